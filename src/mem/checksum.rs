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
pub fn checksum(bytes: &[u8]) -> u64 {
    let mut h = [1u64, 2, 3, 4];
    let mut blocks = bytes.chunks_exact(32);
    for block in &mut blocks {
        let words: [u64; 4] = bytemuck::pod_read_unaligned(block);
        for i in 0..4 {
            h[i] = mix(h[i], words[i], K[i]);
        }
    }
    let mut tail = [0u8; 32];
    let rest = blocks.remainder();
    tail[..rest.len()].copy_from_slice(rest);
    let words: [u64; 4] = bytemuck::cast(tail);
    for i in 0..4 {
        h[i] = mix(h[i], words[i], K[i]);
    }
    let mut out = bytes.len() as u64;
    for (i, v) in h.iter().enumerate() {
        out = mix(out, *v, K[(i + 1) % 4]);
    }
    out ^ (out >> 31)
}

#[cfg(test)]
mod tests {
    use super::checksum;

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
