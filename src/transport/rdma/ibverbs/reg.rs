//! Memory registration: host memory by address (`ibv_reg_mr`, or
//! `ibv_reg_mr_iova2` when relaxed ordering is asked for, since only it
//! takes the optional access flags), and device memory by dma-buf
//! (`ibv_reg_dmabuf_mr`). Both newer functions are optional in the loaded
//! table (`lib.rs`): with an older libibverbs kvring runs and says what it
//! lacks when asked for them.

use super::ffi::*;
use super::lib::Lib;
use super::{failed, MrAccess};
use crate::error::{Error, Result};
use crate::gpu::DmaBufRange;
use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::AsRawFd;

/// The access flags of `access` (relaxed ordering included when asked).
fn flags(access: MrAccess) -> c_uint {
    let mut flags = 0;
    if access.local_write {
        flags |= IBV_ACCESS_LOCAL_WRITE;
    }
    if access.remote_write {
        flags |= IBV_ACCESS_REMOTE_WRITE;
    }
    if access.remote_read {
        flags |= IBV_ACCESS_REMOTE_READ;
    }
    if access.relaxed_ordering {
        // An optional flag: libibverbs drops it where the kernel cannot
        // take optional flags, and the device ignores it where it has no
        // relaxed ordering; an old kernel may still refuse it (the caller
        // then registers without).
        flags |= IBV_ACCESS_RELAXED_ORDERING;
    }
    flags
}

/// Registers host memory (or device memory through a peer-memory module).
///
/// # Safety
///
/// `raw_pd` is live; the range stays valid until the registration is
/// deregistered.
pub(super) unsafe fn host(
    lib: &Lib,
    raw_pd: *mut ibv_pd,
    addr: u64,
    len: u64,
    access: MrAccess,
) -> Result<*mut ibv_mr> {
    let mr = if access.relaxed_ordering {
        let iova2 = lib.reg_mr_iova2.ok_or_else(|| Error::Unsupported {
            what: "relaxed ordering: this libibverbs has no ibv_reg_mr_iova2 (rdma-core 22 or newer needed)".into(),
        })?;
        // SAFETY: our caller's contract; the function is libibverbs' own.
        unsafe { iova2(raw_pd, addr as *mut c_void, len as usize, addr, flags(access)) }
    } else {
        // SAFETY: our caller's contract.
        unsafe { (lib.reg_mr)(raw_pd, addr as *mut _, len as usize, flags(access) as c_int) }
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
    lib: &Lib,
    raw_pd: *mut ibv_pd,
    dmabuf: DmaBufRange<'_>,
    iova: u64,
    access: MrAccess,
) -> Result<*mut ibv_mr> {
    let reg = lib.reg_dmabuf_mr.ok_or_else(|| Error::Unsupported {
        what: "registering a dma-buf: this libibverbs has no ibv_reg_dmabuf_mr (rdma-core 34 or newer needed)".into(),
    })?;
    let DmaBufRange { fd, offset, len } = dmabuf;
    // SAFETY: our caller's contract; `fd` is a live dma-buf descriptor the
    // kernel takes its own reference on.
    let mr = unsafe { reg(raw_pd, offset, len as usize, iova, fd.as_raw_fd(), flags(access) as c_int) };
    if mr.is_null() {
        return Err(failed("verbs", &format!("registering a dma-buf of {len} bytes at {iova:#x}")));
    }
    Ok(mr)
}
