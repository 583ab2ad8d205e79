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

/// How far off "no deadline" lies: a caller's timeout longer than this (up
/// to `Duration::MAX`, or a Python float of seconds near 1e19) waits this
/// long instead, as every `Instant` past it may not exist on the platform.
pub(crate) const NO_DEADLINE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The instant `timeout` after `from`, every caller-supplied timeout's
/// deadline: a timeout too large for an `Instant` (which panics with
/// "overflow when adding duration to instant" under `+`) means no deadline,
/// modelled as [`NO_DEADLINE`] from `from` (see docs/DEADLINES.md).
pub(crate) fn deadline_from(from: Instant, timeout: Duration) -> Instant {
    from.checked_add(timeout)
        .or_else(|| from.checked_add(NO_DEADLINE))
        // An `Instant` 100 years on exists on every supported platform
        // (Linux's is an i64 of seconds); were it not, wait as long as one can.
        .unwrap_or_else(|| longest_from(from))
}

/// The instant `timeout` from now: [`deadline_from`] of `Instant::now()`.
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    deadline_from(Instant::now(), timeout)
}

fn longest_from(from: Instant) -> Instant {
    let mut step = NO_DEADLINE;
    while !step.is_zero() {
        if let Some(at) = from.checked_add(step) {
            return at;
        }
        step /= 2;
    }
    from
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeout_too_large_for_an_instant_is_no_deadline_not_a_panic() {
        let now = Instant::now();
        assert_eq!(deadline_from(now, Duration::from_secs(5)), now + Duration::from_secs(5));
        for huge in [Duration::MAX, Duration::from_secs(u64::MAX / 2), Duration::from_secs_f64(1e19)] {
            assert_eq!(deadline_from(now, huge), now + NO_DEADLINE, "{huge:?}");
        }
        assert!(deadline_after(Duration::MAX) > now + NO_DEADLINE / 2);
        assert_eq!(longest_from(now), now + NO_DEADLINE);
    }
}
