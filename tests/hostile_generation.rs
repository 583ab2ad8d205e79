//! Row 4 of the second hostile review, on every same-host and network
//! transport that names a region by its id: an initiator keeps a link
//! opened when a registry slot held its first region, while the target
//! churns that slot. Region ids carry a 32-bit generation (64-bit ids on
//! every wire), and a slot whose generation is spent is retired (never
//! published again), so no id is ever issued twice in a process's life.
//! Two ways an old id could come back, each refused with a typed error and
//! no byte landed, neither at the address captured at open (cma) nor in
//! the slot's later regions:
//!
//! - 65,536 re-registrations of the slot, where a 16-bit generation wrapped
//!   and the old id matched again;
//! - the slot's last generations (started near `u32::MAX` with a testing
//!   hook rather than 4 billion registrations): the slot is retired at
//!   `u32::MAX`, another slot serves, and the spent one never comes back.

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

/// The target's answer to a write naming `first`: refused, by the
/// initiator's own check against the page (same host) or by the target's
/// registry on the wire (tcp).
fn assert_refused(outcome: Outcome, first: RegionId, transport: TransportKind) {
    let name = transport.name();
    match outcome {
        Outcome::Failed(Error::UnknownRegion { region, .. }) => assert_eq!(region, first, "{name}"),
        Outcome::Failed(Error::Remote { code: ErrorCode::UnknownRegion, message })
            if transport == TransportKind::Tcp =>
        {
            assert!(message.contains(&format!("region {first}")), "{message}")
        }
        other => panic!("{name}: a write to the old id must fail UnknownRegion, got {other:?}"),
    }
}

/// A target, an initiator linked to it over `transport` while the target's
/// first region was registered, and that region (unregistered again).
struct Churn {
    transport: TransportKind,
    target: Engine,
    initiator: Engine,
    local: Region,
    segment: Segment,
    first: RegionId,
    old: Memory,
}

impl Churn {
    fn new(transport: TransportKind, what: &str) -> (Self, Vec<u8>) {
        let name = transport.name();
        let target = common::engine(&format!("{what}-target-{name}"));
        let initiator = common::engine(&format!("{what}-initiator-{name}"));
        let local = initiator.alloc_region(LEN, RegionInfo::raw()).unwrap();
        // SAFETY: no batch in flight touches these bytes while the test writes them.
        unsafe { local.fill_pattern(4) };
        let mut old = vec![0u8; LEN];
        let (first, first_region) = Memory::register(&target, transport, &mut old);
        let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
        assert_eq!(segment.transport(), transport);
        target.unregister(first).unwrap();
        let old = match first_region {
            Some(region) => Memory::Own(region),
            None => Memory::Caller(old),
        };
        (Self { transport, target, initiator, local, segment, first, old }, vec![0u8; LEN])
    }

    /// With a live region `again` registered in caller memory `new` (or its
    /// own), a write naming the first id is refused and lands nothing.
    fn old_id_lands_nothing(&self, again: RegionId, again_region: Option<Region>, new: Vec<u8>) {
        let name = self.transport.name();
        assert_ne!(again, self.first);
        let outcome = write_old(&self.initiator, &self.segment, self.local.id(), self.first);
        assert_refused(outcome, self.first, self.transport);
        assert!(self.old.untouched(), "{name}: nothing at the old region (the address captured at open)");
        let new = match again_region {
            Some(region) => Memory::Own(region),
            None => Memory::Caller(new),
        };
        assert!(new.untouched(), "{name}: nothing in the slot's current region");
        self.target.unregister(again).unwrap();
    }
}

fn churn_past_sixteen_bits(transport: TransportKind) {
    let name = transport.name();
    let (churn, mut new) = Churn::new(transport, "wrap");
    let first = churn.first;
    // 65,536 re-registrations: a 16-bit generation would have come back to
    // `first` here (the old id's low 16 generation bits match again).
    let mut ids = HashSet::new();
    let mut aliased_under_16_bits = 0;
    for _ in 0..=u16::MAX as usize {
        let (id, region) = Memory::register(&churn.target, transport, &mut new);
        assert_ne!(id, first, "{name}: the old id was handed out again");
        assert!(ids.insert(id), "{name}: id {id} handed out twice");
        if id.index() == first.index() && id.generation() as u16 == first.generation() as u16 {
            aliased_under_16_bits += 1;
        }
        churn.target.unregister(id).unwrap();
        drop(region);
    }
    assert_eq!(aliased_under_16_bits, 1, "{name}: the churn reached the generation a 16-bit id wrapped to");
    // A live region in the slot the churn ended on, for the old id to miss.
    let (again, again_region) = Memory::register(&churn.target, transport, &mut new);
    assert_eq!(again.index(), first.index(), "{name}: the slot is still served, not retired");
    churn.old_id_lands_nothing(again, again_region, new);
}

fn churn_to_the_last_generation(transport: TransportKind) {
    let name = transport.name();
    let (churn, mut new) = Churn::new(transport, "spent");
    let first = churn.first;
    // Every free slot (the old id's among them) at its last two generations.
    assert!(kvring::testing::start_free_region_slots_at(&churn.target, u32::MAX - 1) > 0);
    let mut ids = HashSet::new();
    let mut last = None;
    let mut spent_slot_served = 0;
    // Reused last-in first-out: the old id's slot serves twice, then is
    // retired and the next slot serves. A few more rounds show it stays so.
    for _ in 0..6 {
        let (id, region) = Memory::register(&churn.target, transport, &mut new);
        assert!(ids.insert(id), "{name}: id {id} handed out twice");
        assert!(id.generation() >= u32::MAX - 1, "{name}: {id} from a slot started at its last generations");
        if id.index() == first.index() {
            spent_slot_served += 1;
            last = Some(id);
        }
        churn.target.unregister(id).unwrap();
        drop(region);
    }
    assert_eq!(spent_slot_served, 2, "{name}: generations u32::MAX - 1 and u32::MAX, then retired");
    assert_eq!(last.map(RegionId::generation), Some(u32::MAX));
    let (again, again_region) = Memory::register(&churn.target, transport, &mut new);
    assert_ne!(again.index(), first.index(), "{name}: the retired slot is never reused");
    churn.old_id_lands_nothing(again, again_region, new);
}

#[test]
fn an_old_id_kept_across_65536_reregistrations_lands_nothing_over_cma() {
    churn_past_sixteen_bits(TransportKind::Cma);
}

#[test]
fn an_old_id_kept_across_65536_reregistrations_lands_nothing_over_shm() {
    churn_past_sixteen_bits(TransportKind::Shm);
}

#[test]
fn an_old_id_kept_across_65536_reregistrations_lands_nothing_over_tcp() {
    churn_past_sixteen_bits(TransportKind::Tcp);
}

#[test]
fn a_slot_retired_at_its_last_generation_never_serves_the_old_id_over_cma() {
    churn_to_the_last_generation(TransportKind::Cma);
}

#[test]
fn a_slot_retired_at_its_last_generation_never_serves_the_old_id_over_shm() {
    churn_to_the_last_generation(TransportKind::Shm);
}

#[test]
fn a_slot_retired_at_its_last_generation_never_serves_the_old_id_over_tcp() {
    churn_to_the_last_generation(TransportKind::Tcp);
}
