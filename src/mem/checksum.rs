//! A fast, non-cryptographic checksum of region bytes, for verifying what a
//! transfer left on the target (`kvring bench`, tests). Four independent
//! multiply-xor lanes over 64-bit words keep it near memory bandwidth.

const K: [u64; 4] = [0x9E37_79B9_7F4A_7C15, 0xC2B2_AE3D_27D4_EB4F, 0x1656_67B1_9E37_79F9, 0x85EB_CA77_C2B2_AE63];

#[inline(always)]
fn mix(h: u64, w: u64, k: u64) -> u64 {
    (h ^ w).wrapping_mul(k).rotate_left(29)
}

/// Checksum of `bytes`; equal inputs give equal sums, and any change of a
/// byte or of the length changes it with overwhelming probability.
#[cfg(any(test, feature = "testing"))]
pub fn checksum(bytes: &[u8]) -> u64 {
    let whole = bytes.len() - bytes.len() % BLOCK;
    let mut sum = Checksum::new();
    sum.blocks(&bytes[..whole]);
    sum.finish(&bytes[whole..])
}

/// Hands `len` bytes at `ptr`, in memory that other threads or processes
/// may be writing (a registered region: lanes, peers over shm, NICs), to
/// `each` piece by piece (at most [`BOUNCE_BYTES`], a multiple of the
/// checksum's block), copied into a bounce buffer, so no reference to that
/// memory is ever made; the last piece (empty for no bytes) says so.
///
/// # Safety
///
/// `ptr..ptr + len` stays mapped and readable for the call.
pub(crate) unsafe fn bounced(ptr: *const u8, len: usize, mut each: impl FnMut(&[u8], bool)) {
    let mut bounce = vec![0u8; BOUNCE_BYTES.min(len)];
    let mut done = 0;
    loop {
        let n = (len - done).min(BOUNCE_BYTES);
        // SAFETY: `done + n <= len`, inside the range our caller vouches for;
        // the bounce buffer has room for `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(ptr.add(done), bounce.as_mut_ptr(), n) };
        done += n;
        each(&bounce[..n], done == len);
        if done == len {
            return;
        }
    }
}

/// Bytes [`bounced`] copies out at a time.
const BOUNCE_BYTES: usize = 64 * 1024;
const _: () = assert!(BOUNCE_BYTES.is_multiple_of(BLOCK));

/// Checksum of `len` bytes at `ptr` in memory that other threads or
/// processes may be writing, read through a bounce buffer ([`bounced`]).
/// Equal to [`checksum`] of the same bytes.
///
/// # Safety
///
/// `ptr..ptr + len` stays mapped and readable for the call.
pub unsafe fn checksum_shared(ptr: *const u8, len: usize) -> u64 {
    let mut sum = Some(Checksum::new());
    let mut result = 0;
    // SAFETY: forwarded from our own contract.
    unsafe {
        bounced(ptr, len, |piece, last| {
            let Some(running) = sum.as_mut() else { return };
            if !last {
                running.blocks(piece);
                return;
            }
            // Bounce pieces are multiples of BLOCK: only the last has a tail.
            let whole = piece.len() - piece.len() % BLOCK;
            running.blocks(&piece[..whole]);
            if let Some(done) = sum.take() {
                result = done.finish(&piece[whole..]);
            }
        })
    };
    result
}

/// Checksum of `len` bytes of device memory at `addr`, read through the
/// provider's copy engine: equal to [`checksum_shared`] of the same bytes.
pub fn checksum_device(backing: &super::DeviceBacking, addr: u64, len: usize) -> crate::error::Result<u64> {
    let mut sum = Some(Checksum::new());
    let mut result = None;
    backing.read_chunks(addr, len, |offset, chunk| {
        let Some(running) = sum.as_mut() else { return };
        if offset + chunk.len() < len {
            // Bounce chunks are multiples of BLOCK: only the last has a tail.
            running.blocks(chunk);
        } else {
            let whole = chunk.len() - chunk.len() % BLOCK;
            running.blocks(&chunk[..whole]);
            result = sum.take().map(|s| s.finish(&chunk[whole..]));
        }
    })?;
    Ok(result.unwrap_or_else(|| Checksum::new().finish(&[])))
}

const BLOCK: usize = 32;

/// The running state: four lanes over 32-byte blocks.
struct Checksum {
    h: [u64; 4],
    len: u64,
}

impl Checksum {
    fn new() -> Self {
        Self { h: [1, 2, 3, 4], len: 0 }
    }

    /// Takes whole blocks (`bytes.len()` a multiple of [`BLOCK`]).
    fn blocks(&mut self, bytes: &[u8]) {
        for block in bytes.chunks_exact(BLOCK) {
            let words: [u64; 4] = bytemuck::pod_read_unaligned(block);
            for i in 0..4 {
                self.h[i] = mix(self.h[i], words[i], K[i]);
            }
        }
        self.len += bytes.len() as u64;
    }

    /// Takes the last partial block (possibly empty) and folds the length in.
    fn finish(mut self, tail: &[u8]) -> u64 {
        let mut last = [0u8; BLOCK];
        last[..tail.len()].copy_from_slice(tail);
        let words: [u64; 4] = bytemuck::cast(last);
        for i in 0..4 {
            self.h[i] = mix(self.h[i], words[i], K[i]);
        }
        let mut out = self.len + tail.len() as u64;
        for (i, v) in self.h.iter().enumerate() {
            out = mix(out, *v, K[(i + 1) % 4]);
        }
        out ^ (out >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::{checksum, checksum_shared};

    #[test]
    fn through_a_bounce_buffer_it_equals_the_direct_sum() {
        for len in [0, 1, 31, 32, 33, 65536, 65536 + 7, 3 * 65536 + 32, 200_000] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
            // SAFETY: `bytes` is live and `len` long.
            assert_eq!(unsafe { checksum_shared(bytes.as_ptr(), len) }, checksum(&bytes), "{len}");
        }
    }

    #[test]
    fn sensitive_to_every_byte_position_and_length() {
        let base = vec![7u8; 100];
        let sum = checksum(&base);
        for i in 0..base.len() {
            let mut changed = base.clone();
            changed[i] ^= 1;
            assert_ne!(checksum(&changed), sum, "byte {i}");
        }
        assert_ne!(checksum(&base[..99]), sum);
        let mut zeros = vec![0u8; 64];
        assert_ne!(checksum(&zeros[..32]), checksum(&zeros));
        zeros[63] = 1;
        assert_ne!(checksum(&zeros), checksum(&[0u8; 64]));
    }
}
