//! Memory regions: host memory by address (`ibv_reg_mr`,
//! `ibv_reg_mr_iova2`) and device memory by dma-buf (`ibv_reg_dmabuf_mr`),
//! with the checks ibv_reg_mr(3) documents and those the kernel's
//! registration paths make (drivers/infiniband/core/umem.c for memory by
//! address, umem_dmabuf.c and uverbs_std_types_mr.c for dma-bufs), since
//! rdma-core passes every registration to the kernel.

use super::objects::pd_objects;
use super::*;

/// An MR as handed out (the ibv_mr first) and the fake's own mapping of a
/// dma-buf's pages, unmapped at `ibv_dereg_mr` (0, 0 for none).
#[repr(C)]
struct FakeMr {
    raw: ibv_mr,
    map: (usize, usize),
}

/// The host page size (dma-buf offsets and iovas are checked against it).
fn page() -> u64 {
    // SAFETY: sysconf reads a constant of the running system.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as u64 }
}

/// ibv_reg_mr(3): "If IBV_ACCESS_REMOTE_WRITE or IBV_ACCESS_REMOTE_ATOMIC
/// is set, then IBV_ACCESS_LOCAL_WRITE must be set too" (EINVAL).
fn remote_needs_local(access: c_uint) -> bool {
    let remote = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
    access & remote == 0 || access & IBV_ACCESS_LOCAL_WRITE != 0
}

/// Whether every page of `addr..addr + len` is memory this process can
/// read. The kernel pins the pages of an MR registered by address
/// (umem.c, ib_umem_get: pin_user_pages_fast) and fails with EFAULT where
/// it cannot: a PROT_NONE mapping, such as a GPU's device addresses with no
/// peer-memory module to resolve them, or no mapping at all.
fn pinnable(addr: u64, len: u64) -> bool {
    let (page, me) = (page(), std::process::id());
    let end = addr.saturating_add(len);
    let mut at = addr;
    while at < end {
        let mut byte = 0u8;
        let local = libc::iovec { iov_base: (&mut byte as *mut u8).cast(), iov_len: 1 };
        let remote = libc::iovec { iov_base: at as *mut c_void, iov_len: 1 };
        // SAFETY: reads one byte of our own address space into `byte`; the
        // kernel checks the remote side and fails with EFAULT, never faults.
        if unsafe { libc::process_vm_readv(me as i32, &local, 1, &remote, 1, 0) } != 1 {
            return false;
        }
        at = (at / page + 1) * page;
    }
    true
}

/// Records an MR in the fabric: `len` bytes from `iova` as peers address
/// them, lying at `host` in this process.
unsafe fn record(
    pd: *mut ibv_pd,
    iova: u64,
    len: usize,
    access: c_uint,
    host: u64,
    map: (usize, usize),
    path: super::control::MrPath,
) -> *mut ibv_mr {
    let pid = std::process::id();
    let slot = locked(|f| {
        let slot = f.mrs.iter().position(|m| m.used == 0)?;
        f.next_key = f.next_key.wrapping_add(1).max(1);
        // Keys carry the slot in the low bits and a generation above, so a
        // stale key after dereg never matches the slot's next user.
        let key = (f.next_key << 13) | slot as u32;
        let pd = pd as u64;
        f.mrs[slot] = fabric::MrRec { used: 1, pid, key, access, pd, addr: iova, len: len as u64, host };
        Some((slot, key))
    });
    let Some((_, key)) = slot else {
        if map.0 != 0 {
            libc::munmap(map.0 as *mut c_void, map.1);
        }
        return null(libc::ENOMEM);
    };
    pd_objects(pd, 1);
    super::control::registered(key, path);
    let raw =
        ibv_mr { context: (*pd).context, pd, addr: iova as *mut c_void, length: len, handle: 0, lkey: key, rkey: key };
    Box::into_raw(Box::new(FakeMr { raw, map })).cast()
}

unsafe fn reg(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_uint) -> *mut ibv_mr {
    // A failed device (control.rs, `fake_ibverbs_device_fatal`): EIO.
    if super::control::failed((*pd).context) {
        return null(libc::EIO);
    }
    if !remote_needs_local(access) {
        log("ibv_reg_mr: REMOTE_WRITE without LOCAL_WRITE");
        return null(libc::EINVAL);
    }
    if !pinnable(addr as u64, len as u64) {
        if peer_memory() {
            if let Some((map, host)) = peer_pages(addr as u64, len as u64) {
                return record(pd, addr as u64, len, access, host, map, super::control::MrPath::PeerMemory);
            }
        }
        log("ibv_reg_mr: memory the kernel cannot pin (device memory without a peer-memory module?)");
        return null(libc::EFAULT);
    }
    record(pd, addr as u64, len, access, addr as u64, (0, 0), super::control::MrPath::Host)
}

/// `FAKE_IBVERBS_PEER_MEMORY=1`: a peer-memory module is loaded (as
/// nvidia-peermem is): memory by address the kernel cannot pin as user
/// pages is offered to it (rdma-core's peer-memory clients, the kernel's
/// ib_peer_mem / nvidia-peermem's nvidia_p2p_get_pages).
fn peer_memory() -> bool {
    std::env::var_os("FAKE_IBVERBS_PEER_MEMORY").is_some_and(|v| v == "1")
}

/// The peer-memory module's view of `addr..addr + len`: the pages mapped
/// there (shared mappings of a file, such as a GPU's memory exported to
/// this process), mapped again here for the fake NIC's own access, as the
/// module hands the NIC the GPU's pages behind a device address. `None`
/// where any page of the range is not such a mapping. The mapping made,
/// and where byte `addr` lies in it.
fn peer_pages(addr: u64, len: u64) -> Option<((usize, usize), u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let page = page();
    let (start, end) = (addr - addr % page, addr.checked_add(len)?.div_ceil(page) * page);
    let total = (end - start) as usize;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: a fresh reservation of our own, filled below or unmapped.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), total, libc::PROT_NONE, flags, -1, 0) };
    if base == libc::MAP_FAILED {
        return None;
    }
    let mut at = start;
    for line in maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(range), Some(perms), Some(offset)) = (fields.first(), fields.get(1), fields.get(2)) else { continue };
        let (lo, hi) = range.split_once('-')?;
        let (lo, hi) = (u64::from_str_radix(lo, 16).ok()?, u64::from_str_radix(hi, 16).ok()?);
        if hi <= at {
            continue;
        }
        if lo > at || !perms.ends_with('s') || fields.len() < 6 {
            break;
        }
        let upto = hi.min(end);
        let file_offset = u64::from_str_radix(offset, 16).ok()? + (at - lo);
        let Some(fd) = open_mapped(lo, hi, fields[4]) else { break };
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let into = (base as u64 + (at - start)) as *mut c_void;
        // SAFETY: replaces part of our own reservation.
        let mapped = unsafe {
            libc::mmap(into, (upto - at) as usize, rw, libc::MAP_SHARED | libc::MAP_FIXED, fd, file_offset as i64)
        };
        // SAFETY: ours.
        unsafe { libc::close(fd) };
        if mapped == libc::MAP_FAILED {
            break;
        }
        at = upto;
        if at >= end {
            break;
        }
    }
    if at < end {
        // SAFETY: the reservation made above.
        unsafe { libc::munmap(base, total) };
        return None;
    }
    Some(((base as usize, total), base as u64 + (addr - start)))
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut c_void, len: usize, access: c_int) -> *mut ibv_mr {
    reg(pd, addr, len, access as c_uint)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    if iova != addr as u64 {
        // The fake keeps addresses as VAs; kvring registers iova = addr.
        return null(libc::EOPNOTSUPP);
    }
    reg(pd, addr, len, access & !IBV_ACCESS_RELAXED_ORDERING)
}

/// `FAKE_IBVERBS_NO_DMABUF_FILE`: while that file exists, the stack has no
/// dma-buf registration: libibverbs' default op answers EOPNOTSUPP
/// (rdma-core libibverbs/dummy_ops.c, reg_dmabuf_mr), as with a provider
/// or kernel (before 5.12) without it.
fn no_dmabuf() -> bool {
    std::env::var_os("FAKE_IBVERBS_NO_DMABUF_FILE").is_some_and(|p| std::path::Path::new(&p).exists())
}

/// ibv_reg_mr(3), ibv_reg_dmabuf_mr: "The MR starts at offset of the
/// dma-buf and its size is length. The dma-buf is identified by the file
/// descriptor fd. The argument iova specifies the virtual base address of
/// the MR when accessed through a lkey or rkey. It must have the same page
/// offset as offset." The fake's dma-buf (what the fake libcuda's
/// cuMemGetHandleForAddressRange hands out) is an open file description of
/// the device memory whose position is the dma-buf's byte 0; its pages are
/// mapped here, so peers' WRITEs and READs reach the GPU's pages, never its
/// device address.
#[no_mangle]
pub unsafe extern "C" fn ibv_reg_dmabuf_mr(
    pd: *mut ibv_pd,
    offset: u64,
    length: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> *mut ibv_mr {
    let access = access as c_uint;
    if super::control::failed((*pd).context) {
        return null(libc::EIO);
    }
    if no_dmabuf() {
        log("ibv_reg_dmabuf_mr: no dma-buf support (FAKE_IBVERBS_NO_DMABUF_FILE)");
        return null(libc::EOPNOTSUPP);
    }
    // ibv_reg_mr(3): for ibv_reg_dmabuf_mr "only the following flags are
    // supported: IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE,
    // IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_ATOMIC,
    // IBV_ACCESS_RELAXED_ORDERING" (others: EINVAL, as the kernel's
    // ib_check_mr_access refuses them).
    let supported = IBV_ACCESS_LOCAL_WRITE
        | IBV_ACCESS_REMOTE_WRITE
        | IBV_ACCESS_REMOTE_READ
        | IBV_ACCESS_REMOTE_ATOMIC
        | IBV_ACCESS_RELAXED_ORDERING;
    if access & !supported != 0 || !remote_needs_local(access) {
        log("ibv_reg_dmabuf_mr: access flags it does not take");
        return null(libc::EINVAL);
    }
    // ibv_reg_mr(3): iova "must have the same page offset as offset"; the
    // kernel refuses otherwise (uverbs_std_types_mr.c, REG_DMABUF_MR:
    // EINVAL).
    let page = page();
    if offset % page != iova % page {
        log("ibv_reg_dmabuf_mr: iova and offset at different page offsets");
        return null(libc::EINVAL);
    }
    // umem_dmabuf.c, ib_umem_dmabuf_get: the dma-buf must be one (dma_buf_get:
    // EBADF for no descriptor), and offset + length must not wrap or pass
    // its end (EINVAL).
    let mut st: libc::stat = std::mem::zeroed();
    if libc::fstat(fd, &mut st) != 0 {
        return null(libc::EBADF);
    }
    let base = libc::lseek(fd, 0, libc::SEEK_CUR);
    let size = (st.st_size as i64).saturating_sub(base).max(0) as u64;
    let end = offset.checked_add(length as u64);
    if base < 0 || length == 0 || end.is_none_or(|end| end > size) {
        log("ibv_reg_dmabuf_mr: offset + length past the dma-buf's end");
        return null(libc::EINVAL);
    }
    let start = base as u64 + offset;
    let (map_start, in_page) = (start - start % page, start % page);
    let map_len = (in_page + length as u64).div_ceil(page) * page;
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let p = libc::mmap(std::ptr::null_mut(), map_len as usize, rw, libc::MAP_SHARED, fd, map_start as libc::off_t);
    if p == libc::MAP_FAILED {
        return null(libc::EINVAL);
    }
    let host = p as u64 + in_page;
    let path = super::control::MrPath::DmaBuf;
    record(pd, iova, length, access & !IBV_ACCESS_RELAXED_ORDERING, host, (p as usize, map_len as usize), path)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    let key = (*mr).lkey;
    // After dereg the keys are invalid: a WRITE with the old rkey completes
    // with IBV_WC_REM_ACCESS_ERR (ibv_reg_mr(3), ibv_poll_cq(3)).
    locked(|f| {
        let slot = (key & 0x1fff) as usize;
        if f.mrs[slot].key == key {
            f.mrs[slot].used = 0;
        }
    });
    super::control::deregistered(key);
    pd_objects((*mr).pd, -1);
    let fake = Box::from_raw(mr.cast::<FakeMr>());
    if fake.map.0 != 0 {
        libc::munmap(fake.map.0 as *mut c_void, fake.map.1);
    }
    0
}

/// Opens the file behind our mapping `lo..hi` (inode `inode`): through
/// /proc/self/map_files (CAP_SYS_ADMIN), else through a descriptor of
/// this process open on the same inode (the memory's owner keeps one).
fn open_mapped(lo: u64, hi: u64, inode: &str) -> Option<c_int> {
    let open = |path: String| {
        let path = std::ffi::CString::new(path).ok()?;
        // SAFETY: opens a path of our own process's /proc.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        (fd >= 0).then_some(fd)
    };
    if let Some(fd) = open(format!("/proc/self/map_files/{lo:x}-{hi:x}")) {
        return Some(fd);
    }
    let inode: u64 = inode.parse().ok().filter(|&i| i != 0)?;
    for entry in std::fs::read_dir("/proc/self/fd").ok()?.flatten() {
        use std::os::unix::fs::MetadataExt;
        if std::fs::metadata(entry.path()).is_ok_and(|m| m.ino() == inode) {
            return open(entry.path().to_string_lossy().into_owned());
        }
    }
    None
}
