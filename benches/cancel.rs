//! Time to cancel a batch of 4,096 blocks (16 KiB each, 64 MiB), per
//! transport, beside the same batch left to finish, interleaved in one
//! run: the uncancelled batch is timed from submit to its end, the
//! cancelled one from `cancel` (called right after submit) to its end,
//! which is when its leases are released and nothing of it can land.
//!
//! `cargo bench --bench cancel -- --rounds 50` (`-- --test`: one round, the
//! CI smoke run). Prints one line per transport: p50 and p99 of both, in
//! microseconds; the cancel's time as MiB moved at its round's uncancelled
//! pace (what it waited for, in bytes, whatever the host's load did to the
//! pace: tcp's send window alone is 2 MiB); and how many cancelled batches
//! ended `Cancelled` (the rest had nothing left to withdraw and ended
//! `Done`).

use kvring::{Batch, BlockDesc, Engine, Outcome, RegionId, RegionInfo, Segment, TransportKind};
use std::time::{Duration, Instant};

#[path = "common/rounds.rs"]
mod rounds;

const BLOCKS: u64 = 4096;
const BLOCK: u64 = 16 << 10;
const LEN: usize = (BLOCKS * BLOCK) as usize;
const WAIT: Duration = Duration::from_secs(30);
const DEFAULT_ROUNDS: usize = 30;
/// How far into the batch the cancel comes.
const INTO: Duration = Duration::from_millis(2);

fn engine(name: &str) -> Engine {
    Engine::builder().name(name).arena_descs(BLOCKS as usize).build().expect("engine starts")
}

/// Caller memory, registered (cma reaches only that; tcp takes any).
fn caller(engine: &Engine, memory: &mut [u8]) -> RegionId {
    // SAFETY: `memory` outlives the engine (dropped by `main` after it).
    unsafe { engine.register(memory.as_mut_ptr(), memory.len(), RegionInfo::raw()) }.expect("register")
}

fn percentile(samples: &mut [f64], p: f64) -> f64 {
    samples.sort_by(f64::total_cmp);
    let i = ((samples.len() - 1) as f64 * p).round() as usize;
    samples[i]
}

fn micros(samples: &[Duration]) -> Vec<f64> {
    samples.iter().map(|d| d.as_secs_f64() * 1e6).collect()
}

fn measure(what: &str, initiator: &Engine, segment: &Segment, local: RegionId, remote: RegionId, rounds: usize) {
    assert_eq!(segment.transport().name(), what);
    let descs: Vec<BlockDesc> =
        (0..BLOCKS).map(|i| BlockDesc::new(local, i * BLOCK, remote, i * BLOCK, BLOCK)).collect();
    let batch = Batch::write(segment).descs(&descs);
    let mut sub = initiator.submitter().expect("submitter");
    let (mut whole, mut cancel, mut cancelled, mut early) = (Vec::new(), Vec::new(), 0, 0);
    // Each cancel's time in MiB moved at its round's uncancelled pace: what
    // it waited for, as bytes, whatever the host's load did to the pace.
    let mut drained_mib = Vec::new();
    for _ in 0..rounds {
        let started = Instant::now();
        let id = sub.submit(&batch).expect("submit");
        assert!(sub.wait(id, WAIT).expect("wait").is_done());
        let round_whole = started.elapsed();
        whole.push(round_whole);

        let id = sub.submit(&batch).expect("submit");
        // Cancelled in flight, INTO the batch (not before a lane took it).
        if sub.wait(id, INTO).is_ok() {
            early += 1; // ended before the cancel: nothing to time
            continue;
        }
        let started = Instant::now();
        sub.cancel(id).expect("cancel");
        match sub.wait(id, WAIT).expect("wait") {
            Outcome::Cancelled { .. } => cancelled += 1,
            Outcome::Done { .. } => {}
            other => panic!("{what}: a cancelled batch ended {other:?}"),
        }
        let took = started.elapsed();
        cancel.push(took);
        let mib_per_s = (LEN >> 20) as f64 / round_whole.as_secs_f64();
        drained_mib.push(took.as_secs_f64() * mib_per_s);
    }
    if cancel.is_empty() {
        println!("cancel/{what}: every batch ended within {INTO:?}, before its cancel: nothing timed");
        return;
    }
    let (mut whole, mut cancel) = (micros(&whole), micros(&cancel));
    let (w50, w99) = (percentile(&mut whole, 0.5), percentile(&mut whole, 0.99));
    let (c50, c99) = (percentile(&mut cancel, 0.5), percentile(&mut cancel, 0.99));
    let (d50, d99) = (percentile(&mut drained_mib, 0.5), percentile(&mut drained_mib, 0.99));
    println!(
        "cancel/{what}: {BLOCKS} x {} KiB: uncancelled p50 {w50:.0} us p99 {w99:.0} us; \
         cancel-to-end p50 {c50:.0} us p99 {c99:.0} us ({:.3}x of uncancelled p50); as MiB at the round's uncancelled pace p50 {d50:.2} p99 {d99:.2}; \
         {cancelled}/{} ended Cancelled ({early} ended before the cancel, untimed)",
        BLOCK >> 10,
        c50 / w50,
        cancel.len(),
    );
}

fn main() {
    let rounds = rounds::rounds(1, DEFAULT_ROUNDS);
    let target = engine("bench-cancel-target");
    let initiator = engine("bench-cancel-initiator");
    let addr = target.control_addr().to_string();

    let remote = target.alloc_region(LEN, RegionInfo::raw()).expect("region");
    let local = initiator.alloc_region(LEN, RegionInfo::raw()).expect("region");
    // SAFETY: no batch names the region yet.
    unsafe { local.fill_pattern(1) };
    let shm = initiator.open_segment_with(&addr, Some(TransportKind::Shm), WAIT).expect("shm");
    measure("shm", &initiator, &shm, local.id(), remote.id(), rounds);
    initiator.close_segment(&shm);

    let mut theirs = vec![0u8; LEN];
    let mut ours = vec![1u8; LEN];
    let (remote, local) = (caller(&target, &mut theirs), caller(&initiator, &mut ours));
    for kind in [TransportKind::Cma, TransportKind::Tcp] {
        let segment = initiator.open_segment_with(&addr, Some(kind), WAIT).expect("segment");
        measure(kind.name(), &initiator, &segment, local, remote, rounds);
        initiator.close_segment(&segment);
    }
    drop(initiator);
    drop(target);
    drop((theirs, ours));
}
