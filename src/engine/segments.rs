//! Opening peer segments: the handle cache, the handshake, the one
//! function that picks and opens a transport, and handing each lane its own
//! link to the peer.

use super::config::EngineConfig;
use super::lifecycle::lock;
use super::segment::SegmentInner;
use super::{Engine, Segment};
use crate::auth::Initiator;
use crate::control::{ControlClient, Handshake};
use crate::error::{Error, Result};
use crate::log::ratelimit::{log_limited, RateLimit};
use crate::mem::MemoryKind;
use crate::runtime::lane::LaneCommand;
use crate::segment::{local_host_id, CacheStats, PeerSegment, SegmentCache, SegmentDescriptor};
use crate::transport::cma::CmaLink;
use crate::transport::null::NullLink;
use crate::transport::rdma::link::RdmaLink;
use crate::transport::select::{Chosen, LocalReach};
use crate::transport::shm::ShmLink;
use crate::transport::tcp::TcpLink;
use crate::transport::{Link, TransportKind};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The open segment handles: the cache by name, and the key slots with
/// their generations (a key names one opening of one segment).
#[derive(Debug)]
pub(super) struct OpenSegments {
    pub cache: SegmentCache<Segment>,
    free: Vec<u16>,
    generations: Vec<u16>,
}

impl OpenSegments {
    /// Empty, with room for `config.max_segments` keys.
    pub fn new(config: &EngineConfig) -> Self {
        let slots = config.max_segments.min(1 << 16);
        Self {
            cache: SegmentCache::new(config.segment_cache_capacity.min(config.max_segments)),
            free: (0..slots as u16).rev().collect(),
            generations: vec![1; slots],
        }
    }
}

/// The lanes' acknowledgements of a broken link's detach.
#[derive(Debug)]
struct Detaching {
    lanes: usize,
    detached: std::sync::mpsc::Receiver<()>,
}

impl Detaching {
    /// Waits (bounded by [`RETIRE_WAIT`] each) until every lane has let go.
    fn wait_all(all: impl IntoIterator<Item = Detaching>) {
        for detaching in all {
            let deadline = Instant::now() + RETIRE_WAIT;
            for _ in 0..detaching.lanes {
                let left = deadline.saturating_duration_since(Instant::now());
                if detaching.detached.recv_timeout(left).is_err() {
                    break;
                }
            }
        }
    }
}

/// True for an error that says the peer is gone (then no other transport
/// would reach it either).
fn is_gone(error: &Error) -> bool {
    matches!(error, Error::PeerRestarted { .. })
}

/// Whether a same-host transport chosen by default that failed to open
/// with `error` gives way to the next in the order: cma for anything but
/// a peer gone (the kernel's refusal, the target's initiator slots); shm
/// for a cap on mappings (the peer's regions past `MAX_PEER_SHM_REGIONS`,
/// this process's past `MAX_SHM_REGIONS_MAPPED`) or a mapping the system
/// refused. Never a refusal of this engine (a token, a fence).
fn falls_back(transport: TransportKind, error: &Error) -> bool {
    match transport {
        TransportKind::Cma => !is_gone(error),
        TransportKind::Shm => matches!(error, Error::PeerLimit { .. } | Error::Busy { .. } | Error::Io { .. }),
        _ => false,
    }
}

/// Longest a retire waits for lanes to hand back a broken link's resources.
const RETIRE_WAIT: Duration = Duration::from_secs(1);

impl Engine {
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
        self.open_segment_by(name, transport, timeout, None)
    }

    /// [`open_segment_with`](Self::open_segment_with), ending by `shared`
    /// when given (the one deadline `open_many` shares among its peers,
    /// which counts a stale handle's retire too); else `timeout` starts
    /// once a stale handle is retired.
    pub(super) fn open_segment_by(
        &self,
        name: &str,
        transport: Option<TransportKind>,
        timeout: Duration,
        shared: Option<Instant>,
    ) -> Result<Segment> {
        if self.inner.is_stopped() {
            return Err(Error::Shutdown);
        }
        let mut stale = None;
        let mut detaching = None;
        {
            let mut table = lock(&self.inner.segments);
            let cached = table.cache.peek(name).cloned();
            match cached {
                Some(segment) if segment.inner.peer.is_stale() => {
                    // Its peer restarted or went away: evict it now and
                    // reconnect through a fresh handshake below.
                    table.cache.remove_stale(name);
                    stale = Some((segment.epoch(), segment.inner.link.is_broken()));
                    detaching = self.retire(&mut table, &segment);
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
        Detaching::wait_all(detaching);
        if let Some((old_epoch, broken)) = stale {
            // Outside the table lock: a log sink never holds up other opens.
            let detail = if broken { "its link broke" } else { "its peer restarted or its published entry changed" };
            tracing::warn!(
                segment = name,
                old_epoch = format_args!("{old_epoch:#x}"),
                detail,
                "stale segment handle; reconnecting"
            );
        }
        // The handshake and connects run on the caller's thread, never on a
        // lane, and without the table lock, so a dead peer stalls nobody else.
        let deadline = shared.unwrap_or_else(|| crate::deadline::deadline_after(timeout));
        let now = Instant::now();
        if now >= deadline {
            // The deadline was set `timeout` after the open began (here or
            // in `open_many`, which shares one): that much has been waited.
            let began = deadline.checked_sub(timeout).unwrap_or(deadline);
            return Err(Error::Timeout { what: "the segment's open", waited: now.saturating_duration_since(began) });
        }
        let handshake = self.inner.metadata.resolve(name, &self.initiator(), deadline)?;
        let (transport, link) = self.choose_and_open(transport, &handshake, deadline)?;
        self.install_segment(name, handshake.descriptor, transport, link, stale.map(|(epoch, _)| epoch))
    }

    /// Chooses the transport and opens it. A cma chosen by default that
    /// does not open (the kernel refuses it, the target's initiator slots
    /// are full) is reported with the reason, and the next transport in the
    /// order is taken, within the engine's allow-list; asked for, its
    /// failure is the caller's error. A link that is not the order's first
    /// choice says so, once, in the log.
    fn choose_and_open(
        &self,
        requested: Option<TransportKind>,
        handshake: &Handshake,
        deadline: Instant,
    ) -> Result<(TransportKind, Link)> {
        let peer = &handshake.descriptor;
        let chosen = self.choose_transport(requested, peer, self.inner.config.cma)?;
        let mut transport = chosen.kind;
        // Same-host transports chosen by default that did not open, each
        // with why: the next choice excludes them.
        let mut failed: Vec<(TransportKind, Error)> = Vec::new();
        loop {
            match self.open_link(transport, handshake, deadline) {
                Err(error) if requested.is_none() && falls_back(transport, &error) => {
                    failed.push((transport, error));
                    let Some(next) = self.choose_excluding(peer, &failed)? else {
                        // The same link again: the caller gets its error.
                        return Err(failed.pop().map(|(_, error)| error).expect("pushed above"));
                    };
                    transport = next.kind;
                }
                opened => {
                    let link = opened?;
                    if !failed.is_empty() {
                        // One line per open, naming every transport that
                        // did not open and why (`review10_fallback`).
                        let why = failed.iter().map(|(k, error)| format!("{}: {error}", k.name()));
                        let why = why.collect::<Vec<_>>().join("; ");
                        static LIMIT: RateLimit = RateLimit::per_second();
                        log_limited!(warn, LIMIT, segment = %peer.name, transport = transport.name(), failed = %why, "the transports chosen did not open; took the next one");
                    } else if !chosen.passed_over.is_empty() {
                        let why = chosen.passed_over.iter().map(|(k, why)| format!("{}: {why}", k.name()));
                        let why = why.collect::<Vec<_>>().join("; ");
                        static LIMIT: RateLimit = RateLimit::per_second();
                        log_limited!(info, LIMIT, segment = %peer.name, transport = transport.name(), why = %why, "link is not the transport order's first choice");
                    }
                    return Ok((transport, link));
                }
            }
        }
    }

    /// The order's choice for `peer` once the transports in `failed` did
    /// not open (cma refused by the kernel or the target's slots; shm past
    /// a cap on mappings): within the allow-list, each failed one named in
    /// the refusal with the error of its open.
    fn choose_excluding(&self, peer: &SegmentDescriptor, failed: &[(TransportKind, Error)]) -> Result<Option<Chosen>> {
        let excluded = |kind: TransportKind| failed.iter().any(|(k, _)| *k == kind);
        let without_shm;
        let peer = match excluded(TransportKind::Shm) {
            true => {
                let mut copy = peer.clone();
                copy.regions.iter_mut().for_each(|region| region.shm_path = None);
                without_shm = copy;
                &without_shm
            }
            false => peer,
        };
        let chosen = self.choose_transport(None, peer, self.inner.config.cma && !excluded(TransportKind::Cma));
        match chosen {
            // The same link again (shm's also carries cuda_ipc): none.
            Ok(next)
                if excluded(next.kind) || (excluded(TransportKind::Shm) && next.kind == TransportKind::CudaIpc) =>
            {
                Ok(None)
            }
            Ok(next) => Ok(Some(next)),
            // The allow-list left nothing after them: their reasons are the
            // opens that failed, not the reach computed without them.
            Err(Error::TransportRefused { peer, allowed, mut offered, mut reasons }) => {
                for (kind, error) in failed {
                    offered.retain(|k| *k != kind.name());
                    let why = format!("{} to {peer} did not open: {error}", kind.name());
                    match reasons.iter_mut().find(|(k, _)| *k == kind.name()) {
                        Some((_, reason)) => *reason = why,
                        None => reasons.push((kind.name(), why)),
                    }
                }
                Err(Error::TransportRefused { peer, allowed, offered, reasons })
            }
            // Nothing else reaches the peer: the caller gets the failed
            // open's error, not a reach computed without it.
            Err(_) => Ok(None),
        }
    }

    /// The transport to `peer`: the one documented order
    /// (`transport::select::choose_allowed`) given what this engine brings
    /// and the transports it allows.
    fn choose_transport(
        &self,
        requested: Option<TransportKind>,
        peer: &SegmentDescriptor,
        cma: bool,
    ) -> Result<Chosen> {
        let unreachable = self.inner.context.rdma.as_ref().and_then(|node| node.any_unreachable());
        let local = LocalReach {
            host_id: local_host_id(),
            rdma: self.inner.context.rdma.is_some(),
            gpu: self.gpu().is_some(),
            device_regions: self.inner.registry.snapshot().iter().any(|(_, e)| e.info.memory != MemoryKind::Host),
            cma,
            rdma_unreachable: unreachable.as_deref(),
        };
        crate::transport::select::choose_allowed(requested, peer, &local, &self.inner.config.transports)
    }

    /// Who this engine is to its peers.
    pub(super) fn initiator(&self) -> Initiator {
        Initiator {
            name: self.inner.config.name.clone(),
            epoch: self.inner.epoch,
            addr: self.inner.control_addr.to_string(),
        }
    }

    /// The one place a transport is opened: the link to `handshake`'s peer
    /// over `transport`, one lane link per lane.
    fn open_link(&self, transport: TransportKind, handshake: &Handshake, deadline: Instant) -> Result<Link> {
        let descriptor = &handshake.descriptor;
        let lanes = self.inner.lanes.len();
        match transport {
            // One same-host link for both: with a GPU provider it also
            // opens the peer's device regions and moves GPU memory.
            TransportKind::Shm | TransportKind::CudaIpc => {
                let counters: Vec<_> = self.inner.lanes.iter().map(|l| l.shared.metrics.gpu_copies()).collect();
                let session = handshake.session.as_ref();
                // shm where cuda_ipc is not allowed: the peer's GPU memory
                // (opened by cuda_ipc's handles) stays out of reach.
                let allowed = &self.inner.config.transports;
                let host_only;
                let descriptor = match transport == TransportKind::Shm
                    && !allowed.is_empty()
                    && !allowed.contains(&TransportKind::CudaIpc)
                {
                    true => {
                        let mut only = descriptor.clone();
                        only.regions.retain(|r| r.memory == MemoryKind::Host);
                        host_only = only;
                        &host_only
                    }
                    false => descriptor,
                };
                ShmLink::open(descriptor, &counters, transport, self.gpu().cloned(), session, deadline)
            }
            TransportKind::Null => Ok(NullLink::open(lanes)),
            TransportKind::Cma => CmaLink::open(descriptor, lanes),
            TransportKind::Tcp => {
                let addr = descriptor.tcp_addr.as_deref().ok_or_else(|| Error::Unsupported {
                    what: format!("tcp to {}: it serves no tcp data listener", descriptor.name),
                })?;
                // Each lane's link stages its GPU blocks through pages of its
                // own, made at its first staged chunk.
                let stagers = self
                    .inner
                    .lanes
                    .iter()
                    .map(|lane| {
                        let (copies, staging) = (lane.shared.metrics.gpu_copies(), lane.shared.metrics.staging());
                        self.gpu().map(|gpu| crate::transport::tcp::staged::Stager::new(gpu.clone(), copies, staging))
                    })
                    .collect();
                TcpLink::connect(
                    &descriptor.name,
                    addr,
                    descriptor.epoch,
                    handshake.session.as_ref(),
                    stagers,
                    deadline,
                    self.inner.config.io_timeout,
                )
            }
            TransportKind::Rdma => {
                let node = self
                    .inner
                    .context
                    .rdma
                    .clone()
                    .ok_or_else(|| Error::Unsupported { what: "rdma: this engine has no RDMA device".into() })?;
                let initiator = self.initiator();
                let token = self.inner.config.token.clone();
                // Checksummed chunks are verified by asking the peer for
                // CRC32Cs on the control plane, as the same identity.
                let verify = super::crc32c::verify_peer(
                    descriptor.control_addr.clone(),
                    initiator.clone(),
                    token.clone(),
                    self.inner.config.control_timeout,
                );
                let exchange = |nics, ours: &[_], push_key: &[u8]| {
                    // The QPs belong to the identity this connection's
                    // handshake establishes (proven, with a token).
                    let mut client = ControlClient::connect(&descriptor.control_addr, deadline)?;
                    client.handshake(&initiator, token.as_ref(), deadline)?;
                    client.rdma_connect(nics, ours, push_key, deadline)
                };
                RdmaLink::connect(node, descriptor, lanes, exchange, Some(verify))
            }
        }
    }

    /// Opens this engine's own segment as a peer (loopback): useful to test
    /// a transport, or to measure kvring's own overhead with the null
    /// transport, without a second process. A transport outside the
    /// engine's allow-list is refused, as for any peer.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let own = engine.open_self(kvring::TransportKind::Null)?;
    /// assert_eq!(own.epoch(), engine.epoch());
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn open_self(&self, transport: TransportKind) -> Result<Segment> {
        let allowed = &self.inner.config.transports;
        if !allowed.is_empty() && !allowed.contains(&transport) {
            return Err(Error::TransportRefused {
                peer: self.inner.config.name.clone(),
                allowed: allowed.iter().map(|kind| kind.name()).collect(),
                offered: vec![transport.name()],
                reasons: vec![(transport.name(), "it was asked for, and is not in this engine's transports".into())],
            });
        }
        let deadline = crate::deadline::deadline_after(self.inner.config.control_timeout);
        let handshake = match (&self.inner.config.token, transport) {
            // A tokened tcp connection proves a handshake's session, even
            // to this engine itself.
            (Some(token), TransportKind::Tcp) => ControlClient::connect(
                &self.inner.control_addr.to_string(),
                deadline,
            )?
            .handshake(&self.initiator(), Some(token), deadline)?,
            _ => Handshake { descriptor: self.descriptor(), session: None },
        };
        let link = self.open_link(transport, &handshake, deadline)?;
        self.install_segment(&format!("self/{}", transport.name()), handshake.descriptor, transport, link, None)
    }

    /// Hands each lane its link and caches the handle; `replaced` is the
    /// epoch of a stale handle of this name already retired.
    fn install_segment(
        &self,
        name: &str,
        descriptor: SegmentDescriptor,
        transport: TransportKind,
        link: Link,
        mut replaced: Option<u64>,
    ) -> Result<Segment> {
        let epoch = descriptor.epoch;
        let mut table = lock(&self.inner.segments);
        let mut detaching = Vec::new();
        if let Some(old) = table.cache.remove(name) {
            replaced = Some(old.epoch());
            detaching.extend(self.retire(&mut table, &old));
        }
        let Some(slot) = table.free.pop() else {
            drop(table);
            Detaching::wait_all(detaching);
            return Err(Error::Busy { queue: "segment table", capacity: self.inner.config.max_segments });
        };
        let key = ((table.generations[slot as usize] as u32) << 16) | slot as u32;
        let peer = Arc::new(PeerSegment::new(descriptor));
        let Link { state, lanes } = link;
        for (lane, link) in self.inner.lanes.iter().zip(lanes) {
            lane.shared.send(LaneCommand::AttachSegment { key, peer: peer.clone(), state: state.clone(), link });
        }
        let segment = Segment {
            inner: Arc::new(SegmentInner {
                key,
                owner_epoch: self.inner.epoch,
                opened_as: name.to_string(),
                initiator: self.initiator(),
                token: self.inner.config.token.clone(),
                link: state,
                peer,
                transport,
                kv_layout: std::sync::OnceLock::new(),
            }),
        };
        // A full cache pushes out its least recently used handle, whose
        // lanes' links are dropped now.
        let evicted = table.cache.insert(name, segment.clone());
        for old in &evicted {
            detaching.extend(self.retire(&mut table, old));
        }
        drop(table);
        Detaching::wait_all(detaching);
        let transport = transport.name();
        match replaced {
            Some(old) => tracing::info!(
                segment = name,
                epoch = format_args!("{epoch:#x}"),
                old_epoch = format_args!("{old:#x}"),
                transport,
                "segment reopened"
            ),
            None => tracing::debug!(segment = name, epoch = format_args!("{epoch:#x}"), transport, "segment opened"),
        }
        for old in &evicted {
            tracing::debug!(
                segment = old.opened_as(),
                epoch = format_args!("{:#x}", old.epoch()),
                "segment evicted (least recently used)"
            );
        }
        Ok(segment)
    }

    /// Takes a handle out of service: its slot's generation moves on, and
    /// every lane lets go of its link. For a broken link the caller gets a
    /// [`Detaching`] to wait on once it has let go of the table lock, so
    /// what the lanes hand back (RDMA QPs, reset) is there for the
    /// reconnect that usually follows at once.
    #[must_use = "wait on a broken link's detach after releasing the table lock"]
    fn retire(&self, table: &mut OpenSegments, segment: &Segment) -> Option<Detaching> {
        segment.inner.peer.close();
        let key = segment.inner.key;
        let wait = segment.inner.link.is_broken() && !self.inner.is_stopped();
        let (done, detached) = std::sync::mpsc::sync_channel(self.inner.lanes.len());
        for lane in &self.inner.lanes {
            lane.shared.send(LaneCommand::DetachSegment { key, done: wait.then(|| done.clone()) });
        }
        let slot = key as u16;
        let generation = &mut table.generations[slot as usize];
        *generation = generation.wrapping_add(1).max(1);
        table.free.push(slot);
        wait.then(|| Detaching { lanes: self.inner.lanes.len(), detached })
    }

    /// Closes a segment: new submissions to it fail; batches already queued
    /// to it fail with `UnknownSegment` if a lane reaches them after the
    /// close.
    pub fn close_segment(&self, segment: &Segment) {
        let mut table = lock(&self.inner.segments);
        let name = segment.opened_as();
        if table.cache.peek(name).is_some_and(|s| s.inner.key == segment.inner.key) {
            table.cache.remove(name);
            let detaching = self.retire(&mut table, segment);
            drop(table);
            Detaching::wait_all(detaching);
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
}
