//! Just enough HTTP/1.1 for kvring's uses: POSTing JSON to etcd's gRPC
//! gateway and GET/PUT/DELETE on Mooncake's HTTP metadata server (client),
//! and answering `GET /metrics` (server). One request per
//! connection (`Connection: close`), bounded sizes, deadlines on every read
//! and write. A full HTTP stack would be a heavy dependency for this.

use crate::error::{Error, Result};
use crate::net::DeadlineIo;
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
    request(addr, "POST", path, Some("application/json"), body, deadline)
}

/// Sends one request (`method` on `target`, a path with its query, `body`
/// with a Content-Length) to `addr` and reads the whole response before
/// `deadline`.
pub fn request(
    addr: &str,
    method: &str,
    target: &str,
    content_type: Option<&str>,
    body: &[u8],
    deadline: Instant,
) -> Result<Response> {
    let left = || deadline.saturating_duration_since(Instant::now());
    let resolved = addr
        .to_socket_addrs()
        .map_err(|e| Error::io(format!("resolving {addr}"), e))?
        .next()
        .ok_or_else(|| Error::invalid("address", format!("{addr} resolves to nothing")))?;
    let left = left();
    if left.is_zero() {
        return Err(Error::Timeout { what: ACCEPT, waited: std::time::Duration::ZERO });
    }
    // A server that never completes the connect ends at the deadline too.
    let stream = TcpStream::connect_timeout(&resolved, left)
        .map_err(|e| timed(e, deadline, ACCEPT, format!("connecting to {addr}")))?;
    // One deadline for the whole exchange: a server that trickles bytes
    // cannot hold the caller past it.
    let mut stream = DeadlineIo::new(&stream, deadline);
    let content_type = content_type.map(|t| format!("Content-Type: {t}\r\n")).unwrap_or_default();
    let head = format!(
        "{method} {target} HTTP/1.1\r\nHost: {addr}\r\n{content_type}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body))
        .map_err(|e| timed(e, deadline, ANSWER, format!("sending to {addr}")))?;
    let mut raw = Vec::new();
    (&mut stream)
        .take(MAX_MESSAGE_BYTES as u64 + 1)
        .read_to_end(&mut raw)
        .map_err(|e| timed(e, deadline, ANSWER, format!("reading the answer of {addr}")))?;
    if raw.len() > MAX_MESSAGE_BYTES {
        return Err(Error::MessageTooLarge { len: raw.len() as u64, max: MAX_MESSAGE_BYTES as u64 });
    }
    parse_response(&raw)
}

/// `text` escaped for a URL's query: every byte but the unreserved ones
/// (letters, digits, `-._~`) as `%XX`.
pub fn query_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            escaped.push(byte as char);
        } else {
            escaped.push_str(&format!("%{byte:02X}"));
        }
    }
    escaped
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

/// The waits of an exchange, as `Error::Timeout` names them.
const ACCEPT: &str = "the HTTP server (etcd's gateway, Mooncake's metadata server) to accept";
const ANSWER: &str = "the HTTP server's answer (etcd's gateway, Mooncake's metadata server)";

/// An I/O error of a deadline-bound exchange: `Timeout` when the deadline
/// is what ended it.
fn timed(error: std::io::Error, deadline: Instant, what: &'static str, context: String) -> Error {
    if crate::net::is_timeout(&error) && Instant::now() >= deadline {
        Error::Timeout { what, waited: std::time::Duration::ZERO }
    } else {
        Error::io(context, error)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Largest request head read.
pub const MAX_REQUEST_HEAD_BYTES: usize = 8192;

/// Reads one request's head (up to the blank line, at most
/// [`MAX_REQUEST_HEAD_BYTES`]) and returns its method and path. Give it a
/// [`DeadlineIo`] so the whole head is bounded in time.
pub fn read_request_line(stream: &mut impl Read) -> Result<(String, String)> {
    let mut head = Vec::with_capacity(512);
    let mut byte = [0u8; 512];
    while find(&head, b"\r\n\r\n").is_none() {
        let n = stream.read(&mut byte).map_err(|e| Error::io("reading a request", e))?;
        if n == 0 {
            return Err(Error::malformed("http request", "connection closed inside the head"));
        }
        head.extend_from_slice(&byte[..n]);
        if head.len() > MAX_REQUEST_HEAD_BYTES {
            return Err(Error::MessageTooLarge { len: head.len() as u64, max: MAX_REQUEST_HEAD_BYTES as u64 });
        }
    }
    parse_request_line(&head)
}

/// The method and path of a request head (bytes from outside: fuzzed).
pub fn parse_request_line(head: &[u8]) -> Result<(String, String)> {
    let line = head.split(|&b| b == b'\r' || b == b'\n').next().unwrap_or_default();
    let line = std::str::from_utf8(line).map_err(|_| Error::malformed("http request", "request line is not UTF-8"))?;
    let mut parts = line.split(' ');
    let method = parts.next().unwrap_or_default();
    let path = parts.next().unwrap_or_default();
    let version = parts.next().unwrap_or_default();
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) || !version.starts_with("HTTP/1.") {
        return Err(Error::malformed("http request", format!("not an HTTP/1.x request line: {line:?}")));
    }
    Ok((method.to_string(), path.to_string()))
}

/// Writes a complete response and closes nothing (the caller drops the stream).
pub fn write_response(stream: &mut impl Write, status: &str, content_type: &str, body: &[u8]) -> Result<()> {
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

    #[test]
    fn query_values_are_escaped() {
        assert_eq!(query_escape("/kvring/segments/decode-0"), "%2Fkvring%2Fsegments%2Fdecode-0");
        assert_eq!(query_escape("a b&c=d~é"), "a%20b%26c%3Dd~%C3%A9");
    }

    #[test]
    fn request_lines_parse_and_garbage_is_refused() {
        assert_eq!(
            parse_request_line(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap(),
            ("GET".to_string(), "/metrics".to_string())
        );
        for bad in [&b"\xff\xfe GET"[..], b"get / HTTP/1.1", b"GET /", b"", b"KVRC\x02\0\0\0"] {
            assert!(parse_request_line(bad).is_err(), "{bad:?}");
        }
        let head = vec![b'a'; MAX_REQUEST_HEAD_BYTES + 10];
        assert!(matches!(read_request_line(&mut head.as_slice()), Err(Error::MessageTooLarge { .. })));
    }
}
