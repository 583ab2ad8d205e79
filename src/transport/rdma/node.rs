//! An engine's RDMA side: its NICs (a context, a PD and a port each), every
//! registered region's MR on each NIC, and the QPs it accepted for
//! initiators. Owned by the engine; links borrow it for local keys.

use super::devices::pick_gid;
use super::mr_cache::MrCache;
use super::verbs::*;
use crate::desc::RegionId;
use crate::error::{Error, Result};
use crate::segment::RdmaInfo;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

/// Send-queue depth of every QP kvring creates.
pub const QP_DEPTH: u32 = 1024;
/// Writes up to this many bytes go inline.
pub const MAX_INLINE: u32 = 64;
/// Most QP endpoints one connect request may carry.
pub const MAX_CONNECT_ENDPOINTS: usize = 1024;

/// One NIC as the engine uses it.
#[derive(Debug)]
pub struct Nic {
    /// Device name.
    pub name: String,
    context: Context,
    pd: Pd,
    port: u8,
    gid_index: u8,
    mrs: Mutex<MrCache>,
    /// The CQ of the QPs accepted for initiators (one-sided operations
    /// complete on the initiator's side; nothing is polled here).
    passive_cq: Cq,
}

/// A region's keys on every NIC.
#[derive(Debug, Clone)]
struct RegionKeys {
    addr: u64,
    len: u64,
    lkeys: Vec<u32>,
    rkeys: Vec<u32>,
}

/// An engine's RDMA state.
#[derive(Debug)]
pub struct RdmaNode {
    verbs: Arc<dyn Verbs>,
    nics: Vec<Nic>,
    regions: RwLock<HashMap<u32, RegionKeys>>,
    accepted: Mutex<HashMap<String, Vec<Qp>>>,
}

impl RdmaNode {
    /// Opens every device with an active port (at most `max_nics`).
    pub fn open(verbs: Arc<dyn Verbs>, max_nics: usize) -> Result<Self> {
        let mut nics = Vec::new();
        for device in verbs.devices()? {
            if nics.len() >= max_nics {
                break;
            }
            let Some(port) = device.ports.iter().find(|p| p.active) else { continue };
            let gid_index = pick_gid(port).unwrap_or(0);
            let context = verbs.open(&device.name)?;
            let pd = verbs.alloc_pd(context)?;
            let passive_cq = verbs.create_cq(context, 16)?;
            nics.push(Nic {
                name: device.name.clone(),
                context,
                pd,
                port: port.port,
                gid_index,
                mrs: Mutex::new(MrCache::new(verbs.clone(), pd)),
                passive_cq,
            });
        }
        if nics.is_empty() {
            return Err(Error::Device { device: "any".into(), reason: "no RDMA device with an active port".into() });
        }
        Ok(Self { verbs, nics, regions: RwLock::new(HashMap::new()), accepted: Mutex::new(HashMap::new()) })
    }

    /// The provider.
    pub fn verbs(&self) -> &Arc<dyn Verbs> {
        &self.verbs
    }

    /// The NICs, in the order their keys are listed.
    pub fn nics(&self) -> &[Nic] {
        &self.nics
    }

    /// Registers a region with every NIC.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` stays valid until [`RdmaNode::unregister_region`].
    pub unsafe fn register_region(&self, id: RegionId, addr: u64, len: u64) -> Result<()> {
        let mut keys = RegionKeys { addr, len, lkeys: Vec::new(), rkeys: Vec::new() };
        for nic in &self.nics {
            let mut mrs = nic.mrs.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: forwarded from our caller.
            let mr = unsafe { mrs.register(addr, len, MrAccess::ALL)? };
            keys.lkeys.push(mr.lkey);
            keys.rkeys.push(mr.rkey);
        }
        self.regions.write().unwrap_or_else(|p| p.into_inner()).insert(id.raw(), keys);
        Ok(())
    }

    /// Deregisters a region from every NIC.
    pub fn unregister_region(&self, id: RegionId) {
        let removed = self.regions.write().unwrap_or_else(|p| p.into_inner()).remove(&id.raw());
        if let Some(keys) = removed {
            for nic in &self.nics {
                let _ = nic.mrs.lock().unwrap_or_else(|p| p.into_inner()).unregister(keys.addr, keys.len);
            }
        }
    }

    /// The local key of `region` on NIC `nic`.
    pub fn lkey(&self, region: u32, nic: usize) -> Option<u32> {
        self.regions.read().unwrap_or_else(|p| p.into_inner()).get(&region).and_then(|k| k.lkeys.get(nic)).copied()
    }

    /// Runs `f` with a key lookup that holds the table's read lock once.
    pub fn with_lkeys<R>(&self, f: impl FnOnce(&dyn Fn(u32, usize) -> Option<u32>) -> R) -> R {
        let regions = self.regions.read().unwrap_or_else(|p| p.into_inner());
        f(&|region, nic| regions.get(&region).and_then(|k| k.lkeys.get(nic)).copied())
    }

    /// What peers need: NIC count, and each region's address and rkeys.
    pub fn info(&self) -> RdmaInfo {
        let regions = self.regions.read().unwrap_or_else(|p| p.into_inner());
        RdmaInfo {
            nics: self.nics.len() as u32,
            regions: regions.iter().map(|(&id, k)| (RegionId::from_raw(id), k.addr, k.rkeys.clone())).collect(),
        }
    }

    /// Creates a QP on NIC `nic`, moved to INIT, with `cq`.
    pub fn create_qp(&self, nic: usize, cq: Cq) -> Result<(Qp, QpEndpoint)> {
        let nic = self.nics.get(nic).ok_or_else(|| Error::invalid("nic", format!("{nic} is not a NIC")))?;
        let caps = QpCaps { max_send_wr: QP_DEPTH, max_inline: MAX_INLINE, port: nic.port, gid_index: nic.gid_index };
        let (qp, endpoint) = self.verbs.create_qp(nic.pd, cq, caps)?;
        if let Err(error) = self.verbs.modify_qp(qp, QpTransition::Init) {
            let _ = self.verbs.destroy_qp(qp);
            return Err(error);
        }
        Ok((qp, endpoint))
    }

    /// Creates a CQ on NIC `nic`.
    pub fn create_cq(&self, nic: usize, depth: u32) -> Result<Cq> {
        let nic = self.nics.get(nic).ok_or_else(|| Error::invalid("nic", format!("{nic} is not a NIC")))?;
        self.verbs.create_cq(nic.context, depth)
    }

    /// Moves an INIT QP to RTS towards `remote`.
    pub fn connect_qp(&self, qp: Qp, remote: QpEndpoint) -> Result<()> {
        self.verbs.modify_qp(qp, QpTransition::ReadyToReceive(remote))?;
        self.verbs.modify_qp(qp, QpTransition::ReadyToSend)
    }

    /// Accepts an initiator's QPs (lane-major over `nics` NICs): one QP of
    /// ours connected to each, returned in the same order. An initiator that
    /// connects again (it reopened us) replaces its earlier QPs.
    pub fn accept(&self, initiator: &str, nics: usize, endpoints: &[QpEndpoint]) -> Result<Vec<QpEndpoint>> {
        if nics == 0 || nics > self.nics.len() || endpoints.len() > MAX_CONNECT_ENDPOINTS {
            return Err(Error::invalid(
                "rdma connect",
                format!("{} endpoints over {nics} nics (this engine has {})", endpoints.len(), self.nics.len()),
            ));
        }
        let previous = self.accepted.lock().unwrap_or_else(|p| p.into_inner()).remove(initiator);
        for qp in previous.into_iter().flatten() {
            let _ = self.verbs.destroy_qp(qp);
        }
        let mut qps = Vec::with_capacity(endpoints.len());
        let mut ours = Vec::with_capacity(endpoints.len());
        let made = (|| {
            for (index, remote) in endpoints.iter().enumerate() {
                let nic = index % nics;
                let (qp, endpoint) = self.create_qp(nic, self.nics[nic].passive_cq)?;
                qps.push(qp);
                self.connect_qp(qp, *remote)?;
                ours.push(endpoint);
            }
            Ok(())
        })();
        if let Err(error) = made {
            for qp in qps {
                let _ = self.verbs.destroy_qp(qp);
            }
            return Err(error);
        }
        self.accepted.lock().unwrap_or_else(|p| p.into_inner()).insert(initiator.to_string(), qps);
        Ok(ours)
    }
}

impl Drop for RdmaNode {
    fn drop(&mut self) {
        for (_, qps) in self.accepted.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            for qp in qps {
                let _ = self.verbs.destroy_qp(qp);
            }
        }
        for nic in self.nics.drain(..) {
            // MRs first (the cache deregisters on drop), then CQ, PD, context.
            drop(nic.mrs);
            let _ = self.verbs.destroy_cq(nic.passive_cq);
            let _ = self.verbs.dealloc_pd(nic.pd);
            let _ = self.verbs.close(nic.context);
        }
    }
}
