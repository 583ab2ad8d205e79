//! GPU regions served over tcp: bytes staged through the lane's pinned
//! pages, never touched by the lane in device memory.
//!
//! A WRITE frame aimed at a GPU region lands in pages of the lane's pool;
//! the chunk's frames are packed into a group of pages, and one batched copy
//! per group moves them to the device (a group is cut at
//! [`MAX_GROUP_PAGES`], so a chunk of any size stages through a bounded
//! pool). The chunk's ack waits for its last group's copy event: a peer is
//! never told `Done` before its bytes are in device memory. A READ frame
//! from a GPU region is copied into pages (the frames of one read pass
//! share one copy) and answered from them once that copy completed. A frame
//! that finds no page free waits, unread, until a copy ends and frees one.
//!
//! **Quotas.** Pages are counted per peer *identity*, not per connection:
//! with a token, the proven session the connection belongs to (one
//! initiator's handshake, however many connections it opens), without one
//! the connection itself. One identity holds at most
//! [`IDENTITY_STAGE_PAGES`] of its lane's pool. A staged READ answer must
//! be taken by its peer within [`STAGED_SEND_TIMEOUT`] of being ready, or
//! the connection is closed and its pages go back: a peer that asks for
//! staged READs and never reads the answers holds its pages for that long
//! at most. A frame that waited [`STAGE_STALL_LIMIT`] for a page and still
//! finds none is refused `Busy` (the initiator may retry), never left to
//! the initiator's timeout.

use super::{TargetConn, TargetContext};
use crate::desc::RegionId;
use crate::error::Error;
use crate::gpu::{CopyCounters, CopySides, Gpu, Place};
use crate::transport::cuda_ipc::{DeviceCopier, DeviceCopy};
use crate::transport::stage::{StageCounters, StagePool, STAGE_PAGE_BYTES};
use crate::transport::ChunkEnd;
use std::sync::Arc;

/// Pages of a lane's pool for the connections it serves (32 MiB).
pub(crate) const LANE_STAGE_PAGES: usize = 32;
/// Most pages one group (one batched copy) spans.
pub(crate) const MAX_GROUP_PAGES: usize = 8;
/// Most copies one group carries (a peer's tiny scattered frames cost one
/// batched copy per this many).
pub(crate) const MAX_GROUP_COPIES: usize = 256;
/// Most pages one peer identity (a proven session, or a connection without
/// a token) holds at once, over all its connections on the lane: a quarter
/// of the lane's pool, so no peer can hold the pages the others need.
pub(crate) const IDENTITY_STAGE_PAGES: usize = LANE_STAGE_PAGES / 4;
/// Longest a staged READ answer, ready to go, waits for its peer to take
/// it before the connection is closed and its pages go back.
pub(crate) const STAGED_SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);
/// Longest a frame waits for a staging page before it is refused `Busy`.
pub(crate) const STAGE_STALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A lane's staging for its served connections: made at the first frame
/// that needs it, with the provider of that frame's region.
#[derive(Debug, Default)]
pub(crate) struct StagingSlot {
    counters: Arc<CopyCounters>,
    pool_counters: Arc<StageCounters>,
    staging: Option<Staging>,
}

#[derive(Debug)]
struct Staging {
    pool: StagePool,
    copier: DeviceCopier,
    /// Groups whose connection closed while their copy ran: their pages and
    /// leases go back when it ends.
    orphans: Vec<(u64, Group)>,
    ends: Vec<ChunkEnd>,
    /// Pages held now per peer identity (entries at 0 are removed).
    held: std::collections::HashMap<u64, usize>,
}

impl Staging {
    /// Pages `identity` holds on this lane now.
    fn held(&self, identity: u64) -> usize {
        self.held.get(&identity).copied().unwrap_or(0)
    }

    /// Gives `group`'s pages back to the pool, off its owner's count.
    fn give(&mut self, group: &mut Group) {
        if let Some(held) = self.held.get_mut(&group.owner) {
            *held = held.saturating_sub(group.pages.len());
            if *held == 0 {
                self.held.remove(&group.owner);
            }
        }
        self.pool.give(&mut group.pages);
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The lane is stopping.
        self.copier.drain_before_unmap(&mut self.ends, &mut self.pool);
    }
}

impl StagingSlot {
    /// A slot whose copies count their methods in `counters` (the lane's).
    pub fn new(counters: Arc<CopyCounters>, pool_counters: Arc<StageCounters>) -> Self {
        Self { counters, pool_counters, staging: None }
    }

    fn get(&mut self, gpu: &Arc<dyn Gpu>) -> &mut Staging {
        let (counters, pool_counters) = (&self.counters, &self.pool_counters);
        self.staging.get_or_insert_with(|| Staging {
            pool: StagePool::new(gpu.clone(), LANE_STAGE_PAGES, pool_counters.clone()),
            copier: DeviceCopier::new(gpu.clone(), counters.clone()),
            orphans: Vec::new(),
            ends: Vec::new(),
            held: Default::default(),
        })
    }

    /// True while staging copies are running.
    pub fn running(&self) -> bool {
        self.staging.as_ref().is_some_and(|s| s.copier.in_flight() > 0)
    }

    /// True (once) when pages went back since the last call: connections
    /// waiting for pages may go on.
    pub fn take_returned(&mut self) -> bool {
        self.staging.as_mut().is_some_and(|s| s.pool.take_returned())
    }

    /// Polls the copies; calls `done(id, result)` for each that ended (ids
    /// are `connection key << 32 | group`); orphans are settled here.
    pub fn poll(&mut self, ctx: &TargetContext, mut done: impl FnMut(u64, Result<(), Error>, &mut Self)) -> bool {
        let Some(staging) = self.staging.as_mut() else { return false };
        let mut ends = std::mem::take(&mut staging.ends);
        if !staging.copier.poll(&mut ends) {
            staging.ends = ends;
            return false;
        }
        for (id, result) in ends.drain(..) {
            let staging = self.staging.as_mut().expect("made above");
            if let Some(at) = staging.orphans.iter().position(|(orphan, _)| *orphan == id) {
                let (_, mut group) = staging.orphans.swap_remove(at);
                if result.is_err() {
                    // As in `copy_ended`: an unknown end keeps its counts.
                    group.poison_holds();
                }
                group.settle(ctx, staging, false);
                continue;
            }
            done(id, result.map(drop).map_err(|(error, _)| error), self);
        }
        if let Some(staging) = self.staging.as_mut() {
            staging.ends = ends;
        }
        true
    }
}

/// A staged WRITE frame's arrival tag, counted once its group's copy ends:
/// (tag, region, offset, len, the connection's proven sender).
type StagedTag = (u32, u64, u64, u64, Option<Arc<str>>);

/// A staged WRITE frame's fence (its connection's grant stamped on it) and
/// header: checked again when its group's copy is issued.
type StagedCheck = (super::fenced::FrameFence, super::FrameHeader);

/// Pages one batched copy stages through, and what to settle when it ends.
#[derive(Debug, Default)]
pub(super) struct Group {
    /// The connection's number for it (its copy's id is `key << 32 | number`).
    number: u32,
    pages: Vec<u32>,
    /// The peer identity its pages are counted against.
    owner: u64,
    /// Bytes used of the last page.
    used: usize,
    /// Its copies, one per frame, each WRITE's with the fence its frame is
    /// checked under again just before the copy is issued.
    copies: Vec<(DeviceCopy, u64, Option<StagedCheck>)>,
    /// WRITE: the regions its copy writes, leased until it ends.
    leases: Vec<RegionId>,
    /// WRITE: its frames, counted as writers in their regions' fence
    /// tables from just before its copy is issued until it ends (so a
    /// fence meanwhile waits for the copy).
    holds: Vec<crate::mem::fence::Held>,
    /// WRITE: arrival tags to count once its bytes are in place, with
    /// where the bytes went (region, offset, length).
    tags: Vec<StagedTag>,
    /// Set once its copy ended.
    done: Option<Result<(), Error>>,
    /// READ: replies still to be sent from its pages.
    replies: u32,
    issued: bool,
}

impl Group {
    /// Its copy's end is unknown: its fence counts are never released
    /// (`Held::poison`).
    fn poison_holds(&mut self) {
        for held in self.holds.drain(..) {
            // SAFETY: taken under a lease in `leases`, still kept here.
            unsafe { held.poison() };
        }
    }

    /// Gives back the pages and leases; lands the tags when `landed`.
    fn settle(&mut self, ctx: &TargetContext, staging: &mut Staging, landed: bool) {
        staging.give(self);
        // Counted landed before a fence can return: once it has, every
        // byte it waited for is in place and counted.
        for (tag, region, offset, len, sender) in self.tags.drain(..) {
            if landed {
                ctx.arrivals.land_at(tag, region, offset, len, sender.as_deref());
            }
        }
        for held in self.holds.drain(..) {
            // SAFETY: taken under a lease in `leases`, still kept here.
            unsafe { held.release() };
        }
        for region in self.leases.drain(..) {
            // SAFETY: `check_block` kept this lease for the frame whose bytes
            // this group's copy wrote; the copy ended, and it is given back
            // once, here.
            unsafe { ctx.registry.release_kept(region) };
        }
    }
}

/// Which group a frame stages into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Direction {
    /// Into the device (WRITE).
    In,
    /// Out of the device (READ).
    Out,
}

impl TargetConn {
    /// The connection's key for its copies' ids (unique in its lane).
    pub(crate) fn set_stage_key(&mut self, key: u32) {
        self.stage_key = key;
    }

    /// True while a frame waits for staging pages.
    pub(crate) fn stalled(&self) -> bool {
        self.stalled
    }

    /// Pages may be free again: the waiting frame tries again.
    pub(crate) fn unstall(&mut self) {
        self.stalled = false;
    }

    /// Counts this connection's pages against `identity` (its proven
    /// session) from now on, instead of against the connection alone.
    pub(crate) fn set_stage_identity(&mut self, identity: u64) {
        self.stage_identity = Some(identity);
    }

    /// The identity this connection's pages count against.
    fn identity(&self) -> u64 {
        // Without a proven session: the connection alone (its key is unique
        // in its lane; the top bit keeps it apart from session identities).
        self.stage_identity.unwrap_or(1 << 63 | u64::from(self.stage_key))
    }

    /// Places `len` bytes of a frame for device `ordinal` at `device_at` in
    /// the group of `direction`: the host address they stage at and the
    /// group's number, or `None` when this connection may take no more pages
    /// now (its quota, or the lane's pool, is spent: the frame waits).
    pub(super) fn stage(
        &mut self,
        ctx: &TargetContext,
        gpu: &Arc<dyn Gpu>,
        (direction, device_at, ordinal, len): (Direction, u64, u32, usize),
    ) -> Option<(*mut u8, u32)> {
        let group = self.group(direction);
        let fits = !group.pages.is_empty() && group.used + len <= STAGE_PAGE_BYTES;
        let same_device = group.copies.last().is_none_or(|(copy, _, _)| copy.device == ordinal);
        if (!fits && group.pages.len() == MAX_GROUP_PAGES) || group.copies.len() >= MAX_GROUP_COPIES || !same_device {
            // Full, or on another GPU's stream: copy what it holds first.
            self.issue(ctx, direction);
        }
        let fits = fits && !self.group(direction).pages.is_empty();
        let identity = self.identity();
        if !fits && self.stage.get(gpu).held(identity) >= IDENTITY_STAGE_PAGES {
            self.stalled = true;
            return None;
        }
        if self.group(direction).number == 0 {
            self.next_group = self.next_group.wrapping_add(1).max(1);
            let number = self.next_group;
            self.group(direction).number = number;
            if direction == Direction::In {
                self.chunk_groups.get_or_insert(number);
            }
        }
        let staging = self.stage.get(gpu);
        let group = match direction {
            Direction::In => &mut self.write_group,
            Direction::Out => &mut self.read_group,
        };
        if !fits {
            if !matches!(staging.pool.take(1, &mut group.pages), Ok(true)) {
                self.stalled = true;
                return None;
            }
            *staging.held.entry(identity).or_default() += 1;
            group.owner = identity;
            group.used = 0;
        }
        self.stalled_since = None;
        let page = *group.pages.last().expect("a page was taken");
        let at = staging.pool.page(page).wrapping_add(group.used);
        group.used += len;
        let (src, dst) = match direction {
            Direction::In => ((at as u64, Place::Host), (device_at, Place::Device(ordinal))),
            Direction::Out => ((device_at, Place::Device(ordinal)), (at as u64, Place::Host)),
        };
        let sides = CopySides { src: src.1, dst: dst.1 };
        group.copies.push((DeviceCopy { src: src.0, dst: dst.0, sides, device: ordinal }, len as u64, None));
        Some((at, group.number))
    }

    fn group(&mut self, direction: Direction) -> &mut Group {
        match direction {
            Direction::In => &mut self.write_group,
            Direction::Out => &mut self.read_group,
        }
    }

    /// Issues the group of `direction` as one batched copy (when it holds
    /// any); returns its number, or `None` when there was nothing to copy.
    pub(super) fn issue(&mut self, ctx: &TargetContext, direction: Direction) -> Option<u32> {
        if self.group(direction).copies.is_empty() {
            return None;
        }
        let gpu = self.stage.staging.as_ref()?.pool.gpu().clone();
        let mut group = std::mem::take(self.group(direction));
        let id = (u64::from(self.stage_key) << 32) | u64::from(group.number);
        let staging = self.stage.get(&gpu);
        let mut issued = 0;
        for (copy, len, check) in std::mem::take(&mut group.copies) {
            if let Some((fence, header)) = check {
                // Checked again now, under a pass kept until the copy ended:
                // a fence since its header refuses it here (nothing of it
                // lands), and a fence from now on waits for the copy, which
                // runs for a bounded time (never for a sender's pace).
                // SAFETY: the frame's lease is kept until its group settles
                // (in `group.leases`, or still the current frame's).
                match unsafe { fence.admit(header.offset, header.len.into()) } {
                    Ok(pass) => group.holds.push(pass.detach()),
                    Err(error) => {
                        let (region, offset, len) = (header.region, header.offset, u64::from(header.len));
                        group.tags.retain(|t| (t.1, t.2, t.3) != (region, offset, len));
                        self.chunk_failure.get_or_insert((header, error));
                        continue;
                    }
                }
            }
            staging.copier.add(copy, len);
            issued += 1;
        }
        if issued == 0 {
            // Every frame was fenced out: no copy, no failed group (the
            // chunk's ack says FENCED); pages and leases go back now.
            group.settle(ctx, staging, false);
            return None;
        }
        // The device ends are checked ranges of regions leased for the
        // frames (WRITE: in `group.leases`; READ: by their replies, sent
        // only once the copy ended).
        // SAFETY: the host ends are the group's pool pages, held until its copy ends; the device ends above.
        if let Err(error) = unsafe { staging.copier.issue(id, 0, None) } {
            // Never started: nothing reads its pages, so they go back now
            // (READ replies still hold theirs until they are sent, as
            // failures); the group stays as the failure its gate reports.
            group.done = Some(Err(error));
            if group.replies == 0 {
                group.settle(ctx, staging, false);
            }
        }
        group.issued = true;
        let number = group.number;
        self.groups.push(group);
        Some(number)
    }

    /// The WRITE frame `header` just staged (the write group's last copy)
    /// is checked under `fence` again just before its copy is issued.
    pub(super) fn check_before_copy(&mut self, fence: super::fenced::FrameFence, header: super::FrameHeader) {
        if let Some(last) = self.write_group.copies.last_mut() {
            last.2 = Some((fence, header));
        }
    }

    /// A WRITE frame's payload is in its staged page: its region stays
    /// leased and its tag waits until the group's copy ends.
    pub(super) fn staged_payload_landed(&mut self, region: RegionId) {
        self.write_group.leases.push(region);
        if let Some(tag) = self.current.arrival_tag() {
            let current = &self.current;
            self.write_group.tags.push((tag, current.region, current.offset, current.len.into(), self.sender.clone()));
        }
    }

    /// The groups of the WRITE chunk now ending, first to last (its ack's
    /// gate); the next chunk starts its own.
    pub(super) fn take_chunk_groups(&mut self, last: Option<u32>) -> Option<(u32, u32)> {
        // Groups issued earlier in the chunk (a full group, the end of a
        // read pass) count as much as the one issued at its last frame.
        let first = self.chunk_groups.take()?;
        Some((first, last.unwrap_or(self.next_group)))
    }

    /// Copy `id` (of this connection) ended.
    pub(crate) fn copy_ended(
        &mut self,
        ctx: &TargetContext,
        id: u64,
        result: Result<(), Error>,
        slot: &mut StagingSlot,
    ) {
        let number = id as u32;
        let Some(at) = self.groups.iter().position(|g| g.number == number) else { return };
        let Some(staging) = slot.staging.as_mut() else { return };
        let group = &mut self.groups[at];
        let landed = result.is_ok();
        if !landed {
            // Its event's query failed (or the lane stopped with it in
            // flight): whether the copy still runs is unknown, so its fence
            // counts stay (a `Held` dropped unreleased stays counted): the
            // region's fences fail `RegionBusy` rather than return while a
            // stale copy may still land.
            group.poison_holds();
        }
        group.done = Some(result);
        if group.replies == 0 {
            group.settle(ctx, staging, landed);
            if landed {
                // Done: its absence is what an ack gate reads as success.
                self.groups.swap_remove(at);
            }
        } else {
            // READ replies still read its pages; leases are theirs.
            group.tags.clear();
        }
    }

    /// Whether a reply gated on groups `first..=last` may go: `Some(Ok)`
    /// yes, `Some(Err)` as a failure, `None` not yet. Failed groups it
    /// covered are forgotten once it goes.
    pub(super) fn gate(&mut self, (first, last): (u32, u32)) -> Option<Result<(), String>> {
        let covered = |g: &Group| (first..=last).contains(&g.number) && g.replies == 0;
        let mut failure = None;
        for group in self.groups.iter().filter(|g| covered(g) || g.number == last) {
            match &group.done {
                None => return None,
                Some(Err(error)) => failure = failure.or_else(|| Some(error.to_string())),
                Some(Ok(())) => {}
            }
        }
        // Failed WRITE groups are markers kept for this gate: drop them.
        self.groups.retain(|g| !(covered(g) && g.done.is_some() && g.pages.is_empty() && g.leases.is_empty()));
        Some(failure.map_or(Ok(()), Err))
    }

    /// A reply read from group `number`'s pages is sent: the last one gives
    /// the pages back.
    pub(super) fn reply_sent(&mut self, ctx: &TargetContext, number: u32) {
        let Some(at) = self.groups.iter().position(|g| g.number == number) else { return };
        let group = &mut self.groups[at];
        group.replies = group.replies.saturating_sub(1);
        if group.replies == 0 && group.done.is_some() {
            let mut group = self.groups.swap_remove(at);
            if let Some(staging) = self.stage.staging.as_mut() {
                group.settle(ctx, staging, true);
            }
        }
    }

    /// Counts a READ reply that will be sent from the read group's pages.
    pub(super) fn read_reply_staged(&mut self) {
        self.read_group.replies += 1;
    }

    /// Pages came back since the last look (this lane's, any connection's).
    pub(super) fn pages_free(&self) -> bool {
        self.stage.staging.as_ref().is_some_and(|s| s.pool.has_free())
    }

    /// The connection closes: groups not yet issued give back at once; those
    /// whose copy runs are handed to the lane, which settles them when it
    /// ends.
    pub(super) fn release_staging(&mut self, ctx: &TargetContext) {
        let Some(staging) = self.stage.staging.as_mut() else { return };
        for mut group in [std::mem::take(&mut self.write_group), std::mem::take(&mut self.read_group)] {
            group.settle(ctx, staging, false);
        }
        for mut group in self.groups.drain(..) {
            if group.issued && group.done.is_none() {
                let id = (u64::from(self.stage_key) << 32) | u64::from(group.number);
                staging.orphans.push((id, group));
            } else {
                group.settle(ctx, staging, false);
            }
        }
    }

    /// Swaps the lane's staging in (before driving) or out (after).
    pub(crate) fn swap_stage(&mut self, slot: &mut StagingSlot) {
        std::mem::swap(&mut self.stage, slot);
    }
}
