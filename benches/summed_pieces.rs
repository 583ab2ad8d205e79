//! Why shm's checksummed copy goes by 2 KiB pieces
//! (`checksum_shm::SUMMED_PIECE_BYTES`): its loop (each piece's
//! destination lines fetched for writing, the source summed, copied, the
//! destination read back and summed) at several piece sizes, against the
//! plain shm copy (`kvring::host::shm_copy`, 8 KiB pieces), interleaved
//! round by round over blocks of a 128 MiB region on one core.
//!
//! `cargo bench --bench summed_pieces -- [BLOCK_BYTES] [--rounds N]`
//! (`-- --test`: one short round, the CI smoke run). Prints each piece
//! size's median ratio to the plain copy, with the quartiles.

use std::alloc::{alloc, dealloc, Layout};
use std::time::Instant;

#[path = "common/rounds.rs"]
mod rounds;

const REGION: usize = 128 << 20;
const PER_ROUND: usize = 256 << 20;
const PIECES: [usize; 4] = [8 << 10, 4 << 10, 2 << 10, 1 << 10];

/// A page-aligned, touched buffer (a misaligned one halves memcpy here).
struct Buffer(*mut u8, Layout);

impl Buffer {
    fn new(len: usize, seed: u8) -> Self {
        let layout = Layout::from_size_align(len, 4096).expect("layout");
        // SAFETY: a non-zero size.
        let at = unsafe { alloc(layout) };
        assert!(!at.is_null(), "allocating {len} bytes");
        for i in 0..len {
            // SAFETY: inside the allocation.
            unsafe { at.add(i).write((i * 131 + (i >> 9)) as u8 ^ seed) };
        }
        Self(at, layout)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.0, self.1) };
    }
}

fn prefetch_for_write(at: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..len).step_by(64) {
        // SAFETY: a prefetch never faults.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_ET0 }>(at.wrapping_add(line).cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (at, len);
}

/// `checksum_shm::copy_summed`'s loop with `piece`-byte pieces.
fn summed(src: &[u8], dst: &mut [u8], piece: usize) -> (u64, u64) {
    let mut sent = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    let mut landed = sent;
    for (from, to) in src.chunks(piece).zip(dst.chunks_mut(piece)) {
        prefetch_for_write(to.as_ptr(), to.len());
        sent.update(from);
        to.copy_from_slice(from);
        landed.update(to);
    }
    (sent.finalize(), landed.finalize())
}

/// GB/s of `count` blocks of `block` bytes, `way` copying each.
fn round(src: &Buffer, dst: &Buffer, block: usize, way: Option<usize>) -> f64 {
    let blocks = REGION / block;
    let count = PER_ROUND / block;
    let started = Instant::now();
    for i in 0..count {
        let at = (i % blocks) * block;
        // SAFETY: `at + block <= REGION`, inside both distinct buffers.
        let (from, to) = unsafe {
            (std::slice::from_raw_parts(src.0.add(at), block), std::slice::from_raw_parts_mut(dst.0.add(at), block))
        };
        match way {
            None => kvring::host::shm_copy(to, from),
            Some(piece) => {
                let (a, b) = summed(from, to, piece);
                assert_eq!(a, b, "a summed copy's two sums differ");
            }
        }
    }
    (count * block) as f64 / started.elapsed().as_secs_f64() / 1e9
}

fn quartiles(ratios: &mut [f64]) -> (f64, f64, f64) {
    ratios.sort_by(f64::total_cmp);
    let at = |p: f64| ratios[((ratios.len() - 1) as f64 * p).round() as usize];
    (at(0.25), at(0.5), at(0.75))
}

fn main() {
    let rounds = rounds::rounds(1, 20);
    // The first bare number, not the one after `--rounds`.
    let args: Vec<String> = std::env::args().collect();
    let block = args
        .windows(2)
        .filter(|pair| pair[0] != "--rounds")
        .find_map(|pair| pair[1].parse::<usize>().ok())
        .unwrap_or(64 << 10);
    let (src, dst) = (Buffer::new(REGION, 0), Buffer::new(REGION, 0x5a));
    let mut ratios = vec![Vec::new(); PIECES.len()];
    let mut plain = Vec::new();
    // One untimed pass first: the first copy into a buffer runs slower
    // (its TLB entries, the kernel's first write faults).
    round(&src, &dst, block, None);
    for _ in 0..rounds {
        let base = round(&src, &dst, block, None);
        plain.push(base);
        for (piece, ratios) in PIECES.iter().zip(&mut ratios) {
            ratios.push(round(&src, &dst, block, Some(*piece)) / base);
        }
    }
    let (_, median, _) = quartiles(&mut plain);
    println!("summed_pieces: {} KiB blocks, plain shm copy median {median:.2} GB/s, {rounds} rounds", block >> 10);
    for (piece, ratios) in PIECES.iter().zip(&mut ratios) {
        let (low, median, high) = quartiles(ratios);
        println!(
            "  summed, {:>2} KiB pieces: {median:.3}x of the plain copy (quartiles {low:.3}-{high:.3})",
            piece >> 10
        );
    }
}
