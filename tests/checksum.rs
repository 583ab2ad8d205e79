//! End-to-end checksums (`Batch::checksum`, `EngineBuilder::checksum`): a
//! block corrupted after it landed and before it was verified (the
//! `testing` feature's hook, `corrupt_landing_at`) fails its batch with
//! `Corrupt` naming that block, on shm, cma and tcp, for pushes and pulls;
//! what cannot be verified is refused.

mod common;

use common::WAIT;
use kvring::testing::checksum::corrupt_landing_at;
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, Region, RegionId, RegionInfo, Segment, TransportKind};
use std::sync::{Mutex, MutexGuard};

const BLOCK: u64 = 16 << 10;
const BLOCKS: u64 = 8;
const LEN: usize = (BLOCK * BLOCKS) as usize;

/// The corruption hook is process-wide: these tests take turns.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> MutexGuard<'static, ()> {
    let guard = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    corrupt_landing_at(u64::MAX);
    guard
}

/// A target with a shm-backed region and one of its caller's memory (what
/// cma reaches), and an initiator with a region of its own.
struct Pair {
    initiator: Engine,
    local: Region,
    segment: Segment,
    remote: RegionId,
    target: Engine,
    _caller: Box<[u8]>,
}

fn pair(transport: TransportKind, engine_checksum: bool) -> Pair {
    let target = common::engine(&format!("sum-target-{}", transport.name()));
    let shm = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let mut caller = vec![0u8; LEN].into_boxed_slice();
    // SAFETY: `caller` outlives the engines' use of it (Pair drops the
    // engines first: fields drop in order, and `_caller` is last).
    let caller_id = unsafe { target.register(caller.as_mut_ptr(), caller.len(), RegionInfo::raw()) }.unwrap();
    let initiator =
        common::builder(&format!("sum-init-{}", transport.name())).checksum(engine_checksum).build().unwrap();
    let local = initiator.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { local.fill_pattern(41) };
    let addr = target.control_addr().to_string();
    let segment = initiator.open_segment_with(&addr, Some(transport), WAIT).unwrap();
    assert_eq!(segment.transport(), transport);
    let remote = if transport == TransportKind::Cma { caller_id } else { shm.id() };
    std::mem::forget(shm); // stays registered with the target for the test
    Pair { initiator, local, segment, remote, target, _caller: caller }
}

impl Pair {
    fn descs(&self) -> Vec<BlockDesc> {
        (0..BLOCKS).map(|i| BlockDesc::new(self.local.id(), i * BLOCK, self.remote, i * BLOCK, BLOCK)).collect()
    }

    fn run(&self, batch: Batch<'_>) -> Outcome {
        let mut sub = self.initiator.submitter().unwrap();
        let id = sub.submit(&batch.deadline(WAIT)).unwrap();
        sub.wait(id, WAIT).unwrap()
    }

    fn write(&self, checksum: Option<bool>) -> Outcome {
        let descs = self.descs();
        let batch = Batch::write(&self.segment).descs(&descs);
        self.run(match checksum {
            Some(on) => batch.checksum(on),
            None => batch,
        })
    }

    fn read(&self) -> Outcome {
        let descs = self.descs();
        self.run(Batch::read(&self.segment).descs(&descs).checksum(true))
    }
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

/// A checksummed push lands and is done; one whose block 5 is corrupted
/// where it landed fails `Corrupt` naming block 5.
fn pushes_verified(transport: TransportKind) -> Pair {
    let _turn = turn();
    let pair = pair(transport, false);
    assert!(pair.write(Some(true)).is_done());
    corrupt_landing_at(5 * BLOCK);
    let (block, message) = corrupt_block(pair.write(Some(true)));
    assert_eq!(block, 5, "{message}");
    assert!(message.contains("block 5 is corrupt") && message.contains("CRC32C"), "{message}");
    // The hook was taken by that batch: the next one is done again.
    assert!(pair.write(Some(true)).is_done());
    pair
}

#[test]
fn shm_push_and_pull_corrupted_after_landing_fail_corrupt_naming_the_block() {
    let pair = pushes_verified(TransportKind::Shm);
    let _turn = turn();
    assert!(pair.read().is_done());
    corrupt_landing_at(3 * BLOCK);
    let (block, message) = corrupt_block(pair.read());
    assert_eq!(block, 3, "{message}");
    assert!(message.contains("in this engine's region once read"), "{message}");
}

#[test]
fn cma_push_and_pull_corrupted_after_landing_fail_corrupt_naming_the_block() {
    let pair = pushes_verified(TransportKind::Cma);
    let _turn = turn();
    assert!(pair.read().is_done());
    corrupt_landing_at(6 * BLOCK);
    let (block, message) = corrupt_block(pair.read());
    assert_eq!(block, 6, "{message}");
    // What a verified push left is the initiator's bytes.
    assert_eq!(&pair._caller[..], &common::pattern(LEN, 41)[..]);
}

/// tcp pulls are checksummed too: each READ_DATA frame carries the CRC32C
/// of what the target sent, checked once it landed here. A verified pull
/// is done with the target's bytes; one whose block 4 is corrupted where
/// it landed fails `Corrupt` naming block 4 (not done). Tagged pushes are
/// still refused (the tag takes the checksum's field).
#[test]
fn tcp_push_and_pull_corrupted_after_landing_fail_corrupt_and_tags_are_refused() {
    let pair = pushes_verified(TransportKind::Tcp);
    let _turn = turn();
    // SAFETY: no batch touches these bytes now.
    unsafe { pair.local.fill_pattern(7) };
    assert!(pair.read().is_done());
    let mut landed = vec![0u8; LEN];
    // SAFETY: as above.
    unsafe { pair.local.read_at(0, &mut landed) }.unwrap();
    assert!(landed == common::pattern(LEN, 41), "a verified pull left the target's bytes (the pushes')");
    corrupt_landing_at(4 * BLOCK);
    let (block, message) = corrupt_block(pair.read());
    assert_eq!(block, 4, "{message}");
    assert!(message.contains("block 4 is corrupt") && message.contains("once read over tcp"), "{message}");
    assert!(pair.read().is_done(), "the hook was taken: the next pull is done");
    let descs = pair.descs();
    let tagged = Batch::write(&pair.segment).descs(&descs).checksum(true).arrival_tag(9);
    let message = unsupported(pair.run(tagged));
    assert!(message.contains("arrival tag"), "{message}");
    assert!(pair.target.landed(9) == 0, "nothing of a refused part landed");
}

/// A checksummed pull of a target's GPU memory over tcp (staged there):
/// the target has no checksum of device memory, so it refuses the READ
/// and the batch fails `Unsupported`, naming why; unchecked, it is read.
#[test]
fn a_checksummed_tcp_pull_of_gpu_memory_is_refused_by_the_target_with_the_reason() {
    use kvring::gpu::{Gpu, SimGpu};
    let gpu = std::sync::Arc::new(SimGpu::new(1, std::time::Duration::from_micros(50)));
    let target = common::builder("sum-gpu-target").gpu(gpu as std::sync::Arc<dyn Gpu>).build().unwrap();
    let remote = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    let initiator = common::engine("sum-gpu-init");
    let local = initiator.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let descs = [BlockDesc::new(local.id(), 0, remote.id(), 0, BLOCK)];
    let mut sub = initiator.submitter().unwrap();
    let mut run = |checksum: bool| {
        let id = sub.submit(&Batch::read(&segment).descs(&descs).checksum(checksum).deadline(WAIT)).unwrap();
        sub.wait(id, WAIT).unwrap()
    };
    let message = unsupported(run(true));
    assert!(message.contains("checksummed READ") && message.contains("GPU memory"), "{message}");
    assert!(run(false).is_done());
}

#[test]
fn the_engine_setting_checksums_every_batch_and_a_batch_may_opt_out() {
    let _turn = turn();
    let pair = pair(TransportKind::Shm, true);
    corrupt_landing_at(2 * BLOCK);
    assert_eq!(corrupt_block(pair.write(None)).0, 2, "checksummed by the engine's setting");
    corrupt_landing_at(2 * BLOCK);
    // Unchecked: nothing reads the landing back, so the hook stays armed.
    assert!(pair.write(Some(false)).is_done());
    corrupt_landing_at(u64::MAX);
}

#[test]
fn the_checksum_setting_comes_from_kvring_variables() {
    assert!(!kvring::config::Config::defaults().builder().settings().checksum, "off by default");
    let mut config = kvring::config::Config::defaults();
    config.apply_env(vec![("KVRING_CHECKSUM".to_string(), "on".to_string())]).unwrap();
    assert!(config.builder().settings().checksum);
    let dir = std::env::temp_dir().join(format!("kvring-checksum-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("kvring.toml");
    std::fs::write(&file, "version = 1\nchecksum = \"on\"\n").unwrap();
    let from_file = kvring::config::Config::load(Some(&file), Vec::new());
    let _ = std::fs::remove_dir_all(&dir);
    assert!(from_file.unwrap().builder().settings().checksum);
}

/// A block longer than a piece is checked piece by piece, and every piece
/// counts: a corruption in the middle piece of block 1 (of 3) fails the
/// batch naming block 1, on shm and cma, pushes and pulls; uncorrupted,
/// the same batch is done and its bytes are the initiator's.
#[test]
fn a_block_checked_in_pieces_fails_corrupt_for_a_corruption_in_any_piece() {
    use kvring::testing::checksum::VERIFIED_PIECE_BYTES;
    let block = 2 * VERIFIED_PIECE_BYTES + 4096 + 17;
    let len = (3 * block) as usize;
    for transport in [TransportKind::Shm, TransportKind::Cma] {
        let _turn = turn();
        let target = common::engine(&format!("sum-pieces-target-{}", transport.name()));
        let mut caller = vec![0u8; len].into_boxed_slice();
        // SAFETY: `caller` outlives the target's use of it (dropped after
        // the engines, below).
        let caller_id = unsafe { target.register(caller.as_mut_ptr(), len, RegionInfo::raw()) }.unwrap();
        let shm = target.alloc_region(len, RegionInfo::raw()).unwrap();
        let initiator = common::engine(&format!("sum-pieces-init-{}", transport.name()));
        let local = initiator.alloc_region(len, RegionInfo::raw()).unwrap();
        // SAFETY: no batch touches these bytes yet.
        unsafe { local.fill_pattern(43) };
        let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
        let remote = if transport == TransportKind::Cma { caller_id } else { shm.id() };
        let descs: Vec<BlockDesc> =
            (0..3).map(|i| BlockDesc::new(local.id(), i * block, remote, i * block, block)).collect();
        let run = |batch: Batch<'_>| {
            let mut sub = initiator.submitter().unwrap();
            let id = sub.submit(&batch.deadline(WAIT).checksum(true)).unwrap();
            sub.wait(id, WAIT).unwrap()
        };
        assert!(run(Batch::write(&segment).descs(&descs)).is_done(), "{transport:?}");
        if transport == TransportKind::Cma {
            assert_eq!(&caller[..], &common::pattern(len, 43)[..], "a verified push left the initiator's bytes");
        }
        let middle = block + VERIFIED_PIECE_BYTES;
        for op in [kvring::Opcode::Write, kvring::Opcode::Read] {
            corrupt_landing_at(middle);
            let batch = match op {
                kvring::Opcode::Write => Batch::write(&segment),
                kvring::Opcode::Read => Batch::read(&segment),
            };
            let (index, message) = corrupt_block(run(batch.descs(&descs)));
            assert_eq!(index, 1, "{transport:?} {op:?}: {message}");
            corrupt_landing_at(u64::MAX);
        }
        drop((segment, local, initiator, shm, target));
        drop(caller);
    }
}
