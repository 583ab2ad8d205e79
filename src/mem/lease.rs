//! One registry slot's lease protocol: the atomic state word that decides
//! when a region's entry may be read, and when it may be rewritten (the
//! region's memory handed back to its owner).
//!
//! State word: `generation << 32 | live << 31 | reading << 30 | leases`
//! (a 32-bit generation, so ids do not wrap within any plausible life).
//!
//! - [`publish`](Slot::publish) writes the entry, then makes the slot live
//!   (Release);
//! - [`lease`](Slot::lease) adds one while the slot is live under the
//!   caller's generation and nobody reads it exclusively (Acquire: the entry
//!   is visible to the holder); [`release`](Slot::release) takes it back
//!   (Release: the holder's reads happen before any rewrite);
//! - [`read_alone`](Slot::read_alone) takes the slot for a reader that must
//!   not race with this engine's batches (the control server's checksum):
//!   only from live and idle, and no lease is granted until it ends;
//! - [`unpublish`](Slot::unpublish) swaps live-and-idle for not-live under
//!   the next generation in one compare-and-swap (AcqRel), so exactly one
//!   caller wins, and only the winner takes the entry. A generation is
//!   never issued twice: the slot whose generation is spent is retired.
//!
//! The file uses only `crate::sync`, so `loom_tests/` compiles it unchanged
//! and models every interleaving of leases, exclusive reads and racing
//! unpublishes (docs/ARCHITECTURE.md, "Protocols under loom").

use crate::sync::{AtomicU64, Ordering, UnsafeCell};

const LIVE: u64 = 1 << 31;
const READING: u64 = 1 << 30;
/// The lease count's bits: at most this many leases at once.
pub const LEASE_MASK: u64 = READING - 1;
const GENERATION_SHIFT: u32 = 32;

fn generation_of(state: u64) -> u32 {
    (state >> GENERATION_SHIFT) as u32
}

/// Why a slot refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not live under this generation (never published, unpublished, or
    /// published again under a later generation).
    Gone,
    /// Live, but held: `leases` batches, and/or an exclusive reader.
    Held {
        /// Leases held.
        leases: u64,
        /// An exclusive reader holds it.
        reading: bool,
    },
    /// The lease count is at its limit.
    Full,
}

/// What [`Slot::unpublish`] hands back to its one winner.
#[derive(Debug)]
pub struct Unpublished<T> {
    /// The entry, taken out of the slot.
    pub entry: T,
    /// The slot's generations are spent: it must never be published again.
    pub retired: bool,
}

/// One slot: its state word and the entry it guards.
#[derive(Debug)]
pub struct Slot<T> {
    state: AtomicU64,
    /// Written only while the slot is neither live nor leased (by
    /// `publish`'s caller, or `unpublish`'s winner); read by lease holders.
    entry: UnsafeCell<Option<T>>,
}

// SAFETY: `entry` is written only by the one owner of a slot that is not
// live and has no lease (the free list's holder, or `unpublish`'s winner),
// and read only under a lease or an exclusive read, taken with Acquire
// after the Release that published it and given back with Release before
// the Acquire that unpublishes it (module docs); `T` itself crosses threads.
unsafe impl<T: Send + Sync> Sync for Slot<T> {}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Slot<T> {
    /// A free slot, at generation 1 (generation 0 is never issued, so a
    /// zeroed id never names a region).
    pub fn new() -> Self {
        Self { state: AtomicU64::new(1 << GENERATION_SHIFT), entry: UnsafeCell::new(None) }
    }

    /// The generation the next [`publish`](Self::publish) issues.
    pub fn generation(&self) -> u32 {
        generation_of(self.state.load(Ordering::Relaxed))
    }

    /// Writes `entry` and makes the slot live; returns the generation
    /// issued.
    ///
    /// # Safety
    ///
    /// The caller owns the free slot: it is not live, has no lease, and no
    /// other `publish` runs on it (the registry takes it from its free list
    /// under its mutex; a retired slot is never on that list).
    pub unsafe fn publish(&self, entry: T) -> u32 {
        let generation = self.generation();
        // SAFETY: not live and unleased, so no reader exists (our contract);
        // nobody else publishes it.
        self.entry.with_mut(|cell| unsafe { *cell = Some(entry) });
        // Release publishes the entry to lease takers (Acquire in `lease`).
        self.state.store((u64::from(generation) << GENERATION_SHIFT) | LIVE, Ordering::Release);
        generation
    }

    /// Makes `generation` the one the next [`publish`](Self::publish)
    /// issues: for tests that reach a slot's last generations.
    ///
    /// # Safety
    ///
    /// As [`publish`](Self::publish): the caller owns the free slot.
    #[cfg(any(test, feature = "testing"))]
    pub unsafe fn start_at(&self, generation: u32) {
        debug_assert_eq!(self.state.load(Ordering::Relaxed) & (LIVE | READING | LEASE_MASK), 0);
        self.state.store(u64::from(generation) << GENERATION_SHIFT, Ordering::Relaxed);
    }

    /// Takes one lease under `generation`.
    #[inline]
    pub fn lease(&self, generation: u32) -> Result<(), Refused> {
        let mut current = self.state.load(Ordering::Acquire);
        loop {
            if generation_of(current) != generation || current & LIVE == 0 {
                return Err(Refused::Gone);
            }
            if current & READING != 0 {
                return Err(Refused::Held { leases: current & LEASE_MASK, reading: true });
            }
            if current & LEASE_MASK == LEASE_MASK {
                return Err(Refused::Full);
            }
            // Acquire pairs with the Release in `publish`: the entry is
            // visible to whoever holds the lease.
            match self.state.compare_exchange_weak(current, current + 1, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(actual) => current = actual,
            }
        }
    }

    /// Gives one lease back.
    ///
    /// # Safety
    ///
    /// The caller owns a lease on this slot that nobody gave back yet, and
    /// no borrow of the entry under it outlives this call.
    #[inline]
    pub unsafe fn release(&self) {
        // Release pairs with `unpublish`'s Acquire: our reads of the entry
        // happen before the winner takes it.
        let before = self.state.fetch_sub(1, Ordering::Release);
        debug_assert!(before & LEASE_MASK != 0, "a lease given back that was never taken");
    }

    /// Takes the slot for a reader alone: only while live under
    /// `generation` with no lease; until [`end_read`](Self::end_read) no
    /// lease is granted and the slot cannot be unpublished.
    pub fn read_alone(&self, generation: u32) -> Result<(), Refused> {
        let idle = (u64::from(generation) << GENERATION_SHIFT) | LIVE;
        // Acquire pairs with the lease holders' Release (their work on the
        // region is done) and with `publish`'s Release (the entry).
        match self.state.compare_exchange(idle, idle | READING, Ordering::Acquire, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(current) if generation_of(current) == generation && current & LIVE != 0 => {
                Err(Refused::Held { leases: current & LEASE_MASK, reading: current & READING != 0 })
            }
            Err(_) => Err(Refused::Gone),
        }
    }

    /// Ends an exclusive read.
    ///
    /// # Safety
    ///
    /// The caller owns the exclusive read that [`read_alone`](Self::read_alone)
    /// granted, and no borrow of the entry under it outlives this call.
    pub unsafe fn end_read(&self) {
        // Release: the reader's accesses happen before the next lease
        // holder's (Acquire in `lease`) or the unpublisher's.
        let before = self.state.fetch_and(!READING, Ordering::Release);
        debug_assert!(before & READING != 0, "an exclusive read ended that never began");
    }

    /// True while the slot is live under `generation` and leased (or read
    /// alone): what a kept lease's holder checks of a stale id.
    #[inline]
    pub fn is_held(&self, generation: u32) -> bool {
        let state = self.state.load(Ordering::Acquire);
        generation_of(state) == generation && state & LIVE != 0 && state & (LEASE_MASK | READING) != 0
    }

    /// True while the slot is live under `generation`.
    pub fn is_live(&self, generation: u32) -> bool {
        let state = self.state.load(Ordering::Acquire);
        generation_of(state) == generation && state & LIVE != 0
    }

    /// Takes the slot out of service under `generation`: succeeds for
    /// exactly one caller, and only while the slot is live and idle; the
    /// winner gets the entry. The slot's next generation is `generation +
    /// 1`, or none (retired) when `generation` is the last.
    pub fn unpublish(&self, generation: u32) -> Result<Unpublished<T>, Refused> {
        let live_idle = (u64::from(generation) << GENERATION_SHIFT) | LIVE;
        let retired = generation == u32::MAX;
        let next = if retired { u32::MAX } else { generation + 1 };
        let freed = u64::from(next) << GENERATION_SHIFT;
        // AcqRel: Acquire pairs with the lease holders' Release decrements
        // (their reads of the entry are done); Release orders our taking of
        // the entry before the slot's next publish.
        match self.state.compare_exchange(live_idle, freed, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {}
            Err(current) if generation_of(current) == generation && current & LIVE != 0 => {
                return Err(Refused::Held { leases: current & LEASE_MASK, reading: current & READING != 0 });
            }
            Err(_) => return Err(Refused::Gone),
        }
        // SAFETY: the slot is no longer live and had no lease, so no reader
        // exists or can start; the compare-and-swap succeeds once per
        // generation, and a publish needs the slot back on the free list.
        let entry = self.entry.with_mut(|cell| unsafe { (*cell).take() }).expect("a live slot has an entry");
        Ok(Unpublished { entry, retired })
    }

    /// Runs `read` on the entry.
    ///
    /// # Safety
    ///
    /// The caller holds a lease or an exclusive read on the live slot, or
    /// otherwise keeps it from being unpublished for the call (the
    /// registry's mutex with the slot live).
    #[inline]
    pub unsafe fn read<R>(&self, read: impl FnOnce(&T) -> R) -> R {
        // SAFETY: no writer while the slot is live and held (our contract).
        self.entry.with(|cell| read(unsafe { (*cell).as_ref() }.expect("a live slot has an entry")))
    }

    /// The entry, borrowed for as long as the caller keeps the slot held.
    ///
    /// # Safety
    ///
    /// As [`read`](Self::read), for as long as the borrow lives.
    #[cfg(not(loom))]
    #[inline]
    pub unsafe fn entry(&self) -> &T {
        // SAFETY: as `read`, for the borrow's life (our contract).
        self.entry.with(|cell| unsafe { (*cell).as_ref() }.expect("a live slot has an entry"))
    }
}
