//! Device memory as a dma-buf, for a NIC to register (GPUDirect RDMA
//! without a peer-memory module): `cuMemGetHandleForAddressRange` with the
//! dma-buf handle type. It exists from CUDA 11.7 drivers
//! ([`tier::DMABUF_DRIVER`]) and only GPUs that say so support it
//! (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`); cudarc looks the symbol up at
//! its first call and panics when the driver lacks it, so it is called only
//! past both checks, and under the provider's `catch_unwind` besides.

use super::{check, cuda_error, CudaGpu};
use crate::error::Result;
use crate::gpu::{tier, DmaBuf, Memory};
use cudarc::driver::sys;
use std::ffi::{c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};

impl CudaGpu {
    /// `addr..addr + len` of this process's device memory as a dma-buf of
    /// the whole pages around it.
    pub(super) fn dmabuf_range(&self, addr: u64, len: u64) -> Result<DmaBuf> {
        if self.driver_version < tier::DMABUF_DRIVER {
            return Err(cuda_error(format!(
                "the CUDA driver supports CUDA {}; exporting device memory as dma-buf needs {}",
                tier::version_text(self.driver_version),
                tier::version_text(tier::DMABUF_DRIVER)
            )));
        }
        let Memory::Device { ordinal, base, len: run_len } = self.classify_range(addr, len)? else {
            return Err(cuda_error(format!("{addr:#x}+{len} is not device memory: no dma-buf to export")));
        };
        let _bound = self.bind(ordinal)?;
        let device = self.contexts[ordinal as usize].device;
        let mut supported: c_int = 0;
        let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED;
        // SAFETY: writes one int for a device this provider opened.
        check(unsafe { sys::cuDeviceGetAttribute(&mut supported, attribute, device) }, "asking for dma-buf support")?;
        if supported == 0 {
            return Err(cuda_error(format!("GPU {ordinal} cannot export its memory as dma-buf")));
        }
        let span = page_span(addr, len, base.0, run_len, host_page_bytes()).map_err(cuda_error)?;
        let mut fd: c_int = -1;
        // SAFETY: the handle type is the dma-buf descriptor, written as one
        // int into `fd`; the range lies in this process's allocation.
        let result = unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut c_int).cast::<c_void>(),
                span.start,
                span.len as usize,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        check(result, "exporting device memory as dma-buf")?;
        if fd < 0 {
            return Err(cuda_error("exporting device memory as dma-buf returned no descriptor"));
        }
        // SAFETY: the driver handed us a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(DmaBuf { fd, offset: span.offset, len })
    }
}

/// The host's page size (the driver exports page-aligned ranges only).
fn host_page_bytes() -> u64 {
    // SAFETY: sysconf reads a constant of the running system.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().filter(|p| p.is_power_of_two()).unwrap_or(4096)
}

/// The page-aligned range to export around `addr..addr + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PageSpan {
    /// First byte of the exported range (page-aligned).
    pub start: u64,
    /// Its length (whole pages).
    pub len: u64,
    /// Where `addr` lies in it.
    pub offset: u64,
}

/// The whole pages around `addr..addr + len`, which must lie inside the
/// allocation `base..base + alloc_len` holding the range (the driver
/// exports nothing of a neighbour's memory).
pub(super) fn page_span(
    addr: u64,
    len: u64,
    base: u64,
    alloc_len: u64,
    page: u64,
) -> std::result::Result<PageSpan, String> {
    let end = addr.checked_add(len).filter(|_| len > 0).ok_or("an empty or overflowing range")?;
    let start = addr & !(page - 1);
    let end_up = end.checked_add(page - 1).ok_or("the range overflows")? & !(page - 1);
    let alloc_end = base.checked_add(alloc_len).ok_or("the allocation overflows")?;
    if start < base || end_up > alloc_end {
        return Err(format!(
            "the pages around {addr:#x}+{len} run outside its allocation ({base:#x}+{alloc_len}): a dma-buf is \
             exported in whole pages"
        ));
    }
    Ok(PageSpan { start, len: end_up - start, offset: addr - start })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exported_span_is_whole_pages_inside_the_allocation() {
        let base = 0x7f00_0000_0000;
        let span = page_span(base + 100, 5000, base, 2 << 20, 4096).unwrap();
        assert_eq!(span, PageSpan { start: base, len: 8192, offset: 100 });
        let aligned = page_span(base + 4096, 4096, base, 2 << 20, 4096).unwrap();
        assert_eq!(aligned, PageSpan { start: base + 4096, len: 4096, offset: 0 });
        // An allocation that does not start on a page, or ends inside the
        // last page: the pages around the range would reach a neighbour.
        assert!(page_span(base + 300, 100, base + 256, 1 << 20, 4096).unwrap_err().contains("outside"));
        assert!(page_span(base, 5000, base, 5000, 4096).unwrap_err().contains("whole pages"));
        assert!(page_span(base, 0, base, 4096, 4096).is_err());
        assert!(page_span(u64::MAX - 10, 5, 0, u64::MAX, 4096).is_err());
    }
}
