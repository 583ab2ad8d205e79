//! A target connection's replies on their way out: written with vectored
//! writes as far as the socket takes them, READ payloads straight from
//! region memory under the lease each holds until it is sent.

use super::super::frame::{FrameHeader, FRAME_HEADER_BYTES};
use super::staging::StagingSlot;
use super::{Close, Phase, Receiving, Reply, TargetConn, TargetContext, MAX_IO_SLICES};
use crate::error::Error;
use std::io::{IoSlice, Write};
use zerocopy::{FromBytes, IntoBytes};

impl TargetConn {
    /// Queues a reply header, numbered and signed on a sealed connection
    /// (replies leave in the order queued, and every one leaves).
    pub(super) fn queue_frame(&mut self, mut header: FrameHeader) {
        self.sign(&mut header);
        self.queue(zerocopy::IntoBytes::as_bytes(&header));
    }

    /// Numbers and signs a reply header on a sealed connection; replies
    /// leave in the order signed.
    pub(super) fn sign(&mut self, header: &mut FrameHeader) {
        if let Some(seal) = &mut self.seal {
            header.seal(seal);
        }
    }

    pub(super) fn queue(&mut self, bytes: &[u8]) {
        let mut head = [0u8; FRAME_HEADER_BYTES];
        head[..bytes.len()].copy_from_slice(bytes);
        self.replies.push_back(Reply {
            head,
            head_len: bytes.len(),
            payload: std::ptr::null(),
            payload_len: 0,
            lease: None,
            gate: None,
            group: None,
        });
    }

    /// Writes queued replies as far as the socket takes them. `Ok(true)`
    /// when anything was written.
    pub(crate) fn on_writable<S: Write>(
        &mut self,
        io: &mut S,
        ctx: &TargetContext,
        stage: &mut StagingSlot,
    ) -> std::result::Result<bool, Close> {
        self.swap_stage(stage);
        let written = self.write_replies(io, ctx);
        self.swap_stage(stage);
        written
    }

    fn write_replies<S: Write>(&mut self, io: &mut S, ctx: &TargetContext) -> std::result::Result<bool, Close> {
        let mut progressed = false;
        loop {
            let ready = self.open_gates();
            // The send deadline runs while a staged READ answer is ready to
            // go, wherever it is in the queue (plain answers in front of it
            // must not shield its pages), and the peer takes nothing: every
            // write restarts it.
            if self.replies.iter().take(ready).any(|reply| reply.group.is_some()) {
                self.staged_front_since.get_or_insert_with(std::time::Instant::now);
            } else {
                self.staged_front_since = None;
            }
            if ready == 0 {
                return Ok(progressed);
            }
            let mut slices = [IoSlice::new(&[]); MAX_IO_SLICES];
            let mut count = 0;
            let mut skip = self.front_sent;
            for reply in self.replies.iter().take(ready) {
                if count + 2 > MAX_IO_SLICES {
                    break;
                }
                let head = &reply.head[..reply.head_len];
                let payload: &[u8] = if reply.payload_len == 0 {
                    &[]
                } else {
                    // SAFETY: a READ reply's payload is a checked range of a
                    // region this connection holds a lease on until it is sent.
                    unsafe { std::slice::from_raw_parts(reply.payload, reply.payload_len) }
                };
                for part in [head, payload] {
                    if skip >= part.len() {
                        skip -= part.len();
                        continue;
                    }
                    slices[count] = IoSlice::new(&part[skip..]);
                    skip = 0;
                    count += 1;
                }
            }
            let mut written = match io.write_vectored(&slices[..count]) {
                Ok(0) => return Err(Close::PeerGone),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(progressed),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return Err(Close::PeerGone),
            };
            progressed = true;
            // The peer takes its answers: the send deadline starts again.
            self.staged_front_since = None;
            while written > 0 {
                let Some(front) = self.replies.front() else { break };
                let left = front.total() - self.front_sent;
                if written < left {
                    self.front_sent += written;
                    break;
                }
                written -= left;
                self.front_sent = 0;
                self.staged_front_since = None;
                if let Some(done) = self.replies.pop_front() {
                    if let Some(region) = done.lease {
                        // SAFETY: `check_block` kept this lease for this frame; it is given back once, here.
                        unsafe { ctx.registry.release_kept(region) };
                    }
                    if let Some(group) = done.group {
                        self.reply_sent(ctx, group);
                    }
                }
            }
        }
    }

    /// Replies at the front that may go now: each waiting on a staging copy
    /// goes once it ended (as a failure when it failed). Returns how many.
    fn open_gates(&mut self) -> usize {
        for index in 0..self.replies.len() {
            let Some(groups) = self.replies[index].gate else { continue };
            let failure = match self.gate(groups) {
                None => return index,
                Some(Ok(())) => None,
                Some(Err(reason)) => Some(Error::Gpu { device: "staging".into(), reason }),
            };
            let reply = &mut self.replies[index];
            reply.gate = None;
            if let Some(error) = failure {
                // The bytes never reached (or left) the GPU: say so, send no
                // payload (its pages and lease go back as it is popped).
                if let Ok(mut head) = FrameHeader::read_from_bytes(&reply.head[..FRAME_HEADER_BYTES]) {
                    head.status = -(error.code() as i32);
                    head.len = 0;
                    // Unsent yet: signed again under the number it has.
                    if let Some(seal) = &self.seal {
                        head.reseal(seal);
                    }
                    reply.head.copy_from_slice(head.as_bytes());
                }
                reply.payload_len = 0;
            }
        }
        self.replies.len()
    }

    /// Gives back every lease the connection holds (it is being closed);
    /// staging copies still running are left to the lane to settle.
    pub(crate) fn release(&mut self, ctx: &TargetContext, stage: &mut StagingSlot) {
        self.swap_stage(stage);
        self.release_staging(ctx);
        self.swap_stage(stage);
        if let Receiving::Payload { region, .. } = self.receiving {
            // SAFETY: `check_block` kept this lease for this frame; it is given back once, here.
            unsafe { ctx.registry.release_kept(region) };
        }
        self.receiving = Receiving::Header;
        for reply in self.replies.drain(..) {
            if let Some(region) = reply.lease {
                // SAFETY: `check_block` kept this lease for this frame; it is given back once, here.
                unsafe { ctx.registry.release_kept(region) };
            }
        }
        self.phase = Phase::Closing;
    }
}
