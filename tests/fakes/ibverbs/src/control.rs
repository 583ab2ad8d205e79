//! Test-only knobs and counters, exported as `fake_ibverbs_*` symbols that
//! tests find with `dlsym` (kvring never calls them: no verb has them).
//! Each is keyed by memory the asking test owns (a remote address, a
//! registration's address), so the tests of one process, which share the
//! fake, never see each other's faults or bytes.
//!
//! - `fake_ibverbs_fail_next(addr, status)`: the next send WR whose remote
//!   range holds `addr` completes with `status` instead of running (one
//!   shot). A NIC reports a failed WR with an error completion and moves
//!   its QP to the Error state (ibv_poll_cq(3): "the QP will enter the
//!   error state"); IBV_WC_WR_FLUSH_ERR is by ibv_poll_cq(3)'s definition
//!   "a Work Request [that] was in process or outstanding when the QP
//!   transitioned into the Error State", so for it the QP is moved to ERR
//!   first, as its owner's ibv_modify_qp(3) to IBV_QPS_ERR would (which
//!   raises no async event), and the WR is flushed, nothing placed.
//! - `fake_ibverbs_bytes_moved(device, addr)`: bytes that WRs posted
//!   through `device`'s QPs placed into or read from the live
//!   registrations at `addr` (any process's), counted in this process.
//! - `fake_ibverbs_mr_access(addr)`: the access flags this process's
//!   registration at `addr` was made with (ibv_reg_mr(3) `access`), -1 for
//!   none: the rights the fake enforces on every remote request.
//! - `fake_ibverbs_cq_overruns()`: CQs this process's WRs overran
//!   (ibv_poll_cq(3) NOTES: fatal to the CQ; the fake fails its every
//!   later poll), of every test of the process: each expects none.
//! - `fake_ibverbs_device_fatal(device)`: the device fails for this
//!   process, as at a hot-unplug or a driver reset ([`failed`]).
//! - `fake_ibverbs_mr_paths(addr, out, max)`: how each of this process's
//!   live registrations at `addr` reaches its memory ([`MrPath`]: by
//!   address, through a dma-buf, through a peer-memory module).

use super::*;

/// Faults asked for and not yet taken: (remote address, status).
fn faults() -> std::sync::MutexGuard<'static, Vec<(u64, c_uint)>> {
    static FAULTS: Mutex<Vec<(u64, c_uint)>> = Mutex::new(Vec::new());
    FAULTS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Most faults asked for and not yet taken (a limit on a test's mistake).
const MAX_FAULTS: usize = 64;

/// The next send WR whose remote range `[remote_addr, +len)` holds `addr`
/// completes with `status` (see the module's comment).
#[no_mangle]
pub extern "C" fn fake_ibverbs_fail_next(addr: u64, status: c_uint) -> c_int {
    let mut list = faults();
    if list.len() >= MAX_FAULTS {
        return -1;
    }
    list.push((addr, status));
    0
}

/// The status a WR toward `[remote_addr, remote_addr + len)` is to fail
/// with, taking the fault asked for it (the oldest first).
pub fn take_fault(remote_addr: u64, len: u64) -> Option<c_uint> {
    let mut list = faults();
    let at = list.iter().position(|&(addr, _)| addr >= remote_addr && addr < remote_addr.saturating_add(len.max(1)))?;
    Some(list.remove(at).1)
}

/// Bytes moved per (registration key, requester device index).
fn moved() -> std::sync::MutexGuard<'static, HashMap<(u32, u32), u64>> {
    static MOVED: std::sync::OnceLock<Mutex<HashMap<(u32, u32), u64>>> = std::sync::OnceLock::new();
    MOVED.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Counts `len` bytes that a WR of device `device` placed into (or read
/// from) the registration with key `rkey`.
pub fn count_moved(device: u32, rkey: u32, len: u64) {
    *moved().entry((rkey, device)).or_default() += len;
}

/// See the module's comment; 0 for a device the fake does not list.
///
/// # Safety
///
/// `device` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn fake_ibverbs_bytes_moved(device: *const c_char, addr: u64) -> u64 {
    let name = std::ffi::CStr::from_ptr(device);
    let Some(spec) = specs().iter().find(|s| s.name.as_c_str() == name) else { return 0 };
    let keys: Vec<u32> =
        locked(|f| f.mrs.iter().filter(|m| m.used == 1 && m.addr == addr).map(|m| m.key).collect::<Vec<u32>>());
    let moved = moved();
    keys.iter().map(|key| moved.get(&(*key, spec.index)).copied().unwrap_or(0)).sum()
}

/// See the module's comment.
#[no_mangle]
pub extern "C" fn fake_ibverbs_mr_access(addr: u64) -> i64 {
    let me = std::process::id();
    locked(|f| f.mrs.iter().find(|m| m.used == 1 && m.pid == me && m.addr == addr).map_or(-1, |m| i64::from(m.access)))
}

/// How a registration reaches its memory (`fake_ibverbs_mr_paths`).
#[derive(Clone, Copy)]
#[repr(u32)]
pub enum MrPath {
    /// Memory the kernel pins by address (`ibv_reg_mr`).
    Host = 0,
    /// A dma-buf's pages (`ibv_reg_dmabuf_mr`).
    DmaBuf = 1,
    /// A device address a peer-memory module resolved (`ibv_reg_mr`).
    PeerMemory = 2,
}

/// This process's live registrations by key, and their paths.
fn paths() -> std::sync::MutexGuard<'static, HashMap<u32, MrPath>> {
    static PATHS: std::sync::OnceLock<Mutex<HashMap<u32, MrPath>>> = std::sync::OnceLock::new();
    PATHS.get_or_init(Default::default).lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Registration `key` was made through `path`.
pub fn registered(key: u32, path: MrPath) {
    paths().insert(key, path);
}

/// Registration `key` is gone.
pub fn deregistered(key: u32) {
    paths().remove(&key);
}

/// See the module's comment: writes at most `max` paths to `out`, in the
/// order of the registrations' slots; how many there are.
///
/// # Safety
///
/// `out` has room for `max` values.
#[no_mangle]
pub unsafe extern "C" fn fake_ibverbs_mr_paths(addr: u64, out: *mut u32, max: usize) -> usize {
    let me = std::process::id();
    let keys: Vec<u32> =
        locked(|f| f.mrs.iter().filter(|m| m.used == 1 && m.pid == me && m.addr == addr).map(|m| m.key).collect());
    let paths = paths();
    let found: Vec<u32> = keys.iter().filter_map(|key| paths.get(key)).map(|&path| path as u32).collect();
    for (i, path) in found.iter().take(max).enumerate() {
        *out.add(i) = *path;
    }
    found.len()
}

/// CQs overrun by this process's WRs.
static OVERRUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A WR of this process overran a CQ (its first overrun).
pub fn overran() {
    OVERRUNS.fetch_add(1, Ordering::Relaxed);
}

/// See the module's comment.
#[no_mangle]
pub extern "C" fn fake_ibverbs_cq_overruns() -> u64 {
    OVERRUNS.load(Ordering::Relaxed)
}

/// Devices (by index) failed in this process.
static FAILED: AtomicU64 = AtomicU64::new(0);

/// The device fails, for every context of it this process has open: each
/// gets IBV_EVENT_DEVICE_FATAL, "CA is in FATAL state"
/// (ibv_get_async_event(3)), as the kernel raises it on each open context
/// of a device being removed (drivers/infiniband/core/uverbs_main.c,
/// ib_uverbs_free_hw_resources: the event is generated as each context's
/// async descriptor is torn down, Linux commit ccfdbaa5cf46). The contexts
/// are then disassociated from the hardware: every verb that asks the
/// kernel fails with EIO (uverbs_main.c / rdma_core.c: a command on a
/// disassociated file finds no device and returns -EIO), WRs posted go
/// nowhere and never complete (rdma_user_mmap_disassociate: the doorbell
/// pages are unmapped), and destroying what was made still succeeds, so a
/// caller can release everything. The fake lists the device still (as a
/// reset device is listed again), but every context of it, open now or
/// later, stays failed (the fake models no recovery). Queries, PDs, MRs,
/// completion channels, CQs, SRQs and QP changes are the kernel verbs
/// checked; `ibv_open_device` itself succeeds.
/// 0, or -1 for a device the fake does not list.
///
/// # Safety
///
/// `device` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn fake_ibverbs_device_fatal(device: *const c_char) -> c_int {
    let name = std::ffi::CStr::from_ptr(device);
    let Some(spec) = specs().iter().find(|s| s.name.as_c_str() == name) else { return -1 };
    FAILED.fetch_or(1 << spec.index.min(63), Ordering::AcqRel);
    let contexts = super::watched(|contexts| contexts.clone());
    for context in contexts {
        let context = context as *mut ibv_context;
        if spec_of(context).index == spec.index {
            raise_event(context, IBV_EVENT_DEVICE_FATAL, 0);
        }
    }
    0
}

/// Whether `context`'s device failed (`fake_ibverbs_device_fatal`): the
/// verbs that ask the kernel then fail with EIO.
pub fn failed(context: *mut ibv_context) -> bool {
    FAILED.load(Ordering::Acquire) & (1 << spec_of(context).index.min(63)) != 0
}
