//! The C ABI: opaque handles, plain structs, integer results, and the last
//! error's message per thread. `include/kvring.h` is generated from this
//! file by cbindgen (`cbindgen --config cbindgen.toml -o include/kvring.h src/ffi.rs`)
//! and checked in.
//!
//! Every function returns 0 (or a count) on success and a negative
//! `ErrorCode` on failure; `kvring_last_error()` then says why. No Rust type
//! crosses the boundary, no panic unwinds into C (each call is wrapped in
//! `catch_unwind`), and every pointer argument is checked for null.

mod arrivals;
mod batches;
mod config;
mod fence;
mod submit;
mod transports;

use crate::error::Error;
use crate::log::sink::{set_sink, Sink};
use crate::proto::ErrorCode;
use crate::{Engine, RegionId, RegionInfo, Segment, Submitter, TransportKind};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

/// An engine (opaque).
#[derive(Debug)]
pub struct KvringEngine(Engine);
/// An open segment of a peer (opaque).
#[derive(Debug)]
pub struct KvringSegment(Segment);
/// A submitter: rings to the lanes, used by one thread at a time (opaque).
#[derive(Debug)]
pub struct KvringSubmitter(Submitter);

/// One block to move (40 bytes, the layout of kvring's descriptors).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvringBlock {
    /// This engine's region.
    pub local_region: u64,
    /// The peer's region, as the peer numbers it.
    pub remote_region: u64,
    /// Offset in the local region.
    pub local_offset: u64,
    /// Offset in the remote region.
    pub remote_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// A reaped completion.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct KvringCompletion {
    /// The batch id `kvring_submit` returned.
    pub batch: u64,
    /// The batch's `user_data`.
    pub user_data: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// 0 when done, else a negative error code.
    pub result: i32,
    /// The transport that carried it (`KVRING_TRANSPORT_*`).
    pub transport: i32,
}

// The transport took the padding after `result`: the size C programs built
// against an older header allocate is unchanged.
const _: () = assert!(std::mem::size_of::<KvringCompletion>() == 32);
const _: () = assert!(std::mem::size_of::<KvringBlock>() == 40);

/// `kvring_submit` opcodes.
pub const KVRING_WRITE: c_int = 1;
/// Read: remote → local.
pub const KVRING_READ: c_int = 2;
/// `kvring_open_segment` transports: choose by the documented order.
pub const KVRING_TRANSPORT_AUTO: c_int = 0;
/// Shared memory (same host).
pub const KVRING_TRANSPORT_SHM: c_int = 1;
/// TCP.
pub const KVRING_TRANSPORT_TCP: c_int = 2;
/// Same host with GPU memory on either end (CUDA IPC, the GPU's copy
/// engines).
pub const KVRING_TRANSPORT_CUDA_IPC: c_int = 3;
/// Same host, any host memory of the peer (cross-memory attach:
/// `process_vm_writev` / `process_vm_readv`).
pub const KVRING_TRANSPORT_CMA: c_int = 4;
/// RDMA (reported by `kvring_batch_transport` and completions).
pub const KVRING_TRANSPORT_RDMA: c_int = 5;
/// Moves nothing (reported by `kvring_batch_transport` and completions).
pub const KVRING_TRANSPORT_NULL: c_int = 6;
/// `kvring_register_memory` and the memory queries: host memory. A value
/// `n >= 0` is GPU `n`.
pub const KVRING_MEMORY_HOST: c_int = -1;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn remember(message: String) {
    let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = message);
}

fn fail(error: Error) -> c_int {
    let code = -(error.code() as c_int);
    remember(error.to_string());
    code
}

/// Runs `body`, turning errors and panics into negative codes.
fn guarded(body: impl FnOnce() -> Result<c_int, Error>) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => value,
        Ok(Err(error)) => fail(error),
        Err(_) => {
            remember("internal error: a panic was caught at the C boundary".into());
            -(ErrorCode::Internal as c_int)
        }
    }
}

fn null(what: &'static str) -> Error {
    Error::invalid(what, "is a null pointer")
}

/// # Safety
///
/// `text` is null or a valid NUL-terminated string.
unsafe fn text<'a>(text: *const c_char, what: &'static str) -> Result<&'a str, Error> {
    if text.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-null, and NUL-terminated per our contract.
    unsafe { CStr::from_ptr(text) }.to_str().map_err(|_| Error::invalid(what, "is not UTF-8"))
}

/// The message of this thread's last failed call (empty if none). Valid
/// until this thread's next kvring call.
#[no_mangle]
pub extern "C" fn kvring_last_error() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().as_ptr())
}

/// The name of an error code (negative or positive), e.g. `OUT_OF_BOUNDS`.
/// Static; never null.
#[no_mangle]
pub extern "C" fn kvring_error_name(code: c_int) -> *const c_char {
    static NAMES: std::sync::OnceLock<Vec<CString>> = std::sync::OnceLock::new();
    let names = NAMES.get_or_init(|| {
        (0..64).map(|c| CString::new(ErrorCode::try_from(c).map_or("UNKNOWN", |e| e.as_str_name())).unwrap()).collect()
    });
    let index = (code.unsigned_abs() as usize).min(names.len() - 1);
    names[index].as_ptr()
}

/// `kvring_set_log_callback` levels, most severe first.
pub const KVRING_LOG_ERROR: c_int = 1;
/// Something failed or was refused; kvring carries on.
pub const KVRING_LOG_WARN: c_int = 2;
/// Lifecycle: an engine started or stopped, a segment reopened.
pub const KVRING_LOG_INFO: c_int = 3;
/// Details (a segment opened or evicted).
pub const KVRING_LOG_DEBUG: c_int = 4;
/// Finer still.
pub const KVRING_LOG_TRACE: c_int = 5;

/// A `tracing` level as its `KVRING_LOG_*`.
fn log_level(level: tracing::Level) -> c_int {
    match level {
        tracing::Level::ERROR => KVRING_LOG_ERROR,
        tracing::Level::WARN => KVRING_LOG_WARN,
        tracing::Level::INFO => KVRING_LOG_INFO,
        tracing::Level::DEBUG => KVRING_LOG_DEBUG,
        tracing::Level::TRACE => KVRING_LOG_TRACE,
    }
}

/// Receives one of kvring's log events: its level (`KVRING_LOG_*`), its
/// target (the module, e.g. `kvring::engine::lifecycle`), its message with
/// its fields (`engine started name=... epoch=0x...`), and the `user`
/// pointer given with it. Both strings are valid during the call only.
pub type KvringLogCallback =
    Option<unsafe extern "C" fn(level: c_int, target: *const c_char, message: *const c_char, user: *mut c_void)>;

/// Sends kvring's log events to `callback` (NULL: to nowhere), filtered by
/// `RUST_LOG` if set, else kvring's info and above. Returns 0, or
/// `-INVALID_ARGUMENT` if this process already has a Rust `tracing`
/// subscriber (kvring's events then go there).
///
/// The callback runs on the thread that logged: an engine's own threads,
/// and lanes (only when a transfer fails, and at most once a second). It
/// must be thread-safe, return quickly and not call kvring.
///
/// # Safety
///
/// `callback` is null or a function valid, with `user`, until it is
/// replaced by another call.
#[no_mangle]
pub unsafe extern "C" fn kvring_set_log_callback(callback: KvringLogCallback, user: *mut c_void) -> c_int {
    // A C pointer the caller vouches for, carried to other threads as a number.
    let user = user as usize;
    guarded(|| {
        let sink = callback.map(|callback| -> Sink {
            Arc::new(move |level, target, message| {
                let target = CString::new(target.replace('\0', " ")).unwrap_or_default();
                let message = CString::new(message.replace('\0', " ")).unwrap_or_default();
                // SAFETY: valid with `user` per the caller's contract; the
                // strings outlive the call.
                unsafe { callback(log_level(level), target.as_ptr(), message.as_ptr(), user as *mut c_void) };
            })
        });
        set_sink(sink, "kvring=info").map_err(|why| Error::invalid("log callback", why))?;
        Ok(0)
    })
}

/// Starts an engine named `name` whose control plane listens on `listen`
/// (`"127.0.0.1:0"` picks a port), with `lanes` lanes (0: the default),
/// and no token (see `kvring_engine_create_with_token`).
///
/// # Safety
///
/// `name` and `listen` are NUL-terminated strings; `out` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn kvring_engine_create(
    name: *const c_char,
    listen: *const c_char,
    lanes: u32,
    out: *mut *mut KvringEngine,
) -> c_int {
    // SAFETY: forwarded from our caller; a null token means none.
    unsafe { kvring_engine_create_with_token(name, listen, lanes, std::ptr::null(), out) }
}

/// As `kvring_engine_create`, with the cluster's pre-shared `token` (a
/// NUL-terminated string; NULL for none): peers must prove it in every
/// handshake and data connection, and this engine proves it to the peers
/// it opens. It is never sent. Without one, anyone who reaches the
/// engine's ports can read and write its registered memory.
///
/// # Safety
///
/// `name` and `listen` are NUL-terminated strings, `token` is one or NULL;
/// `out` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn kvring_engine_create_with_token(
    name: *const c_char,
    listen: *const c_char,
    lanes: u32,
    token: *const c_char,
    out: *mut *mut KvringEngine,
) -> c_int {
    // SAFETY: forwarded from our caller; NULL rdma settings mean "auto".
    unsafe { kvring_engine_create_with_rdma(name, listen, lanes, token, std::ptr::null(), std::ptr::null(), out) }
}

/// The builder every `kvring_engine_create*` starts from: `name`,
/// `listen`, `lanes` (0: the default) and `token` (NULL: none).
///
/// # Safety
///
/// `name` and `listen` are NUL-terminated strings; `token` is one or NULL.
pub(crate) unsafe fn base_builder(
    name: *const c_char,
    listen: *const c_char,
    lanes: u32,
    token: *const c_char,
) -> Result<crate::EngineBuilder, Error> {
    // SAFETY: per our contract.
    let (name, listen) = unsafe { (text(name, "name")?, text(listen, "listen")?) };
    // SAFETY: per our contract.
    let token = unsafe { optional_text(token, "token")? };
    let listen = listen.parse().map_err(|_| Error::invalid("listen", format!("{listen:?} is not ip:port")))?;
    let mut builder = Engine::builder().name(name).listen(listen);
    if lanes > 0 {
        builder = builder.lanes(lanes as usize);
    }
    if let Some(token) = token {
        builder = builder.token(token);
    }
    Ok(builder)
}

/// `text` of a string that may be NULL (`None`).
///
/// # Safety
///
/// `p` is NULL or a NUL-terminated string that outlives `'a`.
pub(crate) unsafe fn optional_text<'a>(p: *const c_char, what: &'static str) -> Result<Option<&'a str>, Error> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: per our contract, and not NULL.
    unsafe { text(p, what) }.map(Some)
}

/// As `kvring_engine_create_with_token`, choosing RDMA: `rdma` is "auto"
/// (RDMA where libibverbs lists a device with an active port; also what
/// NULL means), "on" (or the call fails, saying why) or "off";
/// `rdma_devices` names the NICs to use, comma-separated (NULL or "" for
/// every active one): each is used or the call fails naming it.
///
/// # Safety
///
/// `name` and `listen` are NUL-terminated strings; `token`, `rdma` and
/// `rdma_devices` are each one or NULL; `out` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn kvring_engine_create_with_rdma(
    name: *const c_char,
    listen: *const c_char,
    lanes: u32,
    token: *const c_char,
    rdma: *const c_char,
    rdma_devices: *const c_char,
    out: *mut *mut KvringEngine,
) -> c_int {
    guarded(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: per our contract.
        let builder = unsafe { base_builder(name, listen, lanes, token)? };
        // SAFETY: per our contract (each checked for NULL first).
        let mode = unsafe { optional_text(rdma, "rdma")? }.unwrap_or("auto");
        // SAFETY: as above.
        let devices = unsafe { optional_text(rdma_devices, "rdma_devices")? }.unwrap_or("");
        let devices = devices.split(',').map(str::to_string).collect();
        let engine = crate::config::with_rdma(builder, mode, devices, crate::rdma::IbOptions::default())?.build()?;
        // SAFETY: `out` is valid (checked non-null, per our contract).
        unsafe { give(out, KvringEngine(engine)) }
    })
}

/// Shuts an engine down and frees it (null is ignored). Segments and
/// submitters made from it must be freed first.
///
/// # Safety
///
/// `engine` came from `kvring_engine_create` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvring_engine_destroy(engine: *mut KvringEngine) {
    if !engine.is_null() {
        // SAFETY: per our contract, we own it now.
        let engine = unsafe { Box::from_raw(engine) };
        let _ = catch_unwind(AssertUnwindSafe(|| engine.0.shutdown()));
    }
}

/// Writes the engine's control address (what peers open) into `buf`;
/// returns its length, or a negative code (`buf` too small, too).
///
/// # Safety
///
/// `engine` is live; `buf` has room for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kvring_engine_control_addr(
    engine: *const KvringEngine,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        if buf.is_null() {
            return Err(null("buf"));
        }
        let addr = engine.0.control_addr().to_string();
        if addr.len() + 1 > len {
            return Err(Error::invalid("buf", format!("needs {} bytes", addr.len() + 1)));
        }
        // SAFETY: `buf` has room for `len >= addr.len() + 1` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(addr.as_ptr(), buf.cast::<u8>(), addr.len());
            *buf.add(addr.len()) = 0;
        }
        Ok(addr.len() as c_int)
    })
}

/// Registers `len` bytes at `addr` (readable and writable by peers); writes
/// the region id to `region_out`.
///
/// # Safety
///
/// `engine` is live; `addr..addr+len` stays valid until `kvring_unregister`
/// or the engine is destroyed; `region_out` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn kvring_register(
    engine: *mut KvringEngine,
    addr: *mut u8,
    len: usize,
    region_out: *mut u64,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        if addr.is_null() || region_out.is_null() {
            return Err(null(if addr.is_null() { "addr" } else { "region_out" }));
        }
        // SAFETY: the caller keeps the range valid (our contract).
        let id = unsafe { engine.0.register(addr, len, RegionInfo::raw())? };
        // SAFETY: checked non-null; valid per our contract.
        unsafe { *region_out = id.raw() };
        Ok(0)
    })
}

/// Registers `len` bytes at `addr` living in `memory`: `KVRING_MEMORY_HOST`
/// or a GPU's number (a CUDA device pointer, exported for same-host peers).
/// The pointer is classified with the GPU driver: GPU memory said to be
/// host memory, or the reverse, is refused with a clear error.
///
/// # Safety
///
/// As `kvring_register`; GPU memory also stays allocated until the peers
/// that opened this engine's segment have closed it (CUDA cannot revoke
/// their mappings).
#[no_mangle]
pub unsafe extern "C" fn kvring_register_memory(
    engine: *mut KvringEngine,
    addr: *mut u8,
    len: usize,
    memory: c_int,
    region_out: *mut u64,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        if addr.is_null() || region_out.is_null() {
            return Err(null(if addr.is_null() { "addr" } else { "region_out" }));
        }
        let info = RegionInfo::raw();
        let info = match memory {
            KVRING_MEMORY_HOST => info,
            n if n >= 0 => info.on_gpu(n as u32),
            other => return Err(Error::invalid("memory", format!("{other} is not -1 (host) or a GPU's number"))),
        };
        // SAFETY: the caller keeps the range valid (our contract).
        let id = unsafe { engine.0.register(addr, len, info)? };
        // SAFETY: checked non-null; valid per our contract.
        unsafe { *region_out = id.raw() };
        Ok(0)
    })
}

/// Where a local region lives: `KVRING_MEMORY_HOST` or a GPU's number.
///
/// # Safety
///
/// `engine` is live.
#[no_mangle]
pub unsafe extern "C" fn kvring_region_memory(engine: *mut KvringEngine, region: u64) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        Ok(memory_code(engine.0.region_info(RegionId::from_raw(region))?.2.memory))
    })
}

/// The C number of a memory kind.
fn memory_code(memory: crate::MemoryKind) -> c_int {
    match memory {
        crate::MemoryKind::Host => KVRING_MEMORY_HOST,
        crate::MemoryKind::Gpu(n) => n as c_int,
    }
}

/// Unregisters a region (refused while batches use it).
///
/// # Safety
///
/// `engine` is live.
#[no_mangle]
pub unsafe extern "C" fn kvring_unregister(engine: *mut KvringEngine, region: u64) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        engine.0.unregister(RegionId::from_raw(region))?;
        Ok(0)
    })
}

/// Opens a peer's segment by name (its control address with the default
/// metadata mode) before `timeout_ms`.
///
/// # Safety
///
/// `engine` is live; `name` is a NUL-terminated string; `out` is valid.
#[no_mangle]
pub unsafe extern "C" fn kvring_open_segment(
    engine: *mut KvringEngine,
    name: *const c_char,
    transport: c_int,
    timeout_ms: u32,
    out: *mut *mut KvringSegment,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        // SAFETY: per our contract.
        let name = unsafe { text(name, "name")? };
        if out.is_null() {
            return Err(null("out"));
        }
        let transport = open_transport(transport)?;
        let segment = engine.0.open_segment_with(name, transport, Duration::from_millis(u64::from(timeout_ms)))?;
        // SAFETY: checked non-null; valid per our contract.
        unsafe { give(out, KvringSegment(segment)) }
    })
}

/// The transport `kvring_open_segment` and `kvring_open_many` are asked
/// for (`KVRING_TRANSPORT_AUTO`: none).
fn open_transport(transport: c_int) -> Result<Option<TransportKind>, Error> {
    Ok(match transport {
        KVRING_TRANSPORT_AUTO => None,
        KVRING_TRANSPORT_SHM => Some(TransportKind::Shm),
        KVRING_TRANSPORT_TCP => Some(TransportKind::Tcp),
        KVRING_TRANSPORT_CUDA_IPC => Some(TransportKind::CudaIpc),
        KVRING_TRANSPORT_CMA => Some(TransportKind::Cma),
        other => {
            return Err(Error::invalid(
                "transport",
                format!("{other} is not 0 (auto), 1 (shm), 2 (tcp), 3 (cuda_ipc) or 4 (cma)"),
            ))
        }
    })
}

/// Frees a segment handle (null is ignored).
///
/// # Safety
///
/// `segment` came from `kvring_open_segment` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvring_segment_free(segment: *mut KvringSegment) {
    // SAFETY: per our contract, we own it now.
    unsafe { take_back(segment) }
}

// Writes an id to its out-parameter as `kvring_register` does, on purpose: a C function each (docs/DUPLICATES.md).
/// The id of the peer's `position`-th region (in the order it lists them).
///
/// # Safety
///
/// `segment` is live; `region_out` is a valid pointer.
#[no_mangle]
pub unsafe extern "C" fn kvring_segment_region(
    segment: *const KvringSegment,
    position: usize,
    region_out: *mut u64,
) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let segment = unsafe { segment.as_ref() }.ok_or_else(|| null("segment"))?;
        if region_out.is_null() {
            return Err(null("region_out"));
        }
        let id = segment.0.region(position)?;
        // SAFETY: checked non-null; valid per our contract.
        unsafe { *region_out = id.raw() };
        Ok(0)
    })
}

/// Where the peer's `position`-th region lives: `KVRING_MEMORY_HOST` or
/// the peer's GPU number.
///
/// # Safety
///
/// `segment` is live.
#[no_mangle]
pub unsafe extern "C" fn kvring_segment_region_memory(segment: *const KvringSegment, position: usize) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let segment = unsafe { segment.as_ref() }.ok_or_else(|| null("segment"))?;
        let regions = segment.0.regions();
        let region = regions.get(position).ok_or_else(|| {
            Error::invalid("position", format!("{position} is past the peer's {} regions", regions.len()))
        })?;
        Ok(memory_code(region.memory))
    })
}

/// A submitter for this thread.
///
/// # Safety
///
/// `engine` is live; `out` is valid.
#[no_mangle]
pub unsafe extern "C" fn kvring_submitter_create(engine: *mut KvringEngine, out: *mut *mut KvringSubmitter) -> c_int {
    guarded(|| {
        // SAFETY: per our contract.
        let engine = unsafe { engine.as_ref() }.ok_or_else(|| null("engine"))?;
        if out.is_null() {
            return Err(null("out"));
        }
        let submitter = engine.0.submitter()?;
        // SAFETY: checked non-null; valid per our contract.
        unsafe { give(out, KvringSubmitter(submitter)) }
    })
}

/// Frees a submitter (null is ignored); wait for its batches first.
///
/// # Safety
///
/// `submitter` came from `kvring_submitter_create` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn kvring_submitter_free(submitter: *mut KvringSubmitter) {
    // SAFETY: per our contract, we own it now.
    unsafe { take_back(submitter) }
}

/// Hands `value` to C through `out`, as a handle it frees with the
/// matching `*_free` (which calls [`take_back`]).
///
/// # Safety
///
/// `out` is valid for a write.
unsafe fn give<T>(out: *mut *mut T, value: T) -> Result<c_int, Error> {
    // SAFETY: valid for a write (our contract).
    unsafe { *out = Box::into_raw(Box::new(value)) };
    Ok(0)
}

/// Drops a handle that [`give`] handed out; null is ignored.
///
/// # Safety
///
/// `handle` is null or came from [`give`], and is not used afterwards.
unsafe fn take_back<T>(handle: *mut T) {
    if !handle.is_null() {
        // SAFETY: per our contract, we own it now.
        drop(unsafe { Box::from_raw(handle) });
    }
}
