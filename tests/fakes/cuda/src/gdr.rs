//! GPUDirect RDMA write ordering [ref: 6.1 Data types,
//! CUGPUDirectRDMAWritesOrdering, CUflushGPUDirectRDMAWritesOptions,
//! CUflushGPUDirectRDMAWritesTarget, CUflushGPUDirectRDMAWritesScope;
//! cuFlushGPUDirectRDMAWrites]. A NIC's writes into device memory are seen
//! in order by the GPU's own work only up to the scope
//! `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` reports
//! (`FAKECUDA_GDR_ORDERING`: 0 none, 100 owner, 200 all devices); below
//! that, `cuFlushGPUDirectRDMAWrites` "blocks until remote writes are
//! visible to the specified scope". The fake cannot hold a NIC's writes
//! back (the fake libibverbs writes the dma-buf's pages at once), so it
//! checks the call and counts the flushes that were needed
//! (`fakecuda_stat("gdr_flushes")`).

use super::{code, err, with, CUresult, COUNTERS};
use std::ffi::c_uint;
use std::sync::atomic::Ordering::Relaxed;

/// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX`, the only target.
const TARGET_CURRENT_CTX: c_uint = 0;
/// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER` and `..._TO_ALL_DEVICES`.
const TO_OWNER: c_uint = 100;
const TO_ALL_DEVICES: c_uint = 200;
/// `CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST`: the function is supported.
const OPTION_HOST: i32 = 1;

#[no_mangle]
pub unsafe extern "C" fn cuFlushGPUDirectRDMAWrites(target: c_uint, scope: c_uint) -> CUresult {
    code(with(|d| {
        // [ref: cuFlushGPUDirectRDMAWrites: target is one of
        // CUflushGPUDirectRDMAWritesTarget (the current context only),
        // scope one of CUflushGPUDirectRDMAWritesScope.]
        if target != TARGET_CURRENT_CTX || (scope != TO_OWNER && scope != TO_ALL_DEVICES) {
            return Err(err::INVALID_VALUE);
        }
        // [ref: ibid.: "Users may query support for this API via
        // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS"; the
        // HOST bit means it is supported.]
        if d.config.gdr_flush_options & OPTION_HOST == 0 {
            return Err(err::NOT_SUPPORTED);
        }
        // The target is the current context: none is an error.
        d.current()?;
        // [ref: ibid.: "If the scope equals or lies within the scope
        // indicated by CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
        // the call will be a no-op".]
        if (scope as i32) > d.config.gdr_ordering {
            COUNTERS.gdr_flushes.fetch_add(1, Relaxed);
        }
        Ok(())
    }))
}
