//! The handshake that gives a watching submitter one notification CQE per
//! burst of notifications, never zero and never an unbounded number.
//!
//! Deliverers push a message, then count it. Lane 0, seeing the count
//! change, [`claims`](NotificationWatch::claim_post) the right to post a CQE;
//! the claim fails while an earlier CQE is unreaped. The submitter, on
//! reaping that CQE, [`releases`](NotificationWatch::reaped) the claim
//! *before* it polls the queue, so a message counted after its last poll
//! finds the claim free and gets a CQE of its own. The count is
//! [`Deliveries`]; the lane's look at it is [`Deliveries::changed_since`].
//! Both modelled in `loom_tests/`, from this file.

use crate::sync::{AtomicBool, AtomicU64, Ordering};

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
    /// updates); the lane then [claims](NotificationWatch::claim_post) a
    /// CQE for each watching submitter. The count is read before the
    /// claim is taken.
    pub fn changed_since(&self, seen: &mut u64) -> bool {
        let now = self.get();
        let changed = now != *seen;
        *seen = now;
        changed
    }
}

/// A submitter's wish for notification CQEs, shared with lane 0.
#[derive(Debug)]
pub struct NotificationWatch {
    on: AtomicBool,
    posted: AtomicBool,
}

impl Default for NotificationWatch {
    fn default() -> Self {
        Self::new()
    }
}

impl NotificationWatch {
    /// Not watching, nothing posted.
    pub fn new() -> Self {
        Self { on: AtomicBool::new(false), posted: AtomicBool::new(false) }
    }

    /// Starts or stops watching.
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::SeqCst);
    }

    /// Lane side, after it saw new deliveries: true when it must post a
    /// CQE (watching, and no earlier CQE is still unreaped).
    pub fn claim_post(&self) -> bool {
        self.on.load(Ordering::SeqCst) && !self.posted.swap(true, Ordering::SeqCst)
    }

    /// Submitter side, on reaping the CQE and before polling the queue.
    pub fn reaped(&self) {
        self.posted.store(false, Ordering::SeqCst);
    }
}
