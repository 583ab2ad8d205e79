//! Bounded waiting: spin, then yield, then sleep in steps that grow with
//! the time waited, to a cap, and give up at the deadline.
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
    /// Then sleep in steps of an eighth of the time waited so far, from
    /// 10 µs up to this cap.
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
}

/// A sleep step is the time waited so far divided by this: a completion is
/// seen at most about an eighth of the wait late (plus one wake-up), where
/// doubling steps could see a 0.8 ms batch 0.3 ms late.
const SLEEP_FRACTION: u32 = 8;

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
        Self { policy, started: Instant::now(), deadline }
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
            let mut step = self.sleep_step(waited);
            if let Some(deadline) = self.deadline {
                step = step.min(deadline - now);
            }
            std::thread::sleep(step);
        }
        Snooze::Retry
    }

    /// The sleep after `waited`: an eighth of it, within 10 µs and the cap.
    fn sleep_step(&self, waited: Duration) -> Duration {
        (waited / SLEEP_FRACTION).clamp(FIRST_SLEEP, self.policy.sleep_cap.max(FIRST_SLEEP))
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
    fn sleep_steps_grow_with_the_wait_up_to_the_cap() {
        let policy = BackoffPolicy { sleep_cap: Duration::from_millis(1), ..BackoffPolicy::default() };
        let backoff = Backoff::new(policy, None);
        let step = |us| backoff.sleep_step(Duration::from_micros(us)).as_micros();
        assert_eq!([step(0), step(250), step(800), step(4000), step(100_000)], [10, 31, 100, 500, 1000]);
    }
}
