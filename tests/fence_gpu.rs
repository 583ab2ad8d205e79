//! Fenced destinations in GPU memory (`Engine::fence`, `Batch::grant`):
//! over cuda_ipc, where a same-host peer's lane writes the target's device
//! memory and checks the region's fence table page (mapped from the
//! target, in this process or passed over its GPU descriptor socket), and
//! over tcp, where the target stages the bytes in host pages and copies
//! them to the device later. On each: (1) a push under a stale grant fails
//! `Fenced` and nothing of it lands; (2) a push naming no grant into a
//! fenced range is refused too; (3) a fence issued while a stale push's
//! device copy is in flight waits for that copy, so nothing stale lands
//! after `fence` returned (on the simulated GPU the stale copy is made slow
//! and the new owner's fast: a fence that did not wait lets the stale bytes
//! land over the new owner's).
//!
//! With `TEST_GPU_PROVIDER=cuda` (the fake CUDA driver in CI,
//! `.ci/stage-fakecuda.sh`, or a real one) the same tests run on the CUDA
//! provider; there (3) has no slow copy to race, and checks the property
//! at the driver's own pace.

mod common;

use common::{fenced, pattern, WAIT};
use kvring::gpu::{Gpu, SimGpu};
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, Region, RegionInfo, Segment, TransportKind};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1 << 20;
const BLOCK: u64 = 64 * 1024;
/// The copy engine's pace, but for the stale copies of (3).
const FAST: Duration = Duration::from_micros(100);
/// A stale push's copies in (3): far slower than the fence and the new
/// owner's write that follow them.
const SLOW: Duration = Duration::from_millis(300);

fn on_cuda() -> bool {
    std::env::var("TEST_GPU_PROVIDER").is_ok_and(|v| v == "cuda")
}

/// The simulator (copies `FAST`), or the CUDA driver.
fn provider() -> (Arc<dyn Gpu>, Option<Arc<SimGpu>>) {
    match on_cuda() {
        true => (Arc::new(kvring::gpu::CudaGpu::load().expect("TEST_GPU_PROVIDER=cuda needs a CUDA driver")), None),
        false => {
            let sim = Arc::new(SimGpu::new(1, FAST));
            (sim.clone(), Some(sim))
        }
    }
}

/// A target with 2 MiB of memory (the first MiB is fenced) and an
/// initiator pushing from a MiB of its own: device memory into host memory,
/// or host memory into device memory.
struct Setup {
    sim: Option<Arc<SimGpu>>,
    initiator: Engine,
    local: Region,
    segment: Segment,
    target: Engine,
    remote: Region,
}

impl Setup {
    fn new(transport: TransportKind) -> Self {
        Self::from_to(transport, RegionInfo::raw(), RegionInfo::raw().on_gpu(0))
    }

    fn from_to(transport: TransportKind, local: RegionInfo, remote: RegionInfo) -> Self {
        let (gpu, sim) = provider();
        let target = common::builder("fence-gpu-target").gpu(gpu.clone()).build().unwrap();
        let remote = target.alloc_region(2 * MIB, remote).unwrap();
        let initiator = common::builder("fence-gpu-initiator").gpu(gpu).build().unwrap();
        let local = initiator.alloc_region(MIB, local).unwrap();
        let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
        assert_eq!(segment.transport(), transport);
        Self { sim, initiator, local, segment, target, remote }
    }

    /// The copies queued from now on land `delay` after they were queued
    /// (on the simulator; the CUDA driver keeps its own pace).
    fn pace(&self, delay: Duration) {
        if let Some(sim) = &self.sim {
            sim.set_copy_delay(delay);
        }
    }

    fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        common::read(&self.remote, offset, len)
    }

    /// The new owner writes its bytes over the fenced MiB.
    fn own(&self, byte: u8) {
        // SAFETY: fenced: no write under an older grant is in the range.
        unsafe { self.remote.write_at(0, &vec![byte; MIB]).unwrap() };
    }

    /// 64 KiB blocks of the initiator's MiB onto `[at, at + MiB)` of the
    /// target's region.
    fn descs(&self, at: u64) -> Vec<BlockDesc> {
        let remote = self.segment.region(0).unwrap();
        (0..MIB as u64 / BLOCK)
            .map(|i| BlockDesc::new(self.local.id(), i * BLOCK, remote, at + i * BLOCK, BLOCK))
            .collect()
    }

    fn push(&self, descs: &[BlockDesc], grant: Option<u32>) -> Outcome {
        common::push_granted(&self.initiator, &self.segment, descs, grant)
    }
}

/// (1) and (2) on one transport.
fn stale_grant_is_fenced(transport: TransportKind) {
    stale_grant_is_fenced_in(Setup::new(transport), transport);
}

fn stale_grant_is_fenced_in(s: Setup, transport: TransportKind) {
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 1)).unwrap() };
    let blocks = s.descs(0);
    let old = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    s.push(&blocks, Some(old)).into_result().unwrap_or_else(|e| panic!("{transport:?}: the current grant: {e}"));
    assert_eq!(s.read(0, MIB), pattern(MIB, 1), "{transport:?}: the current grant lands");

    // The request is aborted; its blocks go to another one.
    let new = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
    s.own(0xEE);
    let outcome = s.push(&blocks, Some(old));
    assert!(fenced(&outcome), "{transport:?}: a stale grant's push must fail Fenced, got {outcome:?}");
    let outcome = s.push(&blocks, None);
    assert!(fenced(&outcome), "{transport:?}: no grant, into a fenced range: {outcome:?}");
    // One block past the fence, then one into it: the first may land, the
    // second must not, and the batch fails.
    let remote = s.segment.region(0).unwrap();
    let straddling = [
        BlockDesc::new(s.local.id(), 0, remote, MIB as u64, BLOCK),
        BlockDesc::new(s.local.id(), BLOCK, remote, BLOCK, BLOCK),
    ];
    assert!(fenced(&s.push(&straddling, Some(old))), "{transport:?}: a batch reaching into the fence");
    assert_eq!(s.read(0, MIB), vec![0xEE; MIB], "{transport:?}: nothing of a refused push landed");

    // Past the fenced range nothing is fenced: no grant is needed there.
    s.push(&s.descs(MIB as u64), None).into_result().unwrap();
    assert_eq!(s.read(MIB as u64, MIB), pattern(MIB, 1));
    s.push(&blocks, Some(new)).into_result().unwrap();
    assert_eq!(s.read(0, MIB), pattern(MIB, 1), "{transport:?}: the new grant lands");
}

/// (3) on one transport.
fn fence_during_a_stale_copy(transport: TransportKind) {
    fence_during_a_stale_copy_in(Setup::new(transport), transport);
}

fn fence_during_a_stale_copy_in(s: Setup, transport: TransportKind) {
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 3)).unwrap() };
    let blocks = s.descs(0);
    let mut sub = s.initiator.submitter().unwrap();
    for round in 0..3u8 {
        let old = s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
        s.pace(SLOW);
        let id = sub.submit(&Batch::write(&s.segment).descs(&blocks).grant(old)).unwrap();
        // The push's copies are queued long before they land (SLOW).
        std::thread::sleep(Duration::from_millis(60));
        s.pace(FAST);
        s.target.fence(s.remote.id(), 0, MIB as u64).unwrap();
        // `fence` returned: no copy under `old` is in the range, and none
        // starts. The new owner's bytes land at once (FAST).
        s.own(0xE0 | round);
        let outcome = sub.wait(id, WAIT).unwrap();
        assert!(
            outcome.is_done() || fenced(&outcome),
            "{transport:?} round {round}: the stale push either landed before the fence or was fenced: {outcome:?}"
        );
        assert_eq!(
            s.read(0, MIB),
            vec![0xE0 | round; MIB],
            "{transport:?} round {round}: a stale byte landed after fence"
        );
    }
}

#[test]
fn cuda_ipc_a_push_under_a_stale_grant_is_fenced_and_nothing_lands() {
    stale_grant_is_fenced(TransportKind::CudaIpc);
}

#[test]
fn cuda_ipc_a_fence_during_a_stale_copy_waits_for_it() {
    fence_during_a_stale_copy(TransportKind::CudaIpc);
}

/// The same link's GPU copies into a peer's *host* (shm) region: the
/// chunk's count in the region file's table is kept until its copies
/// ended, as for a peer's GPU memory (the host pass alone ended when the
/// copies were issued, and a fence then returned under a stale copy).
#[test]
fn cuda_ipc_gpu_copies_into_a_peers_host_memory_are_fenced_too() {
    let gpu_to_host = || Setup::from_to(TransportKind::CudaIpc, RegionInfo::raw().on_gpu(0), RegionInfo::raw());
    stale_grant_is_fenced_in(gpu_to_host(), TransportKind::CudaIpc);
    fence_during_a_stale_copy_in(gpu_to_host(), TransportKind::CudaIpc);
}

#[test]
fn staged_tcp_a_push_under_a_stale_grant_is_fenced_and_nothing_lands() {
    stale_grant_is_fenced(TransportKind::Tcp);
}

#[test]
fn staged_tcp_a_fence_during_a_stale_copy_waits_for_it() {
    fence_during_a_stale_copy(TransportKind::Tcp);
}

/// A digest of `bytes` (the same in the child and its parent: one binary).
fn digest(bytes: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    bytes.hash(&mut hasher);
    hasher.finish()
}

/// A target in another process (this test binary, run as a child): its GPU
/// region's fence table page reaches the initiator only over the target's
/// GPU descriptor socket (`SCM_RIGHTS`), and the initiator maps it. It
/// answers one line per command on its stdin: `fence` (the grant, or
/// `busy`), `own BYTE`, `digest OFFSET` (of a MiB), `scribble SEED` (it
/// overwrites its own table pages with noise, as a hostile peer could).
struct Child {
    child: std::process::Child,
    out: BufReader<std::process::ChildStdout>,
    addr: String,
}

impl Child {
    fn start() -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "fence_gpu_child_target", "--nocapture", "--test-threads=1"])
            .env("KVRING_FENCE_GPU_CHILD", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let addr = loop {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "the child exited before it was ready");
            // libtest prints the test's name before it on the same line.
            if let Some((_, addr)) = line.split_once("ready ") {
                break addr.trim().to_string();
            }
        };
        Self { child, out, addr }
    }

    fn ask(&mut self, command: &str) -> String {
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{command}").unwrap();
        stdin.flush().unwrap();
        let mut line = String::new();
        assert!(self.out.read_line(&mut line).unwrap() > 0, "the child exited at {command}");
        line.trim().to_string()
    }

    fn fence(&mut self) -> u32 {
        let answer = self.ask("fence");
        answer.parse().unwrap_or_else(|_| panic!("fence: {answer}"))
    }

    fn digest(&mut self, offset: usize) -> u64 {
        self.ask(&format!("digest {offset}")).parse().unwrap()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        drop(self.child.stdin.take()); // the child exits at EOF
        let _ = self.child.wait();
    }
}

#[test]
#[ignore = "run by Child::start"]
fn fence_gpu_child_target() {
    let (gpu, _sim) = provider();
    let engine = common::builder("fence-gpu-child").gpu(gpu).build().unwrap();
    // Its first MiB is fenced; its second is the canary no push names.
    let region = engine.alloc_region(2 * MIB, RegionInfo::raw().on_gpu(0)).unwrap();
    println!("ready {}", engine.control_addr());
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lines() {
        let line = line.unwrap();
        let (command, arg) = line.split_once(' ').unwrap_or((&line, ""));
        let answer = match command {
            "fence" => match engine.fence(region.id(), 0, MIB as u64) {
                Ok(grant) => grant.to_string(),
                Err(Error::RegionBusy { .. }) => "busy".into(),
                Err(other) => panic!("{other}"),
            },
            "own" => {
                // SAFETY: fenced by the parent's previous command.
                unsafe { region.write_at(0, &vec![arg.parse::<u8>().unwrap(); MIB]).unwrap() };
                "ok".into()
            }
            "digest" => digest(&common::read(&region, arg.parse().unwrap(), MIB)).to_string(),
            "scribble" => scribble_own_fence_pages(arg.parse().unwrap()).to_string(),
            other => panic!("unknown command {other}"),
        };
        println!("{answer}");
        std::io::stdout().flush().unwrap();
    }
}

/// Overwrites every fence table page of this process (found as the memfds
/// `/proc/self/fd` names) with noise from `seed`; returns how many.
fn scribble_own_fence_pages(seed: u64) -> usize {
    let mut pages = 0;
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let is_page =
            std::fs::read_link(entry.path()).is_ok_and(|l| l.to_string_lossy().starts_with("/memfd:kvring-fences"));
        let Ok(file) = std::fs::OpenOptions::new().read(true).write(true).open(entry.path()) else { continue };
        if !is_page {
            continue;
        }
        // SAFETY: a shared map of a sealed 4 KiB memfd page this process
        // holds; the engine reads it only atomically, and what it reads
        // there is noise it must survive (the property under test).
        let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
        let mut x = seed | 1;
        for word in map.chunks_exact_mut(8) {
            // xorshift64: any values, small and huge.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let value = match x % 4 {
                0 => x % 80,
                1 => 0,
                _ => x,
            };
            word.copy_from_slice(&value.to_ne_bytes());
        }
        pages += 1;
    }
    pages
}

/// (1) and (2) across processes: the table page the initiator checks is
/// the one the child target fences, passed over its descriptor socket.
#[test]
fn cuda_ipc_across_processes_a_stale_grant_is_fenced_and_nothing_lands() {
    let mut child = Child::start();
    let (gpu, _sim) = provider();
    let initiator = common::builder("fence-gpu-parent").gpu(gpu).build().unwrap();
    let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { local.write_at(0, &pattern(MIB, 5)).unwrap() };
    let segment = initiator.open_segment_with(&child.addr, Some(TransportKind::CudaIpc), WAIT).unwrap();
    let remote = segment.region(0).unwrap();
    let blocks: Vec<_> =
        (0..MIB as u64 / BLOCK).map(|i| BlockDesc::new(local.id(), i * BLOCK, remote, i * BLOCK, BLOCK)).collect();
    let mut sub = initiator.submitter().unwrap();
    let mut push = |grant: Option<u32>| {
        let batch = Batch::write(&segment).descs(&blocks);
        let id = sub.submit(&grant.map_or(batch.clone(), |g| batch.grant(g))).unwrap();
        sub.wait(id, WAIT).unwrap()
    };
    let old = child.fence();
    push(Some(old)).into_result().unwrap();
    assert_eq!(child.digest(0), digest(&pattern(MIB, 5)), "the current grant lands");
    let new = child.fence();
    assert_eq!(child.ask("own 238"), "ok");
    assert!(fenced(&push(Some(old))), "a stale grant's push from another process");
    assert!(fenced(&push(None)), "no grant, into a fenced range, from another process");
    assert_eq!(child.digest(0), digest(&[238; MIB]), "nothing of a refused push landed");
    push(Some(new)).into_result().unwrap();
    assert_eq!(child.digest(0), digest(&pattern(MIB, 5)), "the new grant lands");
}

/// The fence table page is outside input to whoever maps it: a target
/// (here, the child) that scribbles noise over its own pages costs the
/// initiator's pushes refusals (`Fenced`, `RegionBusy`) at worst, never a
/// panic, a dead lane, or a byte outside the region pushed to; and its own
/// `fence` answers (a grant, or `RegionBusy` past its wait) without a panic.
#[test]
fn cuda_ipc_a_scribbled_fence_table_costs_refusals_never_a_stray_write() {
    let mut child = Child::start();
    let (gpu, _sim) = provider();
    let initiator = common::builder("fence-gpu-scribbled").gpu(gpu).build().unwrap();
    let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { local.write_at(0, &pattern(MIB, 6)).unwrap() };
    let segment = initiator.open_segment_with(&child.addr, Some(TransportKind::CudaIpc), WAIT).unwrap();
    let remote = segment.region(0).unwrap();
    let canary = child.digest(MIB);
    let mut sub = initiator.submitter().unwrap();
    for seed in 1..=8u64 {
        assert!(child.ask(&format!("scribble {seed}")).parse::<usize>().unwrap() >= 1, "the child has a table page");
        let grant = (seed as u32).wrapping_mul(0x9e37_79b9);
        let blocks: Vec<_> = (0..16).map(|i| BlockDesc::new(local.id(), i * BLOCK, remote, i * BLOCK, BLOCK)).collect();
        let id = sub.submit(&Batch::write(&segment).descs(&blocks).grant(grant % 1000)).unwrap();
        match sub.wait(id, WAIT).unwrap() {
            Outcome::Done { .. } => {}
            Outcome::Failed(Error::Fenced { .. } | Error::RegionBusy { .. }) => {}
            other => panic!("seed {seed}: {other:?}"),
        }
        assert_eq!(child.digest(MIB), canary, "seed {seed}: a byte landed outside the range pushed to");
    }
    // The child's own fence still answers (its busy words may be noise).
    let answer = child.ask("fence");
    assert!(answer == "busy" || answer.parse::<u32>().is_ok(), "{answer}");
    // The lane survived: a push outside every fenced range of a fresh
    // table is served (the next fence's entry clears nothing it needs).
    let id =
        sub.submit(&Batch::read(&segment).block(BlockDesc::new(local.id(), 0, remote, MIB as u64, BLOCK))).unwrap();
    sub.wait(id, WAIT).unwrap().into_result().unwrap();
}

/// A staged frame is checked again just before its device copy is issued,
/// not held from its header: a sender that stalls in the middle of a
/// frame's payload (its header read, its copy not yet issued) does not
/// hold a fence up (`fence` returns its grant, not `RegionBusy` after its
/// wait), and when it resumes, its frame is refused at the copy: the ack
/// says `FENCED` and nothing of it lands.
#[test]
fn staged_tcp_a_sender_stalled_mid_frame_holds_no_fence_and_lands_nothing_after_it() {
    use kvring::testing::tcp::{FrameHeader, FrameOp, FLAG_LAST, FRAME_HEADER_BYTES};
    use std::io::Read;
    use zerocopy::{FromBytes, IntoBytes};
    let (gpu, _sim) = provider();
    let target = common::builder("fence-gpu-stalled").gpu(gpu).build().unwrap();
    let region = target.alloc_region(MIB, RegionInfo::raw().on_gpu(0)).unwrap();
    let len = 65536u32;
    let old = target.fence(region.id(), 0, len.into()).unwrap();
    let mut s = common::raw::data_connection(&target);
    s.write_all(FrameHeader::new(FrameOp::Grant, target.epoch(), 9, 0, u64::from(old), 0).as_bytes()).unwrap();
    let mut write = FrameHeader::new(FrameOp::Write, target.epoch(), 9, region.id().raw(), 0, len.into());
    write.flags = FLAG_LAST;
    s.write_all(write.as_bytes()).unwrap();
    s.write_all(&[0xAB; 32768]).unwrap();
    // The target reads the header and half the payload, then waits.
    std::thread::sleep(Duration::from_millis(100));
    let new = target.fence(region.id(), 0, len.into()).expect("a stalled sender's frame held the fence up");
    assert!(new > old);
    s.write_all(&[0xAB; 32768]).unwrap();
    let mut reply = [0u8; FRAME_HEADER_BYTES];
    s.read_exact(&mut reply).unwrap();
    let reply = FrameHeader::read_from_bytes(&reply).unwrap();
    let fenced_code = Error::Fenced { region: region.id(), grant: old }.code() as i32;
    assert_eq!(reply.status, -fenced_code, "the chunk's ack says FENCED");
    assert_eq!(common::read(&region, 0, len as usize), vec![0u8; len as usize], "a stale byte landed after fence");
}
