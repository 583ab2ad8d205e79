//! What etcd, redis and Mooncake's HTTP metadata server have in common: a
//! key-value server descriptors are published in and looked up from.
//!
//! An engine publishes its descriptor (protobuf, the bytes the handshake
//! carries) under `<prefix><name>` and keeps it there from a thread of its
//! own ([`Publication`]): a lease kept alive (etcd), a TTL refreshed
//! (redis), or the value put again (the HTTP server, which has no TTL).
//! It withdraws the entry when it stops. `open_segment(name)` resolves the
//! name once per open ([`DirectoryStore`]): the data path never touches the
//! server.

use super::{MetadataStore, PeerHandshake};
use crate::auth::Initiator;
use crate::control::Handshake;
use crate::error::{Error, Result};
use crate::log::ratelimit::{log_limited, RateLimit};
use crate::segment::SegmentDescriptor;
use prost::Message;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Key prefix segments are published under when the URL names none.
pub const DEFAULT_PREFIX: &str = "/kvring/segments/";

/// A key-value server descriptors live in.
pub(crate) trait Directory: Send + Sync + std::fmt::Debug {
    /// What and where it is, for messages: `etcd at 127.0.0.1:2379`.
    fn describe(&self) -> String;
    /// `host:port` of the server.
    fn addr(&self) -> &str;
    /// The key a segment named `name` is published under.
    fn key(&self, name: &str) -> String;
    /// The value under `key`, if any.
    fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>>;
    /// Requests this client made so far.
    fn calls(&self) -> u64;
    /// A client of the same server whose requests are counted apart (the
    /// publication and the watcher use their own, so only opens count).
    fn fresh(&self) -> Arc<dyn Directory>;
    /// Publishes `value` under `key` for `ttl`; returns a lease (etcd's id,
    /// 0 for the others) for `refresh` and `withdraw`.
    fn publish(&self, key: &str, value: &[u8], ttl: Duration, deadline: Instant) -> Result<i64>;
    /// Keeps the entry there for another `ttl`, publishing it again if it
    /// was lost (the server restarted); returns the lease now held.
    fn refresh(&self, key: &str, value: &[u8], lease: i64, ttl: Duration, deadline: Instant) -> Result<i64>;
    /// Takes the entry away, if it is still this publication's.
    fn withdraw(&self, key: &str, value: &[u8], lease: i64, deadline: Instant) -> Result<()>;
}

/// The metadata store over a directory: resolves a name to the descriptor
/// published there, then asks that peer's control plane for its live
/// region table (regions registered after publishing are in it), once per
/// open.
#[derive(Debug)]
pub struct DirectoryStore {
    directory: Arc<dyn Directory>,
    handshake: PeerHandshake,
}

impl DirectoryStore {
    /// A store on `directory`; `handshake` carries the token for the peers.
    pub(crate) fn new(directory: Arc<dyn Directory>, handshake: PeerHandshake) -> Self {
        Self { directory, handshake }
    }

    /// The descriptor published under `name`, as stored (no handshake).
    pub fn published(&self, name: &str, deadline: Instant) -> Result<SegmentDescriptor> {
        let key = self.directory.key(name);
        match self.directory.get(&key, deadline)? {
            Some(bytes) => Self::decode_descriptor(&self.directory.describe(), name, &bytes),
            None => Err(Error::UnknownSegment {
                segment: format!("{name} (no key {key} in {})", self.directory.describe()),
            }),
        }
    }

    /// Decodes a descriptor stored for `name` in `source` (bytes from
    /// outside: fuzzed).
    pub fn decode_descriptor(source: &str, name: &str, bytes: &[u8]) -> Result<SegmentDescriptor> {
        let bad = |why: String| Error::malformed("stored descriptor", format!("{name} in {source}: {why}"));
        let message = crate::proto::SegmentDescriptor::decode(bytes).map_err(|e| bad(e.to_string()))?;
        let descriptor = SegmentDescriptor::from_proto(message).map_err(|e| bad(e.to_string()))?;
        if descriptor.name != name {
            return Err(bad(format!("the key for {name:?} holds the descriptor of {:?}", descriptor.name)));
        }
        Ok(descriptor)
    }
}

impl MetadataStore for DirectoryStore {
    fn resolve(&self, name: &str, initiator: &Initiator, deadline: Instant) -> Result<Handshake> {
        let published = self.published(name, deadline)?;
        // Whoever can write the key chooses this address; with a token the
        // handshake makes it prove the token before we prove ours.
        let live = self.handshake.resolve(&published.control_addr, initiator, deadline)?;
        if live.descriptor.name != name {
            return Err(Error::PeerRestarted {
                segment: name.to_string(),
                detail: format!(
                    "{} now serves {:?}; its entry in {} is stale",
                    published.control_addr,
                    live.descriptor.name,
                    self.directory.describe()
                ),
            });
        }
        Ok(live)
    }
}

/// Keeps a descriptor published until stopped: publishes, refreshes every
/// third of the TTL (publishing again if the entry was lost: the server
/// restarted, or this process was stalled past the TTL), and withdraws it
/// when stopped.
#[derive(Debug)]
pub struct Publication {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Publication {
    /// Publishes `value` under `key` now (an error naming the server if it
    /// cannot be reached before `deadline`), then keeps it from a thread.
    pub(crate) fn start(
        directory: Arc<dyn Directory>,
        key: String,
        value: Vec<u8>,
        ttl: Duration,
        deadline: Instant,
    ) -> Result<Self> {
        let mut lease = directory.publish(&key, &value, ttl, deadline)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = stop.clone();
        let period = (ttl / 3).max(Duration::from_millis(100));
        let thread = std::thread::Builder::new()
            .name("kvring-metadata-lease".into())
            .spawn(move || {
                let mut next = crate::deadline::deadline_after(period);
                let mut failures = 0u64;
                while !thread_stop.load(Ordering::Acquire) {
                    if Instant::now() < next {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                    next = crate::deadline::deadline_after(period);
                    let deadline = crate::deadline::deadline_after(period);
                    match directory.refresh(&key, &value, lease, ttl, deadline) {
                        Ok(held) if failures > 0 => {
                            let server = directory.describe();
                            tracing::info!(%key, %server, failures, "metadata store reachable again; entry refreshed");
                            (lease, failures) = (held, 0);
                        }
                        Ok(held) => lease = held,
                        Err(error) => {
                            // Peers keep finding the entry until its TTL runs
                            // out; the next round tries again. Logged when
                            // lost, not every round it stays lost.
                            failures += 1;
                            static LIMIT: RateLimit = RateLimit::per_second();
                            if failures == 1 {
                                log_limited!(warn, LIMIT, %key, %error, "metadata store lost: could not refresh the published descriptor");
                            }
                        }
                    }
                }
                // Going away cleanly: the entry goes now, not after the TTL.
                let _ = directory.withdraw(&key, &value, lease, Instant::now() + Duration::from_secs(1));
            })
            .map_err(|e| Error::io("spawning the metadata publication thread", e))?;
        Ok(Self { stop, thread: Some(thread) })
    }

    /// Withdraws the entry and stops refreshing it.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Publication {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Checks a key prefix: absolute, ending in `/`, printable, with no empty
/// or relative component, so `<prefix><name>` can never reach a key
/// outside it.
pub(crate) fn check_prefix(prefix: &str) -> std::result::Result<(), &'static str> {
    if !prefix.starts_with('/') || !prefix.ends_with('/') {
        return Err("the key prefix must start and end with '/'");
    }
    if prefix.len() > 256 || prefix.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err("the key prefix must be printable, without spaces, at most 256 bytes");
    }
    if prefix[1..prefix.len() - 1].split('/').any(|part| part.is_empty() || part == "." || part == "..") {
        return Err("the key prefix has an empty, '.' or '..' component");
    }
    Ok(())
}

/// Splits `host:port` off a URL's rest, checking both.
pub(crate) fn host_port(addr: &str) -> std::result::Result<(), String> {
    let (host, port) = addr.rsplit_once(':').ok_or("needs host:port")?;
    if host.is_empty() || host.contains(char::is_whitespace) || host.contains('@') {
        return Err("has no host (or a user, which kvring does not take)".into());
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(()),
        _ => Err(format!("port {port:?} is not 1..=65535")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_corrupted_or_misfiled_descriptor_is_refused() {
        let error = DirectoryStore::decode_descriptor("etcd at x", "d", b"\xff\xff\xff").unwrap_err().to_string();
        assert!(error.contains("stored descriptor: d in etcd at x:"), "{error}");
        let other = SegmentDescriptor {
            name: "other".into(),
            epoch: 1,
            host_id: "h".into(),
            pid: 1,
            instance: 0,
            gpu_fds: None,
            regions: vec![],
            control_addr: "127.0.0.1:1".into(),
            tcp_addr: None,
            rdma: None,
            cma: None,
        };
        let bytes = other.to_proto().encode_to_vec();
        let error = DirectoryStore::decode_descriptor("redis at y", "d", &bytes).unwrap_err().to_string();
        assert!(error.contains("holds the descriptor of \"other\""), "{error}");
    }

    #[test]
    fn hosts_and_ports_are_checked() {
        assert!(host_port("127.0.0.1:6379").is_ok());
        assert!(host_port("[::1]:6379").is_ok());
        for (bad, why) in [("host", "needs host:port"), (":1", "no host"), ("u:p@h:1", "no host"), ("h:0", "not 1..")] {
            assert!(host_port(bad).unwrap_err().contains(why), "{bad}");
        }
    }
}
