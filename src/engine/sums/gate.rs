//! The gate every sum for a peer enters: bounds on how many run at once
//! (in all and from one source address), and a close that waits for those
//! running.
//!
//! The promise: once [`Gate::close_and_wait`] returned, no sum is inside
//! the gate and none enters again, so none reads the memory the caller may
//! free once the engine is dropped; and in any interleaving at most
//! `total` sums are inside at once, at most `per_source` from one source.
//! Entering, leaving and closing all hold one lock; a leaving sum wakes
//! the close, which waits until none is left.
//!
//! The file uses only `crate::sync` (std's locks, loom's under
//! `cfg(loom)`), so `loom_tests/` compiles it unchanged
//! (`loom_tests/tests/sum_gate.rs`); the engine's bounds and errors are
//! `super`'s.

use crate::sync::{Condvar, Mutex, MutexGuard};
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::PoisonError;

/// Why a sum was not let in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The gate is closed: the engine stops.
    Closed,
    /// `total` sums run already.
    Total,
    /// `per_source` sums from this source run already.
    Source,
}

/// Sums running at once, in all and from one source address.
#[derive(Debug)]
pub struct Gate {
    total: usize,
    per_source: usize,
    state: Mutex<State>,
    ended: Condvar,
}

#[derive(Debug, Default)]
struct State {
    closed: bool,
    running: usize,
    by_source: HashMap<Option<IpAddr>, usize>,
}

/// One sum in progress; it leaves the gate when dropped.
#[derive(Debug)]
pub struct Running<'a> {
    gate: &'a Gate,
    source: Option<IpAddr>,
}

impl Gate {
    /// An open gate letting in at most `total` sums at once, at most
    /// `per_source` of them from one source.
    pub fn new(total: usize, per_source: usize) -> Self {
        Self { total, per_source, state: Mutex::default(), ended: Condvar::default() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets a sum for `source` start, or says why not.
    pub fn enter(&self, source: Option<IpAddr>) -> Result<Running<'_>, Refused> {
        let mut state = self.lock();
        if state.closed {
            return Err(Refused::Closed);
        }
        let from_source = state.by_source.get(&source).copied().unwrap_or(0);
        if state.running >= self.total {
            return Err(Refused::Total);
        }
        if from_source >= self.per_source {
            return Err(Refused::Source);
        }
        state.running += 1;
        *state.by_source.entry(source).or_default() += 1;
        Ok(Running { gate: self, source })
    }

    /// Lets no sum start from now on, and waits for those running to end.
    pub fn close_and_wait(&self) {
        let mut state = self.lock();
        state.closed = true;
        while state.running > 0 {
            state = self.ended.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Whether the gate was closed (its close may still be waiting).
    #[cfg(any(test, loom))]
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut state = self.gate.lock();
        state.running -= 1;
        if let Some(count) = state.by_source.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                state.by_source.remove(&self.source);
            }
        }
        drop(state);
        self.gate.ended.notify_all();
    }
}
