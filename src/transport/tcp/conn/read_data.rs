//! READ replies: each READ_DATA's payload lands in its span's local range.
//! A checksummed span (`FLAG_CHECKSUM` on its READ) is answered with the
//! CRC32C of the bytes the target sent, in the reply's sealed header; the
//! bytes are summed as they land, read back from where they landed while
//! they are still in the cache, and the span counts as moved only when the
//! two agree. Otherwise its chunk fails `Corrupt` naming the block, so its
//! batch is never reported done.

use super::{Connection, FrameOp, Landing, Peer, Receiving};
use crate::error::{code_of_status, Error, Result};
use crate::proto::ErrorCode;
use crate::transport::checksum::{corrupt, flip_first_byte, take_corruption, Crc32c};
use crate::transport::tcp::frame::FrameHeader;
use crate::transport::ChunkEnd;

/// The checksum of the READ payload landing now.
#[derive(Debug, Clone, Copy)]
pub(super) struct ReadSum {
    /// What the target computed over the bytes it sent.
    sent: u32,
    /// Over the bytes landed so far, read back from local memory.
    landed: Crc32c,
    /// The test hook (`corrupt_landing_at`) named this span: its first
    /// byte is flipped once it has landed, before it is summed.
    corrupt_first: bool,
}

impl Connection {
    /// A READ_DATA header for the front chunk: a failure is recorded, a
    /// payload is received into its span (or discarded when the chunk
    /// already failed). A reply (a failure too) naming another region or
    /// offset than its READ, or a payload whose length or checksum does not
    /// match what its READ asked, kills the connection: the target is out
    /// of step.
    pub(super) fn on_read_data(
        &mut self,
        peer: &Peer,
        reply: &FrameHeader,
        finished: &mut Vec<ChunkEnd>,
    ) -> Result<()> {
        let Some(front) = self.awaiting.front_mut() else { return Ok(()) };
        if reply.opcode != FrameOp::ReadData as u8 {
            return Err(peer.gone(format!("{} answered a read with opcode {}", peer.addr, reply.opcode)));
        }
        let span = front.spans[front.next];
        // Every reply, a failure too, is the block its header names: the
        // target echoes each READ's region and offset. Without this check,
        // a peer out of step (or answering in another order) landed block
        // 1's bytes, with their own true CRC32C, in block 0's place, and
        // the batch was done (review 7); or had a failure naming another
        // block taken as this one's, and the stream went on out of step.
        if reply.region != span.region || reply.offset != span.offset {
            return Err(peer.gone(format!(
                "{} answered region {} offset {} for a read of region {} offset {}",
                peer.addr,
                crate::RegionId::from_raw(reply.region),
                reply.offset,
                crate::RegionId::from_raw(span.region),
                span.offset
            )));
        }
        if let Some(status) = reply.failure() {
            front.failure.get_or_insert_with(|| match code_of_status(status) {
                ErrorCode::Unsupported if span.checksum => Error::Unsupported {
                    what: format!(
                        "a checksummed READ of {}'s region {} at offset {}: the target cannot checksum that memory \
                         (GPU memory has no checksum kernel on its copy path yet); read it without checksums",
                        peer.name,
                        crate::RegionId::from_raw(reply.region),
                        reply.offset
                    ),
                },
                _ => peer.refused(reply, front.grant),
            });
            front.next += 1;
            return self.end_front_if_answered(finished);
        }
        if u64::from(reply.len) != span.len {
            return Err(peer.gone(format!("{} sent {} bytes for a {}-byte read", peer.addr, reply.len, span.len)));
        }
        self.read_sum = match (span.checksum, reply.checksum()) {
            (false, None) => None,
            (true, Some(sent)) => Some(ReadSum {
                sent,
                landed: Crc32c::new(),
                corrupt_first: span.len > 0 && take_corruption(span.local_offset),
            }),
            (true, None) => {
                return Err(peer.gone(format!("{} answered a checksummed read without its CRC32C", peer.addr)))
            }
            (false, Some(_)) => {
                return Err(peer.gone(format!("{} sent a CRC32C for a read that asked for none", peer.addr)))
            }
        };
        self.receiving = if front.failure.is_some() {
            Receiving::Discard { left: span.len as usize }
        } else {
            Receiving::Payload(Landing { dest: span.local, left: span.len as usize })
        };
        if span.len == 0 {
            return self.frame_done(finished);
        }
        Ok(())
    }

    /// Continues the landing payload's checksum over `n` bytes at `dest`,
    /// read back from where they landed.
    ///
    /// # Safety
    ///
    /// `dest..dest + n` is part of the landing span's leased local range,
    /// and its bytes have just landed there.
    pub(super) unsafe fn sum_landed(&mut self, dest: *mut u8, n: usize) {
        let Some(sum) = &mut self.read_sum else { return };
        if sum.corrupt_first && n > 0 {
            sum.corrupt_first = false;
            // SAFETY: per this function's contract, `n > 0`.
            unsafe { flip_first_byte(dest) };
        }
        // SAFETY: per this function's contract.
        unsafe { sum.landed.update_raw(dest, n) };
    }

    /// A READ reply's payload is in place (or discarded): a checksummed
    /// span counts as moved only when what landed has the CRC32C sent.
    pub(super) fn frame_done(&mut self, finished: &mut Vec<ChunkEnd>) -> Result<()> {
        self.receiving = Receiving::Header;
        let sum = self.read_sum.take();
        let Some(front) = self.awaiting.front_mut() else { return Ok(()) };
        let span = front.spans[front.next];
        if front.failure.is_none() {
            match sum.map(|s| (s.sent, s.landed.value())) {
                Some((sent, landed)) if sent != landed => {
                    let error = corrupt(span.desc_index, sent, landed, "in this engine's region once read over tcp");
                    front.failure = Some(error);
                }
                _ => front.moved += span.len,
            }
        }
        front.next += 1;
        self.end_front_if_answered(finished)
    }

    pub(super) fn end_front_if_answered(&mut self, finished: &mut Vec<ChunkEnd>) -> Result<()> {
        let Some(front) = self.awaiting.front_mut() else { return Ok(()) };
        if front.next < front.spans.len() {
            return Ok(());
        }
        let result = match front.failure.take() {
            None => Ok(front.moved),
            Some(error) => Err((error, front.moved)),
        };
        self.end_front(result, finished)
    }
}
