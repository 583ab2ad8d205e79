//! The doorbell: how a parked lane is woken without ever losing a wake-up.
//!
//! A lane that found no work for its busy-poll window announces that it is
//! going to sleep, re-checks its rings, and only then parks. A submitter
//! publishes its entry, then checks whether the lane announced sleep and
//! unparks it if so. Both sides put a SeqCst fence between their store and
//! their load (the Dekker pattern), so at least one of them sees the other:
//! either the lane's re-check finds the entry, or the submitter sees the
//! flag and unparks. `unpark` before `park` is remembered by the thread's
//! park token, so the order of the two calls does not matter either.
//!
//! The lane also parks with a timeout, so even a broken invariant costs a
//! bounded delay, never a hang.

use crate::sync::{fence, thread, AtomicBool, Ordering};
use std::time::Duration;

/// A lane's doorbell.
#[derive(Debug)]
pub struct Doorbell {
    sleeping: AtomicBool,
    lane: thread::Thread,
}

impl Doorbell {
    /// A doorbell for the calling thread (the lane).
    pub fn for_current_thread() -> Self {
        Self::for_thread(thread::current())
    }

    /// A doorbell that wakes `lane`.
    pub fn for_thread(lane: thread::Thread) -> Self {
        Self { sleeping: AtomicBool::new(false), lane }
    }

    /// Lane side: park unless `has_work` finds something after the
    /// announcement. Returns true when it actually parked.
    pub fn park(&self, timeout: Duration, has_work: impl FnOnce() -> bool) -> bool {
        self.sleeping.store(true, Ordering::Relaxed);
        // SeqCst fence pairs with the one in `ring`: our store of `sleeping`
        // and the submitter's store of the ring tail cannot both be missed.
        fence(Ordering::SeqCst);
        if has_work() {
            self.sleeping.store(false, Ordering::Relaxed);
            return false;
        }
        thread::park_timeout(timeout);
        self.sleeping.store(false, Ordering::Relaxed);
        true
    }

    /// Submitter side, after publishing work: wake the lane if it sleeps.
    #[inline]
    pub fn ring(&self) {
        // SeqCst fence pairs with the one in `park` (see the module docs).
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) {
            self.lane.unpark();
        }
    }
}
