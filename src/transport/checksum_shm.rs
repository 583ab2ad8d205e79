//! shm's side of end-to-end checksums: the peer's landed bytes read back
//! through this process's mapping of its region, entered (its owner cannot
//! finish unregistering it while they are read).

use super::checksum::{crc32c_host, flip_first_byte};
use super::cuda_ipc::RemoteAt;
use super::shm::ShmLink;
use super::Block;
use crate::error::{Error, Result, Side};
use crate::ring::Opcode;

/// The peer's region under `block`, entered, and the address of its range.
fn with_remote<T>(link: &ShmLink, op: Opcode, block: &Block, f: impl FnOnce(*mut u8) -> T) -> Result<T> {
    let region = block.desc.remote_region;
    let Some(mapping) = link.mappings.get(region.index() as usize).and_then(Option::as_ref) else {
        return Err(Error::Unsupported { what: format!("reading back GPU region {region} of a peer") });
    };
    let Some(_entered) = mapping.enter() else {
        return Err(Error::UnknownRegion { side: Side::Remote, region });
    };
    match link.remote(op, &block.desc, block.desc_index)? {
        RemoteAt::Host(at) => Ok(f(at as *mut u8)),
        RemoteAt::Device(..) => Err(Error::Unsupported { what: format!("reading back GPU region {region} of a peer") }),
    }
}

/// CRC32C of the peer's bytes under `block`'s remote range.
pub(super) fn remote_crc32c(link: &ShmLink, op: Opcode, block: &Block) -> Result<u32> {
    let len = block.desc.len as usize;
    // SAFETY: `remote` checked the range lies inside the mapping, which is
    // entered for the call; the peer does not write a block it granted
    // while this engine's part to it is in flight.
    with_remote(link, op, block, |at| unsafe { crc32c_host(at, len) })
}

/// Corrupts the first landed byte of `block` (the `testing` feature's hook).
pub(super) fn corrupt_remote(link: &ShmLink, block: &Block) {
    if block.desc.len == 0 {
        return;
    }
    // SAFETY: as above; one byte inside the checked, entered range.
    let _ = with_remote(link, Opcode::Write, block, |at| unsafe { flip_first_byte(at) });
}
