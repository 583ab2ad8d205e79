//! Hostile cases written as an outsider would, for two paths that decide
//! whether memory may still be written or a layer counted as landed:
//!
//! - a same-host peer writing over shm into a region its owner has
//!   unregistered (issue 26: the link mapped the file once and never looked
//!   again, so the write landed and reported success);
//! - arrival tags keyed by the proven sender (issue 27, row 4): two prefill
//!   engines choosing the same tag, and one of them writing the other's
//!   granted blocks under it.

mod common;

use common::WAIT;
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, RegionId, RegionInfo, Segment, TransportKind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const LEN: usize = 1 << 20;
const BLOCK: u64 = 64 << 10;
const TOKEN: &str = "hostile-third-token";

fn write(
    engine: &Engine,
    segment: &Segment,
    local: RegionId,
    remote: RegionId,
    blocks: std::ops::Range<u64>,
) -> Outcome {
    let descs: Vec<_> = blocks.map(|i| BlockDesc::new(local, i * BLOCK, remote, i * BLOCK, BLOCK)).collect();
    let mut sub = engine.submitter().unwrap();
    let id = sub.submit(&Batch::write(segment).descs(&descs).deadline(WAIT)).unwrap();
    sub.wait(id, WAIT).unwrap()
}

// ---- shm: a write into a region its owner unregistered -------------------

#[test]
fn a_shm_write_into_a_region_its_owner_unregistered_fails_and_never_lands() {
    let owner = common::engine("shm-owner");
    let writer = common::engine("shm-writer");
    let local = writer.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(7) };
    let region = owner.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let segment = writer.open_segment_with(&owner.control_addr().to_string(), Some(TransportKind::Shm), WAIT).unwrap();
    assert_eq!(segment.transport(), TransportKind::Shm);
    assert!(write(&writer, &segment, local.id(), region.id(), 0..16).is_done(), "a write while registered lands");

    owner.unregister(region.id()).unwrap();
    // The owner keeps its mapping (it holds the region) and reuses the bytes.
    // SAFETY: the region is unregistered; only this test touches its bytes.
    unsafe { region.write_at(0, &vec![0xee; LEN]).unwrap() };
    match write(&writer, &segment, local.id(), region.id(), 0..16) {
        Outcome::Failed(Error::UnknownRegion { region: named, .. }) => assert_eq!(named, region.id()),
        other => panic!("a write after unregister must fail UnknownRegion, got {other:?}"),
    }
    let mut bytes = vec![0u8; LEN];
    // SAFETY: as above.
    unsafe { region.read_at(0, &mut bytes).unwrap() };
    assert!(bytes.iter().all(|&b| b == 0xee), "no byte landed after unregister returned");
}

#[test]
fn shm_writes_racing_an_unregister_never_land_after_it_returned() {
    let writer = common::engine("shm-race-writer");
    let local = writer.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(9) };
    for round in 0..8 {
        let owner = common::engine("shm-race-owner");
        let region = owner.alloc_region(LEN, RegionInfo::raw()).unwrap();
        let addr = owner.control_addr().to_string();
        let segment = writer.open_segment_with(&addr, Some(TransportKind::Shm), WAIT).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let copying = {
            let (writer, segment, stop, (local, remote)) =
                (writer.clone(), segment.clone(), stop.clone(), (local.id(), region.id()));
            std::thread::spawn(move || {
                let mut done = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    done += u32::from(write(&writer, &segment, local, remote, 0..16).is_done());
                }
                done
            })
        };
        std::thread::sleep(Duration::from_millis(5 + round));
        let unregistered = owner.unregister(region.id());
        // Told it is unregistered, the owner reuses the memory at once,
        // while the writer goes on writing.
        // SAFETY: the region is unregistered (or the test stops below).
        unsafe { region.write_at(0, &vec![0xee; LEN]).unwrap() };
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::Relaxed);
        copying.join().unwrap();
        match unregistered {
            Ok(()) => {
                let mut bytes = vec![0u8; LEN];
                // SAFETY: as above.
                unsafe { region.read_at(0, &mut bytes).unwrap() };
                assert!(bytes.iter().all(|&b| b == 0xee), "round {round}: bytes landed after unregister returned");
            }
            // A copy that did not end within the revocation wait: still
            // registered, which the owner was told.
            Err(Error::RegionBusy { .. }) => {}
            Err(other) => panic!("round {round}: {other:?}"),
        }
    }
}

// ---- arrivals keyed by the proven sender ---------------------------------

fn tokened(name: &str) -> Engine {
    common::builder(name).token(TOKEN).build().unwrap()
}

/// A prefill engine named `name` with a patterned region, and its tcp
/// segment to `decode`.
fn prefill(name: &str, seed: u64, decode: &Engine) -> (Engine, kvring::Region, Segment) {
    let engine = tokened(name);
    let region = engine.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { region.fill_pattern(seed) };
    let segment = engine.open_segment_with(&decode.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    (engine, region, segment)
}

fn tagged(
    engine: &Engine,
    segment: &Segment,
    local: RegionId,
    remote: RegionId,
    blocks: std::ops::Range<u64>,
    tag: u32,
) {
    let descs: Vec<_> = blocks.map(|i| BlockDesc::new(local, i * BLOCK, remote, i * BLOCK, BLOCK)).collect();
    let mut sub = engine.submitter().unwrap();
    let id = sub.submit(&Batch::write(segment).descs(&descs).arrival_tag(tag).deadline(WAIT)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
}

#[test]
fn two_prefill_engines_choosing_one_tag_are_counted_apart_and_neither_completes_the_others() {
    let decode = tokened("decode");
    let kv = decode.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let (a, a_region, a_segment) = prefill("prefill-a", 1, &decode);
    let (b, b_region, b_segment) = prefill("prefill-b", 2, &decode);
    // Both chose slot 42, layer 3 for their own requests: decode gave a
    // blocks 0..4 and b blocks 8..12, and grants each its own.
    let tag = kvring::kv::arrival_tag(42, 3).unwrap();
    decode.grant_arrival_from("prefill-a", tag, &[(kv.id(), 0, 4 * BLOCK)]).unwrap();
    decode.grant_arrival_from("prefill-b", tag, &[(kv.id(), 8 * BLOCK, 4 * BLOCK)]).unwrap();
    let again = decode.grant_arrival_from("prefill-a", tag, &[(kv.id(), 0, BLOCK)]);
    assert!(matches!(again, Err(Error::InvalidArgument { .. })), "{again:?}");
    assert!(decode.grant_arrival(tag, &[(kv.id(), 0, BLOCK)]).is_err(), "an any-sender grant over named ones");

    // b, allowed to write the region, writes a's blocks under the tag.
    tagged(&b, &b_segment, b_region.id(), kv.id(), 0..4, tag);
    assert_eq!(decode.landed_from("prefill-a", tag), 0, "b's bytes in a's blocks are not a's");
    let early = decode.wait_landed_from("prefill-a", tag, 4 * BLOCK, Duration::from_millis(50));
    assert!(matches!(early, Err(Error::Timeout { .. })), "{early:?}");
    assert_eq!(decode.landed_from("prefill-b", tag), 0, "nor b's: outside b's grant");

    // Each pushes its own blocks: each count reaches its own size only.
    tagged(&a, &a_segment, a_region.id(), kv.id(), 0..4, tag);
    decode.wait_landed_from("prefill-a", tag, 4 * BLOCK, WAIT).unwrap();
    assert_eq!(decode.landed_from("prefill-b", tag), 0);
    tagged(&b, &b_segment, b_region.id(), kv.id(), 8..12, tag);
    decode.wait_landed_from("prefill-b", tag, 4 * BLOCK, WAIT).unwrap();
    assert_eq!(decode.landed_from("prefill-a", tag), 4 * BLOCK, "b's push added nothing to a");
    // What a's count says landed is a's bytes.
    let (mut here, mut there) = (vec![0u8; 4 * BLOCK as usize], vec![0u8; 4 * BLOCK as usize]);
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { a_region.read_at(0, &mut here).unwrap() };
    // SAFETY: as above.
    unsafe { kv.read_at(0, &mut there).unwrap() };
    assert!(here == there, "a's blocks hold a's bytes");
    assert_eq!(decode.forget_arrival_from("prefill-a", tag), 4 * BLOCK);
    assert_eq!(decode.landed_from("prefill-b", tag), 4 * BLOCK, "b's grant outlives a's");
    assert_eq!(decode.forget_arrival_from("prefill-b", tag), 4 * BLOCK);
    assert!(decode.arrivals_refused() >= 4, "b's four blocks in a's range were refused");
}

#[test]
fn a_sender_grant_without_a_token_is_refused_saying_why() {
    let decode = common::engine("untokened-decode");
    let kv = decode.alloc_region(LEN, RegionInfo::raw()).unwrap();
    match decode.grant_arrival_from("prefill-a", 7, &[(kv.id(), 0, BLOCK)]) {
        Err(Error::Unsupported { what }) => assert!(what.contains("token"), "{what}"),
        other => panic!("{other:?}"),
    }
    let tokened = tokened("tokened-decode");
    let kv = tokened.alloc_region(LEN, RegionInfo::raw()).unwrap();
    assert!(matches!(tokened.grant_arrival_from("", 7, &[(kv.id(), 0, BLOCK)]), Err(Error::InvalidArgument { .. })));
    assert!(matches!(tokened.grant_arrival_from("p", 0, &[(kv.id(), 0, BLOCK)]), Err(Error::InvalidArgument { .. })));
}
