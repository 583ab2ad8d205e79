//! A cancelled batch of 4,096 blocks on every transport (shm, cma, tcp;
//! cuda_ipc on the simulated GPU, rdma on the simulated verbs): it ends
//! `Cancelled` (or `Done` where nothing was left to withdraw), its leases
//! are released by the time it has ended (both regions unregister at once,
//! no `RegionBusy`), and nothing it held lands afterwards (a sentinel
//! written over the destination once it ended stays intact). No wall-clock
//! figure is asserted here: `cargo bench --bench cancel` measures the time
//! to cancel beside an uncancelled batch.

mod common;

use common::WAIT;
use kvring::gpu::SimGpu;
use kvring::{Batch, BatchState, BlockDesc, Engine, Outcome, Region, RegionId, RegionInfo, Segment, TransportKind};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCKS: u64 = 4096;
const BLOCK: u64 = 16 << 10;
const LEN: usize = (BLOCKS * BLOCK) as usize;
const SENTINEL: u8 = 0xa5;
/// Batches tried until one is caught in flight (cancelled once its first
/// block landed, a 64 MiB batch nearly always is, the first time).
const ROUNDS: usize = 8;
/// How long a late write is given to land before the sentinel is checked.
const SETTLE: Duration = Duration::from_millis(50);

/// The destination's memory, written and read back by the test.
enum Memory {
    Region(Region),
    Caller(Box<[u8]>),
}

impl Memory {
    fn fill(&mut self, byte: u8) {
        match self {
            // SAFETY: the batch has ended; nothing the engine holds names these bytes.
            Memory::Region(region) => unsafe { region.write_at(0, &vec![byte; region.len()]).unwrap() },
            Memory::Caller(bytes) => bytes.fill(byte),
        }
    }

    /// The destination's first 8 bytes, read while a batch may be writing
    /// them: a torn value only means the poll goes round again.
    fn first_word(&self) -> u64 {
        match self {
            Memory::Region(region) => u64::from_ne_bytes(common::read(region, 0, 8).try_into().unwrap()),
            // SAFETY: `bytes` is at least 8 bytes; a volatile read, as the
            // lane writes them behind the compiler's back.
            Memory::Caller(bytes) => {
                u64::from_ne_bytes(unsafe { std::ptr::read_volatile(bytes.as_ptr().cast::<[u8; 8]>()) })
            }
        }
    }

    fn bytes(&self) -> Vec<u8> {
        match self {
            Memory::Region(region) => common::read(region, 0, LEN),
            // Volatile: a late write by a lane would come behind the
            // compiler's back.
            // SAFETY: each index is inside `bytes`.
            Memory::Caller(bytes) => {
                (0..LEN).map(|i| unsafe { std::ptr::read_volatile(bytes.as_ptr().add(i)) }).collect()
            }
        }
    }
}

/// One transport's pair: the engines, the regions and the segment.
struct Case {
    what: &'static str,
    /// Whether a cancel can withdraw chunks the lane has taken (every
    /// transport but cuda_ipc, whose lane issues a part's copies at once).
    withdraws: bool,
    initiator: Engine,
    target: Engine,
    local: RegionId,
    remote: RegionId,
    destination: Memory,
    segment: Segment,
    _held: Vec<Region>,
    _source: Option<Box<[u8]>>,
}

fn caller(engine: &Engine) -> (RegionId, Box<[u8]>) {
    let mut memory = common::pattern(LEN, 3).into_boxed_slice();
    // SAFETY: the box outlives the registration (it is unregistered, or
    // its engine dropped, before the case drops it: fields drop in order).
    let id = unsafe { engine.register(memory.as_mut_ptr(), memory.len(), RegionInfo::raw()) }.unwrap();
    (id, memory)
}

/// Submits a write of 4,096 blocks and cancels it once its first block has
/// landed (so that it is caught in flight, not before a lane took it), up
/// to `ROUNDS` times until one ends `Cancelled`; then checks the leases and
/// that nothing lands after the end.
fn cancel_case(mut case: Case) {
    assert_eq!(case.segment.transport().name(), case.what, "the case's transport");
    let descs: Vec<BlockDesc> =
        (0..BLOCKS).map(|i| BlockDesc::new(case.local, i * BLOCK, case.remote, i * BLOCK, BLOCK)).collect();
    let first = u64::from_ne_bytes(common::pattern(8, 3).try_into().unwrap());
    let mut sub = case.initiator.submitter().unwrap();
    let reader = sub.status_reader();
    let mut caught = None;
    for round in 0..ROUNDS {
        case.destination.fill(0);
        let id = sub.submit(&Batch::write(&case.segment).descs(&descs)).unwrap();
        let deadline = Instant::now() + WAIT;
        while case.destination.first_word() != first && reader.state(id).unwrap() == BatchState::Pending {
            assert!(Instant::now() < deadline, "{}: the first block never landed", case.what);
            std::hint::spin_loop();
        }
        let in_flight = reader.state(id).unwrap() == BatchState::Pending;
        sub.cancel(id).unwrap();
        match sub.wait(id, WAIT).unwrap() {
            Outcome::Cancelled { bytes } => {
                assert!(bytes < LEN as u64, "{}: cancelled after all {bytes} bytes", case.what);
                eprintln!("{}: round {round} ended Cancelled after {bytes} of {LEN} bytes", case.what);
                caught = Some(bytes);
                break;
            }
            Outcome::Done { bytes } => {
                assert_eq!(bytes, LEN as u64, "{}", case.what);
                // A transport that had posted every chunk before the cancel
                // came has nothing to withdraw: caught in flight, it ends Done.
                if in_flight && !case.withdraws {
                    eprintln!("{}: round {round} was in flight at the cancel and ended Done", case.what);
                    caught = Some(bytes);
                    break;
                }
            }
            other => panic!("{}: a cancelled batch ended {other:?}", case.what),
        }
    }
    let bytes = caught.unwrap_or_else(|| panic!("{}: no batch of {ROUNDS} was caught in flight", case.what));
    // The batch has ended: nothing holds either region.
    case.initiator.unregister(case.local).unwrap_or_else(|e| panic!("{}: source still held: {e}", case.what));
    case.target.unregister(case.remote).unwrap_or_else(|e| panic!("{}: destination still held: {e}", case.what));
    // Nothing it held lands afterwards.
    case.destination.fill(SENTINEL);
    std::thread::sleep(SETTLE);
    let after = case.destination.bytes();
    let landed = after.iter().position(|b| *b != SENTINEL);
    assert_eq!(landed, None, "{}: a write landed after the batch ended Cancelled after {bytes} bytes", case.what);
    drop(sub);
}

#[test]
fn a_cancelled_shm_batch_releases_its_leases_and_nothing_lands_after() {
    let target = common::engine("cancel-shm-target");
    let remote = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let initiator = common::engine("cancel-shm-initiator");
    let local = initiator.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch names the region yet.
    unsafe { local.fill_pattern(3) };
    let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Shm), WAIT);
    let (local_id, remote_id) = (local.id(), remote.id());
    cancel_case(Case {
        what: "shm",
        withdraws: true,
        segment: segment.unwrap(),
        initiator,
        target,
        local: local_id,
        remote: remote_id,
        destination: Memory::Region(remote),
        _held: vec![local],
        _source: None,
    });
}

/// Caller memory on both sides (cma carries only that, and tcp reaches it).
fn caller_case(what: &'static str, transport: TransportKind) {
    let target = common::builder(&format!("cancel-{what}-target")).build().unwrap();
    let (remote, destination) = caller(&target);
    let initiator = common::engine(&format!("cancel-{what}-initiator"));
    let (local, source) = caller(&initiator);
    let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
    cancel_case(Case {
        what,
        withdraws: true,
        segment,
        initiator,
        target,
        local,
        remote,
        destination: Memory::Caller(destination),
        _held: vec![],
        _source: Some(source),
    });
}

#[test]
fn a_cancelled_cma_batch_releases_its_leases_and_nothing_lands_after() {
    caller_case("cma", TransportKind::Cma);
}

#[test]
fn a_cancelled_tcp_batch_releases_its_leases_and_nothing_lands_after() {
    caller_case("tcp", TransportKind::Tcp);
}

#[test]
fn a_cancelled_cuda_ipc_batch_on_the_simulated_gpu_releases_its_leases_and_nothing_lands_after() {
    // Each simulated copy takes 1 ms, as a copy engine's would take time.
    let gpu = Arc::new(SimGpu::new(2, Duration::from_millis(1)));
    let target = common::builder("cancel-ipc-target").gpu(gpu.clone()).build().unwrap();
    let remote = target.alloc_region(LEN, RegionInfo::raw().on_gpu(1)).unwrap();
    let initiator = common::builder("cancel-ipc-initiator").gpu(gpu).build().unwrap();
    let local = initiator.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch names the region yet.
    unsafe { local.fill_pattern(3) };
    let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::CudaIpc), WAIT);
    let (local_id, remote_id) = (local.id(), remote.id());
    cancel_case(Case {
        what: "cuda_ipc",
        withdraws: false,
        segment: segment.unwrap(),
        initiator,
        target,
        local: local_id,
        remote: remote_id,
        destination: Memory::Region(remote),
        _held: vec![local],
        _source: None,
    });
}

#[test]
fn a_cancelled_rdma_batch_on_the_simulated_verbs_releases_its_leases_and_nothing_lands_after() {
    let verbs = Arc::new(kvring::rdma::SimVerbs::new());
    let target = common::builder("cancel-rdma-target").rdma(verbs.clone()).build().unwrap();
    let (remote, destination) = caller(&target);
    let initiator = common::builder("cancel-rdma-initiator").rdma(verbs).build().unwrap();
    let (local, source) = caller(&initiator);
    let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Rdma), WAIT);
    cancel_case(Case {
        what: "rdma",
        withdraws: true,
        segment: segment.unwrap(),
        initiator,
        target,
        local,
        remote,
        destination: Memory::Caller(destination),
        _held: vec![],
        _source: Some(source),
    });
}
