//! Every wait on a peer ends in a typed error by its own deadline
//! (docs/DEADLINES.md has the table of waits this file and others prove).
//!
//! Each test stands up a fake peer that stalls at one step (the connect is
//! never accepted; the greeting comes and the handshake answer does not;
//! the handshake is answered and the data listener never is; a metadata
//! server sends half an answer; the GPU descriptor socket never speaks; a
//! target stops reading) and asserts the error the call ends in. A call
//! runs on a thread of its own, and the test fails (rather than hangs) if
//! it has not returned after ten times its deadline; no test asserts how
//! long a call took.

mod common;

use common::WAIT;
use kvring::gpu::{Gpu, SimGpu};
use kvring::testing::control::{preface, read_frame, response, write_frame, MAX_CONTROL_MESSAGE_BYTES};
use kvring::testing::control::{request, HandshakeResponse, Request};
use kvring::testing::control::{GpuHandle, RegionDescriptor, SegmentDescriptor as WireDescriptor};
use kvring::{Access, Batch, BlockDesc, Engine, Error, MetadataMode, Outcome, RegionId, RegionInfo, TransportKind};
use prost::Message;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

/// The deadline every stalled call here is given.
const DEADLINE: Duration = Duration::from_millis(500);

/// Runs `call` on a thread of its own and returns what it returned; fails
/// the test if that takes more than ten times [`DEADLINE`] (the call and
/// what it holds are leaked with the thread then).
fn bounded<T: Send + 'static>(what: &str, call: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(call());
    });
    rx.recv_timeout(DEADLINE * 10).unwrap_or_else(|_| panic!("{what} had not returned after ten times its deadline"))
}

/// Asserts a `Timeout` that names the wait that ran out (`wait`, a part of
/// its `what`).
fn assert_timeout<T: std::fmt::Debug>(what: &str, wait: &str, result: kvring::Result<T>) {
    match result {
        Err(Error::Timeout { what: named, .. }) => {
            assert!(named.contains(wait), "{what}: the timeout names {named:?}, not the wait {wait:?}")
        }
        other => panic!("{what}: expected Error::Timeout, got {other:?}"),
    }
}

/// A TCP listener whose one queue place is taken and that never accepts:
/// the kernel drops every further SYN (listen(2): a full accept queue),
/// so a connect to it can only end at the caller's deadline.
struct Squatter {
    _listener: TcpListener,
    _filler: TcpStream,
    addr: SocketAddr,
}

impl Squatter {
    fn new() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        // SAFETY: listen(2) again on a socket this test owns only sets its
        // backlog (to 0: one connection completes, the rest are dropped).
        assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0);
        let addr = listener.local_addr().unwrap();
        let filler = TcpStream::connect(addr).unwrap();
        Self { _listener: listener, _filler: filler, addr }
    }
}

/// A peer that accepts every connection, runs `answer` on it (the step it
/// takes before it stalls), then holds it open and says nothing more until
/// dropped.
struct Staller {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Staller {
    fn new(answer: impl Fn(&mut TcpStream) + Send + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            while !stopping.load(Ordering::Acquire) {
                match listener.accept() {
                    Ok((mut stream, _)) => {
                        stream.set_nonblocking(false).unwrap();
                        stream.set_read_timeout(Some(WAIT)).unwrap();
                        answer(&mut stream);
                        held.push(stream);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Self { addr, stop, thread: Some(thread) }
    }

    /// A peer that never sends a byte (but accepts, and holds).
    fn mute() -> Self {
        Self::new(|_| {})
    }

    fn addr(&self) -> String {
        self.addr.to_string()
    }
}

impl Drop for Staller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Reads the client's control preface and its first request frame.
fn read_preface_and_request(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut theirs = [0u8; 8];
    stream.read_exact(&mut theirs).ok()?;
    read_frame(stream, MAX_CONTROL_MESSAGE_BYTES).ok().flatten()
}

/// A control peer that answers every untokened handshake with
/// `descriptor` and stalls on any other request.
fn handshaking_peer(descriptor: WireDescriptor) -> Staller {
    let descriptor = Arc::new(Mutex::new(descriptor));
    let staller = Staller::new({
        let descriptor = descriptor.clone();
        move |stream| {
            let _ = stream.write_all(&preface());
            let mut theirs = [0u8; 8];
            if stream.read_exact(&mut theirs).is_err() {
                return;
            }
            while let Ok(Some(frame)) = read_frame(stream, MAX_CONTROL_MESSAGE_BYTES) {
                let Ok(Request { body: Some(request::Body::Handshake(_)), .. }) = Request::decode(frame.as_slice())
                else {
                    return;
                };
                let segment = Some(Box::new(descriptor.lock().unwrap().clone()));
                let answer = HandshakeResponse { segment, ..Default::default() };
                if write_frame(stream, &response(response::Body::Handshake(answer))).is_err() {
                    return;
                }
            }
        }
    });
    descriptor.lock().unwrap().control_addr = staller.addr();
    staller
}

/// A real target's descriptor, with its tcp data listener moved to `data`.
fn target_with_data_listener(target: &Engine, data: &str) -> WireDescriptor {
    let mut descriptor = kvring::testing::descriptor(target);
    descriptor.tcp_addr = Some(data.to_string());
    descriptor.to_proto()
}

fn open_tcp(addr: String, what: &'static str) -> kvring::Result<()> {
    let engine = common::engine("deadline-initiator");
    bounded(what, move || engine.open_segment_with(&addr, Some(TransportKind::Tcp), DEADLINE).map(drop))
}

// --- the control connection and its handshake ---

#[test]
fn a_control_connect_the_peer_never_accepts_ends_in_timeout() {
    let squatter = Squatter::new();
    let result = open_tcp(squatter.addr.to_string(), "open_segment to a full accept queue");
    assert_timeout("connect never accepted", "the peer's control port to accept", result);
}

#[test]
fn a_peer_that_accepts_and_never_greets_ends_in_timeout() {
    let mute = Staller::mute();
    assert_timeout("no greeting", "the peer's control preface", open_tcp(mute.addr(), "open_segment to a mute peer"));
}

#[test]
fn a_peer_that_greets_and_never_answers_the_handshake_ends_in_timeout() {
    let greeter = Staller::new(|stream| {
        let _ = stream.write_all(&preface());
    });
    assert_timeout(
        "greeting, no handshake answer",
        "the peer's control answer",
        open_tcp(greeter.addr(), "open_segment to a greeter"),
    );
}

#[test]
fn a_peer_that_sends_half_a_handshake_answer_ends_in_timeout() {
    let half = Staller::new(|stream| {
        if read_preface_and_request(stream).is_some() {
            // A length of 1000 bytes, then ten of them.
            let mut bytes = preface().to_vec();
            bytes.extend_from_slice(&1000u32.to_le_bytes());
            bytes.extend_from_slice(&[0u8; 10]);
            let _ = stream.write_all(&bytes);
        }
    });
    assert_timeout(
        "half a handshake answer",
        "the peer's control answer",
        open_tcp(half.addr(), "open_segment to half an answer"),
    );
}

/// Forwards everything the client sends to `target`, and of what `target`
/// answers only the preface and the first frame: the tokened handshake's
/// first step (the challenge) reaches the client, the answer to its
/// second step (the proof) never does.
fn relay_of_one_answer(target: SocketAddr) -> Staller {
    Staller::new(move |client| {
        let Ok(server) = TcpStream::connect(target) else { return };
        let (mut up_from, mut up_to) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut up_from, &mut up_to);
        });
        let (mut down_from, mut down_to) = (server, client.try_clone().unwrap());
        std::thread::spawn(move || {
            let mut head = [0u8; 12];
            if down_from.read_exact(&mut head).is_err() {
                return;
            }
            let len = u32::from_le_bytes(head[8..12].try_into().unwrap()) as usize;
            let mut body = vec![0u8; len];
            if down_from.read_exact(&mut body).is_err() {
                return;
            }
            let _ = down_to.write_all(&head).and_then(|()| down_to.write_all(&body));
            // Everything after it is swallowed.
            let _ = std::io::copy(&mut down_from, &mut std::io::sink());
        });
    })
}

#[test]
fn a_tokened_handshake_whose_second_answer_never_comes_ends_in_timeout() {
    const TOKEN: &str = "deadlines-token";
    let target = common::builder("deadline-tokened-target").token(TOKEN).build().unwrap();
    let relay = relay_of_one_answer(target.control_addr());
    let initiator = common::builder("deadline-tokened-initiator").token(TOKEN).build().unwrap();
    let addr = relay.addr();
    let result = bounded("a tokened open through a relay that drops the second answer", move || {
        initiator.open_segment_with(&addr, Some(TransportKind::Tcp), DEADLINE).map(drop)
    });
    assert_timeout("the proof's answer never came", "the peer's control answer", result);
}

/// The handshake is answered, every later control request is not: a
/// notification over the control plane (an shm link carries none), a
/// checksum of the target's region and its KV layout (memory info) each
/// end at their own timeout. The
/// fake relays a real target's descriptor (same process, so shm maps its
/// real regions).
#[test]
fn control_requests_after_the_handshake_that_are_never_answered_end_in_timeout() {
    let target = common::engine("deadline-target");
    let region = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let peer = handshaking_peer(kvring::testing::descriptor(&target).to_proto());
    let initiator = common::engine("deadline-notifier");
    let segment = initiator.open_segment_with(&peer.addr(), Some(TransportKind::Shm), WAIT).unwrap();
    let id = region.id();
    let (notified, summed, layout) = bounded("control requests to a peer that stopped answering", move || {
        let notified = initiator.notify(&segment, b"blocks of request 42 are in place", DEADLINE);
        (notified, segment.remote_checksum(id, 0, 4096, DEADLINE), segment.kv_layout(DEADLINE))
    });
    assert_timeout("notify never answered", "the peer's control answer", notified);
    assert_timeout("checksum never answered", "the peer's control answer", summed);
    assert_timeout("memory info never answered", "the peer's control answer", layout);
}

// --- the tcp data listener, after a handshake that succeeded ---

#[test]
fn a_data_listener_that_never_accepts_ends_in_timeout() {
    let target = common::engine("deadline-target");
    let _region = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let squatter = Squatter::new();
    let peer = handshaking_peer(target_with_data_listener(&target, &squatter.addr.to_string()));
    assert_timeout(
        "data connect never accepted",
        "the data listener to accept",
        open_tcp(peer.addr(), "open_segment, data listener squatted"),
    );
}

#[test]
fn a_data_listener_that_never_answers_the_hello_ends_in_timeout() {
    let target = common::engine("deadline-target");
    let _region = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let mute = Staller::mute();
    let peer = handshaking_peer(target_with_data_listener(&target, &mute.addr()));
    assert_timeout(
        "no hello answer",
        "the data listener's hello",
        open_tcp(peer.addr(), "open_segment, data listener mute"),
    );
}

#[test]
fn a_data_listener_that_sends_half_its_hello_ends_in_timeout() {
    let target = common::engine("deadline-target");
    let _region = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // The hello's magic ("KVTH", `HELLO_MAGIC`) and its version (5), then nothing.
    let half = Staller::new(|stream| {
        let _ = stream.write_all(b"KVTH\x05");
    });
    let peer = handshaking_peer(target_with_data_listener(&target, &half.addr()));
    assert_timeout("half a hello", "the data listener's hello", open_tcp(peer.addr(), "open_segment, half a hello"));
}

/// A target that stops reading mid-stream (SIGSTOP: the kernel still
/// takes the bytes, nothing answers them): the batch fails
/// `PeerStalled` (not `PeerRestarted`: the target did not restart) once
/// the link has been silent for `io_timeout`.
#[test]
fn a_target_that_stops_answering_fails_the_batch_at_the_io_timeout() {
    let (child, line) = common::child::serve(&[
        "--name",
        "decode-0",
        "--listen",
        "127.0.0.1:0",
        "--region-size",
        "1MiB",
        "--parent-watch",
    ]);
    let addr = common::child::field(&line, "listen=").to_string();
    let engine = common::builder("deadline-frozen-initiator").io_timeout(DEADLINE).build().unwrap();
    let local = engine.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let segment = engine.open_segment_with(&addr, Some(TransportKind::Tcp), WAIT).unwrap();
    let remote = segment.region(0).unwrap();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGSTOP) };
    common::wait_until_stopped(child.id());
    let outcome = bounded("a batch to a stopped target", move || {
        let mut sub = engine.submitter().unwrap();
        let descs = [BlockDesc::new(local.id(), 0, remote, 0, 4096)];
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        sub.wait(id, DEADLINE * 8)
    });
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGCONT) };
    assert!(matches!(outcome, Ok(Outcome::Failed(Error::PeerStalled { .. }))), "{outcome:?}");
}

/// A stopping engine waits a bounded grace (`STOP_GRACE`, 2 s) for chunks
/// a frozen target holds, then ends their batch, failed, rather than
/// waiting for the target (here its io timeout is a minute, so only the
/// stop can end it).
#[test]
fn a_stopping_engine_ends_the_batch_a_frozen_target_holds() {
    let (child, line) = common::child::serve(&[
        "--name",
        "decode-0",
        "--listen",
        "127.0.0.1:0",
        "--region-size",
        "8MiB",
        "--parent-watch",
    ]);
    let addr = common::child::field(&line, "listen=").to_string();
    let engine = common::builder("deadline-stopping").io_timeout(Duration::from_secs(60)).build().unwrap();
    let local = engine.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    let segment = engine.open_segment_with(&addr, Some(TransportKind::Tcp), WAIT).unwrap();
    let remote = segment.region(0).unwrap();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGSTOP) };
    common::wait_until_stopped(child.id());
    let mut sub = engine.submitter().unwrap();
    // 4 MiB: more than the socket buffers hold, so chunks stay in flight.
    let descs: Vec<_> = (0..64u64).map(|i| BlockDesc::new(local.id(), i << 16, remote, i << 16, 1 << 16)).collect();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    engine.shutdown();
    let outcome = sub.wait(id, WAIT);
    // SAFETY: as above.
    unsafe { libc::kill(child.id() as i32, libc::SIGCONT) };
    assert!(matches!(outcome, Ok(Outcome::Failed(_))), "{outcome:?}");
}

// --- metadata servers ---

/// An engine on the metadata server at `url`, with the test's deadline on
/// every control-plane call (its publication at start among them).
fn build_on(url: &str) -> kvring::Result<Engine> {
    let mode = MetadataMode::parse(url).unwrap();
    let builder = common::builder("deadline-published").metadata(mode).control_timeout(DEADLINE);
    bounded("an engine publishing to a stalled server", move || builder.build())
}

#[test]
fn an_etcd_that_accepts_and_never_answers_fails_the_engine_s_start_with_timeout() {
    let mute = Staller::mute();
    assert_timeout("etcd mute", "the HTTP server's answer", build_on(&format!("etcd://{}", mute.addr())).map(drop));
}

#[test]
fn an_etcd_that_never_accepts_fails_the_engine_s_start_with_timeout() {
    let squatter = Squatter::new();
    assert_timeout(
        "etcd squatted",
        "the HTTP server (etcd's gateway, Mooncake's metadata server) to accept",
        build_on(&format!("etcd://{}", squatter.addr)).map(drop),
    );
}

#[test]
fn a_redis_that_sends_half_a_reply_fails_the_engine_s_start_with_timeout() {
    // "+O" of "+OK\r\n", and then nothing.
    let half = Staller::new(|stream| {
        let _ = stream.write_all(b"+O");
    });
    assert_timeout(
        "half a RESP reply",
        "the redis metadata server",
        build_on(&format!("redis://{}", half.addr())).map(drop),
    );
}

/// Reads one HTTP request (head and Content-Length body); its first line.
fn read_http_request(stream: &mut TcpStream) -> Option<String> {
    let mut raw = Vec::new();
    let mut byte = [0u8; 1];
    while !raw.ends_with(b"\r\n\r\n") {
        stream.read_exact(&mut byte).ok()?;
        raw.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&raw).to_string();
    let length = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string()))
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).ok()?;
    head.lines().next().map(str::to_string)
}

/// Mooncake's HTTP metadata protocol, stalling on lookups: every PUT and
/// DELETE is answered 200, every GET with a head promising 100 bytes and
/// one of them.
fn http_stalling_on_get() -> Staller {
    Staller::new(|stream| {
        let Some(line) = read_http_request(stream) else { return };
        let answer: &[u8] = match line.starts_with("GET ") {
            true => b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{",
            false => b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        };
        let _ = stream.write_all(answer);
        if !line.starts_with("GET ") {
            let _ = stream.shutdown(std::net::Shutdown::Write);
        }
    })
}

#[test]
fn a_lookup_the_http_metadata_server_half_answers_ends_in_timeout() {
    let server = http_stalling_on_get();
    let engine = build_on(&format!("http://{}/metadata", server.addr())).expect("PUT is answered");
    let (result, engine) =
        bounded("a lookup by name", move || (engine.open_segment_with("decode-9", None, DEADLINE).map(drop), engine));
    assert_timeout("half an HTTP answer to GET", "the HTTP server's answer", result);
    // Its withdrawal at drop looks the entry up first, and is half
    // answered too: the drop still ends (the withdrawal's own deadline).
    bounded("dropping an engine whose withdrawal stalls", move || drop(engine));
}

// --- the GPU descriptor socket ---

/// The GPU descriptor socket accepts (its backlog does) and never says a
/// word: the opener's proof exchange ends at the open's deadline.
/// (`hostile_review2::a_socket_that_never_accepts_does_not_hang_the_opener_past_its_deadline`
/// stalls the step before: a socket whose queue is full.)
#[test]
fn a_gpu_descriptor_socket_that_never_answers_ends_in_timeout() {
    use std::os::linux::net::SocketAddrExt;
    let gpu = Arc::new(SimGpu::new(1, Duration::from_micros(50)));
    let initiator = common::builder("deadline-gpu-opener").gpu(gpu as Arc<dyn Gpu>).build().unwrap();
    let name = format!("kvring-gpu-fds-{:016x}-{:016x}", 0xdead_11e5_u64, std::process::id());
    let socket = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let _silent = std::os::unix::net::UnixListener::bind_addr(&socket).unwrap();
    let ours = kvring::testing::descriptor(&initiator);
    let len = 1 << 20;
    let descriptor = WireDescriptor {
        name: "silent-gpu".into(),
        epoch: 0x5151,
        host_id: ours.host_id,
        pid: std::process::id(),
        instance: 0x1234_5678,
        gpu_fds: name,
        regions: vec![RegionDescriptor {
            id: RegionId::new(0, 1).raw(),
            len,
            access: Access::ALL.bits(),
            addr: 0x7000_0000,
            gpu: 1,
            gpu_handles: vec![GpuHandle { kind: 1, handle: vec![0; 64], offset: 0, len }],
            ..Default::default()
        }],
        ..Default::default()
    };
    let peer = handshaking_peer(descriptor);
    let addr = peer.addr();
    let result = bounded("open_segment over a mute GPU socket", move || {
        initiator.open_segment_with(&addr, Some(TransportKind::CudaIpc), DEADLINE).map(drop)
    });
    assert_timeout("mute GPU descriptor socket", "the peer's GPU socket", result);
}

// --- drains ---

/// A same-host peer's copy marker in an shm region that never clears (its
/// `busy` word, as a peer stopped inside a copy leaves it): `unregister`
/// waits out `SHM_REVOKE_WAIT` and then ends, typed.
/// (Who may set that word is `hostile_review2`'s question; this test only
/// asks that the owner's wait ends.)
#[test]
fn an_unregister_whose_peer_copy_never_ends_returns_region_busy() {
    use std::os::unix::fs::FileExt;
    let owner = common::engine("deadline-shm-owner");
    let region = owner.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let path = region.shm_path().expect("alloc_region is shm-backed").to_path_buf();
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    file.write_all_at(&1u64.to_le_bytes(), 56).unwrap(); // the header's busy word (version 5)
    let id = region.id();
    let owner = Arc::new(owner);
    let unregistering = owner.clone();
    // SHM_REVOKE_WAIT (2 s) is the deadline here.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(unregistering.unregister(id));
    });
    let result = rx.recv_timeout(Duration::from_secs(20)).expect("unregister had not returned after 10x its wait");
    match result {
        Err(Error::RegionBusy { region, in_flight }) => assert_eq!((region, in_flight), (id, 1)),
        other => panic!("expected RegionBusy, got {other:?}"),
    }
    // Cleared, the region goes.
    file.write_all_at(&0u64.to_le_bytes(), 56).unwrap();
    owner.unregister(id).unwrap();
    drop(region);
}

// --- what serves peers ---

/// A scraper that connects to `/metrics` and never sends its request is
/// cut at the server's request deadline (`REQUEST_TIMEOUT`, 2 s): the
/// server closes, and the read sees the end of the stream, long before
/// this side's own read timeout.
#[test]
fn a_scraper_that_never_sends_its_request_is_cut() {
    let engine = common::builder("deadline-metrics").metrics("127.0.0.1:0".parse().unwrap()).build().unwrap();
    let mut silent = TcpStream::connect(engine.metrics_addr().expect("served")).unwrap();
    silent.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut byte = [0u8; 1];
    match silent.read(&mut byte) {
        Ok(0) => {}
        // Closed with this side's nothing unread: a reset is a cut too.
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected the server to close the connection, got {other:?}"),
    }
}
