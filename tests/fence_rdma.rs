//! Fenced destinations over rdma (docs/ARCHITECTURE.md, "Fenced
//! destinations over rdma"): the initiator's lanes check every WRITE
//! against mirrors of the target's fence tables, which the target keeps
//! current by pushing each fence to its writers and waiting for their
//! answer (their writes before the fence completed), or cutting a silent
//! one off (its QPs at the target moved to the error state).
//!
//! On the simulated provider by default, on the real one over the fake
//! libibverbs with `RDMA_TEST_PROVIDER=ibverbs` (.ci/stage-fence-rdma.sh).

mod common;

use common::verbs::Provider;
use common::{fenced, pattern, WAIT};
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, Region, RegionInfo, Segment, TransportKind};

const MIB: usize = 1 << 20;
const BLOCK: u64 = 64 * 1024;

/// A target with a 2 MiB destination (the first MiB is fenced) and an
/// initiator that opened it over rdma.
struct Setup {
    initiator: Engine,
    local: Region,
    segment: Segment,
    remote: Region,
    target: Engine,
    _provider: Provider,
}

impl Setup {
    fn new(name: &str) -> Self {
        Self::with_token(name, None)
    }

    /// With `token`, every control connection proves it, the target's
    /// pushes to the initiator included.
    fn with_token(name: &str, token: Option<&str>) -> Self {
        let provider = Provider::new();
        let builder = |role: &str| {
            let builder = provider.apply(common::builder(&format!("{name}-{role}")));
            match token {
                Some(token) => builder.token(token),
                None => builder,
            }
        };
        let target = builder("target").build().unwrap();
        let remote = target.alloc_region(2 * MIB, RegionInfo::raw()).unwrap();
        let initiator = builder("initiator").build().unwrap();
        let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
        let segment =
            initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Rdma), WAIT).unwrap();
        assert_eq!(segment.transport(), TransportKind::Rdma);
        Self { initiator, local, segment, remote, target, _provider: provider }
    }

    fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        common::read(&self.remote, offset, len)
    }

    /// The new owner writes its bytes over the fenced MiB.
    fn own(&self, byte: u8) {
        // SAFETY: fenced: no write under an older grant is in the range.
        unsafe { self.remote.write_at(0, &vec![byte; MIB]).unwrap() };
    }

    /// Blocks of the initiator's region onto the fenced MiB, `rounds` times.
    fn descs(&self, rounds: u64) -> Vec<BlockDesc> {
        let remote = self.segment.region(0).unwrap();
        let per_round = MIB as u64 / BLOCK;
        (0..rounds * per_round)
            .map(|i| BlockDesc::new(self.local.id(), (i % per_round) * BLOCK, remote, (i % per_round) * BLOCK, BLOCK))
            .collect()
    }

    fn push(&self, descs: &[BlockDesc], grant: Option<u32>) -> Outcome {
        common::push_granted(&self.initiator, &self.segment, descs, grant)
    }
}

/// A stale sender after an abort: a push naming the old grant (or none)
/// is refused `Fenced` and nothing of it lands; the current grant lands.
#[test]
fn rdma_a_push_under_a_stale_grant_is_fenced_and_nothing_lands() {
    let s = Setup::new("fence-rdma-stale");
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 1)).unwrap() };
    let blocks = s.descs(1);
    let old = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    s.push(&blocks, Some(old)).into_result().unwrap();
    assert_eq!(s.read(0, MIB), pattern(MIB, 1));

    let new = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    assert!(new > old);
    s.own(0xEE);
    let outcome = s.push(&blocks, Some(old));
    assert!(fenced(&outcome), "a stale grant's push must fail Fenced, got {outcome:?}");
    let outcome = s.push(&blocks, None);
    assert!(fenced(&outcome), "no grant, into a fenced range: {outcome:?}");
    assert_eq!(s.read(0, MIB), vec![0xEE; MIB], "nothing of a refused push landed");

    let remote = s.segment.region(0).unwrap();
    let beyond: Vec<_> =
        (0..4).map(|i| BlockDesc::new(s.local.id(), i * BLOCK, remote, MIB as u64 + i * BLOCK, BLOCK)).collect();
    s.push(&beyond, None).into_result().unwrap();
    s.push(&blocks, Some(new)).into_result().unwrap();
    assert_eq!(s.read(0, MIB), pattern(MIB, 1), "the current grant lands");
}

/// With a cluster token the target proves it in the handshake of each
/// push: the writer answers (it is not cut off) and the fence holds.
#[test]
fn rdma_fences_are_pushed_over_proven_handshakes_with_a_token() {
    let s = Setup::with_token("fence-rdma-token", Some("fence-s3cret"));
    let old = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    s.push(&s.descs(1), Some(old)).into_result().unwrap();
    s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    assert_eq!(s.target.rdma_accepted_qps(), 1, "the writer answered the proven push");
    let outcome = s.push(&s.descs(1), Some(old));
    assert!(fenced(&outcome), "{outcome:?}");
}

/// A slot fenced and reused while a write to it is in flight: once
/// `fence` returned, no stale byte lands over the new owner's.
#[test]
fn rdma_a_fence_during_a_stale_push_keeps_the_new_owners_bytes() {
    let s = Setup::new("fence-rdma-inflight");
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 3)).unwrap() };
    let blocks = s.descs(256);
    let mut sub = s.initiator.submitter().unwrap();
    let mut refused = 0;
    for round in 0..4u8 {
        let old = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
        let id = sub.submit(&Batch::write(&s.segment).descs(&blocks).grant(old)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(2));
        s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
        s.own(0xE0 | round);
        let outcome = sub.wait(id, WAIT).unwrap();
        refused += usize::from(fenced(&outcome));
        assert_eq!(s.read(0, MIB), vec![0xE0 | round; MIB], "round {round}: a stale byte landed after fence");
    }
    assert!(refused > 0, "no fence met a push in flight");
}

/// A grant nobody was handed (above every one the target issued) lands on
/// no fenced byte.
#[test]
fn rdma_a_made_up_grant_is_refused() {
    let s = Setup::new("fence-rdma-liar");
    let grant = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    for liar in [grant + 1, u32::MAX] {
        let outcome = s.push(&s.descs(1), Some(liar));
        assert!(fenced(&outcome), "grant {liar} (issued: {grant}): {outcome:?}");
    }
    assert_eq!(s.read(0, MIB), vec![0; MIB]);
}

/// Fencing a range no write is in, with a writer connected: one answer
/// from it, and the fence holds for it at once.
#[test]
fn rdma_fencing_an_idle_range_is_answered_and_holds() {
    let s = Setup::new("fence-rdma-idle");
    for _ in 0..8 {
        let grant = s.target.fence(s.remote.id(), 0, BLOCK).unwrap();
        let outcome = s.push(&s.descs(1)[..1], Some(grant - 1));
        assert!(fenced(&outcome), "{outcome:?}");
    }
    assert_eq!(s.target.rdma_accepted_qps(), 1, "the writer was answered, not cut off");
}

/// A writer that never answers (its process stopped: here, its control
/// server gone while its QPs stay) does not hold `fence` past its
/// deadline, and is cut off: nothing it posts afterwards lands.
#[test]
fn rdma_a_writer_that_never_answers_is_cut_off_and_lands_nothing() {
    let s = Setup::new("fence-rdma-silent");
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 5)).unwrap() };
    let old = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    kvring::testing::stop_control_server(&s.initiator);
    let new = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    assert!(new > old);
    assert_eq!(s.target.rdma_accepted_qps(), 0, "the silent writer's QPs were cut off");
    s.own(0x5A);
    // Its lanes' mirror never saw the fence: only the cut-off stops it.
    let outcome = s.push(&s.descs(1), Some(old));
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    assert!(!matches!(outcome, Outcome::Failed(Error::Fenced { .. })), "not refused by its own mirror: {outcome:?}");
    assert_eq!(s.read(0, MIB), vec![0x5A; MIB], "a cut-off writer's bytes landed");
}

/// A writer whose lane stalls with a write posted (its completions held,
/// so its count in the mirror stays): the initiator's answer is "busy"
/// within the push's wait, the target cuts it off, and `fence` returns
/// within its deadline; the new owner's bytes stay (the simulator alone
/// can hold completions).
#[test]
fn rdma_a_stalled_lane_does_not_hold_fence_and_is_cut_off() {
    let s = Setup::new("fence-rdma-stalled");
    let Some(sim) = s._provider.sim_only("holding completions") else { return };
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 7)).unwrap() };
    let old = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    let mut sub = s.initiator.submitter().unwrap();
    let before = sim.bytes_moved("sim0");
    sim.hold_completions(true);
    let id = sub.submit(&Batch::write(&s.segment).descs(&s.descs(1)).grant(old)).unwrap();
    // The chunk is posted (its count taken) before the fence is pushed.
    let posted = std::time::Instant::now() + WAIT;
    while sim.bytes_moved("sim0") == before {
        assert!(std::time::Instant::now() < posted, "the write was never posted");
        std::thread::yield_now();
    }
    let new = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    assert!(new > old);
    assert_eq!(s.target.rdma_accepted_qps(), 0, "the stalled writer was cut off");
    s.own(0x77);
    sim.hold_completions(false);
    let _ = sub.wait(id, WAIT).unwrap();
    let outcome = s.push(&s.descs(1), Some(old));
    assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
    assert_eq!(s.read(0, MIB), vec![0x77; MIB], "a stalled writer's bytes landed after fence");
}

/// The fuzz target's entry point over its committed seed and every
/// truncation and one-byte change of it: no panic, and its invariant holds
/// (what cargo fuzz runs at length in CI).
#[test]
fn the_rdma_fence_decoders_take_their_seed_and_its_mutations() {
    let seed = include_bytes!("../fuzz/seeds/rdma_fence/fenced_then_pushed");
    kvring::testing::fuzz::rdma_fence(seed);
    for cut in 0..seed.len() {
        kvring::testing::fuzz::rdma_fence(&seed[..cut]);
    }
    for at in 0..seed.len() {
        for flip in [0x01, 0x80, 0xff] {
            let mut bytes = seed.to_vec();
            bytes[at] ^= flip;
            kvring::testing::fuzz::rdma_fence(&bytes);
        }
    }
}
