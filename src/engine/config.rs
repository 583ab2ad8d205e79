//! An engine's configuration: every setting with its default, and the
//! builder that starts an engine from them.

use super::Engine;
use crate::advertise::Advertised;
use crate::auth::Token;
use crate::control::DEFAULT_CONTROL_TIMEOUT;
use crate::error::Result;
use crate::gpu::Gpu;
use crate::mem::DEFAULT_MAX_REGIONS;
use crate::metadata::MetadataMode;
use crate::net::AdmissionLimits;
use crate::notify::NotifyQuota;
use crate::runtime::backoff::BackoffPolicy;
use crate::runtime::lane::{DEFAULT_BUSY_POLL, DEFAULT_PARK_TIMEOUT};
use crate::segment::DEFAULT_SEGMENT_CACHE_CAPACITY;
use crate::transport::rdma::verbs::Verbs;
use crate::transport::tcp::DEFAULT_IO_TIMEOUT;
use crate::transport::TransportKind;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// Default number of lanes.
pub const DEFAULT_LANES: usize = 1;
/// Default submission ring depth (SQEs per submitter per lane).
pub const DEFAULT_RING_DEPTH: usize = 256;
/// Default descriptor arena (descriptors per submitter per lane).
pub const DEFAULT_ARENA_DESCS: usize = 16384;
/// Default status slots per submitter (batches in flight or unconsumed).
pub const DEFAULT_MAX_BATCHES_IN_FLIGHT: usize = 1024;
/// Default most open segments.
pub const DEFAULT_MAX_SEGMENTS: usize = 1024;
/// Batches at least this large are split across lanes by bytes.
pub const DEFAULT_SPLIT_THRESHOLD_BYTES: u64 = 1 << 20;
/// Default control-plane listen address: loopback, any free port.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:0";

/// Configuration, read once when the engine starts.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Segment name peers see.
    pub name: String,
    /// Lanes (pinned poller threads).
    pub lanes: usize,
    /// Cores for the lanes, in lane order; empty: pick automatically.
    pub cores: Vec<usize>,
    /// Pin lanes to cores at all.
    pub pin: bool,
    /// SQEs per submitter per lane.
    pub ring_depth: usize,
    /// Descriptors per submitter per lane.
    pub arena_descs: usize,
    /// Status slots per submitter.
    pub max_batches_in_flight: usize,
    /// Idle time a lane busy-polls before parking.
    pub busy_poll: Duration,
    /// Longest a parked lane sleeps without a doorbell (a safety net).
    pub park_timeout: Duration,
    /// Control-plane listen address.
    pub listen: SocketAddr,
    /// Region slots.
    pub max_regions: usize,
    /// Segment slots.
    pub max_segments: usize,
    /// Open segment handles kept in the LRU cache.
    pub segment_cache_capacity: usize,
    /// Deadline of control RPCs (handshake) when the caller gives none.
    pub control_timeout: Duration,
    /// Batches of at least this many bytes are split across lanes.
    pub split_threshold_bytes: u64,
    /// How `wait` backs off.
    pub wait_backoff: BackoffPolicy,
    /// The cluster's pre-shared token: peers must prove it (and this engine
    /// proves it to them) in every handshake and on every data connection.
    /// It never travels.
    pub token: Option<Token>,
    /// Who may hold this engine's connections: per source, pending, the
    /// deadline to prove oneself.
    pub admission: AdmissionLimits,
    /// Deadline of one socket read or write on a TCP data connection.
    pub io_timeout: Duration,
    /// Serve the TCP data transport (on the control address's IP, any port).
    pub serve_tcp: bool,
    /// Cross-memory attach with same-host peers: let them reach this
    /// engine's host memory with `process_vm_*`, and reach theirs.
    pub cma: bool,
    /// Pin caller-registered host memory with the GPU provider (off by
    /// default, see [`EngineBuilder::pin_host_memory`]).
    pub pin_host_memory: bool,
    /// Checksum every batch's blocks end to end unless the batch says
    /// otherwise (see [`EngineBuilder::checksum`]).
    pub checksum: bool,
    /// The transports this engine may reach peers by (empty: every one).
    /// A peer only others reach is refused with
    /// [`Error::TransportRefused`](crate::Error::TransportRefused); one
    /// entry makes it the required transport. It does not change what this
    /// engine serves to its peers.
    pub transports: Vec<TransportKind>,
    /// Notifications queued before senders are refused.
    pub notify_quota: NotifyQuota,
    /// Where names are resolved: the peer itself (the default), or etcd,
    /// where this engine also publishes its own descriptor.
    pub metadata: MetadataMode,
    /// TTL of the lease the published descriptor hangs on (etcd).
    pub metadata_ttl: Duration,
    /// How often open segments' published entries are re-read (etcd).
    pub metadata_poll: Duration,
    /// Where `/metrics` is served (Prometheus text); `None`: not served.
    pub metrics_listen: Option<SocketAddr>,
    /// Whether lanes update their counters (on by default; see
    /// [`Engine::set_metrics_enabled`]).
    pub metrics_enabled: bool,
    /// The IP told to peers; `None` resolves it (see
    /// [`EngineBuilder::planned_advertise`] for the rules).
    pub advertise: Option<IpAddr>,
    /// A verbs provider: the engine then serves and uses RDMA on every
    /// device with an active port (see [`EngineBuilder::rdma`]).
    pub rdma: Option<Arc<dyn Verbs>>,
    /// The RDMA devices to use, by name (empty: every device with an active
    /// port); a named device that is missing or has no active port fails
    /// the build with the reason (see [`EngineBuilder::rdma_devices`]).
    pub rdma_devices: Vec<String>,
    /// The RoCE GID index every RDMA port uses (`None`: chosen from each
    /// port's GID table, RoCE v2 with an IPv4-mapped address first); one
    /// the port does not have fails the build with the reason (see
    /// [`EngineBuilder::rdma_gid_index`]).
    pub rdma_gid_index: Option<u8>,
    /// A GPU provider, to tell device memory from host memory when a range
    /// is registered; `None` loads the CUDA driver at the first
    /// registration where one is installed (see [`EngineBuilder::gpu`]).
    pub gpu: Option<Arc<dyn Gpu>>,
    /// The GPU this engine moves memory of, when it has one: its lanes run
    /// on cores of that GPU's NUMA node (unless `cores` says otherwise).
    /// `None`: the GPUs' node when they all sit on one.
    pub gpu_device: Option<u32>,
    /// How often a target probes the initiators it holds RDMA QPs for, to
    /// release those of initiators that went away.
    pub rdma_probe_interval: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            name: format!("kvring-{}", std::process::id()),
            lanes: DEFAULT_LANES,
            cores: Vec::new(),
            pin: true,
            ring_depth: DEFAULT_RING_DEPTH,
            arena_descs: DEFAULT_ARENA_DESCS,
            max_batches_in_flight: DEFAULT_MAX_BATCHES_IN_FLIGHT,
            busy_poll: DEFAULT_BUSY_POLL,
            park_timeout: DEFAULT_PARK_TIMEOUT,
            listen: DEFAULT_LISTEN.parse().expect("valid default address"),
            max_regions: DEFAULT_MAX_REGIONS,
            max_segments: DEFAULT_MAX_SEGMENTS,
            segment_cache_capacity: DEFAULT_SEGMENT_CACHE_CAPACITY,
            control_timeout: DEFAULT_CONTROL_TIMEOUT,
            split_threshold_bytes: DEFAULT_SPLIT_THRESHOLD_BYTES,
            wait_backoff: BackoffPolicy::default(),
            token: None,
            admission: AdmissionLimits::default(),
            io_timeout: DEFAULT_IO_TIMEOUT,
            serve_tcp: true,
            cma: true,
            pin_host_memory: false,
            checksum: false,
            transports: Vec::new(),
            notify_quota: NotifyQuota::default(),
            metadata: MetadataMode::PeerHandshake,
            metadata_ttl: crate::metadata::etcd::DEFAULT_LEASE_TTL,
            metadata_poll: DEFAULT_METADATA_POLL,
            metrics_listen: None,
            metrics_enabled: true,
            advertise: None,
            rdma: None,
            rdma_devices: Vec::new(),
            rdma_gid_index: None,
            gpu: None,
            gpu_device: None,
            rdma_probe_interval: DEFAULT_RDMA_PROBE_INTERVAL,
        }
    }
}

/// Default interval of the probes of initiators holding RDMA QPs.
pub const DEFAULT_RDMA_PROBE_INTERVAL: Duration = Duration::from_secs(10);

/// Most NICs an engine uses for RDMA.
pub const MAX_RDMA_NICS: usize = 8;

/// Default interval at which open segments' etcd entries are re-read.
pub const DEFAULT_METADATA_POLL: Duration = Duration::from_secs(1);

/// Builds an [`Engine`].
///
/// ```no_run
/// use kvring::Engine;
/// use std::time::Duration;
/// let engine = Engine::builder()
///     .name("prefill-0")
///     .lanes(2)
///     .busy_poll(Duration::from_millis(1))
///     .listen("127.0.0.1:0".parse().unwrap())
///     .build()?;
/// # Ok::<(), kvring::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct EngineBuilder {
    config: EngineConfig,
}

impl EngineBuilder {
    /// The segment name peers see.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.config.name = name.into();
        self
    }

    /// Number of lanes (1..=64).
    pub fn lanes(mut self, lanes: usize) -> Self {
        self.config.lanes = lanes;
        self
    }

    /// The GPU this engine serves: its lanes run on cores of that GPU's
    /// NUMA node, as the GPU provider reports it (where it knows it, and
    /// unless [`cores`](Self::cores) names them). Without it, lanes go to
    /// the GPUs' node when that is unambiguous (one GPU, or all on one
    /// node); this overrides that choice.
    pub fn gpu_device(mut self, ordinal: u32) -> Self {
        self.config.gpu_device = Some(ordinal);
        self
    }

    /// Cores for the lanes, in lane order.
    pub fn cores(mut self, cores: Vec<usize>) -> Self {
        self.config.cores = cores;
        self
    }

    /// Whether to pin lanes to cores (default true).
    pub fn pin(mut self, pin: bool) -> Self {
        self.config.pin = pin;
        self
    }

    /// SQEs per submitter per lane.
    pub fn ring_depth(mut self, depth: usize) -> Self {
        self.config.ring_depth = depth;
        self
    }

    /// Descriptors per submitter per lane (the largest batch).
    pub fn arena_descs(mut self, descs: usize) -> Self {
        self.config.arena_descs = descs;
        self
    }

    /// Status slots per submitter.
    pub fn max_batches_in_flight(mut self, batches: usize) -> Self {
        self.config.max_batches_in_flight = batches;
        self
    }

    /// Idle time a lane busy-polls before it parks.
    pub fn busy_poll(mut self, window: Duration) -> Self {
        self.config.busy_poll = window;
        self
    }

    /// Longest a parked lane sleeps without being woken (a safety net; the
    /// doorbell wakes it when work arrives).
    pub fn park_timeout(mut self, timeout: Duration) -> Self {
        self.config.park_timeout = timeout;
        self
    }

    /// Control-plane listen address (only this address is bound).
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.config.listen = addr;
        self
    }

    /// Open segment handles kept; the least recently used one is closed
    /// when another is opened past this.
    pub fn segment_cache_capacity(mut self, handles: usize) -> Self {
        self.config.segment_cache_capacity = handles;
        self
    }

    /// Deadline of control RPCs when none is given.
    pub fn control_timeout(mut self, timeout: Duration) -> Self {
        self.config.control_timeout = timeout;
        self
    }

    /// Batches of at least this many bytes are split across lanes.
    pub fn split_threshold(mut self, bytes: u64) -> Self {
        self.config.split_threshold_bytes = bytes;
        self
    }

    /// How `wait` backs off.
    pub fn wait_backoff(mut self, policy: BackoffPolicy) -> Self {
        self.config.wait_backoff = policy;
        self
    }

    /// The cluster's pre-shared token: every peer must prove it in its
    /// handshake and every data connection must prove the handshake's
    /// session before anything is served; this engine proves it to the
    /// peers it opens too. The token itself never travels. Without one,
    /// anyone who reaches the engine's ports can read and write its
    /// registered memory (it binds loopback by default).
    pub fn token(mut self, token: impl Into<Vec<u8>>) -> Self {
        self.config.token = Some(Token::new(token));
        self
    }

    /// Who may hold this engine's connections (see [`AdmissionLimits`]).
    pub fn admission(mut self, limits: AdmissionLimits) -> Self {
        self.config.admission = limits;
        self
    }

    /// Deadline of one socket read or write on a TCP data connection.
    pub fn io_timeout(mut self, timeout: Duration) -> Self {
        self.config.io_timeout = timeout;
        self
    }

    /// Whether to serve the TCP data transport (default true). Without it,
    /// peers on other hosts cannot reach this engine's regions.
    pub fn serve_tcp(mut self, serve: bool) -> Self {
        self.config.serve_tcp = serve;
        self
    }

    /// The transports this engine may reach peers by, an allow-list (empty,
    /// the default: every one). The documented order is kept, with the
    /// steps outside the list removed; a peer that only transports outside
    /// it reach is refused at open with
    /// [`Error::TransportRefused`](crate::Error::TransportRefused), naming
    /// what reaches the peer and why each allowed transport does not. A
    /// transport asked for by name outside the list is refused the same way.
    pub fn transports(mut self, allowed: impl IntoIterator<Item = TransportKind>) -> Self {
        let mut list: Vec<TransportKind> = Vec::new();
        for kind in allowed {
            if !list.contains(&kind) {
                list.push(kind);
            }
        }
        self.config.transports = list;
        self
    }

    /// Requires one transport: every peer is reached by it or refused with
    /// the reason ([`transports`](Self::transports) with one entry).
    pub fn require_transport(self, kind: TransportKind) -> Self {
        self.transports([kind])
    }

    /// Cross-memory attach (default on): same-host peers of the same user
    /// may reach this engine's host memory with `process_vm_writev` /
    /// `process_vm_readv` (where the kernel's Yama policy asks for it, the
    /// engine opts in with `PR_SET_PTRACER` and logs that it did), and this
    /// engine reaches theirs. Off, peers are told why and take the next
    /// transport (tcp).
    pub fn cma(mut self, on: bool) -> Self {
        self.config.cma = on;
        self
    }

    /// Pin caller-registered host memory with the GPU provider
    /// (`cuMemHostRegister`), so copies between it and a GPU run at full
    /// rate. Off by default: pinning behind the caller's back makes its own
    /// later `cudaHostRegister` of that buffer fail, refuses read-only
    /// mappings and takes seconds for hundreds of GB inside `register`.
    /// Memory its owner pinned already (`cudaHostAlloc`, PyTorch's
    /// `pin_memory`) is used as it is, on or off; unpinned memory is moved
    /// through the driver's staged copies when this is off.
    pub fn pin_host_memory(mut self, on: bool) -> Self {
        self.config.pin_host_memory = on;
        self
    }

    /// End-to-end checksums for every batch by default (off by default;
    /// a batch overrides it with [`Batch::checksum`](crate::Batch::checksum)):
    /// each block's CRC32C is computed where it is sent and checked where
    /// it lands before the batch is reported done; a mismatch fails the
    /// batch with [`Error::Corrupt`](crate::Error::Corrupt) naming the
    /// block. What each transport verifies is in docs/CHECKSUMS.md.
    pub fn checksum(mut self, on: bool) -> Self {
        self.config.checksum = on;
        self
    }

    /// How names are resolved: [`MetadataMode::Etcd`] looks them up in etcd
    /// and publishes this engine there; [`MetadataMode::PeerHandshake`]
    /// (the default) asks peers themselves. Parse a setting with
    /// [`MetadataMode::parse`].
    pub fn metadata(mut self, mode: MetadataMode) -> Self {
        self.config.metadata = mode;
        self
    }

    /// TTL of the published descriptor's lease (etcd).
    pub fn metadata_ttl(mut self, ttl: Duration) -> Self {
        self.config.metadata_ttl = ttl;
        self
    }

    /// How often open segments' published entries are re-read (etcd).
    pub fn metadata_poll(mut self, every: Duration) -> Self {
        self.config.metadata_poll = every;
        self
    }

    /// Serves Prometheus text at `http://{addr}/metrics`.
    pub fn metrics(mut self, addr: SocketAddr) -> Self {
        self.config.metrics_listen = Some(addr);
        self
    }

    /// The IP peers are told (in handshakes and the metadata store), for an
    /// engine listening on `0.0.0.0` behind NAT or in a pod.
    pub fn advertise(mut self, ip: IpAddr) -> Self {
        self.config.advertise = Some(ip);
        self
    }

    /// Serves and uses RDMA through `verbs` (the real provider,
    /// `kvring::rdma::IbVerbs`, or the simulated one): every region is registered
    /// with each NIC, peers learn the keys in the handshake, and RDMA comes
    /// first in the transport order.
    pub fn rdma(mut self, verbs: Arc<dyn Verbs>) -> Self {
        self.config.rdma = Some(verbs);
        self
    }

    /// Uses only these RDMA devices (Mooncake's `device_name` list, NCCL's
    /// `NCCL_IB_HCA`): each must exist and have an active port, or the
    /// engine is not built and the error names it. No other NIC is used.
    pub fn rdma_devices<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.config.rdma_devices = names.into_iter().map(Into::into).filter(|n: &String| !n.is_empty()).collect();
        self
    }

    /// Uses GID `index` of every RDMA port (what `ibv_rc_pingpong -g` and
    /// perftest's `-x` take; `show_gids` lists them): for RoCE fabrics
    /// where the default, the first RoCE v2 GID with an IPv4-mapped
    /// address, is not the one routed. A port without a GID at `index`
    /// fails the build with the port's valid indices.
    pub fn rdma_gid_index(mut self, index: u8) -> Self {
        self.config.rdma_gid_index = Some(index);
        self
    }

    /// Classifies registered memory with `gpu` (the simulated provider in
    /// tests, or an embedder's own) instead of the CUDA driver.
    pub fn gpu(mut self, gpu: Arc<dyn Gpu>) -> Self {
        self.config.gpu = Some(gpu);
        self
    }

    /// How often the initiators holding this engine's RDMA QPs are probed
    /// (those gone have their QPs released).
    pub fn rdma_probe_interval(mut self, every: Duration) -> Self {
        self.config.rdma_probe_interval = every;
        self
    }

    /// Whether lanes count (default on).
    pub fn metrics_enabled(mut self, on: bool) -> Self {
        self.config.metrics_enabled = on;
        self
    }

    /// Notifications queued before senders are refused with `Busy`.
    pub fn notify_queue(mut self, capacity: usize) -> Self {
        self.config.notify_quota.total = capacity;
        self
    }

    /// All of the notification quotas (per sender and in total, by count
    /// and bytes); past them a sender gets `Busy`.
    pub fn notify_quota(mut self, quota: NotifyQuota) -> Self {
        self.config.notify_quota = quota;
        self
    }

    /// Replaces the whole configuration.
    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }

    /// The configuration built so far.
    pub fn settings(&self) -> &EngineConfig {
        &self.config
    }

    /// The cores lanes would be pinned to (`None`: unpinned), as `build`
    /// would choose them.
    pub fn planned_lane_cores(&self) -> Vec<Option<usize>> {
        lane_cores(&self.config)
    }

    /// The IP the engine would tell peers, and which rule chose it: the
    /// `advertise` setting; the listen address when it is a concrete one;
    /// `KVRING_HOST_IP`, `HOST_IP`, `POD_IP`; the interface that routes to
    /// the metadata server; the hostname's address. A wildcard listener
    /// never advertises loopback silently: that is an error.
    pub fn planned_advertise(&self) -> Result<Advertised> {
        let config = &self.config;
        crate::advertise::for_process(config.advertise, config.listen.ip(), config.metadata.server_addr())
    }

    /// Starts the engine: checks limits, starts lanes and the control server.
    pub fn build(self) -> Result<Engine> {
        Engine::start(self.config)
    }
}

/// Cores for `lanes` lanes, round robin: the configured ones; else the
/// cores of the GPUs' NUMA node (`gpu_device`'s, or the one node all GPUs
/// sit on: `placement::gpu_placement`); else every online core but the
/// first (left to the application's own threads).
pub(super) fn lane_cores(config: &EngineConfig) -> Vec<Option<usize>> {
    use crate::runtime::placement::{self, GpuPlacement};
    if !config.pin {
        return vec![None; config.lanes];
    }
    if !config.cores.is_empty() {
        return (0..config.lanes).map(|i| Some(config.cores[i % config.cores.len()])).collect();
    }
    let online = placement::usable_cores();
    if online.is_empty() {
        return vec![None; config.lanes];
    }
    let near_gpu = match placement::gpu_placement(config.gpu_device, &gpu_nodes(config)) {
        GpuPlacement::Node(node) => {
            let near = placement::near_node(Some(node), &online, placement::node_cores);
            if near.is_none() && config.gpu_device.is_some() {
                tracing::warn!(node, "lanes placed as usual: the GPU's NUMA node has no usable core");
            }
            near
        }
        GpuPlacement::NamedUnknown(gpu) => {
            tracing::warn!(gpu, "lanes placed as usual: the GPU's NUMA node is unknown");
            None
        }
        GpuPlacement::Ambiguous | GpuPlacement::NoGpu => None,
    };
    let skip_first = usize::from(online.len() > 1);
    let usable = near_gpu.as_deref().unwrap_or(&online[skip_first..]);
    (0..config.lanes).map(|i| Some(usable[i % usable.len()])).collect()
}

/// Every GPU as (ordinal, NUMA node): from the configured provider; with
/// `gpu_device` named and none configured, from the CUDA driver; else,
/// where the driver is installed, from sysfs (no CUDA initialised at start
/// for an engine that may never touch a GPU; ordinals are positions then).
fn gpu_nodes(config: &EngineConfig) -> Vec<(u32, Option<u32>)> {
    let from = |gpu: &dyn Gpu| -> Vec<(u32, Option<u32>)> {
        gpu.devices().map(|all| all.into_iter().map(|d| (d.ordinal, d.numa_node)).collect()).unwrap_or_default()
    };
    match (&config.gpu, config.gpu_device) {
        (Some(gpu), _) => from(gpu.as_ref()),
        (None, Some(_)) => crate::gpu::CudaGpu::load().map(|gpu| from(&gpu)).unwrap_or_default(),
        (None, None) if crate::gpu::cuda::driver_present() => {
            crate::runtime::placement::sysfs_gpu_nodes().into_iter().enumerate().map(|(i, n)| (i as u32, n)).collect()
        }
        (None, None) => Vec::new(),
    }
}
