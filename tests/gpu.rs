//! GPU memory end to end on the simulated provider, whose device memory is
//! mapped with no access (a host thread touching it would crash this test)
//! and whose copies land only when an event says so: registration tells
//! device memory from host memory; cuda_ipc moves every pairing of device
//! and host memory, in one process and across processes (legacy handles
//! and runs of pieces, as PyTorch's expandable segments); a batch is never
//! `Done` before its bytes are in place; faults are clear errors; tcp
//! touches device memory only through the provider's copies (staging:
//! tests/gpu_tcp.rs).
//!
//! With `TEST_GPU_PROVIDER=cuda` (what `benches/gpu_check.sh` sets on a GPU
//! machine, and `.ci/stage-fakecuda.sh` over the fake driver) the same
//! tests run on the CUDA driver. Those that read the driver's counters or
//! inject its failures run there in a child process of this binary (so the
//! driver's counters and knobs are the test's alone) over the fake driver,
//! through its own control symbols (tests/common/fakecuda.rs); a test that
//! cannot run on a provider prints a line starting `gpu-skip:`, saying
//! why, so a run's skips can be counted (docs/FAKECUDA.md).

mod common;

use common::fakecuda::Fake;
use common::{read, run, WAIT};
use kvring::gpu::{CopyMethod, CopyMethodCounts, Gpu, SimGpu};
use kvring::{Batch, BlockDesc, Engine, Error, Opcode, Outcome, Region, RegionInfo, Segment, TransportKind};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// True when the tests run on the CUDA driver.
fn on_cuda() -> bool {
    std::env::var("TEST_GPU_PROVIDER").is_ok_and(|v| v == "cuda")
}

/// The provider the tests run on: the simulator (copies `delay` late), or
/// the CUDA driver.
fn provider_with(delay: Duration) -> Arc<dyn Gpu> {
    match on_cuda() {
        true => Arc::new(kvring::gpu::CudaGpu::load().expect("TEST_GPU_PROVIDER=cuda needs a CUDA driver")),
        false => Arc::new(SimGpu::new(2, delay)),
    }
}

fn provider() -> Arc<dyn Gpu> {
    provider_with(Duration::from_millis(1))
}

/// Says that `test` does no real work on this provider, and why: every
/// skip prints this one line (counted in docs/FAKECUDA.md).
fn skipped(test: &str, why: &str) {
    eprintln!("gpu-skip: {test}: {why}");
}

/// The provider of a test that reads the driver's counters or injects its
/// failures: the simulator (its own methods), or the CUDA provider over
/// the fake driver (the fake's `fakecuda_stat`/`fakecuda_set`), in a child
/// process of its own ([`on_either`]).
enum Driver {
    Sim(Arc<SimGpu>),
    Fake { gpu: Arc<dyn Gpu>, fake: Fake },
}

impl Driver {
    fn gpu(&self) -> Arc<dyn Gpu> {
        match self {
            Driver::Sim(sim) => sim.clone(),
            Driver::Fake { gpu, .. } => gpu.clone(),
        }
    }

    fn builder(&self, name: &str) -> kvring::EngineBuilder {
        common::builder(name).gpu(self.gpu())
    }

    fn engine(&self, name: &str) -> Engine {
        self.builder(name).build().unwrap()
    }

    /// Batched copy calls and the copies they carried, so far.
    fn copy_counts(&self) -> (u64, u64) {
        match self {
            Driver::Sim(sim) => sim.copy_counts(),
            Driver::Fake { fake, .. } => (fake.stat("batches") as u64, fake.stat("copies") as u64),
        }
    }

    /// The next copy faults on the device; returns what the error says.
    fn fail_next_copy(&self) -> &'static str {
        match self {
            Driver::Sim(sim) => {
                sim.fail_next_copy();
                "a copy failed on the device"
            }
            Driver::Fake { fake, .. } => {
                fake.set("fault_after", 0);
                "CUDA_ERROR_ILLEGAL_ADDRESS"
            }
        }
    }

    /// Every queued copy runs `delay` late from now on (the simulator was
    /// made that slow; `None`: on time again).
    fn slow_copies(&self, delay: Option<Duration>) {
        if let Driver::Fake { fake, .. } = self {
            fake.set("delay_us", delay.map_or(-1, |d| d.as_micros() as i64));
        }
    }

    /// The next opening of a peer's memory fails as for a peer that
    /// exited; returns what the error says.
    fn fail_next_open(&self) -> &'static str {
        match self {
            Driver::Sim(sim) => {
                sim.fail_next_open();
                "injected"
            }
            Driver::Fake { fake, .. } => {
                fake.set("fail_opens", 1);
                "CUDA_ERROR_INVALID_HANDLE"
            }
        }
    }

    /// GPU `device` is lost (the simulator's, or the fake's context of it
    /// poisoned); returns what the errors say.
    fn lose_device(&self, device: u32) -> &'static str {
        match self {
            Driver::Sim(sim) => {
                sim.lose_device(device);
                "the device was lost"
            }
            Driver::Fake { fake, .. } => {
                fake.set("lose_device", i64::from(device));
                "CUDA_ERROR_ILLEGAL_ADDRESS"
            }
        }
    }

    /// The GPU through which this process reaches a peer's memory that is
    /// on its GPU `ordinal`: that GPU on the simulator; on the driver, the
    /// GPU whose context opened it (legacy IPC maps it into that context
    /// only [ref: cuIpcOpenMemHandle]; the fake's `ipc_opened:D`).
    fn device_reaching(&self, ordinal: u32) -> u32 {
        match self {
            Driver::Sim(_) => ordinal,
            Driver::Fake { fake, .. } => {
                (0..8).find(|&d| fake.stat(&format!("ipc_opened:{d}")) > 0).expect("a peer's memory opened here")
            }
        }
    }

    /// Peers' allocations opened and closed so far.
    fn open_counts(&self) -> (u64, u64) {
        match self {
            Driver::Sim(sim) => sim.open_counts(),
            Driver::Fake { fake, .. } => (fake.stat("ipc_opens") as u64, fake.stat("ipc_closes") as u64),
        }
    }

    /// After `accepted` more copy calls, one is refused at once; returns
    /// what the error says.
    fn refuse_copy_call(&self, accepted: u32) -> &'static str {
        match self {
            Driver::Sim(sim) => {
                sim.refuse_copy_call(accepted);
                "refused the copy call"
            }
            Driver::Fake { fake, .. } => {
                fake.set("refuse_call_after", i64::from(accepted));
                "a batched copy (the whole call refused)"
            }
        }
    }
}

/// Runs `body` on the simulator `sim` here, or, on the CUDA driver, in a
/// child process of this binary (the ignored test `child`, which calls
/// [`in_child`]) with `env` set before the driver loads.
fn on_either(child: &str, env: &[(&str, &str)], sim: impl FnOnce() -> SimGpu, body: fn(&Driver)) {
    if !on_cuda() {
        return body(&Driver::Sim(Arc::new(sim())));
    }
    let output = Command::new(std::env::current_exe().unwrap())
        .args([child, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("KVRING_GPU_SCENARIO", "1")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success() && text.contains("1 passed"), "{child} failed:\n{text}");
    for line in text.lines().filter(|l| l.contains("gpu-skip:")) {
        eprintln!("{}", &line[line.find("gpu-skip:").unwrap()..]); // the child's skip, counted here
    }
}

/// The child side of [`on_either`]: `body` on the CUDA provider over the
/// fake driver; on another driver it skips, saying so (a real driver has
/// neither the counters nor the knobs), unless `FAKECUDA_REQUIRED=1`.
fn in_child(test: &str, body: fn(&Driver)) {
    assert!(std::env::var("KVRING_GPU_SCENARIO").is_ok(), "run by on_either");
    let gpu = Arc::new(kvring::gpu::CudaGpu::load().expect("TEST_GPU_PROVIDER=cuda needs a CUDA driver"));
    match Fake::find() {
        Some(fake) => body(&Driver::Fake { gpu, fake }),
        None => {
            let required = std::env::var("FAKECUDA_REQUIRED").is_ok_and(|v| v == "1");
            assert!(!required, "FAKECUDA_REQUIRED=1 but the fake driver is not loaded");
            skipped(test, "it reads the fake driver's counters or injects its failures, which a real driver lacks");
        }
    }
}

fn sim() -> SimGpu {
    SimGpu::new(2, Duration::from_millis(1))
}

/// A second GPU where there is one, else the first.
fn other_gpu(gpu: &Arc<dyn Gpu>) -> u32 {
    u32::from(gpu.devices().unwrap().len() > 1)
}

fn engine(name: &str, gpu: &Arc<impl Gpu + 'static>) -> Engine {
    common::builder(name).gpu(gpu.clone()).build().unwrap()
}

fn engine_on(name: &str, gpu: &Arc<dyn Gpu>) -> Engine {
    common::builder(name).gpu(gpu.clone()).build().unwrap()
}

fn open(initiator: &Engine, target: &Engine, transport: Option<TransportKind>) -> kvring::Result<Segment> {
    initiator.open_segment_with(&target.control_addr().to_string(), transport, WAIT)
}

#[test]
fn registration_tells_device_memory_from_host_memory() {
    let gpu = provider();
    let engine = engine_on("gpu-0", &gpu);
    let device = gpu.alloc(0, 1 << 20).unwrap();
    let mut host = vec![0u8; 1 << 16];
    let other = other_gpu(&gpu);

    // A CUDA tensor's address handed to a host API: refused, saying how.
    // SAFETY: refused before anything is kept.
    let error = unsafe { engine.register(device.0 as *mut u8, 1 << 20, RegionInfo::raw()) }.unwrap_err();
    assert!(error.to_string().contains("is memory of GPU 0, registered as host memory"), "{error}");
    assert!(error.to_string().contains("RegionInfo::on_gpu(0)"), "{error}");
    // SAFETY: refused.
    let error = unsafe { engine.register(host.as_mut_ptr(), host.len(), RegionInfo::raw().on_gpu(0)) }.unwrap_err();
    assert!(error.to_string().contains("is host memory, registered as GPU 0's"), "{error}");
    // SAFETY: refused.
    let error = unsafe { engine.register(device.0 as *mut u8, 1 << 20, RegionInfo::raw().on_gpu(5)) }.unwrap_err();
    assert!(error.to_string().contains("is memory of GPU 0, registered as GPU 5's"), "{error}");
    // SAFETY: refused.
    let error = unsafe { engine.register(device.0 as *mut u8, 2 << 20, RegionInfo::raw().on_gpu(0)) }.unwrap_err();
    assert!(error.to_string().contains("runs past its"), "{error}");

    // Told right, both register, and say where they live.
    // SAFETY: the allocation and `host` outlive the engine's use of them.
    let on_gpu = unsafe { engine.register(device.0 as *mut u8, 1 << 20, RegionInfo::raw().on_gpu(0)) }.unwrap();
    // SAFETY: as above.
    let on_host = unsafe { engine.register(host.as_mut_ptr(), host.len(), RegionInfo::raw()) }.unwrap();
    assert_eq!(engine.region_info(on_gpu).unwrap().2.memory, kvring::MemoryKind::Gpu(0));
    assert_eq!(engine.region_info(on_host).unwrap().2.memory, kvring::MemoryKind::Host);

    // The engine allocates GPU memory too, and reaches its bytes only
    // through the copy engine.
    let owned = engine.alloc_region(1 << 16, RegionInfo::raw().on_gpu(other)).unwrap();
    assert_eq!(owned.memory(), kvring::MemoryKind::Gpu(other));
    assert!(owned.shm_path().is_none());
    let bytes = common::pattern(5000, 4);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { owned.write_at(100, &bytes).unwrap() };
    assert_eq!(read(&owned, 100, 5000), bytes);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    assert_eq!(unsafe { owned.checksum(100, 5000).unwrap() }, kvring::testing::checksum(&bytes));
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    assert!(unsafe { owned.write_at((1 << 16) - 10, &bytes).is_err() }, "bounds are checked before the GPU is asked");
    // Host shared memory is pinned for the GPU's copy engines (the
    // mapping, header page included).
    let pinned = engine.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    assert!(gpu.host_is_pinned(pinned.as_ptr() as u64 - 4096), "the mapping, header page included");
    drop(engine);
    // SAFETY: the engine that registered it is gone.
    unsafe { gpu.free(device).unwrap() };

    // Managed memory: the host may touch it, but it cannot be shared. On
    // the driver, allocated as an application would (cuMemAllocManaged
    // on GPU 1, its context current on this thread).
    let (gpu, managed) = if !on_cuda() {
        let sim = Arc::new(sim());
        let at = sim.alloc_managed(1, 4096).unwrap().0;
        (sim as Arc<dyn Gpu>, at)
    } else if let Some(fake) = Fake::find() {
        fake.become_application_on(1);
        (gpu, fake.application_alloc_managed(4096))
    } else {
        skipped("registration_tells_device_memory_from_host_memory", "managed memory is allocated through the fake");
        return;
    };
    let engine = engine_on("gpu-managed", &gpu);
    // SAFETY: refused.
    let error = unsafe { engine.register(managed as *mut u8, 4096, RegionInfo::raw().on_gpu(1)) }.unwrap_err();
    assert!(error.to_string().contains("managed memory"), "{error}");
    // SAFETY: the managed allocation outlives the engine's use of it.
    unsafe { engine.register(managed as *mut u8, 4096, RegionInfo::raw()) }.unwrap();
    drop(pinned);
}

/// Caller-registered host memory is pinned with the GPU provider only when
/// the engine is asked to (GPU-REVIEW #14: off by default), best effort,
/// counted, visible per region, and unpinned when unregistered; memory its
/// owner pinned is used as it is, on or off.
#[test]
fn caller_host_memory_is_pinned_only_when_asked_and_never_twice() {
    // Whether a range is pinned is the provider's answer (the simulator's
    // registrations, or the driver's CU_POINTER_ATTRIBUTE_MEMORY_TYPE).
    let gpu = provider();
    let stats = |regions, bytes, owner_pinned, left_pageable| kvring::HostPinStats {
        regions,
        bytes,
        failed: 0,
        owner_pinned,
        left_pageable,
    };
    // Off by default: registered, moved, left pageable.
    let quiet = engine_on("pin-off-engine", &gpu);
    let mut kv = vec![0u8; 1 << 16];
    let addr = kv.as_mut_ptr() as u64;
    // SAFETY: `kv` outlives its registration (unregistered below).
    let id = unsafe { quiet.register(kv.as_mut_ptr(), kv.len(), RegionInfo::raw()) }.unwrap();
    assert!(!gpu.host_is_pinned(addr) && !quiet.region_pinned(id));
    assert_eq!(quiet.host_pins(), stats(0, 0, 0, 1));
    quiet.unregister(id).unwrap();

    // Asked for: pinned once, unpinned at unregister.
    let engine = common::builder("pin-engine").gpu(gpu.clone()).pin_host_memory(true).build().unwrap();
    // SAFETY: as above.
    let id = unsafe { engine.register(kv.as_mut_ptr(), kv.len(), RegionInfo::raw()) }.unwrap();
    assert!(gpu.host_is_pinned(addr) && engine.region_pinned(id));
    assert_eq!(engine.host_pins(), stats(1, 1 << 16, 0, 0));
    // SAFETY: as above; the same registration again is the same region.
    assert_eq!(unsafe { engine.register(kv.as_mut_ptr(), kv.len(), RegionInfo::raw()) }.unwrap(), id);
    assert_eq!(engine.host_pins(), stats(1, 1 << 16, 0, 0), "pinned once");
    engine.unregister(id).unwrap();
    assert!(!gpu.host_is_pinned(addr) && !engine.region_pinned(id));
    assert_eq!(engine.host_pins().regions, 0);

    // Memory its owner pinned: used as it is by both engines, never pinned
    // again nor unpinned by them.
    let mut theirs = vec![0u8; 1 << 16];
    // SAFETY: unpinned below, before `theirs` is freed.
    unsafe { gpu.host_register(theirs.as_mut_ptr() as u64, 1 << 16).unwrap() };
    for (which, e) in [("asked", &engine), ("default", &quiet)] {
        // SAFETY: `theirs` outlives the engine's use of it.
        let other = unsafe { e.register(theirs.as_mut_ptr(), theirs.len(), RegionInfo::raw()) }.unwrap();
        assert!(!e.region_pinned(other), "{which}");
        assert_eq!(e.host_pins().owner_pinned, 1, "{which}");
        assert_eq!(e.host_pins().failed, 0, "{which}");
        e.unregister(other).unwrap();
        assert!(gpu.host_is_pinned(theirs.as_ptr() as u64), "{which}: the engine unpins only what it pinned");
    }
    gpu.host_unregister(theirs.as_ptr() as u64).unwrap();
}

#[test]
fn without_a_gpu_provider_a_gpu_region_is_refused() {
    if kvring::host::gpus().is_ok() {
        // A host with a CUDA driver (the fake's included): in a child that
        // sees no GPU (`CUDA_VISIBLE_DEVICES` empty: `cuInit` finds none).
        let output = Command::new(std::env::current_exe().unwrap())
            .args(["no_gpu_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env("CUDA_VISIBLE_DEVICES", "")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success() && text.contains("1 passed"), "{text}");
        return;
    }
    no_gpu_provider_refuses_gpu_regions();
}

/// The child of [`without_a_gpu_provider_a_gpu_region_is_refused`] on a
/// host with a driver.
#[test]
#[ignore = "a child of without_a_gpu_provider_…"]
fn no_gpu_child() {
    assert!(kvring::host::gpus().is_err(), "CUDA_VISIBLE_DEVICES is empty here");
    no_gpu_provider_refuses_gpu_regions();
}

fn no_gpu_provider_refuses_gpu_regions() {
    let engine = common::engine("gpu-none");
    let mut host = vec![0u8; 4096];
    // SAFETY: refused.
    let error = unsafe { engine.register(host.as_mut_ptr(), 4096, RegionInfo::raw().on_gpu(0)) }.unwrap_err();
    assert!(error.to_string().contains("no GPU provider"), "{error}");
    let error = engine.alloc_region(4096, RegionInfo::raw().on_gpu(0)).unwrap_err();
    assert!(error.to_string().contains("no GPU provider"), "{error}");
}

/// Every pairing of local and remote memory, WRITE then READ back into a
/// cleared range, bytes checked through the provider.
#[test]
fn cuda_ipc_moves_every_pairing_of_device_and_host_memory_in_one_process() {
    let gpu = provider();
    let target = engine_on("ipc-target", &gpu);
    let initiator = engine_on("ipc-initiator", &gpu);
    let remote_gpu = target.alloc_region(1 << 20, RegionInfo::raw().on_gpu(other_gpu(&gpu))).unwrap();
    let remote_host = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let local_gpu = initiator.alloc_region(1 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let local_shm = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let mut caller = vec![0u8; 1 << 20];
    // SAFETY: `caller` outlives the engine's use of it (the engine drops first).
    let local_caller = unsafe { initiator.register(caller.as_mut_ptr(), caller.len(), RegionInfo::raw()) }.unwrap();
    let segment = open(&initiator, &target, None).unwrap();
    assert_eq!(segment.transport(), TransportKind::CudaIpc, "GPU memory on one host: cuda_ipc first");
    let mut sub = initiator.submitter().unwrap();
    let locals: [(&str, kvring::RegionId, Option<&Region>); 3] = [
        ("gpu", local_gpu.id(), Some(&local_gpu)),
        ("shm", local_shm.id(), Some(&local_shm)),
        ("caller", local_caller, None),
    ];
    for (seed, (local_name, local, local_region)) in locals.into_iter().enumerate() {
        for (remote_name, remote) in [("gpu", &remote_gpu), ("host", &remote_host)] {
            let what = format!("{local_name} -> {remote_name}");
            let source = common::pattern(3 * 4096, seed as u64 + 10);
            match local_region {
                // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
                Some(region) => unsafe { region.write_at(0, &source).unwrap() },
                None => caller[..source.len()].copy_from_slice(&source),
            }
            // Three adjacent blocks: one copy (coalesced) on the GPU's side.
            let push: Vec<BlockDesc> =
                (0..3).map(|i| BlockDesc::new(local, i * 4096, remote.id(), 8192 + i * 4096, 4096)).collect();
            assert!(run(&mut sub, &Batch::write(&segment).descs(&push)).is_done(), "{what}");
            assert_eq!(read(remote, 8192, source.len()), source, "{what}: written");
            // Back into a cleared range of the local region.
            let pull: Vec<BlockDesc> =
                (0..3).map(|i| BlockDesc::new(local, 65536 + i * 4096, remote.id(), 8192 + i * 4096, 4096)).collect();
            assert!(run(&mut sub, &Batch::read(&segment).descs(&pull)).is_done(), "{what}");
            let back = match local_region {
                Some(region) => read(region, 65536, source.len()),
                None => caller[65536..65536 + source.len()].to_vec(),
            };
            assert_eq!(back, source, "{what}: read back");
        }
    }
    drop(sub);
    drop(initiator);
}

/// Copy calls and copies counted by the driver (the simulator's, or the
/// fake's `batches` and `copies`).
#[test]
fn adjacent_blocks_cost_one_copy_and_a_chunk_one_batched_call() {
    on_either("coalesce_child", &[], sim, adjacent_blocks_cost_one_copy);
}

#[test]
#[ignore = "a child of adjacent_blocks_cost_one_copy_…"]
fn coalesce_child() {
    in_child("adjacent_blocks_cost_one_copy_and_a_chunk_one_batched_call", adjacent_blocks_cost_one_copy);
}

fn adjacent_blocks_cost_one_copy(gpu: &Driver) {
    let target = gpu.engine("coalesce-target");
    let initiator = gpu.engine("coalesce-initiator");
    let remote = target.alloc_region(1 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(3) };
    let segment = open(&initiator, &target, None).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let before = gpu.copy_counts();
    // 64 blocks, adjacent on both sides: one call, one copy.
    let adjacent: Vec<BlockDesc> =
        (0..64).map(|i| BlockDesc::new(local.id(), i * 4096, remote.id(), i * 4096, 4096)).collect();
    assert!(run(&mut sub, &Batch::write(&segment).descs(&adjacent)).is_done());
    let after = gpu.copy_counts();
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 1), "one batched call carrying one copy");
    // 64 blocks scattered on the remote side: one call, 64 copies.
    let scattered: Vec<BlockDesc> =
        (0..64).map(|i| BlockDesc::new(local.id(), i * 4096, remote.id(), (63 - i) * 4096, 4096)).collect();
    assert!(run(&mut sub, &Batch::write(&segment).descs(&scattered)).is_done());
    let last = gpu.copy_counts();
    assert_eq!((last.0 - after.0, last.1 - after.1), (1, 64));
    assert_eq!(read(&remote, 63 * 4096, 4096), read(&local, 0, 4096));
}

/// A slow copy engine: the simulator made slow, or the fake's streams
/// running each job late (`delay_us`).
#[test]
fn a_batch_past_its_deadline_ends_only_once_its_copies_have() {
    on_either("deadline_child", &[], || SimGpu::new(1, SLOW_COPY), a_batch_past_its_deadline);
}

#[test]
#[ignore = "a child of a_batch_past_its_deadline_…"]
fn deadline_child() {
    in_child("a_batch_past_its_deadline_ends_only_once_its_copies_have", a_batch_past_its_deadline);
}

/// How late the slow copy engine of the deadline test runs each copy.
const SLOW_COPY: Duration = Duration::from_millis(300);

fn a_batch_past_its_deadline(gpu: &Driver) {
    let delay = SLOW_COPY;
    let target = gpu.engine("slow-target");
    let initiator = gpu.engine("slow-initiator");
    let remote = target.alloc_region(1 << 16, RegionInfo::raw().on_gpu(0)).unwrap();
    let local = initiator.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(21) };
    let segment = open(&initiator, &target, None).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let desc = [BlockDesc::new(local.id(), 0, remote.id(), 0, 4096)];
    gpu.slow_copies(Some(delay));
    let started = Instant::now();
    let batch = Batch::write(&segment).descs(&desc).deadline(Duration::from_millis(20));
    let outcome = run(&mut sub, &batch);
    gpu.slow_copies(None);
    assert!(matches!(outcome, Outcome::TimedOut { bytes: 4096 }), "its copy landed, late: {outcome:?}");
    // A copy cannot be recalled: the batch ended once it had landed, so
    // its memory is the caller's again, and the segment stays healthy.
    assert!(started.elapsed() >= delay, "ended after {:?}, before its copy", started.elapsed());
    assert_eq!(read(&remote, 0, 4096), read(&local, 0, 4096));
    assert!(run(&mut sub, &Batch::write(&segment).descs(&desc)).is_done(), "the segment is not stale");
}

/// Faults injected: the simulator's, or the fake's (`fault_after`: a copy
/// raising the sticky `ILLEGAL_ADDRESS`; `lose_device`).
#[test]
fn gpu_faults_are_clear_errors_and_the_lane_serves_others() {
    on_either("engine_fault_child", &[], sim, gpu_faults_are_clear_errors);
}

#[test]
#[ignore = "a child of gpu_faults_are_clear_errors_…"]
fn engine_fault_child() {
    in_child("gpu_faults_are_clear_errors_and_the_lane_serves_others", gpu_faults_are_clear_errors);
}

fn gpu_faults_are_clear_errors(gpu: &Driver) {
    let target = gpu.engine("fault-target");
    let initiator = gpu.engine("fault-initiator");
    let remote = target.alloc_region(1 << 20, RegionInfo::raw().on_gpu(1)).unwrap();
    let host_peer = gpu.engine("fault-host-peer");
    let host_remote = host_peer.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let mut sub = initiator.submitter().unwrap();

    // A copy that fails on the device: the batch fails with it, the rest
    // of its chunks are not reported done.
    let segment = open(&initiator, &target, None).unwrap();
    let host_segment = open(&initiator, &host_peer, Some(TransportKind::Shm)).unwrap();
    let says = gpu.fail_next_copy();
    let many: Vec<BlockDesc> =
        (0..600).map(|i| BlockDesc::new(local.id(), i * 1024, remote.id(), (599 - i) * 1024, 1024)).collect();
    match run(&mut sub, &Batch::write(&segment).descs(&many)) {
        Outcome::Failed(error) => assert!(error.to_string().contains(says), "{error}"),
        other => panic!("{other:?}"),
    }
    // Host memory on the same lane still moves (GPU errors are sticky, as
    // CUDA's are, but a host copy never asks the GPU).
    let host = [BlockDesc::new(local.id(), 0, host_remote.id(), 0, 4096)];
    assert!(run(&mut sub, &Batch::write(&host_segment).descs(&host)).is_done());

    // A peer whose GPU is gone: its transfers fail, saying so. (An export
    // that does not open is a cross-process test below: in one process the
    // peer's pointers are used as they are, never opened.)
    let fresh = match gpu {
        Driver::Sim(_) => Driver::Sim(Arc::new(sim())),
        Driver::Fake { gpu, fake } => Driver::Fake { gpu: gpu.clone(), fake: fake.clone() },
    };
    let (t2, i2) = (fresh.engine("open-target"), fresh.engine("open-initiator"));
    let far = t2.alloc_region(1 << 16, RegionInfo::raw().on_gpu(0)).unwrap();
    let segment = open(&i2, &t2, None).unwrap();
    let local2 = i2.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    let mut sub2 = i2.submitter().unwrap();
    let says = fresh.lose_device(0);
    let desc = [BlockDesc::new(local2.id(), 0, far.id(), 0, 4096)];
    match run(&mut sub2, &Batch::write(&segment).descs(&desc)) {
        Outcome::Failed(error) => assert!(error.to_string().contains(says), "{error}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn tcp_moves_device_memory_only_through_the_providers_copies() {
    // Staged through pinned pages on both ends (tests/gpu_tcp.rs covers the
    // pairings): here, a checksum of a peer's GPU region runs through the
    // target's copy engine, never a host read of device memory.
    let gpu = provider();
    let target = engine_on("gpu-target", &gpu);
    let initiator = engine_on("gpu-initiator", &gpu);
    let theirs = target.alloc_region(1 << 16, RegionInfo::raw().on_gpu(other_gpu(&gpu))).unwrap();
    let segment = open(&initiator, &target, Some(TransportKind::Tcp)).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { theirs.write_at(0, &common::pattern(4096, 8)).unwrap() };
    let sum = segment.remote_checksum(theirs.id(), 0, 4096, WAIT).unwrap();
    assert_eq!(sum, kvring::testing::checksum(&common::pattern(4096, 8)));
}

/// A target in another process (this test binary, run as a child): its GPU
/// memory is exported and opened for real (descriptors the child passes
/// over its socket, or the driver's legacy handles), not shared by pointer.
struct ChildTarget {
    child: Child,
    addr: String,
    /// Kept open, so the child's last words find a reader.
    stdout: BufReader<std::process::ChildStdout>,
}

impl ChildTarget {
    /// Starts a child serving GPU memory laid out as `mode` says
    /// (`legacy`, `pieces`, `kv` or `mla`), its copy engine `delay_us` slow.
    fn start(mode: &str, delay_us: u64) -> Self {
        Self::start_on(mode, delay_us, "127.0.0.1:0")
    }

    /// [`ChildTarget::start`], its control server on `listen`.
    fn start_on(mode: &str, delay_us: u64, listen: &str) -> Self {
        Self::start_with(mode, delay_us, listen, &[])
    }

    /// [`ChildTarget::start_on`], with `env` set in the child.
    fn start_with(mode: &str, delay_us: u64, listen: &str, env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--ignored", "--exact", "gpu_child_target", "--nocapture", "--test-threads=1"])
            .env("KVRING_GPU_CHILD", mode)
            .env("KVRING_GPU_CHILD_DELAY_US", delay_us.to_string())
            .env("KVRING_GPU_CHILD_LISTEN", listen)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let addr = loop {
            let mut line = String::new();
            assert!(stdout.read_line(&mut line).unwrap() > 0, "the child exited before it was ready");
            // libtest prints the test's name before it on the same line.
            if let Some((_, addr)) = line.split_once("ready ") {
                break addr.trim().to_string();
            }
        };
        ChildTarget { child, addr, stdout }
    }

    /// Asks the child to free its `pieces` memory, as an owner might while
    /// it is still registered and opened by a peer, and waits until it has.
    fn free_memory(&mut self) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(b"free\n").unwrap();
        stdin.flush().unwrap();
        loop {
            let mut line = String::new();
            assert!(self.stdout.read_line(&mut line).unwrap() > 0, "the child exited before it freed its memory");
            if line.contains("freed") {
                break;
            }
        }
    }

    /// `kill -9`, then reaped.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildTarget {
    fn drop(&mut self) {
        drop(self.child.stdin.take()); // the child exits at EOF
        let _ = self.child.wait();
    }
}

/// The KV cache shape of the `kv` (MHA) or `mla` child and its initiator.
fn kv_shape(mode: &str) -> kvring::kv::CacheShape {
    match mode {
        "kv" => kvring::kv::CacheShape::mha(3, 32, 2, 64, 2, 1, 1).unwrap(),
        // DeepSeek's shape, smaller: a latent buffer and an index buffer
        // per layer, no value buffer.
        "mla" => kvring::kv::CacheShape::mla(3, 32, 576, 2, 1, 128).unwrap(),
        other => panic!("no KV shape for {other}"),
    }
}

/// A piece of the `pieces` child's run: the NVIDIA allocation granularity.
const PIECE_BYTES: u64 = 2 << 20;
/// The `legacy` and `pieces` children's region.
const PIECES_BYTES: u64 = 4 * PIECE_BYTES;

/// Pieces of the `expandable` child: 2,048 of them in 160 regions, as an
/// H100's 40 GiB expandable KV cache has 20 MiB pages (16 KiB here).
const EXPANDABLE_PIECES: u32 = 2048;
const EXPANDABLE_PIECE: u64 = 16 << 10;
const EXPANDABLE_REGIONS: u64 = 160;
/// Each region: 12.75 pieces, so regions start and end inside pieces.
const EXPANDABLE_REGION: u64 = EXPANDABLE_PIECE * 51 / 4;

/// Copies `bytes` to device address `dst` and waits for the copy.
fn upload(gpu: &Arc<dyn Gpu>, dst: u64, bytes: &[u8]) {
    let stream = gpu.create_stream(0).unwrap();
    let event = gpu.create_event(0).unwrap();
    let copy = kvring::gpu::Copy { src: bytes.as_ptr() as u64, dst, len: bytes.len() as u64 };
    // SAFETY: `bytes` outlives the wait below.
    unsafe { gpu.copy_one(stream, copy).unwrap() };
    gpu.record(stream, event).unwrap();
    eventually("the upload", || gpu.query(event).unwrap());
}

/// The child side of [`ChildTarget`]: run only as such.
#[test]
#[ignore = "the child of the cross-process GPU tests"]
fn gpu_child_target() {
    let mode = std::env::var("KVRING_GPU_CHILD").expect("run by ChildTarget");
    let delay: u64 = std::env::var("KVRING_GPU_CHILD_DELAY_US").unwrap().parse().unwrap();
    let gpu = provider_with(Duration::from_micros(delay));
    let listen = std::env::var("KVRING_GPU_CHILD_LISTEN").unwrap().parse().unwrap();
    let engine = common::builder("gpu-child").gpu(gpu.clone()).listen(listen).build().unwrap();
    let mut _keep = Vec::new();
    let mut pieces = None;
    match mode.as_str() {
        "legacy" => {
            _keep.push(engine.alloc_region(PIECES_BYTES as usize, RegionInfo::raw().on_gpu(other_gpu(&gpu))).unwrap())
        }
        "pieces" => {
            // A run of pieces (as an expandable segment), one region.
            let run = gpu.alloc_pieces(0, PIECE_BYTES, (PIECES_BYTES / PIECE_BYTES) as u32).unwrap();
            // SAFETY: the run lives as long as this process, unless the
            // parent has it freed (below), after which nothing here uses it.
            unsafe { engine.register(run.0 as *mut u8, PIECES_BYTES as usize, RegionInfo::raw().on_gpu(0)) }.unwrap();
            pieces = Some(run);
        }
        "kv" | "mla" => _keep = common::gpu_kv_cache(&engine, kv_shape(&mode), 100).0,
        "expandable" => {
            // An expandable segment's KV cache: many small pieces, many
            // regions over them, each region's ends inside pieces.
            let run = gpu.alloc_pieces(0, EXPANDABLE_PIECE, EXPANDABLE_PIECES).unwrap();
            upload(&gpu, run.0, &common::pattern(EXPANDABLE_PIECE as usize * EXPANDABLE_PIECES as usize, 77));
            for i in 0..EXPANDABLE_REGIONS {
                let at = run.0 + i * EXPANDABLE_REGION;
                // SAFETY: the run lives as long as this process.
                unsafe { engine.register(at as *mut u8, EXPANDABLE_REGION as usize, RegionInfo::raw().on_gpu(0)) }
                    .unwrap();
            }
        }
        other => panic!("unknown mode {other}"),
    }
    println!("ready {}", engine.control_addr());
    std::io::stdout().flush().unwrap();
    // Until the parent closes stdin; "free" frees the pieces under the
    // engine's registration, as an owner might.
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {
        if line.trim() == "free" {
            let run = pieces.take().expect("only the pieces child frees its memory");
            // SAFETY: nothing in this process copies from it from now on
            // (the peer copies in its own process, through its own handles).
            unsafe { gpu.free(run).unwrap() };
            println!("freed");
            std::io::stdout().flush().unwrap();
        }
        line.clear();
    }
}

#[test]
fn across_processes_legacy_handles_and_runs_of_pieces_open_and_move() {
    let gpu = provider();
    let initiator = engine_on("xproc-initiator", &gpu);
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(31) };
    let mut sub = initiator.submitter().unwrap();
    for mode in ["legacy", "pieces"] {
        let target = ChildTarget::start(mode, 200);
        let segment = initiator.open_segment_with(&target.addr, None, WAIT).unwrap();
        assert_eq!(segment.transport(), TransportKind::CudaIpc, "{mode}");
        let remote = segment.regions()[0].clone();
        assert!(matches!(remote.memory, kvring::MemoryKind::Gpu(_)), "{mode}: {remote:?}");
        // 256 KiB blocks across a boundary between pieces, then read back.
        let at = PIECE_BYTES - 131072;
        let descs: Vec<BlockDesc> =
            (0..3).map(|i| BlockDesc::new(local.id(), i * 262144, remote.id, at + i * 262144, 262144)).collect();
        let outcome = run(&mut sub, &Batch::write(&segment).descs(&descs));
        assert!(outcome.is_done(), "{mode}: {outcome:?}");
        let expected = read(&local, 0, 3 * 262144);
        let sum = segment.remote_checksum(remote.id, at, expected.len() as u64, WAIT).unwrap();
        assert_eq!(sum, kvring::testing::checksum(&expected), "{mode}: the target's bytes, read by the target");
        let back: Vec<BlockDesc> = (0..3)
            .map(|i| BlockDesc::new(local.id(), (1 << 19) + i * 65536, remote.id, at + i * 262144, 65536))
            .collect();
        assert!(run(&mut sub, &Batch::read(&segment).descs(&back)).is_done(), "{mode}");
        for i in 0..3usize {
            let got = read(&local, (1 << 19) + i as u64 * 65536, 65536);
            assert_eq!(got, expected[i * 262144..i * 262144 + 65536], "{mode}: block {i} read back");
        }
        initiator.close_segment(&segment);
    }
}

/// An export whose opening fails (as for a peer that exited between the
/// handshake and the open): the open fails, saying so. Injected: the
/// simulator's, or the fake's (`fail_opens`: `INVALID_HANDLE`, as for a
/// handle naming no live memory).
#[test]
fn an_export_that_fails_to_open_fails_the_open_saying_so() {
    on_either("failed_open_child", &[], sim, an_export_that_fails_to_open);
}

#[test]
#[ignore = "a child of an_export_that_fails_to_open_…"]
fn failed_open_child() {
    in_child("an_export_that_fails_to_open_fails_the_open_saying_so", an_export_that_fails_to_open);
}

fn an_export_that_fails_to_open(gpu: &Driver) {
    let initiator = gpu.engine("xproc-open");
    let target = ChildTarget::start("legacy", 0);
    let says = gpu.fail_next_open();
    let error = initiator.open_segment_with(&target.addr, None, WAIT).unwrap_err().to_string();
    assert!(error.contains("has it exited, restarted or freed it?") && error.contains(says), "{error}");
    // The next open of the same export, not failed, opens.
    assert!(initiator.open_segment_with(&target.addr, None, WAIT).is_ok());
}

/// The opener of [`an_expandable_kv_cache_opens_under_a_low_descriptor_limit`],
/// in a process of its own whose descriptor limit (soft and hard, so the
/// engine cannot raise it) is `KVRING_GPU_FD_LIMIT` and where `pidfd_getfd`
/// is refused (`refuse_pidfd_getfd`): opens the target at
/// `KVRING_GPU_OPENER` over cuda_ipc and reads every region back.
#[test]
#[ignore = "the child of the descriptor-limit test"]
fn gpu_child_opener() {
    let addr = std::env::var("KVRING_GPU_OPENER").expect("run by the descriptor-limit test");
    let limit: u64 = std::env::var("KVRING_GPU_FD_LIMIT").unwrap().parse().unwrap();
    let lowered = libc::rlimit { rlim_cur: limit, rlim_max: limit };
    // SAFETY: setrlimit reads one rlimit; lowering a limit needs no privilege.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
    common::refuse_pidfd_getfd();
    let gpu = provider();
    let initiator = common::builder("fd-limit-opener").lanes(1).gpu(gpu.clone()).build().unwrap();
    let segment = initiator.open_segment_with(&addr, Some(TransportKind::CudaIpc), WAIT).unwrap();
    let held = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let total = (EXPANDABLE_REGION * EXPANDABLE_REGIONS) as usize;
    let local = initiator.alloc_region(total, RegionInfo::raw()).unwrap();
    let remote: Vec<_> = segment.regions().iter().map(|r| r.id).collect();
    assert_eq!(remote.len(), EXPANDABLE_REGIONS as usize);
    let descs: Vec<BlockDesc> = remote
        .iter()
        .enumerate()
        .map(|(i, &id)| BlockDesc::new(local.id(), i as u64 * EXPANDABLE_REGION, id, 0, EXPANDABLE_REGION))
        .collect();
    let mut sub = initiator.submitter().unwrap();
    assert!(run(&mut sub, &Batch::read(&segment).descs(&descs)).is_done());
    let expected = common::pattern(EXPANDABLE_PIECE as usize * EXPANDABLE_PIECES as usize, 77);
    assert!(read(&local, 0, total) == expected[..total], "every region's bytes, read through its opened pieces");
    if let Some(fake) = Fake::find() {
        // Descriptors of the peer's memory beyond the driver's own: kvring
        // closed each once imported.
        assert_eq!(fake.stat("fds"), 0, "kvring holds no descriptor of the peer's memory");
    }
    println!("opened every region holding {held} descriptors under a limit of {limit}");
}

/// An expandable-segment KV cache of 2,048 pieces in 160 regions opens in
/// a peer whose descriptor limit is 256 and which may not call
/// `pidfd_getfd`: no piece's descriptor is held by the exporter, and the
/// opener closes each as soon as it is imported.
#[test]
fn an_expandable_kv_cache_opens_under_a_low_descriptor_limit() {
    // The fake libcuda keeps one descriptor of its own per imported
    // allocation (its model of device memory), which a real driver does
    // not: over it the limit grows by those, and the opener asks the fake
    // how many descriptors of the peer's memory kvring itself holds (none).
    // Its pieces are 16 KiB, a granularity the fake reports when asked
    // (FAKECUDA_GRANULARITY; a real GPU's is 2 MiB).
    let fake = on_cuda() && Fake::find().is_some();
    if on_cuda() && !fake {
        // A real GPU's granularity is 2 MiB: 2,048 pieces would be 4 GiB
        // on the device and twice that on the host.
        let test = "an_expandable_kv_cache_opens_under_a_low_descriptor_limit";
        return skipped(test, "16 KiB pieces need the fake driver's FAKECUDA_GRANULARITY");
    }
    let fakes_own = if fake { u64::from(EXPANDABLE_PIECES) } else { 0 };
    let env: &[(&str, &str)] = if fake { &[("FAKECUDA_GRANULARITY", "16384")] } else { &[] };
    let target = ChildTarget::start_with("expandable", 0, "127.0.0.1:0", env);
    let output = Command::new(std::env::current_exe().unwrap())
        .envs(env.iter().copied())
        .args(["--ignored", "--exact", "gpu_child_opener", "--nocapture", "--test-threads=1"])
        .env("KVRING_GPU_OPENER", &target.addr)
        .env("KVRING_GPU_FD_LIMIT", (256 + fakes_own).to_string())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success() && out.contains("opened every region"),
        "{out}{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// No batch is `Done` before its bytes are in place: 10,000 single-block
/// WRITEs from host memory, each checked by the target itself (on a stream
/// of its own, in its own process) the moment the initiator saw `Done`.
/// The copy engine lags 100 µs, so a completion reported early would find
/// old bytes.
#[test]
fn ten_thousand_batches_each_in_place_when_reported_done() {
    each_in_place_when_reported_done(RegionInfo::raw(), 10_000);
}

/// The same device to device, WRITE and READ: each WRITE from GPU memory is
/// checked by the target, then the block is READ back into another block of
/// this GPU region and read at once through a stream of its own; each
/// round's bytes differ, so a READ reported early would find the last
/// round's.
#[test]
fn device_to_device_writes_and_reads_each_in_place_when_reported_done() {
    each_in_place_when_reported_done(RegionInfo::raw().on_gpu(0), 2_500);
}

fn each_in_place_when_reported_done(local_memory: RegionInfo, rounds: u64) {
    let gpu = provider_with(Duration::from_micros(100));
    let initiator = engine_on("done-initiator", &gpu);
    let local = initiator.alloc_region(2 << 20, local_memory).unwrap();
    let target = ChildTarget::start("legacy", 0);
    let segment = initiator.open_segment_with(&target.addr, None, WAIT).unwrap();
    let remote = segment.regions()[0].id;
    let mut sub = initiator.submitter().unwrap();
    let read_back = local_memory.memory != kvring::MemoryKind::Host;
    for i in 0..rounds {
        let block = (i % 256) * 4096;
        let bytes = (i as u32).to_le_bytes().repeat(1024);
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.write_at(block, &bytes).unwrap() };
        let desc = [BlockDesc::new(local.id(), block, remote, block, 4096)];
        assert!(run(&mut sub, &Batch::write(&segment).descs(&desc)).is_done(), "batch {i}");
        let sum = segment.remote_checksum(remote, block, 4096, WAIT).unwrap();
        assert_eq!(sum, kvring::testing::checksum(&bytes), "write {i} was reported done before its bytes landed");
        if read_back {
            let back = [BlockDesc::new(local.id(), (1 << 20) + block, remote, block, 4096)];
            assert!(run(&mut sub, &Batch::read(&segment).descs(&back)).is_done(), "read {i}");
            assert_eq!(read(&local, (1 << 20) + block, 4096), bytes, "read {i} was reported done before it landed");
        }
    }
}

#[test]
fn kv_push_pull_and_push_layer_between_device_layouts_of_two_processes() {
    kv_round_trip("kv");
}

/// MLA: latent (key) and index buffers in GPU memory, no value buffer.
#[test]
fn kv_push_pull_and_push_layer_between_device_mla_layouts_of_two_processes() {
    kv_round_trip("mla");
}

/// Push, per-layer push and pull between this process's KV cache in GPU
/// memory and the `mode` child's, every destination block checked.
fn kv_round_trip(mode: &str) {
    let gpu = provider();
    let prefill = engine_on("kv-prefill", &gpu);
    let (regions, layout) = common::gpu_kv_cache(&prefill, kv_shape(mode), 7);
    assert!(regions.iter().all(|r| r.memory() == kvring::MemoryKind::Gpu(0)));
    let decode = ChildTarget::start(mode, 100);
    let segment = prefill.open_segment_with(&decode.addr, None, WAIT).unwrap();
    assert_eq!(segment.transport(), TransportKind::CudaIpc);
    let remote = segment.kv_layout(WAIT).unwrap();
    layout.check_compatible(&remote).unwrap();
    let mut sub = prefill.submitter().unwrap();
    let id = sub.push_blocks(&segment, &layout, &remote, &[3, 4, 5, 9], &[0, 1, 2, 7]).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    for layer in 0..layout.layers() {
        let id = sub.push_layer(&segment, &layout, &remote, layer, &[20, 21], &[30, 31]).unwrap();
        assert!(sub.wait(id, WAIT).unwrap().is_done());
    }
    // Every destination block holds its source block (checked by the
    // decode process through its own copy engine).
    let check = |src_ids: &[u64], dst_ids: &[u64]| {
        for layer in 0..layout.layers() {
            let (ours, theirs) = (layout.layer(layer).unwrap(), remote.layer(layer).unwrap());
            for (kind, (src, dst)) in ours.iter().zip(theirs).enumerate() {
                let region = &regions[layer as usize * ours.len() + kind];
                for (&s, &d) in src_ids.iter().zip(dst_ids) {
                    let bytes = read(region, src.offset + s * src.block_bytes, src.block_bytes as usize);
                    let at = dst.offset + d * dst.block_bytes;
                    let sum = segment.remote_checksum(dst.region, at, dst.block_bytes, WAIT).unwrap();
                    assert_eq!(sum, kvring::testing::checksum(&bytes), "layer {layer} kind {kind} block {s}->{d}");
                }
            }
        }
    };
    check(&[3, 4, 5, 9], &[0, 1, 2, 7]);
    check(&[20, 21], &[30, 31]);
    // Pull: the decode side's blocks 10, 11 into ours 12, 13.
    let id = sub.pull_blocks(&segment, &layout, &remote, &[10, 11], &[12, 13]).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    for layer in 0..layout.layers() {
        let (ours, theirs) = (layout.layer(layer).unwrap(), remote.layer(layer).unwrap());
        for (kind, (dst, src)) in ours.iter().zip(theirs).enumerate() {
            let region = &regions[layer as usize * ours.len() + kind];
            for (d, s) in [(12u64, 10u64), (13, 11)] {
                let bytes = read(region, dst.offset + d * dst.block_bytes, dst.block_bytes as usize);
                let sum = segment
                    .remote_checksum(src.region, src.offset + s * src.block_bytes, src.block_bytes, WAIT)
                    .unwrap();
                assert_eq!(kvring::testing::checksum(&bytes), sum, "layer {layer} kind {kind} pulled {s}->{d}");
            }
        }
    }
}

/// An older driver: the simulator told to copy one call per copy, or the
/// fake as CUDA 12.6 (no batched copy) on an sm_60 device (where the copy
/// kernel's PTX, built for sm_70, does not load).
#[test]
fn an_older_driver_falls_back_and_the_copies_still_land() {
    let old = || SimGpu::new(1, Duration::from_micros(50)).with_copy_method(CopyMethod::PerCopy);
    let env = [("FAKECUDA_VERSION", "12060"), ("FAKECUDA_SM", "60")];
    on_either("older_driver_child", &env, old, an_older_driver_falls_back);
}

#[test]
#[ignore = "a child of an_older_driver_falls_back_…"]
fn older_driver_child() {
    in_child("an_older_driver_falls_back_and_the_copies_still_land", an_older_driver_falls_back);
}

fn an_older_driver_falls_back(gpu: &Driver) {
    let target = gpu.engine("old-target");
    let initiator = gpu.engine("old-initiator");
    assert_eq!(initiator.gpu_copy_method(), Some(CopyMethod::PerCopy), "the engine says which path it takes");
    let remote = target.alloc_region(1 << 16, RegionInfo::raw().on_gpu(0)).unwrap();
    let local = initiator.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(5) };
    let segment = open(&initiator, &target, None).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let desc = [BlockDesc::new(local.id(), 0, remote.id(), 0, 1 << 16)];
    assert!(run(&mut sub, &Batch::new(Opcode::Write, &segment).descs(&desc)).is_done());
    assert_eq!(read(&remote, 0, 1 << 16), read(&local, 0, 1 << 16));
    assert_eq!(chunks(&initiator).per_copy, 1, "the chunk went one call per copy");
}

/// Chunks of GPU copies the engine's lanes issued, by method.
fn chunks(engine: &Engine) -> CopyMethodCounts {
    CopyMethodCounts::sum(engine.lane_stats().iter().map(|s| s.gpu_chunks))
}

/// On a driver without the batch API, a chunk goes through the copy kernel
/// only when every host range it touches is pinned; otherwise, and when the
/// kernel's descriptor slots are all in flight, one copy call per copy.
/// Each chunk's method is counted, and the bytes land either way.
#[test]
fn the_copy_kernel_takes_only_pinned_chunks_and_every_chunks_method_is_counted() {
    let sim = || SimGpu::new(1, KERNEL_COPY_DELAY).with_copy_method(CopyMethod::Kernel);
    on_either("kernel_tier_child", &[("FAKECUDA_VERSION", "12060")], sim, the_copy_kernel_takes_only_pinned_chunks);
}

/// How late the copy kernel's jobs run while twenty chunks are queued.
const KERNEL_COPY_DELAY: Duration = Duration::from_millis(200);

#[test]
#[ignore = "a child of the_copy_kernel_takes_only_pinned_…"]
fn kernel_tier_child() {
    in_child(
        "the_copy_kernel_takes_only_pinned_chunks_and_every_chunks_method_is_counted",
        the_copy_kernel_takes_only_pinned_chunks,
    );
}

/// On the simulator every copy runs late; on the fake (CUDA 12.6: the
/// kernel tier), only while the twenty chunks are queued.
fn the_copy_kernel_takes_only_pinned_chunks(gpu: &Driver) {
    let target = gpu.engine("kernel-target");
    let initiator = gpu.engine("kernel-initiator");
    assert_eq!(initiator.gpu_copy_method(), Some(CopyMethod::Kernel));
    let remote = target.alloc_region(1 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let pinned = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { pinned.fill_pattern(11) };
    let mut pageable = common::pattern(1 << 16, 12);
    let addr = pageable.as_mut_ptr() as u64;
    // SAFETY: `pageable` outlives the engine's use of it (the engine drops first).
    let caller = unsafe { initiator.register(pageable.as_mut_ptr(), pageable.len(), RegionInfo::raw()) }.unwrap();
    let _ = gpu.gpu().host_unregister(addr); // whatever pinned it, it is pageable now
    let segment = open(&initiator, &target, None).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let before = chunks(&initiator);
    let from_pinned = [BlockDesc::new(pinned.id(), 0, remote.id(), 0, 4096)];
    assert!(run(&mut sub, &Batch::write(&segment).descs(&from_pinned)).is_done());
    assert_eq!(chunks(&initiator).since(&before), CopyMethodCounts { kernel: 1, ..Default::default() });
    let from_pageable = [BlockDesc::new(caller, 0, remote.id(), 65536, 4096)];
    assert!(run(&mut sub, &Batch::write(&segment).descs(&from_pageable)).is_done());
    assert_eq!(chunks(&initiator).since(&before), CopyMethodCounts { kernel: 1, per_copy: 1, ..Default::default() });
    assert_eq!(read(&remote, 0, 4096), read(&pinned, 0, 4096));
    assert_eq!(read(&remote, 65536, 4096), pageable[..4096]);
    // Twenty chunks in flight at once on one stream: sixteen slots, then
    // one call per copy, counted as such.
    gpu.slow_copies(Some(KERNEL_COPY_DELAY));
    let before = chunks(&initiator);
    let ids: Vec<_> = (0..20u64)
        .map(|i| {
            let desc = [BlockDesc::new(pinned.id(), i * 4096, remote.id(), i * 4096, 4096)];
            sub.submit(&Batch::write(&segment).descs(&desc)).unwrap()
        })
        .collect();
    for id in ids {
        assert!(sub.wait(id, WAIT).unwrap().is_done());
    }
    gpu.slow_copies(None);
    assert_eq!(chunks(&initiator).since(&before), CopyMethodCounts { kernel: 16, per_copy: 4, ..Default::default() });
    assert_eq!(read(&remote, 0, 20 * 4096), read(&pinned, 0, 20 * 4096));
    let text = initiator.metrics_text();
    assert!(text.contains("kvring_gpu_chunks_total{method=\"kernel\"} 17"), "{text}");
    drop(sub);
    drop(initiator);
}

/// Runs `kvring bench --memory MEMORY --gpu sim` and returns its JSON cases.
fn gpu_bench(memory: &str, block_sizes: &str) -> Vec<serde_json::Value> {
    let output = Command::new(common::kvring_bin())
        .args(["bench", "--memory", memory, "--gpu", "sim", "--sim-copy-delay", "20us", "--json"])
        .args(["--block-size", block_sizes, "--total", "16MiB", "--region-size", "8MiB", "--latency-samples", "50"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{memory}: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn the_gpu_bench_runs_on_the_simulated_provider_beside_both_baselines_and_verifies() {
    for (memory, ends) in
        [("gpu:0,host", ["gpu:0", "host"]), ("gpu,gpu", ["gpu:0", "gpu:0"]), ("host,gpu", ["host", "gpu:0"])]
    {
        let cases = gpu_bench(memory, "4KiB,256KiB");
        assert_eq!(cases.len(), 4, "{memory}: write and read, two block sizes: {cases:?}");
        for case in &cases {
            assert_eq!(case["transport"], "cuda_ipc");
            assert_eq!(case["memory"], serde_json::json!(ends), "{memory}");
            assert_eq!((case["provider"].as_str(), case["copy_method"].as_str()), (Some("sim"), Some("batched")));
            assert_eq!(case["verified"], true, "{case}");
            for field in
                ["gbps", "baseline_per_call_gbps", "baseline_one_copy_gbps", "ratio_per_call", "ratio_one_copy"]
            {
                assert!(case[field].as_f64().is_some_and(|v| v > 0.0), "{field} in {case}");
            }
            // Every timed chunk went as one batched call, and was counted.
            let chunks = &case["chunks"];
            assert!(chunks["batched"].as_u64().is_some_and(|n| n > 0), "{case}");
            assert_eq!((chunks["kernel"].as_u64(), chunks["per_copy"].as_u64()), (Some(0), Some(0)), "{case}");
        }
    }
    // Without a driver, --gpu cuda (the default) says what to do instead.
    if kvring::host::gpus().is_err() {
        let output = Command::new(common::kvring_bin()).args(["bench", "--memory", "gpu"]).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success() && stderr.contains("`--gpu sim`"), "{stderr}");
    }
}

#[test]
fn lanes_serving_a_gpu_run_on_its_numa_node() {
    let Some(node0) = std::fs::read_to_string("/sys/devices/system/node/node0/cpulist").ok() else {
        skipped("lanes_serving_a_gpu_run_on_its_numa_node", "this host lists no NUMA node in sysfs");
        return;
    };
    let gpu = Arc::new(SimGpu::new(1, Duration::from_micros(1)).with_numa_node(0));
    let builder = kvring::Engine::builder().lanes(3).gpu(gpu).gpu_device(0);
    let cores: Vec<usize> = builder.planned_lane_cores().into_iter().map(|c| c.expect("pinned")).collect();
    let node: Vec<usize> = node0
        .trim()
        .split(',')
        .flat_map(|part| match part.split_once('-') {
            Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<usize>>(),
            None => vec![part.parse().unwrap()],
        })
        .collect();
    assert_eq!(cores.len(), 3);
    assert!(cores.iter().all(|c| node.contains(c)), "lanes on {cores:?}, node 0 has {node:?}");
    // Every GPU on one node: the same cores with nobody naming a GPU.
    let gpu = Arc::new(SimGpu::new(2, Duration::from_micros(1)).with_numa_node(0));
    let unnamed = kvring::Engine::builder().lanes(3).gpu(gpu).planned_lane_cores();
    assert_eq!(unnamed, cores.iter().map(|&c| Some(c)).collect::<Vec<_>>());
}

/// Polls `done` every millisecond until it holds, failing the test at the
/// deadline.
fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {WAIT:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A cuda_ipc target killed: the next batch fails `PeerRestarted` (the
/// memory opened from it is still mapped here, and must not be written as
/// if it were the peer's), its opened memory is closed once the stale
/// handle is retired, and the target restarted on the same port opens
/// afresh and moves bytes its own copy engine verifies.
///
/// Opens and closes counted by the driver (the simulator's, or the fake's
/// `ipc_opens` and `ipc_closes`).
#[test]
fn a_killed_cuda_ipc_target_is_seen_gone_its_memory_closed_and_its_successor_opened() {
    on_either("restart_child", &[], sim, a_killed_target_is_seen_gone);
}

#[test]
#[ignore = "a child of a_killed_cuda_ipc_target_…"]
fn restart_child() {
    in_child(
        "a_killed_cuda_ipc_target_is_seen_gone_its_memory_closed_and_its_successor_opened",
        a_killed_target_is_seen_gone,
    );
}

fn a_killed_target_is_seen_gone(sim: &Driver) {
    let initiator = sim.engine("restart-initiator");
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(41) };
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let mut target = ChildTarget::start_on("legacy", 0, &listen);
    let segment = initiator.open_segment_with(&target.addr, None, WAIT).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let desc = [BlockDesc::new(local.id(), 0, segment.regions()[0].id, 0, 65536)];
    assert!(run(&mut sub, &Batch::write(&segment).descs(&desc)).is_done());
    assert_eq!(sim.open_counts(), (1, 0));

    target.kill();
    match run(&mut sub, &Batch::write(&segment).descs(&desc)) {
        Outcome::Failed(Error::PeerRestarted { detail, .. }) => assert!(detail.contains("exited"), "{detail}"),
        other => panic!("a batch to a dead target ended {other:?}"),
    }
    assert!(segment.is_stale());
    let restarted = ChildTarget::start_on("legacy", 0, &listen);
    let reopened = initiator.open_segment_with(&restarted.addr, None, WAIT).unwrap();
    assert_ne!(reopened.epoch(), segment.epoch(), "a new target, a new epoch");
    eventually("the dead target's memory closed", || sim.open_counts() == (2, 1));
    let remote = reopened.regions()[0].id;
    let desc = [BlockDesc::new(local.id(), 0, remote, 0, 65536)];
    assert!(run(&mut sub, &Batch::write(&reopened).descs(&desc)).is_done());
    let sum = reopened.remote_checksum(remote, 0, 65536, WAIT).unwrap();
    assert_eq!(sum, kvring::testing::checksum(&read(&local, 0, 65536)), "the successor holds the bytes");
}

/// The GPU holding a peer's memory (in another process) is lost: batches
/// to it fail saying so, and the same lane goes on moving another GPU's
/// memory.
///
/// Lost: the simulator's GPU, or the fake's context of it poisoned
/// (`lose_device`).
#[test]
fn a_lost_gpu_under_a_peers_memory_fails_its_batches_and_the_lane_serves_the_other_gpu() {
    on_either("lost_gpu_child", &[], sim, a_lost_gpu_fails_its_batches);
}

#[test]
#[ignore = "a child of a_lost_gpu_under_a_peers_memory_…"]
fn lost_gpu_child() {
    in_child(
        "a_lost_gpu_under_a_peers_memory_fails_its_batches_and_the_lane_serves_the_other_gpu",
        a_lost_gpu_fails_its_batches,
    );
}

fn a_lost_gpu_fails_its_batches(sim: &Driver) {
    let initiator = sim.engine("lost-initiator");
    let target = ChildTarget::start("legacy", 0);
    let segment = initiator.open_segment_with(&target.addr, None, WAIT).unwrap();
    let remote = segment.regions()[0].clone();
    assert_eq!(remote.memory, kvring::MemoryKind::Gpu(1), "the legacy child's memory is on GPU 1");
    let host_peer = sim.engine("lost-host-peer");
    let host_remote = host_peer.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    let host_segment = open(&initiator, &host_peer, None).unwrap();
    let local = initiator.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    let lost = sim.device_reaching(1);
    let on_other = initiator.alloc_region(1 << 16, RegionInfo::raw().on_gpu(1 - lost)).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { on_other.fill_pattern(43) };
    let mut sub = initiator.submitter().unwrap();
    let says = sim.lose_device(lost);
    let desc = [BlockDesc::new(local.id(), 0, remote.id, 0, 4096)];
    match run(&mut sub, &Batch::write(&segment).descs(&desc)) {
        Outcome::Failed(error) => assert!(error.to_string().contains(says), "{error}"),
        other => panic!("{other:?}"),
    }
    let desc = [BlockDesc::new(on_other.id(), 0, host_remote.id(), 0, 8192)];
    assert!(run(&mut sub, &Batch::write(&host_segment).descs(&desc)).is_done(), "the other GPU still moves");
    assert_eq!(read(&host_remote, 0, 8192), read(&on_other, 0, 8192));
}

/// A peer's exported memory freed by its owner after it was opened here.
/// On the simulator it vanishes (legacy IPC: "calling cuMemFree on an
/// exported memory region before calling cuIpcCloseMemHandle in the
/// importing context will result in undefined behavior" [ref: 6.13,
/// cuIpcOpenMemHandle], which the simulator makes a fault): a copy touching
/// it faults, and the batch fails saying why. On the driver, memory of the
/// virtual memory API stays: "the memory allocation will be freed when all
/// outstanding mappings to the memory are unmapped and when all
/// outstanding references to the handle (including its shareable
/// counterparts) are also released" [ref: 6.14, cuMemRelease], so this
/// process, which holds its imported handles and mappings, still reads
/// back what it wrote.
#[test]
fn a_peers_memory_freed_by_its_owner_after_it_was_opened_fails_clearly_or_stays_as_documented() {
    if on_cuda() {
        return a_peers_freed_pieces_stay_until_released_here();
    }
    let sim = Arc::new(sim());
    let initiator = engine("vanish-initiator", &sim);
    let target = ChildTarget::start("legacy", 0);
    let segment = initiator.open_segment_with(&target.addr, None, WAIT).unwrap();
    let local = initiator.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let desc = [BlockDesc::new(local.id(), 0, segment.regions()[0].id, 0, 4096)];
    assert!(run(&mut sub, &Batch::write(&segment).descs(&desc)).is_done());
    sim.vanish_opened();
    match run(&mut sub, &Batch::read(&segment).descs(&desc)) {
        Outcome::Failed(error) => assert!(error.to_string().contains("vanished after it was opened"), "{error}"),
        other => panic!("a batch on vanished memory ended {other:?}"),
    }
}

/// The driver's side of the test above: a peer's pieces freed by their
/// owner after this process imported them are still this process's.
fn a_peers_freed_pieces_stay_until_released_here() {
    let gpu = provider();
    let initiator = engine_on("vanish-initiator", &gpu);
    let mut target = ChildTarget::start("pieces", 0);
    let segment = initiator.open_segment_with(&target.addr, None, WAIT).unwrap();
    let remote = segment.regions()[0].id;
    let local = initiator.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(45) };
    let mut sub = initiator.submitter().unwrap();
    // Across the boundary between the first two pieces.
    let at = PIECE_BYTES - 8192;
    let desc = [BlockDesc::new(local.id(), 0, remote, at, 16384)];
    assert!(run(&mut sub, &Batch::write(&segment).descs(&desc)).is_done());
    target.free_memory();
    let back = [BlockDesc::new(local.id(), 32768, remote, at, 16384)];
    let outcome = run(&mut sub, &Batch::read(&segment).descs(&back));
    assert!(outcome.is_done(), "freed by its owner, still imported here: {outcome:?}");
    assert_eq!(read(&local, 32768, 16384), read(&local, 0, 16384));
}

/// A copy call refused in the middle of a four-chunk batch: the batch
/// fails with it, the chunks after it are never issued (the copy counts
/// say so, and their bytes never land), and the lane goes on moving GPU
/// memory for the next batch.
///
/// Refused: by the simulator, or by the fake (`refuse_call_after`: the
/// batched call returns `INVALID_VALUE`, nothing queued).
#[test]
fn a_copy_refused_mid_batch_drops_the_later_chunks_and_the_lane_serves_on() {
    on_either("refused_call_child", &[], sim, a_copy_refused_mid_batch);
}

#[test]
#[ignore = "a child of a_copy_refused_mid_batch_…"]
fn refused_call_child() {
    in_child("a_copy_refused_mid_batch_drops_the_later_chunks_and_the_lane_serves_on", a_copy_refused_mid_batch);
}

fn a_copy_refused_mid_batch(gpu: &Driver) {
    let target = gpu.engine("midbatch-target");
    let initiator = gpu.builder("midbatch-initiator").lanes(1).build().unwrap();
    let remote = target.alloc_region(1 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(47) };
    let segment = open(&initiator, &target, None).unwrap();
    let mut sub = initiator.submitter().unwrap();
    // 1000 blocks of 1 KiB, reversed on the remote side so no two merge:
    // chunks of 256, 256, 256 and 232 copies.
    let many: Vec<BlockDesc> =
        (0..1000).map(|i| BlockDesc::new(local.id(), i * 1024, remote.id(), (999 - i) * 1024, 1024)).collect();
    let before = gpu.copy_counts();
    let says = gpu.refuse_copy_call(1);
    match run(&mut sub, &Batch::write(&segment).descs(&many)) {
        Outcome::Failed(error) => assert!(error.to_string().contains(says), "{error}"),
        other => panic!("{other:?}"),
    }
    let after = gpu.copy_counts();
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 256), "the first chunk alone was issued");
    assert_eq!(read(&remote, 999 * 1024, 1024), read(&local, 0, 1024), "the first chunk landed");
    for block in [256u64, 600, 999] {
        let at = (999 - block) * 1024;
        assert!(read(&remote, at, 1024).iter().all(|&b| b == 0), "block {block} of a dropped chunk landed");
    }
    let next: Vec<BlockDesc> =
        (0..64).map(|i| BlockDesc::new(local.id(), i * 1024, remote.id(), i * 1024, 1024)).collect();
    assert!(run(&mut sub, &Batch::write(&segment).descs(&next)).is_done(), "the lane serves on");
    assert_eq!(read(&remote, 0, 64 * 1024), read(&local, 0, 64 * 1024));
}

/// The tcp target, spoken to byte by byte: a WRITE or READ frame naming a
/// GPU region is refused (its thread would touch device memory), the
/// connection stays framed, and the region's bytes are untouched.
#[test]
fn raw_frames_aimed_at_a_gpu_region_are_staged_and_checked_like_host_ones() {
    use kvring::testing::tcp::SERVER_HELLO_BYTES;
    use kvring::testing::tcp::{ClientHello, FrameHeader, FrameOp, ServerHello, FLAG_LAST, FRAME_HEADER_BYTES};
    use zerocopy::{FromBytes, IntoBytes};
    let gpu = provider();
    let target = engine_on("raw-gpu-target", &gpu);
    let on_gpu = target.alloc_region(1 << 16, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { on_gpu.write_at(0, &common::pattern(4096, 53)).unwrap() };
    let host = target.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    let mut s = std::net::TcpStream::connect(target.tcp_addr().unwrap()).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(ClientHello::new(target.epoch(), [0; 16], [0; 16], [0; 16]).as_bytes()).unwrap();
    let mut hello = [0u8; SERVER_HELLO_BYTES];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(ServerHello::read_from_bytes(&hello).unwrap().status, 0);
    let mut replies = s.try_clone().unwrap();
    let mut reply = || {
        let mut bytes = [0u8; FRAME_HEADER_BYTES];
        replies.read_exact(&mut bytes).unwrap();
        FrameHeader::read_from_bytes(&bytes).unwrap()
    };
    let frame = |op: FrameOp, region: &Region| {
        let mut header = FrameHeader::new(op, target.epoch(), 9, region.id().raw(), 0, 4096);
        header.flags = FLAG_LAST;
        header
    };
    // A WRITE lands in the GPU region (staged: acked once copied in).
    s.write_all(frame(FrameOp::Write, &on_gpu).as_bytes()).unwrap();
    s.write_all(&[0xEE; 4096]).unwrap();
    let ack = reply();
    assert_eq!((ack.opcode, ack.status), (FrameOp::Ack as u8, 0));
    assert_eq!(read(&on_gpu, 0, 4096), vec![0xEE; 4096]);
    // A READ is answered from it.
    s.write_all(frame(FrameOp::Read, &on_gpu).as_bytes()).unwrap();
    let data = reply();
    assert_eq!((data.opcode, data.status, data.len), (FrameOp::ReadData as u8, 0, 4096));
    let mut bytes = vec![0u8; 4096];
    s.read_exact(&mut bytes).unwrap();
    assert_eq!(bytes, vec![0xEE; 4096]);
    // Past its end: refused like a host region's, nothing written, framing
    // kept.
    let mut past = FrameHeader::new(FrameOp::Write, target.epoch(), 9, on_gpu.id().raw(), (1 << 16) - 100, 4096);
    past.flags = FLAG_LAST;
    s.write_all(past.as_bytes()).unwrap();
    s.write_all(&[0x11; 4096]).unwrap();
    assert_eq!(kvring::ErrorCode::try_from(-reply().status), Ok(kvring::ErrorCode::OutOfBounds));
    s.write_all(frame(FrameOp::Write, &host).as_bytes()).unwrap();
    s.write_all(&[0x5A; 4096]).unwrap();
    assert_eq!(reply().status, 0);
    assert_eq!(read(&host, 0, 4096), vec![0x5A; 4096]);
    assert_eq!(read(&on_gpu, (1 << 16) - 4096, 4096), vec![0u8; 4096], "nothing past the region's end");
}
