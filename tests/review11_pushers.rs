//! Hostile review 11: the rdma fence pushers dialled at connect
//! (`src/engine/fence_pushers.rs`, `engine/control.rs` `rdma_connect`).
//! A target now dials the control address an rdma writer *claimed* in its
//! handshake, before it accepts the writer's QPs, handshakes as itself,
//! requires the engine answering there to be the writer (name and epoch),
//! and keeps the connection for its fences. The claimed address is the
//! peer's word: each probe asks what a peer can make the target do with it
//! (dial where, how often, for how long, keeping what), and what it learns.
//!
//! Peers here speak the control protocol by hand (`ControlClient`); the
//! "writer" answering the target's dial is a fake control server in this
//! test (`FakeWriter`), which answers as whoever the test says, and counts
//! the dials it took and the connections the target still holds open.
//! On the simulated provider (tests/common/verbs.rs).

mod common;

use common::verbs::{Provider, RdmaPair};
use common::WAIT;
use kvring::testing::control::{
    preface, read_frame, request, response, write_frame, ControlClient, HandshakeResponse, Initiator, ProbeResponse,
    RdmaFenceResponse, Request, CONTROL_VERSION, MAX_CONTROL_MESSAGE_BYTES,
};
use kvring::{Engine, Error, RegionInfo};
use prost::Message as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
/// The push key length an rdma connect carries (`PUSH_KEY_BYTES`).
const KEY: usize = 16;
/// Most control connections the target serves from one address
/// (`MAX_CONTROL_CONNECTIONS_PER_SOURCE`).
const PER_SOURCE: usize = 32;

/// What the fake writer saw.
#[derive(Default)]
struct Seen {
    /// Connections accepted.
    dials: AtomicUsize,
    /// Connections that began with a handshake (the target's pusher dials,
    /// not its reaper's probes).
    handshakes: AtomicUsize,
    /// Connections that completed a handshake and the target still holds.
    pushers_open: AtomicUsize,
    /// Probes answered (the target's reaper).
    probes: AtomicUsize,
    /// Probes answered as the identity itself (alive), not another start.
    alive: std::sync::atomic::AtomicBool,
    /// Fences taken and never answered (the connection held until the
    /// target closes it).
    silent: std::sync::atomic::AtomicBool,
    /// The push key of each fence pushed to it.
    fence_keys: Mutex<Vec<Vec<u8>>>,
}

/// A fake engine's control server answering every handshake as
/// `identity` (set by the test before each connect), every probe as
/// another start of it (so the reaper takes it as gone), every fence Ok.
struct FakeWriter {
    addr: SocketAddr,
    identity: Arc<Mutex<(String, u64)>>,
    seen: Arc<Seen>,
}

impl FakeWriter {
    fn start(like: &Engine) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut descriptor = kvring::testing::descriptor(like);
        descriptor.control_addr = addr.to_string();
        // Not this host: the target's owner check has nothing to prove.
        descriptor.host_id = "r11-elsewhere".into();
        descriptor.regions.clear();
        descriptor.tcp_addr = None;
        descriptor.rdma = None;
        descriptor.cma = None;
        let identity = Arc::new(Mutex::new((String::from("r11-nobody"), 1)));
        let seen = Arc::new(Seen::default());
        let (who, saw) = (identity.clone(), seen.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                saw.dials.fetch_add(1, Ordering::SeqCst);
                let (who, saw, descriptor) = (who.clone(), saw.clone(), descriptor.clone());
                std::thread::spawn(move || serve(stream, &who, &saw, descriptor));
            }
        });
        Self { addr, identity, seen }
    }

    fn answer_as(&self, name: &str, epoch: u64) {
        *self.identity.lock().unwrap() = (name.to_string(), epoch);
    }

    fn dials(&self) -> usize {
        self.seen.dials.load(Ordering::SeqCst)
    }

    fn handshakes(&self) -> usize {
        self.seen.handshakes.load(Ordering::SeqCst)
    }

    fn pushers_open(&self) -> usize {
        self.seen.pushers_open.load(Ordering::SeqCst)
    }
}

fn serve(mut s: TcpStream, who: &Mutex<(String, u64)>, saw: &Seen, mut descriptor: kvring::testing::SegmentDescriptor) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    let mut theirs = [0u8; 8];
    if s.read_exact(&mut theirs).is_err() || s.write_all(&preface()).is_err() {
        return;
    }
    let mut pusher = false;
    while let Ok(Some(frame)) = read_frame(&mut s, MAX_CONTROL_MESSAGE_BYTES) {
        let Ok(Request { body: Some(body), .. }) = Request::decode(frame.as_slice()) else { break };
        let (name, epoch) = who.lock().unwrap().clone();
        let answer = match body {
            request::Body::Handshake(_) => {
                descriptor.name = name;
                descriptor.epoch = epoch;
                if !pusher {
                    pusher = true;
                    saw.handshakes.fetch_add(1, Ordering::SeqCst);
                    saw.pushers_open.fetch_add(1, Ordering::SeqCst);
                }
                let segment = Some(Box::new(descriptor.to_proto()));
                response::Body::Handshake(HandshakeResponse { segment, ..Default::default() })
            }
            request::Body::Probe(_) => {
                saw.probes.fetch_add(1, Ordering::SeqCst);
                // Unless alive, another start answers there now: the writer
                // went away.
                let alive = saw.alive.load(Ordering::SeqCst);
                response::Body::Probe(ProbeResponse { name, epoch: if alive { epoch } else { epoch ^ 0xdead } })
            }
            request::Body::RdmaFence(fence) => {
                saw.fence_keys.lock().unwrap().push(fence.push_key);
                if saw.silent.load(Ordering::SeqCst) {
                    let _ = s.read_to_end(&mut Vec::new());
                    break;
                }
                response::Body::RdmaFence(RdmaFenceResponse {})
            }
            _ => break,
        };
        if write_frame(&mut s, &response(answer)).is_err() {
            break;
        }
    }
    if pusher {
        saw.pushers_open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A target serving rdma on the simulated provider, with a destination.
fn target(
    name: &str,
    provider: &Provider,
    tune: impl FnOnce(kvring::EngineBuilder) -> kvring::EngineBuilder,
) -> Engine {
    let target = tune(provider.apply(common::builder(name))).build().unwrap();
    let region = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    std::mem::forget(region);
    target
}

/// A peer's rdma connect to `target`, its handshake naming `who` (name,
/// epoch) at `claimed`: what the target answers.
fn connect_as(target: &Engine, who: (&str, u64), claimed: &str, nics: usize, key: &[u8]) -> kvring::Result<usize> {
    let deadline = Instant::now() + WAIT;
    let me = Initiator { name: who.0.into(), epoch: who.1, addr: claimed.into() };
    let mut client = ControlClient::connect(&target.control_addr().to_string(), deadline)?;
    client.handshake(&me, None, deadline)?;
    // One made-up QP (a connect of none is refused for its shape).
    let qp = kvring::rdma::QpEndpoint { qpn: 0x77, psn: 1, gid: [0; 16], lid: 1, mtu: 1024 };
    client.rdma_connect(nics, &[qp], key, deadline).map(|(ours, _)| ours.len())
}

/// The message of a refused connect, with the claimed address taken out.
fn refusal(answer: kvring::Result<usize>, claimed: &str) -> String {
    match answer {
        Err(Error::Remote { message, .. }) => message.replace(claimed, "<claimed>"),
        other => panic!("an rdma connect claiming {claimed}: {other:?}"),
    }
}

/// Polls `f` until it holds or `WAIT` passed; whether it held.
fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

// Found by review 11 (medium), fixed since: the commit promises "the peer is told the failed step,
// not the system's error (no port-scan oracle)", but the steps themselves
// are the oracle: a closed port reads "could not be connected to", a port
// where anything listens reads "did not complete a handshake", and a
// kvring engine there reads "another engine answers there". Any peer of
// an engine without a token (any member with one) learns, per rdma
// connect, whether a port only the target reaches is open: here, ports on
// the target's own loopback. Proposed fix: one answer for every network
// step ("it did not answer as <writer> within the control timeout"),
// keeping only "not an IP address and port" (the peer's own input)
// apart; the step stays in the target's log.
#[test]
fn a_refused_claim_reads_the_same_whether_a_port_is_open_or_closed() {
    let provider = Provider::new();
    let target = target("r11-oracle-target", &provider, |b| b.control_timeout(Duration::from_millis(500)));
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    // Something listening that is not kvring (an HTTP server, a database):
    // it accepts and closes.
    let open = TcpListener::bind("127.0.0.1:0").unwrap();
    let open_at = open.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in open.incoming().take(1) {
            drop(stream);
        }
    });
    let said_closed = refusal(connect_as(&target, ("r11-scanner", 1), &closed, 1, &[7; KEY]), &closed);
    let said_open = refusal(connect_as(&target, ("r11-scanner", 2), &open_at, 1, &[7; KEY]), &open_at);
    assert_eq!(said_closed, said_open, "the refusal tells a closed port from an open one");
    assert_eq!(target.rdma_accepted_qps(), 0);
}

// Found by review 11 (low), fixed since: the claimed address is dialled (a connect, a handshake,
// up to the control timeout, on one of the target's control threads)
// before the request is checked: a push key of the wrong length, or 0
// nics, is refused only after the dial. A peer gets the target's dial for
// a request that was never going to be accepted. Proposed fix: check the
// push key's length and `nics` (what `accept` checks of the request's
// shape) before `fence_pushers.reach` in `rdma_connect`.
#[test]
fn a_connect_refused_for_its_shape_dials_nobody() {
    let provider = Provider::new();
    let target = target("r11-shape-target", &provider, |b| b);
    let writer = FakeWriter::start(&target);
    writer.answer_as("r11-shape-writer", 3);
    let at = writer.addr.to_string();
    let bad_key = connect_as(&target, ("r11-shape-writer", 3), &at, 1, &[7; 3]);
    assert!(matches!(bad_key, Err(Error::Remote { .. })), "{bad_key:?}");
    let no_nics = connect_as(&target, ("r11-shape-writer", 3), &at, 0, &[7; KEY]);
    assert!(matches!(no_nics, Err(Error::Remote { .. })), "{no_nics:?}");
    assert_eq!(writer.dials(), 0, "the target dialled for a connect it refused for its shape");
}

// Found by review 11 (medium), fixed since: the pusher kept for a writer is dropped only by the
// next fence's `take` (writers no longer listed). A writer the reaper
// released (another start answers its probe), one evicted for newer
// connects, or one cut off, keeps its control connection open in the
// target until some fence with a writer listed runs (`fence_rdma::push`
// returns before `take` when no writer is left); with none, for ever. Each identity
// the peer names (a name, a new epoch: an rdma connect with no endpoints
// costs no QP of the 16 Ki) is one more descriptor held by the target, so
// a peer answering its own dials as many identities exhausts the target's
// descriptors, and no quota per peer bounds them. Proposed fix: prune the
// kept pushers to `node.writers()` in `rdma_connect` before `keep` (and
// after the reaper's releases), and refuse a connect with no endpoints.
#[test]
fn the_pushers_of_writers_that_went_away_are_closed() {
    const IDENTITIES: u64 = 24;
    let provider = Provider::new();
    let target = target("r11-leak-target", &provider, |b| b.rdma_probe_interval(Duration::from_millis(100)));
    let writer = FakeWriter::start(&target);
    let at = writer.addr.to_string();
    for epoch in 1..=IDENTITIES {
        writer.answer_as("r11-leak-writer", epoch);
        let accepted = connect_as(&target, ("r11-leak-writer", epoch), &at, 1, &[7; KEY]);
        assert_eq!(accepted.unwrap(), 1, "a connect of one made-up QP accepted");
    }
    assert_eq!(writer.pushers_open(), IDENTITIES as usize, "one kept pusher per identity");
    // The reaper probes each; another start answers: each is released.
    let probes = |n| eventually(|| writer.seen.probes.load(Ordering::SeqCst) >= n);
    assert!(probes(IDENTITIES as usize), "the reaper probed every identity");
    assert!(
        eventually(|| writer.pushers_open() == 0),
        "{} pushers of writers the target released are still open",
        writer.pushers_open()
    );
}

/// The positive side of the above: a fence with a writer listed drops
/// the pushers of writers no longer listed, and pushes to the one that
/// stays, over its kept connection, with its key.
#[test]
fn a_fence_with_a_writer_closes_the_pushers_of_writers_that_left() {
    let provider = Provider::new();
    let target = target("r11-fence-prune-target", &provider, |b| b.rdma_probe_interval(Duration::from_millis(100)));
    let region = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let writer = FakeWriter::start(&target);
    let at = writer.addr.to_string();
    for epoch in 1..=4 {
        writer.answer_as("r11-prune-writer", epoch);
        connect_as(&target, ("r11-prune-writer", epoch), &at, 1, &[epoch as u8; KEY]).unwrap();
    }
    assert_eq!(writer.pushers_open(), 4);
    assert!(eventually(|| writer.seen.probes.load(Ordering::SeqCst) >= 4), "the reaper probed every identity");
    // A fifth start that stays (its probes answered as itself).
    writer.seen.alive.store(true, Ordering::SeqCst);
    writer.answer_as("r11-prune-writer", 5);
    connect_as(&target, ("r11-prune-writer", 5), &at, 1, &[5; KEY]).unwrap();
    target.fence(region.id(), 0, MIB as u64).unwrap();
    assert!(eventually(|| writer.pushers_open() == 1), "{} pushers open after a fence", writer.pushers_open());
    assert_eq!(*writer.seen.fence_keys.lock().unwrap(), vec![vec![5u8; KEY]]);
    assert_eq!(writer.handshakes(), 5, "the fence used the kept connection");
}

/// A writer reconnecting under one identity (same name and epoch) many
/// times: the kept pusher is replaced each time, the old one closed, so
/// the target holds one connection to it, not one per connect; its
/// fences go out with the key of its last connect.
#[test]
fn a_writer_reconnecting_under_one_identity_keeps_one_pusher() {
    let provider = Provider::new();
    let target = target("r11-reconnect-target", &provider, |b| b);
    let region = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let writer = FakeWriter::start(&target);
    writer.answer_as("r11-reconnect-writer", 9);
    let at = writer.addr.to_string();
    for round in 0..30u8 {
        connect_as(&target, ("r11-reconnect-writer", 9), &at, 1, &[round; KEY]).unwrap();
    }
    assert_eq!(writer.handshakes(), 30, "one dial per connect, no more");
    assert!(eventually(|| writer.pushers_open() == 1), "{} pushers kept for one writer", writer.pushers_open());
    target.fence(region.id(), 0, MIB as u64).unwrap();
    assert_eq!(*writer.seen.fence_keys.lock().unwrap(), vec![vec![29u8; KEY]], "the fence carries the last key");
    assert_eq!(writer.handshakes(), 30, "the fence used the kept connection");
}

/// An impersonator naming an honest writer (its name and epoch are
/// public) at an address of its own that answers as that writer: the
/// target keeps the impersonator's connection and QPs under that identity
/// (without a token a name proves nothing; the honest writer's QPs are
/// replaced: see docs/REVIEW11.md), but the push key still protects the
/// honest writer: the fences the target pushes to the impersonator carry
/// the impersonator's own key, never the honest writer's, and the honest
/// writer is never pushed a fence under the impersonator's key.
#[test]
fn an_impersonators_pusher_gets_only_its_own_key() {
    let RdmaPair { provider: _provider, target, remote, initiator, local: _local, segment: _segment } =
        common::verbs::rdma_pair("r11-imp", None);
    assert_eq!(target.rdma_accepted_qps(), 1);
    let fake = FakeWriter::start(&target);
    let honest = (initiator.name().to_string(), initiator.epoch());
    fake.answer_as(&honest.0, honest.1);
    let at = fake.addr.to_string();
    connect_as(&target, (&honest.0, honest.1), &at, 1, &[0xAA; KEY]).unwrap();
    target.fence(remote.id(), 0, MIB as u64).unwrap();
    let keys = fake.seen.fence_keys.lock().unwrap().clone();
    assert_eq!(keys, vec![vec![0xAA; KEY]], "the impersonator was pushed a fence under another key");
    // The honest writer's own connect takes its identity back.
    drop(initiator);
}

/// Amplification: every rdma connect costs the target one dial of the
/// claimed address, held up to its control timeout on a control thread.
/// A peer opening many connects at once, each claiming an address that
/// accepts and never answers, holds at most its source's share of the
/// control connections (32), so at most that many dials at once, and a
/// peer from another address is still served meanwhile.
#[test]
fn one_source_holds_at_most_its_share_of_dials_and_another_source_is_served() {
    let provider = Provider::new();
    let target = target("r11-amp-target", &provider, |b| b.control_timeout(Duration::from_secs(2)));
    let hole = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = hole.local_addr().unwrap().to_string();
    let held = Arc::new(AtomicUsize::new(0));
    let counted = held.clone();
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        for stream in hole.incoming() {
            let Ok(stream) = stream else { return };
            counted.fetch_add(1, Ordering::SeqCst);
            kept.push(stream);
        }
    });
    let peers: Vec<_> = (0..PER_SOURCE as u64 + 8)
        .map(|epoch| {
            let (target_addr, at) = (target.control_addr(), at.clone());
            std::thread::spawn(move || {
                let deadline = Instant::now() + WAIT;
                let me = Initiator { name: "r11-amp".into(), epoch, addr: at };
                let mut client = ControlClient::connect(&target_addr.to_string(), deadline)?;
                client.handshake(&me, None, deadline)?;
                let qp = kvring::rdma::QpEndpoint { qpn: 0x77, psn: 1, gid: [0; 16], lid: 1, mtu: 1024 };
                client.rdma_connect(1, &[qp], &[7; KEY], deadline).map(drop)
            })
        })
        .collect();
    // While the dials are held: another source is served.
    assert!(eventually(|| held.load(Ordering::SeqCst) >= PER_SOURCE / 2), "the dials began");
    let other = probe_from("127.0.0.2", target.control_addr());
    assert_eq!(other.as_deref(), Some(target.name()), "another source was not served");
    let answers: Vec<_> = peers.into_iter().map(|p| p.join().unwrap()).collect();
    assert!(answers.iter().all(Result::is_err), "a connect claiming a silent address was accepted");
    assert!(held.load(Ordering::SeqCst) <= PER_SOURCE, "{} dials for one source", held.load(Ordering::SeqCst));
    assert_eq!(target.rdma_accepted_qps(), 0);
}

/// A probe of `to` from `source`: the name that answered.
fn probe_from(source: &str, to: SocketAddr) -> Option<String> {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
    let from: SocketAddr = format!("{source}:0").parse().unwrap();
    s.bind(&from.into()).ok()?;
    s.connect_timeout(&to.into(), WAIT).ok()?;
    let mut s: TcpStream = s.into();
    s.set_read_timeout(Some(WAIT)).ok()?;
    s.write_all(&preface()).ok()?;
    let probe = Request { version: CONTROL_VERSION, body: Some(request::Body::Probe(Default::default())) };
    write_frame(&mut s, &probe).ok()?;
    let mut theirs = [0u8; 8];
    s.read_exact(&mut theirs).ok()?;
    let frame = read_frame(&mut s, MAX_CONTROL_MESSAGE_BYTES).ok()??;
    match kvring::testing::control::decode_response(&frame).ok()? {
        response::Body::Probe(ProbeResponse { name, .. }) => Some(name),
        _ => None,
    }
}

// Found by review 11 (low), fixed since: the dial at connect stops a writer whose claimed address
// reaches nothing from stalling every fence, but not a writer that
// answers its dial and then not its fences: each fence of the target
// waits its whole wait (`FENCE_WAIT`, 2 s) for it, cuts it off, and the
// writer's next connect is accepted at once (its dial answered again), to
// stall the next fence: the loop the commit meant to end, run on purpose.
// Any peer can do it on an engine without a token (a member with one).
// Proposed fix: remember the writers (name, and the source address of
// their connect) cut off for a fence they did not answer, and refuse
// their connects for a while (a few `FENCE_WAIT`s, growing while it
// repeats), with that reason.
#[test]
fn a_writer_cut_off_for_a_fence_it_did_not_answer_is_not_accepted_again_at_once() {
    let provider = Provider::new();
    let target = target("r11-silent-target", &provider, |b| b);
    let region = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let writer = FakeWriter::start(&target);
    writer.answer_as("r11-silent-writer", 1);
    writer.seen.silent.store(true, Ordering::SeqCst);
    let at = writer.addr.to_string();
    connect_as(&target, ("r11-silent-writer", 1), &at, 1, &[1; KEY]).unwrap();
    // The fence waits for the writer to its deadline, then cuts it off.
    target.fence(region.id(), 0, MIB as u64).unwrap();
    assert_eq!(writer.seen.fence_keys.lock().unwrap().len(), 1, "the fence was pushed to the writer");
    assert!(eventually(|| writer.pushers_open() == 0), "the unanswered pusher was dropped");
    let again = connect_as(&target, ("r11-silent-writer", 1), &at, 1, &[2; KEY]);
    assert!(again.is_err(), "a writer cut off for a fence it did not answer was accepted again at once");
}
