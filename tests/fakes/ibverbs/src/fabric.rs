//! The "wire": one shared-memory file every process using the fake maps
//! (`/dev/shm/kvring-fakeverbs-<uid>-<fabric>`), holding what a NIC would
//! know about remote objects: memory regions by key, QPs by number, the
//! completion rings of CQs and the receive rings of SRQs. One spin lock
//! serialises every change (a fake needs correctness, not speed).
//!
//! Bytes move with process_vm_readv/writev between processes (the fake's
//! DMA), or a plain copy inside one process.

use crate::ffi::ibv_wc;
use std::sync::atomic::{AtomicU32, Ordering};

pub const MAX_MRS: usize = 8192;
pub const MAX_QPS: usize = 4096;
pub const MAX_CQS: usize = 256;
pub const MAX_SRQS: usize = 64;
/// Most entries one CQ ring holds (the fake's `max_cqe`).
pub const CQ_RING: usize = 8192;
/// Most receives one SRQ holds (the fake's `max_srq_wr`).
pub const SRQ_RING: usize = 8192;

#[repr(C)]
#[derive(Clone, Copy)]
pub struct MrRec {
    pub used: u32,
    pub pid: u32,
    pub key: u32,
    pub access: u32,
    pub pd: u64,
    pub addr: u64,
    pub len: u64,
    /// Where byte `addr` lies in the owner's address space: `addr` itself
    /// for memory registered by address, the fake's own mapping of the
    /// dma-buf's pages for a dma-buf MR (whose `addr` is its iova).
    pub host: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct QpRec {
    pub used: u32,
    pub pid: u32,
    pub qpn: u32,
    pub state: u32,
    /// SRQ slot + 1, 0 for none.
    pub srq: u32,
    /// Receive CQ slot.
    pub recv_cq: u32,
    pub access: u32,
    /// Active MTU of its port, bytes (what it can receive).
    pub port_mtu: u32,
    pub device: u32,
    pub _pad: u32,
}

#[repr(C)]
pub struct CqRec {
    pub used: u32,
    pub pid: u32,
    /// Entries the CQ was created with (`cqe`): one more overruns it.
    pub cqe: u32,
    pub head: u32,
    pub tail: u32,
    /// Armed by `ibv_req_notify_cq`: the next completion sends one event.
    pub armed: u32,
    /// Overrun: every later poll fails (ibv_poll_cq(3) NOTES).
    pub overrun: u32,
    pub has_channel: u32,
    pub ring: [ibv_wc; CQ_RING],
}

#[repr(C)]
pub struct SrqRec {
    pub used: u32,
    pub pid: u32,
    pub max_wr: u32,
    pub head: u32,
    pub tail: u32,
    pub _pad: u32,
    pub ring: [u64; SRQ_RING],
}

#[repr(C)]
pub struct Fabric {
    lock: AtomicU32,
    pub next_qpn: u32,
    pub next_key: u32,
    pub _pad: u32,
    pub mrs: [MrRec; MAX_MRS],
    pub qps: [QpRec; MAX_QPS],
    pub cqs: [CqRec; MAX_CQS],
    pub srqs: [SrqRec; MAX_SRQS],
}

/// The mapped fabric, once per process.
pub fn fabric() -> *mut Fabric {
    static FABRIC: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let addr = *FABRIC.get_or_init(|| {
        let name = std::env::var("FAKE_IBVERBS_FABRIC").unwrap_or_else(|_| "default".into());
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        let path = std::ffi::CString::new(format!("/dev/shm/kvring-fakeverbs-{uid}-{name}")).unwrap();
        let size = std::mem::size_of::<Fabric>();
        // SAFETY: open/ftruncate/mmap of our own file; a new file reads as
        // zeros, which is an empty fabric.
        unsafe {
            let fd = libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC, 0o600);
            assert!(fd >= 0, "fake libibverbs: cannot open its fabric file");
            let mut st: libc::stat = std::mem::zeroed();
            libc::fstat(fd, &mut st);
            if (st.st_size as usize) < size {
                libc::ftruncate(fd, size as libc::off_t);
            }
            let p = libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            libc::close(fd);
            assert!(p != libc::MAP_FAILED, "fake libibverbs: cannot map its fabric file");
            p as usize
        }
    });
    addr as *mut Fabric
}

/// Runs `f` with the fabric locked.
pub fn locked<R>(f: impl FnOnce(&mut Fabric) -> R) -> R {
    let fabric = fabric();
    // SAFETY: the mapping lives for the process; the lock word is atomic.
    let lock = unsafe { &*std::ptr::addr_of!((*fabric).lock) };
    let mut spins = 0u32;
    while lock.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
        spins += 1;
        if spins > 64 {
            std::thread::yield_now();
        }
    }
    // SAFETY: the lock is held: no other process or thread mutates now.
    let result = f(unsafe { &mut *fabric });
    lock.store(0, Ordering::Release);
    result
}

/// Whether `pid` is alive (a killed peer's QPs answer nothing).
pub fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    pid == std::process::id() || unsafe { libc::kill(pid as i32, 0) } == 0
}

/// Copies `len` bytes from `src` in process `src_pid` to `dst` in process
/// `dst_pid` (one of them this process). False when the memory is not there.
pub fn copy(src_pid: u32, src: u64, dst_pid: u32, dst: u64, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    let me = std::process::id();
    if src_pid == me && dst_pid == me {
        // SAFETY: both ranges were checked against registrations of this
        // process, which promise the memory stays valid until dereg.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
        return true;
    }
    let local = libc::iovec { iov_base: if src_pid == me { src } else { dst } as *mut _, iov_len: len };
    let remote = libc::iovec { iov_base: if src_pid == me { dst } else { src } as *mut _, iov_len: len };
    // SAFETY: one local iovec within a registration of ours; the kernel
    // checks the remote one.
    let moved = unsafe {
        if src_pid == me {
            libc::process_vm_writev(dst_pid as i32, &local, 1, &remote, 1, 0)
        } else {
            libc::process_vm_readv(src_pid as i32, &local, 1, &remote, 1, 0)
        }
    };
    moved == len as isize
}
