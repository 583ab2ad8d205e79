//! The engine: one per process (per inference rank). It owns the region
//! registry, the lanes, the control server and the open segments, and hands
//! out per-thread submitters.
//!
//! One file per job: `config.rs` (settings and the builder), `lifecycle.rs`
//! (what the engine holds, start and stop), `regions.rs` (registration),
//! `segments.rs` (opening peers, the one transport factory), `notify.rs`,
//! `control.rs` (what the control server sees), `metadata.rs` (etcd
//! publication and the watcher), `reaper.rs` (RDMA QPs of vanished
//! initiators), `metrics.rs` (`/metrics`); the handles callers hold are in
//! `batch.rs`, `region.rs`, `segment.rs` and `submitter.rs`. This file holds
//! the `Engine` type and its short accessors.

mod arrivals;
mod batch;
mod config;
mod control;
mod crc32c;
mod described;
mod fence;
mod fence_pushers;
mod fence_rdma;
mod lifecycle;
mod metadata;
mod metrics;
mod notify;
mod open_many;
mod pins;
mod reaper;
mod region;
mod regions;
mod segment;
mod segments;
mod serving;
mod submitter;
mod sums;

pub use batch::{Batch, Completion, Event, Outcome};
#[cfg(test)]
pub(crate) use config::MAX_RDMA_NICS;
pub use config::{EngineBuilder, EngineConfig};
#[cfg(feature = "testing")]
pub(crate) use crc32c::check_request as check_crc32c_request;
#[cfg(feature = "testing")]
pub(crate) use crc32c::stall as crc32c_stall;
pub(crate) use lifecycle::EngineInner;
pub use pins::HostPinStats;
#[cfg(feature = "testing")]
pub use region::fill_pattern;
pub use region::Region;
pub use segment::Segment;
pub use submitter::{StatusReader, Submitter};

use crate::advertise::Advertised;
use crate::error::{Error, Result, Side};
use crate::kv::KvLayout;
use crate::mem::registry::check_range;
use crate::runtime::LaneStatsSnapshot;
use crate::segment::SegmentDescriptor;
use lifecycle::lock;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// One engine per process. Cheap to clone (a shared handle).
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<EngineInner>,
}

impl Engine {
    /// A builder with the defaults.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    /// The IP peers are told, and which rule chose it.
    pub fn advertised(&self) -> &Advertised {
        &self.inner.advertised
    }

    /// Where `/metrics` is served, when it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.inner.metrics_addr.get().copied()
    }

    /// The Prometheus text `/metrics` would answer now.
    pub fn metrics_text(&self) -> String {
        metrics::text(&self.inner)
    }

    /// Turns the lanes' counting on or off at run time (the endpoint keeps
    /// answering with what was counted).
    pub fn set_metrics_enabled(&self, on: bool) {
        self.inner.metrics_on.store(on, Ordering::Relaxed);
    }

    /// How this engine resolves names.
    pub fn metadata_mode(&self) -> &crate::metadata::MetadataMode {
        &self.inner.config.metadata
    }

    /// How this engine's GPU provider issues a chunk's copies: one batched
    /// driver call, a copy kernel, or one call per copy (drivers older than
    /// CUDA 12.8); `None` where there is no GPU provider.
    pub fn gpu_copy_method(&self) -> Option<crate::gpu::CopyMethod> {
        self.gpu().map(|gpu| gpu.copy_method())
    }

    /// Requests made to the metadata server so far (0 without one): opens
    /// pay for them, batches never do.
    pub fn metadata_calls(&self) -> u64 {
        self.inner.directory.as_ref().map_or(0, |directory| directory.calls())
    }

    /// Memory-info requests this engine has answered (peers fetching its
    /// KV layout): a peer's segment handle fetches it once and keeps it,
    /// so pushes layer by layer add nothing here. Also the metric
    /// `kvring_memory_info_served_total`.
    pub fn memory_info_served(&self) -> u64 {
        self.inner.context.memory_info_served.load(Ordering::Relaxed)
    }

    /// The segment name peers see.
    pub fn name(&self) -> &str {
        &self.inner.config.name
    }

    /// This start's epoch.
    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// Where the TCP data listener is, when the engine serves one.
    pub fn tcp_addr(&self) -> Option<&str> {
        self.inner.context.tcp_addr.as_deref()
    }

    /// Where the control plane listens: what peers pass to `open_segment`.
    pub fn control_addr(&self) -> SocketAddr {
        self.inner.control_addr
    }

    /// The configuration in force.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Cores the lanes run on (None: not pinned).
    pub fn lane_cores(&self) -> Vec<Option<usize>> {
        self.inner.lanes.iter().map(|l| l.shared.core).collect()
    }

    /// RDMA QPs this engine holds for initiators now (0 without RDMA):
    /// bounded per initiator and in total, released when an initiator
    /// reconnects or its probe finds it gone.
    pub fn rdma_accepted_qps(&self) -> usize {
        self.inner.context.rdma.as_ref().map_or(0, |node| node.accepted_qps())
    }

    /// What registering GPU memory with this engine's NICs did (GPUDirect
    /// RDMA): registrations through dma-buf and through peer memory, with
    /// relaxed ordering, and regions no NIC took. Each region is registered
    /// once per NIC when it is registered with the engine, never per
    /// transfer, so these stay put while batches run. Zeros without RDMA.
    pub fn rdma_device_mrs(&self) -> crate::rdma::DeviceMrStats {
        self.inner.context.rdma.as_ref().map(|node| node.device_stats()).unwrap_or_default()
    }

    /// The NICs that blocks of GPU `ordinal`'s memory go over (those nearest
    /// it: under the same PCIe switch, else the same host bridge, else the
    /// same NUMA node, else all), and how that was decided. Empty without
    /// RDMA or a GPU provider.
    pub fn rdma_gpu_nics(&self, ordinal: u32) -> (Vec<String>, &'static str) {
        match (&self.inner.context.rdma, self.gpu()) {
            (Some(node), Some(gpu)) => {
                let (names, nearness) = node.nics_for_gpu(gpu.as_ref(), ordinal);
                (names, nearness.describe())
            }
            _ => (Vec::new(), "no RDMA device or no GPU provider"),
        }
    }

    /// Each lane's counters, read without a lock.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// for (lane, stats) in engine.lane_stats().iter().enumerate() {
    ///     println!("lane {lane}: {} descriptors, {} bytes, parked {} times", stats.descs, stats.bytes, stats.parks);
    /// }
    /// ```
    pub fn lane_stats(&self) -> Vec<LaneStatsSnapshot> {
        self.inner.lanes.iter().map(|l| l.shared.metrics.snapshot()).collect()
    }

    /// The region registry, for the testing hooks.
    #[cfg(feature = "testing")]
    pub(crate) fn registry(&self) -> &crate::mem::Registry {
        &self.inner.registry
    }

    /// Stops the control server alone (the engine's lanes and QPs stay):
    /// for tests of a peer that no longer answers its control plane.
    #[cfg(feature = "testing")]
    pub(crate) fn stop_control(&self) {
        if let Some(mut server) = lifecycle::lock(&self.inner.control).take() {
            server.stop();
        }
    }

    /// Holds off this process's fences (and rdma connects' snapshots) until
    /// the guard drops: for tests of a connect that meets a long fence.
    #[cfg(feature = "testing")]
    pub(crate) fn hold_fences() -> std::sync::MutexGuard<'static, ()> {
        fence::fencing()
    }

    /// Lane `lane`'s shared part, for the testing hooks.
    #[cfg(feature = "testing")]
    pub(crate) fn lane_shared(&self, lane: usize) -> Option<&crate::runtime::lane::LaneShared> {
        self.inner.lanes.get(lane).map(|l| &*l.shared)
    }

    /// This engine's own segment descriptor (what peers get in a handshake).
    pub(crate) fn descriptor(&self) -> SegmentDescriptor {
        self.inner.context.describe()
    }

    /// A submitter for the calling thread (each submitting thread makes its
    /// own; it owns one set of rings per lane).
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let mut sub = engine.submitter()?;
    /// assert_eq!(sub.in_flight(), 0);
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn submitter(&self) -> Result<Submitter> {
        if self.inner.is_stopped() {
            return Err(Error::Shutdown);
        }
        let tag = self.inner.next_tag.fetch_add(1, Ordering::Relaxed);
        Ok(Submitter::new(self.inner.clone(), tag))
    }

    /// Publishes this engine's KV-cache layout, which peers read with
    /// [`Segment::kv_layout`] before their first transfer. Every buffer must
    /// lie inside a registered region.
    ///
    /// A published layout is fixed for the engine's life: peers cache it in
    /// their segment handle and compute every push's offsets from it, so a
    /// second call with a different layout fails with
    /// [`Error::LayoutFixed`] (and changes nothing); the same layout again is
    /// `Ok`. To serve another layout, start a new engine: its new epoch
    /// makes peers' handles to the old one stale, and their reopened
    /// segments fetch the new layout.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// use kvring::kv::{CacheShape, KvLayout};
    /// let shape = CacheShape::mla(61, 128, 576, 2, 64, 0)?;
    /// let cache = engine.alloc_region(shape.bytes()? as usize, kvring::RegionInfo::raw())?;
    /// engine.set_kv_layout(KvLayout::contiguous(shape, cache.id(), 0)?)?;
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn set_kv_layout(&self, layout: KvLayout) -> Result<()> {
        for layer in 0..layout.layers() {
            for buffer in layout.layer(layer)? {
                let entry = self.inner.registry.get(buffer.region)?;
                let len = buffer
                    .block_bytes
                    .checked_mul(layout.blocks())
                    .ok_or_else(|| Error::invalid("layout", "overflows"))?;
                check_range(buffer.region, Side::Local, layer, buffer.offset, len, entry.len as u64)?;
            }
        }
        // Set at most once; a racing second publisher compares with the
        // winner, so exactly one layout is ever served.
        let published = self.inner.context.kv_layout.get_or_init(|| layout.clone());
        if *published == layout {
            return Ok(());
        }
        let detail = if published.shape() != layout.shape() {
            format!("its shape, published {:?}, new {:?}", published.shape(), layout.shape())
        } else {
            "the same shape, but its buffers lie in other regions or at other offsets".to_string()
        };
        Err(Error::LayoutFixed { detail })
    }

    /// The KV-cache layout this engine published, if any.
    pub fn kv_layout(&self) -> Option<KvLayout> {
        self.inner.context.kv_layout.get().cloned()
    }

    /// Stops the control server and the lanes (after they drain what is
    /// queued). Later calls fail with `Shutdown`.
    pub fn shutdown(&self) {
        self.inner.stop();
    }
}
