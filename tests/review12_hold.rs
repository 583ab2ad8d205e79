//! Hostile review 12: whether review 11's hold of a writer cut off for a
//! fence it did not answer (`CUT_OFF_HOLD`, 10 s, keyed by the claimed
//! name and the claimed control address *as spelt*) holds the writer
//! that stalled the fence, or only that spelling of it.
//!
//! The writer is a fake control server in this test: it answers every
//! handshake as the identity the test sets and takes every fence without
//! answering (the connection held until the target closes it), so that
//! each fence of the target waits its whole wait (`FENCE_WAIT`, 2 s) for
//! it. On the simulated provider (tests/common/verbs.rs).

mod common;

use common::verbs::Provider;
use common::WAIT;
use kvring::testing::control::{
    preface, read_frame, request, response, write_frame, ControlClient, HandshakeResponse, Initiator, ProbeResponse,
    Request, MAX_CONTROL_MESSAGE_BYTES,
};
use kvring::{Engine, RegionInfo};
use prost::Message as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;
/// The push key length an rdma connect carries (`PUSH_KEY_BYTES`).
const KEY: usize = 16;

/// A silent writer: answers handshakes as `identity`, probes as alive,
/// and never answers a fence.
struct SilentWriter {
    addr: SocketAddr,
    identity: Arc<Mutex<(String, u64)>>,
    fences: Arc<AtomicUsize>,
}

impl SilentWriter {
    fn start(like: &Engine) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut descriptor = kvring::testing::descriptor(like);
        descriptor.control_addr = addr.to_string();
        descriptor.host_id = "r12-elsewhere".into();
        descriptor.regions.clear();
        descriptor.tcp_addr = None;
        descriptor.rdma = None;
        descriptor.cma = None;
        let identity = Arc::new(Mutex::new((String::from("r12-nobody"), 1)));
        let fences = Arc::new(AtomicUsize::new(0));
        let (who, count) = (identity.clone(), fences.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (who, count, descriptor) = (who.clone(), count.clone(), descriptor.clone());
                std::thread::spawn(move || serve(stream, &who, &count, descriptor));
            }
        });
        Self { addr, identity, fences }
    }

    fn answer_as(&self, name: &str, epoch: u64) {
        *self.identity.lock().unwrap() = (name.to_string(), epoch);
    }
}

fn serve(
    mut s: TcpStream,
    who: &Mutex<(String, u64)>,
    fences: &AtomicUsize,
    mut descriptor: kvring::testing::SegmentDescriptor,
) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(60)));
    let mut theirs = [0u8; 8];
    if s.read_exact(&mut theirs).is_err() || s.write_all(&preface()).is_err() {
        return;
    }
    while let Ok(Some(frame)) = read_frame(&mut s, MAX_CONTROL_MESSAGE_BYTES) {
        let Ok(Request { body: Some(body), .. }) = Request::decode(frame.as_slice()) else { break };
        let (name, epoch) = who.lock().unwrap().clone();
        let answer = match body {
            request::Body::Handshake(_) => {
                descriptor.name = name;
                descriptor.epoch = epoch;
                let segment = Some(Box::new(descriptor.to_proto()));
                response::Body::Handshake(HandshakeResponse { segment, ..Default::default() })
            }
            request::Body::Probe(_) => response::Body::Probe(ProbeResponse { name, epoch }),
            request::Body::RdmaFence(_) => {
                // Taken, never answered: the target waits its whole wait.
                fences.fetch_add(1, Ordering::SeqCst);
                let _ = s.read_to_end(&mut Vec::new());
                break;
            }
            _ => break,
        };
        if write_frame(&mut s, &response(answer)).is_err() {
            break;
        }
    }
}

/// A target serving rdma on the simulated provider, with a destination.
fn target(name: &str, provider: &Provider) -> (Engine, kvring::Region) {
    let target = provider.apply(common::builder(name)).build().unwrap();
    let region = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    (target, region)
}

/// A peer's rdma connect to `target` as `who` (name, epoch) at `claimed`.
fn connect_as(target: &Engine, who: (&str, u64), claimed: &str) -> kvring::Result<()> {
    let deadline = Instant::now() + WAIT;
    let me = Initiator { name: who.0.into(), epoch: who.1, addr: claimed.into() };
    let mut client = ControlClient::connect(&target.control_addr().to_string(), deadline)?;
    client.handshake(&me, None, deadline)?;
    let qp = kvring::rdma::QpEndpoint { qpn: 0x77, psn: 1, gid: [0; 16], lid: 1, mtu: 1024 };
    client.rdma_connect(1, &[qp], &[7; KEY], deadline).map(drop)
}

/// The silent writer connected, one fence stalled by it and cut off: the
/// hold's starting point; the writer's address as it claimed it.
fn stall_one_fence(target: &Engine, region: &kvring::Region, writer: &SilentWriter, name: &str) -> String {
    writer.answer_as(name, 1);
    let at = writer.addr.to_string();
    connect_as(target, (name, 1), &at).unwrap();
    target.fence(region.id(), 0, MIB as u64).unwrap();
    assert_eq!(writer.fences.load(Ordering::SeqCst), 1, "the fence was pushed to the silent writer");
    // The hold as review 11 probed it: the same claim is refused.
    assert!(connect_as(target, (name, 1), &at).is_err(), "the same claim was accepted again at once");
    at
}

// Found by review 12 (low), fixed since): the hold is keyed by the address *as the peer spelt it*.
// The writer that stalled a fence connects again at once under the same
// name (and epoch), claiming the same listener spelt as an IPv4-mapped
// IPv6 address (`[::ffff:127.0.0.1]:port`): another key, so not held; the
// target dials it, reaches the same silent writer, accepts it, and the
// next fence waits its whole wait again. Proposed fix: key the hold by
// the parsed address in canonical form (`SocketAddr::parse`, then
// `to_canonical()` on its IP) and by the name alone, not the string.
#[test]
fn a_cut_off_writer_is_held_however_it_spells_its_address() {
    let provider = Provider::new();
    let (target, region) = target("r12-spell-target", &provider);
    let writer = SilentWriter::start(&target);
    let at = stall_one_fence(&target, &region, &writer, "r12-spell-writer");
    let respelt = format!("[::ffff:127.0.0.1]:{}", writer.addr.port());
    assert_ne!(respelt, at);
    let again = connect_as(&target, ("r12-spell-writer", 1), &respelt);
    assert!(again.is_err(), "the writer cut off a moment ago was accepted again under its address respelt");
}

// Found by review 12 (low), fixed since; review 11 named it "bounded only by the control listener's
// per-source bounds", but those bound connections at once, not renames
// over time): the writer that stalled a fence comes back at once under a
// new name at the very same address, where the same engine answers the
// dial as the new name (without a token a name proves nothing), is
// accepted, and stalls the next fence its whole wait: one rename per
// fence runs review 11's hole 3 loop as before. Proposed fix: hold the
// claimed address itself (canonical IP and port: what the dial proved is
// the stalling engine) whatever name claims it, beside the name.
#[test]
fn a_cut_off_writer_is_held_whatever_name_it_claims_next() {
    let provider = Provider::new();
    let (target, region) = target("r12-rename-target", &provider);
    let writer = SilentWriter::start(&target);
    let at = stall_one_fence(&target, &region, &writer, "r12-rename-writer");
    writer.answer_as("r12-rename-writer-2", 1);
    let again = connect_as(&target, ("r12-rename-writer-2", 1), &at);
    assert!(again.is_err(), "the engine at an address cut off a moment ago was accepted again under a new name");
}

/// The hold as review 11 meant it: the same name at the same address,
/// under a new epoch (a restart of the same writer), is held too, with
/// the reason.
#[test]
fn a_cut_off_writers_next_start_at_the_same_address_is_held() {
    let provider = Provider::new();
    let (target, region) = target("r12-epoch-target", &provider);
    let writer = SilentWriter::start(&target);
    let at = stall_one_fence(&target, &region, &writer, "r12-epoch-writer");
    writer.answer_as("r12-epoch-writer", 2);
    match connect_as(&target, ("r12-epoch-writer", 2), &at) {
        Err(kvring::Error::Remote { message, .. }) => assert!(message.contains("cut off"), "{message}"),
        other => panic!("a new start of a writer cut off a moment ago: {other:?}"),
    }
}
