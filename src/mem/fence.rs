//! Fenced destinations: the words a target and the writers into one of its
//! regions share, so that a write under a stale grant never lands.
//!
//! A target *fences* a range of a region (a request's blocks) and gets a
//! new *generation* for it, the grant it hands to the one sender that may
//! write there. A write names its grant; it lands only where every fence
//! covering its bytes is no newer than that grant (grant 0 names none: it
//! lands only where nothing was ever fenced). Once [`FenceView::fence`]
//! returned, no write under an older grant is in the range, and none
//! starts.
//!
//! Words (all `AtomicU64`, so the table can live in memory several
//! processes map, or on the heap):
//!
//! - `phase`: how many fences the table has seen (0: never fenced); it
//!   picks which of the two `busy` counters a writer counts in;
//! - `busy[0]`, `busy[1]`: writes in progress, by phase parity;
//! - `floor`: grants below it are stale everywhere in the region (where a
//!   full table folds its oldest entry: a refusal too many, never one too
//!   few);
//! - `used`: how many entry slots were ever taken (readers scan that many);
//! - `issued`: the highest generation the fencer ever entered here,
//!   stored before the entry that carries it: a grant above it was never
//!   handed out for this table, and lands on no fenced byte (a sender
//!   naming `u32::MAX`, or the last grant + 1, would otherwise pass every
//!   fence older than the grant it made up; tcp also refuses a grant its
//!   process never issued, the one-sided writers only see the table);
//! - entries `[start, len, stride, count, generation]` (generation 0: an
//!   empty slot): `count` ranges of `len` bytes, `stride` apart from
//!   `start`, so that one entry holds a request's blocks in every layer of
//!   a layer-major KV pool (a [`Span`]).
//!
//! Generations come from one counter per process ([`next_grant`]), so they
//! rise in every table, and one fence can enter the same grant in several
//! tables (a region's own and the cma page's).
//!
//! **Writer** ([`FenceView::enter`], then [`Pass::admits`] before every
//! copy): read `phase` as `p`, add one to `busy[p & 1]`, SC fence, read
//! `phase` again (another value: undo and start again); then check the
//! entries; copy; subtract one (the pass drops, Release).
//!
//! **Fencer** ([`FenceView::fence`], one at a time per table: the caller's
//! mutex): write the entry (range first, generation last), clear entries it
//! covers, store `phase = p + 1` (the phase flips), SC fence, then wait
//! until `busy[p & 1]` is 0.
//!
//! Why it holds: a writer counted under phase `p` is either seen by the
//! fencer's wait (which then waits for its copy to end), or its SC fence
//! comes after the fencer's in the fences' single order, and then its
//! re-read of `phase` sees `p + 1` (it starts again) and its entry check
//! sees the new entry. A writer that read `phase` as `p + 1` or later read
//! it from the fencer's store, so it sees the entry written before that
//! store. Without the re-read, a writer that read an old phase, stalled
//! across two fences, and counted in the parity the second fence does not
//! wait for, could miss the second fence's entry if its SC fence fell
//! between the two fences' in the single order. `loom_tests/` models the
//! protocol and fails when either SC fence is removed, when the fencer does
//! not wait, or when it flips the phase before writing its entry (loom
//! orders SC fences as it schedules them, so it cannot produce the stalled
//! writer's interleaving; the re-read is argued, not modelled).
//!
//! Entries are never unprotected while rewritten: a folded entry's
//! generation goes into `floor` before its slot is cleared, and covered
//! entries are cleared only after the entry covering them is published.
//!
//! The file uses only `crate::sync`, so `loom_tests/` compiles it unchanged
//! (docs/ARCHITECTURE.md, "Fenced destinations").

use crate::sync::{fence, AtomicU64, Ordering};

/// Entry slots of one table. A table that is full folds its oldest entry
/// into the region-wide floor.
#[cfg(not(loom))]
pub const FENCE_SLOTS: usize = 72;
/// Entry slots of one table (shrunk under loom so the model reaches a fold).
#[cfg(loom)]
pub const FENCE_SLOTS: usize = 2;
const PHASE: usize = 0;
const BUSY: usize = 1;
const FLOOR: usize = 3;
const USED: usize = 4;
/// The highest generation entered (see the module docs); word 5 was
/// unused before, so the layouts around the table did not move (their
/// versions did: a writer of the old layout would not refuse made-up
/// grants).
const ISSUED: usize = 5;
const ENTRIES: usize = 8;
/// Words of one table.
pub const FENCE_WORDS: usize = ENTRIES + ENTRY_WORDS * FENCE_SLOTS;
const ENTRY_WORDS: usize = 5;
const GEN: usize = 4;
/// Times a writer starts its entry again when fences keep flipping the
/// phase under it before it gives up (`None` from [`FenceView::enter`]).
pub const ENTER_TRIES: usize = 1024;

/// The last grant this process issued (0: none yet).
#[cfg(not(loom))]
static LAST_GRANT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// A new grant, above every grant this process issued before; `None` once
/// all 2^32 - 1 were issued.
#[cfg(not(loom))]
pub fn next_grant() -> Option<u32> {
    LAST_GRANT
        .fetch_update(std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed, |last| {
            last.checked_add(1)
        })
        .ok()
        .map(|last| last + 1)
}

/// True when this process has issued `grant` (or it is 0, none): a
/// sender naming a grant above the last issued names one nobody was given.
#[cfg(not(loom))]
pub fn issued(grant: u32) -> bool {
    grant <= LAST_GRANT.load(std::sync::atomic::Ordering::Relaxed)
}

/// Why a fence did not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceFailed {
    /// Writes under older grants were still in progress when the caller's
    /// deadline passed: this many. The range stays fenced under the new
    /// generation (nobody holds it, so nothing lands there until the
    /// range is fenced again).
    Busy(u64),
}

/// What one fence entry covers: `count` ranges of `len` bytes, the k-th
/// at `start + k * stride` (`count` 1: one range).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The first range's first byte.
    pub start: u64,
    /// Bytes of each range.
    pub len: u64,
    /// From one range's start to the next's (at least `len` when `count`
    /// is above 1).
    pub stride: u64,
    /// Ranges, at least 1.
    pub count: u64,
}

impl Span {
    /// One range.
    pub fn range(start: u64, len: u64) -> Self {
        Self { start, len, stride: len, count: 1 }
    }

    /// True when any of its ranges meets `[start, end)`.
    #[inline]
    pub fn meets(&self, start: u64, end: u64) -> bool {
        if self.len == 0 || self.count == 0 || end <= self.start || start >= end {
            return false;
        }
        // The first range whose end passes `start`: k with
        // self.start + k * stride + len > start.
        // (A gap of 0: `start` is the first range's last byte, whatever the
        // stride; a single range's stride of 0, as a peer's table may say,
        // must not make that byte pass.)
        let k = match (start + 1).checked_sub(self.start.saturating_add(self.len)) {
            None | Some(0) => 0,
            Some(_) if self.stride == 0 => return false,
            Some(gap) => gap.div_ceil(self.stride),
        };
        k < self.count && k.checked_mul(self.stride).and_then(|o| o.checked_add(self.start)).is_some_and(|at| at < end)
    }

    /// True when every range of `other` lies inside one of ours.
    fn covers(&self, other: &Span) -> bool {
        let same_pattern = other.stride == self.stride || other.count == 1;
        if !same_pattern || other.start < self.start || self.stride == 0 {
            return false;
        }
        let k = (other.start - self.start) / self.stride;
        let at = self.start + k * self.stride;
        let fits = other.start.saturating_add(other.len) <= at.saturating_add(self.len);
        fits && k.checked_add(other.count).is_some_and(|last| last <= self.count)
    }
}

/// One table's words, wherever they live.
#[derive(Debug, Clone, Copy)]
pub struct FenceView<'a> {
    words: &'a [AtomicU64],
}

/// A writer's entry: counted in a `busy` word until dropped.
#[derive(Debug)]
pub struct Pass<'a> {
    view: FenceView<'a>,
    busy: &'a AtomicU64,
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        // Release: the copy's accesses happen before the fencer reads the
        // count down (its SeqCst load in `fence`).
        self.busy.fetch_sub(1, Ordering::Release);
    }
}

impl<'a> FenceView<'a> {
    /// A view of `words` (at least [`FENCE_WORDS`] of them; all zero is an
    /// empty table).
    pub fn new(words: &'a [AtomicU64]) -> Self {
        assert!(words.len() >= FENCE_WORDS, "a fence table needs {FENCE_WORDS} words");
        Self { words: &words[..FENCE_WORDS] }
    }

    /// The table's words (a target keeps a pointer to them with a lease).
    pub fn words(&self) -> &'a [AtomicU64] {
        self.words
    }

    /// A writer's way in (see the module docs); `None` when fences kept
    /// flipping the phase for [`ENTER_TRIES`] tries.
    pub fn enter(&self) -> Option<Pass<'a>> {
        for _ in 0..ENTER_TRIES {
            let phase = self.words[PHASE].load(Ordering::SeqCst);
            let busy = &self.words[BUSY + (phase & 1) as usize];
            busy.fetch_add(1, Ordering::SeqCst);
            let pass = Pass { view: *self, busy };
            // Pairs with the fence in `fence`: either the fencer's wait
            // reads our count, or our reads below see its entry and phase.
            fence(Ordering::SeqCst);
            if self.words[PHASE].load(Ordering::SeqCst) == phase {
                return Some(pass);
            }
            drop(pass);
        }
        None
    }

    /// Fences `spans` under `generation`: returns once no write under an
    /// older grant is in progress there. `pause` is called between looks
    /// at the writers in progress and returns false once the caller's
    /// deadline passed.
    ///
    /// The caller serialises fences of one table (a mutex), and passes a
    /// generation above every one it passed this table before.
    pub fn fence(&self, spans: &[Span], generation: u32, mut pause: impl FnMut() -> bool) -> Result<(), FenceFailed> {
        let phase = self.words[PHASE].load(Ordering::SeqCst);
        let generation = u64::from(generation);
        // Before the entries: a writer that sees an entry's generation
        // sees `issued` at least that high (a grant it was handed is not
        // refused as made up).
        self.words[ISSUED].fetch_max(generation, Ordering::SeqCst);
        for span in spans {
            let slot = self.free_slot();
            let at = ENTRIES + ENTRY_WORDS * slot;
            // Pattern first, generation last: a reader that sees the
            // generation sees the pattern (SeqCst, as every access here).
            for (word, value) in [span.start, span.len, span.stride, span.count].into_iter().enumerate() {
                self.words[at + word].store(value, Ordering::SeqCst);
            }
            self.words[at + GEN].store(generation, Ordering::SeqCst);
            // Entries the new one covers are redundant now that it is visible.
            let used = self.used();
            for other in (0..used).filter(|&other| other != slot) {
                let at = ENTRIES + ENTRY_WORDS * other;
                let gen = self.words[at + GEN].load(Ordering::SeqCst);
                if gen != 0 && gen < generation && span.covers(&self.entry(other)) {
                    self.words[at + GEN].store(0, Ordering::SeqCst);
                }
            }
        }
        // The phase flips: writers from now on count in the other word.
        self.words[PHASE].store(phase.wrapping_add(1), Ordering::SeqCst);
        // Pairs with the fence in `enter`.
        fence(Ordering::SeqCst);
        let busy = &self.words[BUSY + (phase & 1) as usize];
        loop {
            let writing = busy.load(Ordering::SeqCst);
            if writing == 0 {
                return Ok(());
            }
            if !pause() {
                return Err(FenceFailed::Busy(writing));
            }
        }
    }

    /// Slots ever taken, as the shared `used` word says, never past the
    /// table: in a file's header page any process that maps it can write
    /// the word, and a value past [`FENCE_SLOTS`] must not index past it.
    fn used(&self) -> usize {
        usize::try_from(self.words[USED].load(Ordering::SeqCst)).map_or(FENCE_SLOTS, |used| used.min(FENCE_SLOTS))
    }

    /// Entry `slot`'s pattern.
    fn entry(&self, slot: usize) -> Span {
        let at = ENTRIES + ENTRY_WORDS * slot;
        let word = |i: usize| self.words[at + i].load(Ordering::SeqCst);
        Span { start: word(0), len: word(1), stride: word(2), count: word(3) }
    }

    /// An empty slot, a new one, or the oldest entry's, folded into the
    /// floor first.
    fn free_slot(&self) -> usize {
        let used = self.used();
        if let Some(slot) =
            (0..used).find(|&slot| self.words[ENTRIES + ENTRY_WORDS * slot + GEN].load(Ordering::SeqCst) == 0)
        {
            return slot;
        }
        if used < FENCE_SLOTS {
            // The entry is written before `issued` moves, so a reader that
            // sees the new `used` but an empty slot skips it.
            self.words[USED].store(used as u64 + 1, Ordering::SeqCst);
            return used;
        }
        let oldest = (0..used)
            .min_by_key(|&slot| self.words[ENTRIES + ENTRY_WORDS * slot + GEN].load(Ordering::SeqCst))
            .unwrap_or(0);
        let gen = self.words[ENTRIES + ENTRY_WORDS * oldest + GEN].load(Ordering::SeqCst);
        // The floor takes the entry's protection before its slot goes.
        self.words[FLOOR].fetch_max(gen, Ordering::SeqCst);
        self.words[ENTRIES + ENTRY_WORDS * oldest + GEN].store(0, Ordering::SeqCst);
        oldest
    }
}

/// Why a table's words from a peer were refused ([`FenceView::install`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadTable;

impl FenceView<'_> {
    /// The table's words up to its last used entry slot, both `busy` words
    /// 0: what a target sends the mirror of an rdma writer (taken while no
    /// fence of the table runs: the caller holds the fencers' mutex).
    pub fn snapshot(&self) -> Vec<u64> {
        let len = ENTRIES + ENTRY_WORDS * self.used();
        let mut words: Vec<u64> = self.words[..len].iter().map(|w| w.load(Ordering::SeqCst)).collect();
        words[BUSY] = 0;
        words[BUSY + 1] = 0;
        words
    }

    /// Takes `words` (a [`FenceView::snapshot`] from a peer) as this
    /// table's state, keeping its own `busy` words. For a table no writer
    /// has entered yet and no fencer touches meanwhile (an rdma link's
    /// mirror before its link posts). Refused, the table untouched, unless
    /// the words are whole entries and `used` says as many.
    pub fn install(&self, words: &[u64]) -> Result<(), BadTable> {
        let entries = words.len().checked_sub(ENTRIES).ok_or(BadTable)?;
        let used = entries / ENTRY_WORDS;
        if words.len() > FENCE_WORDS || entries % ENTRY_WORDS != 0 || words[USED] != used as u64 {
            return Err(BadTable);
        }
        // Entries, floor and `issued` before the phase: a writer that sees
        // the phase sees them (as `fence` orders its stores).
        for (at, &word) in words.iter().enumerate().skip(FLOOR) {
            self.words[at].store(word, Ordering::SeqCst);
        }
        self.words[PHASE].store(words[PHASE], Ordering::SeqCst);
        Ok(())
    }

    /// Refuses every write from now on (a fenced, floor-at-the-top table):
    /// for a writer's mirror of a region its target sent no table of.
    pub fn refuse_all(&self) {
        self.words[FLOOR].store(u64::MAX, Ordering::SeqCst);
        self.words[PHASE].fetch_add(1, Ordering::SeqCst);
    }

    /// The highest generation entered here (`issued`).
    pub fn issued(&self) -> u64 {
        self.words[ISSUED].load(Ordering::SeqCst)
    }
}

impl Pass<'_> {
    /// Keeps this writer counted past the borrow it entered under: for a
    /// copy that ends later than the code that checked it (a staged device
    /// copy), so that a fence meanwhile waits for it. Give it back with
    /// [`Held::release`].
    pub fn detach(self) -> Held {
        let busy: *const AtomicU64 = self.busy;
        let words = self.view.words;
        // The other parity's word, for `Held::poison`.
        let other: *const AtomicU64 = match std::ptr::eq(busy, &words[BUSY]) {
            true => &words[BUSY + 1],
            false => &words[BUSY],
        };
        std::mem::forget(self);
        Held { busy, other }
    }

    /// True when a write under `grant` may land in `[start, end)`: no
    /// fence covering any of it is newer than the grant.
    #[inline]
    pub fn admits(&self, start: u64, end: u64, grant: u32) -> bool {
        self.view.admits(start, end, grant)
    }
}

impl FenceView<'_> {
    /// As [`Pass::admits`], for a writer that entered this table and keeps
    /// its count past the pass's borrow (`held`, from [`Pass::detach`] of a
    /// pass of this very table): a device copy's chunk checks each block
    /// under the one count it holds until the copy ends.
    #[inline]
    pub fn admits_held(&self, held: &Held, start: u64, end: u64, grant: u32) -> bool {
        debug_assert!(self.words[BUSY..BUSY + 2].iter().any(|w| std::ptr::eq(w, held.busy)), "a pass of this table");
        self.admits(start, end, grant)
    }

    /// True when no fence newer than `grant` covers any of `[start, end)`
    /// (the caller is counted in `busy`).
    #[inline]
    fn admits(&self, start: u64, end: u64, grant: u32) -> bool {
        let words = self.words;
        // Never fenced: the common case costs one load.
        if words[PHASE].load(Ordering::SeqCst) == 0 {
            return true;
        }
        let grant = u64::from(grant);
        let floor = words[FLOOR].load(Ordering::SeqCst);
        if grant < floor {
            return false;
        }
        // A grant this table's fencer never entered (above `issued`) is
        // made up: it lands on no fenced byte, and, once entries were
        // folded into the floor (whose ranges are gone), nowhere.
        let made_up = grant > words[ISSUED].load(Ordering::SeqCst);
        if made_up && floor > 0 {
            return false;
        }
        let used = self.used();
        (0..used).all(|slot| {
            let gen = words[ENTRIES + ENTRY_WORDS * slot + GEN].load(Ordering::SeqCst);
            gen == 0 || (gen <= grant && !made_up) || !self.entry(slot).meets(start, end)
        })
    }
}

/// A writer counted in a table's `busy` word until released ([`Pass::detach`]).
#[derive(Debug)]
pub struct Held {
    busy: *const AtomicU64,
    /// The table's other `busy` word.
    other: *const AtomicU64,
}

// SAFETY: it points at an atomic word (shared between threads, and between
// processes, by design) that the holder's lease keeps alive; which thread
// releases it does not matter.
unsafe impl Send for Held {}

impl Held {
    /// The writer's copy ended (or never started): a fence stops waiting
    /// for it.
    ///
    /// # Safety
    ///
    /// The table the pass was entered in is still alive (the region's lease
    /// that kept it alive is still kept).
    pub unsafe fn release(self) {
        // SAFETY: per this function's contract. Release: as a pass's drop.
        unsafe { (*self.busy).fetch_sub(1, Ordering::Release) };
    }

    /// Whether the writer's copy ended is unknown (its completion query
    /// failed, or it was dropped unfinished): never released, and counted
    /// in the other parity's word too, so that every later fence of the
    /// table fails `RegionBusy` (fail safe) instead of returning while a
    /// stale copy may still land. A fence only waits for its own parity's
    /// word, so a count left in one word alone would let every second
    /// fence return.
    ///
    /// # Safety
    ///
    /// As [`Held::release`].
    pub unsafe fn poison(self) {
        // SAFETY: per this function's contract.
        unsafe { (*self.other).fetch_add(1, Ordering::SeqCst) };
    }
}

/// A table on the heap: for a region whose writers all run in this
/// process (tcp and staged GPU copies at the target).
#[derive(Debug)]
pub struct FenceTable {
    words: Box<[AtomicU64]>,
}

impl Default for FenceTable {
    fn default() -> Self {
        Self::new()
    }
}

impl FenceTable {
    /// An empty table.
    pub fn new() -> Self {
        Self { words: (0..FENCE_WORDS).map(|_| AtomicU64::new(0)).collect() }
    }

    /// Its view.
    pub fn view(&self) -> FenceView<'_> {
        FenceView::new(&self.words)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_grant_lands_only_where_no_newer_fence_covers() {
        let table = FenceTable::new();
        let view = table.view();
        let pass = view.enter().unwrap();
        assert!(pass.admits(0, 100, 0), "nothing fenced yet");
        drop(pass);
        view.fence(&[Span::range(0, 64)], 1, || true).unwrap();
        view.fence(&[Span::range(64, 64)], 2, || true).unwrap();
        let pass = view.enter().unwrap();
        assert!(!pass.admits(0, 8, 0), "grant 0 in a fenced range");
        assert!(pass.admits(0, 64, 1));
        assert!(!pass.admits(60, 70, 1), "spans into the newer fence");
        assert!(pass.admits(128, 256, 0), "outside every fence");
        drop(pass);
        view.fence(&[Span::range(0, 64)], 5, || true).unwrap();
        let pass = view.enter().unwrap();
        assert!(!pass.admits(0, 64, 1), "stale after the range was fenced again");
        assert!(pass.admits(0, 64, 5));
    }

    #[test]
    fn a_full_table_folds_its_oldest_entry_into_the_floor() {
        let table = FenceTable::new();
        let view = table.view();
        for i in 0..FENCE_SLOTS as u64 {
            view.fence(&[Span::range(i, 1)], i as u32 + 1, || true).unwrap();
        }
        // The table is full: this fence folds the first entry (grant 1).
        view.fence(&[Span::range(10_000, 1)], 1000, || true).unwrap();
        let pass = view.enter().unwrap();
        assert!(!pass.admits(0, 1, 0), "the floor still fences the folded range");
        assert!(!pass.admits(50_000, 50_001, 0), "and, too strictly, every range");
        assert!(pass.admits(0, 1, 1), "the folded range's own grant still lands");
        assert!(pass.admits(1, 2, 2));
        assert!(!pass.admits(1, 2, 1));
    }

    #[test]
    fn a_fence_waits_for_writers_counted_before_it_and_gives_up_at_its_deadline() {
        let table = FenceTable::new();
        let view = table.view();
        let pass = view.enter().unwrap();
        let mut looks = 0;
        let waited = view.fence(&[Span::range(0, 8)], 1, || {
            looks += 1;
            looks < 3
        });
        assert_eq!(waited, Err(FenceFailed::Busy(1)));
        drop(pass);
        // The failed fence left its entry: the range is fenced under a
        // generation nobody holds.
        let pass = view.enter().unwrap();
        assert!(!pass.admits(0, 8, 0));
        drop(pass);
        assert_eq!(view.fence(&[Span::range(0, 8)], 2, || false), Ok(()), "nothing in progress: no wait");
        assert!(view.enter().unwrap().admits(0, 8, 2));
    }

    #[test]
    fn a_strided_span_fences_a_request_in_every_layer_in_one_entry() {
        // 4 layers x K/V of 8 blocks of 100 bytes, layer-major: blocks 2..4
        // of the request recur every 800 bytes.
        let request = Span { start: 200, len: 200, stride: 800, count: 8 };
        let table = FenceTable::new();
        let view = table.view();
        view.fence(&[request], 3, || true).unwrap();
        let pass = view.enter().unwrap();
        for k in 0..8 {
            let at = 200 + k * 800;
            assert!(!pass.admits(at, at + 100, 2), "range {k}, first block");
            assert!(!pass.admits(at + 150, at + 250, 2), "range {k}, straddling its end");
            assert!(pass.admits(at + 200, at + 800, 2), "between ranges {k} and {}", k + 1);
            assert!(pass.admits(at, at + 200, 3));
        }
        assert!(pass.admits(0, 200, 0), "before the first range");
        assert!(pass.admits(200 + 8 * 800, 200 + 9 * 800, 0), "past the last range");
        assert!(!pass.admits(0, 10_000, 2), "a write over all of them");
        assert_eq!(table.words[USED].load(Ordering::SeqCst), 1, "one entry");
        drop(pass);
        // Fencing the same blocks again replaces the entry.
        view.fence(&[request], 4, || true).unwrap();
        let live = (0..2).filter(|&slot| view.words[ENTRIES + ENTRY_WORDS * slot + GEN].load(Ordering::SeqCst) != 0);
        assert_eq!(live.count(), 1);
    }

    #[test]
    fn spans_meet_ranges_exactly_and_never_overflow() {
        let one = Span::range(10, 5);
        assert!(one.meets(14, 15) && one.meets(0, 11) && !one.meets(15, 20) && !one.meets(0, 10));
        let far = Span { start: u64::MAX - 10, len: 100, stride: u64::MAX, count: u64::MAX };
        assert!(far.meets(u64::MAX - 1, u64::MAX));
        assert!(!far.meets(0, 5));
        let flat = Span { start: 0, len: 4, stride: 0, count: 9 };
        assert!(flat.meets(0, 1) && flat.meets(3, 4) && !flat.meets(4, 100));
        let single = Span { start: 10, len: 5, stride: 0, count: 1 };
        assert!(single.meets(14, 15) && single.meets(14, 99) && !single.meets(15, 16), "its last byte");
        assert!(Span { start: 0, len: 10, stride: 100, count: 3 }.covers(&Span::range(205, 5)));
        assert!(!Span { start: 0, len: 10, stride: 100, count: 3 }.covers(&Span::range(305, 5)));
    }

    #[test]
    fn a_grant_never_entered_lands_on_no_fenced_byte() {
        let table = FenceTable::new();
        let view = table.view();
        assert!(view.enter().unwrap().admits(0, 8, u32::MAX), "nothing fenced: nothing to protect");
        view.fence(&[Span::range(0, 64)], 7, || true).unwrap();
        let pass = view.enter().unwrap();
        for made_up in [8, u32::MAX] {
            assert!(!pass.admits(0, 8, made_up), "grant {made_up} was never entered");
            assert!(pass.admits(64, 128, made_up), "outside every fence it still lands");
        }
        assert!(pass.admits(0, 8, 7), "the grant entered lands");
        drop(pass);
        for i in 0..=FENCE_SLOTS as u32 {
            view.fence(&[Span::range(1000 + u64::from(i), 1)], 8 + i, || true).unwrap();
        }
        let pass = view.enter().unwrap();
        assert!(!pass.admits(500, 501, u32::MAX), "past a fold a made-up grant lands nowhere");
        assert!(pass.admits(500, 501, 8 + FENCE_SLOTS as u32));
    }

    #[test]
    fn grants_rise() {
        let (a, b) = (next_grant().unwrap(), next_grant().unwrap());
        assert!(b > a && a > 0);
    }
}

/// The pause a fencer takes between looks at the writers still counted
/// (sleeping 1 µs, doubling to 1 ms), for [`FenceView::fence`]'s `pause`;
/// false once `deadline` passed. One for every table (a region's own, the
/// cma page's, an rdma link's mirror) and for the fencers' mutex.
#[cfg(not(loom))]
pub(crate) fn pauser(deadline: std::time::Instant) -> impl FnMut() -> bool {
    let mut pause = std::time::Duration::from_micros(1);
    move || {
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_millis(1));
        true
    }
}
