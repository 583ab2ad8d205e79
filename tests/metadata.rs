//! Cluster metadata on redis and on Mooncake's HTTP metadata server: a real
//! `redis-server` (Debian's; `.ci/run` installs it), Mooncake's own
//! `mooncake_http_metadata_server` where its PyPI package is installed (on
//! PATH or in target/pyenv), and a small server of the same protocol here,
//! so the HTTP path always runs. Each test starts its servers on free
//! loopback ports; a missing one is skipped with the reason.

mod common;

use common::WAIT;
use kvring::testing::metadata::{HttpMetadata, HttpMetadataUrl, Redis, RedisUrl, DEFAULT_PREFIX};
use kvring::{Batch, BlockDesc, Engine, MetadataMode, RegionInfo, TransportKind};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Mooncake's HTTP protocol, served from a thread: GET, PUT and DELETE on
/// `/metadata?key=...`, 404 for a missing key.
struct TestHttp {
    addr: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestHttp {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let store = Mutex::new(HashMap::<String, Vec<u8>>::new());
        let thread = std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => serve_one(stream, &store),
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Self { addr, stop, thread: Some(thread) }
    }
}

impl Drop for TestHttp {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

fn serve_one(stream: TcpStream, store: &Mutex<HashMap<String, Vec<u8>>>) {
    stream.set_nonblocking(false).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let mut reader = BufReader::new(&stream);
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
    let mut length = 0;
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).unwrap();
        if header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).unwrap();
    let key = target.strip_prefix("/metadata?key=").map(unescape);
    let mut store = store.lock().unwrap();
    let (status, answer) = match (method.as_str(), key) {
        (_, None) => ("400 Bad Request", b"metadata key is required".to_vec()),
        ("GET", Some(key)) => match store.get(&key) {
            Some(value) => ("200 OK", value.clone()),
            None => ("404 Not Found", b"metadata not found".to_vec()),
        },
        ("PUT", Some(key)) => {
            store.insert(key, body);
            ("200 OK", b"metadata updated".to_vec())
        }
        ("DELETE", Some(key)) => match store.remove(&key) {
            Some(_) => ("200 OK", b"metadata deleted".to_vec()),
            None => ("404 Not Found", b"metadata not found".to_vec()),
        },
        _ => ("405 Method Not Allowed", b"Method not allowed".to_vec()),
    };
    let head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", answer.len());
    let mut stream = &stream;
    let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(&answer));
}

fn unescape(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 3 <= bytes.len() {
            out.push(u8::from_str_radix(&text[i + 1..i + 3], 16).unwrap());
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

/// A metadata server a test runs against.
enum Server {
    Redis(Child, String),
    Http(Option<TestHttp>, String),
    Mooncake(Child, String),
}

impl Server {
    fn redis() -> Option<Self> {
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let Ok(child) = child else {
            eprintln!("skipped: no `redis-server` on PATH (apt-get install redis-server; .ci/run does)");
            return None;
        };
        Some(Server::Redis(child, format!("127.0.0.1:{port}")).ready())
    }

    fn http() -> Self {
        let server = TestHttp::start();
        let addr = server.addr.clone();
        Server::Http(Some(server), addr)
    }

    fn mooncake() -> Option<Self> {
        let local =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/pyenv/bin/mooncake_http_metadata_server");
        let binary = if local.exists() { local.display().to_string() } else { "mooncake_http_metadata_server".into() };
        let port = free_port();
        let child = Command::new(&binary)
            .args(["--port", &port.to_string(), "--host", "127.0.0.1", "--log-level", "ERROR"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let Ok(child) = child else {
            eprintln!("skipped: no mooncake_http_metadata_server (pip install mooncake-transfer-engine-non-cuda)");
            return None;
        };
        Some(Server::Mooncake(child, format!("127.0.0.1:{port}")).ready())
    }

    /// Waits until it answers.
    fn ready(self) -> Self {
        let deadline = Instant::now() + WAIT;
        while self.get("/ready").is_err() {
            assert!(Instant::now() < deadline, "{} did not come up", self.url());
            std::thread::sleep(Duration::from_millis(50));
        }
        self
    }

    fn url(&self) -> String {
        match self {
            Server::Redis(_, addr) => format!("redis://{addr}"),
            Server::Http(_, addr) | Server::Mooncake(_, addr) => format!("http://{addr}/metadata"),
        }
    }

    fn addr(&self) -> &str {
        match self {
            Server::Redis(_, addr) | Server::Http(_, addr) | Server::Mooncake(_, addr) => addr,
        }
    }

    fn get(&self, key: &str) -> kvring::Result<Option<Vec<u8>>> {
        let deadline = Instant::now() + Duration::from_secs(1);
        match self {
            Server::Redis(..) => Redis::new(RedisUrl::parse(&self.url())?).get(key, deadline),
            _ => HttpMetadata::new(HttpMetadataUrl::parse(&self.url())?).get(key, deadline),
        }
    }

    fn published(&self, name: &str) -> bool {
        self.get(&format!("{DEFAULT_PREFIX}{name}")).unwrap().is_some()
    }

    fn wait_for(&self, name: &str, present: bool, within: Duration) {
        let started = Instant::now();
        while self.published(name) != present {
            assert!(started.elapsed() < within, "{name} still {}", if present { "absent" } else { "present" });
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server (the engines keep going).
    fn kill(&mut self) {
        match self {
            Server::Redis(child, _) | Server::Mooncake(child, _) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            Server::Http(server, _) => drop(server.take()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Every server this host can run: redis, the test HTTP server, Mooncake's.
fn servers() -> Vec<Server> {
    [Server::redis(), Some(Server::http()), Server::mooncake()].into_iter().flatten().collect()
}

fn engine_on(server: &Server, name: &str) -> Engine {
    common::builder(name)
        .metadata(MetadataMode::parse(&server.url()).unwrap())
        .metadata_poll(Duration::from_millis(100))
        .metadata_ttl(Duration::from_secs(3))
        .build()
        .unwrap()
}

fn push(engine: &Engine, segment: &kvring::Segment, local: &kvring::Region) -> kvring::Outcome {
    let mut sub = engine.submitter().unwrap();
    let remote = segment.region(0).unwrap();
    let id = sub.submit(&Batch::write(segment).block(BlockDesc::new(local.id(), 0, remote, 0, 4096))).unwrap();
    sub.wait(id, WAIT).unwrap()
}

#[test]
fn engines_are_found_by_name_with_no_metadata_call_per_batch_and_withdrawn_at_shutdown() {
    for server in servers() {
        let url = server.url();
        let target = engine_on(&server, "decode-0");
        let _remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        assert!(server.published("decode-0"), "{url}");
        let initiator = engine_on(&server, "prefill-0");
        let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        let segment = initiator.open_segment_with("decode-0", Some(TransportKind::Tcp), WAIT).unwrap();
        assert_eq!(segment.epoch(), target.epoch(), "{url}");
        let after_open = initiator.metadata_calls();
        assert!(after_open >= 1, "{url}");
        for _ in 0..20 {
            assert!(push(&initiator, &segment, &local).is_done(), "{url}");
            initiator.open_segment("decode-0").unwrap();
        }
        assert_eq!(initiator.metadata_calls(), after_open, "{url}: no metadata call per batch or cached open");
        let error = initiator.open_segment("decode-9").unwrap_err().to_string();
        assert!(error.contains("no key /kvring/segments/decode-9") && error.contains(server.addr()), "{error}");
        target.shutdown();
        server.wait_for("decode-0", false, Duration::from_secs(2));
    }
}

#[test]
fn a_restarted_peer_is_noticed_by_the_watcher_and_reopened_by_name() {
    for server in servers() {
        let initiator = engine_on(&server, "prefill-0");
        let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        let first = engine_on(&server, "decode-r");
        let _region = first.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        let segment = initiator.open_segment_with("decode-r", Some(TransportKind::Tcp), WAIT).unwrap();
        assert!(push(&initiator, &segment, &local).is_done());
        drop(first);
        let second = engine_on(&server, "decode-r");
        let _region = second.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        let started = Instant::now();
        while !segment.is_stale() {
            assert!(started.elapsed() < WAIT, "{}: the restart was not noticed", server.url());
            std::thread::sleep(Duration::from_millis(10));
        }
        let reopened = initiator.open_segment_with("decode-r", Some(TransportKind::Tcp), WAIT).unwrap();
        assert_eq!(reopened.epoch(), second.epoch());
        assert!(push(&initiator, &reopened, &local).is_done());
    }
}

#[test]
fn a_server_down_at_start_is_named_and_one_lost_later_stops_no_transfer() {
    for mut server in servers() {
        let url = server.url();
        let target = engine_on(&server, "decode-0");
        let _remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        let initiator = engine_on(&server, "prefill-0");
        let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        let segment = initiator.open_segment_with("decode-0", Some(TransportKind::Tcp), WAIT).unwrap();
        server.kill();
        let error = initiator.open_segment_with("decode-1", None, Duration::from_secs(2)).unwrap_err().to_string();
        assert!(error.contains(server.addr()), "{url}: {error}");
        std::thread::sleep(Duration::from_millis(300));
        assert!(!segment.is_stale(), "{url}: an unreachable server changes nothing");
        assert!(push(&initiator, &segment, &local).is_done(), "{url}");
        // A new engine cannot publish, and says where it tried.
        let mode = MetadataMode::parse(&url).unwrap();
        let error = common::builder("decode-2").metadata(mode).build().unwrap_err().to_string();
        assert!(error.contains(server.addr()), "{url}: {error}");
    }
}

/// redis keeps the entry of an engine killed with `kill -9` for its TTL
/// only; the HTTP server has no TTL, and a restart of the name replaces it.
#[test]
fn a_killed_engine_s_redis_entry_goes_with_its_ttl() {
    let Some(server) = Server::redis() else { return };
    let url = server.url();
    let (mut child, line) = common::child::serve_published("decode-k", &url, "1s");
    assert!(line.contains("metadata=redis://"), "{line}");
    assert!(server.published("decode-k"));
    child.kill().unwrap();
    child.wait().unwrap();
    server.wait_for("decode-k", false, Duration::from_secs(5));
}

#[test]
fn bad_urls_get_clear_errors() {
    common::assert_urls_refused(&[
        ("redis://localhost", "needs host:port"),
        ("redis://localhost:6379/db", "is not a number"),
        ("http://localhost:8080/metadata?key=x", "without '?'"),
        ("https://localhost:8080/metadata", "neither P2PHANDSHAKE nor etcd://"),
    ]);
    let port = free_port();
    for url in [format!("redis://127.0.0.1:{port}"), format!("http://127.0.0.1:{port}/metadata")] {
        let mode = MetadataMode::parse(&url).unwrap();
        let error = common::builder("nobody-home").metadata(mode).build().unwrap_err().to_string();
        assert!(error.contains(&format!("127.0.0.1:{port}")) && error.contains("connecting"), "{url}: {error}");
    }
}

#[test]
fn a_tokened_engine_publishes_only_its_name_control_address_and_epoch() {
    const TOKEN: &str = "publication-token";
    for server in servers() {
        let tokened = |name: &str| {
            common::builder(name).token(TOKEN).metadata(MetadataMode::parse(&server.url()).unwrap()).build().unwrap()
        };
        let engine = tokened("decode-sealed");
        let stored = server.get(&format!("{DEFAULT_PREFIX}decode-sealed")).unwrap().expect("published");
        // What any reader of the store sees: no pid, host, cma page or its
        // address, data endpoint, regions or RDMA keys.
        let published = <kvring::testing::control::SegmentDescriptor as prost::Message>::decode(stored.as_slice())
            .expect("a descriptor");
        let outsider_may_know = kvring::testing::control::SegmentDescriptor {
            name: "decode-sealed".into(),
            epoch: engine.epoch(),
            control_addr: engine.control_addr().to_string(),
            ..Default::default()
        };
        assert_eq!(published, outsider_may_know, "{}", server.url());
        // A tokened peer still finds it by name, and gets the rest from the
        // proven handshake.
        let _region = engine.alloc_region(4096, RegionInfo::raw()).unwrap();
        let peer = tokened("prefill-sealed");
        let segment = peer.open_segment_with("decode-sealed", Some(TransportKind::Tcp), WAIT).unwrap();
        assert_eq!((segment.epoch(), segment.regions().len()), (engine.epoch(), 1));
        let local = peer.alloc_region(4096, RegionInfo::raw()).unwrap();
        assert!(push(&peer, &segment, &local).is_done(), "{}", server.url());
    }
}
