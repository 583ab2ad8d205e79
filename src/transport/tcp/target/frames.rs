//! A target connection's frames once their header is in: each checked
//! against this engine's own registry (region, rights, bounds, with checked
//! arithmetic) before memory is touched, then a WRITE's payload landing (in
//! the region, or staged for a GPU region), a READ answered, a notification
//! handed to the engine's queue; and the replies that end them.

use super::super::frame::{FrameHeader, FrameOp, FLAG_CHECKSUM, FRAME_HEADER_BYTES};
use super::super::Landing;
use super::fenced::FrameFence;
use super::{staging, Phase, Receiving, Reply, TargetConn, TargetContext};
use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::mem::registry::{access_name, check_range};
use crate::mem::Access;
use crate::notify::{Notification, MAX_NOTIFY_FRAME_BYTES};
use prost::Message;
use std::sync::Arc;
use std::time::Instant;
use zerocopy::IntoBytes;

impl TargetConn {
    /// Serves one frame's header; false when it must wait for staging pages
    /// (the header is left unread).
    pub(super) fn on_frame(&mut self, ctx: &TargetContext, op: FrameOp, now: Instant) -> bool {
        let header = self.current;
        let len = header.len as usize;
        let region = RegionId::from_raw(header.region);
        match op {
            FrameOp::Write => return self.on_write(ctx, now),
            FrameOp::Read => {
                match check_block(ctx, &header, Access::REMOTE_READ)
                    .and_then(|found| read_checksum(ctx, &header, found))
                {
                    Ok((addr, device, sum)) => {
                        let mut reply = FrameHeader::new(
                            FrameOp::ReadData,
                            ctx.epoch,
                            header.batch_id,
                            header.region,
                            header.offset,
                            header.len.into(),
                        );
                        reply.flags = 0;
                        if let Some(sum) = sum {
                            // In the sealed header: the MAC covers it.
                            (reply.flags, reply.status) = (FLAG_CHECKSUM, sum as i32);
                        }
                        self.sign(&mut reply);
                        let (payload, gate) = match device {
                            Some((gpu, ordinal)) if len > 0 => {
                                match self.stage(ctx, &gpu, (staging::Direction::Out, addr as u64, ordinal, len)) {
                                    Some((at, number)) => {
                                        self.read_reply_staged();
                                        (at as *const u8, Some(number))
                                    }
                                    None => return self.wait_for_pages(ctx, &header, false, now),
                                }
                            }
                            _ => (addr as *const u8, None),
                        };
                        let mut head = [0u8; FRAME_HEADER_BYTES];
                        head.copy_from_slice(reply.as_bytes());
                        self.replies.push_back(Reply {
                            head,
                            head_len: FRAME_HEADER_BYTES,
                            payload,
                            payload_len: len,
                            lease: Some(region),
                            gate: gate.map(|n| (n, n)),
                            group: gate,
                        });
                    }
                    Err(error) => self.queue_status(FrameOp::ReadData, &header, &error),
                }
                self.frame_done(now);
            }
            FrameOp::Grant => {
                if let Err(error) = self.on_grant(&header) {
                    self.queue_status(FrameOp::Ack, &header, &error);
                    self.phase = Phase::Closing;
                    return true;
                }
                self.frame_done(now);
            }
            FrameOp::Notify => {
                if len > MAX_NOTIFY_FRAME_BYTES {
                    let error = Error::MessageTooLarge { len: len as u64, max: MAX_NOTIFY_FRAME_BYTES as u64 };
                    self.queue_status(FrameOp::Ack, &header, &error);
                    self.phase = Phase::Closing;
                    return true;
                }
                self.notify.clear();
                self.receiving = Receiving::Notify { left: len };
                if len == 0 {
                    self.receiving = Receiving::Header;
                    self.deliver_notification(ctx, now);
                }
            }
            FrameOp::Ack | FrameOp::ReadData => {
                let error = Error::malformed("frame", format!("{op:?} is a reply, not a request"));
                self.queue_status(FrameOp::Ack, &header, &error);
                self.phase = Phase::Closing;
            }
        }
        true
    }

    /// Serves a WRITE frame's header: checked against the registry and the
    /// destination's fences, its payload then lands (or is staged, or
    /// dropped after a refusal); false when it must wait for staging pages.
    fn on_write(&mut self, ctx: &TargetContext, now: Instant) -> bool {
        let header = self.current;
        let len = header.len as usize;
        let region = RegionId::from_raw(header.region);
        self.header_alone = len >= super::DIRECT_READ_MIN_BYTES;
        let checked = if self.chunk_failure.is_none() {
            match check_block(ctx, &header, Access::REMOTE_WRITE).and_then(|found| self.check_grant(ctx, found)) {
                Ok(found) => Some(found),
                Err(error) => {
                    self.chunk_failure = Some((header, error));
                    None
                }
            }
        } else {
            None
        };
        self.fence = match &checked {
            Some((_, None, fence)) => Some(*fence),
            _ => None,
        };
        self.receiving = match checked {
            Some((addr, Some((gpu, ordinal)), fence)) if len > 0 => {
                match self.stage(ctx, &gpu, (staging::Direction::In, addr as u64, ordinal, len)) {
                    Some((at, _)) => {
                        self.check_before_copy(fence, header);
                        Receiving::Payload { landing: Landing { dest: at, left: len }, region, staged: true }
                    }
                    None => return self.wait_for_pages(ctx, &header, true, now),
                }
            }
            Some((addr, _, _)) => {
                Receiving::Payload { landing: Landing { dest: addr as *mut u8, left: len }, region, staged: false }
            }
            None => Receiving::Discard { left: len },
        };
        if len == 0 {
            if let Receiving::Payload { region, .. } = self.receiving {
                // SAFETY: `check_block` kept this lease for this frame; it is given back once, here.
                unsafe { ctx.registry.release_kept(region) };
            }
            self.receiving = Receiving::Header;
            self.fence = None;
            self.write_frame_ended(ctx, now);
        }
        true
    }

    /// No staging page is free for the frame whose header was just taken:
    /// gives its lease back, leaves the header unread, and copies what this
    /// connection has staged so far (its pages come back when that ends,
    /// so waiting connections always move on). A frame that has waited
    /// [`STAGE_STALL_LIMIT`](staging::STAGE_STALL_LIMIT) is refused `Busy`
    /// instead (its payload read and dropped).
    fn wait_for_pages(&mut self, ctx: &TargetContext, header: &FrameHeader, write: bool, now: Instant) -> bool {
        let region = RegionId::from_raw(header.region);
        // SAFETY: `check_block` kept this lease for this frame; the frame is
        // put back unread (or refused), and the lease is given back once, here.
        unsafe { ctx.registry.release_kept(region) };
        let since = *self.stalled_since.get_or_insert(now);
        if now >= since + staging::STAGE_STALL_LIMIT {
            self.stalled_since = None;
            let error = Error::Busy { queue: "GPU staging pages", capacity: staging::IDENTITY_STAGE_PAGES };
            if write {
                self.chunk_failure.get_or_insert((*header, error));
                self.receiving = Receiving::Discard { left: header.len as usize };
            } else {
                self.queue_status(FrameOp::ReadData, header, &error);
                self.receiving = Receiving::Header;
                self.frame_done(now);
            }
            return true;
        }
        self.start -= FRAME_HEADER_BYTES;
        self.receiving = Receiving::Header;
        self.stalled = true;
        self.issue(ctx, staging::Direction::In);
        self.issue(ctx, staging::Direction::Out);
        false
    }

    /// A WRITE frame's payload is in place (or dropped): the chunk's last
    /// frame gets the ack.
    pub(super) fn write_frame_ended(&mut self, ctx: &TargetContext, now: Instant) {
        let header = self.current;
        self.chunk_open = !header.is_last();
        if header.is_last() {
            // Staged bytes of the chunk go to the GPU now; its ack waits for
            // that copy.
            let last = self.issue(ctx, staging::Direction::In);
            let gate = self.take_chunk_groups(last);
            match self.chunk_failure.take() {
                None => self.queue_frame(FrameHeader::new(FrameOp::Ack, ctx.epoch, header.batch_id, 0, 0, 0)),
                Some((failed, error)) => self.queue_status(FrameOp::Ack, &failed, &error),
            }
            if let Some(reply) = self.replies.back_mut() {
                reply.gate = gate;
            }
        }
        self.frame_done(now);
    }

    pub(super) fn frame_done(&mut self, now: Instant) {
        self.last_active = now;
        self.frame_started = (self.start != self.end || self.chunk_open).then_some(now);
    }

    pub(super) fn deliver_notification(&mut self, ctx: &TargetContext, now: Instant) {
        let header = self.current;
        let delivered = if header.epoch != ctx.epoch {
            Err(Error::PeerRestarted { segment: "this target".into(), detail: "notification for another epoch".into() })
        } else {
            crate::proto::Notification::decode(self.notify.as_slice())
                .map_err(|e| Error::malformed("notification", e.to_string()))
                .and_then(|n| ctx.notifications.deliver(Notification { from: n.from, message: n.message }))
        };
        self.notify.clear();
        match delivered {
            Ok(()) => self.queue_frame(FrameHeader::new(FrameOp::Ack, ctx.epoch, header.batch_id, 0, 0, 0)),
            Err(error) => self.queue_status(FrameOp::Ack, &header, &error),
        }
        self.frame_done(now);
    }

    /// Queues a reply header that reports `error` for the frame `about`.
    pub(super) fn queue_status(&mut self, op: FrameOp, about: &FrameHeader, error: &Error) {
        let mut reply = FrameHeader::new(op, about.epoch, about.batch_id, about.region, about.offset, 0);
        reply.status = -(error.code() as i32);
        self.queue_frame(reply);
    }
}

/// Checks one block against the registry; on success returns its address
/// with its region's lease kept for the frame (whoever ends the frame gives
/// it back with `release_kept`).
fn check_block(
    ctx: &TargetContext,
    header: &FrameHeader,
    needs: Access,
) -> Result<(usize, Option<Device>, FrameFence)> {
    if header.epoch != ctx.epoch {
        return Err(Error::PeerRestarted {
            segment: "this target".into(),
            detail: format!("frame for epoch {:#x}, but the current epoch is {:#x}", header.epoch, ctx.epoch),
        });
    }
    let region = RegionId::from_raw(header.region);
    let lease = ctx.registry.lease(region).map_err(|error| match error {
        // Held alone for a moment (a peer's checksum): the frame may retry.
        busy @ Error::RegionBusy { .. } => busy,
        _ => Error::UnknownRegion { side: Side::Remote, region },
    })?;
    let entry = lease.entry();
    // A GPU region's bytes are staged and copied by its provider: the
    // lane never touches device memory.
    let device = match (&entry.info.memory, &entry.device) {
        (crate::mem::MemoryKind::Host, _) => None,
        (crate::mem::MemoryKind::Gpu(ordinal), Some(backing)) => Some((backing.gpu.clone(), *ordinal)),
        (crate::mem::MemoryKind::Gpu(_), None) => {
            return Err(Error::Unsupported { what: format!("tcp to or from GPU memory (region {region})") })
        }
    };
    if !entry.info.access.contains(needs) {
        return Err(Error::AccessDenied { desc_index: 0, side: Side::Remote, region, needs: access_name(needs) });
    }
    check_range(region, Side::Remote, 0, header.offset, header.len.into(), entry.len as u64)?;
    let addr = entry.addr + header.offset as usize;
    let fence = FrameFence::of(entry, region, 0);
    // The frame's bytes move across polls: the lease goes with the frame.
    lease.keep();
    Ok((addr, device, fence))
}

/// A READ that asks for a checksum ([`FLAG_CHECKSUM`]): the CRC32C of the
/// bytes its reply will carry, computed now from the region (the reply
/// sends them from there, after its header). A GPU region has no checksum
/// here: refused (its lease given back), never sent unchecked.
fn read_checksum(
    ctx: &TargetContext,
    header: &FrameHeader,
    (addr, device, _): (usize, Option<Device>, FrameFence),
) -> Result<(usize, Option<Device>, Option<u32>)> {
    if header.flags & FLAG_CHECKSUM == 0 {
        return Ok((addr, device, None));
    }
    if device.is_some() {
        // SAFETY: `check_block` kept this lease for this frame, which ends here; given back once.
        unsafe { ctx.registry.release_kept(RegionId::from_raw(header.region)) };
        return Err(crate::transport::checksum::device_refused());
    }
    // SAFETY: `check_block` checked `addr..addr + len` against the host
    // region's registered range and keeps it leased (registered, mapped)
    // for this frame; the writev that sends it reads the same bytes.
    let sum = unsafe { crate::transport::checksum::crc32c_host(addr as *const u8, header.len as usize) };
    Ok((addr, device, Some(sum)))
}

/// A GPU region's provider and device.
pub(super) type Device = (Arc<dyn crate::gpu::Gpu>, u32);
