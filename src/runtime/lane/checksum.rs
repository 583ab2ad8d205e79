//! End-to-end checksums on one-sided links (shm, cma): the lane computes
//! each block's CRC32C at its source before the copy and at its destination
//! after it, reading the peer's side through the link itself, and fails
//! the chunk with `Corrupt` naming the first block whose two differ. Links
//! whose target verifies (tcp) carry the checksum instead; see
//! docs/CHECKSUMS.md.

use crate::error::Error;
use crate::mem::MemoryKind;
use crate::ring::Opcode;
use crate::transport::checksum::{corrupt, crc32c_host, device_refused, flip_first_byte, take_corruption};
use crate::transport::{Block, LaneLink, Posted, MAX_CHUNK_BLOCKS};

/// Why a checksummed part cannot run on `link`, if it cannot.
pub(super) fn unverifiable(op: Opcode, tag: u32, link: &dyn LaneLink) -> Option<Error> {
    if link.checksums_on_wire(op) && tag != 0 {
        let what = "checksums with an arrival tag over tcp (the frame's field that would carry the checksum carries \
                    the tag): checksum untagged pushes, then notify";
        return Some(Error::Unsupported { what: what.into() });
    }
    if link.verifies_landed() || link.checksums_on_wire(op) {
        return None;
    }
    let what = match op {
        Opcode::Read if link.checksums_on_wire(Opcode::Write) => {
            "checksums on a tcp READ (the target does not send the checksum of what it reads yet): checksum pushes, \
             or read without checksums"
        }
        _ => {
            "checksums on this transport: only shm, cma (the initiator reads both ends) and tcp pushes (the target \
             verifies) check them; rdma, and GPU memory on any transport, are refused rather than moved unchecked"
        }
    };
    Some(Error::Unsupported { what: what.into() })
}

/// Moves `blocks` on a one-sided link, each block's bytes checksummed at
/// both ends: source before the copy, destination after it.
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
    let mut sent = [0u32; MAX_CHUNK_BLOCKS];
    for (sum, block) in sent.iter_mut().zip(blocks) {
        if block.memory != MemoryKind::Host {
            return Posted::Failed((device_refused(), 0));
        }
        *sum = match op {
            // SAFETY: the block's local range is leased and valid for this
            // chunk (our contract); a WRITE only reads it.
            Opcode::Write => unsafe { crc32c_host(block.local, block.desc.len as usize) },
            Opcode::Read => match link.remote_crc32c(op, block) {
                Ok(sum) => sum,
                Err(error) => return Posted::Failed((error, 0)),
            },
        };
    }
    // SAFETY: forwarded from our own contract.
    let moved = match unsafe { link.transfer(op, batch_id, ticket, blocks) } {
        Posted::Done(moved) => moved,
        other => return other,
    };
    for block in blocks.iter().filter(|b| b.desc.len > 0) {
        match op {
            Opcode::Write if take_corruption(block.desc.remote_offset) => link.corrupt_remote(block),
            // SAFETY: the local range is leased for this chunk and this lane
            // alone writes it during a READ.
            Opcode::Read if take_corruption(block.desc.local_offset) => unsafe { flip_first_byte(block.local) },
            _ => {}
        }
    }
    for (&sum, block) in sent.iter().zip(blocks) {
        let landed = match op {
            Opcode::Write => match link.remote_crc32c(op, block) {
                Ok(landed) => landed,
                Err(error) => return Posted::Failed((error, moved)),
            },
            // SAFETY: as above; the copy into it has ended.
            Opcode::Read => unsafe { crc32c_host(block.local, block.desc.len as usize) },
        };
        if landed != sum {
            let where_ = match op {
                Opcode::Write => "in the peer's region once written",
                Opcode::Read => "in this engine's region once read",
            };
            return Posted::Failed((corrupt(block.desc_index, sum, landed, where_), moved));
        }
    }
    Posted::Done(moved)
}
