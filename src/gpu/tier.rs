//! How one chunk's copies are issued: the batch API, the copy kernel, or
//! one copy call each. A pure function of what the driver offers, what is
//! pinned and which GPUs can reach each other, so that every provider makes
//! the same choice and the choice is tested on its own.
//!
//! The kernel dereferences every address of its descriptors on the GPU: a
//! host address must be pinned and mapped for the device at that same
//! address, and memory of another GPU needs peer access from the GPU that
//! runs it. Either missing, it would fault (an illegal address, which
//! poisons the whole context), so those chunks take one copy call each,
//! which the driver stages as it must.

use super::CopyMethod;

/// The oldest driver kvring's CUDA provider runs on (CUDA 11.0: every
/// driver function it calls unconditionally, and PTX ISA 7.0 for the copy
/// kernel). Versions are CUDA's numbers: 1000 × major + 10 × minor.
pub const BASELINE_DRIVER: u32 = 11000;
/// The first driver with `cuGetProcAddress_v2`, through which the batch
/// API is looked up (CUDA 12.0).
pub const PROC_ADDRESS_DRIVER: u32 = 12000;
/// The first driver with `cuMemGetHandleForAddressRange`, which exports
/// device memory as a dma-buf for a NIC (CUDA 11.7).
pub const DMABUF_DRIVER: u32 = 11070;
/// `cuFlushGPUDirectRDMAWrites` and the GPUDirect RDMA ordering attributes
/// (CUDA 11.3).
pub const GDR_FLUSH_DRIVER: u32 = 11030;
/// The first driver with `cuMemcpyBatchAsync` (CUDA 12.8).
pub const BATCH_API_DRIVER: u32 = 12080;

/// What decides one chunk's method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierInputs {
    /// The driver's CUDA version (`cuDriverGetVersion`: 12080 for 12.8).
    pub driver_version: u32,
    /// The batch API's entry point was found (looked up only on drivers
    /// from [`BATCH_API_DRIVER`]).
    pub batch_api: bool,
    /// The copy kernel is loaded on the stream's GPU, a descriptor slot is
    /// free and the chunk fits one.
    pub kernel_ready: bool,
    /// Every host range of the chunk lies in memory this provider pinned
    /// and mapped for the device at the same address.
    pub host_pinned: bool,
    /// Every GPU the chunk touches is the stream's, or one the stream's GPU
    /// has peer access to.
    pub peers_reachable: bool,
}

/// The method for a chunk: the batch API on drivers that have it (it takes
/// pageable memory and other GPUs' memory as they are); else the copy
/// kernel, only where every address it would dereference is reachable;
/// else one copy call per copy.
pub fn choose_method(inputs: TierInputs) -> CopyMethod {
    if inputs.driver_version >= BATCH_API_DRIVER && inputs.batch_api {
        return CopyMethod::Batched;
    }
    if inputs.kernel_ready && inputs.host_pinned && inputs.peers_reachable {
        return CopyMethod::Kernel;
    }
    CopyMethod::PerCopy
}

/// `version` as `12.8`.
pub fn version_text(version: u32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(driver_version: u32) -> TierInputs {
        TierInputs { driver_version, batch_api: true, kernel_ready: true, host_pinned: true, peers_reachable: true }
    }

    #[test]
    fn the_batch_api_on_new_drivers_the_kernel_only_where_it_cannot_fault_else_one_call_each() {
        use CopyMethod::*;
        // 12.8 and newer: the batch API, pinned or not, peers or not.
        assert_eq!(choose_method(inputs(12080)), Batched);
        assert_eq!(choose_method(inputs(13000)), Batched);
        let unpinned = TierInputs { host_pinned: false, peers_reachable: false, ..inputs(12080) };
        assert_eq!(choose_method(unpinned), Batched);
        // An entry point claimed on an older driver is not trusted.
        assert_eq!(choose_method(inputs(12060)), Kernel);
        // 12.8 whose lookup failed: the next tier.
        assert_eq!(choose_method(TierInputs { batch_api: false, ..inputs(12080) }), Kernel);
        // Older drivers: the kernel, only with every host range pinned and
        // every GPU reachable.
        assert_eq!(choose_method(TierInputs { batch_api: false, ..inputs(11000) }), Kernel);
        assert_eq!(choose_method(TierInputs { host_pinned: false, ..inputs(12000) }), PerCopy);
        assert_eq!(choose_method(TierInputs { peers_reachable: false, ..inputs(12000) }), PerCopy);
        assert_eq!(choose_method(TierInputs { kernel_ready: false, ..inputs(12000) }), PerCopy);
        assert_eq!(version_text(12080), "12.8");
        assert_eq!(version_text(11000), "11.0");
    }
}
