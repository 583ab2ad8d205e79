//! A fake CUDA driver (`libcuda.so`) for kvring's tests: the entry points
//! kvring resolves, on host memory no host thread can touch, holding the
//! caller to the driver's *documented* rules. Every rule cites the section
//! of NVIDIA's "CUDA Driver API" reference (docs.nvidia.com/cuda/
//! cuda-driver-api) it follows, written `[ref: SECTION, FUNCTION]`.
//!
//! Device memory is a memfd mapped `PROT_NONE` at the address handed out
//! (a host dereference faults, as on a real GPU) with a private read-write
//! alias that only the stream workers (the "copy engines") use. Each stream
//! is a worker thread running its queue in order; events mark positions in
//! a queue.
//!
//! Configuration (read at `cuInit`): `FAKECUDA_VERSION` (11040, 12060,
//! 12080, 13000; default 12080), `FAKECUDA_GPUS` (physical GPUs, default
//! 2; `CUDA_VISIBLE_DEVICES` picks and orders them as the driver does, and
//! `cuDeviceGetUuid` names each physical GPU alike in every process),
//! `FAKECUDA_INIT_ERROR` (a `CUresult` `cuInit` returns), `FAKECUDA_PEER`
//! (0: no GPU pair can access each other), `FAKECUDA_DELAY_US` (each queued
//! job runs that late), `FAKECUDA_GDR_VMM` (0: the devices report no
//! `GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`), `FAKECUDA_DMABUF` (0: the
//! devices report no `DMA_BUF_SUPPORTED` and export no dma-buf),
//! `FAKECUDA_GDR_ORDERING` (`GPU_DIRECT_RDMA_WRITES_ORDERING`, default 0,
//! none), `FAKECUDA_GDR_FLUSH_OPTIONS` (`GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS`,
//! default 1, `cuFlushGPUDirectRDMAWrites` supported), `FAKECUDA_SM` (compute
//! capability, default 90: the JIT refuses PTX for a higher target),
//! `FAKECUDA_HOST_NUMA` (`HOST_NUMA_ID` of every GPU, default -1: no NUMA). Introspection and faults go through two symbols
//! kvring never calls: `fakecuda_stat(name)` and `fakecuda_set(name, value)`
//! (see `stat` and `set`), which tests find with `dlsym`.

#![allow(non_snake_case, clippy::missing_safety_doc)]

mod exec;
mod gdr;
mod mem;

use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

pub type CUresult = c_uint;
pub type CUdevice = c_int;
pub type CUcontext = *mut c_void;
pub type CUdeviceptr = u64;

/// `CUresult` values used here [ref: 6.1 Data types, enum cudaError_enum].
pub mod err {
    use super::CUresult;
    pub const SUCCESS: CUresult = 0;
    pub const INVALID_VALUE: CUresult = 1;
    pub const OUT_OF_MEMORY: CUresult = 2;
    pub const NOT_INITIALIZED: CUresult = 3;
    pub const STUB_LIBRARY: CUresult = 34;
    pub const NO_DEVICE: CUresult = 100;
    pub const INVALID_DEVICE: CUresult = 101;
    pub const INVALID_IMAGE: CUresult = 200;
    pub const INVALID_CONTEXT: CUresult = 201;
    pub const MAP_FAILED: CUresult = 205;
    pub const ALREADY_MAPPED: CUresult = 208;
    pub const PEER_ACCESS_UNSUPPORTED: CUresult = 217;
    pub const INVALID_PTX: CUresult = 218;
    pub const OPERATING_SYSTEM: CUresult = 304;
    pub const INVALID_HANDLE: CUresult = 400;
    pub const NOT_FOUND: CUresult = 500;
    pub const NOT_READY: CUresult = 600;
    pub const ILLEGAL_ADDRESS: CUresult = 700;
    pub const PEER_ACCESS_ALREADY_ENABLED: CUresult = 704;
    pub const HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
    pub const HOST_MEMORY_NOT_REGISTERED: CUresult = 713;
    pub const NOT_PERMITTED: CUresult = 800;
    pub const NOT_SUPPORTED: CUresult = 801;
}

/// What the environment asked for at `cuInit`.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    version: c_int,
    init_error: CUresult,
    peer: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
    pub(crate) gdr_vmm: bool,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub(crate) dmabuf: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`.
    pub(crate) gdr_ordering: i32,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS`.
    pub(crate) gdr_flush_options: i32,
    /// The devices' compute capability, as major * 10 + minor.
    pub(crate) sm: i32,
    /// The IMEX channel this process was granted (`FAKECUDA_IMEX_CHANNEL`),
    /// which FABRIC handles need; `None`: no channel.
    pub(crate) imex_channel: Option<u32>,
    /// `CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID` of every GPU (`FAKECUDA_HOST_NUMA`;
    /// -1, the driver's "system does not support NUMA", by default).
    host_numa: i32,
    /// The physical GPUs this process sees, in ordinal order
    /// (`CUDA_VISIBLE_DEVICES`).
    visible: Vec<i32>,
}

fn env_num(name: &str, default: i64) -> i64 {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default)
}

fn config() -> Config {
    Config {
        version: env_num("FAKECUDA_VERSION", 12080) as c_int,
        init_error: env_num("FAKECUDA_INIT_ERROR", 0) as CUresult,
        peer: env_num("FAKECUDA_PEER", 1) != 0,
        gdr_vmm: env_num("FAKECUDA_GDR_VMM", 1) != 0,
        dmabuf: env_num("FAKECUDA_DMABUF", 1) != 0,
        gdr_ordering: env_num("FAKECUDA_GDR_ORDERING", 0) as i32,
        gdr_flush_options: env_num("FAKECUDA_GDR_FLUSH_OPTIONS", 1) as i32,
        sm: env_num("FAKECUDA_SM", 90) as i32,
        imex_channel: u32::try_from(env_num("FAKECUDA_IMEX_CHANNEL", -1)).ok(),
        host_numa: env_num("FAKECUDA_HOST_NUMA", -1) as i32,
        visible: visible_devices(env_num("FAKECUDA_GPUS", 2).clamp(0, 64) as i32),
    }
}

/// The physical GPUs (of `gpus`) `CUDA_VISIBLE_DEVICES` shows, in the order
/// it lists them: [ref: CUDA C++ Programming Guide, "CUDA Environment
/// Variables", CUDA_VISIBLE_DEVICES: "Only the devices whose index is
/// present in the sequence are visible to CUDA applications and they are
/// enumerated in the order of the sequence. If one of the indices is
/// invalid, only the devices whose index precedes the invalid index are
/// visible"]. Unset: every GPU, in order. (UUIDs in the list are not
/// modelled.)
fn visible_devices(gpus: i32) -> Vec<i32> {
    let Ok(list) = std::env::var("CUDA_VISIBLE_DEVICES") else { return (0..gpus).collect() };
    let mut seen = Vec::new();
    for entry in list.split(',') {
        match entry.trim().parse::<i32>() {
            Ok(index) if (0..gpus).contains(&index) && !seen.contains(&index) => seen.push(index),
            _ => break,
        }
    }
    seen
}

/// One device's primary context.
#[derive(Debug, Default)]
struct Primary {
    /// `cuDevicePrimaryCtxRetain` calls not yet released.
    retains: u32,
    /// Times the context was created (retain count going 0 → 1).
    created: u32,
    /// A sticky error: once a kernel or copy faulted in this context,
    /// every call in it returns this.
    sticky: CUresult,
    /// Devices this context has peer access to.
    peers: HashSet<i32>,
}

/// The driver's state in this process.
pub(crate) struct Driver {
    pub(crate) config: Config,
    primaries: Vec<Primary>,
    pub(crate) mem: mem::Memory,
    pub(crate) exec: exec::Exec,
}

static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);

/// Counters tests read with `fakecuda_stat`.
pub(crate) struct Counters {
    pub staged: AtomicI64,
    pub stalls: AtomicI64,
    pub sync_copies: AtomicI64,
    pub batches: AtomicI64,
    pub copies: AtomicI64,
    pub kernels: AtomicI64,
    pub missing_calls: AtomicI64,
    pub faults: AtomicI64,
    /// `cuFlushGPUDirectRDMAWrites` calls that flushed.
    pub gdr_flushes: AtomicI64,
    /// Copies still to run before the next injected fault (-1: none).
    pub fault_after: AtomicI64,
    /// Microseconds each queued job waits before running.
    pub delay_us: AtomicI64,
    /// Peers' allocations opened (`cuIpcOpenMemHandle` calls that
    /// succeeded) and closed (`cuIpcCloseMemHandle` calls that succeeded).
    pub ipc_opens: AtomicI64,
    pub ipc_closes: AtomicI64,
    /// Openings of a peer's memory still to fail, as for a peer that
    /// exited (injected).
    pub fail_opens: AtomicI64,
    /// Batched copy calls still to accept before one is refused (-1: none;
    /// injected).
    pub refuse_after: AtomicI64,
}

pub(crate) static COUNTERS: Counters = Counters {
    staged: AtomicI64::new(0),
    stalls: AtomicI64::new(0),
    sync_copies: AtomicI64::new(0),
    batches: AtomicI64::new(0),
    copies: AtomicI64::new(0),
    kernels: AtomicI64::new(0),
    missing_calls: AtomicI64::new(0),
    gdr_flushes: AtomicI64::new(0),
    faults: AtomicI64::new(0),
    fault_after: AtomicI64::new(-1),
    delay_us: AtomicI64::new(-1),
    ipc_opens: AtomicI64::new(0),
    ipc_closes: AtomicI64::new(0),
    fail_opens: AtomicI64::new(0),
    refuse_after: AtomicI64::new(-1),
};

/// True (and the injection spent) when the next opening of a peer's
/// memory is to fail as one of an exited peer's does: `INVALID_HANDLE`,
/// what `cuIpcOpenMemHandle` and `cuMemImportFromShareableHandle` return
/// for a handle that names no live memory [ref: 6.13 cuIpcOpenMemHandle,
/// 6.14 cuMemImportFromShareableHandle, return values].
pub(crate) fn open_fails() -> bool {
    COUNTERS.fail_opens.fetch_update(Relaxed, Relaxed, |n| (n > 0).then(|| n - 1)).is_ok()
}

/// Locks the driver; `None` before a successful `cuInit`.
pub(crate) fn driver() -> MutexGuard<'static, Option<Driver>> {
    DRIVER.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `f` on the initialised driver. [ref: 6.3 Initialization: "If
/// cuInit() has not been called, any function from the driver API will
/// return CUDA_ERROR_NOT_INITIALIZED."]
pub(crate) fn with<R>(f: impl FnOnce(&mut Driver) -> Result<R, CUresult>) -> Result<R, CUresult> {
    let mut guard = driver();
    match guard.as_mut() {
        Some(driver) => f(driver),
        None => Err(err::NOT_INITIALIZED),
    }
}

pub(crate) fn code(result: Result<(), CUresult>) -> CUresult {
    result.err().unwrap_or(err::SUCCESS)
}

// ---------------------------------------------------------------------------
// Contexts: a per-thread stack, whose top is the current context
// [ref: 6.8 Context Management, cuCtxSetCurrent / cuCtxPushCurrent].
// ---------------------------------------------------------------------------

thread_local! {
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// The handle of device `d`'s primary context (never dereferenced).
fn context_handle(device: i32) -> CUcontext {
    (0xC7C7_0000usize + device as usize * 0x10) as CUcontext
}

fn context_device(ctx: CUcontext) -> Option<i32> {
    let value = ctx as usize;
    ((0xC7C7_0000..0xC7C7_0000 + 64 * 0x10).contains(&value) && value.is_multiple_of(0x10))
        .then(|| ((value - 0xC7C7_0000) / 0x10) as i32)
}

/// The calling thread's current context's device, if any.
pub(crate) fn current_raw() -> Option<i32> {
    STACK.with(|s| s.borrow().last().copied()).and_then(|c| context_device(c as CUcontext))
}

impl Driver {
    /// The device of the calling thread's current context, which must be
    /// live and not poisoned. [ref: 6.8 Context Management: calls that use
    /// the current context return CUDA_ERROR_INVALID_CONTEXT when "there is
    /// no context bound to the current thread"; 6.2 Error Handling: after
    /// an error such as CUDA_ERROR_ILLEGAL_ADDRESS "the context cannot be
    /// used, so it must be destroyed".]
    pub(crate) fn current(&self) -> Result<i32, CUresult> {
        let device = current_raw().ok_or(err::INVALID_CONTEXT)?;
        self.context_usable(device)?;
        Ok(device)
    }

    /// `device`'s context exists and carries no sticky error.
    pub(crate) fn context_usable(&self, device: i32) -> Result<(), CUresult> {
        let primary = self.primaries.get(device as usize).ok_or(err::INVALID_CONTEXT)?;
        if primary.retains == 0 {
            return Err(err::INVALID_CONTEXT);
        }
        if primary.sticky != err::SUCCESS {
            return Err(primary.sticky);
        }
        Ok(())
    }

    pub(crate) fn device_count(&self) -> usize {
        self.config.visible.len()
    }

    /// The physical GPU behind this process's ordinal `device`.
    pub(crate) fn physical(&self, device: i32) -> i32 {
        self.config.visible[device as usize]
    }

    /// This process's ordinal of physical GPU `physical`; `None` where
    /// `CUDA_VISIBLE_DEVICES` hides it.
    pub(crate) fn ordinal_of_physical(&self, physical: i32) -> Option<i32> {
        self.config.visible.iter().position(|&p| p == physical).map(|o| o as i32)
    }

    pub(crate) fn check_device(&self, device: CUdevice) -> Result<i32, CUresult> {
        if device < 0 || device as usize >= self.device_count() {
            return Err(err::INVALID_DEVICE);
        }
        Ok(device)
    }

    /// Poisons `device`'s context (a fault in it).
    pub(crate) fn poison(&mut self, device: i32, error: CUresult) {
        if let Some(primary) = self.primaries.get_mut(device as usize) {
            primary.sticky = error;
        }
    }

    pub(crate) fn sticky(&self, device: i32) -> CUresult {
        self.primaries.get(device as usize).map_or(err::SUCCESS, |p| p.sticky)
    }

    /// Whether `from`'s context has peer access to `to`'s memory.
    pub(crate) fn peer_enabled(&self, from: i32, to: i32) -> bool {
        from == to || self.primaries.get(from as usize).is_some_and(|p| p.peers.contains(&to))
    }

    pub(crate) fn version(&self) -> c_int {
        self.config.version
    }
}

/// Writes `value` through `out` when `out` is not null.
pub(crate) unsafe fn put<T>(out: *mut T, value: T) -> Result<(), CUresult> {
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    // SAFETY: not null (checked above); the caller vouches it is valid.
    unsafe { out.write_unaligned(value) };
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    // [ref: 6.4 Version Management: callable before cuInit.]
    let wanted = config().version;
    // SAFETY: an out-pointer the caller passes under the Driver API's contract
    // (valid for this write or null); `put` refuses null.
    code(unsafe { put(version, wanted) })
}

#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> CUresult {
    // [ref: 6.3 Initialization, cuInit: "Currently, the Flags parameter
    // must be 0."]
    if flags != 0 {
        return err::INVALID_VALUE;
    }
    let config = config();
    if config.init_error != err::SUCCESS {
        return config.init_error;
    }
    let mut guard = driver();
    if guard.is_none() {
        if config.visible.is_empty() {
            return err::NO_DEVICE;
        }
        let primaries = (0..config.visible.len()).map(|_| Primary::default()).collect();
        *guard = Some(Driver { primaries, mem: mem::Memory::new(), exec: exec::Exec::default(), config });
    }
    err::SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    // SAFETY: an out-pointer the caller passes under the Driver API's contract
    // (valid for this write or null); `put` refuses null.
    code(with(|d| unsafe { put(count, d.device_count() as c_int) }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    // SAFETY: an out-pointer the caller passes under the Driver API's contract
    // (valid for this write or null); `put` refuses null.
    code(with(|d| unsafe { put(device, d.check_device(ordinal)?) }))
}

/// Copies `text` into a caller's buffer of `len` bytes, NUL-terminated.
unsafe fn put_text(out: *mut c_char, len: c_int, text: &str) -> Result<(), CUresult> {
    if out.is_null() || len <= 0 {
        return Err(err::INVALID_VALUE);
    }
    let n = text.len().min(len as usize - 1);
    // SAFETY: `out` holds `len` > n bytes (the caller's contract, checked non-null above).
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr().cast(), out, n);
        *out.add(n) = 0;
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, device: CUdevice) -> CUresult {
    code(with(|d| {
        let device = d.check_device(device)?;
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put_text(name, len, &format!("Fake GPU {} (fakecuda)", d.physical(device))) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(bus: *mut c_char, len: c_int, device: CUdevice) -> CUresult {
    code(with(|d| {
        let device = d.check_device(device)?;
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put_text(bus, len, &format!("0000:{:02X}:00.0", 0xC0 + d.physical(device))) }
    }))
}

/// `CUuuid`: 16 bytes naming a physical GPU, the same in every process
/// whatever its `CUDA_VISIBLE_DEVICES` [ref: 6.5 Device Management,
/// cuDeviceGetUuid: "Return an UUID for the device"].
unsafe fn put_uuid(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    code(with(|d| {
        let device = d.check_device(device)?;
        let mut bytes = *b"FAKEGPU-\0\0\0\0\0\0\0\0";
        bytes[8..12].copy_from_slice(&d.physical(device).to_le_bytes());
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(uuid, bytes) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    // SAFETY: forwarded under this call's contract.
    unsafe { put_uuid(uuid, device) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], device: CUdevice) -> CUresult {
    // SAFETY: forwarded under this call's contract.
    unsafe { put_uuid(uuid, device) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult {
    code(with(|d| {
        d.check_device(device)?;
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(bytes, 16usize << 30) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(value: *mut c_int, attribute: c_int, device: CUdevice) -> CUresult {
    code(with(|d| {
        d.check_device(device)?;
        let answer = match attribute {
            41 => 1,                                           // UNIFIED_ADDRESSING: 64-bit Linux hosts have UVA
            91 => 1,                                           // CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
            102 => 1,                                          // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
            103 => 1,                                          // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
            110 => i32::from(d.config.gdr_vmm),                // GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
            124 => i32::from(d.config.dmabuf),                 // DMA_BUF_SUPPORTED
            128 => i32::from(d.config.imex_channel.is_some()), // HANDLE_TYPE_FABRIC_SUPPORTED
            117 => d.config.gdr_flush_options,                 // GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS
            118 => d.config.gdr_ordering,                      // GPU_DIRECT_RDMA_WRITES_ORDERING
            75 => d.config.sm / 10,                            // COMPUTE_CAPABILITY_MAJOR
            76 => d.config.sm % 10,                            // COMPUTE_CAPABILITY_MINOR
            // [ref: 6.5 Device Management, CUdevice_attribute,
            // CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID (CUDA 12.2): "NUMA ID of the
            // host node closest to the device. Returns -1 when system does
            // not support NUMA."] A driver older than 12.2 does not know it.
            134 if d.config.version >= 12020 => d.config.host_numa,
            // [ref: 6.5 Device Management, cuDeviceGetAttribute: an
            // attribute the driver does not know is CUDA_ERROR_INVALID_VALUE.]
            // One the fake does not model answers the same rather than a
            // made-up 0 a caller would act on: a new query of kvring's
            // fails loudly here until the fake models its documented value.
            _ => return Err(err::INVALID_VALUE),
        };
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(value, answer) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, device: CUdevice, peer: CUdevice) -> CUresult {
    code(with(|d| {
        let (a, b) = (d.check_device(device)?, d.check_device(peer)?);
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(can, c_int::from(a != b && d.config.peer)) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, device: CUdevice) -> CUresult {
    // [ref: 6.7 Primary Context Management, cuDevicePrimaryCtxRetain:
    // "Retains the primary context on the device, creating it if
    // necessary".]
    code(with(|d| {
        let device = d.check_device(device)?;
        let primary = &mut d.primaries[device as usize];
        if primary.retains == 0 {
            primary.created += 1;
            primary.sticky = err::SUCCESS;
            primary.peers.clear();
        }
        primary.retains += 1;
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(ctx, context_handle(device)) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRelease_v2(device: CUdevice) -> CUresult {
    // [ref: 6.7, cuDevicePrimaryCtxRelease: the context is destroyed once
    // its usage count reaches 0; releasing one not retained is an error.]
    code(with(|d| {
        let device = d.check_device(device)?;
        let primary = &mut d.primaries[device as usize];
        if primary.retains == 0 {
            return Err(err::INVALID_CONTEXT);
        }
        primary.retains -= 1;
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    // [ref: 6.8, cuCtxSetCurrent: replaces the top of the thread's context
    // stack; NULL pops it (a no-op on an empty stack).]
    code(with(|d| {
        if ctx.is_null() {
            STACK.with(|s| s.borrow_mut().pop());
            return Ok(());
        }
        let device = context_device(ctx).ok_or(err::INVALID_CONTEXT)?;
        if d.primaries.get(device as usize).is_none_or(|p| p.retains == 0) {
            return Err(err::INVALID_CONTEXT);
        }
        STACK.with(|s| {
            let mut stack = s.borrow_mut();
            stack.pop();
            stack.push(ctx as usize);
        });
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut CUcontext) -> CUresult {
    // [ref: 6.8, cuCtxGetCurrent: NULL when no context is bound.]
    code(with(|_| {
        let top = STACK.with(|s| s.borrow().last().copied()).unwrap_or(0);
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        unsafe { put(ctx, top as CUcontext) }
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    code(with(|d| {
        let device = context_device(ctx).ok_or(err::INVALID_CONTEXT)?;
        if d.primaries.get(device as usize).is_none_or(|p| p.retains == 0) {
            return Err(err::INVALID_CONTEXT);
        }
        STACK.with(|s| s.borrow_mut().push(ctx as usize));
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut CUcontext) -> CUresult {
    // [ref: 6.8, cuCtxPopCurrent: INVALID_CONTEXT with an empty stack.]
    code(with(|_| {
        let top = STACK.with(|s| s.borrow_mut().pop()).ok_or(err::INVALID_CONTEXT)?;
        if !ctx.is_null() {
            // SAFETY: an out-pointer the caller passes under the Driver API's contract
            // (valid for this write or null); `put` refuses null.
            unsafe { put(ctx, top as CUcontext)? };
        }
        Ok(())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: CUcontext, flags: c_uint) -> CUresult {
    // [ref: 6.29 Peer Context Memory Access, cuCtxEnablePeerAccess: from
    // the current context; flags must be 0; PEER_ACCESS_UNSUPPORTED where
    // cuDeviceCanAccessPeer says no; PEER_ACCESS_ALREADY_ENABLED when
    // enabled before; INVALID_DEVICE for the context itself.]
    code(with(|d| {
        let from = d.current()?;
        if flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        let to = context_device(peer).ok_or(err::INVALID_CONTEXT)?;
        d.context_usable(to)?;
        if to == from {
            return Err(err::INVALID_DEVICE);
        }
        if !d.config.peer {
            return Err(err::PEER_ACCESS_UNSUPPORTED);
        }
        match d.primaries[from as usize].peers.insert(to) {
            true => Ok(()),
            false => Err(err::PEER_ACCESS_ALREADY_ENABLED),
        }
    }))
}

static ERROR_NAMES: &[(CUresult, &CStr)] = &[
    (err::SUCCESS, c"CUDA_SUCCESS"),
    (err::INVALID_VALUE, c"CUDA_ERROR_INVALID_VALUE"),
    (err::OUT_OF_MEMORY, c"CUDA_ERROR_OUT_OF_MEMORY"),
    (err::NOT_INITIALIZED, c"CUDA_ERROR_NOT_INITIALIZED"),
    (err::STUB_LIBRARY, c"CUDA_ERROR_STUB_LIBRARY"),
    (err::NO_DEVICE, c"CUDA_ERROR_NO_DEVICE"),
    (err::INVALID_DEVICE, c"CUDA_ERROR_INVALID_DEVICE"),
    (err::INVALID_IMAGE, c"CUDA_ERROR_INVALID_IMAGE"),
    (err::INVALID_CONTEXT, c"CUDA_ERROR_INVALID_CONTEXT"),
    (err::MAP_FAILED, c"CUDA_ERROR_MAP_FAILED"),
    (err::ALREADY_MAPPED, c"CUDA_ERROR_ALREADY_MAPPED"),
    (err::PEER_ACCESS_UNSUPPORTED, c"CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"),
    (err::INVALID_PTX, c"CUDA_ERROR_INVALID_PTX"),
    (err::OPERATING_SYSTEM, c"CUDA_ERROR_OPERATING_SYSTEM"),
    (err::INVALID_HANDLE, c"CUDA_ERROR_INVALID_HANDLE"),
    (err::NOT_FOUND, c"CUDA_ERROR_NOT_FOUND"),
    (err::NOT_READY, c"CUDA_ERROR_NOT_READY"),
    (err::ILLEGAL_ADDRESS, c"CUDA_ERROR_ILLEGAL_ADDRESS"),
    (err::PEER_ACCESS_ALREADY_ENABLED, c"CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"),
    (err::HOST_MEMORY_ALREADY_REGISTERED, c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"),
    (err::HOST_MEMORY_NOT_REGISTERED, c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"),
    (err::NOT_SUPPORTED, c"CUDA_ERROR_NOT_SUPPORTED"),
];

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, name: *mut *const c_char) -> CUresult {
    // [ref: 6.2 Error Handling, cuGetErrorName: INVALID_VALUE for an
    // unknown code, and callable before cuInit.]
    match ERROR_NAMES.iter().find(|(c, _)| *c == error) {
        // SAFETY: an out-pointer the caller passes under the Driver API's contract
        // (valid for this write or null); `put` refuses null.
        Some((_, text)) => code(unsafe { put(name, text.as_ptr()) }),
        None => err::INVALID_VALUE,
    }
}

/// `cuGetProcAddress_v2` [ref: 6.31 Driver Entry Point Access]: from CUDA
/// 12.0. The 12.8 and 13.0 `cuMemcpyBatchAsync` differ (13.0 dropped
/// `failIdx`), so the version asked for picks which one is returned, and a
/// caller asking 13000 but calling the 12.8 form fails loudly.
#[cfg(not(feature = "no-proc-address"))]
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    _flags: u64,
    status: *mut c_int,
) -> CUresult {
    const SUCCESS: c_int = 0;
    const SYMBOL_NOT_FOUND: c_int = 1;
    const VERSION_NOT_SUFFICIENT: c_int = 2;
    let result = with(|d| {
        if d.version() < 12000 {
            // A pre-12.0 driver has no such symbol: calling it is a bug in
            // the caller's version gate, counted for the tests.
            COUNTERS.missing_calls.fetch_add(1, Relaxed);
            return Err(err::NOT_SUPPORTED);
        }
        if symbol.is_null() || pfn.is_null() {
            return Err(err::INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated symbol name, checked non-null above (cuGetProcAddress's contract).
        let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
        let (found, state): (*mut c_void, c_int) = match name {
            b"cuMemcpyBatchAsync" if cuda_version > d.version() => (std::ptr::null_mut(), VERSION_NOT_SUFFICIENT),
            b"cuMemcpyBatchAsync" if d.version() < 12080 || cuda_version < 12080 => {
                (std::ptr::null_mut(), SYMBOL_NOT_FOUND)
            }
            b"cuMemcpyBatchAsync" if cuda_version >= 13000 => (exec::batch_13000 as *mut c_void, SUCCESS),
            b"cuMemcpyBatchAsync" => (exec::batch_12080 as *mut c_void, SUCCESS),
            _ => (std::ptr::null_mut(), SYMBOL_NOT_FOUND),
        };
        // SAFETY: a valid out-pointer, checked non-null above (cuGetProcAddress's contract).
        unsafe { pfn.write(found) };
        if !status.is_null() {
            // SAFETY: non-null (checked), an out-pointer under the same contract.
            unsafe { status.write(state) };
        }
        match state {
            SUCCESS => Ok(()),
            _ => Err(err::NOT_FOUND),
        }
    });
    code(result)
}

// ---------------------------------------------------------------------------
// Introspection for tests (not part of CUDA).
// ---------------------------------------------------------------------------

/// A figure the fake keeps, by name: `contexts_created:D` and
/// `contexts_active:D` (device D's primary context), `contexts_active`
/// (over all devices), `current` (device + 1 of the calling thread's
/// current context, 0 for none), `fds` (descriptors of fake device memory
/// open in this process that the driver itself does not hold: exported or
/// passed ones), `staged` (cross-GPU copies without peer access), `stalls`
/// (batches that waited for their stream: pageable sources in stream order),
/// `sync_copies`, `batches`, `copies`, `kernels`, `faults`, `missing_calls`,
/// `gdr_flushes` (`cuFlushGPUDirectRDMAWrites` calls that flushed)
/// (calls a driver of the configured version would not have),
/// `ipc_opened:D` (legacy handles open in device D's context), `peer:A:B`,
/// `allocations` (physical allocations alive), `pinned` (host ranges
/// registered). -1 for an unknown name.
#[no_mangle]
pub unsafe extern "C" fn fakecuda_stat(name: *const c_char) -> i64 {
    if name.is_null() {
        return -1;
    }
    // SAFETY: a NUL-terminated counter name from the test, checked non-null above.
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    stat(&name).unwrap_or(-1)
}

fn stat(name: &str) -> Option<i64> {
    let counter = |c: &AtomicI64| Some(c.load(Relaxed));
    match name {
        "staged" => return counter(&COUNTERS.staged),
        "stalls" => return counter(&COUNTERS.stalls),
        "sync_copies" => return counter(&COUNTERS.sync_copies),
        "batches" => return counter(&COUNTERS.batches),
        "copies" => return counter(&COUNTERS.copies),
        "kernels" => return counter(&COUNTERS.kernels),
        "faults" => return counter(&COUNTERS.faults),
        "missing_calls" => return counter(&COUNTERS.missing_calls),
        "gdr_flushes" => return counter(&COUNTERS.gdr_flushes),
        "ipc_opens" => return counter(&COUNTERS.ipc_opens),
        "ipc_closes" => return counter(&COUNTERS.ipc_closes),
        "current" => return Some(current_raw().map_or(0, |d| d as i64 + 1)),
        _ => {}
    }
    let guard = driver();
    let d = guard.as_ref()?;
    let mut parts = name.split(':');
    let head = parts.next()?;
    let arg = |p: Option<&str>| p.and_then(|v| v.parse::<usize>().ok());
    match head {
        "contexts_active" => match arg(parts.next()) {
            Some(dev) => d.primaries.get(dev).map(|p| i64::from(p.retains > 0)),
            None => Some(d.primaries.iter().filter(|p| p.retains > 0).count() as i64),
        },
        "contexts_created" => d.primaries.get(arg(parts.next())?).map(|p| p.created as i64),
        "peer" => {
            let (a, b) = (arg(parts.next())? as i32, arg(parts.next())? as i32);
            Some(i64::from(a != b && d.peer_enabled(a, b)))
        }
        "fds" => Some(mem::foreign_fds(d)),
        "ipc_opened" => Some(d.mem.ipc_opened_in(arg(parts.next())? as i32)),
        "allocations" => Some(d.mem.allocations()),
        "pinned" => Some(d.mem.pinned_ranges()),
        _ => None,
    }
}

/// Sets a knob: `fault_after` (N: the copy after the next N faults, with a
/// sticky `ILLEGAL_ADDRESS` in its stream's context; -1: none),
/// `delay_us` (each queued job runs that late; -1: `FAKECUDA_DELAY_US`),
/// `fail_opens` (N: the next N openings of a peer's memory fail as an
/// exited peer's), `refuse_call_after` (N: after N more batched copy
/// calls, one is refused with `INVALID_VALUE`; -1: none), `lose_device`
/// (D: GPU D's context poisoned), `reset_counters` (zeroes the counters). Returns 0, or -1 for an unknown
/// name.
#[no_mangle]
pub unsafe extern "C" fn fakecuda_set(name: *const c_char, value: i64) -> c_int {
    if name.is_null() {
        return -1;
    }
    // SAFETY: a NUL-terminated setting name from the test, checked non-null above.
    match unsafe { CStr::from_ptr(name) }.to_bytes() {
        b"fault_after" => COUNTERS.fault_after.store(value, Relaxed),
        b"delay_us" => COUNTERS.delay_us.store(value, Relaxed),
        b"fail_opens" => COUNTERS.fail_opens.store(value, Relaxed),
        b"refuse_call_after" => COUNTERS.refuse_after.store(value, Relaxed),
        // A GPU lost under the process (fallen off the bus): the driver
        // reference names no error code for it, so its context is
        // poisoned with the sticky error a fault raises ("the process ...
        // any further CUDA work will return the same error" [ref: 6.1
        // Data types, CUDA_ERROR_ILLEGAL_ADDRESS]), what kvring sees of
        // any context it can no longer use.
        b"lose_device" => {
            let mut guard = driver();
            let Some(d) = guard.as_mut() else { return -1 };
            d.poison(value as i32, err::ILLEGAL_ADDRESS);
        }
        b"reset_counters" => {
            for c in [
                &COUNTERS.staged,
                &COUNTERS.stalls,
                &COUNTERS.sync_copies,
                &COUNTERS.batches,
                &COUNTERS.copies,
                &COUNTERS.kernels,
                &COUNTERS.faults,
                &COUNTERS.missing_calls,
                &COUNTERS.gdr_flushes,
                &COUNTERS.ipc_opens,
                &COUNTERS.ipc_closes,
            ] {
                c.store(0, Relaxed);
            }
        }
        _ => return -1,
    }
    0
}
