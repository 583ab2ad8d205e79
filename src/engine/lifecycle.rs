//! An engine's life: what it holds, how it starts (checks, lanes,
//! servers, publication, threads) and how it stops.

use super::config::{lane_cores, EngineConfig, MAX_RDMA_NICS};
use super::control::ControlContext;
use super::segments::OpenSegments;
use super::submitter::MAX_LANES;
use super::{metadata, metrics, reaper, Engine};
use crate::auth::{Authenticator, Token};
use crate::control::ControlServer;
use crate::error::{Error, Result};
use crate::mem::Registry;
use crate::metadata::{MetadataStore, PeerHandshake};
use crate::notify::NotificationQueue;
use crate::runtime::clock::Clock;
use crate::runtime::lane::{LaneConfig, LaneHandle};
use crate::transport::cma::sys::{dumpable, opt_in_to_ptrace, Yama};
use crate::transport::cma::CmaExport;
use crate::transport::rdma::node::RdmaNode;
use crate::transport::tcp::TcpDataServer;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

pub(crate) struct EngineInner {
    pub(crate) config: EngineConfig,
    pub(crate) epoch: u64,
    pub(crate) registry: Arc<Registry>,
    pub(crate) lanes: Vec<LaneHandle>,
    pub(crate) clock: Clock,
    pub(super) segments: Mutex<OpenSegments>,
    pub(super) control: Mutex<Option<ControlServer>>,
    pub(super) context: Arc<ControlContext>,
    pub(super) data: Mutex<Option<TcpDataServer>>,
    pub(super) notifications: Arc<NotificationQueue>,
    /// Bytes of tagged pushes landed here, by tag.
    pub(super) arrivals: Arc<crate::arrival::Arrivals>,
    pub(super) control_addr: SocketAddr,
    pub(super) metadata: Box<dyn MetadataStore>,
    /// The metadata server's client (etcd, redis, HTTP), if there is one.
    pub(super) directory: Option<Arc<dyn crate::metadata::directory::Directory>>,
    pub(super) publication: Mutex<Option<crate::metadata::directory::Publication>>,
    pub(super) metrics_on: Arc<AtomicBool>,
    pub(super) metrics_server: Mutex<Option<crate::net::Acceptor>>,
    pub(super) metrics_addr: OnceLock<SocketAddr>,
    pub(super) advertised: crate::advertise::Advertised,
    pub(super) stopped: AtomicBool,
    pub(super) next_tag: AtomicU16,
    /// The GPU provider, found at the first registration.
    pub(super) gpu: OnceLock<Option<Arc<dyn crate::gpu::Gpu>>>,
    /// Caller-registered host regions pinned with the GPU provider.
    pub(super) pins: super::pins::HostPins,
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

    pub(super) fn stop(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        // First: peers resolving this name stop finding it.
        if let Some(mut publication) = lock(&self.publication).take() {
            publication.stop();
        }
        // No same-host peer starts another cma call, and those in progress
        // end before the caller may free what it registered.
        if let Ok(cma) = &self.context.cma {
            cma.close();
        }
        if let Some(mut server) = lock(&self.control).take() {
            server.stop();
        }
        self.context.stop_gpu_fds();
        if let Some(mut server) = lock(&self.metrics_server).take() {
            server.stop();
        }
        if let Some(mut server) = lock(&self.data).take() {
            server.stop();
        }
        for lane in &self.lanes {
            lane.shared.stop();
        }
        tracing::info!(name = %self.config.name, epoch = format_args!("{:#x}", self.epoch), "engine stopped");
    }
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        self.stop();
        // A peer's sum still running (the control server's stop waits for
        // it only a while) reads registered memory the caller may free once
        // this returns: none starts now, and those running end first.
        self.context.sums.close_and_wait();
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

pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
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

impl Engine {
    /// Starts an engine: checks the configuration and the host's limits,
    /// starts the lanes, the data and control servers, the metadata
    /// publication and the engine's own threads.
    pub(super) fn start(config: EngineConfig) -> Result<Self> {
        check(&config)?;
        crate::mem::shm::sweep_stale();
        let epoch = random_epoch();
        let registry = Arc::new(Registry::new(config.max_regions));
        let clock = Clock::new();
        let fd_limit = crate::net::raise_fd_limit();
        let admission = config.admission.capped(crate::net::fd_budget(fd_limit));
        let notifications = Arc::new(NotificationQueue::new(config.notify_quota));
        let arrivals = Arc::new(crate::arrival::Arrivals::new());
        let metrics_on = Arc::new(AtomicBool::new(config.metrics_enabled));
        let lanes = start_lanes(&config, &registry, clock, &notifications, &metrics_on)?;
        let advertised =
            crate::advertise::for_process(config.advertise, config.listen.ip(), config.metadata.server_addr())?;
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
            let target = super::serving::Target {
                registry: registry.clone(),
                notifications: notifications.clone(),
                arrivals: arrivals.clone(),
                epoch,
                auth: authenticator.clone(),
            };
            Some(super::serving::serve_tcp(data_listen, &lanes, target, admission)?)
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
            kv_layout: OnceLock::new(),
            memory_info_served: AtomicU64::new(0),
            rdma: open_rdma(&config)?,
            gpudirect: Mutex::new(Default::default()),
            cma: cma_export(&config, epoch),
            gpu_fds: Mutex::new(None),
            connect_wait: config.control_timeout,
            sums: Default::default(),
            fence_pushers: super::fence_pushers::FencePushers::new(config.token.clone()),
        });
        let server = ControlServer::start(config.listen, context.clone(), admission)?;
        // Peers are told the advertised IP with the port actually bound.
        let control_addr = SocketAddr::new(advertised.ip, server.local_addr().port());
        // Set before any peer can learn the address, so every handshake sees it.
        let _ = context.control_addr.set(control_addr.to_string());
        let handshake = PeerHandshake { token: config.token.clone() };
        let (store, directory) = metadata::open_store(&config.metadata, handshake);
        let publication = match &directory {
            Some(directory) => Some(metadata::publish(
                directory.clone(),
                &metadata::publishable(context.describe(), config.token.is_some()),
                config.metadata_ttl,
                crate::deadline::deadline_after(config.control_timeout),
            )?),
            None => None,
        };
        let engine = Self {
            inner: Arc::new(EngineInner {
                segments: Mutex::new(OpenSegments::new(&config)),
                config,
                epoch,
                registry,
                lanes,
                clock,
                control: Mutex::new(Some(server)),
                context,
                data: Mutex::new(data_server),
                notifications,
                arrivals,
                control_addr,
                metadata: store,
                directory,
                publication: Mutex::new(publication),
                metrics_on,
                metrics_server: Mutex::new(None),
                metrics_addr: OnceLock::new(),
                advertised,
                stopped: AtomicBool::new(false),
                next_tag: AtomicU16::new(1),
                gpu: OnceLock::new(),
                pins: Default::default(),
            }),
        };
        engine.start_threads()?;
        engine.announce();
        Ok(engine)
    }

    /// One line that says what this engine is and how peers reach it.
    fn announce(&self) {
        let inner = &self.inner;
        let config = &inner.config;
        tracing::info!(
            name = %config.name,
            epoch = format_args!("{:#x}", inner.epoch),
            control = %inner.control_addr,
            tcp = inner.context.tcp_addr.as_deref().unwrap_or("none"),
            advertised_ip = %inner.advertised.ip,
            advertised_from = %inner.advertised.source,
            lanes = inner.lanes.len(),
            metadata = %config.metadata,
            token = config.token.is_some(),
            "engine started"
        );
    }

    /// The engine's own threads: the metadata watcher (etcd), the RDMA
    /// reaper (and lane 0's RDMA receiver), the `/metrics` server.
    fn start_threads(&self) -> Result<()> {
        let inner = &self.inner;
        if inner.directory.is_some() {
            metadata::start_watcher(Arc::downgrade(inner), inner.config.metadata_poll)?;
        }
        if let Some(node) = &inner.context.rdma {
            reaper::start(Arc::downgrade(inner), inner.config.rdma_probe_interval)?;
            // Port and device faults fail the links on that NIC at once.
            node.start_events()?;
            // Lane 0 counts what WRITE_WITH_IMMs land here (per-layer
            // arrival); receives that complete before it adopts the receiver
            // wait on their CQ.
            if let Some(lane) = inner.lanes.first() {
                let receiver = node.receiver(inner.arrivals.clone());
                lane.shared.send(crate::runtime::lane::LaneCommand::Receive(Box::new(receiver)));
            }
        }
        if let Some(listen) = inner.config.metrics_listen {
            let server = metrics::serve(listen, Arc::downgrade(inner))?;
            let _ = inner.metrics_addr.set(server.local_addr());
            *lock(&inner.metrics_server) = Some(server);
        }
        Ok(())
    }
}

/// The engine's RDMA node, when it was given a verbs provider.
fn open_rdma(config: &EngineConfig) -> Result<Option<Arc<RdmaNode>>> {
    let Some(verbs) = &config.rdma else { return Ok(None) };
    let node = RdmaNode::open(verbs.clone(), &config.rdma_devices, MAX_RDMA_NICS, config.rdma_gid_index)?;
    Ok(Some(Arc::new(node)))
}

/// Refuses a configuration that can never start. (Lanes lock no memory:
/// RDMA registrations and pinned host regions are checked against the
/// locked-memory limit when they are made.)
fn check(config: &EngineConfig) -> Result<()> {
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
    if config.token.as_ref().is_some_and(Token::is_empty) {
        return Err(Error::invalid("token", "an empty token protects nothing; give one or none"));
    }
    Ok(())
}

/// The engine's cma page, or why same-host peers may not reach its memory
/// by cross-memory attach (said in its descriptor, so they take the next
/// transport and can tell their user why).
fn cma_export(config: &EngineConfig, epoch: u64) -> std::result::Result<Arc<CmaExport>, String> {
    if !config.cma {
        return Err("cross-memory attach is turned off on that engine (cma = off)".into());
    }
    let yama = Yama::current();
    match yama {
        Yama::Never => return Err(yama.explain().into()),
        Yama::OptIn => match opt_in_to_ptrace(yama) {
            Ok(_) => tracing::info!(
                "cma: kernel.yama.ptrace_scope is 1; this process allowed processes of its user to attach \
                 (PR_SET_PTRACER_ANY) so same-host peers reach its registered memory"
            ),
            Err(error) => return Err(format!("PR_SET_PTRACER failed ({error}); {}", yama.explain())),
        },
        Yama::CapOnly => tracing::info!("cma: {}; other peers take the next transport", yama.explain()),
        Yama::Open => {}
    }
    if !dumpable() {
        tracing::info!("cma: this process is not dumpable: only peers with CAP_SYS_PTRACE can reach it");
    }
    let capacity = config.max_regions.clamp(1, u16::MAX as usize);
    CmaExport::create(epoch, capacity).map(Arc::new).map_err(|error| {
        tracing::warn!(%error, "cma: could not create the shared page; same-host peers take the next transport");
        format!("its cma page could not be created: {error}")
    })
}

/// Starts the lanes, each pinned to its core; lane 0 posts notification
/// CQEs and is woken by every delivery.
fn start_lanes(
    config: &EngineConfig,
    registry: &Arc<Registry>,
    clock: Clock,
    notifications: &Arc<NotificationQueue>,
    metrics_on: &Arc<AtomicBool>,
) -> Result<Vec<LaneHandle>> {
    let mut lanes = Vec::with_capacity(config.lanes);
    for (index, core) in lane_cores(config).into_iter().enumerate() {
        let lane_config = LaneConfig {
            index,
            core,
            busy_poll: config.busy_poll,
            park_timeout: config.park_timeout,
            max_segments: config.max_segments,
            clock,
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
    Ok(lanes)
}
