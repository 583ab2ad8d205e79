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
//! - entries `[start, end, generation]` (generation 0: an empty slot).
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
pub const FENCE_SLOTS: usize = 96;
/// Entry slots of one table (shrunk under loom so the model reaches a fold).
#[cfg(loom)]
pub const FENCE_SLOTS: usize = 2;
const PHASE: usize = 0;
const BUSY: usize = 1;
const FLOOR: usize = 3;
const USED: usize = 4;
const ENTRIES: usize = 8;
/// Words of one table.
pub const FENCE_WORDS: usize = ENTRIES + 3 * FENCE_SLOTS;
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

/// Why a fence did not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceFailed {
    /// Writes under older grants were still in progress when the caller's
    /// deadline passed: this many. The range stays fenced under the new
    /// generation (nobody holds it, so nothing lands there until the
    /// range is fenced again).
    Busy(u64),
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

    /// Fences `[start, end)` under `generation`: returns once no write
    /// under an older grant is in progress there. `pause` is called between
    /// looks at the writers in progress and returns false once the
    /// caller's deadline passed.
    ///
    /// The caller serialises fences of one table (a mutex), and passes a
    /// generation above every one it passed this table before.
    pub fn fence(
        &self,
        start: u64,
        end: u64,
        generation: u32,
        mut pause: impl FnMut() -> bool,
    ) -> Result<(), FenceFailed> {
        let phase = self.words[PHASE].load(Ordering::SeqCst);
        let generation = u64::from(generation);
        let slot = self.free_slot();
        let at = ENTRIES + 3 * slot;
        // Range first, generation last: a reader that sees the generation
        // sees the range (SeqCst, as every access here).
        self.words[at].store(start, Ordering::SeqCst);
        self.words[at + 1].store(end, Ordering::SeqCst);
        self.words[at + 2].store(generation, Ordering::SeqCst);
        // Entries the new one covers are redundant now that it is visible.
        let used = self.words[USED].load(Ordering::SeqCst) as usize;
        for other in (0..used).filter(|&other| other != slot) {
            let at = ENTRIES + 3 * other;
            let gen = self.words[at + 2].load(Ordering::SeqCst);
            let (s, e) = (self.words[at].load(Ordering::SeqCst), self.words[at + 1].load(Ordering::SeqCst));
            if gen != 0 && start <= s && e <= end {
                self.words[at + 2].store(0, Ordering::SeqCst);
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

    /// An empty slot, a new one, or the oldest entry's, folded into the
    /// floor first.
    fn free_slot(&self) -> usize {
        let used = self.words[USED].load(Ordering::SeqCst) as usize;
        if let Some(slot) = (0..used).find(|&slot| self.words[ENTRIES + 3 * slot + 2].load(Ordering::SeqCst) == 0) {
            return slot;
        }
        if used < FENCE_SLOTS {
            // The entry is written before `issued` moves, so a reader that
            // sees the new `used` but an empty slot skips it.
            self.words[USED].store(used as u64 + 1, Ordering::SeqCst);
            return used;
        }
        let oldest =
            (0..used).min_by_key(|&slot| self.words[ENTRIES + 3 * slot + 2].load(Ordering::SeqCst)).unwrap_or(0);
        let gen = self.words[ENTRIES + 3 * oldest + 2].load(Ordering::SeqCst);
        // The floor takes the entry's protection before its slot goes.
        self.words[FLOOR].fetch_max(gen, Ordering::SeqCst);
        self.words[ENTRIES + 3 * oldest + 2].store(0, Ordering::SeqCst);
        oldest
    }
}

impl Pass<'_> {
    /// True when a write under `grant` may land in `[start, end)`: no
    /// fence covering any of it is newer than the grant.
    #[inline]
    pub fn admits(&self, start: u64, end: u64, grant: u32) -> bool {
        let words = self.view.words;
        // Never fenced: the common case costs one load.
        if words[PHASE].load(Ordering::SeqCst) == 0 {
            return true;
        }
        let grant = u64::from(grant);
        if grant < words[FLOOR].load(Ordering::SeqCst) {
            return false;
        }
        let used = (words[USED].load(Ordering::SeqCst) as usize).min(FENCE_SLOTS);
        (0..used).all(|slot| {
            let at = ENTRIES + 3 * slot;
            let gen = words[at + 2].load(Ordering::SeqCst);
            gen <= grant || {
                let (s, e) = (words[at].load(Ordering::SeqCst), words[at + 1].load(Ordering::SeqCst));
                e <= start || end <= s
            }
        })
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
        view.fence(0, 64, 1, || true).unwrap();
        view.fence(64, 128, 2, || true).unwrap();
        let pass = view.enter().unwrap();
        assert!(!pass.admits(0, 8, 0), "grant 0 in a fenced range");
        assert!(pass.admits(0, 64, 1));
        assert!(!pass.admits(60, 70, 1), "spans into the newer fence");
        assert!(pass.admits(128, 256, 0), "outside every fence");
        drop(pass);
        view.fence(0, 64, 5, || true).unwrap();
        let pass = view.enter().unwrap();
        assert!(!pass.admits(0, 64, 1), "stale after the range was fenced again");
        assert!(pass.admits(0, 64, 5));
    }

    #[test]
    fn a_full_table_folds_its_oldest_entry_into_the_floor() {
        let table = FenceTable::new();
        let view = table.view();
        for i in 0..FENCE_SLOTS as u64 {
            view.fence(i, i + 1, i as u32 + 1, || true).unwrap();
        }
        // The table is full: this fence folds the first entry (grant 1).
        view.fence(10_000, 10_001, 1000, || true).unwrap();
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
        let waited = view.fence(0, 8, 1, || {
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
        assert_eq!(view.fence(0, 8, 2, || false), Ok(()), "nothing in progress: no wait");
        assert!(view.enter().unwrap().admits(0, 8, 2));
    }

    #[test]
    fn grants_rise() {
        let (a, b) = (next_grant().unwrap(), next_grant().unwrap());
        assert!(b > a && a > 0);
    }
}
