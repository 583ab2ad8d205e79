//! Handles to raw pointers without a lock on the lookup: a fixed array of
//! slots, each an atomic pointer and a generation. Lanes turn QP, CQ and
//! SRQ handles into pointers on every post and poll, and registering
//! memory or connecting a peer must not stop them (review finding 3), so a
//! lookup is two atomic loads. A handle carries its slot's generation, so
//! a destroyed (or never issued) handle is refused rather than followed.

use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};
use std::sync::Mutex;

/// A table of at most `capacity` live pointers.
pub(super) struct Slots<T> {
    ptrs: Box<[AtomicPtr<T>]>,
    gens: Box<[AtomicU32]>,
    /// Free slot indices; taken only when creating or destroying.
    free: Mutex<Vec<u32>>,
}

impl<T> std::fmt::Debug for Slots<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slots").field("capacity", &self.ptrs.len()).finish_non_exhaustive()
    }
}

impl<T> Slots<T> {
    /// `capacity` empty slots.
    pub(super) fn new(capacity: u32) -> Self {
        Self {
            ptrs: (0..capacity).map(|_| AtomicPtr::new(std::ptr::null_mut())).collect(),
            gens: (0..capacity).map(|_| AtomicU32::new(0)).collect(),
            free: Mutex::new((0..capacity).rev().collect()),
        }
    }

    /// Keeps `ptr`; `None` when every slot is in use.
    pub(super) fn insert(&self, ptr: *mut T) -> Option<u64> {
        let index = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop()?;
        let slot = index as usize;
        // Odd generations are live; the Release store pairs with the Acquire
        // load in `get`, so a reader that sees this generation sees `ptr`.
        self.ptrs[slot].store(ptr, Ordering::Relaxed);
        let generation = self.gens[slot].load(Ordering::Relaxed).wrapping_add(1);
        self.gens[slot].store(generation, Ordering::Release);
        Some(u64::from(generation) << 32 | u64::from(index))
    }

    /// The pointer behind a live handle.
    pub(super) fn get(&self, handle: u64) -> Option<*mut T> {
        let slot = (handle as u32) as usize;
        let generation = (handle >> 32) as u32;
        // Acquire pairs with the Release in `insert`.
        let live = self.gens.get(slot)?.load(Ordering::Acquire);
        (generation & 1 == 1 && live == generation).then(|| self.ptrs[slot].load(Ordering::Relaxed))
    }

    /// Forgets a live handle; returns its pointer once.
    pub(super) fn remove(&self, handle: u64) -> Option<*mut T> {
        let slot = (handle as u32) as usize;
        let generation = (handle >> 32) as u32;
        let gens = self.gens.get(slot)?;
        // The generation moves to even (dead) exactly once per handle.
        gens.compare_exchange(generation, generation.wrapping_add(1), Ordering::AcqRel, Ordering::Relaxed)
            .ok()
            .filter(|g| g & 1 == 1)?;
        let ptr = self.ptrs[slot].swap(std::ptr::null_mut(), Ordering::Relaxed);
        self.free.lock().unwrap_or_else(|p| p.into_inner()).push(slot as u32);
        Some(ptr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_and_forged_handles_are_refused_and_slots_are_reused() {
        let slots: Slots<u8> = Slots::new(2);
        let mut a = 1u8;
        let mut b = 2u8;
        let ha = slots.insert(&mut a).unwrap();
        let hb = slots.insert(&mut b).unwrap();
        assert!(slots.insert(&mut a).is_none(), "full");
        assert_eq!(slots.get(ha), Some(&mut a as *mut u8));
        assert_eq!(slots.remove(ha), Some(&mut a as *mut u8));
        assert_eq!(slots.get(ha), None, "stale");
        assert_eq!(slots.remove(ha), None, "removed once");
        let hc = slots.insert(&mut b).unwrap();
        assert_ne!(hc, ha, "a reused slot has a new generation");
        assert_eq!(slots.get(hb), Some(&mut b as *mut u8));
        assert_eq!(slots.get(0), None, "generation 0 was never issued");
        assert_eq!(slots.get(u64::MAX), None);
    }
}
