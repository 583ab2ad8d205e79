//! Segment descriptors on Mooncake's HTTP metadata server
//! (`mooncake_http_metadata_server`, or anything speaking its protocol):
//! `GET`, `PUT` and `DELETE` on `<path>?key=<key>`, the value the request's
//! or answer's body, 404 for a missing key. The server keeps no TTL, so the
//! engine puts its entry again every third of `metadata_ttl` (a restarted
//! server gets it back) and deletes it when it stops; a crashed engine's
//! entry stays until its name is published again, and peers that open it
//! meanwhile get a connection error naming its address. Requests go through
//! kvring's own HTTP/1.1 client (`http.rs`).

use super::directory::{host_port, Directory, DEFAULT_PREFIX};
use crate::error::{Error, Result};
use crate::http::{query_escape, Response};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The path Mooncake's server answers on.
pub const DEFAULT_PATH: &str = "/metadata";

/// A parsed `http://host:port[/path]` URL of the metadata server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpMetadataUrl {
    /// `host:port` of the server.
    pub addr: String,
    /// The path keys are asked on (`/metadata` when none is given).
    pub path: String,
}

impl HttpMetadataUrl {
    /// Parses `http://host:port/metadata` (or another path).
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |why: String| Error::invalid("http metadata url", format!("{url:?}: {why}"));
        let rest = url.strip_prefix("http://").ok_or_else(|| bad("must start with http://".into()))?;
        let (addr, path) = match rest.find('/') {
            Some(slash) => (&rest[..slash], &rest[slash..]),
            None => (rest, DEFAULT_PATH),
        };
        host_port(addr).map_err(bad)?;
        let path = if path == "/" { DEFAULT_PATH } else { path };
        let printable = path.bytes().all(|b| b.is_ascii_graphic() && b != b'?' && b != b'#' && b != b'%');
        if path.len() > 256 || !printable {
            return Err(bad("the path must be printable ASCII without '?', '#' or '%', at most 256 bytes".into()));
        }
        Ok(Self { addr: addr.to_string(), path: path.to_string() })
    }
}

/// What a `GET` of a key answered: its value, none (404), or an error
/// naming the server (bytes from outside: fuzzed).
pub fn decode_get(addr: &str, response: &Response) -> Result<Option<Vec<u8>>> {
    match response.status {
        200 => Ok(Some(response.body.clone())),
        404 => Ok(None),
        status => Err(refused(addr, "GET", status, &response.body)),
    }
}

fn refused(addr: &str, method: &str, status: u16, body: &[u8]) -> Error {
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]).trim().to_string();
    Error::Remote {
        code: crate::proto::ErrorCode::Io,
        message: format!("the HTTP metadata server at {addr} answered {status} to {method}: {text}"),
    }
}

/// A client of one HTTP metadata server.
#[derive(Debug)]
pub struct HttpMetadata {
    url: HttpMetadataUrl,
    calls: AtomicU64,
}

impl HttpMetadata {
    /// A client for `url` (nothing is contacted yet).
    pub fn new(url: HttpMetadataUrl) -> Self {
        Self { url, calls: AtomicU64::new(0) }
    }

    fn call(&self, method: &str, key: &str, body: &[u8], deadline: Instant) -> Result<Response> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let addr = &self.url.addr;
        let target = format!("{}?key={}", self.url.path, query_escape(key));
        let content_type = (method == "PUT").then_some("application/octet-stream");
        crate::http::request(addr, method, &target, content_type, body, deadline).map_err(|error| match error {
            Error::Io { context, source } => {
                Error::Io { context: format!("the HTTP metadata server at {addr}: {context}"), source }
            }
            Error::Timeout { what, .. } => Error::Timeout { what, waited: Duration::ZERO },
            other => {
                Error::Remote { code: other.code(), message: format!("the HTTP metadata server at {addr}: {other}") }
            }
        })
    }

    /// The value under `key`, if any.
    pub fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        let response = self.call("GET", key, &[], deadline)?;
        decode_get(&self.url.addr, &response)
    }

    /// Puts `value` under `key`.
    pub fn put(&self, key: &str, value: &[u8], deadline: Instant) -> Result<()> {
        let response = self.call("PUT", key, value, deadline)?;
        match response.status {
            200..=299 => Ok(()),
            status => Err(refused(&self.url.addr, "PUT", status, &response.body)),
        }
    }

    /// Deletes `key` if it still holds `value` (a restarted engine of the
    /// same name may have replaced it; the protocol has no compare, so a
    /// put between the two requests is lost, which only a crash and restart
    /// within milliseconds of a clean stop could cause).
    pub fn delete_if(&self, key: &str, value: &[u8], deadline: Instant) -> Result<()> {
        if self.get(key, deadline)?.as_deref() != Some(value) {
            return Ok(());
        }
        let response = self.call("DELETE", key, &[], deadline)?;
        match response.status {
            200..=299 | 404 => Ok(()),
            status => Err(refused(&self.url.addr, "DELETE", status, &response.body)),
        }
    }
}

impl Directory for HttpMetadata {
    fn describe(&self) -> String {
        format!("the HTTP metadata server at {}{}", self.url.addr, self.url.path)
    }

    fn addr(&self) -> &str {
        &self.url.addr
    }

    fn key(&self, name: &str) -> String {
        format!("{DEFAULT_PREFIX}{name}")
    }

    fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        HttpMetadata::get(self, key, deadline)
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn fresh(&self) -> Arc<dyn Directory> {
        Arc::new(HttpMetadata::new(self.url.clone()))
    }

    fn publish(&self, key: &str, value: &[u8], _ttl: Duration, deadline: Instant) -> Result<i64> {
        self.put(key, value, deadline).map(|()| 0)
    }

    fn refresh(&self, key: &str, value: &[u8], _lease: i64, _ttl: Duration, deadline: Instant) -> Result<i64> {
        self.put(key, value, deadline).map(|()| 0)
    }

    fn withdraw(&self, key: &str, value: &[u8], _lease: i64, deadline: Instant) -> Result<()> {
        self.delete_if(key, value, deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_say_why() {
        let url = HttpMetadataUrl::parse("http://127.0.0.1:8080/metadata").unwrap();
        assert_eq!(url, HttpMetadataUrl { addr: "127.0.0.1:8080".into(), path: "/metadata".into() });
        assert_eq!(HttpMetadataUrl::parse("http://m.local:80").unwrap().path, "/metadata");
        assert_eq!(HttpMetadataUrl::parse("http://m.local:80/").unwrap().path, "/metadata");
        assert_eq!(HttpMetadataUrl::parse("http://m.local:80/kv/meta").unwrap().path, "/kv/meta");
        for (bad, why) in [
            ("https://h:1/metadata", "must start with http://"),
            ("http://h/metadata", "needs host:port"),
            ("http://h:1/metadata?key=x", "without '?'"),
            ("http://h:1/meta data", "printable"),
        ] {
            let error = HttpMetadataUrl::parse(bad).unwrap_err().to_string();
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn answers_decode_by_status() {
        let answer = |status, body: &[u8]| Response { status, body: body.to_vec() };
        assert_eq!(decode_get("a:1", &answer(200, b"v")).unwrap(), Some(b"v".to_vec()));
        assert_eq!(decode_get("a:1", &answer(404, b"metadata not found")).unwrap(), None);
        let error = decode_get("a:1", &answer(400, b"metadata key is required")).unwrap_err().to_string();
        assert!(error.contains("at a:1 answered 400 to GET: metadata key is required"), "{error}");
    }
}
