//! A bounded, lock-free, single-producer single-consumer ring.
//!
//! The shape follows rtrb: two halves that are `Send` but neither `Sync` nor
//! `Clone`, so a second producer or consumer cannot compile; every method that
//! moves an index takes `&mut self`. Positions are free-running counters
//! (wrapping `usize`) masked into a power-of-two buffer, so "full" and "empty"
//! never need a spare slot.
//!
//! Each half caches the other half's position and reloads the shared atomic
//! only when the ring *looks* full (producer) or empty (consumer), so a
//! steady stream costs one shared load per wrap, not per entry. A chunk of
//! entries is published with a single `Release` store.
//!
//! This file depends only on `crate::sync` (std or loom), so the loom models
//! in `loom_tests/` compile it unchanged.

use crate::sync::{Arc, AtomicUsize, Ordering, UnsafeCell};
use crossbeam_utils::CachePadded;
use std::fmt;
use std::mem::MaybeUninit;

/// The shared part of a ring: two positions on their own cache lines, and
/// the slots.
struct Shared<T> {
    /// Next position the consumer will read. Stored only by the consumer.
    head: CachePadded<AtomicUsize>,
    /// Next position the producer will write. Stored only by the producer.
    tail: CachePadded<AtomicUsize>,
    slots: Box<[UnsafeCell<MaybeUninit<T>>]>,
    mask: usize,
}

impl<T> Shared<T> {
    #[inline(always)]
    fn capacity(&self) -> usize {
        self.mask + 1
    }

    #[inline(always)]
    fn slot(&self, position: usize) -> &UnsafeCell<MaybeUninit<T>> {
        // SAFETY: `slots.len()` is `mask + 1`, a power of two, so
        // `position & mask` is always a valid index.
        unsafe { self.slots.get_unchecked(position & self.mask) }
    }

    #[inline(always)]
    fn publish_tail(&self, tail: usize) {
        // Release pairs with the consumer's Acquire load of `tail`: the slot
        // writes before this happen before the consumer reads them.
        self.tail.store(tail, Ordering::Release);
    }

    #[inline(always)]
    fn publish_head(&self, head: usize) {
        // Release pairs with the producer's Acquire load of `head`: our
        // reads of the released slots happen before it overwrites them.
        self.head.store(head, Ordering::Release);
    }
}

impl<T> Drop for Shared<T> {
    fn drop(&mut self) {
        // Both halves are gone (this is the last `Arc`), so no other thread
        // touches the positions; entries in [head, tail) are initialised and
        // still owned by the ring.
        let mut head = self.head.load(Ordering::Relaxed);
        let tail = self.tail.load(Ordering::Relaxed);
        while head != tail {
            self.slot(head).with_mut(|slot| {
                // SAFETY: positions in [head, tail) were written by the
                // producer and not yet read by the consumer, so each holds an
                // initialised value that nobody else will drop.
                unsafe { (*slot).assume_init_drop() }
            });
            head = head.wrapping_add(1);
        }
    }
}

/// Creates a ring holding at least `capacity` entries (rounded up to a power
/// of two, at least 1) and returns its two halves.
///
/// ```
/// let (mut tx, mut rx) = kvring::testing::ring::channel::<u32>(4);
/// tx.push(7).unwrap();
/// assert_eq!(rx.pop(), Some(7));
/// ```
pub fn channel<T>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    let capacity = capacity.max(1).next_power_of_two();
    let slots = (0..capacity).map(|_| UnsafeCell::new(MaybeUninit::uninit())).collect::<Vec<_>>().into_boxed_slice();
    let shared = Arc::new(Shared {
        head: CachePadded::new(AtomicUsize::new(0)),
        tail: CachePadded::new(AtomicUsize::new(0)),
        slots,
        mask: capacity - 1,
    });
    (Producer { shared: shared.clone(), tail: 0, cached_head: 0 }, Consumer { shared, head: 0, cached_tail: 0 })
}

/// The error of a push into a full ring: the entry is handed back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Full<T>(pub T);

impl<T> fmt::Display for Full<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ring is full")
    }
}

/// Not enough free slots for a chunk of the requested size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooFewSlots {
    /// Slots the caller asked for.
    pub requested: usize,
    /// Slots free right now.
    pub available: usize,
}

/// The writing half of a ring. `Send`, not `Sync`, not `Clone`.
///
/// Aligned to 128 bytes (two cache lines, as crossbeam's `CachePadded` on
/// x86_64), so its positions never share a line with the consumer's, or
/// with anything else its owner keeps next to it.
#[repr(align(128))]
pub struct Producer<T> {
    shared: Arc<Shared<T>>,
    /// Our own copy of `shared.tail` (only we store it).
    tail: usize,
    /// The consumer's position as last seen; the ring may have more room.
    cached_head: usize,
}

// SAFETY: the producer only writes slots the consumer has released (checked
// through `head` with Acquire), so moving it to another thread moves sole
// write access to those slots along with it; `T: Send` lets the values cross.
unsafe impl<T: Send> Send for Producer<T> {}

impl<T> fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer").field("capacity", &self.capacity()).field("tail", &self.tail).finish()
    }
}

impl<T> Producer<T> {
    /// Capacity of the ring in entries.
    pub fn capacity(&self) -> usize {
        self.shared.capacity()
    }

    /// Free slots, reloading the consumer's position only when the cached
    /// one shows fewer than `wanted`.
    #[inline]
    fn free_slots(&mut self, wanted: usize) -> usize {
        let capacity = self.shared.capacity();
        let mut free = capacity - self.tail.wrapping_sub(self.cached_head);
        if free < wanted {
            // Acquire pairs with the consumer's Release store of `head`: its
            // reads of the released slots happen before we overwrite them.
            self.cached_head = self.shared.head.load(Ordering::Acquire);
            free = capacity - self.tail.wrapping_sub(self.cached_head);
        }
        free
    }

    /// Free slots right now (reloads the consumer's position).
    #[cfg(test)]
    pub fn slots(&mut self) -> usize {
        self.free_slots(usize::MAX)
    }

    /// True when `n` entries fit; reloads the consumer's position only when
    /// the cached one says they may not.
    #[inline]
    pub fn has_room(&mut self, n: usize) -> bool {
        self.free_slots(n) >= n
    }

    /// Pushes one entry, or hands it back when the ring is full.
    ///
    /// ```
    /// use kvring::testing::ring::{channel, Full};
    /// let (mut tx, _rx) = channel::<u8>(1);
    /// tx.push(1).unwrap();
    /// assert_eq!(tx.push(2), Err(Full(2)));
    /// ```
    #[inline]
    pub fn push(&mut self, value: T) -> Result<(), Full<T>> {
        if self.free_slots(1) == 0 {
            return Err(Full(value));
        }
        self.shared.slot(self.tail).with_mut(|slot| {
            // SAFETY: the slot at `tail` is free (checked above) and only the
            // producer writes free slots.
            unsafe { (*slot).write(value) };
        });
        self.publish(1);
        Ok(())
    }

    /// Reserves `n` slots for writing; entries become visible to the
    /// consumer only when the chunk is committed, all with one store.
    ///
    /// ```
    /// let (mut tx, mut rx) = kvring::testing::ring::channel::<u32>(8);
    /// let mut chunk = tx.write_chunk(3).unwrap();
    /// for v in 0..3 { chunk.push(v).unwrap(); }
    /// chunk.commit();
    /// assert_eq!(rx.read_chunk(8).collect::<Vec<_>>(), vec![0, 1, 2]);
    /// ```
    pub fn write_chunk(&mut self, n: usize) -> Result<WriteChunk<'_, T>, TooFewSlots> {
        let available = self.free_slots(n);
        if available < n {
            return Err(TooFewSlots { requested: n, available });
        }
        // Borrow the shared part and our position apart, so the chunk
        // holds a plain reference to the slots instead of re-reading them
        // through the `Arc` for every entry.
        let Producer { shared, tail, .. } = self;
        Ok(WriteChunk { slots: &shared.slots, mask: shared.mask, shared, tail, limit: n, written: 0 })
    }

    #[inline(always)]
    fn publish(&mut self, n: usize) {
        self.tail = self.tail.wrapping_add(n);
        self.shared.publish_tail(self.tail);
    }
}

/// Slots reserved by [`Producer::write_chunk`]. Dropping it without
/// [`commit`](WriteChunk::commit) publishes nothing and drops what was written.
pub struct WriteChunk<'a, T> {
    /// The slots and mask, copied out so the per-entry path keeps them in
    /// registers (a slot write could otherwise alias `Shared`'s fields).
    slots: &'a [UnsafeCell<MaybeUninit<T>>],
    mask: usize,
    shared: &'a Shared<T>,
    /// The producer's own tail, advanced on commit.
    tail: &'a mut usize,
    limit: usize,
    written: usize,
}

impl<T> fmt::Debug for WriteChunk<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriteChunk").field("limit", &self.limit).field("written", &self.written).finish()
    }
}

impl<T> WriteChunk<'_, T> {
    /// Writes the next entry of the chunk; hands it back if the chunk is full.
    #[inline]
    pub fn push(&mut self, value: T) -> Result<(), Full<T>> {
        if self.written == self.limit {
            return Err(Full(value));
        }
        let index = self.tail.wrapping_add(self.written) & self.mask;
        // SAFETY: `index` is masked into the slots, whose length is mask + 1.
        let slot = unsafe { self.slots.get_unchecked(index) };
        slot.with_mut(|slot| {
            // SAFETY: the slot lies inside the reserved free range
            // [tail, tail + limit), which only this chunk writes.
            unsafe { (*slot).write(value) };
        });
        self.written += 1;
        Ok(())
    }

    /// Publishes every entry written, with one Release store.
    pub fn commit(mut self) {
        let n = std::mem::take(&mut self.written);
        *self.tail = self.tail.wrapping_add(n);
        self.shared.publish_tail(*self.tail);
    }
}

impl<T> Drop for WriteChunk<'_, T> {
    fn drop(&mut self) {
        for i in 0..self.written {
            let position = self.tail.wrapping_add(i);
            self.shared.slot(position).with_mut(|slot| {
                // SAFETY: entries [tail, tail + written) were written by this
                // chunk and never published, so we still own them.
                unsafe { (*slot).assume_init_drop() }
            });
        }
    }
}

/// The reading half of a ring. `Send`, not `Sync`, not `Clone`.
/// Aligned like [`Producer`], for the same reason.
#[repr(align(128))]
pub struct Consumer<T> {
    shared: Arc<Shared<T>>,
    /// Our own copy of `shared.head` (only we store it).
    head: usize,
    /// The producer's position as last seen; there may be more entries.
    cached_tail: usize,
}

// SAFETY: the consumer only reads slots the producer has published (checked
// through `tail` with Acquire); moving it moves sole read access with it.
unsafe impl<T: Send> Send for Consumer<T> {}

impl<T> fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer").field("capacity", &self.shared.capacity()).field("head", &self.head).finish()
    }
}

impl<T> Consumer<T> {
    /// Capacity of the ring in entries.
    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.shared.capacity()
    }

    #[inline]
    fn available(&mut self, wanted: usize) -> usize {
        let mut available = self.cached_tail.wrapping_sub(self.head);
        if available < wanted {
            // Acquire pairs with the producer's Release store of `tail`.
            self.cached_tail = self.shared.tail.load(Ordering::Acquire);
            available = self.cached_tail.wrapping_sub(self.head);
        }
        available
    }

    /// Entries consumed since the ring was made (wrapping): the position
    /// of the next entry to read, in the producer's count.
    pub fn position(&self) -> usize {
        self.head
    }

    /// Entries ready to read (reloads the producer's position).
    pub fn slots(&mut self) -> usize {
        self.available(usize::MAX)
    }

    /// True when the ring holds nothing right now.
    pub fn is_empty(&mut self) -> bool {
        self.available(1) == 0
    }

    /// Pops one entry.
    #[inline]
    pub fn pop(&mut self) -> Option<T> {
        if self.available(1) == 0 {
            return None;
        }
        let value = self.shared.slot(self.head).with(|slot| {
            // SAFETY: `head` < `tail` as published with Release, so the slot
            // is initialised, and only the consumer reads it.
            unsafe { (*slot).assume_init_read() }
        });
        self.release(1);
        Some(value)
    }

    /// Takes up to `max` entries as an iterator; the slots it yielded are
    /// released with one store when it is dropped.
    pub fn read_chunk(&mut self, max: usize) -> ReadChunk<'_, T> {
        let limit = self.available(max).min(max);
        let Consumer { shared, head, .. } = self;
        ReadChunk { slots: &shared.slots, mask: shared.mask, shared, head, limit, read: 0 }
    }

    #[inline(always)]
    fn release(&mut self, n: usize) {
        self.head = self.head.wrapping_add(n);
        self.shared.publish_head(self.head);
    }
}

/// Entries taken by [`Consumer::read_chunk`], yielded by value. The slots of
/// the entries yielded are released together when the chunk is dropped;
/// entries not yet yielded stay in the ring.
pub struct ReadChunk<'a, T> {
    /// Copied out of `Shared`, as in [`WriteChunk`].
    slots: &'a [UnsafeCell<MaybeUninit<T>>],
    mask: usize,
    shared: &'a Shared<T>,
    /// The consumer's own head, advanced on drop.
    head: &'a mut usize,
    limit: usize,
    read: usize,
}

impl<T> fmt::Debug for ReadChunk<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadChunk").field("limit", &self.limit).field("read", &self.read).finish()
    }
}

impl<T> ReadChunk<'_, T> {
    /// Entries left to yield.
    pub fn len(&self) -> usize {
        self.limit - self.read
    }
}

impl<T> Iterator for ReadChunk<'_, T> {
    type Item = T;

    #[inline]
    fn next(&mut self) -> Option<T> {
        if self.read == self.limit {
            return None;
        }
        let index = self.head.wrapping_add(self.read) & self.mask;
        // SAFETY: `index` is masked into the slots, whose length is mask + 1.
        let slot = unsafe { self.slots.get_unchecked(index) };
        let value = slot.with(|slot| {
            // SAFETY: `position` < `tail` as seen with Acquire when the chunk
            // was made, so the slot is initialised; it is read exactly once
            // because `read` only grows and is released on drop.
            unsafe { (*slot).assume_init_read() }
        });
        self.read += 1;
        Some(value)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.len(), Some(self.len()))
    }
}

impl<T> ExactSizeIterator for ReadChunk<'_, T> {}

impl<T> Drop for ReadChunk<'_, T> {
    fn drop(&mut self) {
        if self.read > 0 {
            *self.head = self.head.wrapping_add(self.read);
            self.shared.publish_head(*self.head);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize as StdAtomicUsize;

    #[test]
    fn capacity_rounds_up_to_a_power_of_two() {
        assert_eq!(channel::<u8>(0).0.capacity(), 1);
        assert_eq!(channel::<u8>(3).0.capacity(), 4);
        assert_eq!(channel::<u8>(64).1.capacity(), 64);
    }

    #[test]
    fn full_ring_hands_the_entry_back() {
        let (mut tx, mut rx) = channel::<u32>(2);
        tx.push(1).unwrap();
        tx.push(2).unwrap();
        assert_eq!(tx.push(3), Err(Full(3)));
        assert_eq!(rx.pop(), Some(1));
        tx.push(3).unwrap();
        assert_eq!(rx.pop(), Some(2));
        assert_eq!(rx.pop(), Some(3));
        assert_eq!(rx.pop(), None);
    }

    #[test]
    fn write_chunk_refuses_more_than_is_free() {
        let (mut tx, _rx) = channel::<u32>(4);
        tx.push(0).unwrap();
        let err = tx.write_chunk(4).unwrap_err();
        assert_eq!(err, TooFewSlots { requested: 4, available: 3 });
        let mut chunk = tx.write_chunk(3).unwrap();
        for v in 0..3 {
            chunk.push(v).unwrap();
        }
        assert_eq!(chunk.push(9), Err(Full(9)));
    }

    #[test]
    fn uncommitted_chunk_publishes_nothing_and_drops_its_entries() {
        let drops = Arc::new(StdAtomicUsize::new(0));
        struct Counted(Arc<StdAtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let (mut tx, mut rx) = channel::<Counted>(4);
        {
            let mut chunk = tx.write_chunk(2).unwrap();
            assert!(chunk.push(Counted(drops.clone())).is_ok());
            assert!(chunk.push(Counted(drops.clone())).is_ok());
        }
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        assert!(rx.pop().is_none());
        assert!(tx.push(Counted(drops.clone())).is_ok());
        drop(tx);
        drop(rx);
        assert_eq!(drops.load(Ordering::SeqCst), 3, "ring drop frees the entry inside");
    }

    #[test]
    fn partially_read_chunk_releases_only_what_it_yielded() {
        let (mut tx, mut rx) = channel::<u32>(8);
        for v in 0..6 {
            tx.push(v).unwrap();
        }
        {
            let mut chunk = rx.read_chunk(4);
            assert_eq!(chunk.len(), 4);
            assert_eq!(chunk.next(), Some(0));
            assert_eq!(chunk.next(), Some(1));
        }
        assert_eq!(rx.read_chunk(10).collect::<Vec<_>>(), vec![2, 3, 4, 5]);
        assert_eq!(tx.slots(), 8);
    }

    /// Conservation with real threads: every entry arrives exactly once and
    /// in order, through wrap-around, single pushes and chunks.
    #[test]
    fn every_entry_arrives_exactly_once_in_order() {
        // Fewer under Miri, which interprets every step.
        const COUNT: u64 = if cfg!(miri) { 2_000 } else { 1_000_000 };
        let (mut tx, mut rx) = channel::<u64>(64);
        let producer = std::thread::spawn(move || {
            let mut next = 0u64;
            while next < COUNT {
                if next.is_multiple_of(3) {
                    let want = ((COUNT - next) as usize).min(7);
                    if let Ok(mut chunk) = tx.write_chunk(want) {
                        for _ in 0..want {
                            chunk.push(next).unwrap();
                            next += 1;
                        }
                        chunk.commit();
                        continue;
                    }
                }
                if tx.push(next).is_ok() {
                    next += 1;
                } else {
                    std::hint::spin_loop();
                }
            }
        });
        let mut expected = 0u64;
        let mut sum = 0u64;
        let started = std::time::Instant::now();
        while expected < COUNT {
            // A hang guard (a lost entry would spin here for ever), not a
            // speed check; Miri's interpreted steps have no such clock.
            assert!(cfg!(miri) || started.elapsed().as_secs() < 60, "consumer starved");
            for v in rx.read_chunk(16) {
                assert_eq!(v, expected);
                sum = sum.wrapping_add(v);
                expected += 1;
            }
        }
        producer.join().unwrap();
        assert_eq!(sum, COUNT * (COUNT - 1) / 2);
        assert!(rx.pop().is_none());
    }

    fn assert_send<T: Send>() {}

    #[test]
    fn halves_are_send() {
        assert_send::<Producer<u64>>();
        assert_send::<Consumer<u64>>();
    }
}
