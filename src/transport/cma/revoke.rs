//! The revocation handshake of the cma page, on its words alone: what an
//! initiator does around every `process_vm_*` call, and what a target does
//! to take a region off the page (or stop) and wait out the calls that may
//! still touch it.
//!
//! Initiator: [`enter`] with the region slots the call touches (each gets
//! a *mark* in the initiator's user slot naming it; with more regions than
//! free marks, the call is counted in the slot's word instead, which
//! stands for every region), then, for every call, [`Entered::still`] of
//! the epoch and of each region's state word; the call; the guard's drop
//! (the marks cleared and the count taken back, Release).
//! Target: [`take_off`] (the state word goes to 0) or [`stop`] (the epoch
//! goes to 0), then [`calls_in`] of every user slot until none has a call
//! that may touch the region (a mark naming it, or a count), or, for a
//! stop, none has a call at all. A long call into region B so never holds
//! up the unregister of region A.
//!
//! Each side's write and its read of the other side's word are split by a
//! sequentially consistent fence: of the two orders in which the writes can
//! happen, either the initiator's check reads the cleared word (it makes no
//! call) or the target's wait reads the initiator's mark or count (it waits
//! for the call to end). The words live in a page that several processes
//! map; the fences are the CPU's, which hold across processes as they do
//! across threads.
//!
//! The file uses only `crate::sync`, so `loom_tests/` compiles it unchanged
//! (docs/ARCHITECTURE.md, "Protocols under loom").

use crate::sync::{fence, AtomicU64, Ordering};

/// The low half of a user slot's word while its claimer writes its start
/// time. No call is counted before the slot is published (the count is 0
/// under the mark), so such a slot counts no call. Counts never reach 2^31.
pub const CLAIMING: u64 = 1 << 31;

/// Marks in one user slot: calls in progress, each naming a region slot.
pub const MARKS: usize = 6;

/// The words of one initiator's user slot that the handshake uses: `pid <<
/// 32 | calls counted for every region`, and its marks (`region slot + 1`
/// of a call in progress, or 0).
#[derive(Debug, Clone, Copy)]
pub struct User<'a> {
    /// `pid << 32 | count` (or [`CLAIMING`] while being claimed).
    pub word: &'a AtomicU64,
    /// One region slot each (index + 1), 0 when free.
    pub marks: [&'a AtomicU64; MARKS],
}

/// What a mark holds for region slot `index`.
#[inline]
pub fn mark_of(index: usize) -> u64 {
    index as u64 + 1
}

/// One call (or run of calls) in progress, marked or counted in the
/// initiator's user slot until dropped.
#[derive(Debug)]
pub struct Entered<'a> {
    user: User<'a>,
    /// The marks this call holds, one bit each.
    held: u8,
    /// Counted in the word (every region) rather than marked.
    counted: bool,
}

/// Counts a call into region slots `regions` in, in the initiator's user
/// slot `user`. Check [`Entered::still`] before each call after.
///
/// `regions` may name a slot more than once (a chunk whose blocks
/// alternate between two regions): each distinct slot takes one mark.
#[inline]
pub fn enter<'a>(user: User<'a>, regions: &[usize]) -> Entered<'a> {
    let mut distinct = [0usize; MARKS];
    let mut count = 0;
    let mut entered = Entered { user, held: 0, counted: regions.is_empty() };
    for &index in regions {
        if distinct[..count].contains(&index) {
            continue;
        }
        if count == MARKS {
            entered.counted = true;
            break;
        }
        distinct[count] = index;
        count += 1;
    }
    if !entered.counted {
        for &index in &distinct[..count] {
            let free = (0..MARKS).find(|&m| {
                entered.held & (1 << m) == 0
                    && user.marks[m].compare_exchange(0, mark_of(index), Ordering::SeqCst, Ordering::Relaxed).is_ok()
            });
            match free {
                Some(m) => entered.held |= 1 << m,
                None => {
                    entered.counted = true;
                    break;
                }
            }
        }
    }
    if entered.counted {
        user.word.fetch_add(1, Ordering::SeqCst);
    }
    // Pairs with the fence in `take_off` / `stop`: our marks (or count) are
    // visible to the target's wait, or its cleared word is visible to our
    // check.
    fence(Ordering::SeqCst);
    entered
}

impl Entered<'_> {
    /// True while `word` (the epoch, or a region's state word) still reads
    /// `expected`: the check before every call, made after the marks.
    #[inline]
    pub fn still(&self, word: &AtomicU64, expected: u64) -> bool {
        word.load(Ordering::SeqCst) == expected
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        // Release: the call's accesses happen before the target sees the
        // mark cleared or the count drop (its Acquire in `calls_in`).
        for m in (0..MARKS).filter(|&m| self.held & (1 << m) != 0) {
            self.user.marks[m].store(0, Ordering::Release);
        }
        if self.counted {
            self.user.word.fetch_sub(1, Ordering::Release);
        }
    }
}

/// Target: takes the region whose state word is `state` off the page when
/// it still lists `generation` of that slot (live); returns the word it
/// had, for [`put_back`], or `None` when it listed another generation or
/// none.
pub fn take_off(state: &AtomicU64, generation: u32, live: u64) -> Option<u64> {
    let listed = state.load(Ordering::SeqCst);
    if listed & live == 0 || (listed >> 32) as u32 != generation {
        return None;
    }
    let before = state.swap(0, Ordering::SeqCst);
    // Pairs with the fence in `enter`: the wait that follows reads every
    // mark and count made before an initiator's check could have missed
    // the clear.
    fence(Ordering::SeqCst);
    Some(before)
}

/// Target: lists a region taken off again (its initiators did not finish
/// in time, so it stays registered).
pub fn put_back(state: &AtomicU64, before: u64) {
    state.store(before, Ordering::SeqCst);
}

/// Target: the engine stops; no initiator starts another call.
pub fn stop(epoch: &AtomicU64) {
    epoch.store(0, Ordering::SeqCst);
    // As in `take_off`.
    fence(Ordering::SeqCst);
}

/// Target: the pid holding user slot `user`, and whether it has a call in
/// progress that may touch region slot `region` (`None`: any call). A slot
/// still being claimed has none.
pub fn calls_in(user: User<'_>, region: Option<usize>) -> (u32, bool) {
    // Acquire pairs with `Entered`'s Release: once this reads a count
    // down or a mark cleared, that call's accesses are done.
    let word = user.word.load(Ordering::Acquire);
    let pid = (word >> 32) as u32;
    if word & CLAIMING != 0 {
        return (pid, false);
    }
    let marked = user.marks.iter().any(|mark| {
        let held = mark.load(Ordering::Acquire);
        held != 0 && region.is_none_or(|index| held == mark_of(index))
    });
    (pid, marked || word & (CLAIMING - 1) != 0)
}
