//! The copy kernel: the middle tier of a chunk's copies, for drivers without
//! `cuMemcpyBatchAsync` (older than CUDA 12.8). `copy_kernel.ptx` is built
//! from `copy_kernel.cu` by NVRTC and shipped as text (PTX ISA 7.0, so
//! those drivers JIT it; no compiler at build time).
//!
//! Each stream that launches it owns a ring of descriptor slots in pinned,
//! device-mapped host memory, which the kernel reads over the bus. A slot is
//! reused only once the event recorded after the launch that read it has
//! completed; a slot still busy sends that chunk down the per-copy path, so
//! the lane never waits (and the chunk is counted as per-copy). The kernel
//! dereferences host addresses: it runs only where every one is pinned and
//! device-mapped at that address, and every other GPU's memory is reachable
//! by peer access (`tier.rs` decides, `reach.rs` asks the driver).

use super::{check, Raw};
use crate::error::Result;
use crate::gpu::Copy;
use cudarc::driver::sys;
use std::ffi::{c_uint, c_void};

/// The kernel, as PTX text.
const PTX: &str = concat!(include_str!("copy_kernel.ptx"), "\0");
/// Descriptor slots per stream: chunks in flight on one stream before a
/// chunk falls back to one copy call per run.
const SLOTS: usize = 16;
/// Copies one slot holds (a lane's chunk, `transport::MAX_CHUNK_BLOCKS`,
/// holds at most this many; more go one call each).
pub(super) const SLOT_COPIES: usize = 256;
/// Threads per block (one block per copy).
const THREADS: c_uint = 256;
/// Most blocks per launch (more copies loop over the grid).
const MAX_BLOCKS: c_uint = 1024;

/// The kernel loaded into one device's context.
#[derive(Debug, Clone, Copy)]
pub(super) struct Loaded {
    function: Raw<sys::CUfunction>,
}

/// Bytes of each JIT log kept (the compiler's error and info logs).
const JIT_LOG_BYTES: usize = 4096;

/// Loads the kernel into the current context (the device's); a failure
/// quotes the JIT compiler's error log (`CU_JIT_ERROR_LOG_BUFFER`), and
/// its info log, so it says why (GPU-REVIEW #18).
pub(super) fn load() -> Result<Loaded> {
    use sys::CUjit_option::*;
    let mut module: sys::CUmodule = std::ptr::null_mut();
    let (mut error_log, mut info_log) = (vec![0u8; JIT_LOG_BYTES], vec![0u8; JIT_LOG_BYTES]);
    let mut options = [
        CU_JIT_ERROR_LOG_BUFFER,
        CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        CU_JIT_INFO_LOG_BUFFER,
        CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
    ];
    // Sizes travel as the option's value itself (the driver's convention
    // for unsigned int options), and come back as the bytes written.
    let mut values: [*mut c_void; 4] = [
        error_log.as_mut_ptr().cast(),
        JIT_LOG_BYTES as *mut c_void,
        info_log.as_mut_ptr().cast(),
        JIT_LOG_BYTES as *mut c_void,
    ];
    // SAFETY: a NUL-terminated PTX image; writes one module handle; each
    // log buffer is JIT_LOG_BYTES long, as its size option says, and
    // outlives the call.
    let result = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            PTX.as_ptr().cast(),
            options.len() as c_uint,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    check(result, "loading the copy kernel").map_err(|error| {
        let said = |log: &[u8]| String::from_utf8_lossy(log.split(|&b| b == 0).next().unwrap_or(&[])).trim().to_owned();
        let (errors, info) = (said(&error_log), said(&info_log));
        let reason = match error {
            crate::error::Error::Gpu { reason, .. } => reason,
            other => other.to_string(),
        };
        super::cuda_error(format!("{reason}; the JIT compiler's log: {errors:?} (info: {info:?})"))
    })?;
    let mut function: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: a module just loaded and a NUL-terminated name.
    let found = unsafe { sys::cuModuleGetFunction(&mut function, module, c"kvring_copy".as_ptr()) };
    check(found, "finding the copy kernel")?;
    Ok(Loaded { function: Raw(function) })
}

/// One stream's descriptor slots and the events that free them.
#[derive(Debug)]
pub(super) struct Ring {
    host: Raw<*mut Copy>,
    device: sys::CUdeviceptr,
    events: Vec<Raw<sys::CUevent>>,
    next: usize,
}

impl Ring {
    /// Slots in pinned, device-mapped memory, each with its event (made in
    /// the current context).
    pub(super) fn new() -> Result<Self> {
        let bytes = SLOTS * SLOT_COPIES * std::mem::size_of::<Copy>();
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: writes one pointer to `bytes` of pinned memory.
        check(unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) }, "allocating the copy kernel's descriptors")?;
        let mut ring = Ring { host: Raw(host.cast()), device: 0, events: Vec::with_capacity(SLOTS), next: 0 };
        // SAFETY: `host` was allocated device-mapped just above.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut ring.device, host, 0) };
        check(mapped, "mapping the copy kernel's descriptors")?;
        for _ in 0..SLOTS {
            let mut event: sys::CUevent = std::ptr::null_mut();
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
            // SAFETY: writes one event handle.
            check(unsafe { sys::cuEventCreate(&mut event, flags) }, "creating an event")?;
            ring.events.push(Raw(event));
        }
        Ok(ring)
    }

    /// True when the next slot is free (the launch that last read it has
    /// completed, or none ever did).
    pub(super) fn slot_free(&self) -> bool {
        // SAFETY: an event of this ring (one never recorded is complete).
        unsafe { sys::cuEventQuery(self.events[self.next].0) == sys::CUresult::CUDA_SUCCESS }
    }

    /// Launches the kernel over `copies` on `stream` from the next slot;
    /// `Ok(false)` when that slot is still read by an earlier launch (or
    /// the copies do not fit one), and nothing was launched.
    ///
    /// # Safety
    ///
    /// As `Gpu::copy_batch`: the ranges stay valid until the stream's work
    /// so far has completed.
    pub(super) unsafe fn launch(&mut self, kernel: Loaded, stream: sys::CUstream, copies: &[Copy]) -> Result<bool> {
        let slot = self.next;
        if copies.len() > SLOT_COPIES || !self.slot_free() {
            return Ok(false);
        }
        // SAFETY: the slot holds SLOT_COPIES entries and no launch reads it
        // any more (its event completed); `Copy` is `repr(C)`, three u64s,
        // as the kernel reads them.
        unsafe { std::ptr::copy_nonoverlapping(copies.as_ptr(), self.host.0.add(slot * SLOT_COPIES), copies.len()) };
        let mut descriptors = self.device + (slot * SLOT_COPIES * std::mem::size_of::<Copy>()) as u64;
        let mut count = copies.len() as c_uint;
        let mut params = [(&mut descriptors as *mut u64).cast::<c_void>(), (&mut count as *mut c_uint).cast()];
        let blocks = count.clamp(1, MAX_BLOCKS);
        // SAFETY: the kernel takes (const KvringCopy *, unsigned int), as
        // `params` points at; the launch copies them before returning.
        let launched = unsafe {
            sys::cuLaunchKernel(
                kernel.function.0,
                blocks,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(launched, "launching the copy kernel")?;
        // SAFETY: a live event and stream.
        check(unsafe { sys::cuEventRecord(self.events[slot].0, stream) }, "recording an event")?;
        self.next = (slot + 1) % SLOTS;
        Ok(true)
    }

    /// Frees the ring once `stream` has finished what it has (a stream is
    /// destroyed idle, once its chunks ended, so this does not wait).
    pub(super) fn free(self, stream: sys::CUstream) {
        // SAFETY: a live stream; waiting here keeps a launch from reading
        // freed descriptors.
        unsafe { sys::cuStreamSynchronize(stream) };
        for event in self.events {
            // SAFETY: an event of this ring, recorded work finished.
            unsafe { sys::cuEventDestroy_v2(event.0) };
        }
        // SAFETY: allocated by cuMemHostAlloc; no launch reads it any more.
        unsafe { sys::cuMemFreeHost(self.host.0.cast()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped PTX is the kernel the provider looks up, at an ISA the
    /// older drivers that take this path can JIT, and it reads descriptors
    /// laid out as `Copy` is.
    #[test]
    fn the_shipped_ptx_names_the_kernel_at_an_old_enough_isa() {
        assert!(PTX.contains(".visible .entry kvring_copy("), "the entry point");
        assert!(PTX.contains("\n.version 7.0\n"), "PTX ISA 7.0 (CUDA 11.0 drivers JIT it)");
        assert!(PTX.ends_with('\0'), "NUL-terminated for cuModuleLoadData");
        assert_eq!(std::mem::size_of::<Copy>(), 24, "three u64s, as KvringCopy");
        assert_eq!(std::mem::offset_of!(Copy, len), 16);
    }
}
