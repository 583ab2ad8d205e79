//! The engine as the control server sees it: its descriptor, the RDMA
//! connect, notifications, its KV layout and checksums, and nothing that
//! keeps the engine itself alive.

use super::lifecycle::lock;
use crate::auth::{Authenticator, Initiator};
use crate::control::ControlHandler;
use crate::error::{Error, Result, Side};
use crate::kv::KvLayout;
use crate::mem::registry::check_range;
use crate::mem::MemoryKind;
use crate::mem::{Access, Registry};
use crate::notify::{Notification, NotificationQueue};
use crate::proto::ChecksumRequest;
use crate::region_id::RegionId;
use crate::segment::{local_host_id, CmaReach, RemoteRegion, SegmentDescriptor};
use crate::transport::cma::CmaExport;
use crate::transport::gpu_fds::server::GpuFdServer;
use crate::transport::rdma::fences::PUSH_KEY_BYTES;
use crate::transport::rdma::node::RdmaNode;
use crate::transport::rdma::verbs::QpEndpoint;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// What the control server sees of the engine (no reference back to the
/// engine itself, so dropping the engine stops the server).
pub(super) struct ControlContext {
    pub name: String,
    pub epoch: u64,
    pub registry: Arc<Registry>,
    /// Set once, as soon as the control server has bound.
    pub control_addr: OnceLock<String>,
    pub tcp_addr: Option<String>,
    pub auth: Option<Arc<Authenticator>>,
    pub notifications: Arc<NotificationQueue>,
    /// The KV layout, once published: fixed for the engine's life, since
    /// peers cache it per segment handle (`Engine::set_kv_layout`).
    pub kv_layout: OnceLock<KvLayout>,
    /// Memory-info requests answered (a peer fetching the KV layout): a
    /// metric, so that a layout cached by peers can be seen fetched once.
    pub memory_info_served: AtomicU64,
    pub rdma: Option<Arc<RdmaNode>>,
    /// The GPUs with memory registered with a NIC, whose GPUDirect RDMA
    /// writes are flushed before a notification is queued.
    pub gpudirect: Mutex<GpuDirect>,
    /// The cma page same-host peers reach this engine's memory through, or
    /// why they may not.
    pub cma: std::result::Result<Arc<CmaExport>, String>,
    /// The socket this engine passes its GPU regions' descriptors on,
    /// started with the first GPU region a peer is told of (`None`: not
    /// yet; an error: it could not start, and is not tried again).
    pub gpu_fds: Mutex<Option<std::result::Result<GpuFdServer, String>>>,
    /// Longest an rdma connect waits for the fence in progress (its
    /// snapshot is taken between fences): the engine's control timeout.
    pub connect_wait: std::time::Duration,
    /// The sums running for peers: bounded, and waited for at the drop.
    pub sums: super::sums::SumGate,
    /// The connections this engine pushes its rdma fences over, one per
    /// writer, made at the writer's connect.
    pub fence_pushers: super::fence_pushers::FencePushers,
}

impl ControlContext {
    /// The engine's segment descriptor as it stands now.
    pub fn describe(&self) -> SegmentDescriptor {
        let regions: Vec<RemoteRegion> = self
            .registry
            .snapshot()
            .into_iter()
            .map(|(id, entry)| RemoteRegion {
                id,
                kind: entry.info.kind,
                len: entry.len as u64,
                access: entry.info.access,
                layer: entry.info.layer,
                block_bytes: entry.info.block_bytes,
                shm_path: entry.shm.as_ref().map(|m| m.path().to_path_buf()),
                addr: entry.addr as u64,
                memory: entry.info.memory,
                gpu_export: match &entry.device {
                    None => Ok(Vec::new()),
                    Some(device) => device.export.as_ref().map(|e| e.handles().to_vec()).map_err(Clone::clone),
                },
            })
            .collect();
        let gpu_fds = regions.iter().any(|r| r.memory != MemoryKind::Host).then(|| self.gpu_fds_name()).flatten();
        SegmentDescriptor {
            name: self.name.clone(),
            epoch: self.epoch,
            host_id: local_host_id().to_string(),
            pid: std::process::id(),
            instance: crate::gpu::fd::instance(),
            gpu_fds,
            regions,
            control_addr: self.control_addr.get().cloned().unwrap_or_default(),
            tcp_addr: self.tcp_addr.clone(),
            rdma: self.rdma.as_ref().map(|node| node.info()),
            cma: Some(match &self.cma {
                Ok(export) => export.reach(),
                Err(why) => CmaReach::Refused(why.clone()),
            }),
        }
    }
}

impl ControlContext {
    /// This engine as it names itself when it dials a peer.
    pub fn me(&self) -> Initiator {
        Initiator {
            name: self.name.clone(),
            epoch: self.epoch,
            addr: self.control_addr.get().cloned().unwrap_or_default(),
        }
    }

    /// How long an rdma connect waits to reach its writer back: a writer
    /// not reached within a fence's wait would fail every fence anyway.
    fn fence_reach_deadline(&self) -> std::time::Instant {
        std::time::Instant::now() + self.connect_wait.min(super::fence::FENCE_WAIT)
    }

    /// The GPU descriptor socket's name, the server started at the first
    /// ask; `None` when it could not start (said once, at warn).
    fn gpu_fds_name(&self) -> Option<String> {
        let mut server = lock(&self.gpu_fds);
        let started = server.get_or_insert_with(|| {
            GpuFdServer::start(self.registry.clone(), self.auth.clone(), self.epoch).map_err(|error| {
                tracing::warn!(%error, "no GPU descriptor socket: same-host peers cannot open this engine's GPU memory");
                error.to_string()
            })
        });
        started.as_ref().ok().map(|s| s.name().to_string())
    }

    /// Stops the GPU descriptor socket, if it runs.
    pub fn stop_gpu_fds(&self) {
        if let Some(Ok(mut server)) = lock(&self.gpu_fds).take() {
            server.stop();
        }
    }
}

impl ControlHandler for ControlContext {
    fn authenticator(&self) -> Option<&Authenticator> {
        self.auth.as_deref()
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn describe(&self) -> SegmentDescriptor {
        ControlContext::describe(self)
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn rdma_connect(
        &self,
        initiator: &Initiator,
        request: &crate::proto::RdmaConnectRequest,
    ) -> Result<crate::proto::RdmaConnectResponse> {
        let node =
            self.rdma.as_ref().ok_or_else(|| Error::Unsupported { what: "rdma: this engine serves none".into() })?;
        let endpoints: Vec<_> = request.endpoints.iter().map(QpEndpoint::from_proto).collect::<Result<_>>()?;
        // The request's own shape first: nothing is dialled for a connect
        // refused anyway (hostile review 11).
        node.check_connect_shape(request.nics as usize, endpoints.len())?;
        let push_key = match (request.checks_fences, request.push_key.len()) {
            (false, _) => None,
            (true, PUSH_KEY_BYTES) => Some(request.push_key.clone()),
            (true, n) => return Err(Error::malformed("rdma connect", format!("a push key of {n} bytes"))),
        };
        // A writer whose fences could not reach it is refused now, not at
        // each fence (`fence_pushers`): dialled outside the fencers' mutex,
        // so a fence in progress never waits on it; one cut off lately for
        // a fence it did not answer is refused for a while.
        let pusher = match request.checks_fences {
            true => {
                self.fence_pushers.check_not_cut_off(initiator)?;
                Some(self.fence_pushers.reach(&self.me(), initiator, self.fence_reach_deadline())?)
            }
            false => None,
        };
        // No fence runs between listing the initiator as a writer and the
        // snapshot: a fence before is in the snapshot, one after is pushed
        // to it (docs/ARCHITECTURE.md, "Fenced destinations over rdma").
        let _fencing = super::fence::fencing_until(std::time::Instant::now() + self.connect_wait)?;
        let ours = node.accept(initiator, request.nics as usize, &endpoints, push_key)?;
        if let Some(pusher) = pusher {
            // Kept beside the writers still listed only (one the reaper
            // released or `accept` evicted goes with its connection).
            let writers = node.writers();
            self.fence_pushers.keep(initiator, pusher, writers.iter().map(|(w, _)| w));
        }
        let fences = self
            .registry
            .snapshot()
            .into_iter()
            // Only regions peers may write are written over rdma (the
            // others' mirrors refuse every write).
            .filter(|(_, entry)| entry.info.access.contains(Access::REMOTE_WRITE))
            .map(|(id, entry)| crate::proto::RdmaFenceTable { region: id.raw(), words: entry.fence_view().snapshot() })
            .collect();
        Ok(crate::proto::RdmaConnectResponse {
            endpoints: ours.iter().map(QpEndpoint::to_proto).collect(),
            fences,
            pushes_fences: true,
        })
    }

    fn rdma_fence(&self, target: &Initiator, request: &crate::proto::RdmaFenceRequest) -> Result<()> {
        use crate::transport::rdma::fences::{decode_pushed, MAX_PUSH_WAIT};
        let wait = std::time::Duration::from_millis(u64::from(request.wait_ms)).min(MAX_PUSH_WAIT);
        let deadline = std::time::Instant::now() + wait;
        // The key proves the pusher is the target our QPs were connected
        // to (the handshake alone proves no name without a token, and only
        // membership with one); every live link to it takes the fence.
        // Checked before the spans are decoded: a stranger's push costs no
        // allocation.
        let mirrors = match self.rdma.as_ref() {
            Some(node) => node.mirrors().get(&target.name, target.epoch, &request.push_key)?,
            None => Vec::new(),
        };
        let pushed = decode_pushed(&request.regions)?;
        if mirrors.is_empty() {
            // No link of ours writes there (never opened, or broken and its
            // QPs reset): the target cuts off the QPs it holds for us.
            return Err(Error::UnknownSegment { segment: target.name.clone() });
        }
        // Entered in every link's mirrors, even past one that failed.
        let answers: Vec<Result<()>> =
            mirrors.iter().map(|mirrors| mirrors.apply(pushed.clone(), request.generation, deadline)).collect();
        answers.into_iter().collect()
    }

    fn notify(&self, sender: &str, message: Vec<u8>) -> Result<()> {
        // An untagged push over rdma is WRITEs, then this message: where a
        // GPU does not order a NIC's writes for its own work, they are
        // flushed before the consumer can act on the message (VERBS-REVIEW
        // #15; tagged pushes are counted from receive completions).
        // Flushed only for a notification within its sender's quota: an
        // over-quota peer cannot make this engine flush at any rate.
        let flush = || {
            let gpus = lock(&self.gpudirect).gpus();
            gpus.iter().try_for_each(|(ordinal, gpu)| gpu.flush_rdma_writes(*ordinal).map(drop))
        };
        self.notifications.deliver_after(Notification { from: sender.to_string(), message }, flush)
    }

    fn memory_info(&self) -> Result<crate::proto::KvLayoutInfo> {
        let layout =
            self.kv_layout.get().map(KvLayout::to_proto).ok_or_else(|| Error::Unsupported {
                what: format!("{} has registered no KV-cache layout", self.name),
            })?;
        self.memory_info_served.fetch_add(1, Ordering::Relaxed);
        Ok(layout)
    }

    fn crc32c(&self, request: &crate::proto::Crc32cRequest, source: Option<std::net::IpAddr>) -> Result<Vec<u32>> {
        let _running = self.sums.enter(source)?;
        super::crc32c::answer(&self.registry, request)
    }

    fn checksum(&self, request: &ChecksumRequest, source: Option<std::net::IpAddr>) -> Result<u64> {
        let _running = self.sums.enter(source)?;
        let id = RegionId::from_raw(request.region);
        // Read alone: refused (`RegionBusy`) while a batch of this engine
        // holds the region, and no batch takes it until the sum is done, so
        // no lane of ours writes the bytes we read (a peer's request must
        // not race with our transfers).
        let summed = self.registry.read_alone(id, |entry| {
            if !entry.info.access.contains(Access::REMOTE_READ) {
                return Err(Error::AccessDenied {
                    desc_index: 0,
                    side: Side::Remote,
                    region: id,
                    needs: "remote read",
                });
            }
            check_range(id, Side::Remote, 0, request.offset, request.len, entry.len as u64)?;
            if let Some(device) = &entry.device {
                // Through the GPU's copy engine, on this (control) thread.
                let addr = entry.addr as u64 + request.offset;
                return crate::mem::checksum::checksum_device(device, addr, request.len as usize);
            }
            // SAFETY: the range is inside a registered region (checked) that
            // the exclusive read keeps registered and keeps our lanes off;
            // read through a bounce buffer all the same.
            Ok(unsafe {
                crate::mem::checksum_shared((entry.addr + request.offset as usize) as *const u8, request.len as usize)
            })
        });
        match summed {
            Ok(sum) => sum,
            Err(busy @ Error::RegionBusy { .. }) => Err(busy),
            Err(_) => Err(Error::UnknownRegion { side: Side::Remote, region: id }),
        }
    }
}

/// The GPUs (by ordinal) with memory registered with a NIC, each with the
/// regions that put it there: a GPU leaves with its last such region, so
/// notifications stop flushing it.
#[derive(Default)]
pub(crate) struct GpuDirect {
    gpus: std::collections::BTreeMap<u32, (Arc<dyn crate::gpu::Gpu>, std::collections::BTreeSet<RegionId>)>,
}

impl GpuDirect {
    /// Region `id`, of GPU `ordinal`, is registered with the NICs.
    pub fn add(&mut self, ordinal: u32, gpu: &Arc<dyn crate::gpu::Gpu>, id: RegionId) {
        self.gpus.entry(ordinal).or_insert_with(|| (gpu.clone(), Default::default())).1.insert(id);
    }

    /// Region `id` is unregistered (nothing, if it was no GPU's).
    pub fn remove(&mut self, id: RegionId) {
        self.gpus.retain(|_, (_, regions)| {
            regions.remove(&id);
            !regions.is_empty()
        });
    }

    /// The GPUs to flush, by ordinal.
    pub fn gpus(&self) -> Vec<(u32, Arc<dyn crate::gpu::Gpu>)> {
        self.gpus.iter().map(|(&ordinal, (gpu, _))| (ordinal, gpu.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::RegionInfo;

    /// A peer's checksum request read a region while this engine's batches
    /// wrote it (a data race reached from a peer). It is refused while a
    /// batch holds the region, and no batch takes the region while it reads.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "starts an engine (lanes, sockets, getrlimit); the registry's read_alone runs under Miri"
    )]
    fn a_peer_checksum_waits_for_no_batch_and_shuts_batches_out_while_it_reads() {
        let engine = crate::Engine::builder().name("checksum-race").lanes(1).build().unwrap();
        let region = engine.alloc_region(4096, RegionInfo::raw()).unwrap();
        let id = region.id();
        // SAFETY: no batch names the new region.
        unsafe { region.write_at(0, &[7u8; 4096]).unwrap() };
        let request = ChecksumRequest { region: id.raw(), offset: 0, len: 4096 };
        let context: &ControlContext = &engine.inner.context;

        // A batch in flight holds a lease on the region (as a submitter's
        // part does until its lane ends it).
        let lease = engine.inner.registry.lease(id).unwrap();
        let refused = ControlHandler::checksum(context, &request, None).unwrap_err();
        assert!(matches!(refused, Error::RegionBusy { region, .. } if region == id), "{refused}");
        drop(lease);

        let sum = ControlHandler::checksum(context, &request, None).unwrap();
        assert_eq!(sum, crate::mem::checksum::checksum(&[7u8; 4096]));
        // While a read holds the region alone, a batch's lease is refused.
        let during = engine.inner.registry.read_alone(id, |_| engine.inner.registry.lease(id).map(|_| ())).unwrap();
        assert!(matches!(during, Err(Error::RegionBusy { .. })), "{during:?}");
        assert!(engine.inner.registry.lease(id).is_ok(), "leases are granted again once the read ends");
        // A stale or unknown id is the peer's error, not this engine's.
        let unknown = ChecksumRequest { region: RegionId::new(id.index(), id.generation() + 1).raw(), ..request };
        assert!(matches!(
            ControlHandler::checksum(context, &unknown, None),
            Err(Error::UnknownRegion { side: Side::Remote, .. })
        ));
    }

    #[test]
    fn a_gpu_leaves_the_flush_set_with_its_last_nic_registered_region() {
        let gpu: Arc<dyn crate::gpu::Gpu> = Arc::new(crate::gpu::SimGpu::new(2, std::time::Duration::ZERO));
        let mut set = GpuDirect::default();
        let (a, b, c) = (RegionId::new(1, 1), RegionId::new(2, 1), RegionId::new(3, 1));
        set.add(0, &gpu, a);
        set.add(0, &gpu, b);
        set.add(1, &gpu, c);
        let ordinals = |set: &GpuDirect| set.gpus().into_iter().map(|(o, _)| o).collect::<Vec<_>>();
        assert_eq!(ordinals(&set), [0, 1]);
        set.remove(a);
        assert_eq!(ordinals(&set), [0, 1], "GPU 0 still has a region with the NICs");
        set.remove(RegionId::new(9, 1));
        set.remove(b);
        assert_eq!(ordinals(&set), [1]);
        set.remove(c);
        assert!(set.gpus().is_empty());
    }
}
