//! The handshake that gives a watching submitter one notification CQE per
//! burst of notifications, never zero and never an unbounded number.
//!
//! Deliverers push a message, then count it. Lane 0, seeing the count
//! change, [`claims`](NotificationWatch::claim_post) the right to post a CQE;
//! the claim fails while an earlier CQE is unreaped. The submitter, on
//! reaping that CQE, [`releases`](NotificationWatch::reaped) the claim
//! *before* it polls the queue, so a message counted after its last poll
//! finds the claim free and gets a CQE of its own. The count is
//! `crate::delivered::Deliveries`; the lane's look at it is its
//! `changed_since`. Both modelled in `loom_tests/`, from their files.

use crate::sync::{AtomicBool, Ordering};

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
