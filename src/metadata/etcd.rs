//! Segment descriptors in etcd, through etcd's JSON gateway (`/v3/...`,
//! served by every etcd ≥ 3.4 on its client port).
//!
//! An engine publishes its descriptor under `<prefix><name>`, attached to a
//! lease it keeps alive from its own thread (`directory::Publication`); a
//! crashed engine's key goes when the lease's TTL runs out. The gateway is
//! plain HTTP/1.1 with JSON, so no gRPC stack (and no tokio) is needed.

use super::directory::{check_prefix, host_port, Directory, DEFAULT_PREFIX};
use crate::error::{Error, Result};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
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
        host_port(addr).map_err(bad)?;
        let prefix = if path.is_empty() || path == "/" { DEFAULT_PREFIX.to_string() } else { path.to_string() };
        check_prefix(&prefix).map_err(|why| bad(why.to_string()))?;
        Ok(Self { addr: addr.to_string(), prefix })
    }

    /// The key a segment named `name` is published under.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }
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

    /// The parsed URL (kvring's own tests reach it).
    #[cfg(any(test, feature = "testing"))]
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
            Error::Timeout { what, .. } => Error::Timeout { what, waited: Duration::ZERO },
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

impl Directory for Etcd {
    fn describe(&self) -> String {
        format!("etcd at {}", self.url.addr)
    }

    fn addr(&self) -> &str {
        &self.url.addr
    }

    fn key(&self, name: &str) -> String {
        self.url.key(name)
    }

    fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        Etcd::get(self, key, deadline)
    }

    fn calls(&self) -> u64 {
        Etcd::calls(self)
    }

    fn fresh(&self) -> Arc<dyn Directory> {
        Arc::new(Etcd::new(self.url.clone()))
    }

    fn publish(&self, key: &str, value: &[u8], ttl: Duration, deadline: Instant) -> Result<i64> {
        let lease = self.grant(ttl, deadline)?;
        self.put(key, value, lease, deadline)?;
        Ok(lease)
    }

    fn refresh(&self, key: &str, value: &[u8], lease: i64, ttl: Duration, deadline: Instant) -> Result<i64> {
        if self.keep_alive(lease, deadline)? {
            return Ok(lease);
        }
        Directory::publish(self, key, value, ttl, deadline)
    }

    fn withdraw(&self, _key: &str, _value: &[u8], lease: i64, deadline: Instant) -> Result<()> {
        self.revoke(lease, deadline)
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
}
