//! An engine's RDMA side: its NICs (a context, a PD, a port, a shared
//! receive queue and the CQ of its accepted QPs each), every registered
//! region's MR on each NIC, and the QPs it accepted for initiators
//! (`accept.rs`). Owned by the engine; links borrow it for local keys.
//! Device memory is registered through dma-buf or peer memory
//! (`device.rs`); the receives that count arrivals are polled by one lane
//! (`recv.rs`).

mod accept;
mod device;
mod events;
mod memlock;
mod recv;
#[cfg(test)]
mod tests;

pub use device::DeviceMrStats;

use super::devices::{choose, gid_index as choose_gid};
use super::mr_cache::MrCache;
use super::verbs::*;
use crate::auth::Initiator;
use crate::desc::RegionId;
use crate::error::{Error, Result};
use crate::mem::Access;
use crate::segment::RdmaInfo;
use accept::Accepted;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Send-queue depth of every QP kvring creates.
pub const QP_DEPTH: u32 = 1024;
/// Writes up to this many bytes go inline.
pub const MAX_INLINE: u32 = 64;
/// Most QP endpoints one connect request may carry: the QPs one initiator
/// may hold on this engine.
pub const MAX_CONNECT_ENDPOINTS: usize = 1024;
/// Most QPs accepted for all initiators together; past it the initiator
/// that connected least recently loses its QPs (it reconnects when it
/// next uses them), and a request larger than the bound is refused.
pub const MAX_ACCEPTED_QPS: usize = 16 * 1024;
/// Receives each NIC's shared receive queue holds: the WRITE_WITH_IMMs
/// that may land before the receiving lane polls. Past it a sender's NIC is
/// told "not ready" and retries (unbounded, as kvring's QPs ask), so a flood
/// of immediates waits at its senders and grows nothing here; the CQ they
/// complete on holds as many, so it never overruns.
pub const SRQ_DEPTH: u32 = 4096;
/// Reset QPs kept per NIC and kind for the next connection; beyond this a
/// released QP is destroyed.
const MAX_SPARE_QPS: usize = 256;

/// A QP in the RESET state, kept for reuse with the endpoint it was created
/// with (its QP number does not change; its PSN is re-sent at each
/// handshake).
#[derive(Debug, Clone, Copy)]
struct Spare {
    qp: Qp,
    cq: Cq,
    endpoint: QpEndpoint,
}

/// Reset QPs of one NIC: those that had their own CQ (initiator side) and
/// those on the NIC's passive CQ (accepted for initiators).
#[derive(Debug, Default)]
struct Spares {
    active: Vec<Spare>,
    passive: Vec<Spare>,
}

/// One NIC as the engine uses it.
#[derive(Debug)]
pub struct Nic {
    /// Its kernel name.
    name: String,
    /// Its NUMA node and place in the PCI tree (for the NIC nearest a GPU).
    numa_node: Option<u32>,
    pci_path: Option<std::path::PathBuf>,
    context: Context,
    pd: Pd,
    port: u8,
    /// The GID index its QPs use: chosen again when the port's GID table
    /// changes (IBV_EVENT_GID_CHANGE, `events.rs`).
    gid_index: std::sync::atomic::AtomicU8,
    /// The GID its QPs carry since the table last changed (`None`: it has
    /// not changed since the node opened): a spare QP made with another is
    /// destroyed, not reused.
    gid_now: Mutex<Option<[u8; 16]>>,
    mrs: Mutex<MrCache>,
    /// The CQ of the QPs accepted for initiators: one-sided operations
    /// complete on the initiator's side, so only the receives that
    /// WRITE_WITH_IMMs consume complete here (wakeable: `wake_fd`).
    passive_cq: Cq,
    /// Where the accepted QPs' receives come from, and the descriptor that
    /// wakes the receiving lane; `None` on a device without shared receive
    /// queues (it then counts no arrivals, and says so to peers).
    receives: Option<(Srq, RawFd)>,
    /// Faults its async events reported (port down, device or queue
    /// fatal), counted: a link that saw another count when it was made
    /// fails what it has in flight (see `events.rs`).
    faults: std::sync::atomic::AtomicU64,
    /// Why, for the error those batches end with; `None` while the port is
    /// up.
    fault: Mutex<Option<String>>,
    /// QPs released by links and replaced accepts, reset for reuse: a
    /// reconnect (a peer restart, a failed QP) re-handshakes them instead
    /// of paying for a QP creation, which costs milliseconds on real NICs.
    spares: Mutex<Spares>,
}

impl Nic {
    /// Whether a QP with `endpoint` was made with a GID the port no longer
    /// uses (the table changed since).
    fn stale(&self, endpoint: &QpEndpoint) -> bool {
        self.gid_now.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|gid| gid != endpoint.gid)
    }
}

/// A region's keys on every NIC.
#[derive(Debug, Clone)]
struct RegionKeys {
    addr: u64,
    len: u64,
    lkeys: Vec<u32>,
    rkeys: Vec<u32>,
    /// Whether peers may use the region at all (else its keys are not
    /// listed for them).
    remote: bool,
    /// The NICs its blocks go over (bit n: NIC n; 0: any): those nearest
    /// its GPU, for device memory.
    nics: u32,
    /// Host memory the CPU may read (small writes from it go inline).
    host: bool,
}

/// An engine's RDMA state.
#[derive(Debug)]
pub struct RdmaNode {
    verbs: Arc<dyn Verbs>,
    nics: Vec<Nic>,
    regions: RwLock<HashMap<u64, RegionKeys>>,
    /// Device regions no NIC could register, with why (told to peers).
    unreachable: RwLock<HashMap<u64, String>>,
    /// What registering device memory did.
    device_stats: Mutex<DeviceMrStats>,
    /// Per GPU ordinal, the mask of the NICs nearest it (found once).
    nearest: Mutex<HashMap<u32, u32>>,
    /// The QPs accepted for each initiator.
    accepted: Mutex<Accepted>,
    /// How many there are, read without the lock: with none, no receive
    /// can complete, and the receiving lane does not look.
    accepting: AtomicUsize,
    /// Where arrivals are counted (set with the receiver), for the drain
    /// of a released QP's completions.
    arrivals: std::sync::OnceLock<Arc<crate::arrival::Arrivals>>,
    /// Locked memory its host registrations charge (finding 8).
    memlock: memlock::Memlock,
    /// The GID index configured for every port (`None`: chosen per port).
    gid_configured: Option<u8>,
    /// Accepted QPs whose last receive completion is on the CQ.
    last_wqe: events::LastWqe,
    /// This engine's links' mirrors of their targets' fence tables.
    mirrors: super::fences::MirrorBook,
}

/// Local keys, read under the region table's lock (once per chunk).
pub struct LocalKeys<'a>(&'a HashMap<u64, RegionKeys>);

impl LocalKeys<'_> {
    /// The key of region `region` on NIC `nic`, if registered there.
    pub fn lkey(&self, region: u64, nic: usize) -> Option<u32> {
        self.0.get(&region).and_then(|k| k.lkeys.get(nic)).copied()
    }

    /// The NICs blocks of `region` go over (0: any).
    pub fn nics(&self, region: u64) -> u32 {
        self.0.get(&region).map_or(0, |k| k.nics)
    }

    /// Whether `region` is host memory (unknown: no).
    pub fn host_memory(&self, region: u64) -> bool {
        self.0.get(&region).is_some_and(|k| k.host)
    }
}

impl RdmaNode {
    /// Opens the devices `wanted` (empty: every device with an active
    /// port of one link layer; at most `max_nics`: see [`choose`]), using
    /// GID `gid_index` of each port (`None`: see `devices::gid_index`).
    pub fn open(verbs: Arc<dyn Verbs>, wanted: &[String], max_nics: usize, gid_index: Option<u8>) -> Result<Self> {
        let mut nics = Vec::new();
        for (device, port) in choose(&verbs.devices()?, wanted, max_nics)? {
            let port = &port;
            let chosen_gid = choose_gid(&device.name, port, gid_index)?;
            let context = verbs.open(&device.name)?;
            let pd = verbs.alloc_pd(context)?;
            let (passive_cq, receives) = match receive_queue(&*verbs, context, pd) {
                Ok((cq, srq, wake_fd)) => (cq, Some((srq, wake_fd))),
                Err(error) => {
                    tracing::warn!(device = %device.name, %error, "no shared receive queue: this NIC counts no arrivals");
                    (verbs.create_cq(context, 16)?, None)
                }
            };
            nics.push(Nic {
                name: device.name.clone(),
                numa_node: device.numa_node,
                pci_path: device.pci_path.clone(),
                context,
                pd,
                port: port.port,
                gid_index: std::sync::atomic::AtomicU8::new(chosen_gid),
                gid_now: Mutex::new(None),
                mrs: Mutex::new(MrCache::new(verbs.clone(), pd)),
                passive_cq,
                receives,
                spares: Mutex::new(Spares::default()),
                faults: std::sync::atomic::AtomicU64::new(0),
                fault: Mutex::new(None),
            });
        }
        if nics.is_empty() {
            return Err(Error::Device { device: "any".into(), reason: "no RDMA device with an active port".into() });
        }
        Ok(Self {
            verbs,
            nics,
            regions: RwLock::new(HashMap::new()),
            unreachable: RwLock::new(HashMap::new()),
            device_stats: Mutex::new(DeviceMrStats::default()),
            nearest: Mutex::new(HashMap::new()),
            accepted: Mutex::new(Accepted::default()),
            accepting: AtomicUsize::new(0),
            arrivals: std::sync::OnceLock::new(),
            memlock: memlock::Memlock::of_process(),
            gid_configured: gid_index,
            last_wqe: events::LastWqe::default(),
            mirrors: Default::default(),
        })
    }

    /// This engine's links' mirrors of their targets' fence tables.
    pub fn mirrors(&self) -> &super::fences::MirrorBook {
        &self.mirrors
    }

    /// The provider.
    pub fn verbs(&self) -> &Arc<dyn Verbs> {
        &self.verbs
    }

    /// The NICs, in the order their keys are listed.
    pub fn nics(&self) -> &[Nic] {
        &self.nics
    }

    /// Registers a region with every NIC, with exactly the rights the
    /// region grants peers (a region peers may only read is registered
    /// without remote write, so the NIC itself refuses a write).
    ///
    /// # Safety
    ///
    /// `addr..addr + len` stays valid until [`RdmaNode::unregister_region`].
    pub unsafe fn register_region(&self, id: RegionId, addr: u64, len: u64, access: Access) -> Result<()> {
        let rights = rights(access);
        let remote = rights.remote_write || rights.remote_read;
        let mut keys = RegionKeys { addr, len, lkeys: Vec::new(), rkeys: Vec::new(), remote, nics: 0, host: true };
        self.memlock.charge(len, self.nics.len())?;
        for nic in &self.nics {
            let mut mrs = nic.mrs.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: forwarded from our caller.
            let mr = match unsafe { mrs.register(addr, len, rights) } {
                Ok(mr) => mr,
                Err(error) => {
                    drop(mrs);
                    for done in &self.nics[..keys.lkeys.len()] {
                        let _ = done.mrs.lock().unwrap_or_else(|p| p.into_inner()).unregister(addr, len);
                    }
                    self.memlock.release(len, self.nics.len());
                    return Err(error);
                }
            };
            keys.lkeys.push(mr.lkey);
            keys.rkeys.push(mr.rkey);
        }
        self.regions.write().unwrap_or_else(|p| p.into_inner()).insert(id.raw(), keys);
        Ok(())
    }

    /// Deregisters a region from every NIC.
    pub fn unregister_region(&self, id: RegionId) {
        self.unreachable.write().unwrap_or_else(|p| p.into_inner()).remove(&id.raw());
        let removed = self.regions.write().unwrap_or_else(|p| p.into_inner()).remove(&id.raw());
        if let Some(keys) = removed {
            if keys.host {
                self.memlock.release(keys.len, self.nics.len());
            }
            for nic in &self.nics {
                let _ = nic.mrs.lock().unwrap_or_else(|p| p.into_inner()).unregister(keys.addr, keys.len);
            }
        }
    }

    /// The engine stops: every accepted QP is destroyed and every region
    /// deregistered, so no peer's request touches this engine's memory
    /// again (links still held by segment handles fail their posts).
    pub fn shutdown(&self) {
        let accepted = self.with_accepted(std::mem::take);
        for (_, set) in accepted.by_initiator {
            for (_, spare) in set.qps {
                let _ = self.verbs.destroy_qp(spare.qp);
            }
        }
        let ids: Vec<u64> = self.regions.read().unwrap_or_else(|p| p.into_inner()).keys().copied().collect();
        for id in ids {
            self.unregister_region(RegionId::from_raw(id));
        }
    }

    /// Runs `f` with the local keys, holding the table's read lock once.
    pub fn with_lkeys<R>(&self, f: impl FnOnce(&LocalKeys<'_>) -> R) -> R {
        let regions = self.regions.read().unwrap_or_else(|p| p.into_inner());
        f(&LocalKeys(&regions))
    }

    /// What peers need: NIC count, each region's address and rkeys (only
    /// regions that grant peers a right), and why a device region has none.
    pub fn info(&self) -> RdmaInfo {
        let regions = self.regions.read().unwrap_or_else(|p| p.into_inner());
        let unreachable = self.unreachable.read().unwrap_or_else(|p| p.into_inner());
        RdmaInfo {
            nics: self.nics.len() as u32,
            regions: regions
                .iter()
                .filter(|(_, k)| k.remote)
                .map(|(&id, k)| (RegionId::from_raw(id), k.addr, k.rkeys.clone()))
                .collect(),
            unreachable: unreachable.iter().map(|(&id, why)| (RegionId::from_raw(id), why.clone())).collect(),
            arrivals: self.counts_arrivals(),
        }
    }

    /// Runs `f` on the accepted QPs under their lock, then publishes how
    /// many there are.
    fn with_accepted<R>(&self, f: impl FnOnce(&mut Accepted) -> R) -> R {
        let mut accepted = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        let result = f(&mut accepted);
        self.accepting.store(accepted.total, Ordering::Release);
        result
    }

    /// True when QPs are accepted for initiators (receives may complete).
    pub(crate) fn accepting(&self) -> bool {
        // Acquire pairs with the Release in `with_accepted`: a QP counted
        // here was connected, and its receives' CQ set up, before.
        self.accepting.load(Ordering::Acquire) > 0
    }

    /// True when every NIC has its receive queue, so WRITE_WITH_IMMs into
    /// this engine complete and are counted.
    pub fn counts_arrivals(&self) -> bool {
        self.nics.iter().all(|nic| nic.receives.is_some())
    }

    /// QPs accepted for initiators now.
    pub fn accepted_qps(&self) -> usize {
        self.accepted.lock().unwrap_or_else(|p| p.into_inner()).total
    }

    /// The initiators this engine holds QPs for, with where to probe them.
    pub fn initiators(&self) -> Vec<Initiator> {
        let accepted = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        accepted
            .by_initiator
            .iter()
            .map(|((name, epoch), set)| Initiator { name: name.clone(), epoch: *epoch, addr: set.addr.clone() })
            .collect()
    }

    /// The initiators that may write this engine's memory over rdma, each
    /// with the key of the fences pushed to it (`None`: its lanes check no
    /// mirrors of this engine's fence tables).
    pub fn writers(&self) -> Vec<(Initiator, Option<Vec<u8>>)> {
        let accepted = self.accepted.lock().unwrap_or_else(|p| p.into_inner());
        accepted
            .by_initiator
            .iter()
            .map(|((name, epoch), set)| {
                (Initiator { name: name.clone(), epoch: *epoch, addr: set.addr.clone() }, set.push_key.clone())
            })
            .collect()
    }

    /// Releases the QPs held for an initiator that went away; returns how
    /// many there were.
    pub fn release_initiator(&self, initiator: &Initiator) -> usize {
        let set = self.with_accepted(|accepted| accepted.remove(&(initiator.name.clone(), initiator.epoch)));
        let qps = set.map(|set| set.qps).unwrap_or_default();
        let count = qps.len();
        self.release_passive(qps);
        count
    }

    /// A QP on NIC `nic` in the INIT state with a CQ of its own (`depth`
    /// entries): a spare one reset earlier when there is one, else a new one.
    pub fn take_qp(&self, nic: usize, depth: u32) -> Result<(Qp, Cq, QpEndpoint)> {
        self.take(nic, false, depth).map(|spare| (spare.qp, spare.cq, spare.endpoint))
    }

    /// Hands back a QP from [`RdmaNode::take_qp`]: reset (which also drops
    /// its completions from the CQ, as mlx5 does on a move to RESET) and
    /// kept for the next connection, or destroyed with its CQ when the
    /// NIC has enough spares or the reset fails.
    pub fn release_qp(&self, nic: usize, qp: Qp, cq: Cq, endpoint: QpEndpoint) {
        self.keep_or_destroy(nic, Spare { qp, cq, endpoint }, false);
    }

    /// An INIT QP from NIC `nic`'s spares of that kind, or a new one: on the
    /// NIC's passive CQ (`passive`, accepted QPs) or on a CQ of its own. A
    /// NIC that reported a fault says so beside the verb that failed (after
    /// IBV_EVENT_DEVICE_FATAL the verbs fail with a bare EIO).
    fn take(&self, nic: usize, passive: bool, depth: u32) -> Result<Spare> {
        self.take_unexplained(nic, passive, depth).map_err(|error| match (error, self.nic(nic)) {
            (Error::Device { device, reason }, Ok(n)) => {
                let fault = n.fault.lock().unwrap_or_else(|p| p.into_inner()).clone();
                let reason = match fault {
                    Some(why) => format!("{reason}; earlier, {why}"),
                    None => reason,
                };
                Error::Device { device, reason }
            }
            (error, _) => error,
        })
    }

    fn take_unexplained(&self, nic: usize, passive: bool, depth: u32) -> Result<Spare> {
        let n = self.nic(nic)?;
        let spare = loop {
            let spare = {
                let mut spares = n.spares.lock().unwrap_or_else(|p| p.into_inner());
                if passive {
                    spares.passive.pop()
                } else {
                    spares.active.pop()
                }
            };
            match spare {
                // Made with a GID the port no longer uses.
                Some(spare) if n.stale(&spare.endpoint) => self.destroy(spare, passive),
                other => break other,
            }
        };
        if let Some(spare) = spare {
            if let Err(error) = self.verbs.modify_qp(spare.qp, QpTransition::Init) {
                self.destroy(spare, passive);
                return Err(error);
            }
            return Ok(spare);
        }
        let cq = if passive { n.passive_cq } else { self.verbs.create_cq(n.context, depth)? };
        match self.create_qp(nic, cq, passive) {
            Ok((qp, endpoint)) => Ok(Spare { qp, cq, endpoint }),
            Err(error) => {
                if !passive {
                    let _ = self.verbs.destroy_cq(cq);
                }
                Err(error)
            }
        }
    }

    fn keep_or_destroy(&self, nic: usize, spare: Spare, passive: bool) {
        if passive {
            self.drain_passive(nic, spare.qp);
        }
        let reset = self.verbs.modify_qp(spare.qp, QpTransition::Reset).is_ok();
        if let (true, Ok(n)) = (reset, self.nic(nic)) {
            if n.stale(&spare.endpoint) {
                self.destroy(spare, passive);
                return;
            }
            let mut spares = n.spares.lock().unwrap_or_else(|p| p.into_inner());
            let pool = if passive { &mut spares.passive } else { &mut spares.active };
            if pool.len() < MAX_SPARE_QPS {
                pool.push(spare);
                return;
            }
        }
        self.destroy(spare, passive);
    }

    /// Before an accepted QP is reset or destroyed: moved to ERR, then the
    /// NIC's passive CQ drained (arrivals counted, receives re-posted).
    /// Resetting or destroying it with completions still on the CQ would
    /// drop them (mlx5 cleans the CQ), and with them an arrival and an SRQ
    /// receive for good (IBTA §10.3.1 as quoted in Linux commit
    /// 844bc12e6da3: Error, wait for IBV_EVENT_QP_LAST_WQE_REACHED, drain,
    /// then Reset or Destroy; VERBS-REVIEW finding 4).
    fn drain_passive(&self, nic: usize, qp: Qp) {
        if self.verbs.modify_qp(qp, QpTransition::Error).is_ok() {
            self.wait_last_wqe(qp);
        }
        let Ok(n) = self.nic(nic) else { return };
        let arrivals = self.arrivals.get().cloned();
        let mut wcs = [Wc::new(0, WcStatus::Success); 64];
        let mut repost = Vec::with_capacity(wcs.len());
        // Bounded: the CQ holds at most SRQ_DEPTH receive completions.
        for _ in 0..=(SRQ_DEPTH as usize / wcs.len()) {
            if self.take_receives(n, arrivals.as_deref(), &mut wcs, &mut repost) == 0 {
                break;
            }
        }
    }

    /// Takes one poll of `nic`'s receive completions: counts each arrival
    /// in `arrivals` and re-posts its receive. How many it took.
    pub(super) fn take_receives(
        &self,
        nic: &Nic,
        arrivals: Option<&crate::arrival::Arrivals>,
        wcs: &mut [Wc],
        repost: &mut Vec<u64>,
    ) -> usize {
        let Some((srq, _)) = nic.receives else { return 0 };
        // A CQ that cannot be polled (its device vanished) counts nothing
        // more; the links to that device fail on their own.
        let polled = self.verbs.poll_cq(nic.passive_cq, wcs).unwrap_or(0);
        if polled == 0 {
            return 0;
        }
        repost.clear();
        for wc in &wcs[..polled] {
            // A flushed receive (its QP failed) placed nothing, and a
            // zero-length WRITE_WITH_IMM placed no bytes: neither counts as
            // an arrival.
            if let (WcStatus::Success, Some(tag), 1.., Some(arrivals)) = (wc.status, wc.imm, wc.byte_len, arrivals) {
                arrivals.land(tag, u64::from(wc.byte_len));
            }
            // Only receives of this node complete here, and each goes back
            // once: the queue stays at its depth.
            if wc.wr_id < u64::from(SRQ_DEPTH) {
                repost.push(wc.wr_id);
            }
        }
        // A receive not re-posted is gone from the SRQ for good (RNR stalls
        // later): say so rather than drop it (finding 17).
        if let Err(error) = self.verbs.post_srq_recv(srq, repost) {
            tracing::warn!(device = %nic.name, %error, lost = repost.len(), "re-posting receives failed");
        }
        polled
    }

    /// Destroys a QP, and its CQ unless that is the NIC's shared passive one.
    fn destroy(&self, spare: Spare, passive: bool) {
        let _ = self.verbs.destroy_qp(spare.qp);
        if !passive {
            let _ = self.verbs.destroy_cq(spare.cq);
        }
    }

    fn nic(&self, nic: usize) -> Result<&Nic> {
        self.nics.get(nic).ok_or_else(|| Error::invalid("nic", format!("{nic} is not a NIC")))
    }

    /// Creates a QP on NIC `nic`, moved to INIT, with `cq`; an accepted one
    /// (`passive`) takes its receives from the NIC's shared receive queue.
    fn create_qp(&self, nic: usize, cq: Cq, passive: bool) -> Result<(Qp, QpEndpoint)> {
        let nic = self.nic(nic)?;
        let srq = nic.receives.filter(|_| passive).map(|(srq, _)| srq);
        // An accepted QP never posts a send (a READ's response uses the
        // responder's resources, not send WQEs): one WR and no inline keep
        // its pinned send queue at the provider's minimum instead of
        // ~512 KiB each on mlx5 (VERBS-REVIEW finding 9).
        let (max_send_wr, max_inline) = if passive { (1, 0) } else { (QP_DEPTH, MAX_INLINE) };
        let gid_index = nic.gid_index.load(Ordering::Relaxed);
        let caps = QpCaps { max_send_wr, max_inline, port: nic.port, gid_index, srq };
        let (qp, endpoint) = self.verbs.create_qp(nic.pd, cq, caps)?;
        if let Err(error) = self.verbs.modify_qp(qp, QpTransition::Init) {
            let _ = self.verbs.destroy_qp(qp);
            return Err(error);
        }
        Ok((qp, endpoint))
    }

    /// Moves an INIT QP to RTS towards `remote`.
    pub fn connect_qp(&self, qp: Qp, remote: QpEndpoint) -> Result<()> {
        self.verbs.modify_qp(qp, QpTransition::ReadyToReceive(remote))?;
        self.verbs.modify_qp(qp, QpTransition::ReadyToSend)
    }
}

impl Drop for RdmaNode {
    fn drop(&mut self) {
        self.shutdown();
        let nics: Vec<Nic> = self.nics.drain(..).collect();
        for nic in nics {
            let spares = nic.spares.into_inner().unwrap_or_else(|p| p.into_inner());
            for spare in spares.passive {
                self.destroy(spare, true);
            }
            for spare in spares.active {
                self.destroy(spare, false);
            }
            // MRs first (the cache deregisters on drop), then the SRQ (its
            // QPs are gone), CQ, PD, context.
            drop(nic.mrs);
            if let Some((srq, _)) = nic.receives {
                let _ = self.verbs.destroy_srq(srq);
            }
            let _ = self.verbs.destroy_cq(nic.passive_cq);
            let _ = self.verbs.dealloc_pd(nic.pd);
            let _ = self.verbs.close(nic.context);
        }
    }
}

/// The rights a region's registration grants: exactly those the region
/// grants peers (a region peers may only read is registered without remote
/// write, so the NIC itself refuses a write).
fn rights(access: Access) -> MrAccess {
    MrAccess {
        // Verbs requires local write wherever remote write is granted, and a
        // READ lands in local memory.
        local_write: access.intersects(Access::LOCAL_WRITE | Access::REMOTE_WRITE),
        remote_write: access.contains(Access::REMOTE_WRITE),
        remote_read: access.contains(Access::REMOTE_READ),
        relaxed_ordering: false,
    }
}

/// A NIC's receive queue for arrivals: a wakeable CQ, a shared receive
/// queue of [`SRQ_DEPTH`] receives, each posted once here (re-posted as it
/// completes); what was made is undone on failure.
fn receive_queue(verbs: &dyn Verbs, context: Context, pd: Pd) -> Result<(Cq, Srq, RawFd)> {
    let (cq, wake_fd) = verbs.create_wakeable_cq(context, SRQ_DEPTH)?;
    let srq = match verbs.create_srq(pd, SRQ_DEPTH) {
        Ok(srq) => srq,
        Err(error) => {
            let _ = verbs.destroy_cq(cq);
            return Err(error);
        }
    };
    let receives: Vec<u64> = (0..u64::from(SRQ_DEPTH)).collect();
    if let Err(error) = verbs.post_srq_recv(srq, &receives) {
        let _ = verbs.destroy_srq(srq);
        let _ = verbs.destroy_cq(cq);
        return Err(error);
    }
    Ok((cq, srq, wake_fd))
}
