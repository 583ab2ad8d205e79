//! Hostile review 10: a checksummed rdma chunk's local side summed in
//! 1 MiB steps under its gate (`transport::rdma::verify`), so a withdrawal
//! waits for one step. Probed: a withdrawal (cancel, the segment closed, a
//! deadline) racing a step, after which the test unregisters the chunk's
//! source and unmaps it at once (a verifier that read one byte more would
//! kill this process with SIGSEGV); blocks whose sizes are not multiples
//! of the step, corrupted in their last byte past the last whole step; a
//! zero-length block. On the simulated verbs provider
//! (tests/common/verbs.rs).
//!
//! Not probed here: blocks of 1 GiB and more (two such regions, prefaulted,
//! and their sums at this build's speed are past a quick test on this
//! machine); `verify.rs`'s own unit test cuts them in pieces.

mod common;

use common::verbs::Provider;
use common::WAIT;
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, Region, RegionId, RegionInfo, Segment, TransportKind};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
/// The source of each racing chunk: 48 steps of the gate.
const RACE_LEN: usize = 48 << 20;

/// The corruption hook and the verifier threads are process-wide.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> MutexGuard<'static, ()> {
    let guard = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    kvring::testing::checksum::corrupt_landing_at(u64::MAX);
    kvring::testing::checksum::corrupt_rdma_landings_with(None);
    guard
}

struct Pair {
    _provider: Provider,
    _target: Engine,
    remote: Region,
    initiator: Engine,
    segment: Segment,
}

fn pair(name: &str, remote_len: usize) -> Pair {
    let provider = Provider::new();
    let target = provider.apply(common::builder(&format!("{name}-target"))).build().unwrap();
    let remote = target.alloc_region(remote_len, RegionInfo::raw()).unwrap();
    let initiator = provider.apply(common::builder(&format!("{name}-initiator"))).build().unwrap();
    let addr = target.control_addr().to_string();
    let segment = initiator.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT).unwrap();
    assert_eq!(segment.transport(), TransportKind::Rdma);
    Pair { _provider: provider, _target: target, remote, initiator, segment }
}

/// Memory of the test's own, registered with `engine`; unmapped by
/// [`Mapped::unmap`] once unregistered.
struct Mapped {
    ptr: *mut libc::c_void,
    len: usize,
    id: RegionId,
}

impl Mapped {
    fn new(engine: &Engine, len: usize) -> Self {
        // SAFETY: a fresh anonymous mapping of our own.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        // SAFETY: ours, `len` bytes; a pattern so the sums are not of zeros.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0x5a, len) };
        // SAFETY: the mapping stays until `unmap`, which runs only once
        // the engine has unregistered it.
        let id = unsafe { engine.register(ptr.cast(), len, RegionInfo::raw()) }.unwrap();
        Self { ptr, len, id }
    }

    /// Unregisters it (bounded: a chunk's lease is given back as it ends)
    /// and unmaps it at once.
    fn unmap(self, engine: &Engine) {
        let until = Instant::now() + WAIT;
        loop {
            match engine.unregister(self.id) {
                Ok(()) => break,
                Err(Error::RegionBusy { .. }) if Instant::now() < until => std::thread::yield_now(),
                Err(error) => panic!("unregistered once its batch ended: {error}"),
            }
        }
        // SAFETY: ours, and no longer registered anywhere.
        assert_eq!(unsafe { libc::munmap(self.ptr, self.len) }, 0);
    }
}

/// True while a verifier thread of this process is running (summing: its
/// questions wait on a socket, asleep).
fn a_verifier_runs() -> bool {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return false };
    tasks.flatten().any(|task| {
        let named = std::fs::read_to_string(task.path().join("comm")).is_ok_and(|n| n.starts_with("kvring-rdma-ver"));
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        named && stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()) == Some("R")
    })
}

/// Spins (bounded by `WAIT`) until a verifier runs; whether one did.
fn once_summing() -> bool {
    let until = Instant::now() + WAIT;
    while Instant::now() < until {
        if a_verifier_runs() {
            return true;
        }
        std::thread::yield_now();
    }
    false
}

/// How a racing chunk is withdrawn.
#[derive(Debug, Clone, Copy)]
enum Withdrawal {
    Cancel,
    Close,
    Deadline,
}

// Holds: a withdrawal while a verifier sums the chunk's source in steps
// (seen running), then the source unregistered and unmapped at once, for
// each way a chunk is withdrawn, several times each: the batch ends typed
// and never `Done` (every chunk's first landing is corrupted at the
// target, so a chunk done was not verified), unregister succeeds once it
// ended, and no verifier reads the unmapped source (the process lives).
// A close does not withdraw: the verification finishes, `Corrupt`. The
// blocks are 3 MiB + 5 bytes, so each ends in a short step.
#[test]
fn a_withdrawal_racing_a_step_leaves_no_read_of_the_freed_source() {
    let _turn = turn();
    let mut raced = 0;
    for (round, how) in [Withdrawal::Cancel, Withdrawal::Close, Withdrawal::Deadline].iter().cycle().take(9).enumerate()
    {
        let p = pair(&format!("r10-race{round}"), RACE_LEN);
        let source = Mapped::new(&p.initiator, RACE_LEN);
        let block = 3 * MIB + 5;
        let n = RACE_LEN as u64 / block;
        let descs: Vec<_> =
            (0..n).map(|i| BlockDesc::new(source.id, i * block, p.remote.id(), i * block, block)).collect();
        let deadline = match how {
            Withdrawal::Deadline => Duration::from_millis(1),
            _ => WAIT,
        };
        // Every landing corrupted: a batch that ends done was not verified.
        let remote = p.remote.clone();
        kvring::testing::checksum::corrupt_rdma_landings_with(Some(Box::new(move |_, offset| {
            let mut byte = [0u8];
            // SAFETY: the WRITE naming this byte completed; the test is its
            // only other writer (a stray writer at the target).
            unsafe {
                remote.read_at(offset, &mut byte).unwrap();
                remote.write_at(offset, &[byte[0] ^ 0x01]).unwrap();
            }
        })));
        kvring::testing::checksum::corrupt_landing_at(0);
        let mut sub = p.initiator.submitter().unwrap();
        let batch = Batch::write(&p.segment).descs(&descs).checksum(true).deadline(deadline);
        let id = sub.submit(&batch).unwrap();
        if !matches!(how, Withdrawal::Deadline) {
            raced += usize::from(once_summing());
        }
        match how {
            Withdrawal::Cancel => sub.cancel(id).unwrap(),
            Withdrawal::Close => p.initiator.close_segment(&p.segment),
            Withdrawal::Deadline => {}
        }
        let outcome = sub.wait(id, WAIT + WAIT).expect("the batch ends");
        // A close lets the chunk's verification finish (`Corrupt` then); a
        // cancel or a deadline withdraws it; neither is done.
        assert!(
            matches!(outcome, Outcome::Failed(_) | Outcome::Cancelled { .. } | Outcome::TimedOut { .. }),
            "{how:?}: {outcome:?}"
        );
        kvring::testing::checksum::corrupt_rdma_landings_with(None);
        source.unmap(&p.initiator);
        // A verifier still reading would fault here, on the unmapped pages.
        let until = Instant::now() + Duration::from_millis(100);
        while Instant::now() < until {
            std::thread::yield_now();
        }
    }
    assert!(raced > 0, "no withdrawal met a verifier summing (the race was never run)");
}

// Holds: a block whose size is no multiple of the 1 MiB step, corrupted
// in its last byte (in the short last step) at the target, fails
// `Corrupt` naming it; the same batch uncorrupted is done; a block of a
// few bytes beside it too.
#[test]
fn a_block_not_a_multiple_of_the_step_is_verified_to_its_last_byte() {
    let _turn = turn();
    let p = pair("r10-tail", 8 << 20);
    let local = p.initiator.alloc_region(8 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { local.fill_pattern(11) };
    let long = 2 * MIB + 3;
    let descs = [
        BlockDesc::new(local.id(), 0, p.remote.id(), 0, 3),
        BlockDesc::new(local.id(), 4 * MIB, p.remote.id(), 4 * MIB, long),
    ];
    let run = |descs: &[BlockDesc]| {
        common::run(&mut p.initiator.submitter().unwrap(), &Batch::write(&p.segment).descs(descs).checksum(true))
    };
    let outcome = run(&descs);
    assert!(matches!(outcome, Outcome::Done { bytes } if bytes == 3 + long), "{outcome:?}");
    let remote = p.remote.clone();
    kvring::testing::checksum::corrupt_rdma_landings_with(Some(Box::new(move |_, offset| {
        let last = offset + long - 1;
        let mut byte = [0u8];
        // SAFETY: the WRITE naming this byte completed; the test is its
        // only other writer (a stray writer at the target).
        unsafe {
            remote.read_at(last, &mut byte).unwrap();
            remote.write_at(last, &[byte[0] ^ 0x01]).unwrap();
        }
    })));
    kvring::testing::checksum::corrupt_landing_at(4 * MIB);
    let outcome = run(&descs);
    kvring::testing::checksum::corrupt_rdma_landings_with(None);
    kvring::testing::checksum::corrupt_landing_at(u64::MAX);
    assert!(matches!(outcome, Outcome::Failed(Error::Corrupt { desc_index: 1, .. })), "{outcome:?}");
}

// Holds: a zero-length block in a checksummed rdma batch is refused typed
// or done, never a hang or a panic of the verifier, and the link verifies
// the next batch.
#[test]
fn a_zero_length_block_in_a_checksummed_batch_ends_typed() {
    let _turn = turn();
    let p = pair("r10-zero", 1 << 20);
    let local = p.initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let descs =
        [BlockDesc::new(local.id(), 0, p.remote.id(), 0, 0), BlockDesc::new(local.id(), 0, p.remote.id(), 0, 64)];
    let mut sub = p.initiator.submitter().unwrap();
    match sub.submit(&Batch::write(&p.segment).descs(&descs).checksum(true)) {
        Err(error) => assert!(matches!(error, Error::InvalidArgument { .. }), "{error}"),
        Ok(id) => {
            let outcome = sub.wait(id, WAIT).unwrap();
            assert!(
                outcome.is_done() || matches!(outcome, Outcome::Failed(Error::InvalidArgument { .. })),
                "{outcome:?}"
            );
        }
    }
    let outcome = common::run(&mut sub, &Batch::write(&p.segment).descs(&descs[1..]).checksum(true));
    assert!(outcome.is_done(), "{outcome:?}");
}

// Holds: the initiator engine dropped while a verifier sums a chunk's
// source (seen running): the drop returns once no verifier reads it, and
// the caller unmaps the source at once without a fault.
#[test]
fn an_engine_dropped_mid_step_leaves_no_read_of_the_callers_source() {
    let _turn = turn();
    let mut raced = 0;
    for round in 0..3 {
        let Pair { _provider, _target, remote, initiator, segment } = pair(&format!("r10-drop{round}"), RACE_LEN);
        let source = Mapped::new(&initiator, RACE_LEN);
        let block = 3 * MIB + 5;
        let n = RACE_LEN as u64 / block;
        let descs: Vec<_> =
            (0..n).map(|i| BlockDesc::new(source.id, i * block, remote.id(), i * block, block)).collect();
        let mut sub = initiator.submitter().unwrap();
        sub.submit(&Batch::write(&segment).descs(&descs).checksum(true).deadline(WAIT)).unwrap();
        raced += usize::from(once_summing());
        drop((sub, segment));
        drop(initiator);
        // SAFETY: ours; the engine it was registered with is gone.
        assert_eq!(unsafe { libc::munmap(source.ptr, source.len) }, 0);
        let until = Instant::now() + Duration::from_millis(100);
        while Instant::now() < until {
            std::thread::yield_now();
        }
    }
    assert!(raced > 0, "no drop met a verifier summing (the race was never run)");
}

// Holds: the same race for a READ, whose local side is the destination
// the verifier sums once the bytes landed: cancelled while a verifier
// runs, then the destination unregistered (once the batch ended) and
// unmapped at once; no verifier reads it (the process lives). The batch
// ends cancelled, or done where its verdict came first.
#[test]
fn a_cancel_racing_a_reads_step_leaves_no_read_of_the_freed_destination() {
    let _turn = turn();
    let mut raced = 0;
    for round in 0..3 {
        let p = pair(&format!("r10-read{round}"), RACE_LEN);
        let destination = Mapped::new(&p.initiator, RACE_LEN);
        let block = 3 * MIB + 5;
        let n = RACE_LEN as u64 / block;
        let descs: Vec<_> =
            (0..n).map(|i| BlockDesc::new(destination.id, i * block, p.remote.id(), i * block, block)).collect();
        let mut sub = p.initiator.submitter().unwrap();
        let id = sub.submit(&Batch::read(&p.segment).descs(&descs).checksum(true).deadline(WAIT)).unwrap();
        raced += usize::from(once_summing());
        sub.cancel(id).unwrap();
        let outcome = sub.wait(id, WAIT + WAIT).expect("the batch ends");
        assert!(
            matches!(outcome, Outcome::Cancelled { .. } | Outcome::Done { .. } | Outcome::Failed(_)),
            "{outcome:?}"
        );
        destination.unmap(&p.initiator);
        let until = Instant::now() + Duration::from_millis(100);
        while Instant::now() < until {
            std::thread::yield_now();
        }
    }
    assert!(raced > 0, "no cancel met a verifier summing (the race was never run)");
}
