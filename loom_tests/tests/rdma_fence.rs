//! The RDMA fence protocol (docs/ARCHITECTURE.md, "Fenced destinations
//! over rdma"), modelled with loom. An RDMA writer's lane checks its
//! blocks against a *mirror* of the target region's table that lives in
//! the initiator's own memory (the very `src/mem/fence.rs` writer path),
//! and keeps its count until the chunk's completion, which the NIC gives
//! only once the bytes were placed at the target. The target's `fence`
//! pushes each new entry to every writer's mirror and waits for the
//! acknowledgement, which the initiator sends once its mirror's fence
//! returned (every write it counted before the entry has completed). A
//! writer that does not answer in time has its queue pair at the target
//! moved to the error state, after which none of its writes is placed.
//!
//! The target's bytes are a loom `UnsafeCell`: a stale write that could
//! overlap the new owner's bytes after `fence` returned is reported as a
//! data race, or by the final assertion. The models that skip the drain
//! or the acknowledgement must fail (`should_panic`), so the passing one is
//! no accident of the harness.
#![cfg(loom)]

use kvring_loom::fence::{FenceView, Span, FENCE_WORDS};
use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::{Arc, Mutex};
use loom::thread;

/// One target range and one writer's mirror of its region's table.
struct Link {
    /// The mirror, in the initiator's memory: written by the initiator's
    /// control thread (the pushed entries) and its lane (the counts).
    mirror: Vec<AtomicU64>,
    /// The target's bytes.
    bytes: UnsafeCell<u64>,
    /// The target's queue pair of this writer: false once moved to the
    /// error state. The NIC places an incoming write under it, so a write
    /// is placed before the transition or never (see the ARCHITECTURE
    /// text for the verbs reference).
    qp_ready: Mutex<bool>,
}

impl Link {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            mirror: (0..FENCE_WORDS).map(|_| AtomicU64::new(0)).collect(),
            bytes: UnsafeCell::new(0),
            qp_ready: Mutex::new(true),
        })
    }

    fn mirror(&self) -> FenceView<'_> {
        FenceView::new(&self.mirror)
    }

    /// The writer's lane posts one WRITE under `grant`; the NIC places it
    /// later, on another thread, and the lane lets its count go when it
    /// polls the completion (`early_release`: at the post instead, the
    /// drain skipped). True when it was posted.
    fn post(link: &Arc<Self>, grant: u32, early_release: bool) -> bool {
        let view = link.mirror();
        let Some(pass) = view.enter() else { return false };
        let held = pass.detach();
        if !view.admits_held(&held, 0, 8, grant) {
            // SAFETY (of the model): the mirror lives in `link`.
            unsafe { held.release() };
            return false;
        }
        let nic = link.clone();
        let held = if early_release {
            // SAFETY (of the model): as above.
            unsafe { held.release() };
            None
        } else {
            Some(held)
        };
        thread::spawn(move || {
            {
                let ready = nic.qp_ready.lock().unwrap();
                if *ready {
                    // SAFETY (of the model): loom reports an unordered access.
                    nic.bytes.with_mut(|bytes| unsafe { *bytes = 7 });
                }
            }
            // The completion, polled by the lane.
            if let Some(held) = held {
                // SAFETY (of the model): the mirror lives in `nic`.
                unsafe { held.release() };
            }
        });
        true
    }

    /// The initiator's control thread applies a pushed entry to the
    /// mirror; true (the acknowledgement) once every write counted before
    /// it completed, false when `patience` ran out first (`drain` false:
    /// acknowledges without waiting, the drain skipped).
    fn apply(&self, generation: u32, drain: bool, mut patience: usize) -> bool {
        let result = self.mirror().fence(&[Span::range(0, 8)], generation, || {
            if !drain || patience == 0 {
                return false;
            }
            patience -= 1;
            thread::yield_now();
            true
        });
        result.is_ok() || !drain
    }

    /// The target's deadline passed without an acknowledgement.
    fn break_qp(&self) {
        *self.qp_ready.lock().unwrap() = false;
    }

    fn new_owner_writes(&self) {
        // SAFETY (of the model): loom reports an unordered access.
        self.bytes.with_mut(|bytes| unsafe { *bytes = 1 });
    }

    fn last(&self) -> u64 {
        // SAFETY (of the model): as above.
        self.bytes.with(|bytes| unsafe { *bytes })
    }
}

/// How the model's target and initiator behave.
#[derive(Clone, Copy)]
struct Variant {
    /// The initiator waits for its counted writes before acknowledging.
    drain: bool,
    /// The target waits for the acknowledgement before `fence` returns.
    ack: bool,
    /// The lane lets its count go when it posts, not at the completion.
    early_release: bool,
}

const CORRECT: Variant = Variant { drain: true, ack: true, early_release: false };

/// A stale sender (grant 1) posts while its target fences the range under
/// grant 2 and the new owner writes at once.
fn stale_write_races_a_fence(variant: Variant) {
    loom::model(move || {
        let link = Link::new();
        // The fence that handed the sender its grant, already in the mirror.
        assert!(link.apply(1, true, 0));
        let sender = {
            let link = link.clone();
            thread::spawn(move || Link::post(&link, 1, variant.early_release))
        };
        // The push and its acknowledgement (the initiator's control thread).
        let control = {
            let link = link.clone();
            thread::spawn(move || link.apply(2, variant.drain, usize::MAX))
        };
        if variant.ack {
            assert!(control.join().unwrap(), "the initiator refused the entry");
        }
        link.new_owner_writes();
        let _ = sender.join();
        assert_eq!(link.last(), 1, "a stale write landed after fence returned");
    });
}

#[test]
fn a_stale_rdma_write_lands_before_fence_returns_or_never() {
    stale_write_races_a_fence(CORRECT);
}

#[test]
#[should_panic]
fn skipping_the_drain_lets_a_stale_write_land() {
    stale_write_races_a_fence(Variant { drain: false, ..CORRECT });
}

#[test]
#[should_panic]
fn skipping_the_acknowledgement_lets_a_stale_write_land() {
    stale_write_races_a_fence(Variant { ack: false, ..CORRECT });
}

#[test]
#[should_panic]
fn releasing_the_count_at_the_post_lets_a_stale_write_land() {
    stale_write_races_a_fence(Variant { early_release: true, ..CORRECT });
}

/// A writer whose lane stalls (it never polls the completion, so its count
/// stays) or whose process stopped (its control thread never answers):
/// the initiator's mirror fence gives up, or the target's wait does, and
/// the target moves the writer's QP to the error state before `fence`
/// returns. Nothing it posted lands afterwards.
#[test]
fn a_writer_that_never_acknowledges_is_cut_off_at_the_deadline() {
    stalled_writer(true);
}

/// Without the error transition at the deadline, the stalled writer's
/// posted write may land after `fence` gave up and the range was reused.
#[test]
#[should_panic]
fn not_cutting_off_a_silent_writer_lets_its_write_land() {
    stalled_writer(false);
}

fn stalled_writer(cut_off: bool) {
    loom::model(move || {
        let link = Link::new();
        assert!(link.apply(1, true, 0));
        let sender = {
            let link = link.clone();
            thread::spawn(move || {
                // A lane that posts, then stalls: the count is never released.
                let view = link.mirror();
                let Some(pass) = view.enter() else { return };
                let held = pass.detach();
                if view.admits_held(&held, 0, 8, 1) {
                    let nic = link.clone();
                    thread::spawn(move || {
                        // The guard is kept while the bytes are placed.
                        let ready = nic.qp_ready.lock().unwrap();
                        if *ready {
                            // SAFETY (of the model): as in `Link::post`.
                            nic.bytes.with_mut(|bytes| unsafe { *bytes = 7 });
                        }
                    });
                }
                // Detached: its count goes only when released, which this
                // stalled lane never does.
                let _stalled = held;
            })
        };
        // The initiator's patience is short; either way no acknowledgement
        // comes in time (a stopped process is the same, unanswered).
        let acked = link.apply(2, true, 1);
        if !acked && cut_off {
            link.break_qp();
        }
        link.new_owner_writes();
        sender.join().unwrap();
        assert_eq!(link.last(), 1, "a stale write landed after the writer was cut off");
    });
}

/// A sender naming a grant nobody was given is refused by the mirror as
/// by the target's own table: the pushed entries carry `issued`.
#[test]
fn a_made_up_grant_is_refused_by_the_mirror() {
    loom::model(|| {
        let link = Link::new();
        assert!(link.apply(1, true, 0));
        let liar = {
            let link = link.clone();
            thread::spawn(move || Link::post(&link, u32::MAX, false))
        };
        assert!(link.apply(2, true, usize::MAX));
        link.new_owner_writes();
        let _ = liar.join();
        assert_eq!(link.last(), 1, "a made-up grant's write landed after fence returned");
        assert!(!Link::post(&link, u32::MAX, false), "a made-up grant passed the mirror");
    });
}
