//! Engine handles lent out of a `PyEngine`'s lock, for calls that wait on
//! a peer (an open, an arrival) without holding other calls up. `close`
//! waits for every one to come back before it drops the engine: a handle
//! still out would keep the engine serving peers after `close` returned
//! and the binding released the buffers it held, so a peer's write would
//! land in memory its owner took back (hostile review 3, finding 1).

use crate::Engine;
use std::sync::{Condvar, Mutex, MutexGuard};

/// How many handles are out, and the wake-up of the one waiting for none.
#[derive(Debug, Default)]
pub(super) struct Lent {
    count: Mutex<usize>,
    back: Condvar,
}

impl Lent {
    fn count(&self) -> MutexGuard<'_, usize> {
        self.count.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lends a handle of `engine`. Called with the engine's lock held and
    /// the engine open, so a `close` that takes the engine after it sees
    /// this handle counted.
    pub(super) fn lend(&self, engine: &Engine) -> LentEngine<'_> {
        *self.count() += 1;
        LentEngine { engine: Some(engine.clone()), lent: self }
    }

    /// Waits until every lent handle is back. Each is held by one call
    /// that ends by its own deadline (the caller's timeout), and no handle
    /// is lent once `close` took the engine: the wait ends by the latest
    /// of those deadlines.
    pub(super) fn wait_all_back(&self) {
        let mut count = self.count();
        while *count > 0 {
            count = self.back.wait(count).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// A lent engine handle; given back (dropped first, then counted back)
/// when it goes out of scope.
#[derive(Debug)]
pub(super) struct LentEngine<'a> {
    engine: Option<Engine>,
    lent: &'a Lent,
}

impl std::ops::Deref for LentEngine<'_> {
    type Target = Engine;

    fn deref(&self) -> &Engine {
        self.engine.as_ref().expect("held until dropped")
    }
}

impl Drop for LentEngine<'_> {
    fn drop(&mut self) {
        // The handle goes before the count does: once `close` sees none
        // out, its own drop is the engine's last.
        drop(self.engine.take());
        let mut count = self.lent.count();
        *count -= 1;
        if *count == 0 {
            self.lent.back.notify_all();
        }
    }
}
