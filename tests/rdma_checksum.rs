//! End-to-end checksums over rdma: a checksummed chunk is verified once its
//! work requests completed, by asking the target (on the control plane)
//! for the CRC32C of what landed; the batch is done only then. A block
//! corrupted where it landed (the `testing` feature's hook: the test
//! flips the byte in the target engine's memory for a WRITE, in this
//! engine's for a READ) fails the batch `Corrupt` naming it; a region
//! peers may not read, a tagged push and GPU memory are refused with the
//! reason; a target that does not answer ends the batch at its deadline.
//!
//! On the simulated verbs provider, and with `RDMA_TEST_PROVIDER=ibverbs`
//! on the real one over the fake libibverbs (tests/common/verbs.rs).

mod common;

use common::verbs::Provider;
use common::WAIT;
use kvring::testing::checksum::{corrupt_landing_at, corrupt_rdma_landings_with};
use kvring::{Access, Batch, BlockDesc, Engine, Error, Outcome, Region, RegionInfo, Segment, TransportKind};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

const BLOCK: u64 = 16 << 10;
const BLOCKS: u64 = 8;
const LEN: usize = (BLOCK * BLOCKS) as usize;

/// The corruption hook and the stall are process-wide: tests that verify
/// take turns.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> MutexGuard<'static, ()> {
    let guard = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    corrupt_landing_at(u64::MAX);
    corrupt_rdma_landings_with(None);
    guard
}

/// A target with a region peers may read and write and one they may only
/// write, an initiator with a patterned region, and its rdma segment.
struct Pair {
    _provider: Provider,
    initiator: Engine,
    local: Region,
    segment: Segment,
    remote: Region,
    write_only: Region,
    _target: Engine,
}

fn pair(name: &str) -> Pair {
    let provider = Provider::new();
    let target = provider.apply(common::builder(&format!("{name}-target"))).build().unwrap();
    let remote = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let write_only = target
        .alloc_region(
            LEN,
            RegionInfo::raw().with_access(Access::LOCAL_READ | Access::LOCAL_WRITE | Access::REMOTE_WRITE),
        )
        .unwrap();
    let initiator = provider.apply(common::builder(&format!("{name}-initiator"))).build().unwrap();
    let local = initiator.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { local.fill_pattern(41) };
    let addr = target.control_addr().to_string();
    let segment = initiator.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT).unwrap();
    assert_eq!(segment.transport(), TransportKind::Rdma);
    Pair { _provider: provider, initiator, local, segment, remote, write_only, _target: target }
}

impl Pair {
    fn descs(&self, to: &Region) -> Vec<BlockDesc> {
        (0..BLOCKS).map(|i| BlockDesc::new(self.local.id(), i * BLOCK, to.id(), i * BLOCK, BLOCK)).collect()
    }

    fn run(&self, batch: Batch<'_>, deadline: Duration) -> Outcome {
        let mut sub = self.initiator.submitter().unwrap();
        let id = sub.submit(&batch.deadline(deadline)).unwrap();
        sub.wait(id, WAIT).unwrap()
    }

    fn write(&self) -> Outcome {
        let descs = self.descs(&self.remote);
        self.run(Batch::write(&self.segment).descs(&descs).checksum(true), WAIT)
    }

    fn read(&self) -> Outcome {
        let descs = self.descs(&self.remote);
        self.run(Batch::read(&self.segment).descs(&descs).checksum(true), WAIT)
    }
}

fn contents(region: &Region) -> Vec<u8> {
    let mut out = vec![0u8; region.len()];
    // SAFETY: no batch naming these bytes is in flight.
    unsafe { region.read_at(0, &mut out).unwrap() };
    out
}

fn corrupt_block(outcome: Outcome) -> (u32, String) {
    match outcome {
        Outcome::Failed(error @ Error::Corrupt { .. }) => {
            let message = error.to_string();
            let Error::Corrupt { desc_index, .. } = error else { unreachable!() };
            (desc_index, message)
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

fn unsupported(outcome: Outcome) -> String {
    match outcome {
        Outcome::Failed(error @ Error::Unsupported { .. }) => error.to_string(),
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

/// Checksummed WRITEs and READs of several blocks over rdma are verified
/// at the target and done, with the right bytes; a WRITE whose block 5
/// is corrupted where it landed (in the target's memory, after its
/// completion) fails `Corrupt` naming block 5, and a READ whose block 3
/// is corrupted here fails naming block 3; neither is reported done.
#[test]
fn checksummed_rdma_pushes_and_pulls_are_verified_and_a_corrupted_landing_fails_naming_its_block() {
    let _turn = turn();
    let pair = pair("sum-rdma");
    assert!(pair.write().is_done());
    assert!(contents(&pair.remote) == common::pattern(LEN, 41), "a verified push left the initiator's bytes");
    // Many chunks (the lane hands rdma 256 blocks at a time), each verified.
    let many: Vec<BlockDesc> =
        (0..600).map(|i| BlockDesc::new(pair.local.id(), i * 128, pair.remote.id(), i * 128, 128)).collect();
    let outcome = pair.run(Batch::write(&pair.segment).descs(&many).checksum(true), WAIT);
    assert!(matches!(outcome, Outcome::Done { bytes } if bytes == 600 * 128), "{outcome:?}");

    let target_region = pair.remote.clone();
    corrupt_rdma_landings_with(Some(Box::new(move |region, offset| {
        assert_eq!(region, target_region.id().raw(), "the hook names the region the block landed in");
        let mut byte = [0u8];
        // SAFETY: the WRITE naming this byte completed (the NIC is done
        // with it) and nothing else writes it: a stray writer of the test's.
        unsafe {
            target_region.read_at(offset, &mut byte).unwrap();
            target_region.write_at(offset, &[byte[0] ^ 0x5a]).unwrap();
        }
    })));
    corrupt_landing_at(5 * BLOCK);
    let (block, message) = corrupt_block(pair.write());
    assert_eq!(block, 5, "{message}");
    assert!(message.contains("once written over rdma") && message.contains("CRC32C"), "{message}");
    assert!(pair.write().is_done(), "the hook was taken: the next push is done (and repairs the byte)");

    // SAFETY: no batch touches these bytes now.
    unsafe { pair.local.fill_pattern(7) };
    assert!(pair.read().is_done());
    assert!(contents(&pair.local) == common::pattern(LEN, 41), "a verified pull left the target's bytes");
    corrupt_landing_at(3 * BLOCK);
    let (block, message) = corrupt_block(pair.read());
    assert_eq!(block, 3, "{message}");
    assert!(message.contains("once read over rdma"), "{message}");
    assert!(pair.read().is_done());
    corrupt_rdma_landings_with(None);
}

/// A region peers may write but not read cannot be verified (the target
/// would refuse its CRC: it would reveal the region's contents): a
/// checksummed push into it is refused with that reason before a byte
/// moves, never passed unchecked; unchecked, it is written. A tagged
/// checksummed push is refused (the target counts its arrival before the
/// initiator verified it).
#[test]
fn a_write_only_destination_and_a_tagged_push_are_refused_with_the_reason() {
    let _turn = turn();
    let pair = pair("sum-rdma-refused");
    let descs = pair.descs(&pair.write_only);
    let message = unsupported(pair.run(Batch::write(&pair.segment).descs(&descs).checksum(true), WAIT));
    assert!(message.contains("does not let peers read it"), "{message}");
    assert!(contents(&pair.write_only).iter().all(|&b| b == 0), "nothing of a refused push landed");
    assert!(pair.run(Batch::write(&pair.segment).descs(&descs), WAIT).is_done());

    let descs = pair.descs(&pair.remote);
    let tagged = Batch::write(&pair.segment).descs(&descs).checksum(true).arrival_tag(9);
    let message = unsupported(pair.run(tagged, WAIT));
    assert!(message.contains("arrival tag over rdma"), "{message}");
}

/// A target that never answers the verify request: the batch ends
/// `TimedOut` at its own deadline, not reported done; one cancelled while
/// it waits ends `Cancelled`; once the target answers again, the next
/// checksummed push is verified and done.
#[test]
fn a_target_that_never_answers_ends_the_batch_at_its_deadline_or_its_cancel() {
    let _turn = turn();
    let pair = pair("sum-rdma-stall");
    assert!(pair.write().is_done(), "the verifier is connected");
    let stalled = kvring::testing::stall_crc32c_answers();
    let descs = pair.descs(&pair.remote);
    let outcome = pair.run(Batch::write(&pair.segment).descs(&descs).checksum(true), Duration::from_millis(300));
    assert!(matches!(outcome, Outcome::TimedOut { .. }), "{outcome:?}");

    // Cancelled once its chunk waits on the verdict (the question reached
    // the target): it ends Cancelled at once, not when the target answers.
    let mut sub = pair.initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&pair.segment).descs(&descs).checksum(true).deadline(WAIT)).unwrap();
    let asked = std::time::Instant::now() + WAIT;
    while stalled.waiting() < 2 {
        assert!(std::time::Instant::now() < asked, "the verification never reached the target");
        std::thread::sleep(Duration::from_millis(1));
    }
    sub.cancel(id).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(matches!(outcome, Outcome::Cancelled { .. }), "{outcome:?}");
    drop(stalled);
    assert!(pair.write().is_done(), "verified again once the target answers");
}

/// A checksummed block of GPU memory over rdma is still refused, with the
/// reason (no checksum kernel), before anything is posted; unchecked, it
/// moves. On the simulator (a GPU region over the fake needs the fake
/// libcuda: .ci/stage-fakerdmagpu.sh).
#[test]
fn a_checksummed_gpu_block_over_rdma_is_refused_with_the_reason() {
    use kvring::gpu::{CudaGpu, Gpu, SimGpu};
    let provider = Provider::new();
    // On the real verbs provider, the CUDA provider on the fake libcuda
    // (beside the fake libibverbs: .ci/stage-rdma-checksum.sh).
    let gpu: std::sync::Arc<dyn Gpu> = match &provider {
        Provider::Sim(_) => std::sync::Arc::new(SimGpu::new(1, Duration::from_micros(50))),
        Provider::Real(..) => std::sync::Arc::new(CudaGpu::load().unwrap_or_else(|e| {
            panic!("RDMA_TEST_PROVIDER=ibverbs needs a CUDA driver (the fake libcuda on LD_LIBRARY_PATH): {e}")
        })),
    };
    let builder = |name: &str| provider.apply(common::builder(name)).gpu(gpu.clone());
    let target = builder("sum-rdma-gpu-target").build().unwrap();
    let remote = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let initiator = builder("sum-rdma-gpu-init").build().unwrap();
    let local = initiator.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    let addr = target.control_addr().to_string();
    let segment = initiator.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT).unwrap();
    let descs = [BlockDesc::new(local.id(), 0, remote.id(), 0, BLOCK)];
    let mut sub = initiator.submitter().unwrap();
    let mut run = |checksum: bool| {
        let id = sub.submit(&Batch::write(&segment).descs(&descs).checksum(checksum).deadline(WAIT)).unwrap();
        sub.wait(id, WAIT).unwrap()
    };
    let message = unsupported(run(true));
    assert!(message.contains("GPU memory") && message.contains("no checksum kernel"), "{message}");
    assert!(run(false).is_done());
    // The target refuses a CRC32C of its own GPU memory too, asked anyway.
    let device = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    let mut asker = kvring::testing::control::ControlClient::connect(&addr, deadline).unwrap();
    let refused = asker.crc32c(&[(device.id().raw(), 0, 16)], deadline).unwrap_err();
    assert!(refused.to_string().contains("GPU memory"), "{refused}");
}

/// With a token, the verifier asks on a handshaken (sealed) control
/// session as the link's connect did, and its pushes are verified and
/// done; a client that has not proven the token gets no CRC at all.
#[test]
fn on_a_tokened_engine_only_a_proven_session_gets_crcs() {
    // Takes its turn: another test's stalled answers would stall its own.
    let _turn = turn();
    let pair = common::verbs::rdma_pair("sum-rdma-token", Some("sum-secret"));
    // SAFETY: no batch touches these bytes yet.
    unsafe { pair.local.fill_pattern(5) };
    let descs: Vec<BlockDesc> =
        (0..4).map(|i| BlockDesc::new(pair.local.id(), i * BLOCK, pair.remote.id(), i * BLOCK, BLOCK)).collect();
    let mut sub = pair.initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&pair.segment).descs(&descs).checksum(true).deadline(WAIT)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(matches!(outcome, Outcome::Done { bytes } if bytes == 4 * BLOCK), "{outcome:?}");

    let addr = pair.target.control_addr().to_string();
    let mut stranger =
        kvring::testing::control::ControlClient::connect(&addr, std::time::Instant::now() + WAIT).unwrap();
    let refused = stranger.crc32c(&[(pair.remote.id().raw(), 0, 16)], std::time::Instant::now() + WAIT).unwrap_err();
    assert!(refused.to_string().contains("token"), "{refused}");
}
