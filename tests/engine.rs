//! Two engines in one process, over real shared memory and a real control
//! socket: the data path end to end, and every bad input it must refuse.

mod common;

use common::{engine, pattern, WAIT};
use kvring::{Access, Batch, BatchState, BlockDesc, Error, Outcome, RegionId, RegionInfo, Side, TransportKind};
use std::time::Duration;

const MIB: usize = 1 << 20;
/// Descriptors of 1 MiB in the long batches: 4 GiB, ~0.5 s over shm here,
/// so the checks made while they run hold even under a loaded scheduler.
const LONG_BATCH: u64 = 4096;

/// A predicate a batch's error must satisfy.
type ErrorCheck = Box<dyn Fn(&Error) -> bool>;

struct Pair {
    initiator: kvring::Engine,
    target: kvring::Engine,
    local: kvring::Region,
    remote: kvring::Region,
    segment: kvring::Segment,
}

fn pair(len: usize) -> Pair {
    let target = engine("target");
    let remote = target.alloc_region(len, RegionInfo::raw()).unwrap();
    let initiator = engine("initiator");
    let local = initiator.alloc_region(len, RegionInfo::raw()).unwrap();
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    Pair { initiator, target, local, remote, segment }
}

fn read_back(region: &kvring::Region, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { region.read_at(offset, &mut out).unwrap() };
    out
}

#[test]
fn write_then_read_moves_exact_bytes() {
    let p = pair(MIB);
    assert_eq!(p.segment.name(), "target");
    assert_eq!(p.segment.epoch(), p.target.epoch());
    assert_eq!(p.segment.transport(), TransportKind::Shm);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { p.local.write_at(0, &pattern(MIB, 1)).unwrap() };
    let mut sub = p.initiator.submitter().unwrap();
    let remote = p.segment.region(0).unwrap();
    assert_eq!(remote, p.remote.id());
    // 16 blocks of 4 KiB, landing shuffled on the target.
    let descs: Vec<_> =
        (0..16u64).map(|i| BlockDesc::new(p.local.id(), i * 4096, remote, (15 - i) * 4096 + 65536, 4096)).collect();
    let id = sub.submit(&Batch::write(&p.segment).descs(&descs).user_data(9)).unwrap();
    match sub.wait(id, WAIT).unwrap() {
        Outcome::Done { bytes } => assert_eq!(bytes, 16 * 4096),
        other => panic!("{other:?}"),
    }
    let source = pattern(MIB, 1);
    for i in 0..16usize {
        let landed = read_back(&p.remote, ((15 - i) * 4096 + 65536) as u64, 4096);
        assert_eq!(landed, source[i * 4096..(i + 1) * 4096], "block {i}");
    }
    assert_eq!(read_back(&p.remote, 0, 65536), vec![0u8; 65536], "bytes before the blocks untouched");

    // Pull them back into a cleared local region.
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { p.local.write_at(0, &vec![0u8; MIB]).unwrap() };
    let id = sub.submit(&Batch::read(&p.segment).descs(&descs)).unwrap();
    assert_eq!(sub.wait(id, WAIT).unwrap().into_result().unwrap(), 16 * 4096);
    assert_eq!(read_back(&p.local, 0, 16 * 4096), source[..16 * 4096]);
}

#[test]
fn a_large_batch_is_split_across_lanes_and_still_lands_whole() {
    let target = engine("target");
    let remote = target.alloc_region(8 * MIB, RegionInfo::raw()).unwrap();
    let initiator = common::builder("initiator").lanes(2).split_threshold(MIB as u64).build().unwrap();
    let local = initiator.alloc_region(8 * MIB, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(7) };
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let descs: Vec<_> =
        (0..128u64).map(|i| BlockDesc::new(local.id(), i * 65536, remote.id(), i * 65536, 65536)).collect();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    assert_eq!(sub.wait(id, WAIT).unwrap().into_result().unwrap(), 8 * MIB as u64);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    assert_eq!(unsafe { remote.checksum(0, 8 * MIB).unwrap() }, unsafe { local.checksum(0, 8 * MIB).unwrap() });
    let stats = initiator.lane_stats();
    assert!(stats.iter().all(|s| s.parts >= 1 && s.descs >= 1), "both lanes worked: {stats:?}");
    assert_eq!(stats.iter().map(|s| s.bytes).sum::<u64>(), 8 * MIB as u64);
}

#[test]
fn out_of_bounds_overflow_and_unknown_regions_fail_without_touching_memory() {
    let p = pair(64 * 1024);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { p.local.fill_pattern(3) };
    let mut sub = p.initiator.submitter().unwrap();
    let remote = p.remote.id();
    let local = p.local.id();
    let cases: Vec<(BlockDesc, ErrorCheck)> = vec![
        (
            BlockDesc::new(local, 0, remote, 60 * 1024, 8192),
            Box::new(|e| matches!(e, Error::OutOfBounds { side: Side::Remote, region_len: 65536, desc_index: 1, .. })),
        ),
        (
            BlockDesc::new(local, 64 * 1024, remote, 0, 1),
            Box::new(|e| matches!(e, Error::OutOfBounds { side: Side::Local, desc_index: 1, .. })),
        ),
        (
            BlockDesc::new(local, 0, remote, u64::MAX - 10, 4096),
            Box::new(|e| matches!(e, Error::LengthOverflow { side: Side::Remote, .. })),
        ),
        (
            BlockDesc::new(local, u64::MAX, remote, 0, 4096),
            Box::new(|e| matches!(e, Error::LengthOverflow { side: Side::Local, .. })),
        ),
        (
            BlockDesc::new(local, 0, RegionId::new(remote.index() + 7, 1), 0, 4096),
            Box::new(|e| matches!(e, Error::UnknownRegion { side: Side::Remote, .. })),
        ),
        (
            BlockDesc::new(local, 0, RegionId::new(remote.index(), remote.generation() + 1), 0, 4096),
            Box::new(|e| matches!(e, Error::UnknownRegion { side: Side::Remote, .. })),
        ),
    ];
    for (bad, expected) in cases {
        // A good descriptor after the bad one must be dropped, not moved.
        let descs = [BlockDesc::new(local, 0, remote, 0, 4096), bad, BlockDesc::new(local, 4096, remote, 4096, 4096)];
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { p.remote.write_at(0, &vec![0u8; 64 * 1024]).unwrap() };
        let id = sub.submit(&Batch::write(&p.segment).descs(&descs)).unwrap();
        match sub.wait(id, WAIT).unwrap() {
            Outcome::Failed(error) => {
                assert!(expected(&error), "unexpected error for {bad:?}: {error}");
                assert!(!error.to_string().is_empty());
            }
            other => panic!("{bad:?} ended {other:?}"),
        }
        let after = read_back(&p.remote, 0, 64 * 1024);
        assert_eq!(after[..4096], pattern(64 * 1024, 3)[..4096], "the descriptor before the bad one moved");
        assert!(after[4096..].iter().all(|&b| b == 0), "nothing after the bad descriptor was written");
    }
    // An unknown *local* region is refused at submit: no lease, nothing queued.
    let forged = [BlockDesc::new(RegionId::new(500, 1), 0, remote, 0, 4096)];
    assert!(matches!(
        sub.submit(&Batch::write(&p.segment).descs(&forged)),
        Err(Error::UnknownRegion { side: Side::Local, .. })
    ));
    assert!(matches!(sub.submit(&Batch::write(&p.segment)), Err(Error::InvalidArgument { .. })), "empty batch");
    let zero = [BlockDesc::new(local, 0, remote, 0, 0)];
    assert!(sub.submit(&Batch::write(&p.segment).descs(&zero)).unwrap_err().to_string().contains("zero length"));
}

#[test]
fn access_rights_are_enforced_on_both_sides() {
    let target = engine("target");
    let read_only =
        target.alloc_region(8192, RegionInfo::raw().with_access(Access::REMOTE_READ | Access::LOCAL_READ)).unwrap();
    let initiator = engine("initiator");
    let local = initiator.alloc_region(8192, RegionInfo::raw().with_access(Access::LOCAL_READ)).unwrap();
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let desc = [BlockDesc::new(local.id(), 0, read_only.id(), 0, 4096)];
    let id = sub.submit(&Batch::write(&segment).descs(&desc)).unwrap();
    let error = sub.wait(id, WAIT).unwrap().into_result().unwrap_err();
    assert!(
        error.to_string().contains("remote region") && error.to_string().contains("does not allow remote write"),
        "{error}"
    );
    let id = sub.submit(&Batch::read(&segment).descs(&desc)).unwrap();
    let error = sub.wait(id, WAIT).unwrap().into_result().unwrap_err();
    assert!(error.to_string().contains("does not allow local write"), "{error}");
}

#[test]
fn full_rings_push_back_and_hand_the_batch_back() {
    let target = engine("target");
    let remote = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    // Two status slots: the third unconsumed batch is back-pressure.
    let initiator = common::builder("initiator").max_batches_in_flight(2).arena_descs(8).build().unwrap();
    let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let descs = [BlockDesc::new(local.id(), 0, remote.id(), 0, 4096)];
    let batch = Batch::write(&segment).descs(&descs);
    let first = sub.submit(&batch).unwrap();
    let second = sub.submit(&batch).unwrap();
    match sub.submit(&batch) {
        Err(Error::Busy { queue, capacity }) => {
            assert_eq!(queue, "batch status table");
            assert_eq!(capacity, 2);
        }
        other => panic!("expected Busy, got {other:?}"),
    }
    // The batch is still ours: after consuming one result it goes through.
    sub.wait(first, WAIT).unwrap().into_result().unwrap();
    let third = sub.submit(&batch).unwrap();
    sub.wait(second, WAIT).unwrap().into_result().unwrap();
    sub.wait(third, WAIT).unwrap().into_result().unwrap();
    // A batch bigger than the arena is refused outright.
    let big: Vec<_> = (0..9u64).map(|i| BlockDesc::new(local.id(), i * 4096, remote.id(), 0, 4096)).collect();
    assert!(sub
        .submit(&Batch::write(&segment).descs(&big))
        .unwrap_err()
        .to_string()
        .contains("exceed the per-lane arena of 8"));
}

#[test]
fn stale_forged_and_unfinished_ids_get_distinct_errors() {
    let p = pair(MIB);
    let mut sub = p.initiator.submitter().unwrap();
    let descs = [BlockDesc::new(p.local.id(), 0, p.remote.id(), 0, 4096)];
    let id = sub.submit(&Batch::write(&p.segment).descs(&descs)).unwrap();
    sub.wait(id, WAIT).unwrap().into_result().unwrap();
    assert!(matches!(sub.wait(id, WAIT), Err(Error::StaleBatch { .. })));
    assert!(matches!(sub.state(id), Err(Error::StaleBatch { .. })));
    let forged = kvring::BatchId::from_raw(id.raw() ^ (0xffff << 48));
    assert!(matches!(sub.wait(forged, WAIT), Err(Error::UnknownBatch { .. })));
    let other = p.initiator.submitter().unwrap();
    let theirs = other.status_reader();
    assert!(theirs.state(id).is_err(), "another submitter's table does not know this id");
}

#[test]
fn a_wait_past_its_deadline_times_out_and_the_batch_still_completes() {
    // A long batch (4 GiB over shm, ~0.5 s) outlives a 1 µs wait even if
    // this thread is descheduled between the two calls.
    let p = pair(64 * MIB);
    let mut sub = p.initiator.submitter().unwrap();
    let descs: Vec<_> = (0..LONG_BATCH)
        .map(|i| BlockDesc::new(p.local.id(), (i % 64) * MIB as u64, p.remote.id(), (i % 64) * MIB as u64, MIB as u64))
        .collect();
    let id = sub.submit(&Batch::write(&p.segment).descs(&descs)).unwrap();
    match sub.wait(id, Duration::from_micros(1)) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected Timeout, got {other:?}"),
    }
    let state = sub.status_reader().state(id).unwrap();
    assert!(matches!(state, BatchState::Pending | BatchState::Done), "{state:?}");
    assert_eq!(sub.wait(id, WAIT).unwrap().into_result().unwrap(), LONG_BATCH * MIB as u64);
}

#[test]
fn batch_deadlines_and_cancel_end_batches_distinctly() {
    let p = pair(64 * MIB);
    let mut sub = p.initiator.submitter().unwrap();
    let descs: Vec<_> = (0..LONG_BATCH)
        .map(|i| BlockDesc::new(p.local.id(), (i % 64) * MIB as u64, p.remote.id(), (i % 64) * MIB as u64, MIB as u64))
        .collect();
    // A deadline that has passed by the time a lane looks: nothing moves.
    let id = sub.submit(&Batch::write(&p.segment).descs(&descs).deadline(Duration::ZERO)).unwrap();
    match sub.wait(id, WAIT).unwrap() {
        Outcome::TimedOut { bytes } => assert_eq!(bytes, 0),
        other => panic!("expected TimedOut, got {other:?}"),
    }
    // Cancel a 4 GiB batch right after submitting it: it ends Cancelled
    // with part of it moved, once the descriptors already posted drained.
    let id = sub.submit(&Batch::write(&p.segment).descs(&descs)).unwrap();
    sub.cancel(id).unwrap();
    match sub.wait(id, WAIT).unwrap() {
        Outcome::Cancelled { bytes } => assert!(bytes < LONG_BATCH * MIB as u64, "{bytes}"),
        other => panic!("expected Cancelled, got {other:?}"),
    }
    // The submitter is usable afterwards.
    let one = [descs[0]];
    let id = sub.submit(&Batch::write(&p.segment).descs(&one)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
}

#[test]
fn reap_returns_every_completion_exactly_once_with_its_tag() {
    let p = pair(MIB);
    let mut sub = p.initiator.submitter().unwrap();
    let mut expected = std::collections::BTreeSet::new();
    let mut waited = None;
    for tag in 0..40u64 {
        let descs = [BlockDesc::new(p.local.id(), tag * 4096, p.remote.id(), tag * 4096, 4096)];
        let id = sub.submit(&Batch::write(&p.segment).descs(&descs).user_data(tag)).unwrap();
        if tag == 7 {
            waited = Some(id);
        } else {
            expected.insert(tag);
        }
    }
    // One batch is consumed by wait; reap must not return it again.
    sub.wait(waited.unwrap(), WAIT).unwrap().into_result().unwrap();
    let mut seen = std::collections::BTreeSet::new();
    let started = std::time::Instant::now();
    while seen.len() < expected.len() {
        assert!(started.elapsed() < WAIT, "completions missing: {:?}", expected.difference(&seen).collect::<Vec<_>>());
        while let Some(completion) = sub.reap() {
            assert!(completion.outcome.is_done());
            assert!(seen.insert(completion.user_data), "tag {} reaped twice", completion.user_data);
        }
    }
    assert_eq!(seen, expected);
    assert_eq!(sub.in_flight(), 0);
    assert!(sub.reap().is_none());
}

#[test]
fn regions_in_flight_cannot_be_unregistered_and_registration_is_checked() {
    let p = pair(64 * MIB);
    let mut sub = p.initiator.submitter().unwrap();
    let descs: Vec<_> = (0..LONG_BATCH)
        .map(|i| BlockDesc::new(p.local.id(), (i % 64) * MIB as u64, p.remote.id(), 0, MIB as u64))
        .collect();
    let id = sub.submit(&Batch::write(&p.segment).descs(&descs)).unwrap();
    match p.initiator.unregister(p.local.id()) {
        Err(Error::RegionBusy { region, in_flight }) => {
            assert_eq!(region, p.local.id());
            assert!(in_flight >= 1);
        }
        other => panic!("expected RegionBusy while 4 GiB is in flight, got {other:?}"),
    }
    // Cancel ends it in milliseconds; once it has ended the lease is gone.
    sub.cancel(id).unwrap();
    assert!(matches!(sub.wait(id, WAIT).unwrap(), Outcome::Cancelled { .. } | Outcome::Done { .. }));
    p.initiator.unregister(p.local.id()).unwrap();
    assert!(matches!(p.initiator.unregister(p.local.id()), Err(Error::UnknownRegion { .. })));

    // Caller-registered memory: idempotent for the same range, overlaps refused.
    let mut buffer = vec![0u8; 8192];
    // SAFETY: `buffer` outlives both registrations (unregistered below).
    let id = unsafe { p.initiator.register(buffer.as_mut_ptr(), 8192, RegionInfo::raw()) }.unwrap();
    // SAFETY: as above.
    let again = unsafe { p.initiator.register(buffer.as_mut_ptr(), 8192, RegionInfo::raw()) }.unwrap();
    assert_eq!(id, again);
    // SAFETY: as above; the call is refused before anything is kept.
    let overlap = unsafe { p.initiator.register(buffer.as_mut_ptr().add(100), 100, RegionInfo::raw()) };
    assert!(matches!(overlap, Err(Error::RegionOverlap { existing, .. }) if existing == id));
    p.initiator.unregister(id).unwrap();
}

#[test]
fn closed_segments_refuse_new_batches_and_reopen_fresh() {
    let p = pair(MIB);
    let mut sub = p.initiator.submitter().unwrap();
    let descs = [BlockDesc::new(p.local.id(), 0, p.remote.id(), 0, 4096)];
    p.initiator.close_segment(&p.segment);
    assert!(p.segment.is_closed());
    assert!(matches!(sub.submit(&Batch::write(&p.segment).descs(&descs)), Err(Error::UnknownSegment { .. })));
    let reopened = p.initiator.open_segment(&p.target.control_addr().to_string()).unwrap();
    assert!(!reopened.is_closed());
    let id = sub.submit(&Batch::write(&reopened).descs(&descs)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    // A cached handle comes back while open.
    let cached = p.initiator.open_segment(&p.target.control_addr().to_string()).unwrap();
    assert_eq!(cached.epoch(), reopened.epoch());
}

#[test]
fn idle_lanes_park_and_never_miss_a_wake_up() {
    // A park timeout far beyond the wait deadline: a lost wake-up fails the
    // wait with Timeout instead of hiding behind the safety-net timeout.
    let target = engine("target");
    let remote = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let initiator = common::builder("initiator")
        .busy_poll(Duration::from_micros(50))
        .park_timeout(Duration::from_secs(3600))
        .build()
        .unwrap();
    let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let descs = [BlockDesc::new(local.id(), 0, remote.id(), 0, 4096)];
    for round in 0..300u64 {
        // Sleep across the busy-poll boundary in varying amounts.
        std::thread::sleep(Duration::from_micros((round * 37) % 400));
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        let outcome = sub.wait(id, Duration::from_secs(5));
        assert!(matches!(outcome, Ok(Outcome::Done { .. })), "round {round}: {outcome:?}");
    }
    let parks: u64 = initiator.lane_stats().iter().map(|s| s.parks).sum();
    assert!(parks > 0, "the lane never parked");
}

#[test]
fn many_submitter_threads_conserve_every_batch() {
    let p = pair(4 * MIB);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { p.local.fill_pattern(11) };
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let engine = p.initiator.clone();
            let segment = p.segment.clone();
            let (local, remote) = (p.local.id(), p.remote.id());
            std::thread::spawn(move || {
                let mut sub = engine.submitter().unwrap();
                let mut bytes = 0;
                for i in 0..200u64 {
                    let offset = (t * 200 + i) % 1024 * 4096;
                    let descs = [BlockDesc::new(local, offset, remote, offset, 4096)];
                    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
                    bytes += sub.wait(id, WAIT).unwrap().into_result().unwrap();
                }
                bytes
            })
        })
        .collect();
    let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(total, 4 * 200 * 4096);
    // 4 threads x 200 blocks = the first 800 blocks of the region.
    let written = 800 * 4096;
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    assert_eq!(unsafe { p.remote.checksum(0, written).unwrap() }, unsafe { p.local.checksum(0, written).unwrap() });
}

#[test]
fn the_null_transport_moves_nothing_but_validates_everything() {
    let target = engine("target");
    let remote = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let initiator = engine("initiator");
    let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(5) };
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Null), WAIT).unwrap();
    assert_eq!(segment.transport(), TransportKind::Null);
    let mut sub = initiator.submitter().unwrap();
    let ok = [BlockDesc::new(local.id(), 0, remote.id(), 0, 4096)];
    let id = sub.submit(&Batch::write(&segment).descs(&ok)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    assert!(read_back(&remote, 0, 4096).iter().all(|&b| b == 0));
    let bad = [BlockDesc::new(local.id(), 0, remote.id(), MIB as u64, 1)];
    let id = sub.submit(&Batch::write(&segment).descs(&bad)).unwrap();
    assert!(matches!(sub.wait(id, WAIT).unwrap(), Outcome::Failed(Error::OutOfBounds { .. })));
}

#[test]
fn shutdown_refuses_new_work() {
    let p = pair(MIB);
    let mut sub = p.initiator.submitter().unwrap();
    p.initiator.shutdown();
    let descs = [BlockDesc::new(p.local.id(), 0, p.remote.id(), 0, 4096)];
    assert!(matches!(sub.submit(&Batch::write(&p.segment).descs(&descs)), Err(Error::Shutdown)));
    assert!(matches!(p.initiator.submitter(), Err(Error::Shutdown)));
    assert!(matches!(p.initiator.open_segment("127.0.0.1:1"), Err(Error::Shutdown)));
}

#[test]
fn the_segment_cache_is_bounded_and_counts_hits_misses_and_evictions() {
    let targets: Vec<_> = (0..3).map(|i| engine(&format!("target-{i}"))).collect();
    let _regions: Vec<_> = targets.iter().map(|t| t.alloc_region(4096, RegionInfo::raw()).unwrap()).collect();
    let initiator = common::builder("initiator").segment_cache_capacity(2).build().unwrap();
    let local = initiator.alloc_region(4096, RegionInfo::raw()).unwrap();
    let addr = |i: usize| targets[i].control_addr().to_string();
    let first = initiator.open_segment(&addr(0)).unwrap();
    let second = initiator.open_segment(&addr(1)).unwrap();
    let again = initiator.open_segment(&addr(0)).unwrap(); // hit: 0 is now the most recent
    assert_eq!(again.epoch(), first.epoch());
    let _third_opened = initiator.open_segment(&addr(2)).unwrap(); // evicts 1, the least recently used
    let stats = initiator.segment_cache_stats();
    assert_eq!((stats.hits, stats.misses, stats.evictions, stats.len, stats.capacity), (1, 3, 1, 2, 2));
    assert!(second.is_closed(), "the evicted handle is closed");
    assert!(!first.is_closed());
    let mut sub = initiator.submitter().unwrap();
    let descs = [BlockDesc::new(local.id(), 0, second.region(0).unwrap(), 0, 4096)];
    assert!(matches!(sub.submit(&Batch::write(&second).descs(&descs)), Err(Error::UnknownSegment { .. })));
    // Reopening the evicted name works (a miss, and another eviction).
    let reopened = initiator.open_segment(&addr(1)).unwrap();
    let descs = [BlockDesc::new(local.id(), 0, reopened.region(0).unwrap(), 0, 4096)];
    let id = sub.submit(&Batch::write(&reopened).descs(&descs)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    assert_eq!(initiator.segment_cache_stats().evictions, 2);
}

#[test]
fn a_pre_shared_token_is_required_when_the_target_has_one() {
    let target = common::builder("guarded").token("s3cret").build().unwrap();
    let remote = target.alloc_region(8192, RegionInfo::raw()).unwrap();
    let addr = target.control_addr().to_string();
    for (builder, expected) in [
        (common::builder("no-token"), "requires a token"),
        // The target's proof fails first: the initiator proves nothing to it.
        (common::builder("bad-token").token("guess"), "does not prove the token; nothing was sent to it"),
    ] {
        let initiator = builder.build().unwrap();
        match initiator.open_segment(&addr) {
            Err(Error::Unauthorized { reason }) => assert!(reason.contains(expected), "{reason}"),
            other => panic!("expected Unauthorized ({expected}), got {other:?}"),
        }
    }
    // A tokened initiator refuses a target that does not prove the token
    // (a forged address, or a misconfigured peer).
    let open = common::builder("open").build().unwrap();
    let _open_region = open.alloc_region(4096, RegionInfo::raw()).unwrap();
    let guarded = common::builder("careful").token("s3cret").build().unwrap();
    match guarded.open_segment(&open.control_addr().to_string()) {
        Err(Error::Unauthorized { reason }) => assert!(reason.contains("runs without a token"), "{reason}"),
        other => panic!("expected Unauthorized, got {other:?}"),
    }
    let initiator = common::builder("good-token").token("s3cret").build().unwrap();
    let local = initiator.alloc_region(8192, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(9) };
    let segment = initiator.open_segment(&addr).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let descs = [BlockDesc::new(local.id(), 0, remote.id(), 0, 8192)];
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    // Control RPCs after the handshake work with the token...
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    assert_eq!(segment.remote_checksum(remote.id(), 0, 8192, WAIT).unwrap(), unsafe {
        local.checksum(0, 8192).unwrap()
    });
    // ...and a connection that skips the handshake gets nothing.
    let mut client = kvring::testing::control::ControlClient::connect(&addr, std::time::Instant::now() + WAIT).unwrap();
    match client.checksum(remote.id().raw(), 0, 8192, std::time::Instant::now() + WAIT) {
        Err(Error::Remote { code: kvring::ErrorCode::Unauthorized, message }) => {
            assert!(message.contains("requires a token: complete the handshake first"), "{message}")
        }
        other => panic!("expected Unauthorized, got {other:?}"),
    }
}

#[test]
fn addresses_are_turned_into_region_and_offset_on_both_sides() {
    let target = common::engine("decode-locate");
    let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let initiator = common::engine("prefill-locate");
    let local = initiator.alloc_region(65536, RegionInfo::raw()).unwrap();
    let base = remote.as_ptr() as u64;
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    assert_eq!(segment.locate(base + 4096, 8192).unwrap(), (remote.id(), 4096));
    assert_eq!(segment.locate(base, 1 << 20).unwrap(), (remote.id(), 0));
    for (addr, len) in [(base + (1 << 20) - 10, 11), (base - 1, 2), (u64::MAX - 2, 8)] {
        let error = segment.locate(addr, len).unwrap_err().to_string();
        assert!(error.contains("lies in no region of decode-locate"), "{error}");
    }
    let at = local.as_ptr() as u64;
    assert_eq!(initiator.locate(at + 100, 900).unwrap(), (local.id(), 100));
    let error = initiator.locate(at + 65000, 1000).unwrap_err().to_string();
    assert!(error.contains("lies in no registered region"), "{error}");
    assert!(initiator.locate(base, 10).is_err(), "the peer's memory is not ours");
}

#[test]
fn a_half_started_peer_is_asked_again_rather_than_cached_empty() {
    let target = common::engine("decode-starting");
    let initiator = common::engine("initiator");
    let addr = target.control_addr().to_string();
    // Its control port is up, its region not registered yet.
    let early = initiator.open_segment(&addr).unwrap();
    assert!(early.regions().is_empty());
    let error = early.region(0).unwrap_err().to_string();
    assert!(error.contains("decode-starting exposes no region yet"), "{error}");
    let region = target.alloc_region(4096, RegionInfo::raw()).unwrap();
    // The next open asks the peer again instead of returning the empty handle.
    let ready = initiator.open_segment(&addr).unwrap();
    assert_eq!(ready.region(0).unwrap(), region.id());
}

#[test]
fn a_lane_that_panics_ends_the_batch_it_held_with_its_error_and_refuses_new_work() {
    let p = pair(MIB);
    let mut sub = p.initiator.submitter().unwrap();
    let descs: Vec<_> =
        (0..16u64).map(|i| BlockDesc::new(p.local.id(), i * 65536, p.remote.id(), i * 65536, 65536)).collect();
    // The batch's own deadline is far past the wait's: an answer within
    // the wait can only be the lane's error, not the batch timing out.
    let deadline = Duration::from_secs(3600);
    assert!(deadline > WAIT);
    assert!(kvring::testing::panic_lane_on_next_part(&p.initiator, 0));
    let id = sub.submit(&Batch::write(&p.segment).descs(&descs).deadline(deadline)).unwrap();
    match sub.wait(id, WAIT) {
        Ok(Outcome::Failed(Error::LaneDied { lane: 0, reason })) => {
            assert!(reason.contains("injected by a test"), "{reason}")
        }
        other => panic!("expected LaneDied from lane 0, got {other:?}"),
    }
    assert_eq!(p.initiator.lane_stats()[0].panics, 1);
    assert!(p.initiator.metrics_text().contains("kvring_lane_panics_total{lane=\"0\"} 1"));
    // New work is refused at once with the same error, nothing queued.
    match sub.submit(&Batch::write(&p.segment).descs(&descs)) {
        Err(Error::LaneDied { lane: 0, .. }) => {}
        other => panic!("expected LaneDied at submit, got {other:?}"),
    }
    assert_eq!(sub.in_flight(), 0);
    // The regions the dead part named were handed back: they unregister.
    drop(sub);
    p.initiator.unregister(p.local.id()).unwrap();
}
