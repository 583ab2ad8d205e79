//! Segment descriptors in etcd, through etcd's JSON gateway (`/v3/...`,
//! served by every etcd ≥ 3.4 on its client port).
//!
//! An engine publishes its descriptor (protobuf, the same bytes the
//! handshake carries) under `<prefix><name>`, attached to a lease it keeps
//! alive from its own thread; a crashed engine's key goes when the lease's
//! TTL runs out. `open_segment(name)` resolves the name here once per open:
//! the data path never touches etcd. The gateway is plain HTTP/1.1 with JSON,
//! so no gRPC stack (and no tokio) is needed.

use super::MetadataStore;
use crate::auth::Initiator;
use crate::control::Handshake;
use crate::error::{Error, Result};
use crate::log::ratelimit::{log_limited, RateLimit};
use crate::segment::SegmentDescriptor;
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use prost::Message;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Key prefix segments are published under when the URL names none.
pub const DEFAULT_PREFIX: &str = "/kvring/segments/";
/// Default lease TTL of a published descriptor.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

/// A parsed `etcd://host:port[/prefix/]` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdUrl {
    /// `host:port` of etcd's client endpoint.
    pub addr: String,
    /// Key prefix, starting and ending with `/`.
    pub prefix: String,
}

impl EtcdUrl {
    /// Parses `etcd://host:port` (prefix `/kvring/segments/`) or
    /// `etcd://host:port/some/prefix/`.
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |why: String| Error::invalid("etcd url", format!("{url:?}: {why}"));
        let rest = url.strip_prefix("etcd://").ok_or_else(|| bad("must start with etcd://".into()))?;
        let (addr, path) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash..]),
            None => (rest, ""),
        };
        let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad("needs host:port".into()))?;
        if host.is_empty() || host.contains(char::is_whitespace) {
            return Err(bad("has no host".into()));
        }
        port.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(|| bad(format!("port {port:?} is not 1..=65535")))?;
        let prefix = if path.is_empty() || path == "/" { DEFAULT_PREFIX.to_string() } else { path.to_string() };
        check_prefix(&prefix).map_err(|why| bad(why.to_string()))?;
        Ok(Self { addr: addr.to_string(), prefix })
    }

    /// The key a segment named `name` is published under.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }
}

/// A prefix must be an absolute etcd path ending in `/`, printable, with no
/// empty or relative component, so `<prefix><name>` can never reach a key
/// outside it.
fn check_prefix(prefix: &str) -> std::result::Result<(), &'static str> {
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

/// A client of one etcd endpoint.
#[derive(Debug)]
pub struct Etcd {
    url: EtcdUrl,
    /// Requests made, so a benchmark can show none happen per batch.
    calls: AtomicU64,
}

impl Etcd {
    /// A client for `url` (nothing is contacted yet).
    pub fn new(url: EtcdUrl) -> Self {
        Self { url, calls: AtomicU64::new(0) }
    }

    /// The parsed URL.
    pub fn url(&self) -> &EtcdUrl {
        &self.url
    }

    /// Requests made to etcd so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn call(&self, path: &str, request: Value, deadline: Instant) -> Result<Value> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let addr = &self.url.addr;
        let body = serde_json::to_vec(&request).map_err(|e| Error::invalid("etcd request", e.to_string()))?;
        let response = crate::http::post_json(addr, path, &body, deadline).map_err(|error| match error {
            Error::Io { context, source } => Error::Io { context: format!("etcd at {addr}: {context}"), source },
            Error::Timeout { .. } => Error::Timeout { waited: Duration::ZERO },
            other => Error::Remote { code: other.code(), message: format!("etcd at {addr}: {other}") },
        })?;
        let value = decode_json(&response.body).map_err(|e| self.bad_answer(e))?;
        if response.status != 200 {
            let message = value.get("message").or_else(|| value.get("error")).and_then(Value::as_str).unwrap_or("");
            return Err(Error::Remote {
                code: crate::proto::ErrorCode::Io,
                message: format!("etcd at {addr} answered {} to {path}: {message}", response.status),
            });
        }
        Ok(value)
    }

    fn bad_answer(&self, error: Error) -> Error {
        Error::malformed("etcd answer", format!("from etcd at {}: {error}", self.url.addr))
    }

    /// Grants a lease of `ttl`; returns its id.
    pub fn grant(&self, ttl: Duration, deadline: Instant) -> Result<i64> {
        let answer = self.call("/v3/lease/grant", json!({ "TTL": ttl.as_secs().max(1) }), deadline)?;
        int_field(&answer, "ID").ok_or_else(|| self.bad_answer(Error::malformed("lease grant", "no ID")))
    }

    /// Refreshes a lease; false when etcd no longer knows it (expired).
    pub fn keep_alive(&self, lease: i64, deadline: Instant) -> Result<bool> {
        let answer = self.call("/v3/lease/keepalive", json!({ "ID": lease.to_string() }), deadline)?;
        let result = answer.get("result").unwrap_or(&answer);
        Ok(int_field(result, "TTL").unwrap_or(0) > 0)
    }

    /// Revokes a lease (its keys go at once).
    pub fn revoke(&self, lease: i64, deadline: Instant) -> Result<()> {
        self.call("/v3/lease/revoke", json!({ "ID": lease.to_string() }), deadline).map(drop)
    }

    /// Puts `value` under `key`, attached to `lease` (0: none).
    pub fn put(&self, key: &str, value: &[u8], lease: i64, deadline: Instant) -> Result<()> {
        let mut request = json!({ "key": BASE64.encode(key), "value": BASE64.encode(value) });
        if lease != 0 {
            request["lease"] = Value::String(lease.to_string());
        }
        self.call("/v3/kv/put", request, deadline).map(drop)
    }

    /// The value under `key`, if any.
    pub fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        let answer = self.call("/v3/kv/range", json!({ "key": BASE64.encode(key) }), deadline)?;
        decode_range(&answer).map_err(|e| self.bad_answer(e))
    }
}

/// Parses a JSON body from outside (fuzzed with the HTTP parser).
pub fn decode_json(body: &[u8]) -> Result<Value> {
    serde_json::from_slice(body).map_err(|e| Error::malformed("etcd answer", format!("not JSON: {e}")))
}

/// The first value of a range answer (`kvs[0].value`, base64), if any.
pub fn decode_range(answer: &Value) -> Result<Option<Vec<u8>>> {
    let Some(kvs) = answer.get("kvs") else { return Ok(None) };
    let first = kvs.as_array().and_then(|kvs| kvs.first());
    let Some(first) = first else { return Ok(None) };
    // etcd omits empty fields: a key with an empty value has no "value".
    let encoded = first.get("value").map_or(Some(""), Value::as_str);
    let encoded = encoded.ok_or_else(|| Error::malformed("etcd answer", "a value that is not a string"))?;
    BASE64.decode(encoded).map(Some).map_err(|e| Error::malformed("etcd answer", format!("a value not in base64: {e}")))
}

/// proto3 JSON writes 64-bit integers as strings; accept both forms.
fn int_field(value: &Value, name: &str) -> Option<i64> {
    match value.get(name)? {
        Value::String(text) => text.parse().ok(),
        Value::Number(number) => number.as_i64(),
        _ => None,
    }
}

/// The etcd metadata store: resolves a name to the descriptor published
/// there, then asks that peer's control plane for its live region table
/// (regions registered after publishing are in it), once per open.
#[derive(Debug)]
pub struct EtcdStore {
    etcd: Arc<Etcd>,
    handshake: super::PeerHandshake,
}

impl EtcdStore {
    /// A store on `etcd`; `handshake` carries the token for the peers.
    pub fn new(etcd: Arc<Etcd>, handshake: super::PeerHandshake) -> Self {
        Self { etcd, handshake }
    }

    /// The descriptor published under `name`, as stored (no handshake).
    pub fn published(&self, name: &str, deadline: Instant) -> Result<SegmentDescriptor> {
        let key = self.etcd.url().key(name);
        match self.etcd.get(&key, deadline)? {
            Some(bytes) => Self::decode_descriptor(name, &bytes),
            None => Err(Error::UnknownSegment {
                segment: format!("{name} (no key {key} in etcd at {})", self.etcd.url().addr),
            }),
        }
    }

    /// Decodes a descriptor stored in etcd (bytes from outside: fuzzed).
    pub fn decode_descriptor(name: &str, bytes: &[u8]) -> Result<SegmentDescriptor> {
        let message = crate::proto::SegmentDescriptor::decode(bytes)
            .map_err(|e| Error::malformed("descriptor in etcd", format!("{name}: {e}")))?;
        let descriptor = SegmentDescriptor::from_proto(message)
            .map_err(|e| Error::malformed("descriptor in etcd", format!("{name}: {e}")))?;
        if descriptor.name != name {
            return Err(Error::malformed(
                "descriptor in etcd",
                format!("the key for {name:?} holds the descriptor of {:?}", descriptor.name),
            ));
        }
        Ok(descriptor)
    }
}

impl MetadataStore for EtcdStore {
    fn resolve(&self, name: &str, initiator: &Initiator, deadline: Instant) -> Result<Handshake> {
        let published = self.published(name, deadline)?;
        // Whoever can write the key chooses this address; with a token the
        // handshake makes it prove the token before we prove ours.
        let live = self.handshake.resolve(&published.control_addr, initiator, deadline)?;
        if live.descriptor.name != name {
            return Err(Error::PeerRestarted {
                segment: name.to_string(),
                detail: format!(
                    "{} now serves {:?}; its etcd entry is stale",
                    published.control_addr, live.descriptor.name
                ),
            });
        }
        Ok(live)
    }
}

/// Keeps a descriptor published under a lease until stopped: grants, puts,
/// refreshes every third of the TTL, and re-publishes if the lease was
/// lost (etcd restarted, or this process was stalled past the TTL).
#[derive(Debug)]
pub struct Publication {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Publication {
    /// Publishes `value` under `key` now (an error if etcd cannot be
    /// reached before `deadline`), then keeps it alive from a thread.
    pub fn start(etcd: Arc<Etcd>, key: String, value: Vec<u8>, ttl: Duration, deadline: Instant) -> Result<Self> {
        let mut lease = etcd.grant(ttl, deadline)?;
        etcd.put(&key, &value, lease, deadline)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = stop.clone();
        let period = (ttl / 3).max(Duration::from_millis(100));
        let thread = std::thread::Builder::new()
            .name("kvring-etcd-lease".into())
            .spawn(move || {
                let mut next = Instant::now() + period;
                let mut failures = 0u64;
                while !thread_stop.load(Ordering::Acquire) {
                    if Instant::now() < next {
                        std::thread::sleep(Duration::from_millis(20));
                        continue;
                    }
                    next = Instant::now() + period;
                    let deadline = Instant::now() + period;
                    let refreshed = etcd.keep_alive(lease, deadline).and_then(|alive| {
                        if alive {
                            return Ok(());
                        }
                        lease = etcd.grant(ttl, deadline)?;
                        etcd.put(&key, &value, lease, deadline)
                    });
                    match refreshed {
                        Ok(()) if failures > 0 => {
                            tracing::info!(%key, failures, "metadata store reachable again; lease refreshed");
                            failures = 0;
                        }
                        Ok(()) => {}
                        Err(error) => {
                            // Peers keep finding the entry until its lease
                            // runs out; the next round tries again. Logged
                            // when lost, not every round it stays lost.
                            failures += 1;
                            static LIMIT: RateLimit = RateLimit::per_second();
                            if failures == 1 {
                                log_limited!(warn, LIMIT, %key, %error, "metadata store lost: could not refresh the published descriptor's lease");
                            }
                        }
                    }
                }
                // Going away cleanly: the key goes now, not after the TTL.
                let _ = etcd.revoke(lease, Instant::now() + Duration::from_secs(1));
            })
            .map_err(|e| Error::io("spawning the etcd lease thread", e))?;
        Ok(Self { stop, thread: Some(thread) })
    }

    /// Revokes the lease and stops refreshing it.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_say_why() {
        let url = EtcdUrl::parse("etcd://127.0.0.1:2379").unwrap();
        assert_eq!(url, EtcdUrl { addr: "127.0.0.1:2379".into(), prefix: DEFAULT_PREFIX.into() });
        assert_eq!(url.key("decode-0"), "/kvring/segments/decode-0");
        let url = EtcdUrl::parse("etcd://etcd.local:2379/cluster-a/kv/").unwrap();
        assert_eq!(url.prefix, "/cluster-a/kv/");
        for (bad, why) in [
            ("http://127.0.0.1:2379", "must start with etcd://"),
            ("etcd://127.0.0.1", "needs host:port"),
            ("etcd://:2379", "has no host"),
            ("etcd://host:99999", "is not 1..=65535"),
            ("etcd://host:0", "is not 1..=65535"),
            ("etcd://host:2379/no-trailing-slash", "start and end with '/'"),
            ("etcd://host:2379/a//b/", "empty, '.' or '..'"),
            ("etcd://host:2379/a/../b/", "empty, '.' or '..'"),
            ("etcd://host:2379/a b/", "printable"),
        ] {
            let error = EtcdUrl::parse(bad).unwrap_err().to_string();
            assert!(error.contains(why), "{bad}: {error} should say {why}");
        }
    }

    #[test]
    fn range_answers_decode_and_bad_ones_are_named() {
        let answer: Value = serde_json::from_str(r#"{"kvs":[{"key":"a2V5","value":"aGVsbG8="}],"count":"1"}"#).unwrap();
        assert_eq!(decode_range(&answer).unwrap().unwrap(), b"hello");
        assert_eq!(decode_range(&json!({"count": "0"})).unwrap(), None);
        assert_eq!(decode_range(&json!({"kvs": [{"key": "a2V5"}]})).unwrap().unwrap(), b"");
        assert!(decode_range(&json!({"kvs": [{"value": 5}]})).unwrap_err().to_string().contains("not a string"));
        assert!(decode_range(&json!({"kvs": [{"value": "@@"}]})).unwrap_err().to_string().contains("base64"));
        assert!(decode_json(b"{nope").unwrap_err().to_string().contains("not JSON"));
        assert_eq!(int_field(&json!({"ID": "42"}), "ID"), Some(42));
        assert_eq!(int_field(&json!({"ID": 42}), "ID"), Some(42));
    }

    #[test]
    fn a_corrupted_or_misfiled_descriptor_is_refused() {
        assert!(EtcdStore::decode_descriptor("d", b"\xff\xff\xff").unwrap_err().to_string().contains("d:"));
        let other = SegmentDescriptor {
            name: "other".into(),
            epoch: 1,
            host_id: "h".into(),
            pid: 1,
            regions: vec![],
            control_addr: "127.0.0.1:1".into(),
            tcp_addr: None,
            rdma: None,
            cma: None,
        };
        let bytes = other.to_proto().encode_to_vec();
        let error = EtcdStore::decode_descriptor("d", &bytes).unwrap_err().to_string();
        assert!(error.contains("holds the descriptor of \"other\""), "{error}");
    }
}
