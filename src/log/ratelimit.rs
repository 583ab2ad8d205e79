//! At most one log line per period per kind of event, for events a peer
//! can cause (quota refusals, admission refusals, broken links, an
//! unreachable metadata store): a flood of them must not become a flood
//! of lines, yet the line that does get out says how many were held back.
//!
//! One `static` [`RateLimit`] per kind, checked with two relaxed atomics
//! and no lock, so even a refusal path under attack pays almost nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Lets one event through per period and counts the rest.
#[derive(Debug)]
pub(crate) struct RateLimit {
    period_ns: u64,
    /// When the next event may pass, in ns since [`base`]; 0 at first.
    next_ns: AtomicU64,
    /// Events held back since the last one that passed.
    suppressed: AtomicU64,
}

/// The clock's origin: the first use of any limiter in this process.
fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

impl RateLimit {
    /// A limiter that lets one event through per `period`.
    pub(crate) const fn new(period: Duration) -> Self {
        Self { period_ns: period.as_nanos() as u64, next_ns: AtomicU64::new(0), suppressed: AtomicU64::new(0) }
    }

    /// One event per second: the default for everything a peer can cause.
    pub(crate) const fn per_second() -> Self {
        Self::new(Duration::from_secs(1))
    }

    /// `Some(held back since the last pass)` if this event may be logged
    /// now, else `None` (and it is counted).
    pub(crate) fn admit(&self) -> Option<u64> {
        // +1: a zero `next_ns` means "never passed", even at the origin.
        let now = base().elapsed().as_nanos() as u64 + 1;
        let next = self.next_ns.load(Ordering::Relaxed);
        // Of the threads that find the period over, one wins the swap.
        if now >= next
            && self.next_ns.compare_exchange(next, now + self.period_ns, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// `tracing::warn!` (or another level) through a [`RateLimit`]: the line
/// gets a `suppressed` field with the count held back since the last one.
///
/// `log_limited!(warn, LIMIT, field = value, ..., "message")`
macro_rules! log_limited {
    ($level:ident, $limit:expr, $($rest:tt)+) => {
        if let Some(suppressed) = $limit.admit() {
            tracing::$level!(suppressed, $($rest)+);
        }
    };
}
pub(crate) use log_limited;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_period_passes_and_the_rest_are_counted() {
        let limit = RateLimit::new(Duration::from_millis(200));
        assert_eq!(limit.admit(), Some(0), "the first event passes");
        for _ in 0..5 {
            assert_eq!(limit.admit(), None);
        }
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(limit.admit(), Some(5), "the next pass says how many were held back");
        assert_eq!(limit.admit(), None);
    }

    #[test]
    fn many_threads_get_one_line_per_period() {
        static LIMIT: RateLimit = RateLimit::new(Duration::from_secs(60));
        let passes: Vec<u64> = std::thread::scope(|s| {
            let threads: Vec<_> =
                (0..4).map(|_| s.spawn(|| (0..1000).filter_map(|_| LIMIT.admit()).collect::<Vec<u64>>())).collect();
            threads.into_iter().flat_map(|t| t.join().unwrap()).collect()
        });
        assert_eq!(passes.len(), 1, "one line in the period");
        // Events held back while the first one passed may be reported with
        // it; none is lost.
        assert_eq!(passes[0] + LIMIT.suppressed.load(Ordering::Relaxed), 3999);
    }
}
