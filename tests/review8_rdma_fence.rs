//! Hostile review 8: fenced destinations over rdma (the mirrors of a
//! target's fence tables at each initiator, kept current by the fences the
//! target pushes over the control plane). Each test asserts what
//! docs/ARCHITECTURE.md ("Fenced destinations over rdma") and
//! docs/SECURITY.md promise: a stale write after a fence never lands; a
//! push is the target's own (a third party, token or not, cannot enter
//! fences in an initiator's mirrors of a target it is not); a peer's table
//! words are read so that no write the table fences passes.
//!
//! On the simulated provider (tests/common/verbs.rs).

mod common;

use common::verbs::{Provider, RdmaPair};
use common::{fenced, pattern, WAIT};
use kvring::testing::control::{ControlClient, ErrorCode, Initiator, RdmaFenceRequest, RdmaFenceSpans};
use kvring::testing::fence::{FenceView, Span};
use kvring::{BlockDesc, Engine, Error, Outcome, Region, RegionInfo, Segment, TransportKind};
use std::sync::atomic::AtomicU64;
use std::time::Instant;

const MIB: usize = 1 << 20;
const BLOCK: u64 = 64 * 1024;

/// A target with a 2 MiB destination and an initiator that opened it over
/// rdma (as tests/fence_rdma.rs).
struct Setup {
    initiator: Engine,
    local: Region,
    segment: Segment,
    remote: Region,
    target: Engine,
    token: Option<String>,
    _provider: Provider,
}

impl Setup {
    fn new(name: &str, token: Option<&str>) -> Self {
        let RdmaPair { provider, target, remote, initiator, local, segment } = common::verbs::rdma_pair(name, token);
        Self { initiator, local, segment, remote, target, token: token.map(str::to_string), _provider: provider }
    }

    fn descs(&self) -> Vec<BlockDesc> {
        let remote = self.segment.region(0).unwrap();
        (0..MIB as u64 / BLOCK).map(|i| BlockDesc::new(self.local.id(), i * BLOCK, remote, i * BLOCK, BLOCK)).collect()
    }

    fn push(&self, grant: Option<u32>) -> Outcome {
        common::push_granted(&self.initiator, &self.segment, &self.descs(), grant)
    }

    /// A third party's push to the initiator of a fence of the whole
    /// destination under `generation`, its handshake naming the target
    /// (its name and epoch are public: the metadata and every handshake
    /// carry them), with the cluster token where there is one.
    fn forge_push(&self, generation: u32) -> kvring::Result<()> {
        self.forge(generation, vec![0, 2 * MIB as u64, 0, 1])
    }

    /// The same, with `spans` as its words.
    fn forge(&self, generation: u32, spans: Vec<u64>) -> kvring::Result<()> {
        let deadline = Instant::now() + WAIT;
        let posing =
            Initiator { name: self.target.name().to_string(), epoch: self.target.epoch(), addr: "127.0.0.1:9".into() };
        let token = self.token.as_deref().map(kvring::Token::new);
        let mut client = ControlClient::connect(&self.initiator.control_addr().to_string(), deadline)?;
        client.handshake(&posing, token.as_ref(), deadline)?;
        let request = RdmaFenceRequest {
            generation,
            regions: vec![RdmaFenceSpans { region: self.remote.id().raw(), spans }],
            wait_ms: 0,
            ..Default::default()
        };
        client.rdma_fence(request, deadline)
    }
}

/// A push refused as not the target's.
fn unauthorized(answer: &kvring::Result<()>) -> bool {
    matches!(answer, Err(Error::Remote { code: ErrorCode::Unauthorized, .. }))
}

/// Probe 4/standards: "a peer proves what it claims, and what it proved
/// binds everything after". Without a token the handshake proves no name,
/// so a push must prove it comes from the target this initiator connected
/// to by something only that target holds. A third party posing as the
/// target must not enter a fence in the initiator's mirrors: the owner's
/// push under the current grant still lands.
#[test]
fn a_third_party_without_a_token_cannot_push_fences_for_a_target() {
    let s = Setup::new("r8-forge", None);
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 8)).unwrap() };
    let grant = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    s.push(Some(grant)).into_result().unwrap();
    let forged = s.forge_push(u32::MAX);
    assert!(unauthorized(&forged), "a push from a party that is not the target was taken: {forged:?}");
    // Refused before its spans are decoded: garbage costs a stranger's
    // push nothing more.
    let garbage = s.forge(u32::MAX, vec![1, 2, 3]);
    assert!(unauthorized(&garbage), "{garbage:?}");
    let outcome = s.push(Some(grant));
    assert!(!fenced(&outcome), "a forged fence refused the grant holder's push: {outcome:?}");
    outcome.into_result().unwrap();
    assert_eq!(common::read(&s.remote, 0, MIB), pattern(MIB, 8));
}

/// The same with a cluster token: the token proves membership of the
/// cluster, not that the pusher is the target (every engine holds it), so
/// a member must not push fences as another member.
#[test]
fn a_token_holder_cannot_push_fences_as_another_engine() {
    let s = Setup::new("r8-forge-token", Some("r8-s3cret"));
    let grant = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    let forged = s.forge_push(u32::MAX);
    // Refused as a failed proof on a sealed session is: closed unanswered.
    assert!(forged.is_err(), "a token holder posing as the target pushed a fence: {forged:?}");
    s.push(Some(grant)).into_result().unwrap();
    // The real target's pushes are still taken: its next fence holds.
    s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    assert_eq!(s.target.rdma_accepted_qps(), 1, "the writer answered the target's own push");
    assert!(fenced(&s.push(Some(grant))));
}

/// Probe 7 and the stride-0 note: a peer's table words (an rdma connect's
/// snapshot, or a page a peer maps) holding one range with stride 0 and
/// count 1 fence every byte of that range, its last byte included, as
/// `decode_pushed` already reads a pushed span of that shape.
#[test]
fn a_single_range_of_stride_0_fences_its_last_byte() {
    let single = Span { start: 10, len: 5, stride: 0, count: 1 };
    for (start, end) in [(14, 15), (14, 20), (10, 11), (0, 11), (12, 13)] {
        assert!(single.meets(start, end), "[{start}, {end}) meets [10, 15)");
    }
    assert!(!single.meets(15, 20) && !single.meets(0, 10));
    // The same from a peer's words: phase 1, issued 5, one entry.
    let words: Vec<AtomicU64> = (0..1024).map(|_| AtomicU64::new(0)).collect();
    let view = FenceView::new(&words);
    let mut snapshot = vec![0u64; 8 + 5];
    snapshot[0] = 1; // phase
    snapshot[4] = 1; // used
    snapshot[5] = 5; // issued
    snapshot[8..].copy_from_slice(&[10, 5, 0, 1, 5]);
    view.install(&snapshot).unwrap();
    let pass = view.enter().unwrap();
    assert!(!pass.admits(14, 15, 4), "a stale write at the fenced range's last byte passed");
    assert!(!pass.admits(10, 15, 4));
    assert!(pass.admits(14, 15, 5));
}

/// Standards: a typed error for a push naming a region the initiator has
/// no mirror of, a huge wait, or garbage spans, never a panic; the link
/// keeps working after.
#[test]
fn a_push_of_garbage_is_refused_and_the_link_keeps_working() {
    let s = Setup::new("r8-garbage", None);
    let deadline = Instant::now() + WAIT;
    let me = Initiator { name: "r8-garbage-x".into(), epoch: 1, addr: String::new() };
    let mut client = ControlClient::connect(&s.initiator.control_addr().to_string(), deadline).unwrap();
    client.handshake(&me, None, deadline).unwrap();
    let bad = RdmaFenceRequest {
        generation: 1,
        regions: vec![RdmaFenceSpans { region: s.remote.id().raw(), spans: vec![1, 2, 3] }],
        wait_ms: u32::MAX,
        ..Default::default()
    };
    let refused = client.rdma_fence(bad, deadline);
    assert!(matches!(refused, Err(Error::Remote { .. } | Error::Malformed { .. })), "{refused:?}");
    s.push(None).into_result().unwrap();
}

/// Probe 3/4: the target pushes to the control address an initiator
/// *claimed*. Where that address reaches another engine (two pods behind
/// one NAT address, a port forward) that also writes to the target, that
/// engine must not answer for the initiator: its "done" would let the
/// target's fence return while the initiator's mirrors never saw it, and
/// the initiator's stale push would land over the new owner's bytes. The
/// target dials the claimed address back at the rdma connect and finds
/// another engine there: the connect is refused, saying so, and no QP of
/// the initiator is kept.
#[test]
fn another_engine_at_a_writers_claimed_address_cannot_answer_its_fences() {
    let provider = Provider::new();
    let target = provider.apply(common::builder("r8-claimed-target")).build().unwrap();
    let remote = target.alloc_region(2 * MIB, RegionInfo::raw()).unwrap();
    let loopback = std::net::IpAddr::from([127, 0, 0, 1]);
    // Another writer of the target, at 127.0.0.1:P.
    let other = provider
        .apply(common::builder("r8-claimed-other"))
        .listen(std::net::SocketAddr::new(loopback, 0))
        .build()
        .unwrap();
    let at = other.control_addr();
    let addr = target.control_addr().to_string();
    let _other_segment = other.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT).unwrap();
    let qps = target.rdma_accepted_qps();
    // The initiator listens at 127.0.0.2:P and claims 127.0.0.1:P.
    let initiator = provider
        .apply(common::builder("r8-claimed-initiator"))
        .listen(std::net::SocketAddr::new([127, 0, 0, 2].into(), at.port()))
        .advertise(loopback)
        .build()
        .unwrap();
    assert_eq!(initiator.control_addr(), at, "the initiator claims the other engine's address");
    let refused = initiator.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT).map(|s| s.transport());
    match refused {
        Err(Error::Remote { ref message, .. }) => {
            assert!(message.contains("the writer did not answer there"), "{message}");
            assert!(!message.contains("r8-claimed-other"), "the peer learns no name from its probe: {message}");
        }
        other => panic!("an rdma writer whose claimed address reaches another engine: {other:?}"),
    }
    assert_eq!(target.rdma_accepted_qps(), qps, "QPs kept for a writer fences cannot reach");
    // The other writer's fences still work.
    target.fence(remote.id(), 0, MIB as u64).unwrap();
}

/// A writer whose claimed control address answers nothing (a listener
/// that never reads: a port forwarded to a dead process) is refused at
/// its connect, once the target's control timeout passed, with the
/// reason; no QP of it is kept, so the target's fences never wait on it.
#[test]
fn a_writer_whose_claimed_address_answers_nothing_is_refused_at_connect() {
    let provider = Provider::new();
    let target = provider
        .apply(common::builder("r8-silent-target"))
        .control_timeout(std::time::Duration::from_millis(300))
        .build()
        .unwrap();
    let remote = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let at = silent.local_addr().unwrap();
    let initiator = provider
        .apply(common::builder("r8-silent-initiator"))
        .listen(std::net::SocketAddr::new([127, 0, 0, 2].into(), at.port()))
        .advertise(at.ip())
        .build()
        .unwrap();
    assert_eq!(initiator.control_addr(), at, "the initiator claims the silent listener's address");
    let addr = target.control_addr().to_string();
    match initiator.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT).map(|s| s.transport()) {
        Err(Error::Remote { ref message, .. }) => {
            assert!(
                message.contains("the writer did not answer there") && message.contains(&at.to_string()),
                "{message}"
            );
        }
        other => panic!("an rdma writer whose claimed address answers nothing: {other:?}"),
    }
    assert_eq!(target.rdma_accepted_qps(), 0, "QPs kept for a writer fences cannot reach");
    target.fence(remote.id(), 0, MIB as u64).unwrap();
    drop(silent);
}

/// The claimed control address is the peer's word, and the target dials
/// it: a name is not resolved (DNS would wait past any deadline), and the
/// peer learns only which step failed, not the system's error, so the
/// target is no port scanner's probe of addresses only it reaches.
#[test]
fn a_claimed_address_is_dialled_only_as_ip_and_port_and_its_failure_says_no_more_than_the_step() {
    let provider = Provider::new();
    let target = provider.apply(common::builder("r8-probe-target")).build().unwrap();
    let _remote = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    for (addr, step) in [
        ("localhost:7100".to_string(), "not an IP address and port"),
        (String::new(), "not an IP address and port"),
        (closed.to_string(), "the writer did not answer there"),
    ] {
        let deadline = Instant::now() + WAIT;
        let me = Initiator { name: "r8-probe-liar".into(), epoch: 7, addr: addr.clone() };
        let mut client = ControlClient::connect(&target.control_addr().to_string(), deadline).unwrap();
        client.handshake(&me, None, deadline).unwrap();
        // One made-up QP: a connect of none is refused for its shape first.
        let qp = kvring::rdma::QpEndpoint { qpn: 0x77, psn: 1, gid: [0; 16], lid: 1, mtu: 1024 };
        match client.rdma_connect(1, &[qp], &[7; 16], deadline) {
            Err(Error::Remote { ref message, .. }) => {
                assert!(message.contains(step), "{addr:?}: {message}");
                assert!(!message.contains("os error"), "{addr:?}: the system's error reached the peer: {message}");
            }
            other => panic!("{addr:?}: {:?}", other.map(|_| ())),
        }
    }
    assert_eq!(target.rdma_accepted_qps(), 0);
}

/// Probe 4/standards ("every wait has a deadline with a typed error"): an
/// rdma connect's handler waits for the fence in progress (its snapshot is
/// taken between fences). That wait ends at the target's control timeout
/// with a typed `Timeout` the initiator is told, and the target keeps no
/// QPs for a connect it did not answer.
#[test]
fn an_rdma_connect_waits_for_a_fence_in_progress_only_until_its_deadline() {
    let provider = Provider::new();
    let target = provider
        .apply(common::builder("r8-connect-wait-target"))
        .control_timeout(std::time::Duration::from_millis(200))
        .build()
        .unwrap();
    let _remote = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let initiator = provider.apply(common::builder("r8-connect-wait-initiator")).build().unwrap();
    let held = kvring::testing::hold_fences();
    let opened = initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Rdma), WAIT);
    drop(held);
    match opened {
        Err(Error::Remote { code: ErrorCode::Timeout, ref message }) => {
            assert!(message.contains("fence"), "{message}");
        }
        other => panic!("the target's wait for the fence in progress: {:?}", other.map(|s| s.transport())),
    }
    assert_eq!(target.rdma_accepted_qps(), 0, "QPs kept for a connect the target did not answer");
}
