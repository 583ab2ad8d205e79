//! The RDMA transport end to end on the simulated verbs provider: two
//! engines on one simulated fabric, QPs exchanged through the control plane,
//! lanes posting and polling, the restart path, and no leaked QP, MR or CQ.

mod common;

use common::{pattern, WAIT};
use kvring::transport::rdma::sim::SimVerbs;
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, RegionInfo, TransportKind};
use std::sync::Arc;

fn rdma_engine(name: &str, sim: &Arc<SimVerbs>) -> Engine {
    common::builder(name).rdma(sim.clone()).build().unwrap()
}

fn contents(region: &kvring::Region, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    region.read_at(offset, &mut out).unwrap();
    out
}

#[test]
fn blocks_move_both_ways_over_rdma_and_rdma_comes_first() {
    let sim = Arc::new(SimVerbs::new());
    let target = rdma_engine("decode-0", &sim);
    let remote = target.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    let initiator = rdma_engine("prefill-0", &sim);
    let local = initiator.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    local.fill_pattern(5);
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    assert_eq!(segment.transport(), TransportKind::Rdma, "both serve rdma: it comes first");

    // 64 scattered 4 KiB blocks, a 3 MiB one (sliced), and adjacent ones (coalesced).
    let mut descs: Vec<BlockDesc> =
        (0..64).map(|i| BlockDesc::new(local.id(), i * 8192, remote.id(), i * 8192, 4096)).collect();
    descs.push(BlockDesc::new(local.id(), 1 << 20, remote.id(), 1 << 20, 3 << 20));
    let mut sub = initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(matches!(outcome, Outcome::Done { bytes } if bytes == 64 * 4096 + (3 << 20)), "{outcome:?}");
    let source = pattern(4 << 20, 5);
    for i in 0..64usize {
        assert_eq!(contents(&remote, i as u64 * 8192, 4096), source[i * 8192..i * 8192 + 4096]);
    }
    assert_eq!(contents(&remote, 1 << 20, 3 << 20), source[1 << 20..]);

    // READ back into a fresh region.
    let back = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let reads: Vec<BlockDesc> =
        (0..16).map(|i| BlockDesc::new(back.id(), i * 4096, remote.id(), (1 << 20) + i * 4096, 4096)).collect();
    let id = sub.submit(&Batch::read(&segment).descs(&reads)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    assert_eq!(contents(&back, 0, 65536), source[1 << 20..(1 << 20) + 65536]);

    // A batch of many chunks (the lane hands the link 256 blocks at a time),
    // more requests than the send queue holds.
    let many: Vec<BlockDesc> =
        (0..2000).map(|i| BlockDesc::new(local.id(), i * 2048, remote.id(), i * 2048, 1024)).collect();
    let id = sub.submit(&Batch::write(&segment).descs(&many)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(matches!(outcome, Outcome::Done { bytes } if bytes == 2000 * 1024), "{outcome:?}");
    assert_eq!(contents(&remote, 1999 * 2048, 1024), source[1999 * 2048..1999 * 2048 + 1024]);

    // A block past the peer's region is refused before any verb is posted.
    let past = BlockDesc::new(local.id(), 0, remote.id(), (4 << 20) - 100, 4096);
    let id = sub.submit(&Batch::write(&segment).block(past)).unwrap();
    assert!(matches!(sub.wait(id, WAIT).unwrap(), Outcome::Failed(Error::OutOfBounds { .. })));
}

#[test]
fn a_peer_that_restarts_fails_in_flight_work_and_is_reached_again_with_no_leak() {
    let sim = Arc::new(SimVerbs::new());
    let initiator = rdma_engine("prefill-0", &sim);
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let mut sub = initiator.submitter().unwrap();
    for round in 0..20 {
        let target = rdma_engine("decode-0", &sim);
        let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        let name = target.control_addr().to_string();
        let segment = initiator.open_segment_with(&name, Some(TransportKind::Rdma), WAIT).unwrap();
        let desc = BlockDesc::new(local.id(), 0, remote.id(), 0, 65536);
        let id = sub.submit(&Batch::write(&segment).block(desc)).unwrap();
        assert!(sub.wait(id, WAIT).unwrap().is_done(), "round {round}");
        // The peer goes away: its QPs and MRs with it.
        drop(remote);
        drop(target);
        let id = sub.submit(&Batch::write(&segment).block(desc)).unwrap();
        let outcome = sub.wait(id, WAIT).unwrap();
        assert!(matches!(outcome, Outcome::Failed(Error::PeerRestarted { .. })), "{outcome:?}");
        assert!(segment.is_stale());
        initiator.close_segment(&segment);
    }
    drop(sub);
    drop(local);
    drop(initiator);
    let counts = kvring::transport::rdma::verbs::Verbs::counts(&*sim);
    assert!(counts.balanced(), "{counts:?}");
    assert!(counts.qps.0 >= 40, "{counts:?}");
}

#[test]
fn an_engine_without_rdma_is_reached_over_the_usual_transports_and_refuses_rdma_clearly() {
    let sim = Arc::new(SimVerbs::new());
    let plain = common::engine("decode-plain");
    let _remote = plain.alloc_region(4096, RegionInfo::raw()).unwrap();
    let initiator = rdma_engine("prefill-0", &sim);
    let name = plain.control_addr().to_string();
    assert_eq!(initiator.open_segment(&name).unwrap().transport(), TransportKind::Shm);
    let error = initiator.open_segment_with(&name, Some(TransportKind::Rdma), WAIT).unwrap_err();
    assert!(error.to_string().contains("serves no RDMA"), "{error}");
    let none = Arc::new(SimVerbs::with_devices(vec![]));
    let error = common::builder("x").rdma(none).build().unwrap_err().to_string();
    assert!(error.contains("no RDMA device with an active port"), "{error}");
}
