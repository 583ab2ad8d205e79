//! Row 4 of the second hostile review, on every same-host and network
//! transport that names a region by its id: one registry slot churned
//! through all of its 65,535 generations and more while an initiator keeps
//! a link opened when the slot held its first region. The 16-bit
//! generation is not widened; a slot whose generation is spent is retired
//! (never published again), so no id is ever issued twice in a process's
//! life: the old id is refused with a typed error, and no byte lands,
//! neither at the address captured at open (cma) nor in the slot's later
//! regions.

mod common;

use common::WAIT;
use kvring::{
    Batch, BlockDesc, Engine, Error, ErrorCode, Outcome, Region, RegionId, RegionInfo, Segment, TransportKind,
};
use std::collections::HashSet;

const LEN: usize = 64 << 10;

fn write_old(engine: &Engine, segment: &Segment, local: RegionId, remote: RegionId) -> Outcome {
    let mut sub = engine.submitter().unwrap();
    let descs = [BlockDesc::new(local, 0, remote, 0, LEN as u64)];
    let id = sub.submit(&Batch::write(segment).descs(&descs).deadline(WAIT)).unwrap();
    sub.wait(id, WAIT).unwrap()
}

/// The target's memory for one registration: caller memory (cma and tcp
/// reach it) or a region of its own (shm reaches only that).
enum Memory {
    Caller(Vec<u8>),
    Own(Region),
}

impl Memory {
    fn register(target: &Engine, transport: TransportKind, caller: &mut Vec<u8>) -> (RegionId, Option<Region>) {
        match transport {
            TransportKind::Shm => {
                let region = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
                (region.id(), Some(region))
            }
            // SAFETY: `caller` outlives its registration (unregistered, or
            // the engine dropped, before it is).
            _ => (unsafe { target.register(caller.as_mut_ptr(), caller.len(), RegionInfo::raw()) }.unwrap(), None),
        }
    }

    fn untouched(&self) -> bool {
        match self {
            Memory::Caller(bytes) => bytes.iter().all(|&b| b == 0),
            Memory::Own(region) => {
                let mut bytes = vec![0u8; LEN];
                // SAFETY: no batch names the region while it is read.
                unsafe { region.read_at(0, &mut bytes) }.unwrap();
                bytes.iter().all(|&b| b == 0)
            }
        }
    }
}

fn churn_past_the_generation(transport: TransportKind) {
    let name = transport.name();
    let target = common::engine(&format!("wrap-target-{name}"));
    let initiator = common::engine(&format!("wrap-initiator-{name}"));
    let local = initiator.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test writes them.
    unsafe { local.fill_pattern(4) };
    let mut old = vec![0u8; LEN];
    let mut new = vec![0u8; LEN];
    let (first, first_region) = Memory::register(&target, transport, &mut old);
    let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
    assert_eq!(segment.transport(), transport);
    target.unregister(first).unwrap();
    // Every generation the slot has, and one more: a 16-bit generation
    // that wrapped would come back to `first` here.
    let mut ids = HashSet::new();
    let mut slots = HashSet::new();
    for _ in 0..=u16::MAX as usize {
        let (id, region) = Memory::register(&target, transport, &mut new);
        assert_ne!(id, first, "{name}: the old id was handed out again");
        assert!(ids.insert(id), "{name}: id {id} handed out twice");
        slots.insert(id.index());
        target.unregister(id).unwrap();
        drop(region);
    }
    assert!(slots.contains(&first.index()), "{name}: the churn went through the old id's slot");
    assert!(slots.len() >= 2, "{name}: the spent slot was retired and another one served");
    // A live region in the slot the churn ended on, for the old id to miss.
    let (again, again_region) = Memory::register(&target, transport, &mut new);
    assert_ne!(again, first);
    let outcome = write_old(&initiator, &segment, local.id(), first);
    match outcome {
        // Same host: the initiator's own check against the target's page.
        Outcome::Failed(Error::UnknownRegion { region, .. }) => assert_eq!(region, first, "{name}"),
        // tcp: the target's registry refuses it, and says so on the wire.
        Outcome::Failed(Error::Remote { code: ErrorCode::UnknownRegion, message })
            if transport == TransportKind::Tcp =>
        {
            assert!(message.contains(&format!("region {first}")), "{message}")
        }
        other => panic!("{name}: a write to the old id must fail UnknownRegion, got {other:?}"),
    }
    let old = match first_region {
        Some(region) => Memory::Own(region),
        None => Memory::Caller(old),
    };
    assert!(old.untouched(), "{name}: nothing at the old region (the address captured at open)");
    let new = match again_region {
        Some(region) => Memory::Own(region),
        None => Memory::Caller(std::mem::take(&mut new)),
    };
    assert!(new.untouched(), "{name}: nothing in the slot's current region");
    target.unregister(again).unwrap();
}

#[test]
fn an_old_id_kept_across_a_slots_every_generation_lands_nothing_over_cma() {
    churn_past_the_generation(TransportKind::Cma);
}

#[test]
fn an_old_id_kept_across_a_slots_every_generation_lands_nothing_over_shm() {
    churn_past_the_generation(TransportKind::Shm);
}

#[test]
fn an_old_id_kept_across_a_slots_every_generation_lands_nothing_over_tcp() {
    churn_past_the_generation(TransportKind::Tcp);
}
