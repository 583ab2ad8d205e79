//! The engine's monotonic clock, shared by submitters (deadlines) and lanes.

use std::time::{Duration, Instant};

/// Nanoseconds since the engine started.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    base: Instant,
}

impl Clock {
    /// A clock starting now.
    pub fn new() -> Self {
        Self { base: Instant::now() }
    }

    /// Nanoseconds since the clock started (never 0, so 0 can mean "none").
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64 + 1
    }

    /// The clock reading `after` from now.
    pub fn deadline_ns(&self, after: Duration) -> u64 {
        self.now_ns().saturating_add(after.as_nanos().min(u64::MAX as u128) as u64)
    }
}
