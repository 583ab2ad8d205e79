//! Review 5 (hostile outsider): probes of today's merged changes that touch
//! kvring's promises (docs/SECURITY.md). Each asserts the promised
//! behaviour: it fails where a hole was found and passes once it is closed.

mod common;

use common::child::{field, serve, Reaped};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A `kvring serve` child on loopback (killed and reaped on drop), with its
/// raw-TCP baseline sink's address.
struct Serve {
    _child: Reaped,
    raw: String,
}

impl Serve {
    fn start(extra: &[&str]) -> Self {
        let mut args = vec!["--name", "review5", "--listen", "127.0.0.1:0", "--region-size", "1048576", "--raw-sink"];
        args.extend_from_slice(extra);
        let (child, line) = serve(&args);
        Self { raw: field(&line, "raw=").to_string(), _child: child }
    }

    /// A raw-sink connection whose challenge is answered with zeros (a sink
    /// without a token takes any answer).
    fn raw_client(&self) -> TcpStream {
        let mut stream = TcpStream::connect(&self.raw).expect("connect to the raw sink");
        // A deadline for every read below: a hang fails the test, not CI.
        stream.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut challenge = [0u8; 16];
        stream.read_exact(&mut challenge).expect("challenge");
        stream.write_all(&[0u8; 32]).expect("answer");
        stream
    }
}

fn request(op: u64, bytes: u64, span: u64) -> [u8; 24] {
    let mut r = [0u8; 24];
    for (at, field) in [op, bytes, span].into_iter().enumerate() {
        r[at * 8..at * 8 + 8].copy_from_slice(&field.to_le_bytes());
    }
    r
}

/// src/bin/kvring/raw.rs `serve`/`ping_pong`: a latency-floor request of 0
/// bytes (op 3) makes the sink's `read_exact` of an empty block succeed at
/// once, so the sink answers 8 bytes, again and again, to a client that sent
/// nothing more than its 24-byte request: an unbounded stream from one
/// request, its thread spinning on a lane's core. A 0-byte ping-pong is not
/// a request the bench ever sends (its floor's block is at least 1 byte):
/// the sink should close it, as it closes any other request it refuses.
#[test]
fn the_raw_sink_refuses_a_zero_byte_ping_pong_instead_of_streaming_unasked() {
    let serve = Serve::start(&[]);
    let mut client = serve.raw_client();
    client.write_all(&request(3, 0, 0)).expect("request");
    // The client sends nothing more. A sink that refuses closes (EOF); one
    // that streams unasked sends its 8-byte answers.
    let mut unasked = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match client.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                unasked.extend_from_slice(&buf[..n]);
                if unasked.len() >= 1 << 16 {
                    break;
                }
            }
            Err(e) => panic!("the sink neither closed nor answered: {e}"),
        }
    }
    assert!(unasked.is_empty(), "the sink sent {} bytes nobody asked for (and was still sending)", unasked.len());
}

/// The sink is a bench's baseline, not a service: `kvring serve` starts it
/// only with `--raw-sink` (the bench's own target passes it) and otherwise
/// prints `raw=-`.
#[test]
fn the_raw_sink_runs_only_when_asked() {
    let (child, line) = serve(&["--name", "review5-nosink", "--listen", "127.0.0.1:0", "--region-size", "1048576"]);
    drop(child);
    assert!(line.split_whitespace().any(|f| f == "raw=-"), "a sink nobody asked for: {line:?}");
    let asked = Serve::start(&[]);
    assert!(asked.raw.parse::<std::net::SocketAddr>().is_ok(), "--raw-sink: {}", asked.raw);
}

/// An address where nothing listens (bound, then closed): an open of it
/// fails at once with a typed error.
fn closed_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    drop(listener);
    addr
}

fn engine(name: &str) -> kvring::Engine {
    kvring::Engine::builder().name(name).listen("127.0.0.1:0".parse().unwrap()).build().expect("engine")
}

/// src/engine/open_many.rs `open_many` (`Instant::now() + timeout`) and
/// src/engine/segments.rs `open_segment_by`: a caller's timeout too large
/// for an `Instant` (Duration::MAX; from Python any float of seconds above
/// about 1e19 passes `seconds()` and gets here too) panics with "overflow
/// when adding duration to instant" instead of being taken as "no
/// deadline" or refused with a typed error.
#[test]
fn a_huge_timeout_is_a_typed_error_or_no_deadline_never_a_panic() {
    let initiator = engine("review5-huge-timeout");
    let names = [closed_addr()];
    let many = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        initiator.open_many(&names, None, Duration::MAX).into_iter().map(|r| r.map(|_| ())).collect::<Vec<_>>()
    }));
    let many = many.unwrap_or_else(|_| panic!("open_many panicked on Duration::MAX"));
    assert!(many[0].is_err(), "nothing listens there: {many:?}");
    let one = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        initiator.open_segment_with(&names[0], None, Duration::MAX).map(|_| ())
    }));
    let one = one.unwrap_or_else(|_| panic!("open_segment_with panicked on Duration::MAX"));
    assert!(one.is_err(), "nothing listens there");
}

/// src/engine/submitter.rs `wait` (`Instant::now() + timeout`) and
/// src/engine/notify.rs `notify`: "wait for ever" written the obvious way,
/// `Duration::MAX`, panics even for a batch that has already ended.
#[test]
fn waiting_or_notifying_with_duration_max_never_panics() {
    let target = engine("review5-max-target");
    let remote = target.alloc_region(4096, kvring::RegionInfo::raw()).unwrap();
    let initiator = engine("review5-max-initiator");
    let local = initiator.alloc_region(4096, kvring::RegionInfo::raw()).unwrap();
    let segment = initiator
        .open_segment_with(
            &target.control_addr().to_string(),
            Some(kvring::TransportKind::Tcp),
            Duration::from_secs(10),
        )
        .unwrap();
    let mut sub = initiator.submitter().unwrap();
    let desc = kvring::BlockDesc::new(local.id(), 0, remote.id(), 0, 4096);
    let id = sub.submit(&kvring::Batch::write(&segment).descs(&[desc])).unwrap();
    assert!(sub.wait(id, Duration::from_secs(10)).unwrap().is_done());
    let waited = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| sub.wait(id, Duration::MAX).map(|_| ())));
    assert!(waited.is_ok(), "wait(id, Duration::MAX) panicked");
    let notified = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        initiator.notify(&segment, b"in place", Duration::MAX)
    }));
    assert!(notified.is_ok(), "notify(.., Duration::MAX) panicked");
}

/// src/transport/tcp/conn.rs `progress`, docs/DEADLINES.md: when the ack of
/// an admitted chunk never comes (the target process is stopped: its kernel
/// still takes the bytes), the initiator cannot recall what already left:
/// neither a cancel nor closing the connection (even with a reset: Linux
/// keeps what the target's socket already queued readable) stops a frozen
/// target from landing it once it runs again. What kvring promises instead:
/// the batch ends within `io_timeout` with the typed `PeerStalled` error
/// (not `PeerRestarted`: the peer did not restart), whose message says that
/// bytes already sent may still land and that a fence on the destination
/// range stops them. (First written as "lands nothing after it ends", which
/// no initiator can promise against a frozen target.)
#[test]
fn a_cancelled_tcp_push_whose_ack_never_comes_ends_with_a_typed_stall_that_names_the_fence() {
    const LEN: usize = 256 << 10;
    let (target, line) = serve(&["--name", "review5-stopped", "--listen", "127.0.0.1:0", "--region-size", "1048576"]);
    let addr = field(&line, "listen=").to_string();
    let pid = target.id() as libc::pid_t;
    let initiator = kvring::Engine::builder()
        .name("review5-stopped-initiator")
        .listen("127.0.0.1:0".parse().unwrap())
        .io_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let local = initiator.alloc_region(LEN, kvring::RegionInfo::raw()).unwrap();
    let segment =
        initiator.open_segment_with(&addr, Some(kvring::TransportKind::Tcp), Duration::from_secs(10)).unwrap();
    let remote = segment.region(0).unwrap();
    // SAFETY: stopping our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // A group stop reaches every thread only once one of them handles the
    // signal; until then a connection thread could still take the write and
    // ack it (CI saw `Done` this way on a loaded host).
    common::wait_until_stopped(pid as u32);
    let mut sub = initiator.submitter().unwrap();
    let desc = kvring::BlockDesc::new(local.id(), 0, remote, 0, LEN as u64);
    let id = sub.submit(&kvring::Batch::write(&segment).descs(&[desc])).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    sub.cancel(id).unwrap();
    // Its deadline: the wait returns the batch's end, not `Timeout`.
    let outcome = sub.wait(id, Duration::from_secs(30));
    // SAFETY: our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    drop(target);
    let outcome = outcome.expect("the stalled batch ends within its wait");
    match &outcome {
        kvring::Outcome::Failed(error @ kvring::Error::PeerStalled { waited, .. }) => {
            assert_eq!(*waited, Duration::from_millis(500));
            assert_eq!(error.code(), kvring::ErrorCode::PeerRestarted, "as a peer gone: open it again");
            let message = error.to_string();
            assert!(message.contains("may") && message.contains("land") && message.contains("fence"), "{message}");
        }
        other => panic!("a stalled target must end the batch with PeerStalled: {other:?}"),
    }
}

/// src/host.rs `shm_copy` (src/transport/shm.rs `copy_pieces`): pieces of
/// `SHM_COPY_PIECE_BYTES` with the last one short; lengths around every
/// piece boundary, 0 and 1, at misaligned addresses, inside a buffer with
/// guard bytes on both sides: every byte copied, none written outside.
/// (Held: this passes today.)
#[test]
fn shm_copy_writes_exactly_its_destination_at_every_piece_boundary() {
    let piece = kvring::host::SHM_COPY_PIECE_BYTES;
    const GUARD: usize = 4096;
    let mut lens = vec![0, 1, 63, 64, 65, 4095, 4097];
    for k in 1..=3 {
        lens.extend([k * piece - 1, k * piece, k * piece + 1]);
    }
    for len in lens {
        for misalign in [0, 1, 7, 63] {
            let src: Vec<u8> = (0..len + misalign).map(|i| (i * 31 + 7) as u8).collect();
            let mut dst = vec![0xeeu8; GUARD + misalign + len + GUARD];
            kvring::host::shm_copy(&mut dst[GUARD + misalign..GUARD + misalign + len], &src[misalign..]);
            assert!(dst[..GUARD + misalign].iter().all(|&b| b == 0xee), "len {len}+{misalign}: before");
            assert!(dst[GUARD + misalign + len..].iter().all(|&b| b == 0xee), "len {len}+{misalign}: after");
            assert_eq!(&dst[GUARD + misalign..GUARD + misalign + len], &src[misalign..], "len {len}+{misalign}");
        }
    }
}
