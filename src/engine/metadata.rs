//! The engine's side of cluster metadata: choosing the store, publishing
//! this engine's descriptor, and noticing peers that restarted.
//!
//! With etcd, a watcher thread re-reads the published entry of every open
//! segment at a bounded interval (`metadata_poll`) and marks a handle stale
//! when its entry is gone (lease expired) or carries another epoch, so the
//! next `open_segment(name)` reconnects before a transfer fails on it.
//! The lanes never touch metadata.

use super::{lock, EngineInner};
use crate::error::{Error, Result};
use crate::log::ratelimit::{log_limited, RateLimit};
use crate::metadata::etcd::{Etcd, EtcdStore, Publication};
use crate::metadata::{MetadataMode, MetadataStore, PeerHandshake};
use crate::segment::SegmentDescriptor;
use prost::Message as _;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// The store an engine resolves names with, and its etcd client if any.
pub(crate) type OpenedStore = (Box<dyn MetadataStore>, Option<Arc<Etcd>>);

/// The store an engine resolves names with, and the etcd client if any.
pub(crate) fn open_store(mode: &MetadataMode, handshake: PeerHandshake) -> OpenedStore {
    match mode {
        MetadataMode::PeerHandshake => (Box::new(handshake), None),
        MetadataMode::Etcd(url) => {
            let etcd = Arc::new(Etcd::new(url.clone()));
            (Box::new(EtcdStore::new(etcd.clone(), handshake)), Some(etcd))
        }
    }
}

/// Publishes `descriptor` under its name with a lease kept alive until the
/// publication is dropped. Refuses to publish a loopback address to an etcd
/// that is not on this host: peers elsewhere could never reach it.
pub(crate) fn publish(
    etcd: Arc<Etcd>,
    descriptor: &SegmentDescriptor,
    ttl: Duration,
    deadline: Instant,
) -> Result<Publication> {
    let advertised: SocketAddr = descriptor
        .control_addr
        .parse()
        .map_err(|_| Error::invalid("control address", format!("{:?} is not ip:port", descriptor.control_addr)))?;
    if advertised.ip().is_loopback() && !is_on_this_host(&etcd.url().addr) {
        return Err(Error::invalid(
            "advertised address",
            format!(
                "{} is a loopback address, but etcd at {} is not on this host: peers could not reach it; \
                 listen on a routable address or set an advertised one",
                advertised,
                etcd.url().addr
            ),
        ));
    }
    if advertised.ip().is_unspecified() {
        return Err(Error::invalid(
            "advertised address",
            format!("{advertised} is unspecified; an engine must publish a concrete address"),
        ));
    }
    let key = etcd.url().key(&descriptor.name);
    // Its own client: lease refreshes are not counted as the opens' calls.
    let own = Arc::new(Etcd::new(etcd.url().clone()));
    Publication::start(own, key, descriptor.to_proto().encode_to_vec(), ttl, deadline)
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

/// Starts the thread that notices restarted peers (etcd only).
pub(crate) fn start_watcher(engine: Weak<EngineInner>, poll: Duration) -> Result<()> {
    std::thread::Builder::new()
        .name("kvring-metadata-watch".into())
        .spawn(move || {
            let mut next = Instant::now() + poll;
            let mut reach = Reach::default();
            loop {
                std::thread::sleep(Duration::from_millis(20).min(poll));
                let Some(engine) = engine.upgrade() else { return };
                if engine.is_stopped() {
                    return;
                }
                if Instant::now() >= next {
                    next = Instant::now() + poll;
                    if let Some(result) = check_open_segments(&engine) {
                        reach.note(&engine, result);
                    }
                }
            }
        })
        .map(drop)
        .map_err(|e| Error::io("spawning the metadata watcher", e))
}

/// Whether the watcher's last read reached etcd, so that losing it and
/// regaining it are each logged once, not every poll.
#[derive(Debug, Default)]
struct Reach {
    /// Reads that failed since the last success.
    failures: u64,
}

impl Reach {
    fn note(&mut self, engine: &EngineInner, result: Result<()>) {
        let etcd = engine.etcd.as_ref().map(|e| e.url().addr.clone()).unwrap_or_default();
        match result {
            Ok(()) if self.failures > 0 => {
                tracing::info!(%etcd, failures = self.failures, "metadata store reachable again");
                self.failures = 0;
            }
            Ok(()) => {}
            Err(error) => {
                self.failures += 1;
                // Bounded even if it flaps at every poll.
                static LIMIT: RateLimit = RateLimit::per_second();
                if self.failures == 1 {
                    log_limited!(warn, LIMIT, %etcd, %error, "metadata store unreachable; open segments keep transferring");
                }
            }
        }
    }
}

/// Marks stale every open handle whose published entry is gone or names
/// another epoch. An unreachable etcd changes nothing: open segments keep
/// transferring. `None` when no segment was open to check, else whether
/// etcd answered.
fn check_open_segments(engine: &EngineInner) -> Option<Result<()>> {
    let etcd = engine.etcd.as_ref()?;
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
    let store = EtcdStore::new(Arc::new(Etcd::new(etcd.url().clone())), PeerHandshake::default());
    let mut reached = None;
    for (name, segment) in open {
        let deadline = Instant::now() + engine.config.control_timeout;
        let detail = match store.published(&name, deadline) {
            Ok(published) if published.epoch == segment.epoch() => None,
            Ok(published) => Some(format!("its published epoch is now {:#x}", published.epoch)),
            Err(Error::UnknownSegment { .. }) => Some("its published entry is gone".to_string()),
            Err(error) => {
                // One answer anywhere says etcd is reachable.
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
