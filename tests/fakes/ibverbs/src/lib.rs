//! A fake libibverbs for kvring's CI: the exported functions and context
//! ops kvring resolves, over a shared-memory "fabric" (`fabric.rs`) so QPs
//! in different processes on one host talk. Every rule it enforces cites
//! the rdma-core man page (libibverbs/man/*.3) or document it follows; the
//! man page section is named in the comment beside the check.
//!
//! Devices: `FAKE_IBVERBS_DEVICES` = `name:ib|eth:mtu:active|down,...`
//! (default `fakeroce0:eth:4096:active`). One port each. Faults:
//! `FAKE_IBVERBS_QP_ERROR_AFTER=N` moves a QP to ERR at its Nth WR;
//! `FAKE_IBVERBS_QP_ERROR_FILE` / `FAKE_IBVERBS_PORT_DOWN_FILE`: while the
//! named file exists, WRs fail (RETRY_EXC_ERR) / ports read as down.
//!
//! Error returns follow each page: functions "returning the value of
//! errno" return it and leave errno set to an unrelated sentinel (EDOM),
//! so a caller reading errno instead is caught (VERBS-REVIEW finding 17).
#![allow(clippy::missing_safety_doc, non_camel_case_types)]

mod fabric;
#[path = "../../../../src/transport/rdma/ibverbs/ffi.rs"]
mod ffi;

use fabric::{alive, copy, locked, CQ_RING, MAX_CQS, MAX_MRS, MAX_QPS, MAX_SRQS, SRQ_RING};
use ffi::*;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

const EDOM_SENTINEL: c_int = libc::EDOM;
/// The device's limits (ibv_query_device(3)); max_qp_rd_atom is below 16
/// on purpose, so code that asks for 16 unclamped fails (finding 10).
const MAX_QP_WR: u32 = 4096;
const MAX_SGE: u32 = 2;
const MAX_INLINE: u32 = 128;
const MAX_RD_ATOM: u8 = 8;

fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local.
    unsafe { *libc::__errno_location() = e };
}

/// Returns `code` as "the value of errno" while errno holds a sentinel.
fn ret(code: c_int) -> c_int {
    set_errno(EDOM_SENTINEL);
    code
}

/// NULL-returning verbs set errno (their man pages: "returns NULL ... and
/// errno is set").
fn null<T>(e: c_int) -> *mut T {
    set_errno(e);
    std::ptr::null_mut()
}

fn log(what: &str) {
    if std::env::var_os("FAKE_IBVERBS_QUIET").is_none() {
        eprintln!("fake libibverbs: {what}");
    }
}

// ---------------------------------------------------------------- devices

#[derive(Clone)]
struct DeviceSpec {
    name: CString,
    ethernet: bool,
    mtu: u32,
    active: bool,
    index: u32,
}

fn specs() -> &'static Vec<DeviceSpec> {
    static SPECS: std::sync::OnceLock<Vec<DeviceSpec>> = std::sync::OnceLock::new();
    SPECS.get_or_init(|| {
        let text = std::env::var("FAKE_IBVERBS_DEVICES").unwrap_or_else(|_| "fakeroce0:eth:4096:active".into());
        text.split(',')
            .filter(|s| !s.is_empty())
            .enumerate()
            .map(|(i, s)| {
                let f: Vec<&str> = s.split(':').collect();
                DeviceSpec {
                    name: CString::new(f[0]).unwrap(),
                    ethernet: f.get(1) != Some(&"ib"),
                    mtu: f.get(2).and_then(|m| m.parse().ok()).unwrap_or(4096),
                    active: f.get(3) != Some(&"down"),
                    index: i as u32,
                }
            })
            .collect()
    })
}

fn mtu_enum(bytes: u32) -> c_uint {
    match bytes {
        0..=256 => 1,
        257..=512 => 2,
        513..=1024 => 3,
        1025..=2048 => 4,
        _ => 5,
    }
}

fn gid(spec: &DeviceSpec, index: c_int) -> Option<[u8; 16]> {
    let mut g = [0u8; 16];
    match index {
        0 => {
            g[0] = 0xfe;
            g[1] = 0x80;
            g[15] = spec.index as u8 + 1;
        }
        1 if spec.ethernet => {
            g[10] = 0xff;
            g[11] = 0xff;
            g[12..].copy_from_slice(&[127, 0, 0, spec.index as u8 + 1]);
        }
        _ => return None,
    }
    Some(g)
}

/// The "device" pointers handed out: the spec's address.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    let list: Vec<*mut ibv_device> = specs().iter().map(|s| s as *const DeviceSpec as *mut ibv_device).collect();
    if !num.is_null() {
        *num = list.len() as c_int;
    }
    if list.is_empty() {
        // ibv_get_device_list(3): with no device, rdma-core returns an empty
        // list (errno ENOSYS when the kernel has no RDMA at all).
        set_errno(libc::ENOSYS);
    }
    let mut list = list;
    list.push(std::ptr::null_mut());
    Box::into_raw(list.into_boxed_slice()) as *mut *mut ibv_device
}

#[no_mangle]
pub unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    let n = specs().len() + 1;
    drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(list, n)));
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char {
    (*(device as *const DeviceSpec)).name.as_ptr()
}

/// What the fake keeps per opened context (the ibv_context comes first).
#[repr(C)]
struct Ctx {
    raw: ibv_context,
    spec: DeviceSpec,
    live: AtomicU64,
}

#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    let spec = (*(device as *const DeviceSpec)).clone();
    // Like a NIC's DMA, peers in other processes reach registered memory:
    // allow their process_vm_* where Yama restricts ptrace.
    libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0);
    let mut raw: ibv_context = std::mem::zeroed();
    raw.device = device;
    raw.ops.poll_cq = Some(poll_cq);
    raw.ops.req_notify_cq = Some(req_notify_cq);
    raw.ops.post_srq_recv = Some(post_srq_recv);
    raw.ops.post_send = Some(post_send);
    raw.ops.post_recv = Some(post_recv);
    raw.async_fd = libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC);
    raw.cmd_fd = -1;
    raw.num_comp_vectors = 1;
    let ctx = Box::into_raw(Box::new(Ctx { raw, spec, live: AtomicU64::new(0) }));
    &mut (*ctx).raw
}

#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(context: *mut ibv_context) -> c_int {
    let ctx = context as *mut Ctx;
    let live = (*ctx).live.load(Ordering::Relaxed);
    if live != 0 {
        // ibv_open_device(3): every resource is released before close.
        log(&format!("ibv_close_device with {live} objects still open"));
    }
    libc::close((*ctx).raw.async_fd);
    drop(Box::from_raw(ctx));
    0
}

fn spec_of(context: *mut ibv_context) -> &'static DeviceSpec {
    // SAFETY: every context the fake hands out is a Ctx.
    unsafe { &(*(context as *const Ctx)).spec }
}

fn count(context: *mut ibv_context, delta: i64) {
    // SAFETY: as above.
    unsafe { (*(context as *const Ctx)).live.fetch_add(delta as u64, Ordering::Relaxed) };
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(_context: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
    let mut a: ibv_device_attr = std::mem::zeroed();
    a.max_qp = MAX_QPS as c_int;
    a.max_qp_wr = MAX_QP_WR as c_int;
    a.max_sge = MAX_SGE as c_int;
    a.max_cq = MAX_CQS as c_int;
    a.max_cqe = CQ_RING as c_int;
    a.max_mr = MAX_MRS as c_int;
    a.max_pd = 1024;
    a.max_qp_rd_atom = c_int::from(MAX_RD_ATOM);
    a.max_qp_init_rd_atom = c_int::from(MAX_RD_ATOM);
    a.max_srq = MAX_SRQS as c_int;
    a.max_srq_wr = SRQ_RING as c_int;
    a.max_srq_sge = 1;
    a.phys_port_cnt = 1;
    *attr = a;
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(context: *mut ibv_context, port: u8, attr: *mut ibv_port_attr) -> c_int {
    let spec = spec_of(context);
    if port != 1 {
        // ibv_query_port(3): port numbers start at 1.
        return ret(libc::EINVAL);
    }
    let mut a: ibv_port_attr = std::mem::zeroed();
    a.state = if spec.active && !port_down() { IBV_PORT_ACTIVE } else { 1 };
    a.max_mtu = IBV_MTU_4096;
    a.active_mtu = mtu_enum(spec.mtu);
    a.gid_tbl_len = if spec.ethernet { 2 } else { 1 };
    a.lid = if spec.ethernet { 0 } else { spec.index as u16 + 1 };
    a.link_layer = if spec.ethernet { IBV_LINK_LAYER_ETHERNET } else { IBV_LINK_LAYER_INFINIBAND };
    *attr = a;
    0
}

/// `FAKE_IBVERBS_PORT_DOWN_FILE`: while that file exists every port is down.
fn port_down() -> bool {
    std::env::var_os("FAKE_IBVERBS_PORT_DOWN_FILE").is_some_and(|p| std::path::Path::new(&p).exists())
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(context: *mut ibv_context, port: u8, index: c_int, out: *mut ibv_gid) -> c_int {
    match (port, gid(spec_of(context), index)) {
        (1, Some(g)) => {
            (*out).raw = g;
            0
        }
        _ => ret(libc::EINVAL),
    }
}

#[no_mangle]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn ibv_is_fork_initialized() -> c_int {
    IBV_FORK_UNNEEDED
}

mod objects;
pub use objects::*;
mod post;
pub use post::*;
