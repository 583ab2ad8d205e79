//! The gate between a checksummed rdma chunk's local memory and the
//! verifier thread summing it.
//!
//! The promise: once [`Gate::withdraw`] returned, no [`Gate::step`] reads
//! the chunk's memory, so the lane may give the chunk's leases back and
//! the caller may reuse the bytes. A step runs holding the lock and only
//! while the chunk is not withdrawn; `withdraw` sets the flag holding the
//! same lock, so it waits for a step in progress (one 1 MiB sum) and none
//! starts afterwards.
//!
//! The give-up bound ([`Gate::step_until`], [`Gate::given_up`]) decides
//! nothing about memory: it only tells the lane when to stop waiting for
//! a verdict, and the lane then ends the chunk through `withdraw` like any
//! other withdrawal.
//!
//! The file uses only `crate::sync` (std's locks, loom's under
//! `cfg(loom)`) and std's clock, so `loom_tests/` compiles it unchanged
//! (`loom_tests/tests/verify_gate.rs`).

use crate::sync::Mutex;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

/// Lets a verdict that is on its way arrive before the lane gives up.
pub const VERDICT_GRACE: Duration = Duration::from_secs(1);

/// Keeps the verifier off a chunk's local bytes once the lane withdrew
/// it: the verifier runs each step holding the lock, the lane sets the
/// flag holding it.
#[derive(Debug, Default)]
pub struct Gate {
    withdrawn: Mutex<bool>,
    /// Set by the thread working on the job, before each step it bounds
    /// (the local sums, each question): past this the lane stops waiting
    /// for its verdict. Unset while the job waits in the queue, which its
    /// batch's deadline (or a cancel) bounds, not the question's.
    give_up: Mutex<Option<Instant>>,
}

impl Gate {
    /// Waits for a step in progress to end; none starts afterwards.
    pub fn withdraw(&self) {
        *self.withdrawn.lock().unwrap_or_else(PoisonError::into_inner) = true;
    }

    /// Runs `read` (one step's read of the chunk's memory) unless the
    /// chunk was withdrawn, holding the gate while it runs: `None` once
    /// withdrawn, and then nothing was read.
    pub fn step<R>(&self, read: impl FnOnce() -> R) -> Option<R> {
        // Held for the whole step: a withdrawal, on the lane, waits at
        // most one step's read.
        let withdrawn = self.withdrawn.lock().unwrap_or_else(PoisonError::into_inner);
        if *withdrawn {
            return None;
        }
        let out = read();
        drop(withdrawn);
        Some(out)
    }

    /// The step now starting ends by `deadline`: the lane waits for the
    /// verdict until that and a grace.
    pub fn step_until(&self, deadline: Instant) {
        let until = deadline.checked_add(VERDICT_GRACE).unwrap_or(deadline);
        *self.give_up.lock().unwrap_or_else(PoisonError::into_inner) = Some(until);
    }

    /// True once the step in progress ran past its deadline and grace.
    pub fn given_up(&self, now: Instant) -> bool {
        self.give_up.lock().unwrap_or_else(PoisonError::into_inner).is_some_and(|until| now >= until)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_withdrawn_gate_runs_no_step_and_the_lane_gives_up_only_past_the_grace() {
        let gate = Gate::default();
        assert_eq!(gate.step(|| 7), Some(7));
        let now = Instant::now();
        assert!(!gate.given_up(now), "no step bounded yet");
        gate.step_until(now);
        assert!(!gate.given_up(now), "within the grace");
        assert!(gate.given_up(now + VERDICT_GRACE));
        gate.withdraw();
        assert_eq!(gate.step(|| panic!("a withdrawn chunk's memory is read")), None::<()>);
    }
}
