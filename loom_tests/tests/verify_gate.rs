//! The rdma verifier's gate (`src/transport/rdma/verify/gate.rs`: what
//! decides when a verifier thread may still read a checksummed chunk's
//! local memory), modelled with loom: the chunk's bytes are a loom
//! `UnsafeCell` the verifier reads in steps under the gate, and the lane
//! withdraws the chunk and then writes the cell (the caller reusing the
//! memory once the chunk's leases are given back), so a step that could
//! overlap the reuse is reported as a data race.
//!
//! Checked by hand once (2026-11-27) that the models fail when the gate is
//! broken: a `step` that reads `withdrawn` under the lock but releases it
//! before the read fails both with loom's causality violation on the
//! chunk's bytes; a `withdraw` that sets the flag only when `try_lock`
//! finds the lock free (so it does not wait for a step in progress) fails
//! the first the same way (not the second: there loom reaches no
//! interleaving where the lane's `try_lock` finds a step holding the
//! lock).
#![cfg(loom)]

use kvring_loom::verify_gate::{Gate, VERDICT_GRACE};
use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicU64;
use loom::sync::atomic::Ordering::Relaxed;
use loom::sync::Arc;
use loom::thread;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc as Shared;
use std::time::{Duration, Instant};

/// Steps the verifier takes over the chunk (a chunk of two 1 MiB steps).
const STEPS: usize = 2;
/// What the chunk holds while it is leased, and what the caller writes.
const LEASED: u64 = 7;
const REUSED: u64 = 1;

struct Chunk {
    gate: Gate,
    bytes: UnsafeCell<u64>,
    /// Steps half done, counted mid-step.
    summed: AtomicU64,
}

impl Chunk {
    fn new() -> Arc<Self> {
        Arc::new(Self { gate: Gate::default(), bytes: UnsafeCell::new(LEASED), summed: AtomicU64::new(0) })
    }

    /// The verifier's local sum: up to [`STEPS`] steps, each reading the
    /// chunk under the gate, until one finds it withdrawn. The steps it
    /// took.
    fn sum(&self) -> usize {
        for step in 0..STEPS {
            let read = self.gate.step(|| {
                // A step reads for a while (1 MiB of CRC32C): its first
                // bytes, a point where the lane may run (a Relaxed count,
                // which orders nothing), then its last.
                // SAFETY (of the model): the gate says the lane waits for
                // this read; loom reports it if it could overlap the reuse.
                let first = self.bytes.with(|bytes| unsafe { *bytes });
                self.summed.fetch_add(1, Relaxed);
                // SAFETY: as above.
                (first, self.bytes.with(|bytes| unsafe { *bytes }))
            });
            match read {
                Some(values) => assert_eq!(values, (LEASED, LEASED), "a step read the caller's reused memory"),
                None => return step,
            }
        }
        STEPS
    }

    /// The lane's look at the verifier's progress (no verdict yet): the
    /// model's stand-in for `Verifier::poll`, which orders nothing.
    fn poll(&self) -> u64 {
        self.summed.load(Relaxed)
    }

    /// The caller's reuse once the lane gave the leases back.
    fn reuse(&self) {
        // SAFETY (of the model): a loom cell's pointer; loom itself
        // reports an access that no happens-before orders.
        self.bytes.with_mut(|bytes| unsafe { *bytes = REUSED });
    }
}

/// A verifier sums the chunk while the lane withdraws it (a cancel, a
/// deadline, an abort or the link dropped) and the caller then reuses the
/// memory: every step either ends before `withdraw` returns or reads
/// nothing. The model reaches every outcome: no step, one, both.
#[test]
fn no_step_reads_the_chunk_after_withdraw_returned() {
    let seen: Shared<[AtomicUsize; STEPS + 1]> = Shared::default();
    let counted = seen.clone();
    loom::model(move || {
        let seen = &counted;
        let chunk = Chunk::new();
        let verifier = {
            let chunk = chunk.clone();
            thread::spawn(move || chunk.sum())
        };
        // The lane looks for a verdict first (`Verifier::poll`), so it may
        // be anywhere when the verifier's step starts.
        chunk.poll();
        chunk.gate.withdraw();
        chunk.reuse();
        let steps = verifier.join().unwrap();
        seen[steps].fetch_add(1, Ordering::Relaxed);
        assert!(chunk.gate.step(|| ()).is_none(), "a step after the withdrawal ran");
    });
    for (steps, count) in seen.iter().enumerate() {
        assert!(count.load(Ordering::Relaxed) > 0, "no interleaving where the verifier took {steps} steps");
    }
}

/// The give-up path: the verifier bounds its sum (`step_until`) and
/// steps; the lane, polling past the bound and its grace, stops waiting
/// for the verdict and ends the chunk through `withdraw` (as
/// `Verifier::poll` does through `fail_where`), then the memory is
/// reused. Giving up opens no window onto the memory, and the two locks
/// of the gate never deadlock (loom reports a deadlock as a failure).
/// The model reaches a lane that gave up and one that did not.
#[test]
fn a_lane_that_gives_up_on_a_step_withdraws_before_the_memory_is_reused() {
    let seen: Shared<[AtomicUsize; 2]> = Shared::default();
    let counted = seen.clone();
    loom::model(move || {
        let seen = &counted;
        let chunk = Chunk::new();
        let verifier = {
            let chunk = chunk.clone();
            thread::spawn(move || {
                // A deadline already past: the lane may give up at once.
                chunk.gate.step_until(Instant::now());
                chunk.sum()
            })
        };
        // The lane polls long past the bound and its grace (loom does not
        // model time: an hour stands for "whenever the lane looks").
        let gave_up = chunk.gate.given_up(Instant::now() + VERDICT_GRACE + Duration::from_secs(3600));
        // Given up or cancelled, the lane ends the chunk the same way.
        chunk.gate.withdraw();
        chunk.reuse();
        verifier.join().unwrap();
        seen[usize::from(gave_up)].fetch_add(1, Ordering::Relaxed);
    });
    assert!(
        seen.iter().all(|count| count.load(Ordering::Relaxed) > 0),
        "both a lane that gave up and one that did not: {seen:?}"
    );
}
