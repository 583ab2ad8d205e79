//! The send window: how much of a connection's work may be on its way at
//! once.
//!
//! A chunk ends only through its ack (WRITE) or its replies (READ), and a
//! cancelled batch can withdraw only the chunks none of whose frames has
//! left; what has left must drain before the batch may end, since those
//! bytes still land at the target (docs/ARCHITECTURE.md, "Cancellation").
//! Without a bound, everything queued left as fast as the socket took it:
//! on loopback the socket buffers of both ends held 8-10 MiB of a 64 MiB
//! batch, and a cancel waited for all of it (34 ms at p99 on this loaded
//! host). So a chunk's frames leave only once the chunk is admitted, and a
//! chunk is admitted while the admitted chunks not yet ended move at most
//! [`MAX_UNACKED_BYTES`] (a chunk larger than that goes alone). Chunk ids
//! grow along the queue, so "admitted" is one id bound (`admit_below`),
//! and the first frame not admitted is found by binary search.

use super::{Awaited, Connection};

/// Most bytes the admitted, unended chunks of one connection move: what a
/// cancel may have to wait for, and the pipeline that keeps a stream busy
/// (two or more 64-block chunks of 16 KiB, each acknowledged as its last
/// frame arrives, while the next is on its way; a 100 Gb/s link with a
/// 50 µs round trip holds 0.6 MiB).
pub const MAX_UNACKED_BYTES: u64 = 2 << 20;

impl Connection {
    /// Admits the next queued chunks while the window has room (always one
    /// when nothing is admitted, however large).
    pub(super) fn admit(&mut self) {
        loop {
            let below = self.admit_below;
            let at = self.out.partition_point(|frame| frame.chunk < below);
            let Some(chunk) = self.out.get(at).map(|frame| frame.chunk) else { return };
            // Awaited entries are in chunk order too.
            let Ok(index) = self.awaiting.binary_search_by_key(&chunk, |a| a.chunk) else {
                // A queued frame always has its chunk awaited; were it not
                // so, holding the frame back would stall the connection.
                self.admit_below = chunk.wrapping_add(1);
                continue;
            };
            let entry = &mut self.awaiting[index];
            if self.unacked_bytes > 0 && self.unacked_bytes + entry.window_bytes > MAX_UNACKED_BYTES {
                return;
            }
            entry.admitted = true;
            self.unacked_bytes += entry.window_bytes;
            self.admit_below = chunk.wrapping_add(1);
        }
    }

    /// Gives `ended`'s share of the window back (it ended, was dropped
    /// unsent, or failed).
    pub(super) fn release_window(&mut self, ended: &Awaited) {
        if ended.admitted {
            self.unacked_bytes = self.unacked_bytes.saturating_sub(ended.window_bytes);
        }
    }

    /// Bytes admitted and not yet ended (tests).
    #[cfg(test)]
    pub(super) fn unacked_bytes(&self) -> u64 {
        self.unacked_bytes
    }
}
