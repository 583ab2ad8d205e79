//! The revocation handshake of the cma page, on its words alone: what an
//! initiator does around every `process_vm_*` call, and what a target does
//! to take a region off the page (or stop) and wait out the calls that may
//! still touch it.
//!
//! Initiator: [`enter`] (its user slot's count goes up), then, for every
//! call, [`Entered::still`] of the epoch and of each region's state word;
//! the call; the guard's drop (the count goes down, Release).
//! Target: [`take_off`] (the state word goes to 0) or [`stop`] (the epoch
//! goes to 0), then [`calls_in`] of every user slot until none counts a
//! call.
//!
//! Each side's write and its read of the other side's word are split by a
//! sequentially consistent fence: of the two orders in which the writes can
//! happen, either the initiator's check reads the cleared word (it makes no
//! call) or the target's wait reads the initiator's count (it waits for the
//! call to end). The words live in a page that several processes map; the
//! fences are the CPU's, which hold across processes as they do across
//! threads.
//!
//! The file uses only `crate::sync`, so `loom_tests/` compiles it unchanged
//! (docs/ARCHITECTURE.md, "Protocols under loom").

use crate::sync::{fence, AtomicU64, Ordering};

/// The low half of a user slot's word while its claimer writes its start
/// time. No call is counted before the slot is published (the count is 0
/// under the mark), so such a slot counts no call. Counts never reach 2^31.
pub const CLAIMING: u64 = 1 << 31;

/// One call (or run of calls) in progress, counted in the initiator's user
/// slot until dropped.
#[derive(Debug)]
pub struct Entered<'a>(&'a AtomicU64);

/// Counts a call in, in the initiator's user slot `user`. Check
/// [`Entered::still`] before each call after.
#[inline]
pub fn enter(user: &AtomicU64) -> Entered<'_> {
    user.fetch_add(1, Ordering::SeqCst);
    // Pairs with the fence in `take_off` / `stop`: our count is visible to
    // the target's wait, or its cleared word is visible to our check.
    fence(Ordering::SeqCst);
    Entered(user)
}

impl Entered<'_> {
    /// True while `word` (the epoch, or a region's state word) still reads
    /// `expected`: the check before every call, made after the count.
    #[inline]
    pub fn still(&self, word: &AtomicU64, expected: u64) -> bool {
        word.load(Ordering::SeqCst) == expected
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        // Release: the call's accesses happen before the target sees the
        // count drop (its Acquire in `calls_in`).
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// Target: takes the region whose state word is `state` off the page when
/// it still lists `raw_id` (live); returns the word it had, for
/// [`put_back`], or `None` when it listed another region or none.
pub fn take_off(state: &AtomicU64, raw_id: u32, live: u64) -> Option<u64> {
    let listed = state.load(Ordering::SeqCst);
    if listed & live == 0 || (listed >> 32) as u32 != raw_id {
        return None;
    }
    let before = state.swap(0, Ordering::SeqCst);
    // Pairs with the fence in `enter`: the wait that follows reads every
    // count made before an initiator's check could have missed the clear.
    fence(Ordering::SeqCst);
    Some(before)
}

/// Target: lists a region taken off again (its initiators did not finish
/// in time, so it stays registered).
pub fn put_back(state: &AtomicU64, before: u64) {
    state.store(before, Ordering::SeqCst);
}

/// Target: the engine stops; no initiator starts another call.
pub fn stop(epoch: &AtomicU64) {
    epoch.store(0, Ordering::SeqCst);
    // As in `take_off`.
    fence(Ordering::SeqCst);
}

/// Target: the pid holding user slot `user`, and the calls it counts in
/// progress (0 for a slot still being claimed).
pub fn calls_in(user: &AtomicU64) -> (u32, u64) {
    // Acquire pairs with `Entered`'s Release: once this reads a count
    // down, that call's accesses are done.
    let word = user.load(Ordering::Acquire);
    ((word >> 32) as u32, word & (CLAIMING - 1))
}
