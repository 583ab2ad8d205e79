//! GPUDirect RDMA write ordering (VERBS-REVIEW #15). A NIC's writes into
//! device memory are seen in order by the GPU's own work only up to the
//! scope `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` reports.
//! Below the owning GPU's scope, a consumer told of the data by a message
//! that did not travel with it (a notification after an untagged push) may
//! read stale bytes unless the target first calls
//! `cuFlushGPUDirectRDMAWrites`, which "blocks until remote writes are
//! visible to the specified scope" and is supported where
//! `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS` has the HOST
//! bit (CUDA Driver API, `cuFlushGPUDirectRDMAWrites`; both from CUDA 11.3).

use super::{check, cuda_error, CudaGpu};
use crate::error::Result;
use crate::gpu::tier;
use cudarc::driver::sys;
use std::ffi::c_int;

/// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST`.
const OPTION_HOST: c_int = 1;

impl CudaGpu {
    /// Flushes GPU `ordinal`'s GPUDirect RDMA writes to its own scope where
    /// it does not order them; true when it had to. Drivers before 11.3
    /// have neither the attribute nor the flush: nothing to do there.
    pub(super) fn flush_gdr_writes(&self, ordinal: u32) -> Result<bool> {
        if self.driver_version < tier::GDR_FLUSH_DRIVER {
            return Ok(false);
        }
        let _bound = self.bind(ordinal)?;
        let device = self.contexts[ordinal as usize].device;
        let attribute = |attribute, what| {
            let mut value: c_int = 0;
            // SAFETY: writes one int for a device this provider opened.
            check(unsafe { sys::cuDeviceGetAttribute(&mut value, attribute, device) }, what).map(|()| value)
        };
        let ordering = attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
            "asking for GPUDirect RDMA write ordering",
        )?;
        let owner = sys::CUGPUDirectRDMAWritesOrdering::CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER as c_int;
        if ordering >= owner {
            return Ok(false);
        }
        let options = attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS,
            "asking how GPUDirect RDMA writes flush",
        )?;
        if options & OPTION_HOST == 0 {
            return Err(cuda_error(format!(
                "GPU {ordinal} neither orders a NIC's writes for its own work nor can flush them \
                 (cuFlushGPUDirectRDMAWrites unsupported): a notification after an untagged push could \
                 reach its consumer before the data; push with an arrival tag instead"
            )));
        }
        let target = sys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX;
        let scope = sys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER;
        // SAFETY: no pointers; the GPU's context is current (`_bound`).
        check(unsafe { sys::cuFlushGPUDirectRDMAWrites(target, scope) }, "flushing GPUDirect RDMA writes")?;
        Ok(true)
    }
}
