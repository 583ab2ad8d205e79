//! Fenced destinations (`Engine::fence`, `Batch::grant`) over each
//! transport that has them: a stale sender's write never lands once its
//! destination was fenced again, and it gets `Fenced`.

mod common;

use common::{engine, pattern, WAIT};
use kvring::{Batch, BlockDesc, Error, Outcome, RegionInfo, TransportKind};

const MIB: usize = 1 << 20;
const BLOCK: u64 = 64 * 1024;

fn read_back(region: &kvring::Region, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: no batch naming these bytes is in flight (waited for, or fenced out).
    unsafe { region.read_at(offset, &mut out).unwrap() };
    out
}

/// Blocks of the initiator's region onto the fenced first MiB of the
/// target's, `rounds` times over.
fn descs(local: &kvring::Region, remote: kvring::RegionId, rounds: u64) -> Vec<BlockDesc> {
    let per_round = MIB as u64 / BLOCK;
    (0..rounds * per_round)
        .map(|i| BlockDesc::new(local.id(), (i % per_round) * BLOCK, remote, (i % per_round) * BLOCK, BLOCK))
        .collect()
}

fn fenced(outcome: Outcome) -> bool {
    matches!(outcome, Outcome::Failed(Error::Fenced { .. }))
}

/// (b) A stale sender after an abort: the range was fenced again (a new
/// owner has it); a push naming the old grant gets `Fenced` and nothing
/// lands; the new grant lands.
#[test]
fn shm_a_push_under_a_stale_grant_is_fenced_and_nothing_lands() {
    let target = engine("target");
    let remote = target.alloc_region(2 * MIB, RegionInfo::raw()).unwrap();
    let initiator = engine("initiator");
    let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    assert_eq!(segment.transport(), TransportKind::Shm);
    // SAFETY: no batch touches these bytes yet.
    unsafe { local.write_at(0, &pattern(MIB, 1)).unwrap() };
    let mut sub = initiator.submitter().unwrap();
    let remote_id = segment.region(0).unwrap();
    let blocks = descs(&local, remote_id, 1);

    let old = target.fence(remote.id(), 0, MIB as u64).unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&blocks).grant(old)).unwrap();
    assert_eq!(sub.wait(id, WAIT).unwrap().into_result().unwrap(), MIB as u64);
    assert_eq!(read_back(&remote, 0, MIB), pattern(MIB, 1));

    // The request is aborted; its blocks go to another one.
    let new = target.fence(remote.id(), 0, MIB as u64).unwrap();
    assert!(new > old);
    let owner = vec![0xEEu8; MIB];
    // SAFETY: fenced: no write under `old` is in the range, none starts.
    unsafe { remote.write_at(0, &owner).unwrap() };
    let id = sub.submit(&Batch::write(&segment).descs(&blocks).grant(old)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(fenced(outcome), "a stale grant's push must fail Fenced");
    let id = sub.submit(&Batch::write(&segment).descs(&blocks)).unwrap();
    assert!(fenced(sub.wait(id, WAIT).unwrap()), "no grant at all, into a fenced range");
    assert_eq!(read_back(&remote, 0, MIB), owner, "nothing of a refused push landed");

    // Beyond the fenced range nothing changed: no grant is needed there.
    let beyond: Vec<_> =
        (0..4).map(|i| BlockDesc::new(local.id(), i * BLOCK, remote_id, MIB as u64 + i * BLOCK, BLOCK)).collect();
    let id = sub.submit(&Batch::write(&segment).descs(&beyond)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().into_result().is_ok());

    let id = sub.submit(&Batch::write(&segment).descs(&blocks).grant(new)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().into_result().is_ok(), "the current grant lands");
    assert_eq!(read_back(&remote, 0, MIB), pattern(MIB, 1));
}

/// (a) A slot freed and reused while a write is in flight: the target
/// fences the range while a long stale push is copying into it, then the
/// new owner writes at once; its bytes are never overwritten.
#[test]
fn shm_a_fence_during_a_stale_push_keeps_the_new_owners_bytes() {
    let target = engine("target");
    let remote = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let initiator = engine("initiator");
    let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { local.write_at(0, &pattern(MIB, 3)).unwrap() };
    let mut sub = initiator.submitter().unwrap();
    // 256 MiB of copies into the same MiB: in flight for a while.
    let blocks = descs(&local, segment.region(0).unwrap(), 256);
    let mut refused = 0;
    for round in 0..4u8 {
        let old = target.fence(remote.id(), 0, MIB as u64).unwrap();
        let id = sub.submit(&Batch::write(&segment).descs(&blocks).grant(old)).unwrap();
        let new = target.fence(remote.id(), 0, MIB as u64).unwrap();
        let owner = vec![0xE0 | round; MIB];
        // SAFETY (the property under test): `fence` returned, so no write
        // under `old` is in the range and none starts.
        unsafe { remote.write_at(0, &owner).unwrap() };
        let outcome = sub.wait(id, WAIT).unwrap();
        refused += usize::from(fenced(outcome));
        assert_eq!(read_back(&remote, 0, MIB), owner, "round {round}: a stale byte landed after fence");
        assert!(new > old);
    }
    // The push is long enough that fences land while it copies.
    assert!(refused > 0, "no fence met a push in flight");
}
