//! Segment descriptors in redis, as deployments that keep Mooncake's
//! metadata in redis run it: `SET <prefix><name> <descriptor> PX <ttl>`,
//! refreshed by the engine's publication thread, deleted when it stops (only
//! if the entry is still its own); a crashed engine's entry goes with its
//! TTL. One connection per request, RESP2 written and read here: the four
//! commands kvring sends (`SELECT`, `GET`, `SET`, `EVAL`) and the five reply
//! types are about a page of code, where a client crate would bring a
//! connection manager and an async runtime kvring does not use.

use super::directory::{host_port, Directory, DEFAULT_PREFIX};
use crate::error::{Error, Result};
use crate::net::DeadlineIo;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest reply read (a descriptor is far smaller).
pub const MAX_REPLY_BYTES: usize = crate::http::MAX_MESSAGE_BYTES;
/// Most elements of one array reply.
const MAX_ARRAY: usize = 1024;
/// Deepest nesting of array replies.
const MAX_DEPTH: usize = 4;
/// Longest status or error line.
const MAX_LINE: usize = 64 << 10;

/// Deletes the key only if it still holds this engine's descriptor (a
/// restarted engine of the same name may have replaced it).
const DELETE_IF_OURS: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end";

/// A parsed `redis://host:port[/db]` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisUrl {
    /// `host:port` of the server.
    pub addr: String,
    /// The database number (`SELECT`), 0 when none is given.
    pub db: u32,
}

impl RedisUrl {
    /// Parses `redis://host:port` or `redis://host:port/db`.
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |why: String| Error::invalid("redis url", format!("{url:?}: {why}"));
        let rest = url.strip_prefix("redis://").ok_or_else(|| bad("must start with redis://".into()))?;
        let (addr, db) = match rest.split_once('/') {
            Some((addr, "")) => (addr, 0),
            Some((addr, db)) => (addr, db.parse().map_err(|_| bad(format!("database {db:?} is not a number")))?),
            None => (rest, 0),
        };
        host_port(addr).map_err(bad)?;
        Ok(Self { addr: addr.to_string(), db })
    }
}

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK`.
    Simple(String),
    /// `-ERR ...`.
    Error(String),
    /// `:42`.
    Integer(i64),
    /// `$5 hello`, or `$-1` (none).
    Bulk(Option<Vec<u8>>),
    /// `*2 ...`, or `*-1` (none).
    Array(Option<Vec<Reply>>),
}

/// Parses one reply from the start of `buf` (bytes from outside: fuzzed):
/// `Ok(None)` while it is incomplete, else the reply and the bytes it took.
pub fn parse_reply(buf: &[u8]) -> Result<Option<(Reply, usize)>> {
    parse_at(buf, 0)
}

fn parse_at(buf: &[u8], depth: usize) -> Result<Option<(Reply, usize)>> {
    let bad = |why: String| Error::malformed("redis reply", why);
    let Some(&kind) = buf.first() else { return Ok(None) };
    if !b"+-:$*".contains(&kind) {
        return Err(bad(format!("an unknown reply type {:?}", kind as char)));
    }
    // The line's end, searched after its type byte (which may be '\r').
    let Some(end) = buf[1..].windows(2).take(MAX_LINE + 1).position(|w| w == b"\r\n").map(|at| at + 1) else {
        return match buf.len() > MAX_LINE + 2 {
            true => Err(bad(format!("a line longer than {MAX_LINE} bytes"))),
            false => Ok(None),
        };
    };
    let line = std::str::from_utf8(&buf[1..end]).map_err(|_| bad("a line that is not UTF-8".into()))?;
    let after = end + 2;
    let length = |line: &str| -> Result<i64> {
        line.parse::<i64>().map_err(|_| bad(format!("a length that is not a number: {line:?}")))
    };
    match kind {
        b'+' => Ok(Some((Reply::Simple(line.to_string()), after))),
        b'-' => Ok(Some((Reply::Error(line.to_string()), after))),
        b':' => Ok(Some((Reply::Integer(length(line)?), after))),
        b'$' => match length(line)? {
            -1 => Ok(Some((Reply::Bulk(None), after))),
            n if n < 0 || n as usize > MAX_REPLY_BYTES => Err(bad(format!("a bulk string of {n} bytes"))),
            n => {
                let n = n as usize;
                let Some(rest) = buf.get(after..after + n + 2) else { return Ok(None) };
                if &rest[n..] != b"\r\n" {
                    return Err(bad("a bulk string not ended by CRLF".into()));
                }
                Ok(Some((Reply::Bulk(Some(rest[..n].to_vec())), after + n + 2)))
            }
        },
        b'*' => match length(line)? {
            -1 => Ok(Some((Reply::Array(None), after))),
            n if n < 0 || n as usize > MAX_ARRAY => Err(bad(format!("an array of {n} elements"))),
            _ if depth >= MAX_DEPTH => Err(bad(format!("arrays nested deeper than {MAX_DEPTH}"))),
            n => {
                let mut items = Vec::with_capacity(n as usize);
                let mut at = after;
                for _ in 0..n {
                    let Some((item, used)) = parse_at(&buf[at..], depth + 1)? else { return Ok(None) };
                    items.push(item);
                    at += used;
                }
                Ok(Some((Reply::Array(Some(items)), at)))
            }
        },
        _ => unreachable!("checked above"),
    }
}

/// One command in RESP: an array of bulk strings.
fn encode(command: &[&[u8]], out: &mut Vec<u8>) {
    out.extend_from_slice(format!("*{}\r\n", command.len()).as_bytes());
    for arg in command {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// A client of one redis server.
#[derive(Debug)]
pub struct Redis {
    url: RedisUrl,
    calls: AtomicU64,
}

impl Redis {
    /// A client for `url` (nothing is contacted yet).
    pub fn new(url: RedisUrl) -> Self {
        Self { url, calls: AtomicU64::new(0) }
    }

    /// Sends `command` (after a `SELECT` of the URL's database) on a new
    /// connection and returns its reply; an error reply is an error naming
    /// the server.
    pub fn command(&self, command: &[&[u8]], deadline: Instant) -> Result<Reply> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let addr = &self.url.addr;
        let mut request = Vec::new();
        let db = self.url.db.to_string();
        if self.url.db != 0 {
            encode(&[b"SELECT", db.as_bytes()], &mut request);
        }
        encode(command, &mut request);
        let replies = self.exchange(&request, 1 + usize::from(self.url.db != 0), deadline)?;
        for reply in &replies {
            if let Reply::Error(message) = reply {
                return Err(Error::Remote {
                    code: crate::proto::ErrorCode::Io,
                    message: format!("redis at {addr} answered: {message}"),
                });
            }
        }
        Ok(replies.into_iter().last().expect("at least one reply was read"))
    }

    /// Writes `request` and reads `expected` replies before `deadline`.
    fn exchange(&self, request: &[u8], expected: usize, deadline: Instant) -> Result<Vec<Reply>> {
        let addr = &self.url.addr;
        let io = |what: &str, e: std::io::Error| match crate::net::is_timeout(&e) && Instant::now() >= deadline {
            true => Error::Timeout { what: "the redis metadata server", waited: Duration::ZERO },
            false => Error::io(format!("redis at {addr}: {what}"), e),
        };
        let target = addr
            .to_socket_addrs()
            .map_err(|e| io("resolving it", e))?
            .next()
            .ok_or_else(|| Error::invalid("redis address", format!("{addr} resolves to nothing")))?;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout { what: "the redis metadata server", waited: Duration::ZERO });
        }
        let stream = TcpStream::connect_timeout(&target, left).map_err(|e| io("connecting", e))?;
        let mut stream = DeadlineIo::new(&stream, deadline);
        stream.write_all(request).map_err(|e| io("sending", e))?;
        let (mut buf, mut replies, mut at) = (Vec::new(), Vec::with_capacity(expected), 0);
        let mut chunk = [0u8; 4096];
        while replies.len() < expected {
            match parse_reply(&buf[at..]).map_err(|e| Error::malformed("redis reply", format!("from {addr}: {e}")))? {
                Some((reply, used)) => {
                    replies.push(reply);
                    at += used;
                    continue;
                }
                None if buf.len() > MAX_REPLY_BYTES => {
                    return Err(Error::MessageTooLarge { len: buf.len() as u64, max: MAX_REPLY_BYTES as u64 })
                }
                None => {}
            }
            let n = stream.read(&mut chunk).map_err(|e| io("reading its reply", e))?;
            if n == 0 {
                return Err(Error::malformed("redis reply", format!("{addr} closed the connection mid-reply")));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        Ok(replies)
    }

    /// The value under `key`, if any.
    pub fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        match self.command(&[b"GET", key.as_bytes()], deadline)? {
            Reply::Bulk(value) => Ok(value),
            other => Err(self.unexpected("GET", &other)),
        }
    }

    /// Sets `key` to `value` for `ttl`.
    pub fn set(&self, key: &str, value: &[u8], ttl: Duration, deadline: Instant) -> Result<()> {
        let ms = ttl.as_millis().max(1).to_string();
        match self.command(&[b"SET", key.as_bytes(), value, b"PX", ms.as_bytes()], deadline)? {
            Reply::Simple(ok) if ok == "OK" => Ok(()),
            other => Err(self.unexpected("SET", &other)),
        }
    }

    /// Deletes `key` if it holds `value`; true if it did.
    pub fn delete_if(&self, key: &str, value: &[u8], deadline: Instant) -> Result<bool> {
        match self.command(&[b"EVAL", DELETE_IF_OURS.as_bytes(), b"1", key.as_bytes(), value], deadline)? {
            Reply::Integer(n) => Ok(n > 0),
            other => Err(self.unexpected("EVAL", &other)),
        }
    }

    fn unexpected(&self, command: &str, reply: &Reply) -> Error {
        let shown = format!("{reply:?}");
        let shown = shown.get(..shown.len().min(120)).unwrap_or("?");
        Error::malformed("redis reply", format!("redis at {} answered {command} with {shown}", self.url.addr))
    }
}

impl Directory for Redis {
    fn describe(&self) -> String {
        format!("redis at {} (db {})", self.url.addr, self.url.db)
    }

    fn addr(&self) -> &str {
        &self.url.addr
    }

    fn key(&self, name: &str) -> String {
        format!("{DEFAULT_PREFIX}{name}")
    }

    fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        Redis::get(self, key, deadline)
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn fresh(&self) -> Arc<dyn Directory> {
        Arc::new(Redis::new(self.url.clone()))
    }

    fn publish(&self, key: &str, value: &[u8], ttl: Duration, deadline: Instant) -> Result<i64> {
        self.set(key, value, ttl, deadline).map(|()| 0)
    }

    fn refresh(&self, key: &str, value: &[u8], _lease: i64, ttl: Duration, deadline: Instant) -> Result<i64> {
        // SET again: a redis that restarted empty gets the entry back too.
        self.set(key, value, ttl, deadline).map(|()| 0)
    }

    fn withdraw(&self, key: &str, value: &[u8], _lease: i64, deadline: Instant) -> Result<()> {
        self.delete_if(key, value, deadline).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_and_bad_ones_say_why() {
        assert_eq!(
            RedisUrl::parse("redis://127.0.0.1:6379").unwrap(),
            RedisUrl { addr: "127.0.0.1:6379".into(), db: 0 }
        );
        assert_eq!(RedisUrl::parse("redis://r.local:6380/3").unwrap().db, 3);
        assert_eq!(RedisUrl::parse("redis://r.local:6380/").unwrap().db, 0);
        for (bad, why) in [
            ("http://h:1", "must start with redis://"),
            ("redis://h", "needs host:port"),
            ("redis://h:0", "not 1..=65535"),
            ("redis://h:1/x", "is not a number"),
            ("redis://:pw@h:1", "no host"),
        ] {
            let error = RedisUrl::parse(bad).unwrap_err().to_string();
            assert!(error.contains(why), "{bad}: {error}");
        }
    }

    #[test]
    fn replies_parse_whole_or_wait_for_more_and_bad_ones_are_named() {
        let whole: &[(&[u8], Reply)] = &[
            (b"+OK\r\n", Reply::Simple("OK".into())),
            (b"-ERR no\r\n", Reply::Error("ERR no".into())),
            (b":-7\r\n", Reply::Integer(-7)),
            (b"$5\r\nhe\r\no\r\n", Reply::Bulk(Some(b"he\r\no".to_vec()))),
            (b"$-1\r\n", Reply::Bulk(None)),
            (b"*2\r\n:1\r\n$0\r\n\r\n", Reply::Array(Some(vec![Reply::Integer(1), Reply::Bulk(Some(vec![]))]))),
            (b"*-1\r\n", Reply::Array(None)),
        ];
        for (bytes, reply) in whole {
            assert_eq!(parse_reply(bytes).unwrap(), Some((reply.clone(), bytes.len())), "{bytes:?}");
            for cut in 0..bytes.len() {
                assert_eq!(parse_reply(&bytes[..cut]).unwrap(), None, "{:?} is incomplete", &bytes[..cut]);
            }
        }
        for (bytes, why) in [
            (&b"?x\r\n"[..], "unknown reply type"),
            (b":x\r\n", "not a number"),
            (b"$3\r\nabcd\r\n", "not ended by CRLF"),
            (b"$999999999\r\n", "a bulk string of"),
            (b"*999999\r\n", "an array of"),
            (b"*1\r\n*1\r\n*1\r\n*1\r\n*1\r\n:1\r\n", "nested deeper"),
            (b"+\xff\r\n", "not UTF-8"),
            // Found by fuzz/redis_reply: a line that is only its end.
            (b"\r\n", "unknown reply type"),
        ] {
            let error = parse_reply(bytes).unwrap_err().to_string();
            assert!(error.contains(why), "{bytes:?}: {error}");
        }
        assert!(parse_reply(&vec![b'+'; MAX_LINE + 10]).unwrap_err().to_string().contains("longer than"));
    }

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        encode(&[b"SET", b"k", b"v\r\n"], &mut out);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n");
    }
}
