//! Memory registration: host memory by address (`ibv_reg_mr`, or
//! `ibv_reg_mr_iova2` when relaxed ordering is asked for, since only it
//! takes the optional access flags), and device memory by dma-buf
//! (`ibv_reg_dmabuf_mr`). Both newer functions are looked up with `dlsym`
//! when first needed rather than linked: a binary linked against them
//! would not even load with an older libibverbs, where kvring should run
//! and say what it lacks. The bindings rdma-sys generates from the
//! installed headers have them (rdma-core 44 here); the symbol lookup is
//! what gates them.

use super::{failed, MrAccess};
use crate::error::{Error, Result};
use rdma_sys::*;
use std::ffi::{c_int, c_uint, c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::OnceLock;

/// `ibv_reg_dmabuf_mr` (rdma-core 34, `IBVERBS_1.12`).
type RegDmabuf = unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
/// `ibv_reg_mr_iova2` (rdma-core 22, `IBVERBS_1.8`).
type RegIova2 = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, c_uint) -> *mut ibv_mr;

/// The address of `name` in the loaded libibverbs, if it has it.
fn lookup(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: dlsym with the default handle and a NUL-terminated name only
    // reads the loaded objects' symbol tables.
    let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!found.is_null()).then_some(found)
}

/// `ibv_reg_dmabuf_mr`, looked up once.
fn reg_dmabuf_fn() -> Option<RegDmabuf> {
    static FOUND: OnceLock<Option<usize>> = OnceLock::new();
    let found = (*FOUND.get_or_init(|| lookup(c"ibv_reg_dmabuf_mr").map(|f| f as usize)))?;
    // SAFETY: libibverbs exports this symbol with exactly this signature
    // (verbs.h, rdma-core 34 and later).
    Some(unsafe { std::mem::transmute::<usize, RegDmabuf>(found) })
}

/// `ibv_reg_mr_iova2`, looked up once.
fn reg_iova2_fn() -> Option<RegIova2> {
    static FOUND: OnceLock<Option<usize>> = OnceLock::new();
    let found = (*FOUND.get_or_init(|| lookup(c"ibv_reg_mr_iova2").map(|f| f as usize)))?;
    // SAFETY: libibverbs exports this symbol with exactly this signature
    // (verbs.h, rdma-core 22 and later).
    Some(unsafe { std::mem::transmute::<usize, RegIova2>(found) })
}

/// The access flags of `access` (relaxed ordering included when asked).
fn flags(access: MrAccess) -> c_uint {
    let mut flags = 0;
    if access.local_write {
        flags |= ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    }
    if access.remote_write {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    }
    if access.remote_read {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    }
    if access.relaxed_ordering {
        // An optional flag: libibverbs drops it where the kernel cannot
        // take optional flags, and the device ignores it where it has no
        // relaxed ordering; an old kernel may still refuse it (the caller
        // then registers without).
        flags |= ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
    }
    flags
}

/// Registers host memory (or device memory through a peer-memory module).
///
/// # Safety
///
/// `raw_pd` is live; the range stays valid until the registration is
/// deregistered.
pub(super) unsafe fn host(raw_pd: *mut ibv_pd, addr: u64, len: u64, access: MrAccess) -> Result<*mut ibv_mr> {
    let mr = if access.relaxed_ordering {
        let iova2 = reg_iova2_fn().ok_or_else(|| Error::Unsupported {
            what: "relaxed ordering: this libibverbs has no ibv_reg_mr_iova2 (rdma-core 22 or newer needed)".into(),
        })?;
        // SAFETY: our caller's contract; the function is libibverbs' own.
        unsafe { iova2(raw_pd, addr as *mut c_void, len as usize, addr, flags(access)) }
    } else {
        // SAFETY: our caller's contract.
        unsafe { ibv_reg_mr(raw_pd, addr as *mut _, len as usize, flags(access) as c_int) }
    };
    if mr.is_null() {
        return Err(failed("verbs", &format!("registering {len} bytes at {addr:#x}")));
    }
    Ok(mr)
}

/// Registers `len` bytes of a dma-buf from `offset`, at `iova`.
///
/// # Safety
///
/// `raw_pd` is live; the memory behind the dma-buf stays allocated until
/// the registration is deregistered.
pub(super) unsafe fn dmabuf(
    raw_pd: *mut ibv_pd,
    fd: BorrowedFd<'_>,
    offset: u64,
    len: u64,
    iova: u64,
    access: MrAccess,
) -> Result<*mut ibv_mr> {
    let reg = reg_dmabuf_fn().ok_or_else(|| Error::Unsupported {
        what: "registering a dma-buf: this libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34 or newer needed)".into(),
    })?;
    // SAFETY: our caller's contract; `fd` is a live dma-buf descriptor the
    // kernel takes its own reference on.
    let mr = unsafe { reg(raw_pd, offset, len as usize, iova, fd.as_raw_fd(), flags(access) as c_int) };
    if mr.is_null() {
        return Err(failed("verbs", &format!("registering a dma-buf of {len} bytes at {iova:#x}")));
    }
    Ok(mr)
}
