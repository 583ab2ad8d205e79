//! The synchronisation facade: std atomics normally, loom's under `cfg(loom)`.
//!
//! Every lock-free structure in kvring (`ring::spsc`, `runtime::status`,
//! `runtime::doorbell`) imports its atomics from here and nowhere else, so the
//! loom models in `loom_tests/` can compile the very same source files against
//! loom's checked primitives (the pattern tokio and crossbeam use).

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;

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
