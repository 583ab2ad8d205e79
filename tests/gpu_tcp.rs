//! GPU memory over tcp, staged through pinned pages on each end, on the
//! simulated GPU (its device memory faults if a host thread touches it, and
//! its copies land only when their event says so): every pairing of GPU and
//! host memory both ways, many small blocks at one copy per chunk, blocks
//! larger than a link's staging, and no batch `Done` before its bytes are in
//! place.
//!
//! With `TEST_GPU_PROVIDER=cuda` (`.ci/stage-fakecuda.sh`, over the fake
//! driver) the same tests run on the CUDA provider. A test that reads the
//! driver's counters, injects its failures or needs a slow copy engine runs
//! in a child process of this binary (so the counters and knobs are its
//! own): the fake's `fakecuda_stat`/`fakecuda_set` stand for the
//! simulator's methods, and the simulator's copy delay is the fake's
//! `FAKECUDA_DELAY_US` (each job on a stream runs that late), set before
//! the driver loads. A test that needs the fake's counters or knobs prints
//! a line starting `gpu-skip:` on another driver (docs/FAKECUDA.md).

mod common;

use common::fakecuda::Fake;
use common::WAIT;
use kvring::gpu::{Gpu, SimGpu};
use kvring::{Batch, BlockDesc, Engine, Outcome, Region, RegionInfo, Segment, TransportKind};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

/// True when the tests run on the CUDA driver.
fn on_cuda() -> bool {
    std::env::var("TEST_GPU_PROVIDER").is_ok_and(|v| v == "cuda")
}

/// The provider of a test: the simulator (its own counters and knobs), or
/// the CUDA provider, over the fake driver where it is loaded (its
/// `fakecuda_stat`/`fakecuda_set`).
enum Driver {
    Sim(Arc<SimGpu>),
    Cuda { gpu: Arc<dyn Gpu>, fake: Option<Fake> },
}

impl Driver {
    fn gpu(&self) -> Arc<dyn Gpu> {
        match self {
            Driver::Sim(sim) => sim.clone(),
            Driver::Cuda { gpu, .. } => gpu.clone(),
        }
    }

    fn engine(&self, name: &str) -> Engine {
        common::builder(name).gpu(self.gpu()).build().unwrap()
    }

    /// The fake driver's controls; only tests run with `needs_fake` call it.
    fn fake(&self) -> &Fake {
        match self {
            Driver::Cuda { fake: Some(fake), .. } => fake,
            _ => unreachable!("a test that needs the fake runs only on the simulator or the fake"),
        }
    }

    /// Batched copy calls and the copies they carried, so far.
    fn copy_counts(&self) -> (u64, u64) {
        match self {
            Driver::Sim(sim) => sim.copy_counts(),
            Driver::Cuda { .. } => (self.fake().stat("batches") as u64, self.fake().stat("copies") as u64),
        }
    }

    /// Host ranges pinned for the GPU now (the simulator's registrations,
    /// or the fake's `cuMemHostRegister`ed ranges).
    fn pinned_host_ranges(&self) -> u64 {
        match self {
            Driver::Sim(sim) => sim.host_registered_ranges() as u64,
            Driver::Cuda { .. } => self.fake().stat("pinned") as u64,
        }
    }

    /// Runs `read` with the fake's streams at their own pace again (they
    /// run each job late, as the simulator was made slow): a read that
    /// checks a copy queued earlier is not slowed behind it too, so a copy
    /// still in flight is seen. The simulator's copies land their delay
    /// after they were queued, so there it changes nothing.
    fn unpaced<T>(&self, read: impl FnOnce() -> T) -> T {
        let Driver::Cuda { fake: Some(fake), .. } = self else { return read() };
        fake.set("delay_us", 0);
        let out = read();
        fake.set("delay_us", -1); // FAKECUDA_DELAY_US again
        out
    }

    /// After `accepted` more copy calls, one is refused at once (the fake:
    /// `cuMemcpyBatchAsync` returns `INVALID_VALUE`, nothing queued).
    fn refuse_copy_call(&self, accepted: u32) {
        match self {
            Driver::Sim(sim) => sim.refuse_copy_call(accepted),
            Driver::Cuda { .. } => self.fake().set("refuse_call_after", i64::from(accepted)),
        }
    }
}

/// The simulator with `gpus` GPUs whose copies land `delay` after they
/// were queued, or the same pace on the driver (the fake's streams run
/// each job `delay` late).
struct Pace {
    gpus: u32,
    delay: Duration,
}

/// Runs `body` on the simulator here, or, on the CUDA driver, in a child
/// process of this binary (the ignored test `child`, which calls
/// [`in_child`]) with the fake's delay set to `pace` before it loads.
fn on_either(child: &str, pace: Pace, body: fn(&Driver)) {
    if !on_cuda() {
        return body(&Driver::Sim(Arc::new(SimGpu::new(pace.gpus, pace.delay))));
    }
    let output = Command::new(std::env::current_exe().unwrap())
        .args([child, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("KVRING_GPU_SCENARIO", "1")
        .env("FAKECUDA_DELAY_US", pace.delay.as_micros().to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success() && text.contains("1 passed"), "{child} failed:\n{text}");
    for line in text.lines().filter(|l| l.contains("gpu-skip:")) {
        eprintln!("{}", &line[line.find("gpu-skip:").unwrap()..]); // the child's skip, counted here
    }
}

/// The child side of [`on_either`]: `body` on the CUDA provider. A test
/// that `needs_fake` (its counters or knobs) skips on another driver,
/// saying so, unless `FAKECUDA_REQUIRED=1`; the others run there at the
/// driver's own pace.
fn in_child(test: &str, needs_fake: bool, body: fn(&Driver)) {
    assert!(std::env::var("KVRING_GPU_SCENARIO").is_ok(), "run by on_either");
    let gpu = Arc::new(kvring::gpu::CudaGpu::load().expect("TEST_GPU_PROVIDER=cuda needs a CUDA driver"));
    let fake = Fake::find();
    if fake.is_none() {
        let required = std::env::var("FAKECUDA_REQUIRED").is_ok_and(|v| v == "1");
        assert!(!required, "FAKECUDA_REQUIRED=1 but the fake driver is not loaded");
        if needs_fake {
            eprintln!("gpu-skip: {test}: it reads the fake driver's counters or injects its failures");
            return;
        }
    }
    body(&Driver::Cuda { gpu, fake });
}

/// The provider of a test that needs neither counters nor pace, in this
/// process.
fn provider() -> Driver {
    match on_cuda() {
        true => Driver::Cuda {
            gpu: Arc::new(kvring::gpu::CudaGpu::load().expect("TEST_GPU_PROVIDER=cuda needs a CUDA driver")),
            fake: None,
        },
        false => Driver::Sim(Arc::new(SimGpu::new(2, Duration::from_millis(1)))),
    }
}

fn tcp(initiator: &Engine, target: &Engine) -> Segment {
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    assert_eq!(segment.transport(), TransportKind::Tcp);
    segment
}

fn run(sub: &mut kvring::Submitter, batch: &Batch) -> Outcome {
    let id = sub.submit(batch).unwrap();
    sub.wait(id, WAIT).unwrap()
}

fn contents(region: &Region, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { region.read_at(offset, &mut out).unwrap() };
    out
}

/// WRITE from `local` to `remote` and READ back into `local` at `back`,
/// `blocks` blocks of `len`; checks the bytes on both ends.
fn round_trip(sub: &mut kvring::Submitter, segment: &Segment, local: &Region, remote: &Region, blocks: u64, len: u64) {
    let bytes = (blocks * len) as usize;
    let source = common::pattern(bytes, blocks ^ len);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.write_at(0, &source).unwrap() };
    let out: Vec<_> = (0..blocks).map(|i| BlockDesc::new(local.id(), i * len, remote.id(), i * len, len)).collect();
    assert_eq!(run(sub, &Batch::write(segment).descs(&out)).into_result().unwrap(), bytes as u64);
    let landed = contents(remote, 0, bytes);
    let first_wrong = landed.iter().zip(&source).position(|(a, b)| a != b);
    assert!(
        first_wrong.is_none(),
        "the target holds what was pushed ({blocks} x {len}: first wrong byte {first_wrong:?})"
    );
    let back = bytes as u64;
    let into: Vec<_> =
        (0..blocks).map(|i| BlockDesc::new(local.id(), back + i * len, remote.id(), i * len, len)).collect();
    assert_eq!(run(sub, &Batch::read(segment).descs(&into)).into_result().unwrap(), bytes as u64);
    assert!(contents(local, back, bytes) == source, "what was pulled is what was pushed");
}

/// Copy calls counted by the driver (the simulator's, or the fake's
/// `batches` and `copies`).
#[test]
fn gpu_memory_on_the_initiator_moves_over_tcp_staged_through_pinned_pages() {
    on_either("initiator_child", Pace { gpus: 1, delay: Duration::from_millis(1) }, initiator_gpu_memory_moves);
}

#[test]
#[ignore = "a child of gpu_memory_on_the_initiator_moves_…"]
fn initiator_child() {
    in_child(
        "gpu_memory_on_the_initiator_moves_over_tcp_staged_through_pinned_pages",
        true,
        initiator_gpu_memory_moves,
    );
}

fn initiator_gpu_memory_moves(gpu: &Driver) {
    let target = gpu.engine("staged-target");
    let initiator = gpu.engine("staged-initiator");
    let local = initiator.alloc_region(64 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let remote = target.alloc_region(32 << 20, RegionInfo::raw()).unwrap();
    let segment = tcp(&initiator, &target);
    let mut sub = initiator.submitter().unwrap();
    // 64 small blocks: one copy per chunk each way, not one per block.
    let (calls, _) = gpu.copy_counts();
    round_trip(&mut sub, &segment, &local, &remote, 64, 4096);
    let (after, copies) = gpu.copy_counts();
    assert!(after - calls <= 4, "{} copy calls for two chunks of 64 blocks", after - calls);
    assert!(copies > 0);
    // 64 KiB blocks, and blocks larger than a link stages at once (cut
    // into pieces and chunks of the staging's size).
    round_trip(&mut sub, &segment, &local, &remote, 64, 64 << 10);
    round_trip(&mut sub, &segment, &local, &remote, 2, 12 << 20);
}

#[test]
fn every_pairing_of_gpu_and_host_memory_moves_over_tcp_both_ways() {
    let gpu = provider();
    let target = gpu.engine("pairs-target");
    let initiator = gpu.engine("pairs-initiator");
    let mut sub = initiator.submitter().unwrap();
    // A second GPU where there is one (the simulator's and the fake's
    // two), else the first.
    let other = u32::from(gpu.gpu().devices().unwrap().len() > 1);
    let infos = [RegionInfo::raw(), RegionInfo::raw().on_gpu(0), RegionInfo::raw().on_gpu(other)];
    for (mine, theirs) in [(1, 0), (0, 1), (1, 2), (2, 2)] {
        let local = initiator.alloc_region(20 << 20, infos[mine]).unwrap();
        let remote = target.alloc_region(16 << 20, infos[theirs]).unwrap();
        // Opened after the regions exist, so the descriptor lists them.
        let segment = tcp(&initiator, &target);
        round_trip(&mut sub, &segment, &local, &remote, 64, 4096);
        round_trip(&mut sub, &segment, &local, &remote, 3, 3 << 20);
        initiator.close_segment(&segment);
    }
}

/// The target acks a chunk staged into its GPU only once the copy's event
/// completed: with a copy engine 20 ms late, every batch reported `Done` is
/// found in place by the target at once, and tagged pushes are counted only
/// then.
#[test]
fn no_push_into_a_targets_gpu_is_done_before_its_bytes_are_there() {
    on_either("late_child", Pace { gpus: 1, delay: Duration::from_millis(20) }, no_push_done_before_its_bytes);
}

#[test]
#[ignore = "a child of no_push_into_a_targets_gpu_is_done_…"]
fn late_child() {
    in_child("no_push_into_a_targets_gpu_is_done_before_its_bytes_are_there", false, no_push_done_before_its_bytes);
}

fn no_push_done_before_its_bytes(gpu: &Driver) {
    let target = gpu.engine("late-target");
    let initiator = gpu.engine("late-initiator");
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let remote = target.alloc_region(1 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let segment = tcp(&initiator, &target);
    let mut sub = initiator.submitter().unwrap();
    for round in 0..20u64 {
        let block = common::pattern(4096, round);
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.write_at(0, &block).unwrap() };
        let tag = kvring::kv::arrival_tag(1 + round as u32, 0).unwrap();
        let desc = [BlockDesc::new(local.id(), 0, remote.id(), round * 4096, 4096)];
        assert!(run(&mut sub, &Batch::write(&segment).descs(&desc).arrival_tag(tag)).is_done());
        let landed = gpu.unpaced(|| contents(&remote, round * 4096, 4096));
        assert!(landed == block, "round {round}: Done before the bytes were in place");
        assert_eq!(target.landed(tag), 4096, "counted once in device memory");
    }
}

/// The bench's GPU memory: the simulator's, or the CUDA driver's (the
/// fake's where `LD_LIBRARY_PATH` puts it first).
#[test]
fn the_staged_tcp_bench_runs_beside_host_tcp_and_the_raw_socket_and_verifies() {
    let provider = if on_cuda() { "cuda" } else { "sim" };
    let output = std::process::Command::new(common::kvring_bin())
        .args(["bench", "--memory", "gpu", "--gpu", provider, "--transport", "tcp", "--json"])
        .args(["--block-size", "4KiB,256KiB", "--total", "8MiB", "--region-size", "4MiB", "--latency-samples", "50"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    let cases: Vec<serde_json::Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(cases.len(), 4, "write and read, two block sizes: {cases:?}");
    for case in &cases {
        assert_eq!((case["transport"].as_str(), case["verified"].as_bool()), (Some("tcp"), Some(true)), "{case}");
        for field in ["gbps", "baseline_host_tcp_gbps", "ratio_host_tcp", "baseline_raw_tcp_gbps", "ratio_raw_tcp"] {
            assert!(case[field].as_f64().is_some_and(|v| v > 0.0), "{field} in {case}");
        }
    }
}

/// Many staged batches at once on one link: its 16 pages hold two 8 MiB
/// chunks, the rest wait for pages and every one completes; one whose
/// deadline passes while it waits ends `TimedOut` alone, and the others,
/// on the same connection, still complete.
#[test]
fn exhausted_staging_pages_make_chunks_wait_never_fail_others() {
    on_either("busy_child", Pace { gpus: 1, delay: Duration::from_millis(30) }, exhausted_staging_pages);
}

#[test]
#[ignore = "a child of exhausted_staging_pages_make_chunks_wait_…"]
fn busy_child() {
    in_child("exhausted_staging_pages_make_chunks_wait_never_fail_others", false, exhausted_staging_pages);
}

fn exhausted_staging_pages(gpu: &Driver) {
    let target = gpu.engine("busy-target");
    let initiator = gpu.engine("busy-initiator");
    let local = initiator.alloc_region(64 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let remote = target.alloc_region(64 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.write_at(0, &common::pattern(64 << 20, 77)).unwrap() };
    let segment = tcp(&initiator, &target);
    let mut sub = initiator.submitter().unwrap();
    let mut ids = Vec::new();
    for i in 0..8u64 {
        let desc = [BlockDesc::new(local.id(), i * (8 << 20), remote.id(), i * (8 << 20), 8 << 20)];
        ids.push(sub.submit(&Batch::write(&segment).descs(&desc)).unwrap());
    }
    // Last in line, with a deadline it cannot meet behind the others.
    let late = [BlockDesc::new(local.id(), 0, remote.id(), 0, 8 << 20)];
    let doomed = sub.submit(&Batch::write(&segment).descs(&late).deadline(Duration::from_millis(5))).unwrap();
    for id in ids {
        assert!(sub.wait(id, WAIT).unwrap().is_done(), "a batch waiting for pages completes");
    }
    assert!(matches!(sub.wait(doomed, WAIT).unwrap(), Outcome::TimedOut { .. }));
    assert!(contents(&remote, 8 << 20, 56 << 20) == common::pattern(64 << 20, 77)[8 << 20..]);
    // The link made and pinned its pool once, however many chunks went, and
    // holds no page once they ended.
    let desc = [BlockDesc::new(local.id(), 0, remote.id(), 0, 4096)];
    assert!(run(&mut sub, &Batch::write(&segment).descs(&desc)).is_done());
    let stats = initiator.lane_stats();
    assert_eq!(stats.iter().map(|s| s.staging_pools).sum::<u64>(), 1, "{stats:?}");
    assert_eq!(stats.iter().map(|s| s.staging_pages_out).sum::<u64>(), 0, "{stats:?}");
}

/// A target that restarts while staged chunks are in flight: the batches
/// fail `PeerRestarted` (or completed before it went), the reopened name is
/// reached again, and no staging page stays out once the engines are gone.
/// Pinned host ranges counted by the driver (the simulator's, or the
/// fake's `pinned`).
#[test]
fn restarts_while_staged_chunks_are_in_flight_leak_no_page() {
    on_either("restart_child", Pace { gpus: 1, delay: Duration::from_micros(500) }, restarts_leak_no_page);
}

#[test]
#[ignore = "a child of restarts_while_staged_chunks_are_in_flight_…"]
fn restart_child() {
    in_child("restarts_while_staged_chunks_are_in_flight_leak_no_page", true, restarts_leak_no_page);
}

fn restarts_leak_no_page(gpu: &Driver) {
    let restarts: usize = std::env::var("KVRING_TEST_RESTARTS").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let initiator = gpu.engine("restart-initiator");
    let local = initiator.alloc_region(4 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let (mut failed, mut done, mut most_pinned) = (0, 0, 0);
    for round in 0..restarts {
        let target = gpu.engine("restart-target");
        let remote = target.alloc_region(4 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
        let segment = tcp(&initiator, &target);
        let desc: Vec<_> =
            (0..16u64).map(|i| BlockDesc::new(local.id(), i << 18, remote.id(), i << 18, 1 << 18)).collect();
        let id = sub.submit(&Batch::write(&segment).descs(&desc)).unwrap();
        if round % 2 == 0 {
            std::thread::sleep(Duration::from_micros(300));
        }
        drop(remote);
        drop(target);
        let outcome = sub.wait(id, WAIT).unwrap();
        most_pinned = most_pinned.max(gpu.pinned_host_ranges());
        match outcome {
            Outcome::Done { .. } => done += 1,
            Outcome::Failed(kvring::Error::PeerRestarted { .. }) => failed += 1,
            other => panic!("round {round}: {other:?}"),
        }
        initiator.close_segment(&segment);
    }
    assert_eq!(failed + done, restarts);
    assert!(failed > 0, "no restart caught a chunk in flight ({done} completed first)");
    eprintln!("{restarts} restarts: {failed} caught staged chunks in flight, {done} completed first");
    // The links let go of their pools once their chunks ended (on their
    // lanes, just after the close): no page out, every pool released.
    let deadline = std::time::Instant::now() + WAIT;
    let settled = || {
        let stats = initiator.lane_stats();
        let sum = |f: fn(&kvring::LaneStatsSnapshot) -> u64| stats.iter().map(f).sum::<u64>();
        (sum(|s| s.staging_pages_out), sum(|s| s.staging_pools), sum(|s| s.staging_pools_released))
    };
    while settled().1 != settled().2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let (out, pinned, released) = settled();
    assert_eq!(out, 0, "staging pages still out after {restarts} restarts ({failed} failed mid-flight)");
    assert_eq!(pinned, released, "every pool pinned was released");
    drop(sub);
    drop(local);
    drop(initiator);
    // And on both ends, every pool's memory was unpinned with the GPU.
    assert!(most_pinned > 0, "the staging pools were pinned with the GPU");
    assert_eq!(gpu.pinned_host_ranges(), 0, "pinned host ranges left after every engine went");
}

/// More than the target's pool (32 pages of 1 MiB) read out of its GPU in
/// one batch, and by several connections at once: a frame that finds no
/// page waits and goes on as the replies sent from pages give them back.
#[test]
fn pulling_more_than_the_targets_staging_pool_completes() {
    on_either("deep_child", Pace { gpus: 1, delay: Duration::from_micros(200) }, pulling_more_than_the_pool);
}

#[test]
#[ignore = "a child of pulling_more_than_the_targets_staging_pool_…"]
fn deep_child() {
    in_child("pulling_more_than_the_targets_staging_pool_completes", false, pulling_more_than_the_pool);
}

fn pulling_more_than_the_pool(gpu: &Driver) {
    let target = gpu.engine("deep-target");
    let remote = target.alloc_region(96 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { remote.write_at(0, &common::pattern(96 << 20, 41)).unwrap() };
    let initiator = common::builder("deep-initiator").gpu(gpu.gpu()).lanes(2).build().unwrap();
    let local = initiator.alloc_region(96 << 20, RegionInfo::raw()).unwrap();
    let segment = tcp(&initiator, &target);
    let mut sub = initiator.submitter().unwrap();
    // 96 blocks of 1 MiB: split across both lanes' connections.
    let descs: Vec<_> =
        (0..96u64).map(|i| BlockDesc::new(local.id(), i << 20, remote.id(), i << 20, 1 << 20)).collect();
    assert_eq!(run(&mut sub, &Batch::read(&segment).descs(&descs)).into_result().unwrap(), 96 << 20);
    assert!(contents(&local, 0, 96 << 20) == common::pattern(96 << 20, 41));
    let stats = target.lane_stats();
    assert_eq!(stats.iter().map(|s| s.staging_pages_out).sum::<u64>(), 0, "{stats:?}");
}

/// Peers that send part of a chunk to a GPU region and go quiet hold no
/// pages for long: what a read pass staged is copied at its end, so a
/// legitimate push beside them completes, and its bytes are in place.
#[test]
fn quiet_peers_holding_half_chunks_do_not_hold_the_staging_pool() {
    on_either("held_child", Pace { gpus: 1, delay: Duration::from_micros(100) }, quiet_peers_do_not_hold_the_pool);
}

#[test]
#[ignore = "a child of quiet_peers_holding_half_chunks_…"]
fn held_child() {
    in_child("quiet_peers_holding_half_chunks_do_not_hold_the_staging_pool", false, quiet_peers_do_not_hold_the_pool);
}

fn quiet_peers_do_not_hold_the_pool(gpu: &Driver) {
    use kvring::testing::tcp::{ClientHello, FrameHeader, FrameOp, SERVER_HELLO_BYTES};
    use std::io::{Read, Write};
    use zerocopy::IntoBytes;
    let target = gpu.engine("held-target");
    let remote = target.alloc_region(64 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let mut quiet = Vec::new();
    for peer in 0..6u64 {
        let mut s = std::net::TcpStream::connect(target.tcp_addr().unwrap()).unwrap();
        s.write_all(ClientHello::new(target.epoch(), [0; 16], [0; 16], [0; 16]).as_bytes()).unwrap();
        let mut hello = [0u8; SERVER_HELLO_BYTES];
        s.read_exact(&mut hello).unwrap();
        // Eight frames just over half a page each, none the chunk's last.
        for frame in 0..8u64 {
            let offset = (peer * 8 + frame) * (1 << 20);
            let header = FrameHeader::new(FrameOp::Write, target.epoch(), 1, remote.id().raw(), offset, (1 << 19) + 1);
            s.write_all(header.as_bytes()).unwrap();
            s.write_all(&vec![0xAB; (1 << 19) + 1]).unwrap();
        }
        quiet.push(s);
    }
    let initiator = gpu.engine("beside-initiator");
    let local = initiator.alloc_region(8 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.write_at(0, &common::pattern(8 << 20, 3)).unwrap() };
    let segment = tcp(&initiator, &target);
    let mut sub = initiator.submitter().unwrap();
    let descs: Vec<_> =
        (0..8u64).map(|i| BlockDesc::new(local.id(), i << 20, remote.id(), (56 << 20) + (i << 20), 1 << 20)).collect();
    assert!(run(&mut sub, &Batch::write(&segment).descs(&descs)).is_done());
    assert!(contents(&remote, 56 << 20, 8 << 20) == common::pattern(8 << 20, 3));
    drop(quiet);
}

/// A copy into the target's GPU that the driver refuses fails that chunk's
/// ack (never `Done`), gives its pages back, and the next push goes on.
/// Refused: by the simulator, or by the fake (`refuse_call_after`).
#[test]
fn a_refused_staging_copy_fails_its_chunk_only() {
    on_either("refused_child", Pace { gpus: 1, delay: Duration::from_micros(100) }, a_refused_staging_copy);
}

#[test]
#[ignore = "a child of a_refused_staging_copy_fails_its_chunk_only"]
fn refused_child() {
    in_child("a_refused_staging_copy_fails_its_chunk_only", true, a_refused_staging_copy);
}

fn a_refused_staging_copy(gpu: &Driver) {
    let target = gpu.engine("refusing-target");
    let remote = target.alloc_region(4 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let initiator = gpu.engine("refused-initiator");
    let local = initiator.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.write_at(0, &common::pattern(4 << 20, 8)).unwrap() };
    let segment = tcp(&initiator, &target);
    let mut sub = initiator.submitter().unwrap();
    let descs = [BlockDesc::new(local.id(), 0, remote.id(), 0, 1 << 20)];
    gpu.refuse_copy_call(0);
    match run(&mut sub, &Batch::write(&segment).descs(&descs)) {
        Outcome::Failed(error) => {
            assert!(error.to_string().contains("refused") || error.to_string().contains("gpu"), "{error}")
        }
        other => panic!("a chunk whose copy was refused ended {other:?}"),
    }
    assert!(run(&mut sub, &Batch::write(&segment).descs(&descs)).is_done());
    assert!(contents(&remote, 0, 1 << 20) == common::pattern(1 << 20, 8));
    let stats = target.lane_stats();
    assert_eq!(stats.iter().map(|s| s.staging_pages_out).sum::<u64>(), 0, "{stats:?}");
}

/// One chunk into two GPUs of the target: its ack waits for both copies
/// (on two streams), not only the last.
#[test]
fn a_chunk_into_two_gpus_is_done_only_once_both_copies_are() {
    on_either("two_gpu_child", Pace { gpus: 2, delay: Duration::from_millis(20) }, a_chunk_into_two_gpus);
}

#[test]
#[ignore = "a child of a_chunk_into_two_gpus_is_done_…"]
fn two_gpu_child() {
    in_child("a_chunk_into_two_gpus_is_done_only_once_both_copies_are", false, a_chunk_into_two_gpus);
}

fn a_chunk_into_two_gpus(gpu: &Driver) {
    if gpu.gpu().devices().unwrap().len() < 2 {
        eprintln!("gpu-skip: a_chunk_into_two_gpus_is_done_only_once_both_copies_are: one GPU here");
        return;
    }
    let target = gpu.engine("two-gpu-target");
    let first = target.alloc_region(1 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let second = target.alloc_region(1 << 20, RegionInfo::raw().on_gpu(1)).unwrap();
    let initiator = gpu.engine("two-gpu-initiator");
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let segment = tcp(&initiator, &target);
    let mut sub = initiator.submitter().unwrap();
    for round in 0..10u64 {
        let bytes = common::pattern(8192, round);
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.write_at(0, &bytes).unwrap() };
        let descs = [
            BlockDesc::new(local.id(), 0, first.id(), round * 4096, 4096),
            BlockDesc::new(local.id(), 4096, second.id(), round * 4096, 4096),
        ];
        assert!(run(&mut sub, &Batch::write(&segment).descs(&descs)).is_done());
        let landed = gpu.unpaced(|| [contents(&first, round * 4096, 4096), contents(&second, round * 4096, 4096)]);
        assert!(landed[0] == bytes[..4096], "round {round}: GPU 0");
        assert!(landed[1] == bytes[4096..], "round {round}: GPU 1");
    }
}
