//! The revocation handshake of `src/mem/revoke.rs` (what decides whether
//! a same-host peer may still write a region its owner unregisters),
//! modelled with loom: the region's bytes are a loom `UnsafeCell`, so a
//! peer's write that could overlap the owner's reuse after `revoke`
//! returned is reported as a data race.
#![cfg(loom)]

use kvring_loom::shm_revoke::{enter, revoke};
use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::Arc;
use loom::thread;

struct Region {
    live: AtomicU64,
    busy: AtomicU64,
    bytes: UnsafeCell<u64>,
}

/// A peer copies into the region while its owner revokes it and then
/// reuses the memory: the copy either happens before `revoke` returns or
/// not at all, in every interleaving.
#[test]
fn no_peer_write_lands_after_revoke_returned() {
    loom::model(|| {
        let region = Arc::new(Region { live: AtomicU64::new(1), busy: AtomicU64::new(0), bytes: UnsafeCell::new(0) });
        let peer = {
            let region = region.clone();
            thread::spawn(move || match enter(&region.live, &region.busy) {
                Some(_copying) => {
                    // SAFETY (of the model): `enter` says the owner waits for this.
                    region.bytes.with_mut(|bytes| unsafe { *bytes = 7 });
                    true
                }
                None => false,
            })
        };
        revoke(&region.live, &region.busy, || {
            thread::yield_now();
            true
        })
        .unwrap();
        // The owner was told no copy is in progress: it reuses the memory.
        // SAFETY: a loom cell's pointer; loom itself reports an unordered access.
        region.bytes.with_mut(|bytes| unsafe { *bytes = 1 });
        let copied = peer.join().unwrap();
        // SAFETY: as above.
        let last = region.bytes.with(|bytes| unsafe { *bytes });
        assert_eq!(last, 1, "a peer's byte landed after revoke returned (copied: {copied})");
    });
}

/// An owner whose deadline passes with a copy in progress gets `Err`, and
/// the region is live again (it stays registered): a later peer enters.
#[test]
fn a_revoke_that_gives_up_leaves_the_region_live() {
    loom::model(|| {
        let region = Arc::new(Region { live: AtomicU64::new(1), busy: AtomicU64::new(0), bytes: UnsafeCell::new(0) });
        let guard = enter(&region.live, &region.busy).expect("live");
        let owner = {
            let region = region.clone();
            thread::spawn(move || revoke(&region.live, &region.busy, || false))
        };
        assert_eq!(owner.join().unwrap(), Err(1));
        drop(guard);
        assert!(enter(&region.live, &region.busy).is_some(), "live again after a failed revoke");
        assert_eq!(revoke(&region.live, &region.busy, || false), Ok(()));
        assert!(enter(&region.live, &region.busy).is_none(), "no entry once revoked");
    });
}
