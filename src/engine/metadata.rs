//! The engine's side of cluster metadata: choosing the store, publishing
//! this engine's descriptor, and noticing peers that restarted.
//!
//! With a metadata server (etcd, redis, Mooncake's HTTP server), a watcher
//! thread re-reads the published entry of every open segment at a bounded
//! interval (`metadata_poll`) and marks a handle stale when its entry is
//! gone (lease or TTL expired) or carries another epoch, so the next
//! `open_segment(name)` reconnects before a transfer fails on it. The lanes
//! never touch metadata.

use super::{lock, EngineInner};
use crate::error::{Error, Result};
use crate::log::ratelimit::{log_limited, RateLimit};
use crate::metadata::directory::{Directory, DirectoryStore, Publication};
use crate::metadata::etcd::Etcd;
use crate::metadata::mooncake_http::HttpMetadata;
use crate::metadata::redis::Redis;
use crate::metadata::{MetadataMode, MetadataStore, PeerHandshake};
use crate::segment::SegmentDescriptor;
use prost::Message as _;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// The store an engine resolves names with, and its metadata server's
/// client if any.
pub(crate) type OpenedStore = (Box<dyn MetadataStore>, Option<Arc<dyn Directory>>);

/// The store an engine resolves names with, and the server's client if any.
pub(crate) fn open_store(mode: &MetadataMode, handshake: PeerHandshake) -> OpenedStore {
    let directory: Arc<dyn Directory> = match mode {
        MetadataMode::PeerHandshake => return (Box::new(handshake), None),
        MetadataMode::Etcd(url) => Arc::new(Etcd::new(url.clone())),
        MetadataMode::Redis(url) => Arc::new(Redis::new(url.clone())),
        MetadataMode::Http(url) => Arc::new(HttpMetadata::new(url.clone())),
    };
    (Box::new(DirectoryStore::new(directory.clone(), handshake)), Some(directory))
}

/// What an engine publishes in a metadata store. With a token, only what
/// an outsider may know: its name, control address and epoch (a peer gets
/// the rest, its regions, data endpoints, pid, host, cma page and RDMA keys,
/// from the handshake, after both proofs and sealed by the session). Without
/// one, the whole descriptor: any reader could ask the engine for it anyway.
pub(crate) fn publishable(descriptor: SegmentDescriptor, tokened: bool) -> SegmentDescriptor {
    if !tokened {
        return descriptor;
    }
    SegmentDescriptor {
        name: descriptor.name,
        epoch: descriptor.epoch,
        host_id: String::new(),
        pid: 0,
        instance: 0,
        gpu_fds: None,
        regions: Vec::new(),
        control_addr: descriptor.control_addr,
        tcp_addr: None,
        rdma: None,
        cma: None,
    }
}

/// Publishes `descriptor` under its name, kept there until the publication
/// is dropped. Refuses to publish a loopback address to a metadata server
/// that is not on this host: peers elsewhere could never reach it.
pub(crate) fn publish(
    directory: Arc<dyn Directory>,
    descriptor: &SegmentDescriptor,
    ttl: Duration,
    deadline: Instant,
) -> Result<Publication> {
    let advertised: SocketAddr = descriptor
        .control_addr
        .parse()
        .map_err(|_| Error::invalid("control address", format!("{:?} is not ip:port", descriptor.control_addr)))?;
    if advertised.ip().is_loopback() && !is_on_this_host(directory.addr()) {
        return Err(Error::invalid(
            "advertised address",
            format!(
                "{} is a loopback address, but {} is not on this host: peers could not reach it; \
                 listen on a routable address or set an advertised one",
                advertised,
                directory.describe()
            ),
        ));
    }
    if advertised.ip().is_unspecified() {
        return Err(Error::invalid(
            "advertised address",
            format!("{advertised} is unspecified; an engine must publish a concrete address"),
        ));
    }
    let key = directory.key(&descriptor.name);
    // Its own client: refreshes are not counted as the opens' calls.
    Publication::start(directory.fresh(), key, descriptor.to_proto().encode_to_vec(), ttl, deadline)
}

/// True when `addr` (`host:port`) resolves to an address of this host.
pub(crate) fn is_on_this_host(addr: &str) -> bool {
    let Ok(mut resolved) = addr.to_socket_addrs() else { return false };
    resolved.any(|a| is_local_ip(a.ip()))
}

/// Loopback, or an address a socket on this host can bind.
pub(crate) fn is_local_ip(ip: IpAddr) -> bool {
    ip.is_loopback() || UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Starts the thread that notices restarted peers (with a metadata server).
pub(crate) fn start_watcher(engine: Weak<EngineInner>, poll: Duration) -> Result<()> {
    std::thread::Builder::new()
        .name("kvring-metadata-watch".into())
        .spawn(move || {
            let mut next = crate::deadline::deadline_after(poll);
            let mut reach = Reach::default();
            loop {
                std::thread::sleep(Duration::from_millis(20).min(poll));
                let Some(engine) = engine.upgrade() else { return };
                if engine.is_stopped() {
                    return;
                }
                if Instant::now() >= next {
                    next = crate::deadline::deadline_after(poll);
                    if let Some(result) = check_open_segments(&engine) {
                        reach.note(&engine, result);
                    }
                }
            }
        })
        .map(drop)
        .map_err(|e| Error::io("spawning the metadata watcher", e))
}

/// Whether the watcher's last read reached the server, so that losing it and
/// regaining it are each logged once, not every poll.
#[derive(Debug, Default)]
struct Reach {
    /// Reads that failed since the last success.
    failures: u64,
}

impl Reach {
    fn note(&mut self, engine: &EngineInner, result: Result<()>) {
        let server = engine.directory.as_ref().map(|d| d.describe()).unwrap_or_default();
        match result {
            Ok(()) if self.failures > 0 => {
                tracing::info!(%server, failures = self.failures, "metadata store reachable again");
                self.failures = 0;
            }
            Ok(()) => {}
            Err(error) => {
                self.failures += 1;
                // Bounded even if it flaps at every poll.
                static LIMIT: RateLimit = RateLimit::per_second();
                if self.failures == 1 {
                    log_limited!(warn, LIMIT, %server, %error, "metadata store unreachable; open segments keep transferring");
                }
            }
        }
    }
}

/// Marks stale every open handle whose published entry is gone or names
/// another epoch. An unreachable etcd changes nothing: open segments keep
/// transferring. `None` when no segment was open to check, else whether
/// the server answered.
fn check_open_segments(engine: &EngineInner) -> Option<Result<()>> {
    let directory = engine.directory.as_ref()?;
    let open: Vec<_> = {
        let table = lock(&engine.segments);
        table
            .cache
            .entries()
            .filter(|(_, s)| !s.inner.peer.is_stale() && !s.is_closed())
            .map(|(name, s)| (name.to_string(), s.clone()))
            .collect()
    };
    // Its own client: the watcher's reads are not counted as the opens' calls.
    let store = DirectoryStore::new(directory.fresh(), PeerHandshake::default());
    let mut reached = None;
    for (name, segment) in open {
        let deadline = crate::deadline::deadline_after(engine.config.control_timeout);
        let detail = match store.published(&name, deadline) {
            Ok(published) if published.epoch == segment.epoch() => None,
            Ok(published) => Some(format!("its published epoch is now {:#x}", published.epoch)),
            Err(Error::UnknownSegment { .. }) => Some("its published entry is gone".to_string()),
            Err(error) => {
                // One answer anywhere says the server is reachable.
                reached.get_or_insert(Err(error));
                continue;
            }
        };
        reached = Some(Ok(()));
        if let Some(detail) = detail {
            segment.inner.peer.mark_stale();
            let old_epoch = segment.epoch();
            tracing::warn!(segment = %name, old_epoch = format_args!("{old_epoch:#x}"), %detail, "peer restart detected");
        }
    }
    reached
}
