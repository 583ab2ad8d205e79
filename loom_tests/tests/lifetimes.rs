//! loom models of the protocols that decide when memory may still be read
//! or written: the registry slot's leases, exclusive reads and unregister
//! (src/mem/lease.rs), and the cma page's revocation handshake
//! (src/transport/cma/revoke.rs), both compiled unchanged from kvring's
//! source. The guarded bytes are loom `UnsafeCell`s: an access that no
//! happens-before orders against another fails the model, so a broken
//! ordering shows as a data race, not only as a wrong value.
#![cfg(loom)]

use kvring_loom::lease::{Refused, Slot};
use kvring_loom::revoke;
use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::{Arc, Mutex};
use loom::thread;

/// Unregisters `generation`, waiting (as a caller retrying `RegionBusy`
/// does) until the leases drain; returns the entry it took.
fn unregister_when_drained(slot: &Slot<u64>, generation: u32) -> u64 {
    loop {
        match slot.unpublish(generation) {
            Ok(unpublished) => return unpublished.entry,
            Err(Refused::Held { .. }) => thread::yield_now(),
            Err(other) => panic!("a live slot refused its own unregister: {other:?}"),
        }
    }
}

/// A lane holds a lease and reads the region's entry while the owner
/// unregisters, waiting for the lease to drain, then registers new memory
/// in the same slot. The lane's read happens before the owner takes and
/// rewrites the entry (a race fails the model); the lane either leased the
/// region and read its own entry, or was told it is gone; the old id never
/// leases again, and the new registration has a new generation.
#[test]
fn a_lease_holder_reads_before_unregister_takes_the_entry_and_ids_are_never_reused() {
    loom::model(|| {
        let slot = Arc::new(Slot::<u64>::new());
        // SAFETY: a new slot, owned here.
        let first = unsafe { slot.publish(7) };
        let lane = {
            let slot = slot.clone();
            thread::spawn(move || match slot.lease(first) {
                Ok(()) => {
                    // SAFETY: under the lease just taken.
                    let seen = unsafe { slot.read(|entry| *entry) };
                    // SAFETY: that lease, given back once.
                    unsafe { slot.release() };
                    Some(seen)
                }
                Err(refused) => {
                    assert_eq!(refused, Refused::Gone, "a live idle slot refused a lease");
                    None
                }
            })
        };
        assert_eq!(unregister_when_drained(&slot, first), 7);
        // SAFETY: unpublished above by this thread, the slot's only owner.
        let second = unsafe { slot.publish(8) };
        assert_ne!(second, first, "a generation issued twice");
        let seen = lane.join().unwrap();
        assert!(seen.is_none() || seen == Some(7), "the lane read another region's entry: {seen:?}");
        assert_eq!(slot.lease(first), Err(Refused::Gone), "the old id leased the new region");
        assert_eq!(slot.unpublish(first).unwrap_err(), Refused::Gone);
        slot.lease(second).unwrap();
        // SAFETY: the lease just taken.
        assert_eq!(unsafe { slot.read(|entry| *entry) }, 8);
    });
}

/// Two unregisters of one region race while a lane holds a lease: exactly
/// one takes the entry; the other is told the region is held (only while
/// it is still live) or gone, never given it twice. Each unregister runs
/// as the engine's does (src/engine/regions.rs): under the cma page's
/// serialising mutex, take it off the page, unregister, and list it again
/// only when the registry said it is still held. Once an unregister has
/// succeeded, the page never lists the region again.
#[test]
fn racing_unregisters_take_the_region_once_and_the_loser_never_lists_it_again() {
    const GENERATION: u32 = 1;
    const LISTED: u64 = (GENERATION as u64) << 32 | 1;
    loom::model(|| {
        let slot = Arc::new(Slot::<u64>::new());
        // SAFETY: a new slot, owned here.
        let generation = unsafe { slot.publish(7) };
        let page = Arc::new(AtomicU64::new(LISTED));
        let serial = Arc::new(Mutex::new(()));
        slot.lease(generation).unwrap();
        let lane = {
            let slot = slot.clone();
            // SAFETY: the lease taken above, handed to this thread and
            // given back once.
            thread::spawn(move || unsafe { slot.release() })
        };
        let unregisters: Vec<_> = (0..2)
            .map(|_| {
                let (slot, page, serial) = (slot.clone(), page.clone(), serial.clone());
                thread::spawn(move || {
                    let _serial = serial.lock().unwrap();
                    let before = revoke::take_off(&page, GENERATION, 1);
                    match slot.unpublish(generation) {
                        Ok(unpublished) => Some(unpublished.entry),
                        Err(Refused::Held { .. }) => {
                            if let Some(before) = before {
                                revoke::put_back(&page, before);
                            }
                            None
                        }
                        Err(Refused::Gone) => None,
                        Err(Refused::Full) => unreachable!("unpublish never says full"),
                    }
                })
            })
            .collect();
        let taken: Vec<u64> = unregisters.into_iter().filter_map(|u| u.join().unwrap()).collect();
        lane.join().unwrap();
        assert!(taken.len() <= 1, "the entry was taken twice: {taken:?}");
        if taken == [7] {
            assert_eq!(page.load(loom::sync::atomic::Ordering::SeqCst), 0, "an unregistered region is listed");
        } else {
            // Both came while the lane held it: still registered and listed.
            assert!(slot.is_live(generation));
            assert_eq!(page.load(loom::sync::atomic::Ordering::SeqCst), LISTED);
        }
    });
}

/// A peer's checksum reads a region alone while a lane tries to lease it:
/// never both at once (the read and the lane's write are ordered), and the
/// region cannot be unregistered under the read.
#[test]
fn a_read_alone_and_a_lease_never_overlap() {
    loom::model(|| {
        let slot = Arc::new(Slot::<u64>::new());
        // SAFETY: a new slot, owned here.
        let generation = unsafe { slot.publish(7) };
        let bytes = Arc::new(UnsafeCell::new(0u64));
        let lane = {
            let (slot, bytes) = (slot.clone(), bytes.clone());
            thread::spawn(move || {
                if slot.lease(generation).is_ok() {
                    // The lane's copy into the region.
                    // SAFETY: a loom cell's pointer; loom itself reports an unordered access.
                    bytes.with_mut(|b| unsafe { *b += 1 });
                    // SAFETY: the lease taken above, given back once.
                    unsafe { slot.release() };
                }
            })
        };
        if slot.read_alone(generation).is_ok() {
            // SAFETY: read alone: nobody writes the bytes now.
            let sum = bytes.with(|b| unsafe { *b });
            assert!(sum <= 1);
            assert!(matches!(slot.unpublish(generation), Err(Refused::Held { reading: true, .. })));
            // SAFETY: the exclusive read granted above, ended once.
            unsafe { slot.end_read() };
        }
        lane.join().unwrap();
        assert!(slot.unpublish(generation).is_ok(), "everything given back: it unregisters");
    });
}

/// The target's words and two regions' bytes, as cma initiators write
/// them and as the target's caller reuses them once `unregister` (or the
/// engine's stop) returned.
struct Target {
    epoch: AtomicU64,
    /// Region slots 0 (A) and 1 (B).
    state: [AtomicU64; 2],
    /// One initiator's user slot: its word and its marks.
    word: AtomicU64,
    marks: [AtomicU64; revoke::MARKS],
    memory: [UnsafeCell<u64>; 2],
}

/// Each slot's generation, as its state word lists it (the slot is the
/// word's place on the page).
const GENERATION: [u32; 2] = [2, 2];
const LISTED: [u64; 2] = [(GENERATION[0] as u64) << 32 | 1, (GENERATION[1] as u64) << 32 | 1];
const EPOCH: u64 = 41;

impl Target {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            epoch: AtomicU64::new(EPOCH),
            state: [AtomicU64::new(LISTED[0]), AtomicU64::new(LISTED[1])],
            word: AtomicU64::new(0),
            marks: std::array::from_fn(|_| AtomicU64::new(0)),
            memory: [UnsafeCell::new(0), UnsafeCell::new(0)],
        })
    }

    fn user(&self) -> revoke::User<'_> {
        revoke::User { word: &self.word, marks: std::array::from_fn(|m| &self.marks[m]) }
    }

    /// One initiator call into regions `into`, as `CmaLink::move_all` makes
    /// it: marked in, the epoch and each region checked, then
    /// `process_vm_writev` into each.
    fn initiator_call(&self, into: &[usize]) -> bool {
        let entered = revoke::enter(self.user(), into);
        let allowed =
            entered.still(&self.epoch, EPOCH) && into.iter().all(|&r| entered.still(&self.state[r], LISTED[r]));
        if allowed {
            for &r in into {
                // SAFETY: a loom cell's pointer; loom itself reports an unordered access.
                self.memory[r].with_mut(|m| unsafe { *m = 1 });
            }
        }
        allowed
    }

    /// The target's wait: until no call that may touch `region` (None:
    /// any) is marked or counted.
    fn drain(&self, region: Option<usize>) {
        while revoke::calls_in(self.user(), region).1 {
            thread::yield_now();
        }
    }

    /// The caller frees region `r`'s memory and uses it for something else.
    fn reuse(&self, r: usize) {
        // SAFETY: a loom cell's pointer; loom itself reports an unordered access.
        self.memory[r].with_mut(|m| unsafe { *m = 99 });
    }
}

/// A target unregisters region A while an initiator makes a call into it
/// (alone, beside B, blocks alternating between A and B, or into B and A
/// with one mark free, so that A is counted for every region): either the
/// initiator's check sees A off the page and makes no call, or the
/// target's wait sees the call marked (or counted) and waits for it to
/// end; the caller's reuse of the memory never races with the call.
#[test]
fn a_cma_call_never_reaches_a_region_after_its_revoke_returned() {
    let cases: [(&[usize], usize); 4] = [(&[0], 0), (&[1, 0], 0), (&[0, 1, 0, 1, 0, 1, 0, 1], 0), (&[1, 0], 5)];
    for (into, taken) in cases {
        loom::model(move || {
            let target = Target::new();
            // Marks other lanes' calls into B hold for the whole model.
            for mark in &target.marks[..taken] {
                mark.store(revoke::mark_of(1), loom::sync::atomic::Ordering::SeqCst);
            }
            let initiator = {
                let target = target.clone();
                thread::spawn(move || target.initiator_call(into))
            };
            let before = revoke::take_off(&target.state[0], GENERATION[0], 1).expect("listed");
            assert_eq!(before, LISTED[0]);
            target.drain(Some(0));
            target.reuse(0);
            let _ = initiator.join().unwrap();
            // A second revoke of the same id finds nothing to take off.
            assert_eq!(revoke::take_off(&target.state[0], GENERATION[0], 1), None);
        });
    }
}

/// Two initiators (two lanes of one link, sharing its user slot) write A
/// and B while the target unregisters A: A's wait never misses the call
/// into A, whichever marks the two calls took.
#[test]
fn two_calls_sharing_a_user_slot_never_hide_the_one_into_the_revoked_region() {
    loom::model(|| {
        let target = Target::new();
        let calls: Vec<_> = [0usize, 1]
            .into_iter()
            .map(|r| {
                let target = target.clone();
                thread::spawn(move || target.initiator_call(&[r]))
            })
            .collect();
        revoke::take_off(&target.state[0], GENERATION[0], 1).expect("listed");
        target.drain(Some(0));
        target.reuse(0);
        for call in calls {
            let _ = call.join().unwrap();
        }
    });
}

/// A call into B in progress does not hold up A's unregister: with the
/// call marked in and not yet ended, A's wait finds nothing to wait for,
/// while B's finds the call.
#[test]
fn a_call_into_b_does_not_hold_up_the_unregister_of_a() {
    loom::model(|| {
        let target = Target::new();
        let entered = revoke::enter(target.user(), &[1]);
        let unregister_a = {
            let target = target.clone();
            thread::spawn(move || {
                revoke::take_off(&target.state[0], GENERATION[0], 1).expect("listed");
                revoke::calls_in(target.user(), Some(0)).1
            })
        };
        assert!(!unregister_a.join().unwrap(), "A's unregister waited on a call into B");
        assert!(revoke::calls_in(target.user(), Some(1)).1, "B's unregister must wait on it");
        assert!(revoke::calls_in(target.user(), None).1, "a stop must wait on it");
        drop(entered);
        assert!(!revoke::calls_in(target.user(), Some(1)).1);
    });
}

/// The engine stops (the epoch goes to 0) while an initiator makes a call:
/// the same guarantee, through the epoch word.
#[test]
fn a_cma_call_never_reaches_memory_after_the_engine_stopped() {
    loom::model(|| {
        let target = Target::new();
        let initiator = {
            let target = target.clone();
            thread::spawn(move || target.initiator_call(&[1]))
        };
        revoke::stop(&target.epoch);
        target.drain(None);
        target.reuse(1);
        let _ = initiator.join().unwrap();
        // After the stop, no call is allowed.
        assert!(!target.initiator_call(&[0]));
    });
}
