//! Hostile review 9b: end-to-end checksums over rdma (`Crc32cRequest`,
//! answered by the target's `engine::crc32c`; asked by the initiator's
//! verifier threads, `transport::rdma::verify`). Each test asserts what
//! docs/CHECKSUMS.md ("rdma") and docs/SECURITY.md promise, so that it
//! fails where a hole exists:
//!
//! - at the target: no CRC of a region peers may not read, no read outside
//!   a registered region, every request bounded (256 ranges, 1 GiB), a
//!   typed error for every bad range, a region never unregistered under a
//!   sum or read once its engine is dropped, only a proven session when
//!   the engine has a token, and "the control connection limits bound how
//!   many" sums one peer runs at once (docs/SECURITY.md);
//! - at the initiator: a checksummed chunk is done only once the target's
//!   CRCs match; a target that lies (wrong count, garbage, another answer,
//!   silence) gets a typed error, never `Done`; a chunk withdrawn (close,
//!   a target cut off) ends typed; the verifier threads end with the link;
//!   "a question is bounded by the engine's control timeout"
//!   (docs/CHECKSUMS.md), so a healthy target is verified.
//!
//! Holes found are `#[ignore = "HOLE: ..."]` (run them with `--ignored`):
//! T6 (an evicted pending connection keeps summing: no bound per peer),
//! T7 (a sum outliving the engine's drop reads a caller's freed memory:
//! SIGSEGV) and I7 (a chunk's verification deadline counts its queue
//! time).
//!
//! On the simulated verbs provider (tests/common/verbs.rs).

mod common;

use common::verbs::Provider;
use common::WAIT;
use kvring::testing::control::{
    read_frame, request, response, write_frame, ControlClient, ErrorCode, Initiator, Request, Response,
    MAX_CONTROL_MESSAGE_BYTES,
};
use kvring::{Access, Batch, BlockDesc, Engine, Error, Outcome, Region, RegionInfo, Segment, TransportKind};
use prost::Message;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The target's readable region.
const LEN: usize = 4 << 20;

/// The stall of CRC32C answers, the corruption hook and the count of
/// verifier threads are process-wide: the tests that touch them take turns.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> MutexGuard<'static, ()> {
    let guard = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    kvring::testing::checksum::corrupt_landing_at(u64::MAX);
    kvring::testing::checksum::corrupt_rdma_landings_with(None);
    guard
}

/// A target (no rdma needed: the request is the control plane's) with a
/// patterned region peers may read and one they may only write.
struct Target {
    engine: Engine,
    readable: Region,
    write_only: Region,
    addr: String,
}

fn target(name: &str, token: Option<&str>) -> Target {
    let builder = common::builder(name);
    let engine = match token {
        Some(token) => builder.token(token),
        None => builder,
    }
    .build()
    .unwrap();
    let readable = engine.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes.
    unsafe { readable.fill_pattern(77) };
    let write_only = engine
        .alloc_region(
            LEN,
            RegionInfo::raw().with_access(Access::LOCAL_READ | Access::LOCAL_WRITE | Access::REMOTE_WRITE),
        )
        .unwrap();
    // SAFETY: as above.
    unsafe { write_only.fill_pattern(78) };
    let addr = engine.control_addr().to_string();
    Target { engine, readable, write_only, addr }
}

fn contents(region: &Region) -> Vec<u8> {
    let mut out = vec![0u8; region.len()];
    // SAFETY: no batch naming these bytes is in flight.
    unsafe { region.read_at(0, &mut out).unwrap() };
    out
}

/// One CRC32C request from a fresh, unauthenticated client.
fn ask(addr: &str, ranges: &[(u64, u64, u64)]) -> kvring::Result<Vec<u32>> {
    let deadline = Instant::now() + WAIT;
    let mut client = ControlClient::connect(addr, deadline)?;
    client.crc32c(ranges, deadline)
}

/// The target's error code, if the answer is the target's refusal.
fn code<T: std::fmt::Debug>(answer: &kvring::Result<T>) -> ErrorCode {
    match answer {
        Err(Error::Remote { code, .. }) => *code,
        other => panic!("expected the target's typed refusal, got {other:?}"),
    }
}

/// Probe T1: every request is bounded and every bad range refused typed,
/// before a byte is read: 257 and 10,000 ranges, 1 GiB + 1 in one range
/// or across two, lengths whose sum overflows 64 bits, an offset + length
/// that wraps, a range past the end, a zero-length range past the end.
/// 256 ranges and exactly 1 GiB in all (256 x 4 MiB over one 4 MiB
/// region) are answered, each CRC that of the bytes.
#[test]
fn t1_every_request_is_bounded_and_every_bad_range_refused_typed() {
    let t = target("r9b-bounds", None);
    let r = t.readable.id().raw();
    let bytes = contents(&t.readable);

    let many = vec![(r, 0, 1); 257];
    assert_eq!(code(&ask(&t.addr, &many)), ErrorCode::InvalidArgument);
    let huge = vec![(r, 0, 1); 10_000];
    let answer = ask(&t.addr, &huge);
    assert!(
        matches!(code(&answer), ErrorCode::InvalidArgument | ErrorCode::MessageTooLarge),
        "10,000 ranges: {answer:?}"
    );
    assert_eq!(code(&ask(&t.addr, &[(r, 0, GIB + 1)])), ErrorCode::InvalidArgument);
    assert_eq!(code(&ask(&t.addr, &[(r, 0, GIB / 2 + 1), (r, 0, GIB / 2)])), ErrorCode::InvalidArgument);
    assert_eq!(code(&ask(&t.addr, &[(r, 0, u64::MAX), (r, 0, 2)])), ErrorCode::InvalidArgument);
    assert_eq!(code(&ask(&t.addr, &[(r, u64::MAX - 3, 8)])), ErrorCode::LengthOverflow);
    assert_eq!(code(&ask(&t.addr, &[(r, 0, 1), (r, LEN as u64 - 10, 11)])), ErrorCode::OutOfBounds);
    assert_eq!(code(&ask(&t.addr, &[(r, LEN as u64 + 1, 0)])), ErrorCode::OutOfBounds);
    assert_eq!(code(&ask(&t.addr, &[(r, u64::MAX, 0)])), ErrorCode::OutOfBounds);

    // At the limits: answered, every CRC that of the bytes.
    let edge = ask(&t.addr, &[(r, LEN as u64, 0), (r, LEN as u64 - 1, 1)]).unwrap();
    assert_eq!(edge, [0, crc32c::crc32c(&bytes[LEN - 1..])]);
    let ranges: Vec<_> = (0..256u64).map(|i| (r, i, 1)).collect();
    let crcs = ask(&t.addr, &ranges).unwrap();
    let want: Vec<u32> = (0..256).map(|i| crc32c::crc32c(&bytes[i..i + 1])).collect();
    assert_eq!(crcs, want);
    let whole = vec![(r, 0, LEN as u64); (GIB / LEN as u64) as usize];
    assert_eq!(whole.len(), 256);
    let crcs = ask(&t.addr, &whole).unwrap();
    assert!(crcs.iter().all(|&c| c == crc32c::crc32c(&bytes)), "1 GiB in 256 ranges, each the region's CRC");
}

/// Probe T2: no CRC of memory a peer may not name: a write-only region
/// (even a zero-length range of it, and after a readable range), an
/// unknown region, one unregistered (its stale id), and a forged
/// generation of a live slot are refused typed.
#[test]
fn t2_unreadable_unknown_and_stale_regions_are_refused_typed() {
    let t = target("r9b-regions", None);
    let r = t.readable.id().raw();
    let w = t.write_only.id().raw();
    assert_eq!(code(&ask(&t.addr, &[(w, 0, 16)])), ErrorCode::AccessDenied);
    assert_eq!(code(&ask(&t.addr, &[(r, 0, 1), (w, 0, 1)])), ErrorCode::AccessDenied);
    assert_eq!(code(&ask(&t.addr, &[(w, 0, 0)])), ErrorCode::AccessDenied);
    assert_eq!(code(&ask(&t.addr, &[(0, 0, 1)])), ErrorCode::UnknownRegion);
    assert_eq!(code(&ask(&t.addr, &[(u64::MAX, 0, 1)])), ErrorCode::UnknownRegion);
    // A forged generation of the readable region's slot.
    let forged = kvring::RegionId::new(t.readable.id().index(), t.readable.id().generation() + 1).raw();
    assert_eq!(code(&ask(&t.addr, &[(forged, 0, 1)])), ErrorCode::UnknownRegion);
    let gone = t.engine.alloc_region(4096, RegionInfo::raw()).unwrap();
    let stale = gone.id();
    t.engine.unregister(stale).unwrap();
    assert_eq!(code(&ask(&t.addr, &[(stale.raw(), 0, 1)])), ErrorCode::UnknownRegion);
    // Its slot taken again by a new region: the stale id names nothing.
    let again = t.engine.alloc_region(4096, RegionInfo::raw()).unwrap();
    assert_ne!(again.id(), stale);
    assert_eq!(code(&ask(&t.addr, &[(stale.raw(), 0, 1)])), ErrorCode::UnknownRegion);
}

/// Probe T3: with a token, no CRC without the proof: a client with no
/// handshake and one whose handshake carries the wrong token are refused;
/// a proven session is answered.
#[test]
fn t3_a_tokened_engine_answers_only_a_proven_session() {
    let t = target("r9b-token", Some("r9b-secret"));
    let r = t.readable.id().raw();
    let bare = ask(&t.addr, &[(r, 0, 16)]);
    assert_eq!(code(&bare), ErrorCode::Unauthorized, "{bare:?}");
    let me = Initiator { name: "r9b-stranger".into(), epoch: 7, addr: "127.0.0.1:9".into() };
    let deadline = Instant::now() + WAIT;
    let mut wrong = ControlClient::connect(&t.addr, deadline).unwrap();
    let proof = wrong.handshake(&me, Some(&kvring::Token::new("not-the-secret")), deadline);
    assert!(proof.is_err(), "a wrong token proved itself: {proof:?}");
    let after = wrong.crc32c(&[(r, 0, 16)], deadline);
    assert!(after.is_err(), "a CRC after a failed proof: {after:?}");
    let mut proven = ControlClient::connect(&t.addr, deadline).unwrap();
    proven.handshake(&me, Some(&kvring::Token::new("r9b-secret")), deadline).unwrap();
    let bytes = contents(&t.readable);
    assert_eq!(proven.crc32c(&[(r, 0, 16)], deadline).unwrap(), [crc32c::crc32c(&bytes[..16])]);
}

/// Probe T4 (what an untokened engine grants any local process): the CRC
/// of a REMOTE_READ region is answered to a client with no handshake,
/// exactly as the bench's `Checksum` request (and an rdma READ) already
/// answers it; 1-byte ranges are an oracle of the bytes, 256 at a time,
/// which REMOTE_READ grants anyway. For a region peers may not read both
/// requests are refused, so the oracle reveals nothing there.
#[test]
fn t4_without_a_token_the_crc_grants_what_remote_read_already_grants() {
    let t = target("r9b-oracle", None);
    let r = t.readable.id().raw();
    let w = t.write_only.id().raw();
    let deadline = Instant::now() + WAIT;
    let mut client = ControlClient::connect(&t.addr, deadline).unwrap();
    assert!(client.checksum(r, 0, 64, deadline).is_ok(), "the bench's checksum answers a stranger too");
    let refused = client.checksum(w, 0, 64, deadline);
    assert!(refused.is_err(), "{refused:?}");
    let table: Vec<u32> = (0..=255u8).map(|b| crc32c::crc32c(&[b])).collect();
    let ranges: Vec<_> = (0..256u64).map(|i| (r, i, 1)).collect();
    let crcs = ask(&t.addr, &ranges).unwrap();
    let recovered: Vec<u8> = crcs.iter().map(|c| table.iter().position(|t| t == c).unwrap() as u8).collect();
    assert_eq!(recovered, contents(&t.readable)[..256], "1-byte CRCs reveal a readable region's bytes");
    let ranges: Vec<_> = (0..256u64).map(|i| (w, i, 1)).collect();
    assert_eq!(code(&ask(&t.addr, &ranges)), ErrorCode::AccessDenied);
}

/// Probe T5: a region is never unregistered under a sum (the lease): a
/// caller's own buffer, registered, summed in 256 MiB requests while the
/// owner unregisters it and then overwrites the buffer at once. Every
/// answer is either the CRCs of the original bytes (the sum ran under the
/// lease, unregister refused `RegionBusy` meanwhile) or `UnknownRegion`
/// (unregistered first): never a CRC of bytes written after unregister
/// returned.
#[test]
fn t5_a_region_is_not_unregistered_under_a_sum() {
    let t = target("r9b-lease", None);
    let len = MIB as usize;
    let mut buffer: Vec<u8> = (0..len).map(|i| (i * 31 % 253) as u8).collect();
    let want = crc32c::crc32c(&buffer);
    // SAFETY: the buffer outlives its registration (unregistered below,
    // before it is written or dropped).
    let id = unsafe { t.engine.register(buffer.as_mut_ptr(), len, RegionInfo::raw()) }.unwrap();
    let addr = t.addr.clone();
    let started = Arc::new(AtomicUsize::new(0));
    let asker = {
        let started = started.clone();
        std::thread::spawn(move || {
            let mut answers = Vec::new();
            for _ in 0..4 {
                started.fetch_add(1, Ordering::AcqRel);
                let answer = ask(&addr, &vec![(id.raw(), 0, MIB); 256]);
                let gone = answer.is_err();
                answers.push(answer);
                if gone {
                    break;
                }
            }
            answers
        })
    };
    while started.load(Ordering::Acquire) < 2 {
        std::thread::yield_now();
    }
    let mut busy = 0;
    let until = Instant::now() + WAIT;
    loop {
        match t.engine.unregister(id) {
            Ok(()) => break,
            Err(Error::RegionBusy { .. }) => busy += 1,
            Err(other) => panic!("unregister: {other}"),
        }
        assert!(Instant::now() < until, "unregister never got the region back");
        std::thread::sleep(Duration::from_micros(200));
    }
    // The owner reuses its memory at once.
    buffer.iter_mut().for_each(|b| *b = !*b);
    let answers = asker.join().unwrap();
    for answer in &answers {
        match answer {
            Ok(crcs) => assert!(crcs.iter().all(|&c| c == want), "a CRC of bytes written after unregister"),
            Err(_) => assert_eq!(code(answer), ErrorCode::UnknownRegion),
        }
    }
    eprintln!(
        "unregister refused busy {busy} times; answers {:?}",
        answers.iter().map(|a| a.is_ok()).collect::<Vec<_>>()
    );
    drop(buffer);
}

// ---- The initiator's side ----

/// A target over rdma and an initiator that opened it (through `via`, a
/// relay that may lie, when given).
struct Pair {
    _provider: Provider,
    target: Engine,
    remote: Region,
    initiator: Engine,
    local: Region,
    segment: Segment,
}

fn pair(name: &str, via: Option<&Liar>) -> Pair {
    pair_timed(name, via, None)
}

/// As [`pair`], the initiator's control timeout `timeout` where given.
fn pair_timed(name: &str, via: Option<&Liar>, timeout: Option<Duration>) -> Pair {
    let provider = Provider::new();
    let target = provider.apply(common::builder(&format!("{name}-target"))).build().unwrap();
    let remote = target.alloc_region(2 << 20, RegionInfo::raw()).unwrap();
    let builder = provider.apply(common::builder(&format!("{name}-initiator")));
    let initiator = match timeout {
        Some(timeout) => builder.control_timeout(timeout),
        None => builder,
    }
    .build()
    .unwrap();
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { local.fill_pattern(41) };
    let addr = match via {
        Some(liar) => liar.start(&target.control_addr().to_string()),
        None => target.control_addr().to_string(),
    };
    let segment = initiator.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT).unwrap();
    assert_eq!(segment.transport(), TransportKind::Rdma);
    Pair { _provider: provider, target, remote, initiator, local, segment }
}

impl Pair {
    /// `n` blocks of `len` bytes, at the same offsets at both ends.
    fn descs(&self, n: u64, len: u64) -> Vec<BlockDesc> {
        (0..n).map(|i| BlockDesc::new(self.local.id(), i * len, self.remote.id(), i * len, len)).collect()
    }

    fn write(&self, descs: &[BlockDesc], deadline: Duration) -> Outcome {
        self.run(Batch::write(&self.segment), descs, deadline)
    }

    fn read(&self, descs: &[BlockDesc], deadline: Duration) -> Outcome {
        self.run(Batch::read(&self.segment), descs, deadline)
    }

    fn run(&self, batch: Batch<'_>, descs: &[BlockDesc], deadline: Duration) -> Outcome {
        let mut sub = self.initiator.submitter().unwrap();
        let id = sub.submit(&batch.descs(descs).checksum(true).deadline(deadline)).unwrap();
        sub.wait(id, WAIT + deadline).unwrap()
    }
}

/// The verifier threads of this process now.
fn verifier_threads() -> usize {
    let tasks = std::fs::read_dir("/proc/self/task").unwrap();
    let names = tasks.filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok());
    names.filter(|name| name.starts_with("kvring-rdma-ver")).count()
}

/// Polls `done` until it holds or `WAIT` passes; whether it held.
fn eventually(done: impl Fn() -> bool) -> bool {
    let until = Instant::now() + WAIT;
    while Instant::now() < until {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    done()
}

/// How the relay answers the initiator's CRC32C requests.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Lie {
    /// The target's own answer.
    Honest,
    /// One CRC fewer than ranges.
    Fewer,
    /// One CRC more.
    More,
    /// Every CRC flipped.
    Garbage,
    /// Another request's body (a `Checksum` answer).
    OtherBody,
    /// The previous CRC32C answer again, for this request.
    Replay,
    /// Never answers (holds the connection until the initiator drops it).
    Silent,
    /// The target's own answer, 800 ms late.
    Late,
    /// The target's own answer, 1.2 s late (a slow but healthy target).
    Slow,
    /// What a target older than the request answers it with.
    Older,
}

/// A relay between the initiator and the target's control port that
/// names itself as the target's control address in the handshake's
/// descriptor (so the link's connect and its verifier come through it)
/// and answers CRC32C requests as `lie` says. Untokened only (a sealed
/// session cannot be relayed altered: that is the token's point).
#[derive(Clone)]
struct Liar {
    lie: Arc<Mutex<Lie>>,
    /// The last honest CRC32C answer relayed, on any connection.
    last: Arc<Mutex<Option<Vec<u32>>>>,
    /// CRC32C requests relayed.
    asked: Arc<AtomicUsize>,
}

impl Liar {
    fn new() -> Self {
        Self { lie: Arc::new(Mutex::new(Lie::Honest)), last: Arc::default(), asked: Arc::default() }
    }

    fn set(&self, lie: Lie) {
        *self.lie.lock().unwrap() = lie;
    }

    /// Listens; returns the address to dial.
    fn start(&self, target: &str) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let me = listener.local_addr().unwrap().to_string();
        let (liar, target, addr) = (self.clone(), target.to_string(), me.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let (liar, target, addr) = (liar.clone(), target.clone(), addr.clone());
                std::thread::spawn(move || liar.relay(client, &target, &addr));
            }
        });
        me
    }

    fn relay(&self, mut client: TcpStream, target: &str, me: &str) {
        let Ok(mut server) = TcpStream::connect(target) else { return };
        let mut preface = [0u8; 8];
        if client.read_exact(&mut preface).is_err() || server.write_all(&preface).is_err() {
            return;
        }
        if server.read_exact(&mut preface).is_err() || client.write_all(&preface).is_err() {
            return;
        }
        loop {
            let Ok(Some(asked)) = read_frame(&mut client, MAX_CONTROL_MESSAGE_BYTES) else { return };
            let is_crc =
                matches!(Request::decode(asked.as_slice()).ok().and_then(|r| r.body), Some(request::Body::Crc32c(_)));
            let mut frame = (asked.len() as u32).to_le_bytes().to_vec();
            frame.extend_from_slice(&asked);
            if server.write_all(&frame).is_err() {
                return;
            }
            let Ok(Some(answer)) = read_frame(&mut server, MAX_CONTROL_MESSAGE_BYTES) else { return };
            let mut answer = Response::decode(answer.as_slice()).unwrap();
            let lie = *self.lie.lock().unwrap();
            match &mut answer.body {
                Some(response::Body::Handshake(handshake)) => {
                    if let Some(segment) = &mut handshake.segment {
                        segment.control_addr = me.to_string();
                    }
                }
                Some(response::Body::Crc32c(told)) if is_crc => {
                    self.asked.fetch_add(1, Ordering::AcqRel);
                    let honest = told.crcs.clone();
                    match lie {
                        Lie::Honest => {}
                        Lie::Late => std::thread::sleep(Duration::from_millis(800)),
                        Lie::Slow => std::thread::sleep(Duration::from_millis(1200)),
                        Lie::Older => {
                            let message = "malformed control request: no body".to_string();
                            let code = ErrorCode::MalformedMessage as i32;
                            let reply = kvring::testing::control::ErrorReply { code, message };
                            answer.body = Some(response::Body::Error(reply));
                        }
                        Lie::Fewer => {
                            told.crcs.pop();
                        }
                        Lie::More => told.crcs.push(0),
                        Lie::Garbage => told.crcs.iter_mut().for_each(|c| *c = !*c),
                        Lie::OtherBody => {
                            answer.body = Some(response::Body::Checksum(kvring::testing::control::ChecksumResponse {
                                checksum: 42,
                            }))
                        }
                        Lie::Replay => {
                            if let Some(previous) = &*self.last.lock().unwrap() {
                                told.crcs = previous.clone();
                            }
                        }
                        Lie::Silent => {
                            // Never answers: waits for the initiator to hang up.
                            let mut sink = [0u8; 64];
                            while matches!(client.read(&mut sink), Ok(n) if n > 0) {}
                            return;
                        }
                    }
                    *self.last.lock().unwrap() = Some(honest);
                }
                _ => {}
            }
            if write_frame(&mut client, &answer).is_err() {
                return;
            }
        }
    }
}

/// Probe I1 (a hostile target, through the relay): a wrong count of CRCs
/// (fewer, more), garbage, another request's body, a replayed answer and
/// silence each end the checksummed push typed (`Malformed`, `Corrupt`
/// naming block 0, `TimedOut` at the batch's deadline), never `Done`; an
/// honest answer afterwards is `Done` again (no connection left out of
/// step).
#[test]
fn i1_a_lying_target_gets_a_typed_error_never_done() {
    let _turn = turn();
    let liar = Liar::new();
    let p = pair("r9b-liar", Some(&liar));
    let descs = p.descs(4, 16 << 10);
    assert!(p.write(&descs, WAIT).is_done(), "an honest relay is verified");
    assert!(liar.asked.load(Ordering::Acquire) >= 1, "the verifier asked through the relay");
    let malformed = |outcome: &Outcome| matches!(outcome, Outcome::Failed(Error::Malformed { .. }));
    for lie in [Lie::Fewer, Lie::More, Lie::OtherBody] {
        liar.set(lie);
        let outcome = p.write(&descs, WAIT);
        assert!(malformed(&outcome), "{lie:?}: {outcome:?}");
        liar.set(Lie::Honest);
        assert!(p.write(&descs, WAIT).is_done(), "honest again after {lie:?}");
    }
    liar.set(Lie::Garbage);
    let outcome = p.write(&descs, WAIT);
    assert!(matches!(outcome, Outcome::Failed(Error::Corrupt { desc_index: 0, .. })), "{outcome:?}");
    let outcome = p.read(&descs, WAIT);
    match outcome {
        Outcome::Failed(error @ Error::Corrupt { desc_index: 0, .. }) => {
            assert!(error.to_string().contains("once read over rdma"), "{error}")
        }
        other => panic!("a pull the target lies about: {other:?}"),
    }
    liar.set(Lie::Older);
    let outcome = p.write(&descs, WAIT);
    match outcome {
        Outcome::Failed(error @ Error::Unsupported { .. }) => {
            assert!(error.to_string().contains("older kvring"), "{error}")
        }
        other => panic!("an older target: {other:?}"),
    }
    // Another request's answer: the previous push's CRCs (other bytes).
    liar.set(Lie::Honest);
    let other: Vec<BlockDesc> =
        (0..4).map(|i| BlockDesc::new(p.local.id(), 200_000 + i * 4096, p.remote.id(), i * 4096, 16 << 10)).collect();
    assert!(p.write(&other, WAIT).is_done());
    liar.set(Lie::Replay);
    let outcome = p.write(&descs, WAIT);
    assert!(
        matches!(outcome, Outcome::Failed(Error::Corrupt { .. } | Error::Malformed { .. })),
        "a replayed answer: {outcome:?}"
    );
    liar.set(Lie::Silent);
    let outcome = p.write(&descs, Duration::from_millis(500));
    assert!(matches!(outcome, Outcome::TimedOut { .. }), "a silent target: {outcome:?}");
    liar.set(Lie::Honest);
    assert!(p.write(&descs, WAIT).is_done(), "honest again after silence");
    // A verdict that comes after its chunk was withdrawn (the batch's
    // deadline) is ignored: the next push, corrupted where it landed,
    // verified meanwhile on the other thread, still fails `Corrupt`.
    liar.set(Lie::Late);
    let outcome = p.write(&descs, Duration::from_millis(300));
    assert!(matches!(outcome, Outcome::TimedOut { .. }), "a late target: {outcome:?}");
    liar.set(Lie::Honest);
    let remote = p.remote.clone();
    kvring::testing::checksum::corrupt_rdma_landings_with(Some(Box::new(move |_, offset| {
        let mut byte = [0u8];
        // SAFETY: the WRITE naming this byte completed; the test is its
        // only other writer (a stray writer at the target).
        unsafe {
            remote.read_at(offset, &mut byte).unwrap();
            remote.write_at(offset, &[byte[0] ^ 0x3c]).unwrap();
        }
    })));
    kvring::testing::checksum::corrupt_landing_at(2 * (16 << 10));
    let outcome = p.write(&descs, WAIT);
    kvring::testing::checksum::corrupt_rdma_landings_with(None);
    assert!(matches!(outcome, Outcome::Failed(Error::Corrupt { desc_index: 2, .. })), "{outcome:?}");
    assert!(p.write(&descs, WAIT).is_done(), "honest again after a late answer");
}

/// Probe I2: the verifier threads end with the link: two while a segment
/// is open and verified, none once it is closed (its lane links dropped),
/// and none left once the engines are dropped.
#[test]
fn i2_the_verifier_threads_end_with_the_link() {
    let _turn = turn();
    // An earlier test's threads end with its engines (at most a control
    // timeout after, if one was mid-question).
    assert!(eventually(|| verifier_threads() == 0), "an earlier test's verifier threads outlived it");
    let before = verifier_threads();
    let p = pair("r9b-threads", None);
    assert!(p.write(&p.descs(4, 4096), WAIT).is_done());
    assert_eq!(verifier_threads(), before + 2, "two verifier threads per link");
    p.initiator.close_segment(&p.segment);
    let closed = eventually(|| verifier_threads() == before);
    drop(p);
    assert!(eventually(|| verifier_threads() == before), "verifier threads outlived their engines");
    assert!(closed, "verifier threads outlived their closed segment");
}

/// Probe I3: a segment closed while a chunk waits on its verdict (the
/// target holds the answer): the batch ends typed, never `Done`, and the
/// engine verifies a new segment's push afterwards.
#[test]
fn i3_a_segment_closed_while_verifying_ends_the_batch_typed() {
    let _turn = turn();
    let p = pair("r9b-close", None);
    let descs = p.descs(8, 16 << 10);
    assert!(p.write(&descs, WAIT).is_done(), "the verifier is connected");
    let stalled = kvring::testing::stall_crc32c_answers();
    let mut sub = p.initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&p.segment).descs(&descs).checksum(true).deadline(WAIT)).unwrap();
    assert!(eventually(|| stalled.waiting() >= 1), "the verification never reached the target");
    p.initiator.close_segment(&p.segment);
    let outcome = sub.wait(id, WAIT + WAIT).unwrap();
    drop(stalled);
    eprintln!("closed while verifying: {outcome:?}");
    assert!(!outcome.is_done(), "a chunk whose verification never ended was reported done");
    assert!(!matches!(outcome, Outcome::Failed(Error::Corrupt { .. })), "{outcome:?}");
    let addr = p.target.control_addr().to_string();
    let again = p.initiator.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT).unwrap();
    let mut sub = p.initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&again).descs(&descs).checksum(true).deadline(WAIT)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done(), "a new segment verifies again");
}

/// Probe I4: the target's control plane cut off while a chunk waits on
/// its verdict: the verifier's question fails and the batch ends typed
/// (not `Done`), well before its own deadline.
#[test]
fn i4_a_target_cut_off_mid_question_ends_the_batch_typed() {
    let _turn = turn();
    let p = pair("r9b-cut", None);
    let descs = p.descs(8, 16 << 10);
    assert!(p.write(&descs, WAIT).is_done(), "the verifier is connected");
    let stalled = kvring::testing::stall_crc32c_answers();
    let mut sub = p.initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&p.segment).descs(&descs).checksum(true).deadline(WAIT * 6)).unwrap();
    assert!(eventually(|| stalled.waiting() >= 1), "the verification never reached the target");
    let target = p.target.clone();
    let stopper = std::thread::spawn(move || kvring::testing::stop_control_server(&target));
    let outcome = sub.wait(id, WAIT);
    drop(stalled);
    stopper.join().unwrap();
    let outcome = outcome.expect("the batch ended once the target's control plane was cut");
    eprintln!("cut off while verifying: {outcome:?}");
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    assert!(!matches!(outcome, Outcome::Failed(Error::Corrupt { .. })), "{outcome:?}");
}

/// Probe I5: many checksummed chunks at once (16 batches of 12 chunks,
/// 192 verifications: past the threads' queue of 64) are each verified
/// and done; a corrupted landing in the middle chunk of a large batch
/// fails it `Corrupt` naming that block, never done.
#[test]
fn i5_many_chunks_are_verified_and_a_corruption_deep_in_a_batch_is_named() {
    let _turn = turn();
    let p = pair("r9b-many", None);
    let descs = p.descs(3000, 256);
    // Sixteen submitters (a descriptor arena each), a batch of 12 chunks each.
    let mut subs: Vec<_> = (0..16).map(|_| p.initiator.submitter().unwrap()).collect();
    let batch = Batch::write(&p.segment).descs(&descs).checksum(true).deadline(WAIT * 3);
    let ids: Vec<Vec<_>> = subs.iter_mut().map(|sub| (0..1).map(|_| sub.submit(&batch).unwrap()).collect()).collect();
    for (sub, ids) in subs.iter_mut().zip(ids) {
        for id in ids {
            let outcome = sub.wait(id, WAIT * 4).unwrap();
            assert!(matches!(outcome, Outcome::Done { bytes } if bytes == 3000 * 256), "{outcome:?}");
        }
    }
    let remote = p.remote.clone();
    kvring::testing::checksum::corrupt_rdma_landings_with(Some(Box::new(move |_, offset| {
        let mut byte = [0u8];
        // SAFETY: the WRITE naming this byte completed; the test is its
        // only other writer (a stray writer at the target).
        unsafe {
            remote.read_at(offset, &mut byte).unwrap();
            remote.write_at(offset, &[byte[0] ^ 0xa5]).unwrap();
        }
    })));
    kvring::testing::checksum::corrupt_landing_at(2000 * 256);
    let outcome = p.write(&descs, WAIT * 3);
    kvring::testing::checksum::corrupt_rdma_landings_with(None);
    assert!(matches!(outcome, Outcome::Failed(Error::Corrupt { desc_index: 2000, .. })), "{outcome:?}");
}

/// Probe T6 (CPU exhaustion): one source asking for CRC32Cs from many
/// connections at once. Each request is bounded (1 GiB); how many sums a
/// single source runs at once must be bounded too, by the control plane's
/// per-source cap (32 connections, `MAX_CONTROL_CONNECTIONS_PER_SOURCE`,
/// and 64 in all): the rest refused `Busy`, typed. HOLE: a request is
/// served while its connection is still pending (admitted only once
/// answered), and a newcomer past the per-source cap evicts the oldest
/// pending connection by shutting its socket, while that connection's
/// thread goes on summing: 80 connections from one address had 80 sums
/// running at once (the stall hook counts them; 16 of them had been cut
/// off, "closed the connection without answering"), each of which may be
/// 1 GiB, each on its own thread. docs/SECURITY.md says "the control
/// connection limits bound how many": they do not. The bench's `Checksum`
/// request (whole region, exclusive) is served the same way.
#[test]
fn t6_one_source_holds_at_most_its_per_source_share_of_sums() {
    let _turn = turn();
    let t = target("r9b-flood", None);
    let r = t.readable.id().raw();
    let stalled = kvring::testing::stall_crc32c_answers();
    const ASKERS: usize = 80;
    let ended = Arc::new(AtomicUsize::new(0));
    let askers: Vec<_> = (0..ASKERS)
        .map(|_| {
            let (addr, ended) = (t.addr.clone(), ended.clone());
            std::thread::spawn(move || {
                let answer = ask(&addr, &[(r, 0, 4096)]);
                ended.fetch_add(1, Ordering::AcqRel);
                answer
            })
        })
        .collect();
    // Every asker is either held at the target or has its answer (a
    // refusal, or its connection cut).
    eventually(|| stalled.waiting() + ended.load(Ordering::Acquire) >= ASKERS);
    let held = stalled.waiting();
    // Askers that had their answer (a refusal, or their connection cut)
    // while the sums were held.
    let cut = ended.load(Ordering::Acquire);
    drop(stalled);
    let answers: Vec<_> = askers.into_iter().map(|a| a.join().unwrap()).collect();
    let busy = answers.iter().filter(|a| matches!(a, Err(Error::Remote { code: ErrorCode::Busy, .. }))).count();
    let failed: Vec<_> = answers.iter().filter_map(|a| a.as_ref().err()).map(|e| e.to_string()).take(2).collect();
    eprintln!(
        "{ASKERS} askers from one source: {held} sums held at once, {cut} ended meanwhile, {busy} busy: {failed:?}"
    );
    assert!(held <= 32, "one source had {held} sums running at once (per-source cap 32, 64 in all)");
}

/// Probe I6 (fences and checksums together): a granted checksummed push
/// is verified and done, a fence after it passes (its counts given back),
/// and a checksummed push under the now stale grant is refused `Fenced`,
/// never verified into `Done`.
#[test]
fn i6_a_granted_checksummed_push_is_verified_and_a_stale_one_fenced() {
    let _turn = turn();
    let p = pair("r9b-fence", None);
    let descs = p.descs(8, 16 << 10);
    let grant = p.target.fence(p.remote.id(), 0, 2 << 20).unwrap();
    let granted = |grant: u32| {
        let mut sub = p.initiator.submitter().unwrap();
        let batch = Batch::write(&p.segment).descs(&descs).checksum(true).grant(grant).deadline(WAIT);
        let id = sub.submit(&batch).unwrap();
        sub.wait(id, WAIT + WAIT).unwrap()
    };
    let outcome = granted(grant);
    assert!(outcome.is_done(), "{outcome:?}");
    let next = p.target.fence(p.remote.id(), 0, 2 << 20).unwrap();
    assert_ne!(next, grant);
    let outcome = granted(grant);
    assert!(common::fenced(&outcome), "a stale grant's checksummed push: {outcome:?}");
    assert!(granted(next).is_done());
}

/// Probe I7: a slow but healthy target, each question answered within the
/// control timeout (1.2 s of 2 s), and a batch of four checksummed chunks
/// with a deadline far away (WAIT): the batch is verified and done, as
/// docs/CHECKSUMS.md says ("a question is bounded by the engine's control
/// timeout"). HOLE:
/// each chunk's verification deadline is fixed when it completes
/// (`Verifier::start`: now + the control timeout), so the time a job
/// waits in the queue behind the two threads' other questions counts
/// against it: chunks 3 and 4 wait 1.2 s, are asked with 0.8 s left and
/// fail `Timeout`, long before the batch's own deadline. At scale: 128
/// chunks of 512 MiB verified at ~0.1 s each on two threads need 6.4 s,
/// so a healthy 64 GiB checksummed batch fails at the default 5 s.
#[test]
fn i7_a_slow_healthy_target_verifies_a_batch_of_several_chunks() {
    let _turn = turn();
    let liar = Liar::new();
    let p = pair_timed("r9b-slow", Some(&liar), Some(Duration::from_secs(2)));
    let descs = p.descs(4 * 256, 256);
    assert!(p.write(&descs, WAIT).is_done(), "an honest relay is verified");
    liar.set(Lie::Slow);
    let asked = liar.asked.load(Ordering::Acquire);
    let outcome = p.write(&descs, WAIT);
    liar.set(Lie::Honest);
    eprintln!("four chunks, each question 1.2 s of a 2 s timeout: {outcome:?}");
    assert!(liar.asked.load(Ordering::Acquire) > asked);
    assert!(outcome.is_done(), "a healthy target within the timeout per question: {outcome:?}");
}

/// Probe I8: the target's region unregistered between a push's landing
/// and its verification (the question held at the target meanwhile): the
/// target refuses the CRC (`UNKNOWN_REGION`) and the batch ends with that
/// typed error, not `Done` and not `Corrupt`.
#[test]
fn i8_a_destination_unregistered_before_its_verification_fails_typed() {
    let _turn = turn();
    let p = pair("r9b-gone", None);
    let descs = p.descs(8, 16 << 10);
    assert!(p.write(&descs, WAIT).is_done(), "the verifier is connected");
    let stalled = kvring::testing::stall_crc32c_answers();
    let mut sub = p.initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&p.segment).descs(&descs).checksum(true).deadline(WAIT)).unwrap();
    assert!(eventually(|| stalled.waiting() >= 1), "the verification never reached the target");
    p.target.unregister(p.remote.id()).unwrap();
    drop(stalled);
    let outcome = sub.wait(id, WAIT + WAIT).unwrap();
    assert!(matches!(outcome, Outcome::Failed(Error::Remote { code: ErrorCode::UnknownRegion, .. })), "{outcome:?}");
}

/// Probe T7: no sum reads a caller's memory after its engine is dropped.
/// `Engine::register`'s contract lets the caller free its memory once
/// "the region is unregistered (or the engine dropped)". A CRC32C answer
/// in progress when the engine is dropped (held here by the stall hook,
/// as a 1 GiB sum on a loaded core would be) outlives the control
/// server's stop, which waits at most 5 s (`CONNECTION_DRAIN`) for a
/// connection in the middle of a request and then lets the drop return:
/// the caller unmaps its memory, and the answer, still holding the
/// registry (an `Arc` of the control context), leases the region and
/// sums unmapped memory. HOLE: the process dies of SIGSEGV (so this test
/// fails by crashing its binary when run with `--ignored`); without the
/// `munmap` it passes, after the 5 s drain. The bench's `Checksum`
/// answer has the same window.
#[test]
fn t7_no_sum_reads_a_callers_memory_after_its_engine_is_dropped() {
    let _turn = turn();
    let engine = common::builder("r9b-drop").build().unwrap();
    let len = 1 << 20;
    // SAFETY: a fresh anonymous mapping of our own.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    // SAFETY: the mapping stays until the engine is dropped (below), as
    // `register`'s contract asks.
    let id = unsafe { engine.register(ptr.cast(), len, RegionInfo::raw()) }.unwrap();
    let addr = engine.control_addr().to_string();
    let stalled = kvring::testing::stall_crc32c_answers();
    let asker = std::thread::spawn(move || ask(&addr, &[(id.raw(), 0, len as u64)]));
    assert!(eventually(|| stalled.waiting() >= 1), "the request never reached the target");
    // The held answer goes on past the control server's 5 s drain (as a
    // 1 GiB sum on a loaded core would); the drop must wait for it.
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(7));
        drop(stalled);
    });
    let dropping = Instant::now();
    drop(engine);
    assert!(releaser.is_finished() || dropping.elapsed() >= Duration::from_secs(7), "the drop waited for the sum");
    // The engine is gone: the caller takes its memory back.
    // SAFETY: ours, and registered with an engine that no longer exists.
    assert_eq!(unsafe { libc::munmap(ptr, len) }, 0);
    releaser.join().unwrap();
    // Answered or cut off, never a read of the unmapped memory (which
    // would kill the process here).
    let _ = asker.join().unwrap();
    let until = Instant::now() + Duration::from_millis(500);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(10));
    }
}
