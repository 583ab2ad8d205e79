//! An admitted connection's idleness, kept without a lock by the lane that
//! serves it and claimed by the admission book (`net::admission`) when a
//! newcomer needs its place. Its own file so the loom model
//! (`loom_tests/tests/idle_cell.rs`) compiles it unchanged.

use crate::sync::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// An admitted connection's idleness, kept by the lane that serves it with
/// no lock: busy, idle since a tick, or evicted. The book takes an idle
/// connection's place only by swapping the very tick it saw for `EVICTED`,
/// and the lane marks it busy by swapping that tick for `BUSY` before it
/// reads a byte, so exactly one of them wins: a connection whose lane saw
/// bytes is never evicted, and one that was evicted serves nothing more.
/// A single word's compare-and-swaps order the two sides; nothing else is
/// published through it, so `AcqRel` is more than enough.
#[derive(Debug)]
pub struct IdleCell(AtomicU64);

impl Default for IdleCell {
    /// Busy: a connection is not evictable until its lane says so.
    fn default() -> Self {
        Self(AtomicU64::new(Self::BUSY))
    }
}

impl IdleCell {
    const BUSY: u64 = 0;
    const EVICTED: u64 = u64::MAX;

    /// The connection finished what it was doing at `now`. False once it
    /// was evicted (its lane is told to close it).
    pub fn idle(&self, now: Instant) -> bool {
        self.0.compare_exchange(Self::BUSY, ticks(now), Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Bytes arrived: the connection is not to be evicted from now on.
    /// False once it was evicted: the caller closes it and serves nothing.
    pub fn busy(&self) -> bool {
        let mut seen = self.0.load(Ordering::Acquire);
        loop {
            match seen {
                Self::EVICTED => return false,
                Self::BUSY => return true,
                idle => match self.0.compare_exchange(idle, Self::BUSY, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return true,
                    Err(now) => seen = now,
                },
            }
        }
    }

    /// The tick it went idle at, if it is idle.
    pub fn idle_since(&self) -> Option<u64> {
        Some(self.0.load(Ordering::Acquire)).filter(|&t| t != Self::BUSY && t != Self::EVICTED)
    }

    /// Takes its place if it is still idle since `since`.
    pub fn claim(&self, since: u64) -> bool {
        self.0.compare_exchange(since, Self::EVICTED, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
}

/// The instant ticks count from: set by the first book made, before any
/// of its connections arrived, so no idle instant a book compares is
/// earlier.
pub(crate) fn base() -> Instant {
    static BASE: OnceLock<Instant> = OnceLock::new();
    *BASE.get_or_init(Instant::now)
}

/// `at` as a tick (nanoseconds since `base()`, plus one),
/// never `IdleCell::BUSY` nor `IdleCell::EVICTED`.
pub(crate) fn ticks(at: Instant) -> u64 {
    let nanos = u64::try_from(at.saturating_duration_since(base()).as_nanos()).unwrap_or(u64::MAX);
    nanos.saturating_add(1).min(IdleCell::EVICTED - 1)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The book takes a place only by swapping the very tick it saw: a
    /// connection that went busy, even idle again since, is not taken.
    #[test]
    fn a_claim_loses_to_a_connection_that_went_busy_since_it_was_seen() {
        let cell = IdleCell::default();
        let t0 = Instant::now();
        assert_eq!(cell.idle_since(), None, "busy at first");
        assert!(cell.idle(t0));
        let seen = cell.idle_since().expect("idle");
        assert!(cell.busy());
        assert!(!cell.claim(seen), "busy since it was seen");
        assert!(cell.idle(t0 + Duration::from_secs(1)));
        assert!(!cell.claim(seen), "idle again, but not since the tick seen");
        let now = cell.idle_since().unwrap();
        assert!(now > seen);
        assert!(cell.claim(now));
        assert!(!cell.busy() && !cell.idle(t0) && cell.idle_since().is_none());
    }
}
