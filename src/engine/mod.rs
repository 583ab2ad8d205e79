//! The engine: one per process (per inference rank). It owns the region
//! registry, the lanes, the control server and the open segments, and hands
//! out per-thread submitters.

mod batch;
mod metadata;
mod metrics;
mod reaper;
mod region;
mod segment;
mod submitter;

pub use batch::{Batch, Completion, Event, Outcome};
pub use region::{fill_pattern, Region};
pub use segment::Segment;
pub use submitter::{StatusReader, Submitter, MAX_LANES};

use crate::auth::{Authenticator, Initiator, Token};
use crate::control::{ControlHandler, ControlServer, DEFAULT_CONTROL_TIMEOUT};
use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::kv::KvLayout;
use crate::mem::registry::check_range;
use crate::mem::{Access, RegionInfo, Registry, ShmMapping, DEFAULT_MAX_REGIONS};
use crate::metadata::{MetadataStore, PeerHandshake};
use crate::net::AdmissionLimits;
use crate::proto::ChecksumRequest;
use crate::runtime::backoff::BackoffPolicy;
use crate::runtime::lane::{
    memlock_limit_bytes, memlock_needed_bytes, Clock, LaneCommand, LaneConfig, LaneHandle, LaneSegment,
    DEFAULT_BUSY_POLL, DEFAULT_IO_MEMORY_BYTES, DEFAULT_PARK_TIMEOUT,
};
use crate::segment::{
    local_host_id, CacheStats, PeerSegment, RemoteRegion, SegmentCache, SegmentDescriptor, TransportKind,
    DEFAULT_SEGMENT_CACHE_CAPACITY,
};
use crate::transport::notify::{Notification, NotificationQueue, NotifyQuota, MAX_NOTIFY_BYTES};
use crate::transport::rdma::link::RdmaLink;
use crate::transport::rdma::node::RdmaNode;
use crate::transport::rdma::verbs::QpEndpoint;
use crate::transport::tcp::DEFAULT_IO_TIMEOUT;
use crate::transport::{Link, NullLink, ShmLink, TcpDataServer, TcpLink};
use prost::Message as _;
use segment::SegmentInner;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

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
    /// glommio io_uring buffer memory per lane.
    pub io_memory_bytes: usize,
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
    /// Notifications queued before senders are refused.
    pub notify_quota: NotifyQuota,
    /// Where names are resolved: `None` (or `"P2PHANDSHAKE"`) asks the peer
    /// itself; `etcd://host:port[/prefix/]` uses etcd, where this engine
    /// also publishes its own descriptor.
    pub metadata: Option<String>,
    /// TTL of the lease the published descriptor hangs on (etcd).
    pub metadata_ttl: Duration,
    /// How often open segments' published entries are re-read (etcd).
    pub metadata_poll: Duration,
    /// Where `/metrics` is served (Prometheus text); `None`: not served.
    pub metrics_listen: Option<SocketAddr>,
    /// Whether lanes update their counters (on by default; see
    /// [`Engine::set_metrics_enabled`]).
    pub metrics_enabled: bool,
    /// The IP told to peers; `None` resolves it (see [`crate::advertise`]).
    pub advertise: Option<IpAddr>,
    /// A verbs provider: the engine then serves and uses RDMA on every
    /// device with an active port (see [`EngineBuilder::rdma`]).
    pub rdma: Option<Arc<dyn crate::transport::rdma::verbs::Verbs>>,
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
            io_memory_bytes: DEFAULT_IO_MEMORY_BYTES,
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
            notify_quota: NotifyQuota::default(),
            metadata: None,
            metadata_ttl: crate::metadata::etcd::DEFAULT_LEASE_TTL,
            metadata_poll: DEFAULT_METADATA_POLL,
            metrics_listen: None,
            metrics_enabled: true,
            advertise: None,
            rdma: None,
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

    /// glommio io_uring buffer memory per lane, bytes.
    pub fn io_memory(mut self, bytes: usize) -> Self {
        self.config.io_memory_bytes = bytes;
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

    /// Resolves names through etcd (`etcd://host:port[/prefix/]`) and
    /// publishes this engine there; `"P2PHANDSHAKE"` (the default) asks
    /// peers themselves.
    pub fn metadata(mut self, url: impl Into<String>) -> Self {
        self.config.metadata = Some(url.into());
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

    /// Serves and uses RDMA through `verbs` (the real provider with the
    /// `rdma` feature, or the simulated one): every region is registered
    /// with each NIC, peers learn the keys in the handshake, and RDMA comes
    /// first in the transport order.
    pub fn rdma(mut self, verbs: Arc<dyn crate::transport::rdma::verbs::Verbs>) -> Self {
        self.config.rdma = Some(verbs);
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

    /// Starts the engine: checks limits, starts lanes and the control server.
    pub fn build(self) -> Result<Engine> {
        Engine::start(self.config)
    }
}

/// One lane's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaneStatsSnapshot {
    /// Batch parts executed.
    pub parts: u64,
    /// Descriptors executed (moved or failed).
    pub descs: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Times the lane parked.
    pub parks: u64,
    /// Most batch parts (and notifications) it has had in flight at once.
    pub peak_in_flight: u64,
}

/// One engine per process. Cheap to clone (a shared handle).
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<EngineInner>,
}

#[derive(Debug)]
struct SegmentTable {
    cache: SegmentCache<Segment>,
    free: Vec<u16>,
    generations: Vec<u16>,
}

pub(crate) struct EngineInner {
    pub(crate) config: EngineConfig,
    pub(crate) epoch: u64,
    pub(crate) registry: Arc<Registry>,
    pub(crate) lanes: Vec<LaneHandle>,
    pub(crate) clock: Clock,
    segments: Mutex<SegmentTable>,
    control: Mutex<Option<ControlServer>>,
    context: Arc<ControlContext>,
    data: Mutex<Option<TcpDataServer>>,
    notifications: Arc<NotificationQueue>,
    control_addr: SocketAddr,
    metadata: Box<dyn MetadataStore>,
    etcd: Option<Arc<crate::metadata::etcd::Etcd>>,
    publication: Mutex<Option<crate::metadata::etcd::Publication>>,
    metrics_on: Arc<AtomicBool>,
    metrics_server: Mutex<Option<crate::net::Acceptor>>,
    metrics_addr: OnceLock<SocketAddr>,
    advertised: crate::advertise::Advertised,
    stopped: AtomicBool,
    next_tag: AtomicU16,
}

impl std::fmt::Debug for EngineInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("name", &self.config.name)
            .field("epoch", &format_args!("{:#018x}", self.epoch))
            .field("lanes", &self.lanes.len())
            .field("control", &self.control_addr)
            .finish()
    }
}

impl EngineInner {
    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    fn stop(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        // First: peers resolving this name stop finding it.
        if let Some(mut publication) = lock(&self.publication).take() {
            publication.stop();
        }
        if let Some(mut server) = lock(&self.control).take() {
            server.stop();
        }
        if let Some(mut server) = lock(&self.metrics_server).take() {
            server.stop();
        }
        if let Some(mut server) = lock(&self.data).take() {
            server.stop();
        }
        for lane in &self.lanes {
            lane.shared.stop();
        }
    }
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        self.stop();
        for lane in &mut self.lanes {
            lane.stop_and_join();
        }
        // No peer reaches this engine's memory through its NICs any more,
        // even while a segment handle keeps the RDMA node alive.
        if let Some(node) = &self.context.rdma {
            node.shutdown();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its data consistent, so a panic
    // elsewhere does not make the data unusable.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A random 64-bit epoch from the kernel.
fn random_epoch() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into the buffer.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if got != bytes.len() as isize {
        // Never seen; still never reuse an epoch across restarts.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return now.as_nanos() as u64 ^ ((std::process::id() as u64) << 32);
    }
    u64::from_le_bytes(bytes) | 1
}

/// Cores for `lanes` lanes: the configured ones, or every online core but
/// the first (left to the application's own threads), round robin.
fn lane_cores(config: &EngineConfig) -> Vec<Option<usize>> {
    if !config.pin {
        return vec![None; config.lanes];
    }
    if !config.cores.is_empty() {
        return (0..config.lanes).map(|i| Some(config.cores[i % config.cores.len()])).collect();
    }
    let online = crate::runtime::placement::usable_cores();
    if online.is_empty() {
        return vec![None; config.lanes];
    }
    let skip_first = usize::from(online.len() > 1);
    let usable = &online[skip_first..];
    (0..config.lanes).map(|i| Some(usable[i % usable.len()])).collect()
}

impl Engine {
    /// A builder with the defaults.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    fn start(config: EngineConfig) -> Result<Self> {
        if config.lanes == 0 || config.lanes > MAX_LANES {
            return Err(Error::invalid("lanes", format!("{} is outside 1..={MAX_LANES}", config.lanes)));
        }
        if config.name.is_empty() || config.name.len() > crate::segment::descriptor::MAX_SEGMENT_NAME_BYTES {
            return Err(Error::invalid("name", "must be 1..=256 bytes"));
        }
        for (what, value) in [
            ("ring depth", config.ring_depth),
            ("arena", config.arena_descs),
            ("max batches in flight", config.max_batches_in_flight),
        ] {
            if value == 0 || value > (1 << 16) {
                return Err(Error::invalid(what, format!("{value} is outside 1..=65536")));
            }
        }
        let need = memlock_needed_bytes(config.lanes, config.io_memory_bytes);
        if let Some(have) = memlock_limit_bytes() {
            if have < need {
                return Err(Error::LockedMemoryLimit { have_bytes: have, need_bytes: need });
            }
        }
        crate::mem::shm::sweep_stale();
        let epoch = random_epoch();
        let registry = Arc::new(Registry::new(config.max_regions));
        let clock = Clock::new();
        if config.token.as_ref().is_some_and(Token::is_empty) {
            return Err(Error::invalid("token", "an empty token protects nothing; give one or none"));
        }
        let fd_limit = crate::net::raise_fd_limit();
        let admission = config.admission.capped(crate::net::fd_budget(fd_limit));
        let notifications = Arc::new(NotificationQueue::new(config.notify_quota));
        let metrics_on = Arc::new(AtomicBool::new(config.metrics_enabled));
        let mut lanes = Vec::with_capacity(config.lanes);
        for (index, core) in lane_cores(&config).into_iter().enumerate() {
            let lane_config = LaneConfig {
                index,
                core,
                busy_poll: config.busy_poll,
                park_timeout: config.park_timeout,
                io_memory_bytes: config.io_memory_bytes,
                max_segments: config.max_segments,
                clock,
                // Lane 0 posts notification CQEs to submitters that watch.
                notifications: (index == 0).then(|| notifications.clone()),
                metrics: metrics_on.clone(),
            };
            // Lanes started so far stop when `lanes` drops on error.
            lanes.push(LaneHandle::start(lane_config, registry.clone())?);
        }
        if let Some(lane) = lanes.first() {
            let lane = lane.shared.clone();
            notifications.on_delivery(Box::new(move || lane.doorbell.ring()));
        }
        let advertised = crate::advertise::for_engine(&config)?;

        let authenticator = config.token.clone().map(|token| Arc::new(Authenticator::new(token, epoch)));
        if authenticator.is_none() && !config.listen.ip().is_loopback() {
            tracing::warn!(
                listen = %config.listen,
                "listening beyond loopback without a token: anyone who reaches these ports can read and write \
                 this engine's registered memory; set a token (token = ..., KVRING_TOKEN, --token)"
            );
        }
        let data_server = if config.serve_tcp {
            let data_listen = SocketAddr::new(config.listen.ip(), 0);
            let target = crate::transport::tcp::TargetContext {
                registry: registry.clone(),
                notifications: notifications.clone(),
                epoch,
                auth: authenticator.clone(),
            };
            Some(TcpDataServer::start(data_listen, target, admission)?)
        } else {
            None
        };
        let context = Arc::new(ControlContext {
            name: config.name.clone(),
            epoch,
            registry: registry.clone(),
            control_addr: OnceLock::new(),
            tcp_addr: data_server.as_ref().map(|s| SocketAddr::new(advertised.ip, s.local_addr().port()).to_string()),
            auth: authenticator,
            notifications: notifications.clone(),
            kv_layout: Mutex::new(None),
            rdma: match &config.rdma {
                Some(verbs) => Some(Arc::new(RdmaNode::open(verbs.clone(), MAX_RDMA_NICS)?)),
                None => None,
            },
        });
        let server = ControlServer::start(config.listen, context.clone(), admission)?;
        // Peers are told the advertised IP with the port actually bound.
        let control_addr = SocketAddr::new(advertised.ip, server.local_addr().port());
        // Set before any peer can learn the address, so every handshake sees it.
        let _ = context.control_addr.set(control_addr.to_string());
        let segments = SegmentTable {
            cache: SegmentCache::new(config.segment_cache_capacity.min(config.max_segments)),
            free: (0..config.max_segments.min(1 << 16) as u16).rev().collect(),
            generations: vec![1; config.max_segments.min(1 << 16)],
        };
        let handshake = PeerHandshake { token: config.token.clone() };
        let (store, etcd) = metadata::open_store(config.metadata.as_deref(), handshake)?;
        let publication = match &etcd {
            Some(etcd) => Some(metadata::publish(
                etcd.clone(),
                &context.describe(),
                config.metadata_ttl,
                Instant::now() + config.control_timeout,
            )?),
            None => None,
        };
        let poll = config.metadata_poll;
        let engine = Self {
            inner: Arc::new(EngineInner {
                config,
                epoch,
                registry,
                lanes,
                clock,
                segments: Mutex::new(segments),
                control: Mutex::new(Some(server)),
                context,
                data: Mutex::new(data_server),
                notifications,
                control_addr,
                metadata: store,
                etcd,
                publication: Mutex::new(publication),
                metrics_on,
                metrics_server: Mutex::new(None),
                metrics_addr: OnceLock::new(),
                advertised,
                stopped: AtomicBool::new(false),
                next_tag: AtomicU16::new(1),
            }),
        };
        if engine.inner.etcd.is_some() {
            metadata::start_watcher(Arc::downgrade(&engine.inner), poll)?;
        }
        if engine.inner.context.rdma.is_some() {
            reaper::start(Arc::downgrade(&engine.inner), engine.inner.config.rdma_probe_interval)?;
        }
        if let Some(listen) = engine.inner.config.metrics_listen {
            let server = metrics::serve(listen, Arc::downgrade(&engine.inner))?;
            let _ = engine.inner.metrics_addr.set(server.local_addr());
            *lock(&engine.inner.metrics_server) = Some(server);
        }
        Ok(engine)
    }

    /// The IP peers are told, and which rule chose it.
    pub fn advertised(&self) -> &crate::advertise::Advertised {
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

    /// How this engine resolves names (`kvring info` prints it).
    pub fn metadata_mode(&self) -> String {
        self.inner.metadata.mode()
    }

    /// Requests made to the metadata server so far (0 without one): opens
    /// pay for them, batches never do.
    pub fn metadata_calls(&self) -> u64 {
        self.inner.etcd.as_ref().map_or(0, |etcd| etcd.calls())
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

    /// Each lane's counters, read without a lock.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// for (lane, stats) in engine.lane_stats().iter().enumerate() {
    ///     println!("lane {lane}: {} descriptors, {} bytes, parked {} times", stats.descs, stats.bytes, stats.parks);
    /// }
    /// ```
    pub fn lane_stats(&self) -> Vec<LaneStatsSnapshot> {
        self.inner
            .lanes
            .iter()
            .map(|l| {
                let s = &l.shared.stats;
                LaneStatsSnapshot {
                    parts: s.parts.load(Ordering::Relaxed),
                    descs: s.descs.load(Ordering::Relaxed),
                    bytes: s.bytes.load(Ordering::Relaxed),
                    parks: s.parks.load(Ordering::Relaxed),
                    peak_in_flight: s.peak_in_flight.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// Registers `len` bytes at `ptr`. The same range again (same info)
    /// returns the same id; overlapping another region is refused.
    ///
    /// # Safety
    ///
    /// `ptr..ptr+len` must stay valid for reads and writes until the region
    /// is unregistered (or the engine dropped), and the caller must not
    /// access it while a batch that uses it is in flight.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let mut kv = vec![0u8; 1 << 20];
    /// // SAFETY: `kv` outlives the registration (unregistered below).
    /// let id = unsafe { engine.register(kv.as_mut_ptr(), kv.len(), kvring::RegionInfo::raw())? };
    /// engine.unregister(id)?;
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub unsafe fn register(&self, ptr: *mut u8, len: usize, info: RegionInfo) -> Result<RegionId> {
        let id = self.inner.registry.register(ptr as usize, len, info, None)?;
        // SAFETY: the caller keeps the range valid until it unregisters (our
        // contract), which deregisters it from the NICs too.
        unsafe { self.register_with_nics(id, ptr as u64, len as u64, info.access)? };
        Ok(id)
    }

    /// Registers a region with every NIC (when the engine serves RDMA);
    /// on failure the region is unregistered again.
    ///
    /// # Safety
    ///
    /// The range stays valid until the region is unregistered.
    unsafe fn register_with_nics(&self, id: RegionId, addr: u64, len: u64, access: Access) -> Result<()> {
        let Some(node) = &self.inner.context.rdma else { return Ok(()) };
        // SAFETY: forwarded from our caller.
        if let Err(error) = unsafe { node.register_region(id, addr, len, access) } {
            node.unregister_region(id);
            let _ = self.inner.registry.unregister(id);
            return Err(error);
        }
        Ok(())
    }

    /// The registered local region holding `addr..addr + len`, and the
    /// offset of `addr` in it: for callers that name memory by address.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let region = engine.alloc_region(1 << 20, kvring::RegionInfo::raw())?;
    /// let (id, offset) = engine.locate(region.as_ptr() as u64 + 4096, 4096)?;
    /// assert_eq!((id, offset), (region.id(), 4096));
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn locate(&self, addr: u64, len: u64) -> Result<(RegionId, u64)> {
        let found = usize::try_from(addr).ok().zip(usize::try_from(len).ok());
        found
            .and_then(|(addr, len)| self.inner.registry.find(addr, len))
            .ok_or_else(|| Error::invalid("local address", format!("{addr:#x}+{len} lies in no registered region")))
    }

    /// Unregisters a region; refused with `RegionBusy` while batches use it.
    pub fn unregister(&self, id: RegionId) -> Result<()> {
        self.inner.registry.unregister(id)?;
        if let Some(node) = &self.inner.context.rdma {
            node.unregister_region(id);
        }
        Ok(())
    }

    /// Allocates `len` bytes of shared memory (page aligned, pre-faulted,
    /// mappable by same-host peers) and registers it.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let region = engine.alloc_region(1 << 20, kvring::RegionInfo::raw())?;
    /// region.write_at(0, b"hello")?;
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn alloc_region(&self, len: usize, info: RegionInfo) -> Result<Region> {
        let mapping = Arc::new(ShmMapping::create(len, self.inner.epoch)?);
        let id = self.inner.registry.register(mapping.as_ptr() as usize, len, info, Some(mapping.clone()))?;
        // SAFETY: the registry keeps the mapping alive while it is registered.
        unsafe { self.register_with_nics(id, mapping.as_ptr() as u64, len as u64, info.access)? };
        Region::new(id, mapping)
    }

    /// A registered region's description.
    pub fn region_info(&self, id: RegionId) -> Result<(usize, usize, RegionInfo)> {
        let entry = self.inner.registry.get(id)?;
        Ok((entry.addr, entry.len, entry.info))
    }

    /// This engine's own segment descriptor (what peers get in a handshake).
    pub fn descriptor(&self) -> SegmentDescriptor {
        self.inner.context.describe()
    }

    /// Opens (or returns the cached handle of) a peer segment by name or
    /// control address, choosing the transport: shm when the peer is on
    /// this host.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let decode = engine.open_segment("127.0.0.1:7100")?;
    /// println!("{} has {} regions", decode.name(), decode.regions().len());
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn open_segment(&self, name: &str) -> Result<Segment> {
        self.open_segment_with(name, None, self.inner.config.control_timeout)
    }

    /// [`open_segment`](Self::open_segment) with an explicit transport and
    /// handshake deadline.
    pub fn open_segment_with(
        &self,
        name: &str,
        transport: Option<TransportKind>,
        timeout: Duration,
    ) -> Result<Segment> {
        if self.inner.is_stopped() {
            return Err(Error::Shutdown);
        }
        {
            let mut table = lock(&self.inner.segments);
            let cached = table.cache.peek(name).cloned();
            match cached {
                Some(segment) if segment.inner.peer.is_stale() => {
                    // Its peer restarted or went away: evict it now and
                    // reconnect through a fresh handshake below.
                    table.cache.remove_stale(name);
                    self.retire(&mut table, &segment);
                    table.cache.note_miss();
                }
                // A peer whose descriptor listed no region yet was still
                // starting: ask it again rather than hand back the empty
                // handle.
                Some(segment)
                    if !segment.is_closed()
                        && !segment.regions().is_empty()
                        && transport.is_none_or(|t| t == segment.transport()) =>
                {
                    table.cache.get(name); // counts the hit and refreshes its recency
                    return Ok(segment);
                }
                _ => table.cache.note_miss(),
            }
        }
        // The handshake and connects run on the caller's thread, never on a
        // lane, and without the table lock, so a dead peer stalls nobody else.
        let deadline = Instant::now() + timeout;
        let handshake = self.inner.metadata.resolve(name, &self.initiator(), deadline)?;
        let serves_rdma = self.inner.context.rdma.is_some();
        let transport =
            crate::transport::select::choose(transport, &handshake.descriptor, local_host_id(), serves_rdma)?;
        let link = self.open_link(transport, &handshake, deadline)?;
        self.install_segment(name, handshake.descriptor, transport, link)
    }

    /// Who this engine is to its peers.
    fn initiator(&self) -> Initiator {
        Initiator {
            name: self.inner.config.name.clone(),
            epoch: self.inner.epoch,
            addr: self.inner.control_addr.to_string(),
        }
    }

    fn open_link(
        &self,
        transport: TransportKind,
        handshake: &crate::control::Handshake,
        deadline: Instant,
    ) -> Result<Arc<dyn Link>> {
        let descriptor = &handshake.descriptor;
        Ok(match transport {
            TransportKind::Shm => Arc::new(ShmLink::open(descriptor)?),
            TransportKind::Tcp => {
                let addr = descriptor.tcp_addr.as_deref().ok_or_else(|| Error::Unsupported {
                    what: format!("tcp to {}: it serves no tcp data listener", descriptor.name),
                })?;
                let lanes = self.inner.lanes.len();
                Arc::new(TcpLink::connect(
                    &descriptor.name,
                    addr,
                    descriptor.epoch,
                    handshake.session.as_ref(),
                    lanes,
                    deadline,
                    self.inner.config.io_timeout,
                )?)
            }
            TransportKind::Null => Arc::new(NullLink),
            TransportKind::Rdma => {
                let node = self
                    .inner
                    .context
                    .rdma
                    .clone()
                    .ok_or_else(|| Error::Unsupported { what: "rdma: this engine has no RDMA device".into() })?;
                let initiator = self.initiator();
                let token = self.inner.config.token.clone();
                Arc::new(RdmaLink::connect(node, descriptor, self.inner.lanes.len(), |nics, ours| {
                    // The QPs belong to the identity this connection's
                    // handshake establishes (proven, with a token).
                    let mut client = crate::control::ControlClient::connect(&descriptor.control_addr, deadline)?;
                    client.handshake(&initiator, token.as_ref(), deadline)?;
                    client.rdma_connect(nics, ours, deadline)
                })?)
            }
        })
    }

    /// Opens this engine's own segment as a peer (loopback): useful to test
    /// a transport, or to measure kvring's own overhead with the null
    /// transport, without a second process.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let own = engine.open_self(kvring::TransportKind::Null)?;
    /// assert_eq!(own.epoch(), engine.epoch());
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn open_self(&self, transport: TransportKind) -> Result<Segment> {
        let deadline = Instant::now() + self.inner.config.control_timeout;
        let handshake = match (&self.inner.config.token, transport) {
            // A tokened tcp connection proves a handshake's session, even
            // to this engine itself.
            (Some(token), TransportKind::Tcp) => crate::control::ControlClient::connect(
                &self.inner.control_addr.to_string(),
                deadline,
            )?
            .handshake(&self.initiator(), Some(token), deadline)?,
            _ => crate::control::Handshake { descriptor: self.descriptor(), session: None },
        };
        let link = self.open_link(transport, &handshake, deadline)?;
        self.install_segment(&format!("self/{}", transport.name()), handshake.descriptor, transport, link)
    }

    fn install_segment(
        &self,
        name: &str,
        descriptor: SegmentDescriptor,
        transport: TransportKind,
        link: Arc<dyn Link>,
    ) -> Result<Segment> {
        let mut table = lock(&self.inner.segments);
        if let Some(old) = table.cache.remove(name) {
            self.retire(&mut table, &old);
        }
        let slot =
            table.free.pop().ok_or(Error::Busy { queue: "segment table", capacity: self.inner.config.max_segments })?;
        let key = ((table.generations[slot as usize] as u32) << 16) | slot as u32;
        let peer = Arc::new(PeerSegment::new(descriptor));
        for lane in &self.inner.lanes {
            lane.shared.send(LaneCommand::AttachSegment {
                key,
                segment: LaneSegment { peer: peer.clone(), link: link.clone() },
            });
        }
        let segment = Segment {
            inner: Arc::new(SegmentInner {
                key,
                owner_epoch: self.inner.epoch,
                opened_as: name.to_string(),
                initiator: self.initiator(),
                token: self.inner.config.token.clone(),
                link: link.clone(),
                peer,
                transport,
            }),
        };
        // A full cache pushes out its least recently used handle, whose
        // lanes' state is dropped now.
        for evicted in table.cache.insert(name, segment.clone()) {
            self.retire(&mut table, &evicted);
        }
        Ok(segment)
    }

    fn retire(&self, table: &mut SegmentTable, segment: &Segment) {
        segment.inner.peer.close();
        segment.inner.link.retire();
        let key = segment.inner.key;
        for lane in &self.inner.lanes {
            lane.shared.send(LaneCommand::DetachSegment { key });
        }
        let slot = key as u16;
        let generation = &mut table.generations[slot as usize];
        *generation = generation.wrapping_add(1).max(1);
        table.free.push(slot);
    }

    /// Closes a segment: new submissions to it fail; batches already queued
    /// to it fail with `UnknownSegment` if a lane reaches them after the
    /// close.
    pub fn close_segment(&self, segment: &Segment) {
        let mut table = lock(&self.inner.segments);
        let name = segment.opened_as();
        if table.cache.peek(name).is_some_and(|s| s.inner.key == segment.inner.key) {
            table.cache.remove(name);
            self.retire(&mut table, segment);
        }
    }

    /// Segment-cache counters: hits, misses, evictions, stale evictions.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let stats = engine.segment_cache_stats();
    /// println!("{} hits, {} misses, {} evicted", stats.hits, stats.misses, stats.evictions);
    /// ```
    pub fn segment_cache_stats(&self) -> CacheStats {
        lock(&self.inner.segments).cache.stats()
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

    /// Sends `message` to a peer ("request 42's blocks are in place") and
    /// waits (bounded by `timeout`) until the peer has queued it. Over tcp it
    /// travels on the data connection, after everything sent before it;
    /// over shm (no connection of its own) on the control plane. Call it
    /// after the batches it announces have ended `Done`: their bytes are
    /// then in place before the message is read.
    ///
    /// ```no_run
    /// # fn demo(engine: &kvring::Engine, decode: &kvring::Segment) -> kvring::Result<()> {
    /// engine.notify(decode, b"request 42: blocks in place", std::time::Duration::from_secs(1))?;
    /// # Ok(()) }
    /// ```
    pub fn notify(&self, segment: &Segment, message: &[u8], timeout: Duration) -> Result<()> {
        if segment.inner.owner_epoch != self.inner.epoch {
            return Err(Error::invalid("segment", "handle was opened by another engine"));
        }
        if segment.inner.peer.is_stale() {
            return Err(Error::PeerRestarted { segment: segment.name().to_string(), detail: "reopen it first".into() });
        }
        let deadline = Instant::now() + timeout;
        if segment.inner.link.carries_notifications() {
            return self.notify_on_data_path(segment, message, timeout);
        }
        segment.control_client(deadline)?.notify(&self.inner.config.name, message, deadline)
    }

    /// Hands a notification to lane 0, which queues it on its data
    /// connection to the peer behind what it has queued there.
    fn notify_on_data_path(&self, segment: &Segment, message: &[u8], timeout: Duration) -> Result<()> {
        if self.inner.is_stopped() {
            // The lanes read no more commands: fail now, not at the timeout.
            return Err(Error::Shutdown);
        }
        if message.len() > MAX_NOTIFY_BYTES {
            return Err(Error::MessageTooLarge { len: message.len() as u64, max: MAX_NOTIFY_BYTES as u64 });
        }
        let payload = crate::proto::Notification { from: self.inner.config.name.clone(), message: message.to_vec() }
            .encode_to_vec();
        let lane = self.inner.lanes.first().ok_or(Error::Shutdown)?;
        let (reply, result) = std::sync::mpsc::sync_channel(1);
        lane.shared.send(LaneCommand::Notify { key: segment.inner.key, payload, reply });
        match result.recv_timeout(timeout) {
            Ok(result) => result,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(Error::Timeout { waited: timeout }),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(Error::Shutdown),
        }
    }

    /// Publishes this engine's KV-cache layout, which peers read with
    /// [`Segment::kv_layout`] before their first transfer. Every buffer must
    /// lie inside a registered region.
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
        *lock(&self.inner.context.kv_layout) = Some(layout);
        Ok(())
    }

    /// The KV-cache layout this engine published, if any.
    pub fn kv_layout(&self) -> Option<KvLayout> {
        lock(&self.inner.context.kv_layout).clone()
    }

    /// The oldest notification peers sent this engine, if any.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// while let Some(n) = engine.poll_notification() {
    ///     println!("{} says {:?}", n.from, String::from_utf8_lossy(&n.message));
    /// }
    /// ```
    pub fn poll_notification(&self) -> Option<Notification> {
        self.inner.notifications.poll()
    }

    /// Stops the control server and the lanes (after they drain what is
    /// queued). Later calls fail with `Shutdown`.
    pub fn shutdown(&self) {
        self.inner.stop();
    }
}

/// What the control server sees of the engine (no reference back to the
/// engine itself, so dropping the engine stops the server).
struct ControlContext {
    name: String,
    epoch: u64,
    registry: Arc<Registry>,
    /// Set once, as soon as the control server has bound.
    control_addr: OnceLock<String>,
    tcp_addr: Option<String>,
    auth: Option<Arc<Authenticator>>,
    notifications: Arc<NotificationQueue>,
    kv_layout: Mutex<Option<KvLayout>>,
    rdma: Option<Arc<RdmaNode>>,
}

impl ControlContext {
    /// The engine's segment descriptor as it stands now.
    fn describe(&self) -> SegmentDescriptor {
        let regions = self
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
            })
            .collect();
        SegmentDescriptor {
            name: self.name.clone(),
            epoch: self.epoch,
            host_id: local_host_id().to_string(),
            pid: std::process::id(),
            regions,
            control_addr: self.control_addr.get().cloned().unwrap_or_default(),
            tcp_addr: self.tcp_addr.clone(),
            rdma: self.rdma.as_ref().map(|node| node.info()),
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
    ) -> Result<Vec<crate::proto::QpEndpointInfo>> {
        let node =
            self.rdma.as_ref().ok_or_else(|| Error::Unsupported { what: "rdma: this engine serves none".into() })?;
        let endpoints: Vec<_> = request.endpoints.iter().map(QpEndpoint::from_proto).collect::<Result<_>>()?;
        let ours = node.accept(initiator, request.nics as usize, &endpoints)?;
        Ok(ours.iter().map(QpEndpoint::to_proto).collect())
    }

    fn notify(&self, sender: &str, message: Vec<u8>) -> Result<()> {
        self.notifications.deliver(Notification { from: sender.to_string(), message })
    }

    fn memory_info(&self) -> Result<crate::proto::KvLayoutInfo> {
        lock(&self.kv_layout)
            .as_ref()
            .map(KvLayout::to_proto)
            .ok_or_else(|| Error::Unsupported { what: format!("{} has registered no KV-cache layout", self.name) })
    }

    fn checksum(&self, request: &ChecksumRequest) -> Result<u64> {
        let id = RegionId::from_raw(request.region);
        // The lease keeps the region registered while we read it.
        self.registry.lease(id).map_err(|_| Error::UnknownRegion { side: Side::Remote, region: id })?;
        let result = (|| {
            let entry = self.registry.leased(id)?;
            if !entry.info.access.contains(Access::REMOTE_READ) {
                return Err(Error::AccessDenied {
                    desc_index: 0,
                    side: Side::Remote,
                    region: id,
                    needs: "remote read",
                });
            }
            check_range(id, Side::Remote, 0, request.offset, request.len, entry.len as u64)?;
            // SAFETY: the range is inside a registered region (checked) that
            // the lease keeps registered; the bytes are plain integers, and a
            // transfer running concurrently only makes the sum meaningless.
            let bytes = unsafe {
                std::slice::from_raw_parts((entry.addr + request.offset as usize) as *const u8, request.len as usize)
            };
            Ok(crate::mem::checksum(bytes))
        })();
        self.registry.release(id);
        result
    }
}
