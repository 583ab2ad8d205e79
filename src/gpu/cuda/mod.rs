//! The real GPU provider: the CUDA driver API through cudarc, loaded at run
//! time, so kvring builds, runs and passes its tests where there is no CUDA
//! at all and says so when asked for a GPU.
//!
//! Every call is gated: cudarc panics on a missing library or symbol, and a
//! panic must never cross the C ABI or Python, so the library's presence is
//! checked once before anything else, and `cuMemcpyBatchAsync` is used only
//! when the driver hands it out for the 12.8 ABI (otherwise one copy call
//! per triple, and the method is reported). Each operation makes its
//! device's primary context current on the calling thread first: the
//! context the CUDA runtime (and PyTorch) uses, so their pointers and ours
//! are the same. Classifying, exporting and opening memory is `ipc.rs`.

mod ipc;
mod kernel;

use super::{Copy, CopyMethod, DevicePtr, Event, Export, Gpu, GpuDevice, IpcHandle, Memory, Stream};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// `cuMemcpyBatchAsync` as the 12.8 ABI has it (with `failIdx`).
type BatchCopy = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut sys::CUmemcpyAttributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;

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

/// The provider over the CUDA driver.
#[derive(Debug)]
pub struct CudaGpu {
    /// Per device: its handle and retained primary context.
    contexts: Vec<(sys::CUdevice, Raw<sys::CUcontext>)>,
    batch_copy: Option<BatchCopy>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    streams: HashMap<u64, (u32, Raw<sys::CUstream>)>,
    events: HashMap<u64, (u32, Raw<sys::CUevent>)>,
    /// Peers' exports opened here, by the pointer `open` returned.
    opened: HashMap<u64, Vec<ipc::Opened>>,
    /// Legacy handles opened here: their base and how many opens hold them.
    legacy: HashMap<[u8; 64], (u64, u32)>,
    /// Runs of pieces this provider allocated, by their address.
    runs: HashMap<u64, ipc::Opened>,
    /// The copy kernel per device, once loaded (`None`: it did not load).
    kernels: HashMap<u32, Option<kernel::Loaded>>,
    /// The copy kernel's descriptor ring of each stream that launched it.
    rings: HashMap<u64, kernel::Ring>,
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
    /// context; a clear error when there is no driver or no device.
    pub fn load() -> Result<Self> {
        if !driver_present() {
            return Err(cuda_error(
                "no CUDA driver found (libcuda.so.1 does not load): device memory needs the NVIDIA driver \
                 (kvring's tests run the GPU paths on a simulated provider without one)",
            ));
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
            let mut context: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: writes one context handle for a valid device.
            check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, device) }, "retaining a GPU's context")?;
            contexts.push((device, Raw(context)));
        }
        if contexts.is_empty() {
            return Err(cuda_error("the CUDA driver loaded but lists no GPU"));
        }
        // SAFETY: the first device's context, retained just above.
        check(unsafe { sys::cuCtxSetCurrent(contexts[0].1 .0) }, "making a GPU's context current")?;
        let batch_copy = batch_copy_12080();
        Ok(Self { contexts, batch_copy, state: Mutex::new(State::default()) })
    }

    /// Makes `device`'s primary context current on this thread.
    fn bind(&self, device: u32) -> Result<()> {
        let (_, context) = self
            .contexts
            .get(device as usize)
            .ok_or_else(|| cuda_error(format!("no GPU {device} (this host has {})", self.contexts.len())))?;
        // SAFETY: a context this provider retained.
        check(unsafe { sys::cuCtxSetCurrent(context.0) }, "making a GPU's context current")
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
        if let Some(&known) = self.lock().kernels.get(&device) {
            return known;
        }
        let loaded = self.bind(device).and_then(|()| kernel::load());
        if let Err(error) = &loaded {
            tracing::warn!(%error, gpu = device, "the copy kernel did not load: one copy call per run instead");
        }
        let loaded = loaded.ok();
        self.lock().kernels.insert(device, loaded);
        loaded
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
        let mut state = std::mem::take(self.state.get_mut().unwrap_or_else(|p| p.into_inner()));
        let _ = self.bind(0);
        for (opened, base) in state.take_opened() {
            let _ = ipc::close(opened, base);
        }
        for (_, run) in state.runs.drain() {
            let _ = ipc::close(run, 0);
        }
        for (id, ring) in state.rings.drain() {
            if let Some((device, stream)) = state.streams.get(&id) {
                let _ = self.bind(*device);
                ring.free(stream.0);
            }
        }
        for (_, (device, event)) in state.events {
            let _ = self.bind(device);
            // SAFETY: an event this provider created and nothing uses now.
            unsafe { sys::cuEventDestroy_v2(event.0) };
        }
        for (_, (device, stream)) in state.streams {
            let _ = self.bind(device);
            // SAFETY: a stream this provider created and nothing uses now.
            unsafe { sys::cuStreamDestroy_v2(stream.0) };
        }
        for (device, _) in &self.contexts {
            // SAFETY: one release per retain in `load`.
            unsafe { sys::cuDevicePrimaryCtxRelease_v2(*device) };
        }
    }
}

impl Gpu for CudaGpu {
    fn provider(&self) -> &'static str {
        "cuda"
    }

    fn devices(&self) -> Result<Vec<GpuDevice>> {
        self.contexts.iter().enumerate().map(|(ordinal, (device, _))| describe(ordinal as u32, *device)).collect()
    }

    fn classify(&self, addr: u64, len: u64) -> Result<Memory> {
        self.classify_range(addr, len)
    }

    fn alloc(&self, device: u32, len: u64) -> Result<DevicePtr> {
        self.bind(device)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len as usize) }, "allocating device memory")?;
        Ok(DevicePtr(ptr))
    }

    fn alloc_pieces(&self, device: u32, piece_len: u64, pieces: u32) -> Result<DevicePtr> {
        self.alloc_run(device, piece_len, pieces)
    }

    unsafe fn free(&self, ptr: DevicePtr) -> Result<()> {
        if let Some(run) = self.lock().runs.remove(&ptr.0) {
            self.bind(0)?;
            return ipc::close(run, 0);
        }
        // SAFETY: our caller's contract: nothing uses the allocation.
        check(unsafe { sys::cuMemFree_v2(ptr.0) }, "freeing device memory")
    }

    fn export(&self, addr: u64, len: u64) -> Result<Export> {
        self.export_range(addr, len)
    }

    fn open(&self, handles: &[IpcHandle]) -> Result<DevicePtr> {
        self.open_export(handles)
    }

    unsafe fn close(&self, ptr: DevicePtr) -> Result<()> {
        // SAFETY: our caller's contract: no copy uses it.
        unsafe { self.close_export(ptr) }
    }

    fn create_stream(&self, device: u32) -> Result<Stream> {
        self.bind(device)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
        // SAFETY: writes one stream handle.
        check(unsafe { sys::cuStreamCreate(&mut stream, flags) }, "creating a stream")?;
        let mut state = self.lock();
        let id = state.take_id();
        state.streams.insert(id, (device, Raw(stream)));
        Ok(Stream(id))
    }

    fn destroy_stream(&self, stream: Stream) -> Result<()> {
        let (device, raw) = self.lock().streams.remove(&stream.0).ok_or_else(|| cuda_error("no such stream"))?;
        self.bind(device)?;
        if let Some(ring) = self.lock().rings.remove(&stream.0) {
            ring.free(raw.0);
        }
        // SAFETY: a stream this provider created, now out of its table.
        check(unsafe { sys::cuStreamDestroy_v2(raw.0) }, "destroying a stream")
    }

    fn copy_method(&self) -> CopyMethod {
        match (self.batch_copy.is_some(), self.kernel(0).is_some()) {
            (true, _) => CopyMethod::Batched,
            (false, true) => CopyMethod::Kernel,
            (false, false) => CopyMethod::PerCopy,
        }
    }

    unsafe fn copy_batch(&self, stream: Stream, copies: &[Copy]) -> Result<CopyMethod> {
        let (device, raw) = *self.lock().streams.get(&stream.0).ok_or_else(|| cuda_error("no such stream"))?;
        self.bind(device)?;
        if copies.is_empty() {
            return Ok(self.copy_method());
        }
        if let Some(batch) = self.batch_copy {
            let mut dsts: Vec<u64> = copies.iter().map(|c| c.dst).collect();
            let mut srcs: Vec<u64> = copies.iter().map(|c| c.src).collect();
            let mut sizes: Vec<usize> = copies.iter().map(|c| c.len as usize).collect();
            let nowhere = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID, id: 0 };
            let mut attributes = [sys::CUmemcpyAttributes {
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                srcLocHint: nowhere,
                dstLocHint: nowhere,
                flags: 0,
            }];
            let mut first = [0usize];
            let mut failed = usize::MAX;
            // SAFETY: the arrays hold `copies.len()` entries each and one
            // attribute set covering them all; the ranges are our caller's.
            let result = unsafe {
                batch(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    copies.len(),
                    attributes.as_mut_ptr(),
                    first.as_mut_ptr(),
                    1,
                    &mut failed,
                    raw.0,
                )
            };
            check(result, &format!("a batched copy (copy {failed} refused)"))?;
            return Ok(CopyMethod::Batched);
        }
        if let Some(kernel) = self.kernel(device) {
            let mut state = self.lock();
            if let std::collections::hash_map::Entry::Vacant(slot) = state.rings.entry(stream.0) {
                slot.insert(kernel::Ring::new()?);
            }
            let ring = state.rings.get_mut(&stream.0).expect("inserted above");
            // SAFETY: forwarded from our caller.
            if unsafe { ring.launch(kernel, raw.0, copies)? } {
                return Ok(CopyMethod::Kernel);
            }
        }
        for copy in copies {
            // SAFETY: the ranges are our caller's; UVA resolves directions.
            let result = unsafe { sys::cuMemcpyAsync(copy.dst, copy.src, copy.len as usize, raw.0) };
            check(result, "a copy")?;
        }
        Ok(CopyMethod::PerCopy)
    }

    fn create_event(&self, device: u32) -> Result<Event> {
        self.bind(device)?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        // SAFETY: writes one event handle.
        check(unsafe { sys::cuEventCreate(&mut event, flags) }, "creating an event")?;
        let mut state = self.lock();
        let id = state.take_id();
        state.events.insert(id, (device, Raw(event)));
        Ok(Event(id))
    }

    fn record(&self, stream: Stream, event: Event) -> Result<()> {
        let (device, stream) = *self.lock().streams.get(&stream.0).ok_or_else(|| cuda_error("no such stream"))?;
        let (_, event) = *self.lock().events.get(&event.0).ok_or_else(|| cuda_error("no such event"))?;
        self.bind(device)?;
        // SAFETY: both handles are live (in the provider's tables).
        check(unsafe { sys::cuEventRecord(event.0, stream.0) }, "recording an event")
    }

    fn query(&self, event: Event) -> Result<bool> {
        let (device, raw) = *self.lock().events.get(&event.0).ok_or_else(|| cuda_error("no such event"))?;
        self.bind(device)?;
        // SAFETY: a live event.
        match unsafe { sys::cuEventQuery(raw.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check(other, "a copy on the device").map(|()| false),
        }
    }

    fn destroy_event(&self, event: Event) -> Result<()> {
        let (device, raw) = self.lock().events.remove(&event.0).ok_or_else(|| cuda_error("no such event"))?;
        self.bind(device)?;
        // SAFETY: an event this provider created, now out of its table.
        check(unsafe { sys::cuEventDestroy_v2(raw.0) }, "destroying an event")
    }

    unsafe fn host_register(&self, addr: u64, len: u64) -> Result<()> {
        self.bind(0)?;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: our caller keeps the range mapped until it unregisters.
        check(unsafe { sys::cuMemHostRegister_v2(addr as *mut c_void, len as usize, flags) }, "pinning host memory")
    }

    fn host_unregister(&self, addr: u64) -> Result<()> {
        self.bind(0)?;
        // SAFETY: the driver checks that the address was registered.
        check(unsafe { sys::cuMemHostUnregister(addr as *mut c_void) }, "unpinning host memory")
    }
}

/// One device's name, memory and PCI address.
fn describe(ordinal: u32, device: sys::CUdevice) -> Result<GpuDevice> {
    let mut name = [0 as c_char; 256];
    // SAFETY: writes at most `name.len()` bytes, NUL-terminated.
    check(unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, device) }, "naming a GPU")?;
    let mut memory: usize = 0;
    // SAFETY: writes one size.
    check(unsafe { sys::cuDeviceTotalMem_v2(&mut memory, device) }, "sizing a GPU's memory")?;
    let mut bus = [0 as c_char; 32];
    // SAFETY: writes at most `bus.len()` bytes, NUL-terminated.
    let bus_known = unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, device) }
        == sys::CUresult::CUDA_SUCCESS;
    // SAFETY: both buffers were NUL-terminated by the driver (zeroed before).
    let text = |buffer: &[c_char]| unsafe { CStr::from_ptr(buffer.as_ptr()) }.to_string_lossy().into_owned();
    let pci_bus = bus_known.then(|| text(&bus).to_lowercase());
    let numa_node = pci_bus.as_deref().and_then(|bus| {
        let path = format!("/sys/bus/pci/devices/{bus}/numa_node");
        std::fs::read_to_string(path).ok()?.trim().parse::<i64>().ok().and_then(|n| u32::try_from(n).ok())
    });
    Ok(GpuDevice { ordinal, name: text(&name), memory_bytes: memory as u64, pci_bus, numa_node })
}

/// The 12.8-ABI `cuMemcpyBatchAsync`, when the driver has it (asked for
/// by ABI version: a 13.x driver also exports a `_v2` without `failIdx`).
fn batch_copy_12080() -> Option<BatchCopy> {
    let mut pointer: *mut c_void = std::ptr::null_mut();
    let mut status = sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    // SAFETY: a NUL-terminated name and two out-pointers.
    let result =
        unsafe { sys::cuGetProcAddress_v2(c"cuMemcpyBatchAsync".as_ptr(), &mut pointer, 12080, 0, &mut status) };
    if result != sys::CUresult::CUDA_SUCCESS
        || pointer.is_null()
        || status != sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS
    {
        return None;
    }
    // SAFETY: the driver returned this entry point for the 12.8 ABI, whose
    // signature `BatchCopy` is.
    Some(unsafe { std::mem::transmute::<*mut c_void, BatchCopy>(pointer) })
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
    Err(cuda_error(format!("{doing}: {name} ({})", result as u32)))
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
}
