//! Bounded waiting: spin, then yield, then sleep in doubling steps to a cap,
//! and give up at the deadline.
//!
//! Every wait in kvring goes through [`Backoff`]; none is unbounded.
//! Spinning first matters here: a thread wake-up costs ~50 µs in these VMs,
//! while a completion seen by a spinning waiter costs well under 1 µs.

use std::time::{Duration, Instant};

/// Default time spent spinning before yielding.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Default time spent yielding before sleeping.
pub const DEFAULT_YIELD: Duration = Duration::from_micros(200);
/// First sleep step.
pub const FIRST_SLEEP: Duration = Duration::from_micros(10);
/// Longest sleep step.
pub const DEFAULT_SLEEP_CAP: Duration = Duration::from_millis(1);

/// How a waiter backs off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffPolicy {
    /// Busy-spin this long.
    pub spin: Duration,
    /// Then `yield_now` this long.
    pub yield_for: Duration,
    /// Then sleep, doubling from 10 µs up to this cap.
    pub sleep_cap: Duration,
}

impl Default for BackoffPolicy {
    fn default() -> Self {
        Self { spin: DEFAULT_SPIN, yield_for: DEFAULT_YIELD, sleep_cap: DEFAULT_SLEEP_CAP }
    }
}

/// One wait in progress.
#[derive(Debug)]
pub struct Backoff {
    policy: BackoffPolicy,
    started: Instant,
    deadline: Option<Instant>,
    sleep: Duration,
}

/// What the waiter should do after [`Backoff::snooze`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Snooze {
    /// Check the condition again.
    Retry,
    /// The deadline passed.
    Expired,
}

impl Backoff {
    /// Starts a wait that ends at `deadline` (None: wait as long as needed,
    /// still backing off to the cap).
    pub fn new(policy: BackoffPolicy, deadline: Option<Instant>) -> Self {
        Self { policy, started: Instant::now(), deadline, sleep: FIRST_SLEEP }
    }

    /// Time since the wait started.
    pub fn waited(&self) -> Duration {
        self.started.elapsed()
    }

    /// Backs off once, by the phase the wait is in.
    pub fn snooze(&mut self) -> Snooze {
        let now = Instant::now();
        if let Some(deadline) = self.deadline {
            if now >= deadline {
                return Snooze::Expired;
            }
        }
        let waited = now - self.started;
        if waited < self.policy.spin {
            for _ in 0..32 {
                std::hint::spin_loop();
            }
        } else if waited < self.policy.spin + self.policy.yield_for {
            std::thread::yield_now();
        } else {
            let mut step = self.sleep;
            if let Some(deadline) = self.deadline {
                step = step.min(deadline - now);
            }
            std::thread::sleep(step);
            self.sleep = (self.sleep * 2).min(self.policy.sleep_cap);
        }
        Snooze::Retry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_expires_at_its_deadline_and_not_long_after() {
        let policy = BackoffPolicy {
            spin: Duration::from_micros(10),
            yield_for: Duration::from_micros(10),
            sleep_cap: Duration::from_millis(2),
        };
        let deadline = Instant::now() + Duration::from_millis(20);
        let mut backoff = Backoff::new(policy, Some(deadline));
        let mut rounds = 0u32;
        while backoff.snooze() == Snooze::Retry {
            rounds += 1;
            assert!(rounds < 1_000_000, "backoff never expired");
        }
        assert!(Instant::now() >= deadline);
        // Sleeping is capped and clipped to the deadline, so the overshoot is
        // one scheduler wake-up, not a whole doubling step.
        assert!(backoff.waited() < Duration::from_secs(2), "waited {:?}", backoff.waited());
    }

    #[test]
    fn sleep_steps_double_up_to_the_cap() {
        let policy =
            BackoffPolicy { spin: Duration::ZERO, yield_for: Duration::ZERO, sleep_cap: Duration::from_micros(40) };
        let mut backoff = Backoff::new(policy, None);
        let mut steps = vec![];
        for _ in 0..4 {
            steps.push(backoff.sleep);
            backoff.snooze();
        }
        assert_eq!(steps, [10, 20, 40, 40].map(Duration::from_micros));
    }
}
