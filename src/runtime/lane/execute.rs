//! Executing one batch part: its ticket, the validation of every
//! descriptor, and the chunks handed to the lane's link.

use super::super::status::{BatchId, PartEnd};
use super::links::{LinkSlot, Links};
use super::poll::Lane;
use super::MAX_CHUNK_BLOCKS;
use crate::desc::{BlockDesc, RegionId};
use crate::error::{Error, Result, Side};
use crate::mem::{Access, MemoryKind, Registry};
use crate::ring::{Opcode, Sqe};
use crate::segment::PeerSegment;
use crate::transport::{Block, Posted};
use bytemuck::Zeroable;
use std::sync::mpsc;

/// One part (or notification) the lane is executing, from its SQE until
/// every chunk of it has ended.
pub(super) struct Ticket {
    pub ring: usize,
    pub sqe: Sqe,
    /// The link it runs on (arena index), once resolved.
    pub link: Option<u32>,
    /// Chunks handed to the link and not yet ended.
    pub outstanding: u32,
    pub progress: PartProgress,
    pub end: Option<PartEnd<Error>>,
    /// Leases held until the part ends (once any chunk went in flight).
    pub leases: Vec<RegionId>,
    /// Set for a notification: where its result goes.
    pub notify_reply: Option<mpsc::SyncSender<Result<()>>>,
    /// When the lane took the part (engine clock), for the latency histogram.
    pub started_ns: u64,
    /// Set from the moment it names a part (or notification) until it is
    /// ended: what a lane that panicked must still end.
    pub live: bool,
}

impl Ticket {
    pub fn new() -> Self {
        Self {
            ring: 0,
            sqe: Sqe::zeroed(),
            link: None,
            outstanding: 0,
            progress: PartProgress::default(),
            end: None,
            leases: Vec::new(),
            notify_reply: None,
            started_ns: 0,
            live: false,
        }
    }
}

/// Bytes and descriptors a part has moved so far.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct PartProgress {
    pub bytes: u64,
    pub executed: u64,
}

impl Lane {
    /// Executes one SQE: validates its descriptors run by run and hands
    /// them to the segment's link in chunks; ends the part now, or when its
    /// last chunk in flight ends.
    pub(super) fn execute_part(&mut self, ring_index: usize, sqe: Sqe) {
        if self.rings[ring_index].is_none() {
            return;
        }
        // `poll_rings` pops an SQE only with a ticket free.
        let Some(ticket_index) = self.free_tickets.pop() else {
            debug_assert!(false, "an SQE was taken with no ticket free");
            return;
        };
        let link = self.link_of(&sqe);
        self.count_in_flight();
        if sqe.deadline_ns != 0 {
            self.next_expiry_ns = self.next_expiry_ns.min(sqe.deadline_ns);
        }
        let op = Opcode::from_u8(sqe.opcode);
        let first_end = self.refusal(&sqe, link, op);
        let Lane { registry, rings, config, chunk, ended_runs, tickets, links, .. } = self;
        let Some(slot) = rings[ring_index].as_mut() else { unreachable!("checked above") };
        slot.tickets += 1;
        let ring = &mut slot.rings;
        let ticket = &mut tickets[ticket_index as usize];
        (ticket.ring, ticket.sqe, ticket.link) = (ring_index, sqe, link);
        ticket.started_ns =
            if config.metrics.load(std::sync::atomic::Ordering::Relaxed) { config.clock.now_ns() } else { 0 };
        ticket.progress = PartProgress::default();
        ticket.leases.clear();
        ticket.end = first_end;
        (ticket.notify_reply, ticket.live) = (None, true);
        let id = BatchId::from_raw(sqe.batch_id);
        chunk.clear();
        ended_runs.clear();
        let max_chunk = link.map_or(1, |l| links.get(l).link.max_chunk().clamp(1, MAX_CHUNK_BLOCKS));
        let moves_device_memory = link.is_some_and(|l| links.get(l).link.moves_device_memory());
        let checksummed = sqe.flags & crate::ring::SQE_FLAG_CHECKSUM != 0;
        let verify = checksummed && link.is_some_and(|l| links.get(l).link.verifies_landed());
        let (tag, grant, wire_checksum) = (sqe.arrival_tag, sqe.grant, checksummed && !verify);
        let mut post = Poster {
            ticket_index,
            id,
            max_chunk,
            moves_device_memory,
            tag,
            verify,
            wire_checksum,
            grant,
            split_extra: 0,
            registry,
            chunk,
            ended_runs,
            links,
        };
        // Every descriptor of the part is consumed from the arena, executed
        // or not, so the next batch never waits behind a failed one; leases
        // are released run by run exactly as the submitter took them, but
        // only once the chunk using them has ended.
        let descs = ring.descs.read_chunk(sqe.desc_count as usize);
        debug_assert_eq!(descs.len(), sqe.desc_count as usize, "descriptors are published before their SQE");
        let mut run: Option<RegionId> = None;
        for (offset, desc) in descs.enumerate() {
            if run != Some(desc.local_region) {
                if let Some(region) = run {
                    post.ended_runs.push(region);
                }
                run = Some(desc.local_region);
            }
            let (Some(link), Some(op), None) = (link, op, &ticket.end) else { continue };
            if post.chunk.is_empty() {
                if ring.status.cancel_requested(id) {
                    ticket.end = Some(PartEnd::Cancelled);
                    continue;
                }
                if sqe.deadline_ns != 0 && config.clock.now_ns() > sqe.deadline_ns {
                    ticket.end = Some(PartEnd::TimedOut);
                    continue;
                }
            }
            post.add(ticket, link, op, desc, sqe.desc_base + offset as u32);
        }
        if let (Some(link), Some(op), None) = (link, op, &ticket.end) {
            post.flush(ticket, link, op);
        }
        ticket.progress.executed = ticket.progress.executed.saturating_sub(post.split_extra);
        post.chunk.clear();
        for region in post.ended_runs.drain(..).chain(run) {
            if ticket.outstanding > 0 {
                ticket.leases.push(region);
            } else {
                // SAFETY: the submitter kept this run's lease for this part; the part
                // has no chunk in flight, and the lease is given back once, here.
                unsafe { post.registry.release_kept(region) };
            }
        }
        #[cfg(feature = "testing")]
        if self.shared.panic_next_part.swap(false, std::sync::atomic::Ordering::AcqRel) {
            panic!("injected by a test: lane {} panics while it holds batch {:#x}", self.config.index, sqe.batch_id);
        }
        if self.tickets[ticket_index as usize].outstanding == 0 {
            self.end_ticket(ticket_index as usize);
        }
    }

    /// The arena index of the SQE's link, if the lane has it.
    fn link_of(&mut self, sqe: &Sqe) -> Option<u32> {
        self.links.find(sqe.segment).or_else(|| {
            // A segment's attach command is pushed before any SQE naming it,
            // but the lane may have drained its commands just before both
            // arrived: drain again before calling the key unknown.
            self.take_commands();
            self.links.find(sqe.segment)
        })
    }

    /// Why the part must end before a block moves, if it must: an unknown
    /// segment or opcode, a stale peer, a tag its link cannot carry.
    fn refusal(&self, sqe: &Sqe, link: Option<u32>, op: Option<Opcode>) -> Option<PartEnd<Error>> {
        match (link, op) {
            (None, _) => Some(PartEnd::Failed(Error::UnknownSegment { segment: format!("key {:#x}", sqe.segment) })),
            (_, None) => Some(PartEnd::Failed(Error::UnknownOpcode { opcode: sqe.opcode })),
            (Some(link), Some(op)) => stale_end(&self.links.get(link).peer)
                .or_else(|| untaggable(sqe.arrival_tag, op, &*self.links.get(link).link).map(PartEnd::Failed))
                .or_else(|| {
                    let checksummed = sqe.flags & crate::ring::SQE_FLAG_CHECKSUM != 0;
                    let link = &*self.links.get(link).link;
                    checksummed
                        .then(|| super::checksum::unverifiable(op, sqe.arrival_tag, link))
                        .flatten()
                        .map(PartEnd::Failed)
                })
                .or_else(|| ungranted(sqe.grant, op, &*self.links.get(link).link).map(PartEnd::Failed)),
        }
    }

    /// Raises the peak-in-flight counter when the tickets in use exceed it.
    fn count_in_flight(&mut self) {
        let in_use = (self.tickets.len() - self.free_tickets.len()) as u64;
        if in_use > self.peak_in_flight {
            self.peak_in_flight = in_use;
            self.shared.metrics.peak_in_flight(in_use);
        }
    }

    /// Queues a notification on `key`'s link, after what this lane queued
    /// there; its result goes to `reply` when it ends like a chunk.
    pub(super) fn post_notification(&mut self, key: u32, payload: Vec<u8>, reply: mpsc::SyncSender<Result<()>>) {
        let Some(link) = self.links.find(key) else {
            let _ = reply.send(Err(Error::UnknownSegment { segment: format!("key {key:#x}") }));
            return;
        };
        let Some(index) = self.free_tickets.pop() else {
            let _ = reply.send(Err(Error::Busy { queue: "lane tickets", capacity: self.tickets.len() }));
            return;
        };
        let slot = self.links.get_mut(link);
        match slot.link.post_notification(index as u64, payload) {
            Ok(()) => {
                let ticket = &mut self.tickets[index as usize];
                ticket.outstanding = 1;
                ticket.notify_reply = Some(reply);
                ticket.live = true;
                ticket.link = Some(link);
                self.links.chunk_started(link);
            }
            Err(error) => {
                if matches!(error, Error::PeerRestarted { .. }) {
                    slot.peer.mark_stale();
                }
                let _ = reply.send(Err(error));
                self.free_tickets.push(index);
            }
        }
    }
}

/// A part to a peer already found gone fails at once.
fn stale_end(peer: &PeerSegment) -> Option<PartEnd<Error>> {
    peer.is_stale().then(|| {
        PartEnd::Failed(Error::PeerRestarted {
            segment: peer.descriptor().name.clone(),
            detail: "an earlier batch found it gone".into(),
        })
    })
}

/// Hands a part's validated blocks to its link, chunk by chunk.
struct Poster<'a> {
    ticket_index: u32,
    id: BatchId,
    /// Most blocks the link takes at once.
    max_chunk: usize,
    /// Whether the link may be handed GPU memory.
    moves_device_memory: bool,
    /// The part's arrival tag, stamped on each block.
    tag: u32,
    /// Checksummed, verified by this lane (a one-sided link).
    verify: bool,
    /// Checksummed, verified by the target (stamped on each block).
    wire_checksum: bool,
    /// The part's grant, stamped on each block.
    grant: u32,
    /// Pieces beyond the first of blocks cut by [`Poster::add_staged`]
    /// (executed counts descriptors, not pieces).
    split_extra: u64,
    registry: &'a Registry,
    chunk: &'a mut Vec<Block>,
    ended_runs: &'a mut Vec<RegionId>,
    links: &'a mut Links,
}

impl Poster<'_> {
    /// Validates one descriptor into the chunk, flushing the chunk when it
    /// is full; a bad descriptor ends the part (blocks validated before it
    /// still move, as they would have one by one).
    fn add(&mut self, ticket: &mut Ticket, link: u32, op: Opcode, desc: BlockDesc, desc_index: u32) {
        let peer = &self.links.get(link).peer;
        let (local, memory) = match validate(self.registry, peer, &desc, desc_index, op, self.moves_device_memory) {
            Ok(found) => found,
            Err(error) => {
                self.flush(ticket, link, op);
                ticket.progress.executed += 1;
                ticket.end.get_or_insert(PartEnd::Failed(error));
                return;
            }
        };
        let (tag, checksum, grant) = (self.tag, self.wire_checksum, self.grant);
        let block = Block { local, memory, desc, desc_index, tag, checksum, grant };
        if memory == MemoryKind::Host {
            self.chunk.push(block);
        } else {
            self.add_staged(ticket, link, op, block);
        }
        if self.chunk.len() >= self.max_chunk {
            self.flush(ticket, link, op);
        }
    }

    /// Adds a block of local GPU memory, keeping each chunk's GPU bytes
    /// within what the link stages at once: the chunk is cut there, and a
    /// larger block is cut into pieces (each counted as the block when it
    /// is executed).
    fn add_staged(&mut self, ticket: &mut Ticket, link: u32, op: Opcode, block: Block) {
        let cap = self.links.get(link).link.max_staged_chunk_bytes().max(1);
        let mut done = 0;
        while done < block.desc.len {
            let staged: u64 = self.chunk.iter().filter(|b| b.memory != MemoryKind::Host).map(|b| b.desc.len).sum();
            if staged >= cap {
                self.flush(ticket, link, op);
                if ticket.end.is_some() {
                    return;
                }
                continue;
            }
            let len = (block.desc.len - done).min(cap - staged);
            let mut piece = block;
            piece.local = block.local.wrapping_add(done as usize);
            piece.desc.local_offset += done;
            piece.desc.remote_offset += done;
            piece.desc.len = len;
            self.chunk.push(piece);
            self.split_extra += u64::from(done > 0);
            done += len;
        }
    }

    /// Transfers the chunk; releases the leases of the runs that ended in it
    /// once it has ended (now, or when the part ends if any chunk of it is
    /// in flight).
    fn flush(&mut self, ticket: &mut Ticket, link: u32, op: Opcode) {
        if self.chunk.is_empty() {
            return;
        }
        let slot: &mut LinkSlot = self.links.get_mut(link);
        let (id, ticket_index) = (self.id.raw(), self.ticket_index as u64);
        let posted = match self.verify {
            // SAFETY: as below; `verify` is set only for links that verify landed bytes.
            true => unsafe { super::checksum::transfer_verified(&mut *slot.link, op, id, ticket_index, self.chunk) },
            // SAFETY: every block was validated against a region this part holds a lease on
            // (`validate`); the leases are released only after the chunk ended (below, or in `end_ticket`).
            false => unsafe { slot.link.transfer(op, id, ticket_index, self.chunk) },
        };
        ticket.progress.executed += self.chunk.len() as u64;
        self.chunk.clear();
        match posted {
            Posted::Done(bytes) => ticket.progress.bytes += bytes,
            Posted::Failed((error, bytes)) => {
                ticket.progress.bytes += bytes;
                ticket.end.get_or_insert(PartEnd::Failed(error));
            }
            Posted::InFlight => {
                ticket.outstanding += 1;
                self.links.chunk_started(link);
            }
        }
        if ticket.outstanding > 0 {
            ticket.leases.append(self.ended_runs);
        } else {
            for region in self.ended_runs.drain(..) {
                // SAFETY: the submitter kept this run's lease for this part; the chunk
                // that used it has ended, and the lease is given back once, here.
                unsafe { self.registry.release_kept(region) };
            }
        }
    }
}

/// Checks a descriptor's local range against the leased registry entry and
/// its remote range against the peer's descriptor; returns the local address
/// and where it lives. GPU memory on either side goes only to a link that
/// moves device memory: no other may ever touch it.
#[inline]
fn validate(
    registry: &Registry,
    peer: &PeerSegment,
    desc: &BlockDesc,
    desc_index: u32,
    op: Opcode,
    moves_device_memory: bool,
) -> Result<(*mut u8, MemoryKind)> {
    let (local_needs, remote_needs) = match op {
        Opcode::Read => (Access::LOCAL_WRITE, Access::REMOTE_READ),
        Opcode::Write => (Access::LOCAL_READ, Access::REMOTE_WRITE),
    };
    // SAFETY: the submitter kept a lease on every run's region of this part;
    // this run's lease is given back only after the chunk holding this block
    // has ended (`Poster::flush`, `end_ticket`), long after this borrow.
    let local = unsafe { registry.kept(desc.local_region) }?;
    if local.info.memory != MemoryKind::Host && !moves_device_memory {
        return Err(gpu_memory_unsupported(desc.local_region, Side::Local));
    }
    let local_addr =
        local.check(desc.local_region, Side::Local, desc_index, desc.local_offset, desc.len, local_needs)?;
    let remote = peer.region(desc.remote_region)?;
    if remote.memory != MemoryKind::Host && !moves_device_memory {
        return Err(gpu_memory_unsupported(desc.remote_region, Side::Remote));
    }
    remote.check(desc_index, desc.remote_offset, desc.len, remote_needs)?;
    Ok((local_addr as *mut u8, local.info.memory))
}

/// The error for a GPU region on a link that does not move device memory
/// (a host thread would touch its bytes).
pub(crate) fn gpu_memory_unsupported(region: RegionId, side: Side) -> Error {
    let whose = match side {
        Side::Local => "this engine's",
        Side::Remote => "the peer's",
    };
    Error::Unsupported {
        what: format!(
            "moving GPU memory ({whose} region {region}) over this transport: only cuda_ipc (same host, with a GPU \
             provider) and rdma (GPUDirect) move device memory so far"
        ),
    }
}

/// Why a part with arrival `tag` cannot run as `op` on `link` (a READ, or a
/// link whose target does not count arrivals), if it cannot.
fn untaggable(tag: u32, op: Opcode, link: &dyn crate::transport::LaneLink) -> Option<Error> {
    let what = match (tag, op) {
        (0, _) => return None,
        (_, Opcode::Read) => "an arrival tag on a READ (tags count pushed bytes on the target)",
        (_, Opcode::Write) if link.counts_arrivals() => return None,
        (_, Opcode::Write) => {
            "an arrival tag on a link whose target cannot count it (the target counts them on tcp and rdma, rdma where \
             its NICs have shared receive queues; on one host, push then notify)"
        }
    };
    Some(Error::Unsupported { what: what.into() })
}

/// Why a WRITE part naming `grant` cannot run on `link` (one whose writes
/// are not checked against the destination's fences), if it cannot.
fn ungranted(grant: u32, op: Opcode, link: &dyn crate::transport::LaneLink) -> Option<Error> {
    (grant != 0 && op == Opcode::Write && !link.checks_grants()).then(|| Error::Unsupported {
        what: "a granted write on a link that does not check fences (rdma to an older target, which pushes none; \
               tcp, shm, cma, cuda_ipc and rdma do)"
            .into(),
    })
}
