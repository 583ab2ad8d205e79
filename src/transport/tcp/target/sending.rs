//! A target connection's replies on their way out: written with vectored
//! writes as far as the socket takes them, READ payloads straight from
//! region memory under the lease each holds until it is sent.

use super::{Close, Phase, Receiving, TargetConn, TargetContext, MAX_IO_SLICES};
use std::io::{IoSlice, Write};

impl TargetConn {
    /// Writes queued replies as far as the socket takes them. `Ok(true)`
    /// when anything was written.
    pub(crate) fn on_writable<S: Write>(
        &mut self,
        io: &mut S,
        ctx: &TargetContext,
    ) -> std::result::Result<bool, Close> {
        let mut progressed = false;
        while !self.replies.is_empty() {
            let mut slices = [IoSlice::new(&[]); MAX_IO_SLICES];
            let mut count = 0;
            let mut skip = self.front_sent;
            for reply in &self.replies {
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
            while written > 0 {
                let Some(front) = self.replies.front() else { break };
                let left = front.total() - self.front_sent;
                if written < left {
                    self.front_sent += written;
                    break;
                }
                written -= left;
                self.front_sent = 0;
                if let Some(done) = self.replies.pop_front() {
                    if let Some(region) = done.lease {
                        // SAFETY: `check_block` kept this lease for this frame; it is given back once, here.
                        unsafe { ctx.registry.release_kept(region) };
                    }
                }
            }
        }
        Ok(progressed)
    }

    /// Gives back every lease the connection holds (it is being closed).
    pub(crate) fn release(&mut self, ctx: &TargetContext) {
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
