//! Fenced destinations: what a fence costs and what checking grants costs
//! a push, each beside its baseline in the same run, interleaved.
//!
//! - `fence/idle`: `Engine::fence` of an idle range (nothing writing) beside
//!   one tcp round trip (a 64-byte push over tcp to the same target, submit
//!   to end): the target fences without a message, so the ratio is < 1.
//! - `fence/<transport>`: a push of 16 x 64 KiB blocks naming its grant
//!   into a fenced range of a region holding 16 other requests' fences,
//!   beside the same push into a region never fenced (no grant); shm, tcp
//!   and cma from host memory, cuda_ipc device to device on the simulated
//!   GPU (its copy engine is host memcpy after a 10 us delay: the row
//!   measures the check and the held pass, not a real GPU's copy).
//! - `fence/rdma-idle`: `Engine::fence` of an idle range of a target with
//!   one rdma writer connected (the fence is pushed to it and answered:
//!   one control round trip over a kept connection) beside one tcp round
//!   trip to the same target; `fence/rdma`: the granted push, as above,
//!   over rdma (the simulated provider: its NIC is a memcpy under a lock,
//!   so the row measures the mirror check and the held counts).
//!
//! `cargo bench --bench fence -- --rounds 2000` (`-- --test`: a few rounds,
//! the CI smoke run). Prints p50 of each, in microseconds, and the ratio.

use kvring::{Batch, BlockDesc, Engine, RegionId, RegionInfo, Segment, TransportKind};
use std::time::{Duration, Instant};

#[path = "common/rounds.rs"]
mod rounds;

const BLOCKS: u64 = 16;
const BLOCK: u64 = 64 << 10;
const LEN: usize = (BLOCKS * BLOCK) as usize;
const WAIT: Duration = Duration::from_secs(30);
const DEFAULT_ROUNDS: usize = 1000;

fn p50(samples: &mut [Duration]) -> f64 {
    samples.sort();
    samples[samples.len() / 2].as_secs_f64() * 1e6
}

fn push(sub: &mut kvring::Submitter, batch: &Batch) -> Duration {
    let started = Instant::now();
    let id = sub.submit(batch).expect("submit");
    let outcome = sub.wait(id, WAIT).expect("wait");
    assert!(outcome.is_done(), "the push lands: {outcome:?}");
    started.elapsed()
}

/// Caller memory, registered (cma reaches only that; tcp takes any).
fn caller(engine: &Engine, memory: &mut [u8]) -> RegionId {
    // SAFETY: `memory` outlives the engine (dropped by `main` after it).
    unsafe { engine.register(memory.as_mut_ptr(), memory.len(), RegionInfo::raw()) }.expect("register")
}

/// The same push into `plain` (never fenced) and, naming its grant, into
/// the first `LEN` bytes of `fenced` (beside 16 other requests' fences:
/// the cma page's table is the engine's, and the bench stays within its 72
/// entries, past which a fold would refuse grant 0 in every region).
fn checked(
    what: &str,
    target: &Engine,
    sub: &mut kvring::Submitter,
    segment: &Segment,
    regions: [RegionId; 3],
    rounds: usize,
) {
    let [local, plain, fenced] = regions;
    for r in 1..=16u64 {
        target.fence(fenced, r * LEN as u64, LEN as u64).expect("fence");
    }
    let grant = target.fence(fenced, 0, LEN as u64).expect("fence");
    let descs =
        |remote| (0..BLOCKS).map(|i| BlockDesc::new(local, i * BLOCK, remote, i * BLOCK, BLOCK)).collect::<Vec<_>>();
    let (to_plain, to_fenced) = (descs(plain), descs(fenced));
    let (plain_batch, fenced_batch) =
        (Batch::write(segment).descs(&to_plain), Batch::write(segment).descs(&to_fenced).grant(grant));
    let (mut base, mut with) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        base.push(push(sub, &plain_batch));
        with.push(push(sub, &fenced_batch));
    }
    let (b, w) = (p50(&mut base), p50(&mut with));
    println!("fence/{what}: {BLOCKS} x {} KiB push: unfenced p50 {b:.1} us, granted into a fenced range p50 {w:.1} us ({:.3}x)", BLOCK >> 10, w / b);
}

fn main() {
    let rounds = rounds::rounds(3, DEFAULT_ROUNDS);
    let target = Engine::builder().name("bench-fence-target").build().expect("engine");
    let initiator = Engine::builder().name("bench-fence-initiator").build().expect("engine");
    let addr = target.control_addr().to_string();
    let mut sub = initiator.submitter().expect("submitter");

    // Host memory of the caller's: tcp and cma reach it (registered before
    // the segments open, so their descriptors list it).
    let mut ours = vec![1u8; LEN];
    let mut plain = vec![0u8; LEN];
    let mut idle = vec![0u8; 8 * LEN];
    let mut fenced: Vec<Vec<u8>> = (0..2).map(|_| vec![0u8; 17 * LEN]).collect();
    let local = caller(&initiator, &mut ours);
    let (plain_id, idle_id) = (caller(&target, &mut plain), caller(&target, &mut idle));
    let fenced_ids: Vec<RegionId> = fenced.iter_mut().map(|memory| caller(&target, memory)).collect();

    // An idle fence beside a tcp round trip.
    let tcp = initiator.open_segment_with(&addr, Some(TransportKind::Tcp), WAIT).expect("tcp");
    let tiny = Batch::write(&tcp).block(BlockDesc::new(local, 0, plain_id, 0, 64));
    let (mut trip, mut fence) = (Vec::new(), Vec::new());
    for i in 0..rounds as u64 {
        trip.push(push(&mut sub, &tiny));
        let started = Instant::now();
        target.fence(idle_id, (i % 8) * LEN as u64, 4096).expect("fence");
        fence.push(started.elapsed());
    }
    let (t, f) = (p50(&mut trip), p50(&mut fence));
    println!(
        "fence/idle: fence of an idle range p50 {f:.1} us, one tcp round trip (64-byte push) p50 {t:.1} us ({:.3}x)",
        f / t
    );

    checked("tcp", &target, &mut sub, &tcp, [local, plain_id, fenced_ids[0]], rounds);
    initiator.close_segment(&tcp);
    let cma = initiator.open_segment_with(&addr, Some(TransportKind::Cma), WAIT).expect("cma");
    checked("cma", &target, &mut sub, &cma, [local, plain_id, fenced_ids[1]], rounds);
    initiator.close_segment(&cma);

    // shm-backed regions: the region file's table.
    let remote_plain = target.alloc_region(LEN, RegionInfo::raw()).expect("region");
    let remote_fenced = target.alloc_region(17 * LEN, RegionInfo::raw()).expect("region");
    let mine = initiator.alloc_region(LEN, RegionInfo::raw()).expect("region");
    let shm = initiator.open_segment_with(&addr, Some(TransportKind::Shm), WAIT).expect("shm");
    checked("shm", &target, &mut sub, &shm, [mine.id(), remote_plain.id(), remote_fenced.id()], rounds);
    drop(sub);
    drop(initiator);
    drop(target);

    // cuda_ipc on the simulated GPU: device to device, the GPU region's
    // own table page (mapped by the initiator's lane, held until each
    // chunk's event completed).
    let gpu: std::sync::Arc<dyn kvring::gpu::Gpu> =
        std::sync::Arc::new(kvring::gpu::SimGpu::new(1, Duration::from_micros(10)));
    let target = Engine::builder().name("bench-fence-gpu-target").gpu(gpu.clone()).build().expect("engine");
    let initiator = Engine::builder().name("bench-fence-gpu-initiator").gpu(gpu).build().expect("engine");
    let on_gpu = RegionInfo::raw().on_gpu(0);
    let remote_plain = target.alloc_region(LEN, on_gpu).expect("region");
    let remote_fenced = target.alloc_region(17 * LEN, on_gpu).expect("region");
    let mine = initiator.alloc_region(LEN, on_gpu).expect("region");
    let mut sub = initiator.submitter().expect("submitter");
    let ipc = initiator
        .open_segment_with(&target.control_addr().to_string(), Some(TransportKind::CudaIpc), WAIT)
        .expect("cuda_ipc");
    checked("cuda_ipc", &target, &mut sub, &ipc, [mine.id(), remote_plain.id(), remote_fenced.id()], rounds);
    drop(sub);
    drop(initiator);
    drop(target);
    drop((ours, plain, idle, fenced));
    rdma(rounds);
}

/// The rdma rows, on the simulated provider.
fn rdma(rounds: usize) {
    let sim = std::sync::Arc::new(kvring::rdma::SimVerbs::new());
    let target = Engine::builder().name("bench-fence-rdma-target").rdma(sim.clone()).build().expect("engine");
    let initiator = Engine::builder().name("bench-fence-rdma-initiator").rdma(sim).build().expect("engine");
    let addr = target.control_addr().to_string();
    let remote_plain = target.alloc_region(LEN, RegionInfo::raw()).expect("region");
    let remote_fenced = target.alloc_region(17 * LEN, RegionInfo::raw()).expect("region");
    let idle = target.alloc_region(8 * LEN, RegionInfo::raw()).expect("region");
    let mine = initiator.alloc_region(LEN, RegionInfo::raw()).expect("region");
    let mut sub = initiator.submitter().expect("submitter");
    let rdma = initiator.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT).expect("rdma");
    // The tcp baseline from another engine: one engine holds one segment
    // per peer, and opening it over tcp would close the rdma link.
    let other = Engine::builder().name("bench-fence-rdma-tcp").build().expect("engine");
    let theirs = other.alloc_region(LEN, RegionInfo::raw()).expect("region");
    let mut other_sub = other.submitter().expect("submitter");
    let tcp = other.open_segment_with(&addr, Some(TransportKind::Tcp), WAIT).expect("tcp");
    let tiny = Batch::write(&tcp).block(BlockDesc::new(theirs.id(), 0, remote_plain.id(), 0, 64));
    let (mut trip, mut fence) = (Vec::new(), Vec::new());
    for i in 0..rounds as u64 {
        trip.push(push(&mut other_sub, &tiny));
        let started = Instant::now();
        target.fence(idle.id(), (i % 8) * LEN as u64, 4096).expect("fence");
        fence.push(started.elapsed());
    }
    assert_eq!(target.rdma_accepted_qps(), 1, "the rdma writer answered every fence");
    let (t, f) = (p50(&mut trip), p50(&mut fence));
    println!(
        "fence/rdma-idle: fence of an idle range with one rdma writer p50 {f:.1} us, one tcp round trip (64-byte \
         push) p50 {t:.1} us ({:.3}x)",
        f / t
    );
    other.close_segment(&tcp);
    checked("rdma", &target, &mut sub, &rdma, [mine.id(), remote_plain.id(), remote_fenced.id()], rounds);
}
