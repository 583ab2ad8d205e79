//! Device memory as the simulated NIC reaches it. A registration by
//! address is checked as a NIC's pinning checks it: memory of a simulated
//! GPU registers only through a peer-memory module (which hands the NIC the
//! GPU's pages), and any other range must be mapped readable (and writable,
//! when the NIC may write it) in this process, so a range no host thread
//! may touch is refused (as `get_user_pages` fails on it), never
//! dereferenced later. A dma-buf registration maps the dma-buf itself.
//! Either way the NIC reaches device memory through a mapping of its own
//! (an [`Alias`]), never through the device address, which faults.

use super::MrPath;
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Memory, SimGpu};
use crate::transport::rdma::verbs::MrAccess;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;

/// A mapping of device memory that only the simulated NIC uses, under the
/// fabric's lock; unmapped when its registration goes.
#[derive(Debug)]
pub(super) struct Alias {
    base: *mut libc::c_void,
    len: usize,
    /// Where the registered range's first byte is in it.
    start: u64,
}

// SAFETY: an address range and its length; the bytes are touched only by
// the simulated NIC's copies, made under the fabric's lock.
unsafe impl Send for Alias {}

impl Alias {
    /// Where the registered range starts in this mapping.
    pub fn start(&self) -> u64 {
        self.start
    }
}

impl Drop for Alias {
    fn drop(&mut self) {
        // SAFETY: the range was mapped by `map_parts` and is unmapped once.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

fn bad_address(reason: String) -> Error {
    Error::Device { device: "simulated".into(), reason }
}

/// How the NIC reaches `addr..addr + len` registered by address: host
/// memory as it is, a simulated GPU's memory through its pages when a
/// peer-memory module is loaded.
pub(super) fn pin(
    gpus: &[Arc<SimGpu>],
    peer_memory: bool,
    addr: u64,
    len: u64,
    access: MrAccess,
) -> Result<(MrPath, Option<Alias>)> {
    for gpu in gpus {
        match gpu.classify(addr, len)? {
            Memory::Device { ordinal, .. } if !peer_memory => {
                return Err(bad_address(format!(
                    "registering {addr:#x}+{len}: it is memory of GPU {ordinal} and no peer-memory module \
                     (nvidia-peermem) is loaded, so the NIC cannot pin it (bad address); register it through a \
                     dma-buf"
                )))
            }
            Memory::Device { .. } => {
                let pages = gpu.nic_pages(addr, len)?;
                let parts: Vec<_> = pages.iter().map(|(file, offset, len)| (file.as_fd(), *offset, *len)).collect();
                return Ok((MrPath::PeerMemory, Some(map_parts(&parts)?)));
            }
            Memory::Host | Memory::Managed { .. } => {}
        }
    }
    let writable = access.local_write || access.remote_write;
    check_mapped(&std::fs::read_to_string("/proc/self/maps").unwrap_or_default(), addr, len, writable)
        .map_err(|why| bad_address(format!("registering {addr:#x}+{len}: {why} (bad address)")))?;
    Ok((MrPath::Host, None))
}

/// Checks that `addr..addr + len` lies in mappings of `maps` (the text of
/// `/proc/self/maps`) that are readable, and writable when `write`.
fn check_mapped(maps: &str, addr: u64, len: u64, write: bool) -> std::result::Result<(), String> {
    let end = addr.saturating_add(len);
    let mut at = addr;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else { continue };
        let Some((start, stop)) = range.split_once('-') else { continue };
        let (Ok(start), Ok(stop)) = (u64::from_str_radix(start, 16), u64::from_str_radix(stop, 16)) else { continue };
        if stop <= at {
            continue;
        }
        if start > at {
            break;
        }
        let perms = perms.as_bytes();
        if perms.first() != Some(&b'r') || (write && perms.get(1) != Some(&b'w')) {
            return Err(format!("{at:#x} is mapped {} here", String::from_utf8_lossy(perms)));
        }
        at = stop;
        if at >= end {
            return Ok(());
        }
    }
    Err(format!("{at:#x} is not mapped"))
}

/// Maps `parts` (descriptor, offset in it, length) back to back, readable
/// and writable, as one range; each part after the first must start at a
/// page of its descriptor and follow a part that ended on a page.
pub(super) fn map_parts(parts: &[(BorrowedFd<'_>, u64, u64)]) -> Result<Alias> {
    let page = page_bytes();
    let first = parts.first().ok_or_else(|| bad_address("nothing to map".into()))?;
    let delta = first.1 % page;
    let total = parts.iter().try_fold(delta, |sum, (_, _, len)| sum.checked_add(*len));
    let total = total.and_then(|t| t.checked_add(page - 1)).map(|t| t & !(page - 1));
    let total = total.and_then(|t| usize::try_from(t).ok()).ok_or_else(|| bad_address("a range too large".into()))?;
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
    // SAFETY: a fresh anonymous reservation with no access; the kernel picks
    // the address, and the parts are mapped over it below.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), total, libc::PROT_NONE, flags, -1, 0) };
    if base == libc::MAP_FAILED {
        return Err(Error::io("reserving a simulated NIC mapping", std::io::Error::last_os_error()));
    }
    let alias = Alias { base, len: total, start: base as u64 + delta };
    let mut at = base as u64;
    for (index, (fd, offset, len)) in parts.iter().enumerate() {
        let (file_offset, span) = if index == 0 { (offset - delta, delta + len) } else { (*offset, *len) };
        if !file_offset.is_multiple_of(page) || !(at - base as u64).is_multiple_of(page) {
            return Err(bad_address("pieces that do not meet on page boundaries".into()));
        }
        if offset.checked_add(*len).is_none_or(|end| end > file_len(*fd)) {
            return Err(bad_address(format!("{len} bytes at {offset} run past the memory behind the descriptor")));
        }
        let (Ok(span), Ok(file_offset)) = (usize::try_from(span), libc::off_t::try_from(file_offset)) else {
            return Err(bad_address("a range too large".into()));
        };
        let (prot, fixed) = (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_FIXED);
        // SAFETY: a shared mapping of memory the descriptor holds, placed
        // inside the reservation made above for exactly these parts.
        let placed = unsafe { libc::mmap(at as *mut libc::c_void, span, prot, fixed, fd.as_raw_fd(), file_offset) };
        if placed == libc::MAP_FAILED {
            return Err(Error::io("mapping device memory for the simulated NIC", std::io::Error::last_os_error()));
        }
        at += span as u64;
    }
    Ok(alias)
}

fn page_bytes() -> u64 {
    // SAFETY: sysconf reads a constant of the running system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().filter(|p| p.is_power_of_two()).unwrap_or(4096)
}

/// The size of what `fd` holds (0 when it cannot be read).
fn file_len(fd: BorrowedFd<'_>) -> u64 {
    // SAFETY: a zeroed stat is a valid out-parameter for fstat.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is a live descriptor; `stat` is ours.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
        return 0;
    }
    u64::try_from(stat.st_size).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_must_lie_in_readable_and_writable_mappings() {
        let maps = "1000-3000 rw-p 0 0:0 0\n3000-4000 r--p 0 0:0 0\n5000-6000 ---p 0 0:0 0\n";
        assert_eq!(check_mapped(maps, 0x1000, 0x2000, true), Ok(()));
        assert_eq!(check_mapped(maps, 0x2000, 0x2000, false), Ok(()), "read-only is fine to read");
        assert!(check_mapped(maps, 0x2000, 0x2000, true).unwrap_err().contains("r--p"));
        assert!(check_mapped(maps, 0x3800, 0x1000, false).unwrap_err().contains("0x4000 is not mapped"));
        assert!(check_mapped(maps, 0x5000, 16, false).unwrap_err().contains("---p"), "no access: device memory");
        assert!(check_mapped(maps, 0x9000, 16, false).is_err());
    }
}
