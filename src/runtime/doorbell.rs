//! The doorbell: how a parked lane is woken without ever losing a wake-up.
//!
//! A lane that found no work for its busy-poll window announces that it is
//! going to sleep, re-checks its rings, and only then parks. A submitter
//! publishes its entry, then checks whether the lane announced sleep and
//! unparks it if so. Both sides put a SeqCst fence between their store and
//! their load (the Dekker pattern), so at least one of them sees the other:
//! either the lane's re-check finds the entry, or the submitter sees the
//! flag and unparks. `unpark` before `park` is remembered by the thread's
//! park token, so the order of the two calls does not matter either.
//!
//! The lane also parks with a timeout, so even a broken invariant costs a
//! bounded delay, never a hang.
//!
//! A lane sleeps in its poller (`epoll_wait`), so that a socket it serves
//! wakes it as well as a submitter: the doorbell then rings the poller's
//! waker (an eventfd), which, like an unpark, is remembered by a wait that
//! has not started yet. The loom models check both forms: the poller's
//! waker is then a model of the eventfd (`crate::sync::poller`).

#[cfg(any(loom, test))]
use crate::sync::thread;
use crate::sync::{fence, AtomicBool, Ordering};
use std::time::Duration;

/// A lane's doorbell.
#[derive(Debug)]
pub struct Doorbell {
    sleeping: AtomicBool,
    wake: Wake,
}

/// How a parked lane is woken.
#[derive(Debug)]
enum Wake {
    /// It parked its thread (the loom models' form).
    #[cfg(any(loom, test))]
    Thread(thread::Thread),
    /// It waits in its poller, which this wakes (the production form).
    Poller(crate::sync::Waker),
}

impl Doorbell {
    /// A doorbell for the calling thread (the lane).
    #[cfg(any(loom, test))]
    pub fn for_current_thread() -> Self {
        Self::for_thread(thread::current())
    }

    /// A doorbell that wakes `lane`.
    #[cfg(any(loom, test))]
    pub fn for_thread(lane: thread::Thread) -> Self {
        Self { sleeping: AtomicBool::new(false), wake: Wake::Thread(lane) }
    }

    /// A doorbell for a lane that sleeps in the poller `waker` wakes.
    pub fn for_poller(waker: crate::sync::Waker) -> Self {
        Self { sleeping: AtomicBool::new(false), wake: Wake::Poller(waker) }
    }

    /// Lane side: park the thread unless `has_work` finds something after
    /// the announcement. Returns true when it actually parked.
    #[cfg(any(loom, test))]
    pub fn park(&self, timeout: Duration, has_work: impl FnOnce() -> bool) -> bool {
        self.park_with(timeout, has_work, thread::park_timeout)
    }

    /// Lane side: as [`park`](Self::park), sleeping with `sleep` (a wait in
    /// the lane's poller, which the doorbell's `ring` interrupts).
    pub fn park_with(&self, timeout: Duration, has_work: impl FnOnce() -> bool, sleep: impl FnOnce(Duration)) -> bool {
        self.sleeping.store(true, Ordering::Relaxed);
        // SeqCst fence pairs with the one in `ring`: our store of `sleeping`
        // and the submitter's store of the ring tail cannot both be missed.
        fence(Ordering::SeqCst);
        if has_work() {
            self.sleeping.store(false, Ordering::Relaxed);
            return false;
        }
        sleep(timeout);
        self.sleeping.store(false, Ordering::Relaxed);
        true
    }

    /// Submitter side, after publishing work: wake the lane if it sleeps.
    #[inline]
    pub fn ring(&self) {
        // SeqCst fence pairs with the one in `park` (see the module docs).
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) {
            match &self.wake {
                #[cfg(any(loom, test))]
                Wake::Thread(lane) => lane.unpark(),
                Wake::Poller(waker) => {
                    // It fails only if the eventfd cannot be written, and the
                    // lane's park times out anyway.
                    let _ = waker.wake();
                }
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool as StdAtomicBool;
    use std::sync::Arc;

    /// A lane asleep in its poller is woken by the doorbell, and a ring
    /// before the wait began is not lost: the next wait returns with the
    /// waker's event. (A wait that ended at its timeout has no event, so
    /// the event, not a clock, tells the two apart.)
    #[test]
    fn a_ring_wakes_a_lane_asleep_in_its_poller_and_is_never_lost() {
        let mut poll = mio::Poll::new().unwrap();
        let waker = mio::Waker::new(poll.registry(), mio::Token(7)).unwrap();
        let bell = Arc::new(Doorbell::for_poller(waker));
        let mut events = mio::Events::with_capacity(8);
        let ringer = {
            let bell = bell.clone();
            std::thread::spawn(move || {
                // Most often after the lane began to wait; either way the
                // wake must come through.
                std::thread::sleep(Duration::from_millis(50));
                bell.ring();
            })
        };
        let parked = bell.park_with(
            Duration::from_secs(10),
            || false,
            |t| {
                let _ = poll.poll(&mut events, Some(t));
            },
        );
        assert!(parked);
        assert!(events.iter().any(|e| e.token() == mio::Token(7)), "woken by the waker, not the timeout");
        ringer.join().unwrap();
        // The lane announces sleep, a submitter rings before the lane waits:
        // the wait still sees the waker's event.
        let remembered = bell.park_with(
            Duration::from_secs(10),
            || {
                bell.ring();
                false
            },
            |t| {
                let _ = poll.poll(&mut events, Some(t));
            },
        );
        assert!(remembered);
        assert!(events.iter().any(|e| e.token() == mio::Token(7)), "the early ring was remembered");
        // Work found after the announcement: no sleep at all.
        assert!(!bell.park_with(Duration::from_secs(10), || true, |_| panic!("must not sleep")));
    }

    /// The thread-park form unparks on a ring. (That no ring is ever lost
    /// is the loom models' to prove: a timed park cannot tell here.)
    #[test]
    fn a_ring_unparks_a_parked_thread() {
        let bell = Arc::new(Doorbell::for_current_thread());
        let rang = Arc::new(StdAtomicBool::new(false));
        let ringer = {
            let (bell, rang) = (bell.clone(), rang.clone());
            std::thread::spawn(move || {
                rang.store(true, std::sync::atomic::Ordering::Release);
                bell.ring();
            })
        };
        // A spurious return is allowed: park until the ring's work is seen.
        while !rang.load(std::sync::atomic::Ordering::Acquire) {
            bell.park(Duration::from_secs(10), || rang.load(std::sync::atomic::Ordering::Acquire));
        }
        ringer.join().unwrap();
        // Work found after the announcement: no park at all.
        assert!(!bell.park(Duration::from_secs(10), || true));
    }
}
