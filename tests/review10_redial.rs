//! Hostile review 10: the tcp redial after `dialling()` / `park()` took
//! the place of `park_while_dialling` (commit 21f88e8). A proxy of the
//! test's own stands between a real initiator and a real target's data
//! port (as in review9_redial, whose proxy this copies), so the test
//! decides what each dial meets. Probed: a chunk withdrawn (deadline,
//! cancel) while parked is never sent once the slow dial answers; a
//! cancel in the middle of parked chunks leaves the others, in order,
//! landing once; a notification parked behind a peer that closes every
//! dial after its hello ends typed with a bounded number of dials, and
//! once the peer serves again nothing is delivered twice.

mod common;

use common::WAIT;
use kvring::gpu::{Gpu, SimGpu};
use kvring::testing::tcp::SERVER_HELLO_BYTES;
use kvring::{Batch, BlockDesc, Engine, Outcome, RegionInfo, Segment, TransportKind};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The client hello's size (the server hello's is exported).
const CLIENT_HELLO_BYTES: usize = std::mem::size_of::<kvring::testing::tcp::ClientHello>();

/// What the proxy does with one accepted data connection.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Relays both ways to the target.
    Relay,
    /// Relays the hello both ways, then closes the initiator's side at
    /// once (a peer that accepts a dial and closes again).
    CloseAfterHello,
    /// Relays, after holding the connection unanswered this long (a dial
    /// that takes a while: what comes meanwhile is parked).
    RelayAfter(Duration),
}

/// A proxy in front of a target's data port.
struct Proxy {
    addr: SocketAddr,
    /// Accepted connections so far (each a dial of the initiator).
    dials: Arc<AtomicUsize>,
    /// The initiator's side of each accepted connection, by order.
    accepted: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    /// Closes the `n`th accepted connection both ways (as the target's idle
    /// close or an eviction would) and waits until the initiator's end has
    /// read it (`CLOSE_WAIT`), before any chunk is sent on it.
    fn close(&self, n: usize) {
        let s = self.accepted.lock().unwrap()[n].try_clone().unwrap();
        s.shutdown(std::net::Shutdown::Both).unwrap();
        let deadline = Instant::now() + WAIT;
        while !closed_by_peer_towards(&self.addr) {
            assert!(Instant::now() < deadline, "the initiator never saw the close");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn dials(&self) -> usize {
        self.dials.load(Ordering::SeqCst)
    }
}

/// A proxy to `upstream` whose `n`th connection (from 0) meets `mode(n)`.
fn proxy(upstream: SocketAddr, mode: impl Fn(usize) -> Mode + Send + 'static) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let dials = Arc::new(AtomicUsize::new(0));
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let (count, keep) = (dials.clone(), accepted.clone());
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let n = count.fetch_add(1, Ordering::SeqCst);
            // Past a few hundred dials the test has its answer: close this
            // one and stop listening (later dials are refused), so a
            // looping initiator cannot exhaust descriptors.
            if n > 400 {
                return;
            }
            keep.lock().unwrap().push(client.try_clone().unwrap());
            let m = mode(n);
            std::thread::spawn(move || serve(client, upstream, m));
        }
    });
    Proxy { addr, dials, accepted }
}

fn serve(mut client: TcpStream, upstream: SocketAddr, mode: Mode) {
    match mode {
        Mode::CloseAfterHello => {
            let Ok(mut target) = TcpStream::connect(upstream) else { return };
            let mut hello = [0u8; CLIENT_HELLO_BYTES];
            let mut answer = [0u8; SERVER_HELLO_BYTES];
            if client.read_exact(&mut hello).is_ok()
                && target.write_all(&hello).is_ok()
                && target.read_exact(&mut answer).is_ok()
            {
                let _ = client.write_all(&answer);
            }
            let _ = client.shutdown(std::net::Shutdown::Both);
        }
        Mode::RelayAfter(wait) => {
            std::thread::sleep(wait);
            serve(client, upstream, Mode::Relay);
        }
        Mode::Relay => {
            let Ok(target) = TcpStream::connect(upstream) else { return };
            let (mut c2, mut t2) = (client.try_clone().unwrap(), target.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c2, &mut t2);
                let _ = t2.shutdown(std::net::Shutdown::Both);
                let _ = c2.shutdown(std::net::Shutdown::Both);
            });
            let (mut t, mut c) = (target, client);
            let _ = std::io::copy(&mut t, &mut c);
            let _ = c.shutdown(std::net::Shutdown::Both);
            let _ = t.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// True when some connection of this host to `to` was closed by `to` and
/// not yet by us (`CLOSE_WAIT`, state 08 in `/proc/net/tcp`).
fn closed_by_peer_towards(to: &SocketAddr) -> bool {
    let port = format!(":{:04X}", to.port());
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table).is_ok_and(|text| {
            text.lines().skip(1).any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                fields.get(2).is_some_and(|remote| remote.ends_with(&port)) && fields.get(3) == Some(&"08")
            })
        })
    })
}

/// A control server in this process answering one untokened handshake
/// with `descriptor`, hinting its own end of the connection (the true
/// owner: target and test share this process), holding it until the
/// initiator closes it.
fn answering(descriptor: &kvring::testing::SegmentDescriptor) -> String {
    use kvring::testing::control::{preface, read_frame, response, write_frame, HandshakeResponse};
    use std::os::fd::AsRawFd;
    let segment = descriptor.to_proto();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut theirs = [0u8; 8];
        s.read_exact(&mut theirs).unwrap();
        s.write_all(&preface()).unwrap();
        let _ = read_frame(&mut s, kvring::testing::control::MAX_CONTROL_MESSAGE_BYTES);
        let answer = response(response::Body::Handshake(HandshakeResponse {
            segment: Some(Box::new(segment)),
            answering_fd: Some(s.as_raw_fd() as u32),
            ..Default::default()
        }));
        write_frame(&mut s, &answer).unwrap();
        s.set_read_timeout(None).unwrap();
        let _ = s.read_to_end(&mut Vec::new());
    });
    addr
}

/// A target, an initiator with one lane (one data connection) reaching the
/// target's data port through a proxy, and an open tcp segment.
struct Pair {
    target: Engine,
    region: kvring::Region,
    initiator: Engine,
    local: kvring::Region,
    segment: Segment,
    proxy: Proxy,
}

fn pair(name: &str, io_timeout: Duration, mode: impl Fn(usize) -> Mode + Send + 'static) -> Pair {
    pair_with(name, io_timeout, None, |b| b, mode)
}

/// As [`pair`], the initiator's region on `gpu`'s device 0 where given
/// (staged over tcp through pinned pages), its builder passed through
/// `tweak`.
fn pair_with(
    name: &str,
    io_timeout: Duration,
    gpu: Option<Arc<SimGpu>>,
    tweak: impl FnOnce(kvring::EngineBuilder) -> kvring::EngineBuilder,
    mode: impl Fn(usize) -> Mode + Send + 'static,
) -> Pair {
    let target = common::engine(&format!("{name}-target"));
    let region = target.alloc_region(8192, RegionInfo::raw()).unwrap();
    let upstream: SocketAddr = target.tcp_addr().unwrap().parse().unwrap();
    let proxy = proxy(upstream, mode);
    let mut descriptor = kvring::testing::descriptor(&target);
    descriptor.tcp_addr = Some(proxy.addr.to_string());
    let control = answering(&descriptor);
    let mut builder = tweak(common::builder(&format!("{name}-initiator")).lanes(1).io_timeout(io_timeout));
    let mut info = RegionInfo::raw();
    if let Some(gpu) = gpu {
        builder = builder.gpu(gpu as Arc<dyn Gpu>);
        info = info.on_gpu(0);
    }
    let initiator = builder.build().unwrap();
    let local = initiator.alloc_region(8192, info).unwrap();
    let segment = initiator.open_segment_with(&control, Some(TransportKind::Tcp), WAIT).unwrap();
    assert_eq!(proxy.dials(), 1, "the open dials one data connection");
    Pair { target, region, initiator, local, segment, proxy }
}

impl Pair {
    /// Polls until the proxy saw `n` dials.
    fn until_dials(&self, n: usize) {
        let deadline = Instant::now() + WAIT;
        while self.proxy.dials() < n {
            assert!(Instant::now() < deadline, "the initiator never dialled again");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

const LONG: Duration = Duration::from_secs(60);

/// Fills `len` local bytes at `offset` with `byte`: the block writing
/// them to the same place of the target's region.
fn part(p: &Pair, offset: u64, len: u64, byte: u8) -> [BlockDesc; 1] {
    // SAFETY: no batch in flight touches these bytes while the test writes them.
    unsafe { p.local.write_at(offset, &vec![byte; len as usize]).unwrap() };
    [BlockDesc::new(p.local.id(), offset, p.region.id(), offset, len)]
}

// Holds: chunks parked behind a slow dial and withdrawn meanwhile (one by
// its deadline, one cancelled) are never sent once the dial answers: a
// chunk submitted after them lands on the new connection, and their bytes
// never reach the target.
#[test]
fn chunks_withdrawn_while_parked_are_never_sent_once_the_dial_answers() {
    let p =
        pair(
            "r10-withdrawn",
            LONG,
            |n| if n == 0 { Mode::Relay } else { Mode::RelayAfter(Duration::from_millis(600)) },
        );
    p.proxy.close(0);
    let mut sub = p.initiator.submitter().unwrap();
    let late = sub
        .submit(&Batch::write(&p.segment).descs(&part(&p, 0, 2048, 9)).deadline(Duration::from_millis(100)))
        .unwrap();
    p.until_dials(2);
    let cancelled = sub.submit(&Batch::write(&p.segment).descs(&part(&p, 2048, 2048, 8))).unwrap();
    sub.cancel(cancelled).unwrap();
    assert!(matches!(sub.wait(late, WAIT), Ok(Outcome::TimedOut { bytes: 0 })));
    assert!(matches!(sub.wait(cancelled, WAIT), Ok(Outcome::Cancelled { bytes: 0 })));
    let after = common::run(&mut sub, &Batch::write(&p.segment).descs(&part(&p, 4096, 4096, 7)));
    assert!(after.is_done(), "{after:?}");
    assert_eq!(common::read(&p.region, 4096, 4096), vec![7; 4096]);
    assert_eq!(common::read(&p.region, 0, 4096), vec![0; 4096], "a withdrawn chunk was sent after all");
    // The dial both withdrawn chunks waited on was abandoned with them
    // (dropped, review 9's fix), so the next chunk dialled once more.
    assert_eq!(p.proxy.dials(), 3, "one dial per batch that needed one");
}

// Holds: three chunks parked behind a slow dial, the middle one
// cancelled: the first and the last land, once, in order; the middle one
// never; one dial.
#[test]
fn a_cancel_among_parked_chunks_leaves_the_others_landing_once() {
    let p =
        pair("r10-middle", LONG, |n| if n == 0 { Mode::Relay } else { Mode::RelayAfter(Duration::from_millis(400)) });
    p.proxy.close(0);
    let mut sub = p.initiator.submitter().unwrap();
    let first = sub.submit(&Batch::write(&p.segment).descs(&part(&p, 0, 2048, 1))).unwrap();
    p.until_dials(2);
    // Parked too: the lane answers once it is kept for the dial.
    p.initiator.notify(&p.segment, b"between", WAIT).unwrap();
    let middle = sub.submit(&Batch::write(&p.segment).descs(&part(&p, 2048, 2048, 2))).unwrap();
    let last = sub.submit(&Batch::write(&p.segment).descs(&part(&p, 4096, 2048, 3))).unwrap();
    sub.cancel(middle).unwrap();
    assert!(matches!(sub.wait(first, WAIT), Ok(Outcome::Done { bytes: 2048 })));
    assert!(matches!(sub.wait(middle, WAIT), Ok(Outcome::Cancelled { bytes: 0 })));
    assert!(matches!(sub.wait(last, WAIT), Ok(Outcome::Done { bytes: 2048 })));
    assert_eq!(common::read(&p.region, 0, 2048), vec![1; 2048]);
    assert_eq!(common::read(&p.region, 2048, 2048), vec![0; 2048], "the cancelled chunk was sent");
    assert_eq!(common::read(&p.region, 4096, 2048), vec![3; 2048]);
    // A round trip after them: a notification sent twice would be in.
    assert!(common::run(&mut sub, &Batch::write(&p.segment).descs(&part(&p, 6144, 2048, 4))).is_done());
    let mut got = Vec::new();
    while let Some(n) = p.target.poll_notification() {
        got.push(n.message);
    }
    assert_eq!(got, vec![b"between".to_vec()], "the parked notification, once");
    assert_eq!(p.proxy.dials(), 2);
}

// Holds: a notification and a chunk posted while the peer closes every
// dial after its hello: `notify` returns (never a hang), the chunk fails
// typed (the handle stale: the dialled peer is taken as gone, review 9's
// `copy_of`), the dials stay few, and nothing reaches the target.
#[test]
fn a_notification_and_a_chunk_behind_a_flapping_peer_end_typed_with_few_dials() {
    let p = pair("r10-flap", LONG, |n| if n == 0 { Mode::Relay } else { Mode::CloseAfterHello });
    p.proxy.close(0);
    let first = p.initiator.notify(&p.segment, b"first", WAIT);
    assert!(!matches!(first, Err(kvring::Error::Timeout { .. })), "notify hung: {first:?}");
    // The notification's failed dial may already have staled the handle
    // (refused at submit), or the chunk dials and fails itself.
    let mut sub = p.initiator.submitter().unwrap();
    match sub.submit(&Batch::write(&p.segment).descs(&part(&p, 0, 4096, 5))) {
        Err(error) => assert!(matches!(error, kvring::Error::PeerRestarted { .. }), "{error}"),
        Ok(id) => {
            let flapped = sub.wait(id, WAIT);
            assert!(matches!(flapped, Ok(Outcome::Failed(_))), "a write to a peer closing every dial: {flapped:?}");
        }
    }
    assert!(p.segment.is_stale(), "the dialled peer is taken as gone");
    let dials = p.proxy.dials();
    assert!(dials <= 8, "a bounded number of dials for one notification and one batch, not {dials}");
    assert!(p.target.poll_notification().is_none(), "nothing was relayed");
    assert_eq!(common::read(&p.region, 0, 4096), vec![0; 4096], "the failed write landed");
}
