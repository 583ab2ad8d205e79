//! The fenced-destination protocol of `src/mem/fence.rs` (what decides
//! whether a writer under a grant may still copy into a range its target
//! fenced), modelled with loom: the range's bytes are a loom `UnsafeCell`,
//! so a stale write that could overlap the new owner's bytes after `fence`
//! returned is reported as a data race (or by the final assertion).
#![cfg(loom)]

use kvring_loom::fence::{FenceView, Span, FENCE_WORDS};
use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::Arc;
use loom::thread;

struct Range {
    words: Vec<AtomicU64>,
    bytes: UnsafeCell<u64>,
}

impl Range {
    fn new() -> Arc<Self> {
        Arc::new(Self { words: (0..FENCE_WORDS).map(|_| AtomicU64::new(0)).collect(), bytes: UnsafeCell::new(0) })
    }

    fn view(&self) -> FenceView<'_> {
        FenceView::new(&self.words)
    }

    /// A writer's copy under `grant`: true when it landed.
    fn write(&self, grant: u32, value: u64) -> bool {
        let Some(pass) = self.view().enter() else { return false };
        if !pass.admits(0, 8, grant) {
            return false;
        }
        // SAFETY (of the model): `admits` under a pass says the fencer
        // waits for this copy, or that it is not stale.
        self.bytes.with_mut(|bytes| unsafe { *bytes = value });
        true
    }
}

fn patient() -> bool {
    thread::yield_now();
    true
}

/// A stale sender (grant `g1`) writes while its target fences the range
/// again and hands it to a new owner, who writes at once: the stale copy
/// lands before `fence` returns or not at all.
#[test]
fn no_stale_write_lands_after_fence_returned() {
    loom::model(|| {
        let range = Range::new();
        let g1 = 1;
        range.view().fence(&[Span::range(0, 8)], g1, || true).unwrap();
        let stale = {
            let range = range.clone();
            thread::spawn(move || range.write(g1, 7))
        };
        range.view().fence(&[Span::range(0, 8)], 2, patient).unwrap();
        // The new owner's bytes.
        // SAFETY: a loom cell's pointer; loom reports an unordered access.
        range.bytes.with_mut(|bytes| unsafe { *bytes = 1 });
        let landed = stale.join().unwrap();
        // SAFETY: as above.
        let last = range.bytes.with(|bytes| unsafe { *bytes });
        assert_eq!(last, 1, "a stale write landed after fence returned (landed: {landed})");
    });
}

/// A sender naming a grant nobody was given (`u32::MAX`: above every
/// generation the table will hold) writes while its target fences a range
/// that was never fenced: the copy lands before `fence` returns or not at
/// all, and once it returned the made-up grant is refused. Fails when the
/// table's `issued` word is not checked (the entry's generation is below
/// the made-up grant, so the write would pass it).
#[test]
fn a_made_up_grant_lands_before_the_fence_returns_or_never() {
    loom::model(|| {
        let range = Range::new();
        let liar = {
            let range = range.clone();
            thread::spawn(move || range.write(u32::MAX, 7))
        };
        range.view().fence(&[Span::range(0, 8)], 1, patient).unwrap();
        // SAFETY: a loom cell's pointer; loom reports an unordered access.
        range.bytes.with_mut(|bytes| unsafe { *bytes = 1 });
        let landed = liar.join().unwrap();
        // SAFETY: as above.
        let last = range.bytes.with(|bytes| unsafe { *bytes });
        assert_eq!(last, 1, "a made-up grant's write landed after fence returned (landed: {landed})");
        assert!(!range.write(u32::MAX, 9), "a made-up grant passed the fence");
        // SAFETY: as above.
        assert_eq!(range.bytes.with(|bytes| unsafe { *bytes }), 1);
    });
}

/// A device copy's writer (cuda_ipc's chunk, the tcp target's staged
/// copy): it enters and checks on its lane, keeps its count past the pass
/// (`Pass::detach`), and the copy lands later on another thread (the copy
/// engine), which releases the count only once the copy is in place
/// (`Held::release`). The stale copy still lands before `fence` returns or
/// not at all.
#[test]
fn a_held_pass_released_after_an_async_copy_keeps_the_fence_waiting() {
    loom::model(|| {
        let range = Range::new();
        let g1 = 1;
        range.view().fence(&[Span::range(0, 8)], g1, || true).unwrap();
        let stale = {
            let range = range.clone();
            thread::spawn(move || {
                let view = range.view();
                let Some(pass) = view.enter() else { return false };
                let held = pass.detach();
                if !view.admits_held(&held, 0, 8, g1) {
                    // SAFETY (of the model): the table lives in `range`.
                    unsafe { held.release() };
                    return false;
                }
                // The copy engine runs it later, elsewhere.
                let engine = range.clone();
                thread::spawn(move || {
                    // SAFETY (of the model): as in `Range::write`.
                    engine.bytes.with_mut(|bytes| unsafe { *bytes = 7 });
                    // SAFETY (of the model): the table lives in `engine`.
                    unsafe { held.release() };
                })
                .join()
                .unwrap();
                true
            })
        };
        range.view().fence(&[Span::range(0, 8)], 2, patient).unwrap();
        // SAFETY: a loom cell's pointer; loom reports an unordered access.
        range.bytes.with_mut(|bytes| unsafe { *bytes = 1 });
        let landed = stale.join().unwrap();
        // SAFETY: as above.
        let last = range.bytes.with(|bytes| unsafe { *bytes });
        assert_eq!(last, 1, "a stale async copy landed after fence returned (landed: {landed})");
    });
}

/// A writer that read the phase, then stalled while the target fenced
/// twice (so the second fence waits on the other counter), must still see
/// the second fence's entry. (The writer's re-read of the phase guards an
/// order of SC fences loom does not produce: see `src/mem/fence.rs`.)
#[test]
fn a_writer_stalled_across_two_fences_is_still_refused() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(|| {
        let range = Range::new();
        let g1 = 1;
        range.view().fence(&[Span::range(0, 8)], g1, || true).unwrap();
        let stale = {
            let range = range.clone();
            thread::spawn(move || range.write(g1, 7))
        };
        range.view().fence(&[Span::range(0, 8)], 2, patient).unwrap();
        range.view().fence(&[Span::range(0, 8)], 3, patient).unwrap();
        // SAFETY: as in the test above.
        range.bytes.with_mut(|bytes| unsafe { *bytes = 1 });
        stale.join().unwrap();
        // SAFETY: as above.
        assert_eq!(range.bytes.with(|bytes| unsafe { *bytes }), 1);
    });
}

/// The current grant's writer is never refused by a fence of another range
/// (a table entry folded into the floor refuses only older grants).
#[test]
fn the_current_grant_lands_beside_fences_of_other_ranges() {
    loom::model(|| {
        let range = Range::new();
        let g1 = 1;
        range.view().fence(&[Span::range(0, 8)], g1, || true).unwrap();
        let writer = {
            let range = range.clone();
            thread::spawn(move || range.write(g1, 7))
        };
        range.view().fence(&[Span::range(100, 8)], 2, patient).unwrap();
        range.view().fence(&[Span::range(200, 8)], 3, patient).unwrap();
        assert!(writer.join().unwrap(), "the current grant was refused");
    });
}
