//! shm's side of end-to-end checksums: the peer's landed bytes read back
//! through this process's mapping of its region, entered (its owner cannot
//! finish unregistering it while they are read).

use super::checksum::{flip_first_byte, Crc32c};
use super::cuda_ipc::RemoteAt;
use super::shm::{overlap, ShmLink, COPY_PIECE_BYTES};
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

/// Continues `sum` over the peer's bytes under `block`'s remote range.
pub(super) fn remote_crc32c(link: &ShmLink, op: Opcode, block: &Block, sum: &mut Crc32c) -> Result<()> {
    let len = block.desc.len as usize;
    // SAFETY: `remote` checked the range lies inside the mapping, which is
    // entered for the call; the peer does not write a block it granted
    // while this engine's part to it is in flight.
    with_remote(link, op, block, |at| unsafe { sum.update_raw(at, len) })
}

/// Corrupts the first landed byte of `block` (the `testing` feature's hook).
pub(super) fn corrupt_remote(link: &ShmLink, block: &Block) {
    if block.desc.len == 0 {
        return;
    }
    // SAFETY: as above; one byte inside the checked, entered range.
    let _ = with_remote(link, Opcode::Write, block, |at| unsafe { flip_first_byte(at) });
}

/// Copies one host block between local memory and a peer's mapping, as
/// `copy_host` does, continuing `sum` over the source's bytes: each piece
/// of [`COPY_PIECE_BYTES`] summed just before it is copied (it stays in the
/// L1 cache from its CRC to its copy), with the
/// destination's lines fetched for writing meanwhile, so the source is read
/// from memory once and both streams overlap, as in a plain copy.
///
/// # Safety
///
/// `local` is valid for `len` bytes as [`LaneLink::transfer`] requires,
/// `remote` lies inside a mapping the link holds (entered), and the source
/// is not written by this process during the call.
///
/// [`LaneLink::transfer`]: super::LaneLink::transfer
pub(super) unsafe fn copy_summed(op: Opcode, local: *mut u8, remote: *mut u8, len: usize, sum: &mut Crc32c) {
    let (src, dst) = match op {
        Opcode::Write => (local as *const u8, remote),
        Opcode::Read => (remote as *const u8, local),
    };
    if overlap(src, dst, len) {
        // An engine that maps its own region (loopback): the whole source
        // is summed before it moves, since the copy overwrites it.
        // SAFETY: per this function's contract; `copy` is a memmove.
        unsafe {
            sum.update_raw(src, len);
            std::ptr::copy(src, dst, len);
        }
        return;
    }
    let mut done = 0;
    while done < len {
        let n = (len - done).min(COPY_PIECE_BYTES);
        prefetch_for_write(dst.wrapping_add(done), n);
        // SAFETY: `done + n <= len`, inside both ranges (per this
        // function's contract), which do not overlap (checked above).
        unsafe {
            sum.update_raw(src.add(done), n);
            std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), n);
        }
        done += n;
    }
}

/// Asks for the cache lines of `len` bytes at `at` in the state for
/// writing (x86-64 `prefetchw`; nothing elsewhere). A hint: it never
/// faults, and a line it misses is fetched by the store as usual.
#[inline]
fn prefetch_for_write(at: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0};
        let mut line = 0;
        while line < len {
            // SAFETY: SSE, which the intrinsic needs, is part of x86-64's
            // baseline; a prefetch reads and writes nothing, and never
            // faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_ET0>(at.wrapping_add(line).cast::<i8>()) };
            line += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, len);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::checksum::crc32c_host;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 + (i >> 9)) as u8).collect()
    }

    #[test]
    fn a_summed_copy_moves_the_bytes_and_sums_the_source_as_it_was() {
        // Pieces and a tail, in both directions.
        let len = 3 * COPY_PIECE_BYTES + 1234;
        for op in [Opcode::Write, Opcode::Read] {
            let (mut local, mut remote) = (pattern(len), vec![0u8; len]);
            if op == Opcode::Read {
                std::mem::swap(&mut local, &mut remote);
            }
            let source = if op == Opcode::Write { local.clone() } else { remote.clone() };
            let mut sum = Crc32c::new();
            // SAFETY: two live, distinct buffers of `len` bytes.
            unsafe { copy_summed(op, local.as_mut_ptr(), remote.as_mut_ptr(), len, &mut sum) };
            let landed = if op == Opcode::Write { &remote } else { &local };
            assert_eq!(landed, &source, "{op:?}");
            // SAFETY: a live slice.
            assert_eq!(sum.value(), unsafe { crc32c_host(source.as_ptr(), len) }, "{op:?}");
        }
    }

    #[test]
    fn a_summed_copy_between_overlapping_ranges_is_a_memmove_of_the_source_as_it_was() {
        // An engine that maps its own region: the destination starts inside
        // the source, so piece-wise copying forward would copy bytes it had
        // already overwritten.
        let len = 2 * COPY_PIECE_BYTES + 77;
        let shift = 1000;
        let mut buffer = pattern(len + shift);
        let source = buffer[..len].to_vec();
        let mut sum = Crc32c::new();
        let base = buffer.as_mut_ptr();
        assert!(overlap(base, base.wrapping_add(shift), len));
        assert!(!overlap(base, base.wrapping_add(len), len));
        // SAFETY: both ranges lie inside `buffer`.
        unsafe { copy_summed(Opcode::Write, base, base.add(shift), len, &mut sum) };
        assert_eq!(&buffer[shift..], &source[..]);
        // SAFETY: a live slice.
        assert_eq!(sum.value(), unsafe { crc32c_host(source.as_ptr(), len) });
    }
}
