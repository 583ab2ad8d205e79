//! Deadlines from callers' timeouts: one rule for a timeout too large for
//! the clock (docs/DEADLINES.md). A leaf module, std only, so any module
//! may use it without an import cycle.

use std::time::{Duration, Instant};

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
