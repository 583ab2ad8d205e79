//! Memory for the memcpy baselines: the same kind the shm transport copies
//! into (a shared mapping of a /dev/shm file, pre-faulted), so a ratio
//! against it measures kvring, not a difference in pages.

use memmap2::{MmapMut, MmapOptions};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

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
    // Pages allocated now, as `alloc_region` does: a sparse file would be
    // populated with the zero page, and every first write would fault
    // inside the measured copy.
    // SAFETY: fallocate on a file descriptor this function owns.
    let rc = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&file), 0, 0, len as libc::off_t) };
    if rc != 0 {
        return Err(format!("allocating {path}: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the file was created (and unlinked) by this process: nothing
    // else maps or truncates it.
    let map = unsafe { MmapOptions::new().len(len).populate().map_mut(&file) };
    map.map_err(|e| format!("mapping {path}: {e}"))
}

/// Fills `bytes` with a pattern derived from `seed` (no zero pages).
pub fn fill(bytes: &mut [u8], seed: u64) {
    for (index, word) in bytes.chunks_mut(8).enumerate() {
        let value = (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ seed;
        word.copy_from_slice(&value.to_le_bytes()[..word.len()]);
    }
}

/// memcpy of `total` bytes in `block`-sized copies (each as the shm
/// transport copies a block, [`kvring::host::shm_copy`])
/// between two page-aligned, pre-faulted shared mappings of the same size
/// as the bench's regions, on the lane's core: what the shm transport's
/// copy costs alone.
pub fn memcpy_baseline(block: u64, total: u64, region_bytes: u64, core: Option<usize>) -> Result<f64, String> {
    // Made once and kept for every later round of the same region size, as
    // the transport's regions live through the whole case: mappings made
    // fresh for each round copied markedly slower here than the plain
    // transport did between its long-lived ones.
    static KEPT: std::sync::Mutex<Option<(u64, MmapMut, MmapMut)>> = std::sync::Mutex::new(None);
    let mut kept = KEPT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if kept.as_ref().is_none_or(|(len, _, _)| *len != region_bytes) {
        *kept = None; // the old pair is unmapped before the new one is made
        let mut src = shm_buffer(region_bytes as usize)?;
        fill(&mut src, region_bytes);
        *kept = Some((region_bytes, src, shm_buffer(region_bytes as usize)?));
    }
    let Some((_, src, dst)) = kept.as_mut() else { unreachable!("made above") };
    let (src_addr, dst_addr) = (src.as_mut_ptr() as usize, dst.as_mut_ptr() as usize);
    let copy = move || {
        if let Some(core) = core {
            core_affinity::set_for_current(core_affinity::CoreId { id: core });
        }
        let blocks_in_region = region_bytes / block;
        let count = total.div_ceil(block);
        let started = Instant::now();
        for i in 0..count {
            let offset = ((i % blocks_in_region) * block) as usize;
            // SAFETY: offset + block <= region_bytes; both mappings are that
            // long, distinct, outlive this thread (joined below), and only
            // this thread uses them meanwhile.
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts((src_addr + offset) as *const u8, block as usize),
                    std::slice::from_raw_parts_mut((dst_addr + offset) as *mut u8, block as usize),
                )
            };
            kvring::host::shm_copy(dst, src);
        }
        (count * block) as f64 / started.elapsed().as_secs_f64() / 1e9
    };
    std::thread::spawn(copy).join().map_err(|_| "memcpy baseline thread panicked".to_string())
}
