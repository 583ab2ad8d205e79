//! The status table: one atomic status word per batch, readable by any
//! thread without a lock.
//!
//! Each submitter owns one table. A slot's word packs the slot's generation
//! and the batch state; a [`BatchId`] packs the table's tag, the slot index
//! and the generation, so a stale id (its batch ended and was consumed) or a
//! forged one (wrong tag, index past the end) is an error, never another
//! batch's status.
//!
//! A batch split across lanes has one *part* per lane. Each lane adds its
//! bytes and, on failure, offers its error; the lane that finishes the last
//! part (the `remaining` count reaching zero) computes the terminal state
//! and publishes it with one Release store. Readers load the word with
//! Acquire and then see every part's bytes and the error.
//!
//! The failure payload type is generic so the loom models can compile this
//! file without the rest of the crate.

use crate::sync::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::fmt;

/// A batch id: `tag:16 | slot:16 | generation:32`, a generational index.
///
/// ```
/// use kvring::BatchId;
/// let id = BatchId::from_raw(0x0001_0002_0000_0003);
/// assert_eq!(id.raw(), 0x0001_0002_0000_0003);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BatchId(u64);

impl BatchId {
    pub(crate) const fn new(tag: u16, slot: u16, generation: u32) -> Self {
        Self(((tag as u64) << 48) | ((slot as u64) << 32) | generation as u64)
    }

    /// Rebuilds an id from its raw form (e.g. from a CQE).
    pub const fn from_raw(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw form.
    pub const fn raw(self) -> u64 {
        self.0
    }

    pub(crate) const fn tag(self) -> u16 {
        (self.0 >> 48) as u16
    }

    pub(crate) const fn slot(self) -> u16 {
        (self.0 >> 32) as u16
    }

    pub(crate) const fn generation(self) -> u32 {
        self.0 as u32
    }
}

impl fmt::Debug for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BatchId({:#x}:{}:{})", self.tag(), self.slot(), self.generation())
    }
}

/// Where a batch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BatchState {
    /// Slot unused.
    Free = 0,
    /// Submitted, not finished.
    Pending = 1,
    /// Every descriptor moved.
    Done = 2,
    /// A descriptor failed; the rest were dropped.
    Failed = 3,
    /// The batch's deadline passed before every descriptor was posted.
    TimedOut = 4,
    /// Cancelled; every posted descriptor drained first.
    Cancelled = 5,
}

impl BatchState {
    fn from_bits(bits: u8) -> Self {
        match bits {
            1 => Self::Pending,
            2 => Self::Done,
            3 => Self::Failed,
            4 => Self::TimedOut,
            5 => Self::Cancelled,
            _ => Self::Free,
        }
    }

    /// True for Done, Failed, TimedOut and Cancelled.
    pub fn is_terminal(self) -> bool {
        match self {
            Self::Done | Self::Failed | Self::TimedOut | Self::Cancelled => true,
            Self::Free | Self::Pending => false,
        }
    }
}

/// How one lane's part of a batch ended.
#[derive(Debug)]
pub enum PartEnd<F> {
    /// Every descriptor of the part moved.
    Done,
    /// A descriptor failed.
    Failed(F),
    /// The deadline passed; remaining descriptors were dropped.
    TimedOut,
    /// Cancel was requested; remaining descriptors were dropped.
    Cancelled,
}

/// A terminal result taken out of the table.
#[derive(Debug)]
pub struct Finished<F> {
    /// The terminal state.
    pub state: BatchState,
    /// Bytes moved by all parts.
    pub bytes: u64,
    /// The first failure, when `state` is `Failed`.
    pub failure: Option<F>,
}

/// What the lane that finished a batch's last part publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartCompletion {
    /// The batch's terminal state.
    pub state: BatchState,
    /// Bytes moved by all parts.
    pub bytes: u64,
    /// The completion's result code, as `result_of` computed it.
    pub result: i32,
}

/// Why an id was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdError {
    /// Wrong table or slot index out of range: never issued here.
    Unknown,
    /// The slot has moved on to a later generation.
    Stale,
}

const FLAG_TIMED_OUT: u32 = 1;
const FLAG_CANCELLED: u32 = 2;

#[repr(align(64))]
struct Slot<F> {
    /// `generation << 32 | state`.
    word: AtomicU64,
    remaining: AtomicU32,
    /// Bits: cancel requested (set by the submitter), and part outcomes.
    cancel: AtomicU32,
    part_flags: AtomicU32,
    bytes: AtomicU64,
    failure: AtomicPtr<F>,
}

impl<F> Slot<F> {
    fn new() -> Self {
        Self {
            word: AtomicU64::new(0),
            remaining: AtomicU32::new(0),
            cancel: AtomicU32::new(0),
            part_flags: AtomicU32::new(0),
            bytes: AtomicU64::new(0),
            failure: AtomicPtr::new(std::ptr::null_mut()),
        }
    }
}

fn pack(generation: u32, state: BatchState) -> u64 {
    ((generation as u64) << 32) | state as u64
}

/// One submitter's table of batch status words.
pub struct StatusTable<F> {
    tag: u16,
    slots: Box<[Slot<F>]>,
    /// Cancels requested so far: a lane compares it with the count it last
    /// saw (one load a round) and walks its parts in flight only when it moved.
    cancels: AtomicU64,
}

// SAFETY: the only non-atomic content is the boxed failure behind an
// AtomicPtr, handed between threads with AcqRel swaps; `F: Send` lets it move.
unsafe impl<F: Send> Sync for StatusTable<F> {}
// SAFETY: as above.
unsafe impl<F: Send> Send for StatusTable<F> {}

impl<F> fmt::Debug for StatusTable<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatusTable").field("tag", &self.tag).field("capacity", &self.slots.len()).finish()
    }
}

impl<F> StatusTable<F> {
    /// A table of `capacity` slots (at most 65536) whose ids carry `tag`.
    pub fn new(capacity: usize, tag: u16) -> Self {
        let capacity = capacity.clamp(1, 1 << 16);
        Self { tag, slots: (0..capacity).map(|_| Slot::new()).collect(), cancels: AtomicU64::new(0) }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    fn slot(&self, id: BatchId) -> Result<&Slot<F>, IdError> {
        if id.tag() != self.tag {
            return Err(IdError::Unknown);
        }
        self.slots.get(id.slot() as usize).ok_or(IdError::Unknown)
    }

    /// Starts a batch of `parts` lane parts in a free slot (owner only).
    pub fn begin(&self, slot_index: u16, parts: u32) -> BatchId {
        let slot = &self.slots[slot_index as usize];
        let generation = (slot.word.load(Ordering::Relaxed) >> 32) as u32;
        debug_assert_eq!(BatchState::from_bits(slot.word.load(Ordering::Relaxed) as u8), BatchState::Free);
        slot.remaining.store(parts, Ordering::Relaxed);
        slot.cancel.store(0, Ordering::Relaxed);
        slot.part_flags.store(0, Ordering::Relaxed);
        slot.bytes.store(0, Ordering::Relaxed);
        // Release: the resets above are visible to the lanes, which receive
        // the id through a ring (itself Release/Acquire) after this store.
        slot.word.store(pack(generation, BatchState::Pending), Ordering::Release);
        BatchId::new(self.tag, slot_index, generation)
    }

    /// Records the end of one lane part. Returns the batch's completion when
    /// this was its last part; that caller then posts the CQE. `result_of`
    /// turns the terminal state (and the failure, if any) into the CQE's
    /// result code.
    pub fn finish_part(
        &self,
        id: BatchId,
        bytes: u64,
        end: PartEnd<F>,
        result_of: impl FnOnce(BatchState, Option<&F>) -> i32,
    ) -> Option<PartCompletion> {
        let slot = self.slot(id).ok()?;
        if bytes > 0 {
            slot.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        match end {
            PartEnd::Done => {}
            PartEnd::Failed(failure) => {
                let boxed = Box::into_raw(Box::new(failure));
                // First failure wins; a later one is dropped here.
                if slot
                    .failure
                    .compare_exchange(std::ptr::null_mut(), boxed, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    // SAFETY: `boxed` came from Box::into_raw above and was
                    // never shared.
                    drop(unsafe { Box::from_raw(boxed) });
                }
            }
            PartEnd::TimedOut => {
                slot.part_flags.fetch_or(FLAG_TIMED_OUT, Ordering::Relaxed);
            }
            PartEnd::Cancelled => {
                slot.part_flags.fetch_or(FLAG_CANCELLED, Ordering::Relaxed);
            }
        }
        // AcqRel: every part's writes above happen before the last part's
        // decrement observes zero, and that lane then reads them all.
        if slot.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return None;
        }
        let failure = slot.failure.load(Ordering::Acquire);
        let state = if !failure.is_null() {
            BatchState::Failed
        } else {
            let flags = slot.part_flags.load(Ordering::Relaxed);
            if flags & FLAG_TIMED_OUT != 0 {
                BatchState::TimedOut
            } else if flags & FLAG_CANCELLED != 0 {
                BatchState::Cancelled
            } else {
                BatchState::Done
            }
        };
        // SAFETY: a non-null failure stays owned by the slot until `take`,
        // which cannot run before the terminal store below.
        let result = result_of(state, unsafe { failure.as_ref() });
        let total = slot.bytes.load(Ordering::Relaxed);
        // Release pairs with readers' Acquire in `state`/`take`: the bytes
        // and failure are visible once the terminal state is.
        slot.word.store(pack(id.generation(), state), Ordering::Release);
        Some(PartCompletion { state, bytes: total, result })
    }

    /// The state of a batch, from any thread.
    pub fn state(&self, id: BatchId) -> Result<BatchState, IdError> {
        let slot = self.slot(id)?;
        let word = slot.word.load(Ordering::Acquire);
        if (word >> 32) as u32 != id.generation() {
            return Err(IdError::Stale);
        }
        match BatchState::from_bits(word as u8) {
            BatchState::Free => Err(IdError::Stale),
            state => Ok(state),
        }
    }

    /// Bytes moved so far (exact once the state is terminal).
    pub fn bytes(&self, id: BatchId) -> Result<u64, IdError> {
        self.state(id)?;
        Ok(self.slot(id)?.bytes.load(Ordering::Relaxed))
    }

    /// Asks the lanes to drop the batch's descriptors not yet posted.
    pub fn request_cancel(&self, id: BatchId) -> Result<(), IdError> {
        let slot = self.slot(id)?;
        self.state(id)?;
        slot.cancel.store(1, Ordering::Relaxed);
        // Release: pairs with the Acquire in `cancels_requested`, so a lane
        // that sees the count move also sees the batch's cancel flag.
        self.cancels.fetch_add(1, Ordering::Release);
        Ok(())
    }

    /// How many cancels were ever requested on this table (lanes compare it
    /// with the count they last saw before walking their parts in flight).
    #[inline]
    pub fn cancels_requested(&self) -> u64 {
        self.cancels.load(Ordering::Acquire)
    }

    /// True when cancel was requested (lanes poll this between descriptors).
    #[inline]
    pub fn cancel_requested(&self, id: BatchId) -> bool {
        self.slot(id).map(|s| s.cancel.load(Ordering::Relaxed) != 0).unwrap_or(false)
    }

    /// Takes a terminal batch's result and frees its slot for a later
    /// generation (owner only). `Ok(None)` while it is still pending.
    pub fn take(&self, id: BatchId) -> Result<Option<Finished<F>>, IdError> {
        let state = self.state(id)?;
        if !state.is_terminal() {
            return Ok(None);
        }
        let slot = self.slot(id)?;
        let bytes = slot.bytes.load(Ordering::Relaxed);
        let raw = slot.failure.swap(std::ptr::null_mut(), Ordering::AcqRel);
        let failure = if raw.is_null() {
            None
        } else {
            // SAFETY: a non-null pointer here came from Box::into_raw in
            // `finish_part`, and the swap made us its only owner.
            Some(*unsafe { Box::from_raw(raw) })
        };
        let next_generation = id.generation().wrapping_add(1);
        // Release: a later `begin` on this slot (same thread) and readers
        // see the slot free under the next generation.
        slot.word.store(pack(next_generation, BatchState::Free), Ordering::Release);
        Ok(Some(Finished { state, bytes, failure }))
    }
}

impl<F> Drop for StatusTable<F> {
    fn drop(&mut self) {
        for slot in self.slots.iter() {
            let raw = slot.failure.swap(std::ptr::null_mut(), Ordering::Acquire);
            if !raw.is_null() {
                // SAFETY: as in `take`; we are the last owner of the table.
                drop(unsafe { Box::from_raw(raw) });
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn code<F>(state: BatchState, failure: Option<&F>) -> i32 {
        -(state as i32) - failure.map_or(0, |_| 1)
    }

    #[test]
    fn a_batch_ends_once_its_last_part_ends() {
        let table = StatusTable::<String>::new(4, 7);
        let id = table.begin(2, 3);
        assert_eq!(table.state(id), Ok(BatchState::Pending));
        assert_eq!(table.finish_part(id, 10, PartEnd::Done, code), None);
        assert_eq!(table.finish_part(id, 20, PartEnd::Failed("boom".into()), code), None);
        let done = table.finish_part(id, 30, PartEnd::TimedOut, code).unwrap();
        assert_eq!(done, PartCompletion { state: BatchState::Failed, bytes: 60, result: -4 });
        let finished = table.take(id).unwrap().unwrap();
        assert_eq!(finished.state, BatchState::Failed);
        assert_eq!(finished.bytes, 60);
        assert_eq!(finished.failure.as_deref(), Some("boom"));
        assert_eq!(table.state(id), Err(IdError::Stale));
        assert_eq!(table.take(id).unwrap_err(), IdError::Stale);
    }

    #[test]
    fn forged_and_stale_ids_are_refused() {
        let table = StatusTable::<()>::new(2, 1);
        let id = table.begin(0, 1);
        assert_eq!(table.state(BatchId::new(2, 0, id.generation())), Err(IdError::Unknown), "other tag");
        assert_eq!(table.state(BatchId::new(1, 5, 0)), Err(IdError::Unknown), "slot past the end");
        assert_eq!(table.state(BatchId::new(1, 1, 0)), Err(IdError::Stale), "free slot");
        table.finish_part(id, 0, PartEnd::Done, code);
        table.take(id).unwrap();
        let next = table.begin(0, 1);
        assert_ne!(next, id);
        assert_eq!(table.state(id), Err(IdError::Stale));
        assert_eq!(table.state(next), Ok(BatchState::Pending));
    }

    #[test]
    fn precedence_is_failed_then_timed_out_then_cancelled() {
        let table = StatusTable::<u8>::new(1, 0);
        let id = table.begin(0, 2);
        table.finish_part(id, 0, PartEnd::Cancelled, code);
        assert_eq!(table.finish_part(id, 0, PartEnd::TimedOut, code).unwrap().state, BatchState::TimedOut);
        table.take(id).unwrap();
        let id = table.begin(0, 1);
        table.request_cancel(id).unwrap();
        assert!(table.cancel_requested(id));
        assert_eq!(table.finish_part(id, 0, PartEnd::Cancelled, code).unwrap().state, BatchState::Cancelled);
    }
}
