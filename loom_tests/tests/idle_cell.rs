//! The data port's `IdleCell` (`src/net/idle_cell.rs`), modelled with loom:
//! the lane that serves a connection marks it idle between requests and
//! busy before it reads the next one, while the admission book claims an
//! idle connection's place for a newcomer. The connection's state is a
//! loom `UnsafeCell` the lane touches only while it serves and the book
//! only once its claim won, so a claim that could overlap serving is
//! reported as a data race.
#![cfg(loom)]

use kvring_loom::idle_cell::IdleCell;
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;
use std::time::{Duration, Instant};

struct Conn {
    cell: IdleCell,
    /// What the lane serves into, and the book's close writes.
    state: UnsafeCell<u32>,
}

/// The lane serves `requests` requests, going idle before each; it stops
/// once the cell says its place was taken. The number it served.
fn lane(conn: &Conn, requests: u32) -> u32 {
    let t0 = Instant::now();
    for n in 0..requests {
        if !conn.cell.idle(t0 + Duration::from_secs(u64::from(n))) || !conn.cell.busy() {
            return n;
        }
        // SAFETY (of the model): the cell says this lane alone holds it.
        conn.state.with_mut(|s| unsafe { *s += 1 });
    }
    requests
}

/// The book looks at the cell once and claims the tick it saw.
fn book(conn: &Conn) -> bool {
    let Some(since) = conn.cell.idle_since() else { return false };
    if !conn.cell.claim(since) {
        return false;
    }
    // SAFETY (of the model): the claim won: the lane serves nothing more.
    conn.state.with_mut(|s| unsafe { *s = u32::MAX });
    true
}

/// A claim and the lane's next request never both win: the lane never
/// serves after its place was taken, and a connection that went busy is
/// never taken.
#[test]
fn a_claim_never_overlaps_serving() {
    loom::model(|| {
        let conn = Arc::new(Conn { cell: IdleCell::default(), state: UnsafeCell::new(0) });
        let served = {
            let conn = conn.clone();
            thread::spawn(move || lane(&conn, 2))
        };
        let claimed = book(&conn);
        let served = served.join().unwrap();
        // SAFETY (of the model): both threads are done.
        let state = conn.state.with(|s| unsafe { *s });
        if claimed {
            assert_eq!(state, u32::MAX, "the lane served after the claim");
            assert!(served < 2, "a claimed connection cannot have served everything");
            assert!(!conn.cell.busy() && conn.cell.idle_since().is_none(), "evicted for good");
        } else {
            assert_eq!(state, served, "every request the lane took was served");
        }
    });
}

/// Two claims of the same tick (a book that looked twice): at most one wins.
#[test]
fn a_tick_is_claimed_at_most_once() {
    loom::model(|| {
        let conn = Arc::new(Conn { cell: IdleCell::default(), state: UnsafeCell::new(0) });
        assert!(conn.cell.idle(Instant::now()));
        let since = conn.cell.idle_since().expect("idle");
        let other = {
            let conn = conn.clone();
            thread::spawn(move || conn.cell.claim(since))
        };
        let lane_busy = conn.cell.busy();
        let mine = conn.cell.claim(since);
        let theirs = other.join().unwrap();
        assert!(!(mine && theirs), "one tick claimed twice");
        assert_ne!(lane_busy, theirs || mine, "exactly one of the lane and a claim wins");
    });
}
