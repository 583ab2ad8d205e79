//! Fenced destinations over rdma (docs/ARCHITECTURE.md, "Fenced
//! destinations over rdma"): the initiator's lanes check every WRITE
//! against mirrors of the target's fence tables, which the target keeps
//! current by pushing each fence to its writers and waiting for their
//! answer (their writes before the fence completed), or cutting a silent
//! one off (its QPs at the target moved to the error state).
//!
//! On the simulated provider by default, on the real one over the fake
//! libibverbs with `RDMA_TEST_PROVIDER=ibverbs` (.ci/stage-fence-rdma.sh),
//! whose late landings (`FAKE_IBVERBS_DELAY_FILE`) show the drain: the
//! late-landing tests run there only (the simulator places a WRITE at its
//! post, and says so).

mod common;

use common::verbs::{FakeDelay, Provider, RdmaPair};
use common::{fenced, pattern, WAIT};
use kvring::rdma::SimVerbs;
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, Region, Segment};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

const MIB: usize = 1 << 20;
const BLOCK: u64 = 64 * 1024;
/// How late the fake libibverbs places a delayed WRITE: well inside the
/// push's wait (`FENCE_WAIT`, 2 s), so a drained writer is answered.
const LATE_MS: u64 = 200;

/// The fake's delay knob acts on every WR the process posts: a test that
/// stalls writes runs alone, the others side by side.
static TURNS: RwLock<()> = RwLock::new(());

enum Turn {
    Shared(#[allow(dead_code)] RwLockReadGuard<'static, ()>),
    Alone(#[allow(dead_code)] RwLockWriteGuard<'static, ()>),
}

/// A stall of the writer's lane with a WRITE posted: the simulator holds
/// its completion (its bytes placed at the post), the fake libibverbs
/// keeps the whole WR (bytes and completion both late).
enum Stall {
    Sim(Arc<SimVerbs>, u64),
    Fake(FakeDelay),
}

impl Stall {
    fn hold(provider: &Provider) -> Self {
        match provider {
            Provider::Sim(sim) => {
                let before = sim.bytes_moved("sim0");
                sim.hold_completions(true);
                Stall::Sim(sim.clone(), before)
            }
            Provider::Real(..) => {
                let delay = provider.fake_delay().expect("the fake libibverbs (.ci/stage-fence-rdma.sh)");
                delay.hold();
                Stall::Fake(delay)
            }
        }
    }

    /// Whether the WRITE was posted (its mirror count taken).
    fn posted(&self) -> bool {
        match self {
            Stall::Sim(sim, before) => sim.bytes_moved("sim0") != *before,
            Stall::Fake(delay) => delay.kept() > 0,
        }
    }

    fn release(&self) {
        match self {
            Stall::Sim(sim, _) => sim.hold_completions(false),
            Stall::Fake(delay) => delay.release(),
        }
    }
}

/// Waits until `posted` says the write is posted.
fn until_posted(posted: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + WAIT;
    while !posted() {
        assert!(std::time::Instant::now() < deadline, "the write was never posted");
        std::thread::yield_now();
    }
}

/// A target with a 2 MiB destination (the first MiB is fenced) and an
/// initiator that opened it over rdma.
struct Setup {
    initiator: Engine,
    local: Region,
    segment: Segment,
    remote: Region,
    target: Engine,
    _provider: Provider,
    _turn: Turn,
}

impl Setup {
    fn new(name: &str) -> Self {
        Self::with_token(name, None)
    }

    /// As [`Setup::new`], running alone (it stalls the writer's WRs).
    fn alone(name: &str) -> Self {
        let turn = Turn::Alone(TURNS.write().unwrap_or_else(std::sync::PoisonError::into_inner));
        Self::build(name, None, turn)
    }

    /// With `token`, every control connection proves it, the target's
    /// pushes to the initiator included.
    fn with_token(name: &str, token: Option<&str>) -> Self {
        let turn = Turn::Shared(TURNS.read().unwrap_or_else(std::sync::PoisonError::into_inner));
        Self::build(name, token, turn)
    }

    fn build(name: &str, token: Option<&str>, turn: Turn) -> Self {
        let pair = common::verbs::rdma_pair(name, token);
        let RdmaPair { provider, target, remote, initiator, local, segment } = pair;
        Self { initiator, local, segment, remote, target, _provider: provider, _turn: turn }
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

/// A writer whose lane stalls with a write posted (on the simulator its
/// completion held, on the fake libibverbs the whole WRITE kept, so its
/// count in the mirror stays): the initiator's answer is "busy" within the
/// push's wait, the target cuts it off, and `fence` returns within its
/// deadline; the new owner's bytes stay, the released WRITE lands nothing.
#[test]
fn rdma_a_stalled_lane_does_not_hold_fence_and_is_cut_off() {
    let s = Setup::alone("fence-rdma-stalled");
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 7)).unwrap() };
    let old = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    let mut sub = s.initiator.submitter().unwrap();
    let stall = Stall::hold(&s._provider);
    let id = sub.submit(&Batch::write(&s.segment).descs(&s.descs(1)).grant(old)).unwrap();
    // The chunk is posted (its count taken) before the fence is pushed.
    until_posted(|| stall.posted());
    let new = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    assert!(new > old);
    assert_eq!(s.target.rdma_accepted_qps(), 0, "the stalled writer was cut off");
    s.own(0x77);
    stall.release();
    let _ = sub.wait(id, WAIT).unwrap();
    // Its next push fails, or is refused at submit where the released
    // WRITE's failure (its responder QP gone to ERR) broke the segment.
    match sub.submit(&Batch::write(&s.segment).descs(&s.descs(1)).grant(old)) {
        Ok(id) => {
            let outcome = sub.wait(id, WAIT).unwrap();
            assert!(matches!(outcome, Outcome::Failed(_)), "{outcome:?}");
        }
        Err(error) => assert!(matches!(error, Error::PeerRestarted { .. }), "{error:?}"),
    }
    assert!(s.read(0, MIB) == vec![0x77; MIB], "a stalled writer's bytes landed after fence");
}

/// One granted block posted with its placement delayed (the fake
/// libibverbs places it `LATE_MS` after its post), then fenced: `fence`
/// returns once it landed (the writer drained, answered, not cut off),
/// its bytes there at return and unchanged after; or, had the writer been
/// cut off, with its bytes never landing. Fails if the writer answers the
/// push before its write completed.
#[test]
fn rdma_fence_waits_for_a_write_that_lands_late() {
    let s = Setup::alone("fence-rdma-late");
    let Some(delay) = s._provider.fake_delay() else { return };
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 9)).unwrap() };
    let ours = pattern(MIB, 9)[..BLOCK as usize].to_vec();
    let old = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    let mut sub = s.initiator.submitter().unwrap();
    delay.delay_ms(LATE_MS);
    let id = sub.submit(&Batch::write(&s.segment).descs(&s.descs(1)[..1]).grant(old)).unwrap();
    until_posted(|| delay.kept() > 0);
    s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    let at_return = s.read(0, BLOCK as usize);
    let answered = s.target.rdma_accepted_qps() == 1;
    delay.release();
    let outcome = sub.wait(id, WAIT).unwrap();
    if answered {
        assert!(at_return == ours, "the writer answered the fence before its write landed");
        assert!(matches!(outcome, Outcome::Done { .. }), "a drained write completed: {outcome:?}");
    } else {
        eprintln!("the writer was cut off (the delayed write outlived the push's wait)");
        assert!(at_return == vec![0; BLOCK as usize], "a cut-off writer's bytes landed");
    }
    assert_eq!(delay.kept(), 0, "the delayed write was executed");
    assert!(s.read(0, BLOCK as usize) == at_return, "the bytes changed after fence returned");
    assert!(s.read(BLOCK, MIB - BLOCK as usize) == vec![0; MIB - BLOCK as usize], "only the one block was written");
    assert!(answered, "a write landing {LATE_MS} ms late was not waited for: its writer was cut off");
}

/// The same late write, fenced and the range handed to a new owner who
/// writes it at once: the delayed WRITE never overwrites the owner's bytes
/// (it landed before `fence` returned, or never). Fails if the writer
/// answers the push before its write completed.
#[test]
fn rdma_a_late_write_never_lands_over_the_new_owner() {
    let s = Setup::alone("fence-rdma-late-owner");
    let Some(delay) = s._provider.fake_delay() else { return };
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 11)).unwrap() };
    let old = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    let mut sub = s.initiator.submitter().unwrap();
    delay.delay_ms(LATE_MS);
    let id = sub.submit(&Batch::write(&s.segment).descs(&s.descs(1)[..1]).grant(old)).unwrap();
    until_posted(|| delay.kept() > 0);
    s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    s.own(0x99);
    // Kept WRs due at once: whatever the fake still holds runs now.
    delay.release();
    let _ = sub.wait(id, WAIT).unwrap();
    assert_eq!(delay.kept(), 0, "the delayed write was executed");
    assert!(s.read(0, MIB) == vec![0x99; MIB], "a late write landed over the new owner's bytes");
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
