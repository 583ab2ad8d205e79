//! End-to-end block checksums (CRC32C), the parts every link shares: the
//! checksum of host bytes, and (with the `testing` feature) the hook that
//! corrupts the next landing so tests can see a mismatch reported.
//!
//! Where each transport computes and verifies them is in docs/CHECKSUMS.md.

/// CRC32C of `len` host bytes at `ptr`.
///
/// # Safety
///
/// `ptr..ptr + len` is mapped and readable for the call, and nothing in
/// this process writes it meanwhile (a leased block of a part in flight, or
/// the peer's mapped destination of this lane's own copy).
#[inline]
pub(crate) unsafe fn crc32c_host(ptr: *const u8, len: usize) -> u32 {
    if len == 0 {
        return crc32c::crc32c(&[]);
    }
    // SAFETY: per this function's contract.
    crc32c::crc32c(unsafe { std::slice::from_raw_parts(ptr, len) })
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
/// over shm or cma) is `offset`. Process-wide: tests that use it run one at
/// a time.
#[cfg(feature = "testing")]
pub fn corrupt_landing_at(offset: u64) {
    CORRUPT_LANDING_AT.store(offset, std::sync::atomic::Ordering::Release);
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
