//! What this host offers an engine, read before one starts: its identity
//! (same-host peers are recognised by it), its locked-memory limit against
//! what the lanes need, its shared-memory directory, its RDMA devices and
//! its GPUs.
//! `kvring info` prints these; an embedding engine can check them the same
//! way.

/// This host's identity (boot id and hostname): equal for two engines on
/// the same host, which is how shared memory is offered.
pub fn id() -> &'static str {
    crate::segment::local_host_id()
}

/// The soft locked-memory limit in bytes (`u64::MAX` when unlimited), if it
/// can be read.
pub fn locked_memory_limit() -> Option<u64> {
    crate::runtime::lane::memlock_limit_bytes()
}

/// Locked memory an engine with `lanes` lanes and the default io_uring
/// buffers needs (glommio's floor of 512 KiB at least).
pub fn locked_memory_needed(lanes: usize) -> u64 {
    crate::runtime::lane::memlock_needed_bytes(lanes, crate::runtime::lane::DEFAULT_IO_MEMORY_BYTES)
}

/// Where shared-memory regions live.
pub const SHM_DIR: &str = crate::mem::shm::SHM_DIR;

/// RDMA devices the kernel lists (name, NUMA node, active ports and the GID
/// index kvring would use), one line each, or why there are none.
pub fn rdma_devices() -> Result<Vec<String>, String> {
    use crate::transport::rdma::devices::{pick_gid, read_sysfs, SYSFS_ROOT};
    let root = std::path::Path::new(SYSFS_ROOT);
    if !root.is_dir() {
        return Err(format!("no devices: {SYSFS_ROOT} does not exist"));
    }
    let devices = read_sysfs(root);
    if devices.is_empty() {
        return Err(format!("no devices under {SYSFS_ROOT}"));
    }
    Ok(devices
        .iter()
        .map(|d| {
            let ports: Vec<String> = d
                .ports
                .iter()
                .filter(|p| p.active)
                .map(|p| format!("port {} gid {:?} mtu {}", p.port, pick_gid(p), p.mtu))
                .collect();
            let numa = d.numa_node.map_or("numa ?".to_string(), |n| format!("numa {n}"));
            let ports = if ports.is_empty() { "no active port".into() } else { ports.join(", ") };
            format!("{} ({numa}; {ports})", d.name)
        })
        .collect())
}

/// GPUs the CUDA driver lists (ordinal, name, memory, PCI bus, NUMA node),
/// one line each, or why there are none (no driver, no device).
pub fn gpus() -> Result<Vec<String>, String> {
    use crate::gpu::Gpu;
    let gpu = crate::gpu::cuda::CudaGpu::load().map_err(|e| e.to_string())?;
    let devices = gpu.devices().map_err(|e| e.to_string())?;
    Ok(devices
        .iter()
        .map(|d| {
            let numa = d.numa_node.map_or("numa ?".to_string(), |n| format!("numa {n}"));
            let bus = d.pci_bus.as_deref().unwrap_or("pci ?");
            format!("{}: {} ({} MiB; {bus}; {numa})", d.ordinal, d.name, d.memory_bytes >> 20)
        })
        .collect())
}
