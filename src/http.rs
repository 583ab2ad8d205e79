//! Just enough HTTP/1.1 for kvring's two uses: POSTing JSON to etcd's gRPC
//! gateway (client), and answering `GET /metrics` (server). One request per
//! connection (`Connection: close`), bounded sizes, deadlines on every read
//! and write. A full HTTP stack would be a heavy dependency for this.

use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Instant;

/// Largest response or request kvring reads.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// A parsed response: status code and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// Body, de-chunked.
    pub body: Vec<u8>,
}

/// POSTs `body` (JSON) to `http://{addr}{path}` and reads the whole
/// response before `deadline`.
pub fn post_json(addr: &str, path: &str, body: &[u8], deadline: Instant) -> Result<Response> {
    let left = || deadline.saturating_duration_since(Instant::now());
    let target = addr
        .to_socket_addrs()
        .map_err(|e| Error::io(format!("resolving {addr}"), e))?
        .next()
        .ok_or_else(|| Error::invalid("address", format!("{addr} resolves to nothing")))?;
    if left().is_zero() {
        return Err(Error::Timeout { waited: std::time::Duration::ZERO });
    }
    let mut stream =
        TcpStream::connect_timeout(&target, left()).map_err(|e| Error::io(format!("connecting to {addr}"), e))?;
    let timeout = Some(left().max(std::time::Duration::from_millis(1)));
    stream.set_read_timeout(timeout).map_err(|e| Error::io("setting a read timeout", e))?;
    stream.set_write_timeout(timeout).map_err(|e| Error::io("setting a write timeout", e))?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body))
        .map_err(|e| Error::io(format!("sending to {addr}"), e))?;
    let mut raw = Vec::new();
    stream
        .take(MAX_MESSAGE_BYTES as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(|e| Error::io(format!("reading the answer of {addr}"), e))?;
    if raw.len() > MAX_MESSAGE_BYTES {
        return Err(Error::MessageTooLarge { len: raw.len() as u64, max: MAX_MESSAGE_BYTES as u64 });
    }
    parse_response(&raw)
}

/// Parses a complete HTTP/1.1 response (bytes from outside: fuzzed).
pub fn parse_response(raw: &[u8]) -> Result<Response> {
    let bad = |why: &str| Error::malformed("http response", why.to_string());
    let split = find(raw, b"\r\n\r\n").ok_or_else(|| bad("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| bad("headers are not UTF-8"))?;
    let rest = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    if !parts.next().unwrap_or_default().starts_with("HTTP/1.") {
        return Err(bad("not an HTTP/1.x status line"));
    }
    let status: u16 = parts.next().and_then(|s| s.parse().ok()).ok_or_else(|| bad("no status code"))?;
    let mut chunked = false;
    let mut length: Option<usize> = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { return Err(bad("a header without ':'")) };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") && value.eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse().map_err(|_| bad("a Content-Length that is not a number"))?);
        }
    }
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(length) = length {
        rest.get(..length).ok_or_else(|| bad("body shorter than its Content-Length"))?.to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>> {
    let bad = |why: &str| Error::malformed("http response", why.to_string());
    let mut body = Vec::new();
    loop {
        let end = find(rest, b"\r\n").ok_or_else(|| bad("a chunk size without an end"))?;
        let size_text = std::str::from_utf8(&rest[..end]).map_err(|_| bad("a chunk size that is not text"))?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| bad("a chunk size that is not hex"))?;
        rest = &rest[end + 2..];
        if size == 0 {
            return Ok(body);
        }
        if size > MAX_MESSAGE_BYTES || rest.len() < size + 2 {
            return Err(bad("a chunk longer than the message"));
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Reads one request's head (up to the blank line, at most 8 KiB) and
/// returns its method and path.
pub fn read_request_line(stream: &mut TcpStream) -> Result<(String, String)> {
    let mut head = Vec::with_capacity(512);
    let mut byte = [0u8; 512];
    while find(&head, b"\r\n\r\n").is_none() {
        let n = stream.read(&mut byte).map_err(|e| Error::io("reading a request", e))?;
        if n == 0 {
            return Err(Error::malformed("http request", "connection closed inside the head"));
        }
        head.extend_from_slice(&byte[..n]);
        if head.len() > 8192 {
            return Err(Error::MessageTooLarge { len: head.len() as u64, max: 8192 });
        }
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let method = parts.next().unwrap_or_default().to_string();
    let path = parts.next().unwrap_or_default().to_string();
    Ok((method, path))
}

/// Writes a complete response and closes nothing (the caller drops the stream).
pub fn write_response(stream: &mut TcpStream, status: &str, content_type: &str, body: &[u8]) -> Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body))
        .map_err(|e| Error::io("writing a response", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_parse_with_length_chunks_or_eof_and_bad_ones_are_named() {
        let plain = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}trailing").unwrap();
        assert_eq!(plain, Response { status: 200, body: b"{}".to_vec() });
        let chunked = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(chunked.body, b"abcde");
        assert_eq!(parse_response(b"HTTP/1.0 404 Not Found\r\n\r\ngone").unwrap().body, b"gone");
        for (raw, why) in [
            (&b"HTTP/1.1 200 OK\r\n"[..], "no end of headers"),
            (b"SMTP 200 OK\r\n\r\n", "status line"),
            (b"HTTP/1.1 abc OK\r\n\r\n", "no status code"),
            (b"HTTP/1.1 200 OK\r\nbroken\r\n\r\n", "without ':'"),
            (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nab", "shorter"),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "not hex"),
            (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nff\r\nab", "longer than"),
        ] {
            let error = parse_response(raw).unwrap_err().to_string();
            assert!(error.contains(why), "{error} should say {why}");
        }
    }
}
