//! End-to-end block checksums (CRC32C), the parts every link shares: the
//! checksum of host bytes, and (with the `testing` feature) the hook that
//! corrupts the next landing so tests can see a mismatch reported.
//!
//! Where each transport computes and verifies them is in docs/CHECKSUMS.md.

/// Bytes of a block moved and checksummed at a time on a one-sided link
/// (shm, cma): a piece's source and destination (512 KiB together) stay in
/// a core's L2 cache from the source's CRC through the copy to the
/// destination's CRC, so a checked piece reads memory once, as its plain
/// copy does.
pub const VERIFIED_PIECE_BYTES: u64 = 256 << 10;

/// CRC32C of `len` host bytes at `ptr`.
///
/// # Safety
///
/// `ptr..ptr + len` is mapped and readable for the call, and nothing in
/// this process writes it meanwhile (a leased block of a part in flight, or
/// the peer's mapped destination of this lane's own copy).
#[inline]
pub(crate) unsafe fn crc32c_host(ptr: *const u8, len: usize) -> u32 {
    let mut sum = Crc32c::new();
    // SAFETY: per this function's contract.
    unsafe { sum.update_raw(ptr, len) };
    sum.value()
}

/// CRC32C of `bytes`.
#[cfg(test)]
pub(crate) fn crc32c_of(bytes: &[u8]) -> u32 {
    let mut sum = Crc32c::new();
    sum.update(bytes);
    sum.value()
}

/// CRC32C of `len` bytes at `ptr` that another party may write meanwhile
/// (a peer's NIC placing an RDMA WRITE): read through a bounce buffer
/// (`mem::checksum::bounced`), so no `&[u8]` is ever formed over the
/// shared bytes.
///
/// # Safety
///
/// `ptr..ptr + len` is mapped and readable for the call (a region kept
/// registered, by a lease, until it returns).
pub(crate) unsafe fn crc32c_shared(ptr: *const u8, len: usize) -> u32 {
    let mut sum = Crc32c::new();
    // SAFETY: forwarded from our own contract.
    unsafe { crate::mem::checksum::bounced(ptr, len, |piece, _| sum.update(piece)) };
    sum.value()
}

/// A CRC32C (Castagnoli; `crc_fast`'s CRC-32/ISCSI) computed over pieces
/// in order: the same value as over their bytes at once. `crc_fast` picks
/// its kernel once, at run time, by the CPU's features (AVX-512 with
/// VPCLMULQDQ folding beside the `crc32` instruction here; SSE4.2 and
/// PCLMULQDQ, or ARMv8 CRC and PMULL, elsewhere; a table where none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Crc32c(crc_fast::Digest);

impl Crc32c {
    /// The CRC32C of no bytes yet.
    #[inline]
    pub(crate) fn new() -> Self {
        Self(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }

    /// Continues over `bytes`.
    #[inline]
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// Continues over `len` host bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// As [`crc32c_host`].
    #[inline]
    pub(crate) unsafe fn update_raw(&mut self, ptr: *const u8, len: usize) {
        if len > 0 {
            // SAFETY: per this function's contract (`len > 0`, so `ptr` is
            // a real address).
            self.update(unsafe { std::slice::from_raw_parts(ptr, len) });
        }
    }

    /// The CRC32C of every byte so far.
    #[inline]
    pub(crate) fn value(&self) -> u32 {
        // CRC-32/ISCSI is 32 bits wide: the digest's upper half is zero.
        self.0.finalize() as u32
    }
}

/// The two CRC32Cs of a block being verified: of its source's bytes as
/// they were copied, and of its destination's bytes read back once landed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockSums {
    /// Over the source.
    pub sent: Crc32c,
    /// Over the destination, read back.
    pub landed: Crc32c,
}

impl BlockSums {
    /// Both over no bytes yet.
    pub(crate) fn new() -> Self {
        Self { sent: Crc32c::new(), landed: Crc32c::new() }
    }
}

/// Where `block` lands, as the corruption hook names it: its offset in the
/// peer's region for a WRITE, in this engine's for a READ.
#[inline]
pub(crate) fn landing_offset(op: crate::ring::Opcode, block: &super::Block) -> u64 {
    match op {
        crate::ring::Opcode::Write => block.desc.remote_offset,
        crate::ring::Opcode::Read => block.desc.local_offset,
    }
}

/// The error for a block whose checksums differ.
pub(crate) fn corrupt(desc_index: u32, sent: u32, landed: u32, where_: &str) -> crate::error::Error {
    crate::error::Error::Corrupt {
        desc_index,
        detail: format!("its CRC32C was {sent:#010x} where it was sent but {landed:#010x} {where_}"),
    }
}

/// Armed by a test: the remote offset of the next checksummed block to be
/// corrupted after its bytes land and before they are verified
/// (`u64::MAX`: none).
#[cfg(feature = "testing")]
static CORRUPT_LANDING_AT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

/// Arms a corruption of the next checksummed block whose destination
/// offset (in the peer's region for a WRITE, in this engine's for a READ
/// over shm, cma or tcp) is `offset`, or of the piece of a block that starts
/// there (shm and cma check a block in pieces of [`VERIFIED_PIECE_BYTES`],
/// tcp in frames). Process-wide: tests that use it run one at a time.
#[cfg(feature = "testing")]
pub fn corrupt_landing_at(offset: u64) {
    CORRUPT_LANDING_AT.store(offset, std::sync::atomic::Ordering::Release);
}

/// What corrupts a byte of a peer's region for the `testing` feature's
/// hook over rdma, where no CPU of this engine touches the landed bytes:
/// called with the peer's region (raw id) and the offset of the landed
/// byte to flip, after the WRITE's completion and before its verification.
#[cfg(feature = "testing")]
pub type RemoteCorrupter = Box<dyn Fn(u64, u64) + Send + Sync>;

#[cfg(feature = "testing")]
static REMOTE_CORRUPTER: std::sync::Mutex<Option<RemoteCorrupter>> = std::sync::Mutex::new(None);

/// Sets (or with `None` clears) how a test corrupts a block landed by an
/// rdma WRITE in the target's memory, when [`corrupt_landing_at`] names
/// it: the test writes the target engine's region itself, as a stray
/// writer there would. Process-wide, like the hook.
#[cfg(feature = "testing")]
pub fn corrupt_rdma_landings_with(corrupter: Option<RemoteCorrupter>) {
    *REMOTE_CORRUPTER.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = corrupter;
}

/// Corrupts the first byte at `offset` of the peer's region `region` with
/// the test's corrupter, if one is set (see [`corrupt_rdma_landings_with`]).
#[inline]
pub(crate) fn corrupt_remote_landing(region: u64, offset: u64) {
    #[cfg(feature = "testing")]
    if let Some(corrupter) = &*REMOTE_CORRUPTER.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
        corrupter(region, offset);
    }
    #[cfg(not(feature = "testing"))]
    let _ = (region, offset);
}

/// Takes the armed corruption if it is for a block at `offset`.
#[inline]
pub(crate) fn take_corruption(offset: u64) -> bool {
    #[cfg(feature = "testing")]
    {
        use std::sync::atomic::Ordering;
        CORRUPT_LANDING_AT.compare_exchange(offset, u64::MAX, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
    #[cfg(not(feature = "testing"))]
    {
        let _ = offset;
        false
    }
}

/// Flips the first byte at `ptr` (a test's corruption of landed bytes).
///
/// # Safety
///
/// `ptr` is valid for a one-byte read and write, and nothing else accesses
/// it during the call.
pub(crate) unsafe fn flip_first_byte(ptr: *mut u8) {
    // SAFETY: per this function's contract.
    unsafe { ptr.write_volatile(ptr.read_volatile() ^ 0x5a) };
}

/// GPU memory has no checksum on any copy path yet: refused, never moved
/// unchecked.
pub(crate) fn device_refused() -> crate::error::Error {
    crate::error::Error::Unsupported {
        what: "a checksum of GPU memory: kvring has no checksum kernel on the GPU copy path yet, so checksummed \
               batches of device memory are refused rather than moved unchecked"
            .into(),
    }
}

/// tcp's target: checks a WRITE frame that carries a checksum against the
/// bytes now in place (its range ends at `end`); a mismatch fails the chunk
/// `CORRUPT`, naming the frame (the initiator maps it to its block).
///
/// # Safety
///
/// `end - header.len .. end` is the frame's checked range, still leased,
/// and nothing else writes it during the call.
pub(crate) unsafe fn verify_frame(
    header: &super::tcp::frame::FrameHeader,
    end: *mut u8,
    failure: &mut Option<(super::tcp::frame::FrameHeader, crate::error::Error)>,
) {
    let Some(sent) = header.checksum() else { return };
    let len = header.len as usize;
    let start = end.wrapping_sub(len);
    if len > 0 && take_corruption(header.offset) {
        // SAFETY: per this function's contract.
        unsafe { flip_first_byte(start) };
    }
    // SAFETY: per this function's contract.
    let landed = unsafe { crc32c_host(start, len) };
    if landed != sent {
        failure.get_or_insert((*header, corrupt(0, sent, landed, "in the bytes the target received")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CRC32C bit by bit (reflected polynomial 0x82F63B78, init and final
    /// xor 0xFFFFFFFF): the definition, sharing no code with either crate.
    fn reference(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &byte in bytes {
            crc ^= u32::from(byte);
            for _ in 0..8 {
                crc = (crc >> 1) ^ (0x82f6_3b78 & (crc & 1).wrapping_neg());
            }
        }
        !crc
    }

    fn host(bytes: &[u8]) -> u32 {
        // SAFETY: a live slice, not written during the call.
        unsafe { crc32c_host(bytes.as_ptr(), bytes.len()) }
    }

    #[test]
    fn known_crc32c_vectors() {
        // The CRC catalogue's check value of CRC-32/ISCSI, and RFC 3720
        // (iSCSI) appendix B.4's examples.
        let ascending: Vec<u8> = (0..32).collect();
        let descending: Vec<u8> = (0..32).rev().collect();
        let vectors: [(&[u8], u32); 6] = [
            (b"", 0),
            (b"123456789", 0xe306_9283),
            (&[0u8; 32], 0x8a91_36aa),
            (&[0xffu8; 32], 0x62a8_ab43),
            (&ascending, 0x46dd_794e),
            (&descending, 0x113f_db5c),
        ];
        for (bytes, expected) in vectors {
            assert_eq!(host(bytes), expected, "{bytes:?}");
            assert_eq!(reference(bytes), expected, "{bytes:?}");
        }
    }

    #[test]
    fn equals_the_crc32c_crate_and_the_definition_over_random_buffers() {
        // Lengths around each kernel's steps (16, 64, 256 bytes, a few
        // KiB), and large ones; start offsets that misalign every load.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let buffer: Vec<u8> = (0..(1 << 20) + 64).map(|_| next() as u8).collect();
        let mut lens: Vec<usize> = (0..=300).chain([511, 512, 513, 1023, 4096, 4097, 65_536, 65_599]).collect();
        lens.extend((0..40).map(|_| next() as usize % (1 << 20)));
        lens.push(1 << 20);
        for len in lens {
            let start = next() as usize % 64;
            let bytes = &buffer[start..start + len];
            let old = crc32c::crc32c(bytes);
            assert_eq!(host(bytes), old, "len {len} at {start}");
            if len <= 65_599 {
                assert_eq!(reference(bytes), old, "len {len} at {start}");
            }
            // In pieces, as the lane checksums a block piece by piece.
            let mut pieces = Crc32c::new();
            let mut at = 0;
            while at < len {
                let n = (next() as usize % 70_000).min(len - at);
                pieces.update(&bytes[at..at + n]);
                at += n;
            }
            assert_eq!(pieces.value(), old, "len {len} at {start} in pieces");
        }
    }
}
