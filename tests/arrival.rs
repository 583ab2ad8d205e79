//! Per-layer arrival: a push carries a tag on the data path and the target
//! counts its bytes under it as they land, so the decode side waits for
//! layer L of request R without a notification, while later layers are
//! still in flight.

mod common;

use common::{engine, WAIT};
use kvring::kv::{arrival_tag, CacheShape, KvLayout};
use kvring::{Batch, BlockDesc, Error, RegionInfo, TransportKind};
use std::time::Duration;

#[test]
fn a_tagged_push_over_tcp_is_counted_on_the_target_once_in_place() {
    let target = engine("arrival-target");
    let remote = target.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    let initiator = engine("arrival-initiator");
    let local = initiator.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let mut sub = initiator.submitter().unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(5) };
    let tag = arrival_tag(7, 3).unwrap();
    assert_eq!(target.landed(tag), 0);
    assert!(matches!(target.wait_landed(tag, 1, Duration::from_millis(20)), Err(Error::Timeout { .. })));

    // 64 blocks of 4 KiB (one chunk) and one of 3 MiB (three frames).
    let small: Vec<_> = (0..64u64).map(|i| BlockDesc::new(local.id(), i * 4096, remote.id(), i * 4096, 4096)).collect();
    let big = [BlockDesc::new(local.id(), 1 << 20, remote.id(), 1 << 20, 3 << 20)];
    let expected: u64 = small.iter().chain(&big).map(|d| d.len).sum();
    // The target's count reaches the bytes without the initiator's help.
    for outcome in common::land_in_turn(&mut sub, &segment, &target, tag, &[&small[..], &big[..]]) {
        assert!(outcome.is_done());
    }
    assert_eq!(target.landed(tag), expected);
    // What was counted is in place.
    let (mut here, mut there) = (vec![0u8; 3 << 20], vec![0u8; 3 << 20]);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.read_at(1 << 20, &mut here).unwrap() };
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { remote.read_at(1 << 20, &mut there).unwrap() };
    assert!(here == there);
    // An untagged push and another tag leave the count alone.
    let id = sub.submit(&Batch::write(&segment).descs(&small)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    assert_eq!(target.landed(tag), expected);
    assert_eq!(target.forget_arrival(tag), expected);
    assert_eq!(target.landed(tag), 0);
    assert_eq!(target.arrivals_dropped(), 0);
}

#[test]
fn push_layer_tagged_lets_the_target_wait_layer_by_layer() {
    let shape = CacheShape::mha(4, 16, 2, 64, 2, 4, 1).unwrap();
    let target = engine("layer-target");
    let theirs = target.alloc_region(shape.bytes().unwrap() as usize, RegionInfo::raw()).unwrap();
    let initiator = engine("layer-initiator");
    let mine = initiator.alloc_region(shape.bytes().unwrap() as usize, RegionInfo::raw()).unwrap();
    let remote = KvLayout::contiguous(shape, theirs.id(), 0).unwrap();
    let local = KvLayout::contiguous(shape, mine.id(), 0).unwrap();
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let blocks = [1u64, 2, 5, 9];
    for layer in 0..4 {
        let id = sub.push_layer_tagged(&segment, &local, &remote, layer, 11, &blocks, &blocks).unwrap();
        let layer_bytes = blocks.len() as u64 * (shape.key_block_bytes + shape.value_block_bytes);
        target.wait_landed(arrival_tag(11, layer).unwrap(), layer_bytes, WAIT).unwrap();
        assert!(sub.wait(id, WAIT).unwrap().is_done());
        assert_eq!(target.landed(arrival_tag(11, layer + 1).unwrap()), 0, "the next layer is not counted yet");
    }
}

#[test]
fn a_tag_on_a_read_or_on_a_transport_whose_target_cannot_count_it_is_refused() {
    let target = engine("untaggable-target");
    let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let initiator = engine("untaggable-initiator");
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let addr = target.control_addr().to_string();
    let desc = [BlockDesc::new(local.id(), 0, remote.id(), 0, 4096)];
    let mut sub = initiator.submitter().unwrap();
    let tcp = initiator.open_segment_with(&addr, Some(TransportKind::Tcp), WAIT).unwrap();
    let id = sub.submit(&Batch::read(&tcp).descs(&desc).arrival_tag(9)).unwrap();
    let refused = sub.wait(id, WAIT).unwrap().into_result().unwrap_err();
    assert!(refused.to_string().contains("arrival tag on a READ"), "{refused}");
    initiator.close_segment(&tcp);
    let shm = initiator.open_segment_with(&addr, Some(TransportKind::Shm), WAIT).unwrap();
    let id = sub.submit(&Batch::write(&shm).descs(&desc).arrival_tag(9)).unwrap();
    let refused = sub.wait(id, WAIT).unwrap().into_result().unwrap_err();
    assert!(refused.to_string().contains("counts them on tcp and rdma"), "{refused}");
    assert_eq!(target.landed(9), 0);
}
