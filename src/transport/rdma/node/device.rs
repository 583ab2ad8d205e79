//! GPUDirect RDMA: device memory registered with every NIC once per region
//! (never per transfer), through a dma-buf the GPU provider exports
//! (`ibv_reg_dmabuf_mr`) or, where that fails, by its device pointer
//! through a peer-memory module (`ibv_reg_mr`), each first with relaxed
//! ordering and without it if the NIC refuses. A region no NIC takes stays
//! registered with the engine (cuda_ipc and tcp still move it); the reason
//! is kept, told to peers, and given by rdma links that are asked to move
//! it. Its blocks go over the NICs nearest its GPU (`topology.rs`).

use super::{rights, Nic, RdmaNode, RegionKeys};
use crate::desc::RegionId;
use crate::gpu::{DmaBuf, Gpu};
use crate::mem::Access;
use crate::transport::rdma::topology::{gpu_pci_path, nearest, Nearness};
use crate::transport::rdma::verbs::{Mr, MrAccess};

/// What registering device memory with an engine's NICs did, counted over
/// the engine's life: each region is registered once per NIC, so these do
/// not move while batches run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMrStats {
    /// Device regions registered with every NIC.
    pub regions: u64,
    /// Registrations (one per region and NIC) through a dma-buf.
    pub dmabuf: u64,
    /// Registrations of a device pointer through a peer-memory module.
    pub peer_memory: u64,
    /// Registrations the NIC took with relaxed ordering.
    pub relaxed_ordering: u64,
    /// Device regions a NIC could not register (they move over cuda_ipc or
    /// tcp; rdma links refuse them with the reason).
    pub failed: u64,
}

/// How one NIC took a device range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    DmaBuf,
    PeerMemory,
}

impl RdmaNode {
    /// Registers GPU `ordinal`'s memory at `addr..addr + len` (region `id`)
    /// with every NIC. A region a NIC cannot take is undone on the others
    /// and recorded with the reason, which is returned (the caller's
    /// registration stands: other transports move it).
    ///
    /// # Safety
    ///
    /// The memory stays allocated until [`RdmaNode::unregister_region`].
    pub unsafe fn register_device_region(
        &self,
        id: RegionId,
        addr: u64,
        len: u64,
        access: Access,
        gpu: &dyn Gpu,
        ordinal: u32,
    ) -> Result<(), String> {
        // Registered again with the same info (same id): once per region.
        if self.regions.read().unwrap_or_else(|p| p.into_inner()).contains_key(&id.raw()) {
            return Ok(());
        }
        if let Some(reason) = self.unreachable(id.raw()) {
            return Err(reason);
        }
        let base = rights(access);
        let nics = self.nearest_mask(gpu, ordinal);
        let remote = base.remote_write || base.remote_read;
        let mut keys = RegionKeys { addr, len, lkeys: Vec::new(), rkeys: Vec::new(), remote, nics, host: false };
        // One dma-buf for every NIC: each registration takes its own reference.
        let dmabuf = gpu.export_dmabuf(addr, len).map_err(|e| e.to_string());
        let mut made = Vec::with_capacity(self.nics.len());
        for (index, nic) in self.nics.iter().enumerate() {
            // SAFETY: forwarded from our caller.
            match unsafe { register_on(nic, addr, len, base, dmabuf.as_ref()) } {
                Ok((mr, via, relaxed)) => {
                    keys.lkeys.push(mr.lkey);
                    keys.rkeys.push(mr.rkey);
                    made.push((via, relaxed));
                }
                Err(why) => {
                    for earlier in &self.nics[..index] {
                        let _ = earlier.mrs.lock().unwrap_or_else(|p| p.into_inner()).unregister(addr, len);
                    }
                    let reason = format!(
                        "GPU {ordinal}'s memory at {addr:#x}+{len} could not be registered with NIC {} ({why})",
                        nic.name
                    );
                    self.unreachable.write().unwrap_or_else(|p| p.into_inner()).insert(id.raw(), reason.clone());
                    self.device_stats.lock().unwrap_or_else(|p| p.into_inner()).failed += 1;
                    return Err(reason);
                }
            }
        }
        {
            let mut stats = self.device_stats.lock().unwrap_or_else(|p| p.into_inner());
            stats.regions += 1;
            for (via, relaxed) in made {
                match via {
                    Via::DmaBuf => stats.dmabuf += 1,
                    Via::PeerMemory => stats.peer_memory += 1,
                }
                stats.relaxed_ordering += u64::from(relaxed);
            }
        }
        self.regions.write().unwrap_or_else(|p| p.into_inner()).insert(id.raw(), keys);
        Ok(())
    }

    /// What registering device memory did so far.
    pub fn device_stats(&self) -> DeviceMrStats {
        *self.device_stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why local region `region` (device memory) is registered with no NIC,
    /// if it is not.
    pub fn unreachable(&self, region: u64) -> Option<String> {
        self.unreachable.read().unwrap_or_else(|p| p.into_inner()).get(&region).cloned()
    }

    /// The first reason a device region of this engine's is registered with
    /// no NIC, if one is not.
    pub fn any_unreachable(&self) -> Option<String> {
        self.unreachable.read().unwrap_or_else(|p| p.into_inner()).values().next().cloned()
    }

    /// The NICs nearest GPU `ordinal` (names), and how near.
    pub fn nics_for_gpu(&self, gpu: &dyn Gpu, ordinal: u32) -> (Vec<String>, Nearness) {
        let (mask, nearness) = self.find_nearest(gpu, ordinal);
        let names = self.nics.iter().enumerate().filter(|(i, _)| mask & (1 << i) != 0).map(|(_, n)| n.name.clone());
        (names.collect(), nearness)
    }

    /// The mask of the NICs nearest GPU `ordinal`, found once per GPU.
    fn nearest_mask(&self, gpu: &dyn Gpu, ordinal: u32) -> u32 {
        if let Some(&mask) = self.nearest.lock().unwrap_or_else(|p| p.into_inner()).get(&ordinal) {
            return mask;
        }
        let (mask, _) = self.find_nearest(gpu, ordinal);
        self.nearest.lock().unwrap_or_else(|p| p.into_inner()).insert(ordinal, mask);
        mask
    }

    /// Reads where GPU `ordinal` sits (its PCI path from sysfs, its NUMA
    /// node from the provider) and ranks the NICs against it.
    fn find_nearest(&self, gpu: &dyn Gpu, ordinal: u32) -> (u32, Nearness) {
        let device = gpu.devices().ok().and_then(|all| all.into_iter().find(|d| d.ordinal == ordinal));
        let numa = device.as_ref().and_then(|d| d.numa_node);
        let path = device.and_then(|d| d.pci_bus).and_then(|bus| gpu_pci_path(&bus));
        let nics: Vec<_> = self.nics.iter().map(|n| (n.pci_path.as_deref(), n.numa_node)).collect();
        nearest(path.as_deref(), numa, &nics)
    }
}

/// Registers a device range with `nic`: through the dma-buf if there is
/// one, else by device pointer; each with relaxed ordering first. The
/// registration is kept in the NIC's cache (deregistered with the region).
///
/// # Safety
///
/// The memory stays allocated until the registration is dropped.
unsafe fn register_on(
    nic: &Nic,
    addr: u64,
    len: u64,
    base: MrAccess,
    dmabuf: Result<&DmaBuf, &String>,
) -> Result<(Mr, Via, bool), String> {
    let mut mrs = nic.mrs.lock().unwrap_or_else(|p| p.into_inner());
    let (verbs, pd) = mrs.target();
    let relaxed = MrAccess { relaxed_ordering: true, ..base };
    let mut made = None;
    let dmabuf_error = match dmabuf {
        Ok(buf) => {
            let mut last = String::new();
            for access in [relaxed, base] {
                // SAFETY: our caller's contract; the dma-buf is live.
                match unsafe { verbs.reg_dmabuf_mr(pd, buf.range(), addr, access) } {
                    Ok(mr) => {
                        made = Some((mr, Via::DmaBuf, access));
                        break;
                    }
                    Err(error) => last = error.to_string(),
                }
            }
            last
        }
        Err(why) => format!("no dma-buf: {why}"),
    };
    if made.is_none() {
        let mut last = String::new();
        for access in [relaxed, base] {
            // SAFETY: our caller's contract.
            match unsafe { verbs.reg_mr(pd, addr, len, access) } {
                Ok(mr) => {
                    made = Some((mr, Via::PeerMemory, access));
                    break;
                }
                Err(error) => last = error.to_string(),
            }
        }
        if made.is_none() {
            return Err(format!("dma-buf: {dmabuf_error}; peer memory: {last}"));
        }
    }
    let (mr, via, access) = made.expect("set above");
    mrs.keep(mr, access);
    Ok((mr, via, access.relaxed_ordering))
}
