//! Memory for the memcpy baselines: the same kind the shm transport copies
//! into (a shared mapping of a /dev/shm file, pre-faulted), so a ratio
//! against it measures kvring, not a difference in pages.

use memmap2::{MmapMut, MmapOptions};
use std::sync::atomic::{AtomicU32, Ordering};

/// A pre-faulted shared mapping of `len` bytes of a /dev/shm file that is
/// unlinked at once (nothing is left behind, whatever happens next).
pub fn shm_buffer(len: usize) -> Result<MmapMut, String> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let path = format!(
        "{}/kvring-bench-{}-{}",
        kvring::host::SHM_DIR,
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| format!("creating {path}: {e}"))?;
    let _ = std::fs::remove_file(&path);
    file.set_len(len as u64).map_err(|e| format!("sizing {path}: {e}"))?;
    // SAFETY: the file was created (and unlinked) by this process: nothing
    // else maps or truncates it.
    unsafe { MmapOptions::new().len(len).populate().map_mut(&file) }.map_err(|e| format!("mapping {path}: {e}"))
}

/// Fills `bytes` with a pattern derived from `seed` (no zero pages).
pub fn fill(bytes: &mut [u8], seed: u64) {
    for (index, word) in bytes.chunks_mut(8).enumerate() {
        let value = (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed;
        word.copy_from_slice(&value.to_le_bytes()[..word.len()]);
    }
}
