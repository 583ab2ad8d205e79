//! The engine's sum gate (`src/engine/sums/gate.rs`: what bounds the sums
//! run for peers and decides when none reads the caller's memory any
//! more), modelled with loom: sums enter the gate and read the memory (a
//! loom `UnsafeCell`) while the engine's drop closes the gate and then
//! frees the memory (writes the cell), so a sum that could overlap the
//! free is reported as a data race; and sums from two sources race to
//! enter, counting themselves inside, so a gate that lets in more than
//! its bounds fails the model's assertions.
//!
//! Checked by hand once (2026-11-27) that the models fail when the gate is
//! broken: a `close_and_wait` that sets `closed` but does not wait fails
//! the first model (loom's causality violation on the memory), and an
//! `enter` comparing with `>` instead of `>=` (one sum past each bound)
//! fails both bounds models.
#![cfg(loom)]

use kvring_loom::sum_gate::{Gate, Refused};
use loom::cell::UnsafeCell;
use loom::sync::atomic::AtomicUsize;
use loom::sync::atomic::Ordering::SeqCst;
use loom::sync::Arc;
use loom::thread;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize as Seen, Ordering};
use std::sync::Arc as Shared;

/// What the memory holds while registered, and what the free leaves.
const LIVE: u64 = 7;
const FREED: u64 = 0;
/// The preemptions the bounds models explore (see [`bounded`]).
const PREEMPTIONS: usize = 4;

fn source(n: u8) -> Option<IpAddr> {
    Some(IpAddr::from([10, 0, 0, n]))
}

struct Engine {
    gate: Gate,
    memory: UnsafeCell<u64>,
}

impl Engine {
    /// One sum for a peer at `from`: true when it entered and read.
    fn sum(&self, from: Option<IpAddr>) -> bool {
        let Ok(_running) = self.gate.enter(from) else { return false };
        // SAFETY (of the model): the gate says the close waits for this
        // read; loom reports it if it could overlap the free.
        let value = self.memory.with(|memory| unsafe { *memory });
        assert_eq!(value, LIVE, "a sum read freed memory");
        true
    }
}

/// Two sums (from two sources) race the engine's drop, which closes the
/// gate and then frees the memory: every sum's read happens before the
/// close returns, or the sum is refused; a closed gate admits none. The
/// model reaches every outcome: no sum read, one, both.
#[test]
fn no_sum_reads_the_memory_after_the_close_returned() {
    let seen: Shared<[Seen; 3]> = Shared::default();
    let counted = seen.clone();
    loom::model(move || {
        let seen = &counted;
        let engine = Arc::new(Engine { gate: Gate::new(2, 1), memory: UnsafeCell::new(LIVE) });
        let sums: Vec<_> = [1, 2]
            .map(|n| {
                let engine = engine.clone();
                thread::spawn(move || engine.sum(source(n)))
            })
            .into();
        engine.gate.close_and_wait();
        // SAFETY (of the model): a loom cell's pointer; loom itself
        // reports an access that no happens-before orders.
        engine.memory.with_mut(|memory| unsafe { *memory = FREED });
        assert_eq!(engine.gate.enter(source(1)).err(), Some(Refused::Closed), "a closed gate admitted a sum");
        let read = sums.into_iter().map(|sum| usize::from(sum.join().unwrap())).sum::<usize>();
        seen[read].fetch_add(1, Ordering::Relaxed);
    });
    for (read, count) in seen.iter().enumerate() {
        assert!(count.load(Ordering::Relaxed) > 0, "no interleaving where {read} sums read");
    }
}

/// Who is inside the gate, counted by the sums themselves between their
/// entry and their exit, in one word (one loom access per count): all of
/// them in the low byte, those from source 1 in the next.
const ONE: usize = 1;
const ONE_FROM_FIRST: usize = 1 << 8;

/// Three sums, two of them from source 1, enter the gate at once under
/// the bounds `(total, per_source)`: in no interleaving are more than
/// `total` inside, or more than `per_source` from source 1. `refused` is
/// the refusal the bounds must produce in some interleaving.
fn bounded(total: usize, per_source: usize, refused: Refused) {
    let refusals = Shared::new(Seen::new(0));
    let all_in = Shared::new(Seen::new(0));
    let counted = (refusals.clone(), all_in.clone());
    // Three threads each locking twice: unbounded, loom runs for many
    // minutes; four preemptions take about a second here, five about
    // seven (LOOM_MAX_PREEMPTIONS still overrides).
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = builder.preemption_bound.or(Some(PREEMPTIONS));
    builder.check(move || {
        let (refusals, all_in) = &counted;
        let gate = Arc::new(Gate::new(total, per_source));
        let inside = Arc::new(AtomicUsize::new(0));
        let enter = move |gate: &Gate, inside: &AtomicUsize, from: u8| match gate.enter(source(from)) {
            Ok(running) => {
                let me = if from == 1 { ONE + ONE_FROM_FIRST } else { ONE };
                let now = inside.fetch_add(me, SeqCst) + me;
                let (all, first) = (now & 0xff, now >> 8);
                assert!(all <= total, "{all} sums inside a gate bounded to {total}");
                assert!(first <= per_source, "{first} sums from one source, bounded to {per_source}");
                inside.fetch_sub(me, SeqCst);
                drop(running);
                None
            }
            Err(why) => Some(why),
        };
        let others: Vec<_> = [1, 2]
            .map(|from| {
                let (gate, inside) = (gate.clone(), inside.clone());
                thread::spawn(move || enter(&gate, &inside, from))
            })
            .into();
        let mut why = vec![enter(&gate, &inside, 1)];
        why.extend(others.into_iter().map(|other| other.join().unwrap()));
        assert!(!why.contains(&Some(Refused::Closed)), "an open gate refused as closed");
        if why.contains(&Some(refused)) {
            refusals.fetch_add(1, Ordering::Relaxed);
        }
        if why.iter().all(Option::is_none) {
            all_in.fetch_add(1, Ordering::Relaxed);
        }
    });
    assert!(refusals.load(Ordering::Relaxed) > 0, "no interleaving met the bound ({refused:?})");
    assert!(all_in.load(Ordering::Relaxed) > 0, "no interleaving where the sums came one after another");
}

/// At most two inside in all (two from one source would be allowed).
#[test]
fn never_more_sums_inside_than_the_total_bound() {
    bounded(2, 2, Refused::Total);
}

/// At most one from one source (three in all would be allowed).
#[test]
fn never_more_sums_from_one_source_than_its_bound() {
    bounded(3, 1, Refused::Source);
}
