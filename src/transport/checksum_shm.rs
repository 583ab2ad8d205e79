//! shm's side of end-to-end checksums: the peer's landed bytes read back
//! through this process's mapping of its region, entered (its owner cannot
//! finish unregistering it while they are read).

use super::checksum::{flip_first_byte, BlockSums, Crc32c};
use super::cuda_ipc::RemoteAt;
use super::shm::{overlap, prefetch_for_write, ShmLink};
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

/// Bytes of a block summed, copied and read back at a time
/// ([`copy_summed`]). Measured on this machine (AMD EPYC, Zen 4, glibc's
/// AVX-512 `memmove`), 64 KiB and 1 MiB blocks from a 128 MiB region, the
/// three steps over 2 KiB pieces moved 1.04-1.34x as fast as the plain
/// 8 KiB-piece copy (`shm::copy_pieces`), over 8 KiB pieces 0.65-0.80x,
/// over 4 KiB 0.98-1.17x, over 1 KiB 0.78-0.91x (medians of 20 interleaved
/// rounds, four runs at load average 9). A 2 KiB piece is copied from the
/// L1 cache by `memmove`'s vector loop, where 8 KiB goes to `rep movsb`,
/// and the source's CRC pass has already pulled it in; the same 2 KiB
/// pieces without the CRC pass copied at half the speed, so the plain
/// copy keeps its 8 KiB.
pub(super) const SUMMED_PIECE_BYTES: usize = 2 << 10;

/// Copies one host block between local memory and a peer's mapping, as
/// `copy_host` does, continuing `sums` over it piece by piece
/// ([`SUMMED_PIECE_BYTES`]), each piece in the L1 cache throughout: its
/// destination's lines fetched for writing, its source summed, copied, and
/// its destination read back and summed. So the source is read from memory
/// once and the destination written once, as in a plain copy. `corrupt`
/// (the `testing` feature's hook) flips the first landed byte before it is
/// read back.
///
/// # Safety
///
/// `local` is valid for `len` bytes as [`LaneLink::transfer`] requires,
/// `remote` lies inside a mapping the link holds (entered), and nothing
/// else in this process touches either range during the call.
///
/// [`LaneLink::transfer`]: super::LaneLink::transfer
pub(super) unsafe fn copy_summed(
    op: Opcode,
    (local, remote, len): (*mut u8, *mut u8, usize),
    sums: &mut BlockSums,
    corrupt: bool,
) {
    let (src, dst) = match op {
        Opcode::Write => (local as *const u8, remote),
        Opcode::Read => (remote as *const u8, local),
    };
    if overlap(src, dst, len) {
        // An engine that maps its own region (loopback): the whole source
        // is summed before it moves, since the copy overwrites it.
        // SAFETY: per this function's contract; `copy` is a memmove.
        unsafe {
            sums.sent.update_raw(src, len);
            std::ptr::copy(src, dst, len);
            if corrupt && len > 0 {
                flip_first_byte(dst);
            }
            sums.landed.update_raw(dst, len);
        }
        return;
    }
    let mut done = 0;
    while done < len {
        let n = (len - done).min(SUMMED_PIECE_BYTES);
        let (from, to) = (src.wrapping_add(done), dst.wrapping_add(done));
        prefetch_for_write(to, n);
        // SAFETY: `done + n <= len`, inside both ranges (per this
        // function's contract), which do not overlap (checked above).
        unsafe {
            sums.sent.update_raw(from, n);
            std::ptr::copy_nonoverlapping(from, to, n);
            if corrupt && done == 0 {
                flip_first_byte(to);
            }
            sums.landed.update_raw(to, n);
        }
        done += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::checksum::crc32c_host;

    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 + (i >> 9)) as u8).collect()
    }

    fn crc(bytes: &[u8]) -> u32 {
        // SAFETY: a live slice.
        unsafe { crc32c_host(bytes.as_ptr(), bytes.len()) }
    }

    #[test]
    fn a_summed_copy_moves_the_bytes_and_sums_both_ends() {
        // Pieces and a tail, in both directions; then with the first
        // landed byte corrupted before it is read back.
        let len = 3 * SUMMED_PIECE_BYTES + 1234;
        for (op, corrupt) in
            [(Opcode::Write, false), (Opcode::Read, false), (Opcode::Write, true), (Opcode::Read, true)]
        {
            let (mut local, mut remote) = (pattern(len), vec![0u8; len]);
            if op == Opcode::Read {
                std::mem::swap(&mut local, &mut remote);
            }
            let source = if op == Opcode::Write { local.clone() } else { remote.clone() };
            let mut sums = BlockSums::new();
            let at = (local.as_mut_ptr(), remote.as_mut_ptr(), len);
            // SAFETY: two live, distinct buffers of `len` bytes.
            unsafe { copy_summed(op, at, &mut sums, corrupt) };
            let landed = if op == Opcode::Write { &remote } else { &local };
            assert_eq!(sums.sent.value(), crc(&source), "{op:?}");
            assert_eq!(sums.landed.value(), crc(landed), "{op:?}");
            assert_eq!(landed[1..], source[1..], "{op:?}");
            assert_eq!(landed[0] == source[0], !corrupt, "{op:?}");
            assert_eq!(sums.sent.value() == sums.landed.value(), !corrupt, "{op:?}");
        }
    }

    #[test]
    fn a_summed_copy_between_overlapping_ranges_is_a_memmove_of_the_source_as_it_was() {
        // An engine that maps its own region: the destination starts inside
        // the source, so piece-wise copying forward would copy bytes it had
        // already overwritten.
        let len = 2 * SUMMED_PIECE_BYTES + 77;
        let shift = 1000;
        let mut buffer = pattern(len + shift);
        let source = buffer[..len].to_vec();
        let mut sums = BlockSums::new();
        let base = buffer.as_mut_ptr();
        assert!(overlap(base, base.wrapping_add(shift), len));
        assert!(!overlap(base, base.wrapping_add(len), len));
        // SAFETY: both ranges lie inside `buffer`.
        unsafe { copy_summed(Opcode::Write, (base, base.add(shift), len), &mut sums, false) };
        assert_eq!(&buffer[shift..], &source[..]);
        assert_eq!(sums.sent.value(), crc(&source));
        assert_eq!(sums.landed.value(), crc(&source));
    }
}
