//! Hostile review 12: review 11's fix of its hole 3, the cut-off memory
//! (`src/engine/fence_pushers.rs`: `cut_off`, `check_not_cut_off`,
//! `CUT_OFF_HOLD`), and its hole 6 (a `Probe` admits no longer on a
//! tokened engine, `src/control/server.rs`).
//!
//! The memory is keyed by the name and the control address a writer
//! *claimed*, and `fence_rdma::push` enters every writer whose fence
//! answer was an error, not only one that did not answer: each probe
//! asks whether a stranger can get an honest writer, a name and address
//! it does not own, refused at its next connects. The honest writer is a
//! real engine (`rdma_pair`, no token, on the simulated provider); the
//! stranger speaks the control protocol by hand (`ControlClient`).

mod common;

use common::verbs::{rdma_pair, RdmaPair};
use common::WAIT;
use kvring::testing::control::{request, response, ControlClient, Initiator, RdmaConnectRequest};
use kvring::{Engine, Error, TransportKind};
use std::time::Instant;

const MIB: u64 = 1 << 20;
/// The push key length an rdma connect carries (`PUSH_KEY_BYTES`).
const KEY: usize = 16;

/// One made-up QP (a connect of none is refused for its shape).
fn qp() -> kvring::rdma::QpEndpoint {
    kvring::rdma::QpEndpoint { qpn: 0x77, psn: 1, gid: [0; 16], lid: 1, mtu: 1024 }
}

/// A stranger's rdma connect to `target`, its handshake claiming `who`
/// (name, epoch, control address), checking fences with `key` or not.
fn connect_claiming(target: &Engine, who: &Initiator, key: Option<[u8; KEY]>) -> kvring::Result<()> {
    let deadline = Instant::now() + WAIT;
    let mut client = ControlClient::connect(&target.control_addr().to_string(), deadline)?;
    client.handshake(who, None, deadline)?;
    let request = RdmaConnectRequest {
        initiator: String::new(),
        nics: 1,
        endpoints: vec![qp().to_proto()],
        checks_fences: key.is_some(),
        push_key: key.map(|k| k.to_vec()).unwrap_or_default(),
    };
    match client.call(request::Body::RdmaConnect(request), deadline)? {
        response::Body::RdmaConnect(_) => Ok(()),
        other => panic!("an rdma connect answered {other:?}"),
    }
}

/// The honest initiator as it names itself in its handshakes.
fn honest(initiator: &Engine) -> Initiator {
    Initiator {
        name: initiator.name().to_string(),
        epoch: initiator.epoch(),
        addr: initiator.control_addr().to_string(),
    }
}

/// The honest initiator opens the target again over rdma (a new link, a
/// new rdma connect under its own name, epoch and address).
fn honest_reopens(pair: &RdmaPair) -> kvring::Result<kvring::Segment> {
    pair.initiator.close_segment(&pair.segment);
    let addr = pair.target.control_addr().to_string();
    pair.initiator.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT)
}

// Found by review 12 (medium), fixed since): a stranger gets an honest writer refused, with no dial
// and no epoch. The cut-off memory is keyed by the claimed name and
// address, and `fence_rdma::push` enters every writer whose answer was an
// error, including one that never checks fences (`checks_fences: false`,
// answered "does not check fences" without being asked). A stranger
// naming the honest writer and its control address (both public: the
// writer's descriptor), any other epoch, no push key, is accepted without
// a dial; the target's next fence cuts the stranger off and remembers
// (honest name, honest address): the honest writer's connects (this
// start's and the next one's) are refused for 10 s, renewed by the
// stranger at every fence. Proposed fix: in `fence_rdma::push`, call
// `pushers.cut_off(writer)` only for a writer with a push key whose
// answer was no answer by the deadline (`Timeout`/`Io`), never for an
// answer or a writer not asked.
#[test]
fn a_stranger_without_a_push_key_cannot_get_an_honest_writer_refused() {
    let pair = rdma_pair("r12-nokey", None);
    let mut stranger = honest(&pair.initiator);
    stranger.epoch ^= 0x5a5a;
    connect_claiming(&pair.target, &stranger, None).unwrap();
    pair.target.fence(pair.remote.id(), 0, MIB).unwrap();
    let again = honest_reopens(&pair);
    assert!(again.is_ok(), "the honest writer was refused after a stranger claimed its address: {:?}", again.err());
}

// Found by review 12 (medium), fixed since): the same with a push key. The stranger names the honest
// writer's name, epoch and address; the target dials the address, where
// the honest engine answers as itself, so the connect is accepted (the
// stranger's QPs replace the honest writer's, as review 11 noted). The
// next fence is pushed to the honest writer with the stranger's key; the
// honest writer refuses it at once (`Unauthorized`: not its key), and the
// target, taking that answer for a fence not answered, cuts it off and
// remembers it: its reconnect is refused for 10 s. Before review 11's fix
// the honest writer's reconnect took its identity back at once. Proposed
// fix: as above (an answer, even a refusal, is not a writer that stalls
// fences; only a missed deadline is remembered).
#[test]
fn an_impersonators_refused_fence_does_not_get_the_honest_writer_refused() {
    let pair = rdma_pair("r12-imp", None);
    connect_claiming(&pair.target, &honest(&pair.initiator), Some([0xEE; KEY])).unwrap();
    pair.target.fence(pair.remote.id(), 0, MIB).unwrap();
    let again = honest_reopens(&pair);
    assert!(again.is_ok(), "the honest writer was refused after an impersonator's fence: {:?}", again.err());
}

/// The honest writer alone: its fences are answered, nothing is cut off,
/// and it opens the target again at once (the holes above are the
/// stranger's doing, not the hold's ordinary path).
#[test]
fn an_honest_writer_whose_fences_are_answered_reconnects_at_once() {
    let pair = rdma_pair("r12-plain", None);
    pair.target.fence(pair.remote.id(), 0, MIB).unwrap();
    let again = honest_reopens(&pair).unwrap();
    assert_eq!(again.transport(), TransportKind::Rdma);
}

/// Review 11's hole 6 fix on an engine without a token: a `Probe` still
/// admits, so a request after it on the same connection is served (what
/// `Segment::kv_layout` does with no token: a probe, then `memory_info`),
/// and the answer is the engine's, not a refusal for want of a proof.
#[test]
fn an_untokened_engines_probe_still_admits_the_next_request() {
    let engine = common::builder("r12-untokened").build().unwrap();
    let deadline = Instant::now() + WAIT;
    let mut client = ControlClient::connect(&engine.control_addr().to_string(), deadline).unwrap();
    let (name, epoch) = client.probe(deadline).unwrap();
    assert_eq!((name.as_str(), epoch), (engine.name(), engine.epoch()));
    // No layout published: the engine's own "none yet", over the same
    // connection, not `Unauthorized` nor a closed connection (`Io`).
    match client.memory_info(deadline) {
        Ok(_) => {}
        Err(Error::Remote { message, .. }) => assert!(!message.contains("nauthor"), "{message}"),
        Err(other) => panic!("a request after a probe on an engine without a token: {other:?}"),
    }
}
