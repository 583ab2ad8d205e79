//! The real GPU provider: the CUDA driver API through cudarc, loaded at run
//! time, so kvring builds, runs and passes its tests where there is no CUDA
//! at all and says so when asked for a GPU.
//!
//! Every call is gated: cudarc panics on a missing library or symbol, and a
//! panic must never reach a lane, the C ABI or Python. The library's
//! presence is checked once before anything else; the driver's version is
//! asked first (`cuDriverGetVersion`, in every driver) and a driver older
//! than [`tier::BASELINE_DRIVER`] is refused, saying so; every function
//! newer than that baseline is called only on drivers that have it
//! (`cuGetProcAddress_v2` from 12.0, `cuMemcpyBatchAsync` from 12.8); and
//! every entry point runs under `catch_unwind`, so a symbol missing after
//! all is an error, not a crash. How each chunk's copies go (batch API,
//! copy kernel, one call each) is [`tier::choose_method`]'s choice, from
//! what is pinned here and which GPUs this process has peer access between
//! (`reach.rs`). Device memory is exported as a dma-buf for NICs
//! (`dmabuf.rs`, from CUDA 11.7 drivers). Each operation makes its device's
//! primary context current on the calling thread (the context the CUDA
//! runtime and PyTorch use, so their pointers and ours are the same) and
//! puts back whatever context the thread had when it returns: a worker on
//! `cuda:3` finds its current device unchanged after any kvring call
//! ([`Bound`]). A device's primary context is retained only at its first
//! use (memory of it registered, or it was named), never at load: each one
//! costs hundreds of MiB of device memory in every process. Classifying,
//! exporting and opening memory is `ipc.rs`.

mod batch;
mod context;
mod device;
mod dmabuf;
mod fabric;
mod gdr;
mod ipc;
mod load;

use batch::{batch_copy_12080, batched, per_copy, BatchCopy};
use device::describe;
pub(crate) use load::unavailable;
use load::{library_mismatch, LOAD_ERROR};
mod kernel;
mod reach;

use super::tier::{self, choose_method, TierInputs};
use super::{Copy, CopyMethod, CopySides, DevicePtr, DmaBuf, Event, Export, Gpu, GpuDevice, IpcHandle, Memory, Stream};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// A driver object the provider keeps in a table (raw pointers, usable from
/// any thread once the context is current there).
#[derive(Debug, Clone, Copy)]
struct Raw<T>(T);
// SAFETY: CUDA streams, events and contexts may be used from any thread
// (the driver API is thread safe); the provider makes the owning context
// current before each use, and never dereferences the handles itself.
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as above: shared use is a handle passed to the thread-safe driver.
unsafe impl<T> Sync for Raw<T> {}

/// One device: its handle and, once used, its retained primary context.
#[derive(Debug)]
struct Slot {
    device: sys::CUdevice,
    context: OnceLock<Raw<sys::CUcontext>>,
    /// The GPU's UUID (`cuDeviceGetUuid`): how another process, whose
    /// `CUDA_VISIBLE_DEVICES` may number GPUs otherwise, names it.
    uuid: Option<[u8; 16]>,
}

/// The provider over the CUDA driver.
#[derive(Debug)]
pub struct CudaGpu {
    /// Per device: its handle and primary context (retained lazily).
    contexts: Vec<Slot>,
    /// Held while a primary context is retained (one retain per device).
    retaining: Mutex<()>,
    /// The driver's CUDA version (12080 for 12.8).
    driver_version: u32,
    batch_copy: Option<BatchCopy>,
    /// Per device: whether a host pointer pinned here is also its address
    /// on that device (what lets the copy kernel use host pointers).
    host_pointers: Vec<bool>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    streams: HashMap<u64, (u32, Raw<sys::CUstream>)>,
    events: HashMap<u64, (u32, Raw<sys::CUevent>)>,
    /// Peers' exports opened here, by the pointer `open` returned.
    opened: HashMap<u64, Vec<ipc::Opened>>,
    /// Legacy handles opened here, per opening device's context: their
    /// base and how many opens hold them.
    legacy: HashMap<([u8; 64], u32), (u64, u32)>,
    /// Runs of pieces this provider allocated, by their address.
    runs: HashMap<u64, ipc::Opened>,
    /// The copy kernel per device, once loaded (`None`: it did not load).
    kernels: HashMap<u32, std::result::Result<kernel::Loaded, String>>,
    /// The copy kernel's descriptor ring of each stream that launched it.
    rings: HashMap<u64, kernel::Ring>,
    /// Allocations this provider made with `cuMemAlloc`: address → device.
    allocations: HashMap<u64, u32>,
    /// Host ranges this provider pinned (device-mapped): start → length.
    pinned: BTreeMap<u64, u64>,
    /// Whether a kernel on the first GPU may touch the second's memory
    /// (peer access asked for once per pair).
    peers: HashMap<(u32, u32), bool>,
    next_id: u64,
}

/// True when the CUDA driver library loads (checked once: each check
/// opens and closes it).
pub(crate) fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library by its known names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

impl CudaGpu {
    /// Loads the driver, initialises it and retains every device's primary
    /// context; a clear error when there is no driver, no device, or a
    /// driver older than kvring needs.
    pub fn load() -> Result<Self> {
        if !driver_present() {
            return Err(cuda_error(
                "no CUDA driver found (libcuda.so.1 does not load): device memory needs the NVIDIA driver \
                 (kvring's tests run the GPU paths on a simulated provider without one)",
            ));
        }
        let loaded = match library_mismatch() {
            Some(reason) => Err(cuda_error(reason)),
            None => shielded("loading the CUDA driver", Self::load_present),
        };
        if let Err(error) = &loaded {
            let mut kept = LOAD_ERROR.lock().unwrap_or_else(|p| p.into_inner());
            *kept = Some(error.to_string());
        }
        loaded
    }

    /// [`CudaGpu::load`] once the library is known to be there.
    fn load_present() -> Result<Self> {
        let mut version: c_int = 0;
        // SAFETY: writes one int; in every driver, callable before cuInit.
        check(unsafe { sys::cuDriverGetVersion(&mut version) }, "asking the CUDA driver's version")?;
        let driver_version = u32::try_from(version).unwrap_or(0);
        if driver_version < tier::BASELINE_DRIVER {
            return Err(cuda_error(format!(
                "the CUDA driver supports CUDA {} only; kvring needs {} or newer (update the NVIDIA driver)",
                tier::version_text(driver_version),
                tier::version_text(tier::BASELINE_DRIVER)
            )));
        }
        // SAFETY: the library is present; cuInit takes no pointer.
        check(unsafe { sys::cuInit(0) }, "initialising the CUDA driver")?;
        let mut count: c_int = 0;
        // SAFETY: writes one int.
        check(unsafe { sys::cuDeviceGetCount(&mut count) }, "counting GPUs")?;
        let mut contexts = Vec::with_capacity(count.max(0) as usize);
        for ordinal in 0..count {
            let mut device: sys::CUdevice = 0;
            // SAFETY: writes one device handle; `ordinal` is below the count.
            check(unsafe { sys::cuDeviceGet(&mut device, ordinal) }, "opening a GPU")?;
            contexts.push(Slot { device, context: OnceLock::new(), uuid: load::uuid(device) });
        }
        if contexts.is_empty() {
            return Err(cuda_error("the CUDA driver loaded but lists no GPU"));
        }
        let host_pointers = contexts.iter().map(|slot| reach::host_pointers_usable(slot.device)).collect();
        let batch_copy = batch_copy_12080(driver_version);
        let state = Mutex::new(State::default());
        Ok(Self { contexts, retaining: Mutex::new(()), driver_version, batch_copy, host_pointers, state })
    }

    /// The driver's CUDA version (12080 for 12.8).
    pub fn driver_version(&self) -> u32 {
        self.driver_version
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The copy kernel on `device` (loaded at its first use), where the
    /// driver has no batched copy and the kernel loads; a failure to load
    /// is said once and remembered.
    fn kernel(&self, device: u32) -> Option<kernel::Loaded> {
        if self.batch_copy.is_some() {
            return None;
        }
        if let Some(known) = self.lock().kernels.get(&device) {
            return known.as_ref().ok().copied();
        }
        let loaded = self.bind(device).and_then(|_bound| kernel::load());
        if let Err(error) = &loaded {
            tracing::warn!(%error, gpu = device, "the copy kernel did not load: one copy call per run instead");
        }
        let loaded = loaded.map_err(|error| match error {
            Error::Gpu { reason, .. } => reason,
            other => other.to_string(),
        });
        let kept = loaded.as_ref().ok().copied();
        self.lock().kernels.insert(device, loaded);
        kept
    }

    /// Whether the copy kernel loads on `device` (loading it now, as its
    /// first chunk there would): `Ok` where it loaded or the driver has
    /// batched copies (the kernel is never used), else the load's error
    /// with the JIT compiler's log.
    pub fn copy_kernel_loads(&self, device: u32) -> Result<()> {
        shielded("loading the copy kernel", || {
            self.kernel(device);
            match self.lock().kernels.get(&device) {
                Some(Err(reason)) => Err(cuda_error(reason.clone())),
                Some(Ok(_)) | None => Ok(()),
            }
        })
    }
}

impl State {
    fn take_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        let state = std::mem::take(self.state.get_mut().unwrap_or_else(|p| p.into_inner()));
        let released = shielded("releasing the CUDA provider", || {
            self.release(state);
            Ok(())
        });
        if let Err(error) = released {
            tracing::warn!(%error, "the CUDA provider did not release everything");
        }
    }
}

impl CudaGpu {
    /// Closes, frees and destroys everything in `state`, then releases the
    /// contexts (the provider's drop).
    fn release(&self, mut state: State) {
        for (opened, base) in state.take_opened() {
            let _bound = self.bind(opened.device());
            let _ = ipc::close(opened, base);
        }
        for (_, run) in state.runs.drain() {
            let _ = ipc::close(run, 0);
        }
        for (id, ring) in state.rings.drain() {
            if let Some((device, stream)) = state.streams.get(&id) {
                let _bound = self.bind(*device);
                ring.free(stream.0);
            }
        }
        for (_, (device, event)) in state.events {
            let _bound = self.bind(device);
            // SAFETY: an event this provider created and nothing uses now.
            unsafe { sys::cuEventDestroy_v2(event.0) };
        }
        for (_, (device, stream)) in state.streams {
            let _bound = self.bind(device);
            // SAFETY: a stream this provider created and nothing uses now.
            unsafe { sys::cuStreamDestroy_v2(stream.0) };
        }
        for (addr, device) in state.allocations {
            let _bound = self.bind(device);
            // SAFETY: an allocation this provider made whose owner never
            // freed it (owners hold the provider, so they are gone).
            unsafe { sys::cuMemFree_v2(addr) };
        }
        for (addr, _) in state.pinned {
            let _bound = self.bind(self.home());
            // SAFETY: a range this provider pinned whose owner never
            // unpinned it (owners hold the provider, so they are gone); the
            // driver checks the address and touches no memory of it.
            unsafe { sys::cuMemHostUnregister(addr as *mut c_void) };
        }
        let retained: Vec<u32> = self.retained().map(|(device, _)| device).collect();
        for ordinal in retained {
            // SAFETY: one release per retain in `context`.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.contexts[ordinal as usize].device) };
        }
    }

    /// A stream's device and handle.
    fn stream(&self, stream: Stream) -> Result<(u32, Raw<sys::CUstream>)> {
        self.lock().streams.get(&stream.0).copied().ok_or_else(|| cuda_error("no such stream"))
    }

    /// `copies` by the method [`choose_method`] picks for them on `device`'s
    /// stream `raw`.
    ///
    /// # Safety
    ///
    /// As [`Gpu::copy_batch`].
    unsafe fn issue(
        &self,
        device: u32,
        stream: Stream,
        raw: sys::CUstream,
        copies: &[Copy],
        sides: &[CopySides],
    ) -> Result<CopyMethod> {
        let batch = self.batch_copy.filter(|_| self.driver_version >= tier::BATCH_API_DRIVER);
        let kernel = if batch.is_some() { None } else { self.kernel(device) };
        let kernel_ready = kernel.is_some() && copies.len() <= kernel::SLOT_COPIES && self.slot_free(stream)?;
        // Peer access is enabled for every pair of GPUs a chunk touches,
        // whatever the method: a batched or plain copy between GPUs without
        // it is staged through the host.
        let peers_reachable = self.peers_reachable(device, sides);
        let host_pinned = kernel_ready && self.host_pinned(device, copies, sides);
        let inputs = TierInputs {
            driver_version: self.driver_version,
            batch_api: batch.is_some(),
            kernel_ready,
            host_pinned,
            peers_reachable,
        };
        match (choose_method(inputs), batch, kernel) {
            (CopyMethod::Batched, Some(batch), _) => {
                let pageable = self.pageable_source(copies, sides);
                // SAFETY: forwarded from our caller.
                unsafe { batched(batch, raw, copies, pageable) }.map(|()| CopyMethod::Batched)
            }
            (CopyMethod::Kernel, _, Some(kernel)) => {
                let mut state = self.lock();
                let ring =
                    state.rings.get_mut(&stream.0).ok_or_else(|| cuda_error("the copy kernel's ring is gone"))?;
                // SAFETY: forwarded from our caller; every address the
                // kernel dereferences is reachable (the tier's inputs).
                match unsafe { ring.launch(kernel, raw, copies)? } {
                    true => Ok(CopyMethod::Kernel),
                    // SAFETY: as above.
                    false => unsafe { per_copy(raw, copies) }.map(|()| CopyMethod::PerCopy),
                }
            }
            // SAFETY: forwarded from our caller.
            _ => unsafe { per_copy(raw, copies) }.map(|()| CopyMethod::PerCopy),
        }
    }

    /// True when `stream`'s next descriptor slot is free (its ring made at
    /// the first look).
    fn slot_free(&self, stream: Stream) -> Result<bool> {
        let mut state = self.lock();
        if let std::collections::hash_map::Entry::Vacant(slot) = state.rings.entry(stream.0) {
            slot.insert(kernel::Ring::new()?);
        }
        Ok(state.rings.get(&stream.0).is_some_and(kernel::Ring::slot_free))
    }
}

impl Gpu for CudaGpu {
    fn provider(&self) -> &'static str {
        "cuda"
    }

    fn devices(&self) -> Result<Vec<GpuDevice>> {
        shielded("listing GPUs", || {
            self.contexts.iter().enumerate().map(|(ordinal, slot)| describe(ordinal as u32, slot.device)).collect()
        })
    }

    fn classify(&self, addr: u64, len: u64) -> Result<Memory> {
        shielded("classifying a pointer", || self.classify_range(addr, len))
    }

    fn allocation_span(&self, addr: u64) -> Option<(u64, u64)> {
        shielded("finding an allocation's bounds", || self.span_of(addr)).ok().flatten()
    }

    fn alloc(&self, device: u32, len: u64) -> Result<DevicePtr> {
        shielded("allocating device memory", || {
            let _bound = self.bind(device)?;
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: writes one device pointer.
            check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len as usize) }, "allocating device memory")?;
            self.lock().allocations.insert(ptr, device);
            Ok(DevicePtr(ptr))
        })
    }

    fn alloc_pieces(&self, device: u32, piece_len: u64, pieces: u32) -> Result<DevicePtr> {
        shielded("allocating device memory", || self.alloc_run(device, piece_len, pieces))
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        shielded("freeing device memory", || {
            if let Some(run) = self.lock().runs.remove(&ptr.0) {
                return ipc::close(run, 0);
            }
            // cuMemFree needs a current context: the allocation's, bound
            // here, so a finalizer thread with none frees it too.
            let device = self.lock().allocations.get(&ptr.0).copied();
            let device = device.ok_or_else(|| cuda_error(format!("{:#x} was not allocated here", ptr.0)))?;
            let _bound = self.bind(device)?;
            // SAFETY: our caller's contract: nothing uses the allocation.
            check(unsafe { sys::cuMemFree_v2(ptr.0) }, "freeing device memory")?;
            self.lock().allocations.remove(&ptr.0);
            Ok(())
        })
    }

    fn export(&self, addr: u64, len: u64) -> Result<Export> {
        shielded("exporting device memory", || self.export_range(addr, len))
    }

    fn export_dmabuf(&self, addr: u64, len: u64) -> Result<DmaBuf> {
        shielded("exporting device memory as dma-buf", || self.dmabuf_range(addr, len))
    }

    fn flush_rdma_writes(&self, device: u32) -> Result<bool> {
        shielded("flushing GPUDirect RDMA writes", || self.flush_gdr_writes(device))
    }

    fn share(&self, handle: &IpcHandle) -> Result<Option<crate::gpu::Shareable>> {
        shielded("sharing device memory", || self.share_handle(handle))
    }

    fn open(&self, handles: &[IpcHandle], fds: crate::gpu::FdSource<'_>) -> Result<DevicePtr> {
        shielded("opening a peer's device memory", || self.open_export(handles, fds))
    }

    fn opened_device(&self, ptr: DevicePtr) -> Option<u32> {
        self.lock().opened.get(&ptr.0)?.last().and_then(ipc::Opened::context_device)
    }

    unsafe fn close(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: our caller's contract: no copy uses it.
        shielded("closing a peer's device memory", || unsafe { self.close_export(ptr) })
    }

    fn create_stream(&self, device: u32) -> Result<Stream> {
        shielded("creating a stream", || {
            let _bound = self.bind(device)?;
            let mut stream: sys::CUstream = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
            // SAFETY: writes one stream handle.
            check(unsafe { sys::cuStreamCreate(&mut stream, flags) }, "creating a stream")?;
            let mut state = self.lock();
            let id = state.take_id();
            state.streams.insert(id, (device, Raw(stream)));
            Ok(Stream(id))
        })
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        shielded("destroying a stream", || {
            let (device, raw) = self.lock().streams.remove(&stream.0).ok_or_else(|| cuda_error("no such stream"))?;
            let _bound = self.bind(device)?;
            if let Some(ring) = self.lock().rings.remove(&stream.0) {
                ring.free(raw.0);
            }
            // SAFETY: a stream this provider created, now out of its table.
            check(unsafe { sys::cuStreamDestroy_v2(raw.0) }, "destroying a stream")
        })
    }

    fn wait_caller_stream(&self, device: u32, stream: u64, timeout: std::time::Duration) -> Result<()> {
        shielded("waiting for the caller's stream", || {
            // An event recorded now marks the work queued so far; polling
            // the stream itself would also wait for work queued after this
            // call (a decode loop's stream is rarely idle).
            let event = self.mark_caller_stream(device, stream)?;
            let deadline = crate::deadline::deadline_after(timeout);
            let waited = loop {
                // SAFETY: a live event made just above.
                match unsafe { sys::cuEventQuery(event.0) } {
                    sys::CUresult::CUDA_SUCCESS => break Ok(()),
                    sys::CUresult::CUDA_ERROR_NOT_READY if std::time::Instant::now() < deadline => {
                        std::thread::sleep(std::time::Duration::from_micros(20))
                    }
                    sys::CUresult::CUDA_ERROR_NOT_READY => break Err(Error::timeout("the caller's stream", timeout)),
                    other => break check(other, "the caller's stream"),
                }
            };
            // SAFETY: an event made above, no longer polled.
            unsafe { sys::cuEventDestroy_v2(event.0) };
            waited
        })
    }

    fn copy_method(&self) -> CopyMethod {
        let kernel = shielded("loading the copy kernel", || Ok(self.kernel(0).is_some())).unwrap_or(false);
        choose_method(TierInputs {
            driver_version: self.driver_version,
            batch_api: self.batch_copy.is_some(),
            kernel_ready: kernel,
            host_pinned: true,
            peers_reachable: true,
        })
    }

    unsafe fn copy_batch(&self, stream: Stream, copies: &[Copy], sides: &[CopySides]) -> Result<CopyMethod> {
        shielded("a batch of copies", || {
            let (device, raw) = self.stream(stream)?;
            let _bound = self.bind(device)?;
            if copies.is_empty() {
                return Ok(self.copy_method());
            }
            // SAFETY: forwarded from our caller.
            unsafe { self.issue(device, stream, raw.0, copies, sides) }
        })
    }

    unsafe fn copy_one(&self, stream: Stream, copy: Copy) -> Result<()> {
        shielded("a copy", || {
            let (device, raw) = self.stream(stream)?;
            let _bound = self.bind(device)?;
            // SAFETY: the range is our caller's; UVA resolves the direction.
            check(unsafe { sys::cuMemcpyAsync(copy.dst, copy.src, copy.len as usize, raw.0) }, "a copy")
        })
    }

    fn create_event(&self, device: u32) -> Result<Event> {
        shielded("creating an event", || {
            let _bound = self.bind(device)?;
            let mut event: sys::CUevent = std::ptr::null_mut();
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
            // SAFETY: writes one event handle.
            check(unsafe { sys::cuEventCreate(&mut event, flags) }, "creating an event")?;
            let mut state = self.lock();
            let id = state.take_id();
            state.events.insert(id, (device, Raw(event)));
            Ok(Event(id))
        })
    }

    fn record(&self, stream: Stream, event: Event) -> Result<()> {
        shielded("recording an event", || {
            let (device, stream) = self.stream(stream)?;
            let (_, event) = *self.lock().events.get(&event.0).ok_or_else(|| cuda_error("no such event"))?;
            let _bound = self.bind(device)?;
            // SAFETY: both handles are live (in the provider's tables).
            check(unsafe { sys::cuEventRecord(event.0, stream.0) }, "recording an event")
        })
    }

    fn query(&self, event: Event) -> Result<bool> {
        shielded("polling an event", || {
            let (device, raw) = *self.lock().events.get(&event.0).ok_or_else(|| cuda_error("no such event"))?;
            let _bound = self.bind(device)?;
            // SAFETY: a live event.
            match unsafe { sys::cuEventQuery(raw.0) } {
                sys::CUresult::CUDA_SUCCESS => Ok(true),
                sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                other => check(other, "a copy on the device").map(|()| false),
            }
        })
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        shielded("destroying an event", || {
            let (device, raw) = self.lock().events.remove(&event.0).ok_or_else(|| cuda_error("no such event"))?;
            let _bound = self.bind(device)?;
            // SAFETY: an event this provider created, now out of its table.
            check(unsafe { sys::cuEventDestroy_v2(raw.0) }, "destroying an event")
        })
    }

    unsafe fn host_register(&self, addr: u64, len: u64) -> Result<()> {
        shielded("pinning host memory", || {
            let _bound = self.bind(self.home())?;
            let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
            // SAFETY: our caller keeps the range mapped until it unregisters.
            let result = unsafe { sys::cuMemHostRegister_v2(addr as *mut c_void, len as usize, flags) };
            check(result, "pinning host memory")?;
            self.lock().pinned.insert(addr, len);
            Ok(())
        })
    }

    fn host_is_pinned(&self, addr: u64) -> bool {
        shielded("asking whether host memory is pinned", || {
            let mut kind = 0u32;
            let mut attributes = [sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE];
            let mut data: [*mut c_void; 1] = [(&mut kind as *mut u32).cast()];
            // cuPointerGetAttributes gives a pointer CUDA does not know
            // default values (0) instead of an error, and needs no context.
            // SAFETY: the one data pointer points at a u32, what MEMORY_TYPE writes.
            let result = unsafe { sys::cuPointerGetAttributes(1, attributes.as_mut_ptr(), data.as_mut_ptr(), addr) };
            check(result, "asking whether host memory is pinned")?;
            // 1 is CU_MEMORYTYPE_HOST: allocated or registered with CUDA.
            Ok(kind == 1)
        })
        .unwrap_or(false)
    }

    fn host_unregister(&self, addr: u64) -> Result<()> {
        shielded("unpinning host memory", || {
            let _bound = self.bind(self.home())?;
            self.lock().pinned.remove(&addr);
            // SAFETY: the driver checks that the address was registered.
            check(unsafe { sys::cuMemHostUnregister(addr as *mut c_void) }, "unpinning host memory")
        })
    }
}

/// Runs `call`, turning a panic inside it (cudarc's, for a driver function
/// the loaded driver lacks) into an error naming what was being done: no
/// panic from the driver bindings ever reaches a lane, C or Python.
fn shielded<T>(doing: &str, call: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)).unwrap_or_else(|panic| {
        let detail = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("no message");
        Err(cuda_error(format!("{doing}: the CUDA driver bindings failed ({detail}); is the driver too old?")))
    })
}

fn cuda_error(reason: impl Into<String>) -> Error {
    Error::Gpu { device: "cuda".into(), reason: reason.into() }
}

/// A driver result as kvring's error, naming what was being done.
fn check(result: sys::CUresult, doing: &str) -> Result<()> {
    if result == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: writes one pointer to a static string, or fails.
    let named = unsafe { sys::cuGetErrorName(result, &mut name) } == sys::CUresult::CUDA_SUCCESS && !name.is_null();
    // SAFETY: the driver's static NUL-terminated string.
    let name = if named { unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned() } else { String::new() };
    let hint = match result as u32 {
        34 => {
            "; this libcuda is the CUDA toolkit's stub library (for linking only), found before the NVIDIA \
             driver's: take its directory off LD_LIBRARY_PATH"
        }
        100 => "; no GPU is visible to this process (check CUDA_VISIBLE_DEVICES and the container's devices)",
        _ => "",
    };
    Err(cuda_error(format!("{doing}: {name} ({}){hint}", result as u32)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_loading_says_so_and_never_panics() {
        if driver_present() {
            // A GPU host: the provider loads and lists its devices.
            let gpu = CudaGpu::load().expect("a driver is present");
            assert!(!gpu.devices().unwrap().is_empty());
            return;
        }
        let error = CudaGpu::load().unwrap_err().to_string();
        assert!(error.contains("no CUDA driver found") && error.contains("NVIDIA driver"), "{error}");
    }

    /// Symbols newer than the baseline are not even looked up on drivers
    /// that lack them: here, with no driver at all, a lookup would panic.
    #[test]
    fn the_batch_api_is_looked_up_only_on_drivers_that_have_it() {
        if driver_present() {
            return; // a GPU host: the lookup would run for real
        }
        for version in [0, tier::BASELINE_DRIVER, tier::PROC_ADDRESS_DRIVER, tier::BATCH_API_DRIVER - 10] {
            assert!(batch_copy_12080(version).is_none(), "CUDA {version}");
        }
    }

    #[test]
    fn a_panic_in_the_driver_bindings_becomes_an_error() {
        let caught: Result<()> = shielded("a batch of copies", || panic!("Missing symbol cuMemcpyBatchAsync"));
        let error = caught.unwrap_err().to_string();
        assert!(error.contains("a batch of copies") && error.contains("cuMemcpyBatchAsync"), "{error}");
        assert!(error.contains("driver too old"), "{error}");
        assert_eq!(shielded("nothing", || Ok(7)).unwrap(), 7);
    }
}
