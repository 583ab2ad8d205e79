//! The synchronisation facade: std atomics and locks normally, loom's under
//! `cfg(loom)`.
//!
//! Every lock-free structure in kvring (`ring::spsc`, `runtime::status`,
//! `runtime::doorbell`) imports its atomics from here and nowhere else, and so
//! does every lock that decides when memory may still be read (the rdma
//! verifier's gate, the engine's sum gate), so the loom models in
//! `loom_tests/` can compile the very same source files against loom's checked
//! primitives (the pattern tokio and crossbeam use).

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;
/// loom's locks return std's `LockResult`, so `PoisonError::into_inner`
/// reads the same under both.
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex, MutexGuard};

/// An `UnsafeCell` with loom's closure-based access API, so the ring's code
/// reads the same under both configurations.
#[cfg(not(loom))]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    pub(crate) const fn new(value: T) -> Self {
        Self(std::cell::UnsafeCell::new(value))
    }

    #[inline(always)]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

#[cfg(loom)]
pub(crate) use loom::cell::UnsafeCell;

/// Thread parking: `std::thread` normally, loom's under `cfg(loom)` (lanes
/// sleep in their pollers; the doorbell's loom models and tests park
/// threads).
#[cfg(any(loom, test))]
pub(crate) mod thread {
    #[cfg(not(loom))]
    pub(crate) use std::thread::{current, park_timeout, Thread};

    #[cfg(loom)]
    pub(crate) use loom::thread::{current, Thread};

    /// loom has no timed park; a spurious return is allowed by both, so the
    /// model treats the timed form as a plain park.
    #[cfg(loom)]
    pub(crate) fn park_timeout(_dur: std::time::Duration) {
        loom::thread::park();
    }
}

/// The waker of a lane's poller: mio's (an eventfd on Linux) normally; under
/// `cfg(loom)` a model of it, so the doorbell's loom model runs the
/// production `Wake::Poller` form.
#[cfg(not(loom))]
pub(crate) use mio::Waker;

#[cfg(loom)]
pub(crate) use poller::Waker;

/// A model of a lane's poller and its waker, for loom. What it keeps of
/// mio's `Waker` (an eventfd registered with epoll: eventfd(2), epoll(7))
/// is what the doorbell relies on: `wake` adds to a counter that stays set
/// until a wait consumes it, so a wake made before the wait began is not
/// lost, and a wait returns once the counter is set. A timed wait is
/// modelled as an untimed one (a timeout only hides a lost wake-up, which
/// the model must see as a deadlock).
#[cfg(loom)]
pub mod poller {
    use loom::sync::{Arc, Condvar, Mutex};

    #[derive(Debug, Default)]
    struct Counter {
        value: Mutex<u64>,
        changed: Condvar,
    }

    /// The lane's side: where it sleeps.
    #[derive(Debug)]
    pub struct Poller(Arc<Counter>);

    /// The doorbell's side: what wakes the poller.
    #[derive(Debug)]
    pub struct Waker(Arc<Counter>);

    /// A poller and its waker.
    pub fn pair() -> (Poller, Waker) {
        let counter = Arc::new(Counter::default());
        (Poller(counter.clone()), Waker(counter))
    }

    impl Waker {
        /// eventfd write(2) of 1: the counter goes up and a waiter wakes.
        pub fn wake(&self) -> std::io::Result<()> {
            *self.0.value.lock().unwrap() += 1;
            self.0.changed.notify_all();
            Ok(())
        }
    }

    impl Poller {
        /// epoll_wait(2) until the eventfd is readable, then its read(2):
        /// the counter back to zero. Returns what was read.
        pub fn wait(&self, _timeout: std::time::Duration) -> u64 {
            let mut value = self.0.value.lock().unwrap();
            while *value == 0 {
                value = self.0.changed.wait(value).unwrap();
            }
            std::mem::take(&mut *value)
        }

        /// Wakes not yet consumed by a wait.
        pub fn pending(&self) -> u64 {
            *self.0.value.lock().unwrap()
        }
    }
}
