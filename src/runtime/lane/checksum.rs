//! End-to-end checksums on one-sided links (shm, cma): the lane computes
//! each block's CRC32C at its source before the copy and at its destination
//! after it, reading the peer's side through the link itself, and fails
//! the chunk with `Corrupt` naming the first block whose two differ. Links
//! that carry the checksum in their frames (tcp: the target verifies a
//! WRITE, the connection a READ's reply) verify it there; see
//! docs/CHECKSUMS.md. rdma verifies a chunk once it completed, off the
//! lane (`transport::rdma::verify`).

use crate::error::Error;
use crate::mem::MemoryKind;
use crate::ring::Opcode;
use crate::transport::checksum::{corrupt, device_refused, BlockSums, VERIFIED_PIECE_BYTES};
use crate::transport::{Block, LaneLink, Posted, MAX_CHUNK_BLOCKS};

/// Why a checksummed part cannot run on `link`, if it cannot.
pub(super) fn unverifiable(op: Opcode, tag: u32, link: &dyn LaneLink) -> Option<Error> {
    if link.checksums_on_wire(op) && tag != 0 {
        let what = "checksums with an arrival tag over tcp (the frame's field that would carry the checksum carries \
                    the tag): checksum untagged pushes, then notify";
        return Some(Error::Unsupported { what: what.into() });
    }
    if link.verifies_completed() && tag != 0 {
        let what = "checksums with an arrival tag over rdma (the target counts a tagged WRITE as arrived when it \
                    lands, before this engine has verified it): checksum untagged pushes, then notify";
        return Some(Error::Unsupported { what: what.into() });
    }
    if link.verifies_landed() || link.checksums_on_wire(op) || link.verifies_completed() {
        return None;
    }
    let what = "checksums on this transport: only shm, cma (the initiator reads both ends), tcp (the frames carry \
                each block's CRC32C) and rdma to host memory (the target sums what landed, asked on the control \
                plane) check them; GPU memory on any transport is refused rather than moved unchecked";
    Some(Error::Unsupported { what: what.into() })
}

/// Moves `blocks` on a one-sided link, each block's bytes checksummed at
/// both ends, piece by piece ([`VERIFIED_PIECE_BYTES`]): the source's
/// piece before its copy, the destination's piece after it.
///
/// # Safety
///
/// As [`LaneLink::transfer`]; the link [`LaneLink::verifies_landed`].
pub(super) unsafe fn transfer_verified(
    link: &mut dyn LaneLink,
    op: Opcode,
    batch_id: u64,
    ticket: u64,
    blocks: &[Block],
) -> Posted {
    debug_assert!(blocks.len() <= MAX_CHUNK_BLOCKS);
    let mut moved = 0;
    for block in blocks {
        if block.memory != MemoryKind::Host {
            return Posted::Failed((device_refused(), moved));
        }
        let mut sums = BlockSums::new();
        let mut done = 0;
        loop {
            let mut piece = *block;
            let len = (block.desc.len - done).min(VERIFIED_PIECE_BYTES);
            piece.local = block.local.wrapping_add(done as usize);
            piece.desc.local_offset += done;
            piece.desc.remote_offset += done;
            piece.desc.len = len;
            // SAFETY: forwarded from our own contract; the piece lies inside
            // the block.
            match unsafe { verified_piece(link, op, (batch_id, ticket), &piece, &mut sums) } {
                Ok(bytes) => moved += bytes,
                Err(Posted::Failed((error, bytes))) => return Posted::Failed((error, moved + bytes)),
                Err(other) => return other,
            }
            done += len;
            if done >= block.desc.len {
                break;
            }
        }
        let (sent, landed) = (sums.sent.value(), sums.landed.value());
        if landed != sent {
            let where_ = match op {
                Opcode::Write => "in the peer's region once written",
                Opcode::Read => "in this engine's region once read",
            };
            return Posted::Failed((corrupt(block.desc_index, sent, landed, where_), moved));
        }
    }
    Posted::Done(moved)
}

/// Moves one piece of a block, continuing `sums` over it
/// ([`LaneLink::transfer_summed`]): the bytes moved, or how the piece ended
/// otherwise (failed, with the bytes moved before it failed).
///
/// # Safety
///
/// As [`LaneLink::transfer`], for the one block `piece`.
unsafe fn verified_piece(
    link: &mut dyn LaneLink,
    op: Opcode,
    ids: (u64, u64),
    piece: &Block,
    sums: &mut BlockSums,
) -> Result<u64, Posted> {
    // SAFETY: forwarded from our own contract.
    match unsafe { link.transfer_summed(op, ids, piece, sums) } {
        Posted::Done(moved) => Ok(moved),
        // A link that verifies landed bytes copies before it returns; were
        // one to go async, the piece stays in flight (its leases held).
        other => Err(other),
    }
}
