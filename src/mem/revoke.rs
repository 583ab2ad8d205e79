//! The revocation handshake between the owner of a region and the peers
//! that copy into it through their own mapping of it (`mem::shm`): two
//! words both sides share, `live` (1 while the owner has the region
//! registered) and `busy` (peers' copies in progress).
//!
//! A peer [`enter`]s before it copies: it adds one to `busy`, then checks
//! `live`; it subtracts one when the copy ends (the guard drops). The owner
//! [`revoke`]s: it clears `live`, then waits until `busy` is 0. This is a
//! store-buffering pattern (each side writes one word, then reads the
//! other's), so each side puts a sequentially consistent fence between its
//! write and its read: two SC fences forbid both reads missing both writes.
//! Either the peer's check sees `live` cleared and it copies nothing, or
//! the owner's wait sees the peer's count and lets the copy end first (the
//! guard's decrement, read by the owner's load, orders the copy before the
//! owner's reuse): once `revoke` returned `Ok`, no peer's copy is in the
//! region, and none starts. (SeqCst operations alone suffice in C++'s
//! model too; the fences make the rule explicit, and loom, which treats
//! SeqCst accesses as AcqRel but models SC fences, checks it.)
//!
//! The atomics come from `crate::sync`, so `loom_tests/` models this very
//! file (a peer copying while its owner revokes and reuses the memory).

use crate::sync::{fence, AtomicU64, Ordering};

/// A peer's copy in progress in a region (see [`enter`]); ends on drop.
#[derive(Debug)]
pub struct Entered<'a> {
    busy: &'a AtomicU64,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        // SeqCst, as every operation on the two words: `revoke` waits for it.
        self.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A peer's way in: counts a copy in progress and checks the owner still
/// has the region live; None (nothing may be copied) once it revoked it.
pub fn enter<'a>(live: &'a AtomicU64, busy: &'a AtomicU64) -> Option<Entered<'a>> {
    busy.fetch_add(1, Ordering::SeqCst);
    let entered = Entered { busy };
    // Paired with `revoke`'s fence: either this load sees `live` cleared,
    // or `revoke`'s load sees this count.
    fence(Ordering::SeqCst);
    (live.load(Ordering::SeqCst) == 1).then_some(entered)
}

/// The owner's way out: clears `live`, then waits for the copies in
/// progress, calling `pause` between looks while any is (`pause` returns
/// false once the owner's deadline passed). `Ok` when none is left;
/// `Err(busy)` when the deadline came first, with `live` as it was (the
/// region stays registered).
pub fn revoke(live: &AtomicU64, busy: &AtomicU64, mut pause: impl FnMut() -> bool) -> Result<(), u64> {
    let before = live.swap(0, Ordering::SeqCst);
    // Paired with `enter`'s fence (see the module docs).
    fence(Ordering::SeqCst);
    loop {
        let copying = busy.load(Ordering::SeqCst);
        if copying == 0 {
            return Ok(());
        }
        if !pause() {
            live.store(before, Ordering::SeqCst);
            return Err(copying);
        }
    }
}
