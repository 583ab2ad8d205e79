//! The count of notifications delivered so far: counted by the queue after
//! each message is in (`NotificationQueue::deliver`), read by lane 0 to
//! decide whether to announce (`runtime/watch.rs` has the handshake). Only
//! `crate::sync`, so `loom_tests/` compiles this file unchanged.

use crate::sync::{AtomicU64, Ordering};

/// How many notifications were delivered so far: counted by a deliverer
/// after its message is in the queue, read by lane 0.
#[derive(Debug, Default)]
pub struct Deliveries(AtomicU64);

impl Deliveries {
    /// None so far.
    pub fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// Deliverer side, after the message is queued.
    pub fn count(&self) {
        // Release: whoever sees the new count (Acquire below) finds the
        // message in the queue.
        self.0.fetch_add(1, Ordering::AcqRel);
    }

    /// Deliveries so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Lane side: true when deliveries happened since `seen` (which it
    /// updates); the lane then claims (`NotificationWatch::claim_post`) a
    /// CQE for each watching submitter. The count is read before the
    /// claim is taken.
    pub fn changed_since(&self, seen: &mut u64) -> bool {
        let now = self.get();
        let changed = now != *seen;
        *seen = now;
        changed
    }
}
