//! What this host offers an engine, read before one starts: its identity
//! (same-host peers are recognised by it), its locked-memory limit (what
//! RDMA registrations and pinned host regions are charged against; lanes
//! lock none), its shared-memory directory, its RDMA devices, its
//! GPUs, and which NICs each GPU's memory would go over.
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
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    (rc == 0).then_some(if limit.rlim_cur == libc::RLIM_INFINITY { u64::MAX } else { limit.rlim_cur })
}

/// Where shared-memory regions live.
pub const SHM_DIR: &str = crate::mem::shm::SHM_DIR;

/// Bytes the shm transport copies at a time (a block is copied in pieces
/// of this size, [`shm_copy`]).
pub const SHM_COPY_PIECE_BYTES: usize = crate::transport::shm::COPY_PIECE_BYTES;

/// Copies `src` into `dst` the way the shm transport copies a block: in
/// pieces of [`SHM_COPY_PIECE_BYTES`], each piece's destination cache lines
/// fetched for writing first. `kvring bench`'s memcpy baseline copies with
/// it, so that it measures the transport's own copy.
///
/// # Panics
///
/// If the two lengths differ.
pub fn shm_copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "shm_copy: lengths differ");
    // SAFETY: two live slices of the same length; `&mut` and `&` cannot
    // overlap.
    unsafe { crate::transport::shm::copy_pieces(src.as_ptr(), dst.as_mut_ptr(), src.len()) };
}

/// RDMA devices libibverbs lists (name, NUMA node, each port's state,
/// link layer, MTU, GIDs and the GID index kvring would use), one line
/// each, or in one line why there are none: no libibverbs, or no device.
pub fn rdma_devices() -> Result<Vec<String>, String> {
    use crate::transport::rdma::ibverbs::IbVerbs;
    use crate::transport::rdma::verbs::Verbs;
    if let Some(why) = IbVerbs::unavailable() {
        return Err(format!("libibverbs not found: {why}"));
    }
    let devices = IbVerbs::new().devices().map_err(|e| e.to_string())?;
    if devices.is_empty() {
        return Err("no RDMA device (libibverbs lists none)".into());
    }
    Ok(devices.iter().map(describe_device).collect())
}

/// One device as `kvring info` shows it.
pub fn describe_device(d: &crate::transport::rdma::verbs::DeviceInfo) -> String {
    use crate::transport::rdma::devices::pick_gid;
    let ports: Vec<String> = d
        .ports
        .iter()
        .map(|p| {
            let gids: Vec<String> = p
                .gids
                .iter()
                .map(|(i, g, v2)| format!("{i}={}{}", std::net::Ipv6Addr::from(*g), if *v2 { " v2" } else { "" }))
                .collect();
            let state = if p.active { "active" } else { "down" };
            let gid = pick_gid(p).map_or("none".to_string(), |g| g.to_string());
            format!(
                "port {} {state} {} mtu {} lid {} gid {gid} [{}]",
                p.port,
                p.link_layer,
                p.mtu,
                p.lid,
                gids.join(" ")
            )
        })
        .collect();
    let numa = d.numa_node.map_or("numa ?".to_string(), |n| format!("numa {n}"));
    let ports = if ports.is_empty() { "no port".into() } else { ports.join(", ") };
    format!("{} ({numa}; {ports})", d.name)
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

/// For each NVIDIA GPU sysfs lists, the RDMA NICs its memory would go
/// over and why (the same choice an engine makes: same PCIe switch, else
/// the same host bridge, else the same NUMA node, else every NIC), one
/// line each, or why there is nothing to choose (no GPU, no NIC). From
/// sysfs alone (`$KVRING_SYSFS_ROOT`, else `/sys`): no driver needed.
pub fn gpu_nics() -> Result<Vec<String>, String> {
    use crate::transport::rdma::gpu_nics::{choices, sysfs_root};
    choices(&sysfs_root())
}

#[cfg(test)]
mod tests {
    #[test]
    fn shm_copy_copies_every_piece_and_the_tail() {
        let len = 3 * super::SHM_COPY_PIECE_BYTES + 999;
        let src: Vec<u8> = (0..len).map(|i| (i * 7 + (i >> 10)) as u8).collect();
        let mut dst = vec![0u8; len];
        super::shm_copy(&mut dst, &src);
        assert_eq!(dst, src);
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn shm_copy_refuses_different_lengths() {
        super::shm_copy(&mut [0u8; 3], &[1u8; 4]);
    }
}
