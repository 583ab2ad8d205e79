//! GPU memory across hosts over RDMA (GPUDirect), end to end: device
//! regions registered with every NIC once, through a dma-buf or peer
//! memory; RDMA WRITE and READ straight between device memory on both ends
//! (the NIC reaches it through the GPU's own pages, never the device
//! address, which faults); the NIC nearest the GPU; per-layer arrival
//! counted on the target from WRITE_WITH_IMM; the KV layer between
//! device-resident layouts; and bad input: a region no NIC takes, a peer
//! that restarts mid-transfer, nothing reported done before it landed.
//!
//! On the simulated verbs provider and the simulated GPU by default. With
//! `RDMA_TEST_PROVIDER=ibverbs`, on the real verbs provider over the fake
//! libibverbs and the CUDA provider over the fake libcuda (both on
//! `LD_LIBRARY_PATH`: .ci/stage-fakerdmagpu.sh), device memory registered
//! through the dma-buf the fake libcuda exports, whose pages the fake
//! libibverbs maps: all the two fakes share, as a GPU and a NIC share only
//! the dma-buf. What only the simulator can do is skipped there with the
//! reason printed (see `Fab::sim`).
//!
//! Every engine here shares one process, so the transport is asked for by
//! name (on one host the default would be cuda_ipc).

mod common;

use common::verbs::{FakeDelay, Provider};
use common::{pattern, read, run, WAIT};
use kvring::gpu::{CudaGpu, Gpu, SimGpu};
use kvring::kv::{arrival_tag, check_pd_topo, push_targets, Attention, CacheShape, KvLayout, Mode, Rank};
use kvring::rdma::{MrPath, ObjectCounts, SimVerbs, Verbs};
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, Region, RegionInfo, Segment, TransportKind};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether this run is on the real providers over the fakes.
fn real() -> bool {
    std::env::var("RDMA_TEST_PROVIDER").as_deref() == Ok("ibverbs")
}

/// Whether this run is on a host's own NICs (`RDMA_TEST_DEVICES`, as
/// benches/rdma_check.sh names them) rather than the fakes: what needs a
/// fake's knob is skipped there, saying so.
fn host_nics(skipped: &str) -> bool {
    let host = real() && std::env::var_os("RDMA_TEST_DEVICES").is_some();
    if host {
        eprintln!("skipped on the host's own NICs: {skipped} (a fake's knob)");
    }
    host
}

/// The NICs and GPUs a test's engines share.
struct Fab {
    verbs: Provider,
    gpu: Arc<dyn Gpu>,
    /// The NICs' names, in order.
    nics: Vec<String>,
}

impl Fab {
    /// The simulator, for what only it can do; on the real provider `None`,
    /// with `skipped` printed as the reason.
    fn sim(&self, skipped: &str) -> Option<&Arc<SimVerbs>> {
        self.verbs.sim_only(skipped)
    }

    /// Objects the verbs provider created and destroyed.
    fn counts(&self) -> ObjectCounts {
        self.verbs.verbs().counts()
    }
}

/// NICs named as given on the simulator (with their NUMA nodes) and `gpu`;
/// on the real providers as many of the fake's NICs and its GPUs.
fn fabric(nics: &[(&str, Option<u32>)], gpu: SimGpu) -> Fab {
    if real() {
        let verbs = Provider::with_nics(nics.len());
        let Provider::Real(_, names) = &verbs else { unreachable!("RDMA_TEST_PROVIDER=ibverbs") };
        let nics = names.clone();
        let cuda = CudaGpu::load().unwrap_or_else(|e| {
            panic!("RDMA_TEST_PROVIDER=ibverbs needs a CUDA driver (the fake libcuda on LD_LIBRARY_PATH): {e}")
        });
        return Fab { verbs, gpu: Arc::new(cuda), nics };
    }
    let sim = Arc::new(SimVerbs::with_devices(nics.iter().map(|(n, numa)| SimVerbs::device(n, *numa)).collect()));
    let gpu = Arc::new(gpu);
    sim.attach_gpu(gpu.clone());
    let nics = nics.iter().map(|(n, _)| n.to_string()).collect();
    Fab { verbs: Provider::Sim(sim), gpu, nics }
}

fn one_nic() -> Fab {
    fabric(&[("sim0", Some(0))], SimGpu::new(2, Duration::ZERO))
}

fn engine(name: &str, fab: &Fab) -> Engine {
    fab.verbs.apply(common::builder(name)).gpu(fab.gpu.clone()).build().unwrap()
}

/// On the real providers, runs test `name` again in a child process of
/// this test binary with `env` set (the fakes read their knobs from the
/// environment, which every test of this process would see) and asserts
/// it passed; true in that child, and on the simulator, where the caller
/// goes on with the test itself.
fn in_child(name: &str, env: &[(&str, &std::ffi::OsStr)]) -> bool {
    if !real() || std::env::var_os("RDMA_GPU_CHILD").is_some() {
        return true;
    }
    if !host_nics(name) {
        run_child(name, env);
    }
    false
}

/// Runs test `name` of this binary in a child process with `env` (and
/// `RDMA_GPU_CHILD` set) and asserts it passed.
fn run_child(name: &str, env: &[(&str, &std::ffi::OsStr)]) {
    let exe = std::env::current_exe().unwrap();
    let mut child = std::process::Command::new(exe);
    child.args([name, "--exact", "--nocapture", "--test-threads=1"]).env("RDMA_GPU_CHILD", "1");
    for (key, value) in env {
        child.env(key, value);
    }
    let out = child.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "{name} in a child: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A counter of the fake libcuda (`fakecuda_stat`), `None` where the GPU
/// is the simulated one.
fn fake_cuda_stat(name: &std::ffi::CStr) -> Option<i64> {
    if !real() {
        return None;
    }
    type Stat = unsafe extern "C" fn(*const std::ffi::c_char) -> i64;
    // SAFETY: dlopen of the loaded driver by name, dlsym of the fake's own
    // counter function, called with a NUL-terminated name.
    unsafe {
        let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW);
        let stat = (!lib.is_null()).then(|| libc::dlsym(lib, c"fakecuda_stat".as_ptr())).filter(|p| !p.is_null());
        let Some(stat) = stat else {
            let required = std::env::var_os("FAKECUDA_REQUIRED").is_some();
            assert!(!required, "FAKECUDA_REQUIRED=1 but the CUDA driver loaded is not the fake");
            eprintln!("skipped: counting GPUDirect flushes needs the fake libcuda");
            return None;
        };
        let stat = std::mem::transmute::<*mut std::ffi::c_void, Stat>(stat);
        Some(stat(name.as_ptr()))
    }
}

fn open(initiator: &Engine, target: &Engine) -> kvring::Result<Segment> {
    initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Rdma), WAIT)
}

fn done(outcome: Outcome) -> u64 {
    match outcome {
        Outcome::Done { bytes } => bytes,
        other => panic!("expected Done, got {other:?}"),
    }
}

fn failure(outcome: Outcome) -> Error {
    match outcome {
        Outcome::Failed(error) => error,
        other => panic!("expected a failure, got {other:?}"),
    }
}

const GPU: fn(u32) -> RegionInfo = |n| RegionInfo::raw().on_gpu(n);

#[test]
fn gpu_memory_moves_both_ways_over_rdma_registered_once_per_region_and_nic() {
    let fab = fabric(&[("mlx5_0", None), ("mlx5_1", None)], SimGpu::new(2, Duration::ZERO));
    let target = engine("decode-0", &fab);
    let remote = target.alloc_region(4 << 20, GPU(0)).unwrap();
    let remote_host = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let initiator = engine("prefill-0", &fab);
    let local = initiator.alloc_region(8 << 20, GPU(1)).unwrap();
    let local_host = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(5) };
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local_host.fill_pattern(6) };
    for engine in [&target, &initiator] {
        let stats = engine.rdma_device_mrs();
        assert_eq!((stats.regions, stats.dmabuf, stats.peer_memory, stats.failed), (1, 2, 0, 0), "{stats:?}");
        assert_eq!(stats.relaxed_ordering, 2, "relaxed ordering asked for and taken");
    }
    if let Some(referee) = fab.verbs.referee() {
        assert_eq!(referee.mr_paths(remote.as_ptr() as u64), [MrPath::DmaBuf, MrPath::DmaBuf]);
    }
    let segment = open(&initiator, &target).unwrap();
    assert_eq!(segment.transport(), TransportKind::Rdma);
    let mut sub = initiator.submitter().unwrap();

    // GPU to GPU: 64 scattered blocks and one 3 MiB block (sliced, striped).
    let mut descs: Vec<BlockDesc> =
        (0..64).map(|i| BlockDesc::new(local.id(), i * 8192, remote.id(), i * 8192, 4096)).collect();
    descs.push(BlockDesc::new(local.id(), 1 << 20, remote.id(), 1 << 20, 3 << 20));
    assert_eq!(done(run(&mut sub, &Batch::write(&segment).descs(&descs))), 64 * 4096 + (3 << 20));
    let source = pattern(8 << 20, 5);
    for i in 0..64usize {
        assert_eq!(read(&remote, i as u64 * 8192, 4096), source[i * 8192..i * 8192 + 4096], "block {i}");
    }
    assert_eq!(read(&remote, 1 << 20, 3 << 20), source[1 << 20..4 << 20]);
    // READ back, GPU to GPU, into another part of the local region.
    let back = [BlockDesc::new(local.id(), 4 << 20, remote.id(), 1 << 20, 2 << 20)];
    done(run(&mut sub, &Batch::read(&segment).descs(&back)));
    assert_eq!(read(&local, 4 << 20, 2 << 20), source[1 << 20..3 << 20]);
    // Host to GPU and GPU to host.
    let host_in = [BlockDesc::new(local_host.id(), 0, remote.id(), 0, 65536)];
    done(run(&mut sub, &Batch::write(&segment).descs(&host_in)));
    assert_eq!(read(&remote, 0, 65536), pattern(1 << 20, 6)[..65536]);
    let gpu_out = [BlockDesc::new(local.id(), 0, remote_host.id(), 0, 65536)];
    done(run(&mut sub, &Batch::write(&segment).descs(&gpu_out)));
    assert_eq!(read(&remote_host, 0, 65536), source[..65536]);

    // A thousand more transfers register nothing more: once per region
    // and NIC, never per transfer.
    let before = (initiator.rdma_device_mrs(), target.rdma_device_mrs(), fab.counts().mrs);
    for i in 0..1000u64 {
        let desc = [BlockDesc::new(local.id(), (i % 512) * 4096, remote.id(), (i % 1024) * 4096, 4096)];
        let batch = if i % 2 == 0 { Batch::write(&segment) } else { Batch::read(&segment) };
        done(run(&mut sub, &batch.descs(&desc)));
    }
    assert_eq!((initiator.rdma_device_mrs(), target.rdma_device_mrs(), fab.counts().mrs), before);
    // Unregistered, a device region's registrations go with it.
    drop(sub);
    drop((segment, local, local_host, remote, remote_host, initiator, target));
    let counts = fab.counts();
    assert!(counts.balanced(), "{counts:?}");
}

/// Reads simulated device memory through the GPU's copy engine.
fn device_bytes(gpu: &dyn Gpu, device: u32, addr: u64, len: usize) -> Vec<u8> {
    let out = vec![0u8; len];
    let stream = gpu.create_stream(device).unwrap();
    let event = gpu.create_event(device).unwrap();
    let copy = kvring::gpu::Copy { src: addr, dst: out.as_ptr() as u64, len: len as u64 };
    // SAFETY: `out` outlives the copy, which is waited for below.
    unsafe { gpu.copy_one(stream, copy) }.unwrap();
    gpu.record(stream, event).unwrap();
    let deadline = Instant::now() + WAIT;
    while !gpu.query(event).unwrap() {
        assert!(Instant::now() < deadline, "the copy never completed");
        std::thread::yield_now();
    }
    gpu.destroy_event(event).unwrap();
    gpu.destroy_stream(stream).unwrap();
    out
}

#[test]
fn a_gpu_range_registered_inside_an_allocation_takes_rdma_where_it_lies() {
    // A caller's range 64 KiB into its allocation (as a framework's caching
    // allocator hands out): the dma-buf exported for it starts at the
    // range's page, so the NIC's offset 0 must be that page, not the
    // allocation's start.
    let fab = one_nic();
    let target = engine("decode-0", &fab);
    let base = fab.gpu.alloc(0, 4 << 20).unwrap();
    let inside = base.0 + (64 << 10);
    // SAFETY: the allocation outlives the registration (unregistered below, then freed).
    let id = unsafe { target.register(inside as *mut u8, 1 << 20, GPU(0)) }.unwrap();
    assert_eq!(target.rdma_device_mrs().dmabuf, 1);
    let initiator = engine("prefill-0", &fab);
    let local = initiator.alloc_region(2 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(21) };
    let segment = open(&initiator, &target).unwrap();
    let mut sub = initiator.submitter().unwrap();
    done(run(&mut sub, &Batch::write(&segment).block(BlockDesc::new(local.id(), 0, id, 0, 1 << 20))));
    let device = device_bytes(&*fab.gpu, 0, base.0, 2 << 20);
    assert!(device[..64 << 10].iter().all(|&b| b == 0), "nothing lands before the range");
    assert_eq!(device[64 << 10..(64 << 10) + (1 << 20)], pattern(2 << 20, 21)[..1 << 20]);
    assert!(device[(64 << 10) + (1 << 20)..].iter().all(|&b| b == 0), "nothing lands after it");
    // READ from inside the range, at an offset that is no page boundary.
    let back = BlockDesc::new(local.id(), 1 << 20, id, 4096 + 100, 8192);
    done(run(&mut sub, &Batch::read(&segment).block(back)));
    assert_eq!(read(&local, 1 << 20, 8192), pattern(2 << 20, 21)[4196..4196 + 8192]);
    drop((sub, segment, local, initiator));
    target.unregister(id).unwrap();
    drop(target);
    // SAFETY: no engine uses it any more.
    unsafe { fab.gpu.free(base) }.unwrap();
}

#[test]
fn without_dmabuf_gpu_memory_registers_through_peer_memory_and_relaxed_ordering_is_dropped_where_refused() {
    // The NIC stack has no dma-buf registration; nvidia-peermem is loaded;
    // the NIC refuses relaxed ordering (the simulator's; the fake's takes
    // it: ibv_reg_mr(3) makes it a flag a device may ignore).
    let knob = std::env::temp_dir().join(format!("kvring-peer-memory-{}", std::process::id()));
    let name = "without_dmabuf_gpu_memory_registers_through_peer_memory_and_relaxed_ordering_is_dropped_where_refused";
    let env = [("FAKE_IBVERBS_NO_DMABUF_FILE", knob.as_os_str()), ("FAKE_IBVERBS_PEER_MEMORY", "1".as_ref())];
    if !in_child(name, &env) {
        let _ = std::fs::remove_file(&knob);
        return;
    }
    let fab = one_nic();
    dmabuf(&fab, false);
    if let Provider::Sim(sim) = &fab.verbs {
        sim.peer_memory(true);
        sim.relaxed_ordering(false);
    }
    let gpu = fab.gpu.clone();
    let target = engine("decode-0", &fab);
    let remote = target.alloc_region(1 << 20, GPU(0)).unwrap();
    // A run of pieces (PyTorch's expandable segments), registered by the
    // caller: one dma-buf cannot cover it, peer memory can.
    let pieces = gpu.alloc_pieces(0, 2 << 20, 2).unwrap().0;
    // SAFETY: the allocation outlives the engine (freed at the end).
    let run_id = unsafe { target.register(pieces as *mut u8, 4 << 20, GPU(0)) }.unwrap();
    let stats = target.rdma_device_mrs();
    let relaxed = if real() { 2 } else { 0 };
    assert_eq!(
        (stats.regions, stats.dmabuf, stats.peer_memory, stats.relaxed_ordering),
        (2, 0, 2, relaxed),
        "{stats:?}"
    );
    if let Some(referee) = fab.verbs.referee() {
        assert_eq!(referee.mr_paths(pieces), [MrPath::PeerMemory]);
    }

    let initiator = engine("prefill-0", &fab);
    let local = initiator.alloc_region(1 << 20, GPU(1)).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(11) };
    let segment = open(&initiator, &target).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let descs = [
        BlockDesc::new(local.id(), 0, remote.id(), 0, 1 << 20),
        // Across the boundary of the run's two pieces.
        BlockDesc::new(local.id(), 0, run_id, (2 << 20) - 4096, 8192),
    ];
    done(run(&mut sub, &Batch::write(&segment).descs(&descs)));
    assert_eq!(read(&remote, 0, 1 << 20), pattern(1 << 20, 11));
    assert_eq!(device_bytes(&*gpu, 0, pieces + (2 << 20) - 4096, 8192), pattern(1 << 20, 11)[..8192]);
    // And back: READ from across the boundary into the initiator's GPU.
    let back = [BlockDesc::new(local.id(), 65536, run_id, (2 << 20) - 4096, 8192)];
    done(run(&mut sub, &Batch::read(&segment).descs(&back)));
    assert_eq!(read(&local, 65536, 8192), pattern(1 << 20, 11)[..8192]);

    drop((sub, segment, local, initiator, remote));
    target.unregister(run_id).unwrap();
    drop(target);
    // SAFETY: no engine uses it any more.
    unsafe { gpu.free(kvring::gpu::DevicePtr(pieces)) }.unwrap();
}

#[test]
fn an_untagged_push_into_gpu_memory_is_flushed_before_its_notification_reaches_the_consumer() {
    // VERBS-REVIEW #15: an untagged push is RDMA WRITEs, then a
    // notification on the control plane. Where the GPU does not order a
    // NIC's writes for its own work (GPU_DIRECT_RDMA_WRITES_ORDERING below
    // OWNER: the fake libcuda's default), the target flushes them
    // (cuFlushGPUDirectRDMAWrites) before the notification is queued; where
    // it does (FAKECUDA_GDR_ORDERING=100, in a child), it does not.
    let name = "an_untagged_push_into_gpu_memory_is_flushed_before_its_notification_reaches_the_consumer";
    let ordered = std::env::var("FAKECUDA_GDR_ORDERING").is_ok_and(|v| v == "100");
    let fab = one_nic();
    let flushes = || fake_cuda_stat(c"gdr_flushes");
    let initiator = engine("prefill-0", &fab);
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(31) };
    let mut sub = initiator.submitter().unwrap();
    let mut push_and_notify = |target: &Engine, remote: &Region, message: &[u8]| {
        let segment = open(&initiator, target).unwrap();
        done(run(&mut sub, &Batch::write(&segment).block(BlockDesc::new(local.id(), 0, remote.id(), 0, 65536))));
        let before = flushes();
        initiator.notify(&segment, message, WAIT).unwrap();
        let deadline = Instant::now() + WAIT;
        let notification = loop {
            if let Some(n) = target.poll_notification() {
                break n;
            }
            assert!(Instant::now() < deadline, "the notification never came");
            std::thread::yield_now();
        };
        // The flush (if any) came before the notification was queued, so
        // it is counted by the time the consumer holds it.
        assert_eq!(notification.message, message);
        assert_eq!(read(remote, 0, 65536), pattern(1 << 20, 31)[..65536]);
        before.zip(flushes()).map(|(b, a)| a - b)
    };
    // A target with host memory only flushes nothing.
    let host_target = engine("decode-host", &fab);
    let host_remote = host_target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    assert_eq!(push_and_notify(&host_target, &host_remote, b"host").unwrap_or(0), 0);
    // One with GPU memory registered with its NIC flushes that GPU.
    let quota = kvring::NotifyQuota { per_sender: 1, ..Default::default() };
    let target = fab.verbs.apply(common::builder("decode-0")).gpu(fab.gpu.clone()).notify_quota(quota).build().unwrap();
    let remote = target.alloc_region(1 << 20, GPU(0)).unwrap();
    match push_and_notify(&target, &remote, b"gpu") {
        Some(flushed) => assert_eq!(flushed, i64::from(!ordered), "ordered by the GPU: {ordered}"),
        None => eprintln!("skipped on the simulated GPU: counting flushes (it orders a NIC's writes itself)"),
    }
    // A notification past its sender's quota is refused before any flush:
    // an over-quota peer cannot make the target flush at any rate.
    let segment = open(&initiator, &target).unwrap();
    initiator.notify(&segment, b"queued", WAIT).unwrap();
    let before = flushes();
    assert!(initiator.notify(&segment, b"over quota", WAIT).is_err(), "a second one from the sender is over quota");
    assert_eq!(flushes(), before, "a refused notification flushed");
    assert_eq!(target.poll_notification().unwrap().message, b"queued");
    // Its last NIC-registered region gone, the GPU is flushed no more.
    target.unregister(remote.id()).unwrap();
    let before = flushes();
    initiator.notify(&segment, b"no gpu memory", WAIT).unwrap();
    assert_eq!(target.poll_notification().unwrap().message, b"no gpu memory");
    assert_eq!(flushes(), before, "a GPU with no region registered with the NICs was flushed");
    if real() && std::env::var_os("RDMA_GPU_CHILD").is_none() && !host_nics("a GPU that orders its NIC writes") {
        run_child(name, &[("FAKECUDA_GDR_ORDERING", "100".as_ref())]);
    }
}

/// Turns the NICs' dma-buf registration off or on: the simulator's knob,
/// or the fake libibverbs' `FAKE_IBVERBS_NO_DMABUF_FILE` (set by
/// `in_child`), on while the file it names exists.
fn dmabuf(fab: &Fab, on: bool) {
    if let Provider::Sim(sim) = &fab.verbs {
        return sim.dmabuf(on);
    }
    let knob = std::env::var_os("FAKE_IBVERBS_NO_DMABUF_FILE").expect("set by in_child");
    if on {
        let _ = std::fs::remove_file(knob);
    } else {
        std::fs::write(knob, b"").unwrap();
    }
}

#[test]
fn a_gpu_region_no_nic_can_register_refuses_rdma_with_the_reason_and_the_default_goes_on_to_tcp() {
    let knob = std::env::temp_dir().join(format!("kvring-no-dmabuf-{}", std::process::id()));
    if !in_child(
        "a_gpu_region_no_nic_can_register_refuses_rdma_with_the_reason_and_the_default_goes_on_to_tcp",
        &[("FAKE_IBVERBS_NO_DMABUF_FILE", knob.as_os_str())],
    ) {
        let _ = std::fs::remove_file(&knob);
        return;
    }
    let fab = one_nic();
    dmabuf(&fab, false); // and no peer-memory module
    let target = engine("decode-0", &fab);
    let remote = target.alloc_region(1 << 20, GPU(0)).unwrap();
    assert_eq!(target.rdma_device_mrs().failed, 1, "registered with the engine, not with the NIC");
    let initiator = engine("prefill-0", &fab);
    // Asked for by name: refused, with the target's reason.
    let refused = open(&initiator, &target).unwrap_err().to_string();
    let nic = format!("could not be registered with NIC {}", fab.nics[0]);
    assert!(refused.contains("its GPU region") && refused.contains(&nic), "{refused}");
    // The simulator says why in its words; the fake libibverbs with errno
    // (EOPNOTSUPP for the dma-buf, EFAULT for the device address).
    let peer = if real() { "Bad address" } else { "no peer-memory module" };
    assert!(refused.contains("peer memory") && refused.contains(peer), "{refused}");
    // By default, an engine that cannot use cuda_ipc (no GPU provider)
    // goes on to tcp, which stages device memory.
    let mut plain = fab.verbs.apply(common::builder("prefill-host"));
    if real() {
        // With a CUDA driver loadable (the fake), an engine finds its GPUs
        // itself, and on one host cuda_ipc would reach the target's GPU
        // memory: leave it out, as across hosts.
        plain = plain.transports([TransportKind::Rdma, TransportKind::Tcp]);
    }
    let plain = plain.build().unwrap();
    let name = target.control_addr().to_string();
    assert_eq!(plain.open_segment(&name).unwrap().transport(), TransportKind::Tcp);

    // This engine's own GPU region that no NIC takes: refused the same way.
    dmabuf(&fab, true);
    let host_target = engine("decode-host", &fab);
    let host_remote = host_target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let segment = open(&initiator, &host_target).unwrap();
    dmabuf(&fab, false);
    let unregistrable = initiator.alloc_region(1 << 20, GPU(1)).unwrap();
    assert_eq!(initiator.rdma_device_mrs().failed, 1);
    let refused = open(&initiator, &target).unwrap_err().to_string();
    assert!(refused.contains("this engine's GPU memory"), "{refused}");
    // Over a segment opened before it was registered, the lane refuses its
    // blocks with the reason before anything is posted; nothing lands, the
    // link stays healthy.
    let mut sub = initiator.submitter().unwrap();
    let desc = [BlockDesc::new(unregistrable.id(), 0, host_remote.id(), 0, 4096)];
    let error = failure(run(&mut sub, &Batch::write(&segment).descs(&desc)));
    assert!(matches!(error, Error::Unsupported { .. }) && error.to_string().contains("could not be registered"));
    assert!(read(&host_remote, 0, 4096).iter().all(|&b| b == 0));
    assert!(!segment.is_stale());
    let host_local = initiator.alloc_region(4096, RegionInfo::raw()).unwrap();
    let fine = [BlockDesc::new(host_local.id(), 0, host_remote.id(), 0, 4096)];
    done(run(&mut sub, &Batch::write(&segment).descs(&fine)));
    drop(remote);
}

#[test]
fn a_gpu_whose_driver_exports_no_dmabuf_registers_through_peer_memory() {
    // The NIC stack takes dma-bufs, the GPU's driver exports none
    // (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED 0), nvidia-peermem is loaded.
    // On the fakes in a child: the fake libcuda reads FAKECUDA_DMABUF at
    // cuInit, for the process.
    let name = "a_gpu_whose_driver_exports_no_dmabuf_registers_through_peer_memory";
    let env = [("FAKECUDA_DMABUF", "0".as_ref()), ("FAKE_IBVERBS_PEER_MEMORY", "1".as_ref())];
    if !in_child(name, &env) {
        return;
    }
    let fab = fabric(&[("sim0", Some(0))], SimGpu::new(1, Duration::ZERO).without_dmabuf());
    if let Provider::Sim(sim) = &fab.verbs {
        sim.peer_memory(true);
    }
    let engine = engine("old-driver", &fab);
    let region = engine.alloc_region(65536, GPU(0)).unwrap();
    let stats = engine.rdma_device_mrs();
    assert_eq!((stats.regions, stats.dmabuf, stats.peer_memory, stats.failed), (1, 0, 1, 0), "{stats:?}");
    drop(region);
}

#[test]
fn a_peer_that_restarts_while_gpu_memory_is_in_flight_fails_peer_restarted_and_nothing_leaks() {
    // On the fakes, in a child whose fake libibverbs keeps every WR posted
    // while the delay file exists (tests/fakes/ibverbs/src/delay.rs): no
    // other test's WRs are held with this one's.
    let name = "a_peer_that_restarts_while_gpu_memory_is_in_flight_fails_peer_restarted_and_nothing_leaks";
    let file = std::env::temp_dir().join(format!("kvring-gpu-hold-{}", std::process::id()));
    if !in_child(name, &[("FAKE_IBVERBS_DELAY_FILE", file.as_os_str())]) {
        return;
    }
    let fab = one_nic();
    let stall = match &fab.verbs {
        Provider::Sim(sim) => Stall::Sim(sim.clone()),
        Provider::Real(..) => Stall::Fake(FakeDelay::find().expect("the fake libibverbs is loaded")),
    };
    let initiator = engine("prefill-0", &fab);
    let local = initiator.alloc_region(16 << 20, GPU(1)).unwrap();
    let mut sub = initiator.submitter().unwrap();
    // Scattered 4 KiB blocks: more requests than a send queue holds, so
    // some wait for completions while the target goes away.
    let descs: Vec<BlockDesc> =
        (0..1500).map(|i| BlockDesc::new(local.id(), i * 8192, kvring::RegionId::from_raw(0), 0, 4096)).collect();
    for round in 0..20 {
        let target = engine("decode-0", &fab);
        let remote = target.alloc_region(16 << 20, GPU(0)).unwrap();
        let segment = open(&initiator, &target).unwrap();
        let descs: Vec<BlockDesc> = descs
            .iter()
            .map(|d| BlockDesc::new(d.local_region, d.local_offset, remote.id(), d.local_offset, d.len))
            .collect();
        let posted = stall.hold();
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        let deadline = Instant::now() + WAIT;
        while stall.posted() == posted {
            assert!(Instant::now() < deadline, "round {round}: nothing was posted");
            std::thread::yield_now();
        }
        // The target goes away with the batch in flight.
        drop(remote);
        drop(target);
        stall.release();
        let error = failure(sub.wait(id, WAIT).unwrap());
        assert!(matches!(error, Error::PeerRestarted { .. }), "round {round}: {error}");
        assert!(segment.is_stale());
        initiator.close_segment(&segment);
    }
    drop(sub);
    drop((local, initiator));
    let counts = fab.counts();
    assert!(counts.balanced(), "every QP, MR, CQ, PD and SRQ went: {counts:?}");
}

/// A fabric whose work stays in flight until released: the simulator's
/// held completions (it places a WRITE's bytes when posted), or the fake
/// libibverbs' kept WRs (placed and completed only once released; legal
/// for a NIC by ibv_post_send(3) and ibv_poll_cq(3): tests/fakes/ibverbs/src/delay.rs).
enum Stall {
    Sim(Arc<SimVerbs>),
    Fake(FakeDelay),
}

impl Stall {
    /// Holds the fabric's work; what [`Stall::posted`] says now.
    fn hold(&self) -> u64 {
        match self {
            Stall::Sim(sim) => sim.hold_completions(true),
            Stall::Fake(delay) => delay.hold(),
        }
        self.posted()
    }

    /// A count that grows as requests are posted while held (bytes the
    /// simulator moved; WRs the fake keeps).
    fn posted(&self) -> u64 {
        match self {
            Stall::Sim(sim) => sim.bytes_moved("sim0"),
            Stall::Fake(delay) => delay.kept(),
        }
    }

    /// Lets the held work complete.
    fn release(&self) {
        match self {
            Stall::Sim(sim) => sim.hold_completions(false),
            Stall::Fake(delay) => delay.release(),
        }
    }
}

#[test]
fn no_batch_is_done_before_its_bytes_are_in_the_targets_gpu_memory() {
    // Completions seen late, as on a real fabric: the bytes must already be
    // in place when they are. The simulator places a WRITE's bytes at its
    // post and shows its completion two polls later; the fake libibverbs
    // places and completes each WR 1 ms after its post, at a later poll
    // (tests/fakes/ibverbs/src/delay.rs), in a child of its own so that no
    // other test's WRs are late with these.
    let name = "no_batch_is_done_before_its_bytes_are_in_the_targets_gpu_memory";
    let file = std::env::temp_dir().join(format!("kvring-gpu-late-{}", std::process::id()));
    if !in_child(name, &[("FAKE_IBVERBS_DELAY_FILE", file.as_os_str())]) {
        return;
    }
    let fab = one_nic();
    let _late = match &fab.verbs {
        Provider::Sim(sim) => {
            sim.delay_completions(2);
            None
        }
        Provider::Real(..) => {
            let late = FakeDelay::find().expect("the fake libibverbs is loaded");
            late.delay_ms(1);
            Some(late)
        }
    };
    let target = engine("decode-0", &fab);
    let remote = target.alloc_region(1 << 20, GPU(0)).unwrap();
    let initiator = engine("prefill-0", &fab);
    let local = initiator.alloc_region(2 << 20, GPU(1)).unwrap();
    let segment = open(&initiator, &target).unwrap();
    let mut sub = initiator.submitter().unwrap();
    for i in 0..500u64 {
        let block = (i % 256) * 4096;
        let bytes = (i as u32 + 1).to_le_bytes().repeat(1024);
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.write_at(block, &bytes).unwrap() };
        let desc = [BlockDesc::new(local.id(), block, remote.id(), block, 4096)];
        done(run(&mut sub, &Batch::write(&segment).descs(&desc)));
        assert_eq!(read(&remote, block, 4096), bytes, "write {i} was done before it was in the target's GPU memory");
        let back = [BlockDesc::new(local.id(), (1 << 20) + block, remote.id(), block, 4096)];
        done(run(&mut sub, &Batch::read(&segment).descs(&back)));
        assert_eq!(read(&local, (1 << 20) + block, 4096), bytes, "read {i} was done before it was in place");
    }
}

#[test]
fn the_nic_nearest_the_gpu_carries_its_blocks() {
    let name = "the_nic_nearest_the_gpu_carries_its_blocks";
    // On the real providers: GPU 0 on host NUMA node 1 by the fake
    // libcuda's HOST_NUMA_ID, and the fake's first NIC on node 0, its
    // second on node 1, by a sysfs tree of the NICs' own.
    let sysfs = std::env::temp_dir().join(format!("kvring-rdma-gpu-numa-{}", std::process::id()));
    if real() && std::env::var_os("RDMA_GPU_CHILD").is_none() {
        let Provider::Real(_, nics) = Provider::with_nics(2) else { unreachable!("RDMA_TEST_PROVIDER=ibverbs") };
        for (node, nic) in nics.iter().enumerate() {
            std::fs::create_dir_all(sysfs.join(nic).join("device")).unwrap();
            std::fs::write(sysfs.join(nic).join("device/numa_node"), format!("{node}\n")).unwrap();
        }
    }
    let env = [("FAKECUDA_HOST_NUMA", "1".as_ref()), ("KVRING_RDMA_SYSFS_ROOT", sysfs.as_os_str())];
    let child = in_child(name, &env);
    let _ = std::fs::remove_dir_all(&sysfs);
    if !child {
        return;
    }
    let fab = fabric(&[("mlx5_0", Some(0)), ("mlx5_1", Some(1))], SimGpu::new(1, Duration::ZERO).with_numa_node(1));
    let referee = fab.verbs.referee().expect("the simulator, or the fake libibverbs' control symbols");
    let target = engine("decode-0", &fab);
    let remote = target.alloc_region(8 << 20, RegionInfo::raw()).unwrap();
    let initiator = engine("prefill-0", &fab);
    let on_gpu = initiator.alloc_region(4 << 20, GPU(0)).unwrap();
    let on_host = initiator.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    assert_eq!(initiator.rdma_gpu_nics(0), (vec![fab.nics[1].clone()], "same NUMA node"));
    let segment = open(&initiator, &target).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let moved = |nic| referee.bytes_moved(nic, remote.as_ptr() as u64);
    let before = (moved(0), moved(1));
    done(run(&mut sub, &Batch::write(&segment).block(BlockDesc::new(on_gpu.id(), 0, remote.id(), 0, 4 << 20))));
    assert_eq!((moved(0), moved(1)), (before.0, before.1 + (4 << 20)), "all over the GPU's NIC");
    // Host memory is striped over both, as before.
    let host = BlockDesc::new(on_host.id(), 0, remote.id(), 4 << 20, 4 << 20);
    done(run(&mut sub, &Batch::write(&segment).block(host)));
    assert!(moved(0) > before.0 && moved(1) > before.1 + (4 << 20));
}

#[test]
fn a_tagged_push_over_rdma_is_counted_on_the_target_as_it_lands_in_host_and_gpu_memory() {
    let fab = one_nic();
    for memory in [RegionInfo::raw(), GPU(0)] {
        let target = engine("arrival-target", &fab);
        let remote = target.alloc_region(4 << 20, memory).unwrap();
        let initiator = engine("arrival-initiator", &fab);
        let local = initiator.alloc_region(4 << 20, memory).unwrap();
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.fill_pattern(3) };
        let segment = open(&initiator, &target).unwrap();
        let mut sub = initiator.submitter().unwrap();
        let tag = arrival_tag(7, 3).unwrap();
        let small: Vec<_> =
            (0..64u64).map(|i| BlockDesc::new(local.id(), i * 8192, remote.id(), i * 8192, 4096)).collect();
        let big = [BlockDesc::new(local.id(), 1 << 20, remote.id(), 1 << 20, 3 << 20)];
        let expected: u64 = small.iter().chain(&big).map(|d| d.len).sum();
        // The target's count reaches the bytes on its own.
        for outcome in common::land_in_turn(&mut sub, &segment, &target, tag, &[&small[..], &big[..]]) {
            done(outcome);
        }
        // What was counted is in place.
        assert_eq!(read(&remote, 1 << 20, 3 << 20), pattern(4 << 20, 3)[1 << 20..]);
        // Untagged pushes leave the count alone; a tag on a READ is refused.
        done(run(&mut sub, &Batch::write(&segment).descs(&small)));
        assert_eq!(target.landed(tag), expected);
        let refused = failure(run(&mut sub, &Batch::read(&segment).descs(&small).arrival_tag(tag)));
        assert!(refused.to_string().contains("arrival tag on a READ"), "{refused}");
        assert_eq!(target.forget_arrival(tag), expected);
        assert_eq!(target.arrivals_dropped(), 0);
    }
    if let Some(referee) = fab.verbs.referee() {
        assert_eq!(referee.cq_overruns(), 0);
    }
}

#[test]
fn a_target_whose_nics_have_no_receive_queue_serves_rdma_and_refuses_tags_clearly() {
    let fab = one_nic();
    // The simulator's knob, or the fake's device made without SRQs
    // (FAKE_IBVERBS_DEVICES names it with `nosrq`).
    let target = match &fab.verbs {
        Provider::Sim(sim) => {
            sim.shared_receive_queues(false);
            let target = engine("no-srq-target", &fab);
            sim.shared_receive_queues(true);
            target
        }
        Provider::Real(..) if host_nics("a NIC without shared receive queues") => return,
        Provider::Real(ib, _) => {
            let listed = ib.devices().unwrap().iter().any(|d| d.name == "fakenosrq0");
            assert!(listed, "FAKE_IBVERBS_DEVICES lacks fakenosrq0:eth:4096:active:nosrq (.ci/stage-fakerdmagpu.sh)");
            let builder = common::builder("no-srq-target").rdma(ib.clone()).rdma_devices(["fakenosrq0"]);
            builder.gpu(fab.gpu.clone()).build().unwrap()
        }
    };
    let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let initiator = engine("no-srq-initiator", &fab);
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let segment = open(&initiator, &target).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let desc = [BlockDesc::new(local.id(), 0, remote.id(), 0, 4096)];
    done(run(&mut sub, &Batch::write(&segment).descs(&desc)));
    // Its descriptor says it counts no arrivals: a tag is refused before a
    // write is posted (it would wait for a receive that never comes).
    let refused = failure(run(&mut sub, &Batch::write(&segment).descs(&desc).arrival_tag(5)));
    assert!(refused.to_string().contains("shared receive queues"), "{refused}");
    // The other way round, this side's receive queues count.
    let back = open(&target, &initiator).unwrap();
    let mut tsub = target.submitter().unwrap();
    let desc = [BlockDesc::new(remote.id(), 0, local.id(), 0, 4096)];
    done(run(&mut tsub, &Batch::write(&back).descs(&desc).arrival_tag(5)));
    initiator.wait_landed(5, 4096, WAIT).unwrap();
}

#[test]
fn a_flood_of_tagged_writes_waits_at_its_senders_and_grows_nothing_on_the_target() {
    let fab = one_nic();
    let target = engine("flood-target", &fab);
    let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let tag = arrival_tag(1, 0).unwrap();
    // Five initiators, one QP each, each with 4,000 scattered 64-byte
    // WRITE_WITH_IMMs: more than the target's receive queue holds while its
    // lane cannot poll (the fabric's completions held).
    let initiators: Vec<_> = (0..5).map(|i| engine(&format!("flood-{i}"), &fab)).collect();
    let locals: Vec<_> = initiators.iter().map(|e| e.alloc_region(1 << 20, RegionInfo::raw()).unwrap()).collect();
    let segments: Vec<_> = initiators.iter().map(|e| open(e, &target).unwrap()).collect();
    let mut subs: Vec<_> = initiators.iter().map(|e| e.submitter().unwrap()).collect();
    // On the fake the flood runs with the target's lane polling as it
    // comes (its receive queue refilled as it goes, senders retrying on
    // RNR): everything lands and is counted once.
    let sim = fab.sim("holding the fabric's completions so the receives run out, and counting parked senders");
    if let Some(sim) = sim {
        sim.hold_completions(true);
    }
    let ids: Vec<_> = subs
        .iter_mut()
        .zip(&locals)
        .zip(&segments)
        .map(|((sub, local), segment)| {
            let descs: Vec<_> = (0..4000u64)
                .map(|i| BlockDesc::new(local.id(), i * 128, remote.id(), (i * 128) % (1 << 20), 64))
                .collect();
            sub.submit(&Batch::write(segment).descs(&descs).arrival_tag(tag)).unwrap()
        })
        .collect();
    // The receives run out: the rest waits at its senders' NICs, and
    // nothing on the target grows (its CQ holds what its queue holds).
    if let Some(sim) = sim {
        let deadline = Instant::now() + WAIT;
        while sim.parked() == 0 {
            assert!(Instant::now() < deadline, "no sender ever waited for a receive");
            std::thread::yield_now();
        }
        assert_eq!(target.landed(tag), 0, "the target's lane has not polled yet");
        sim.hold_completions(false);
    }
    target.wait_landed(tag, 5 * 4000 * 64, WAIT).unwrap();
    for (sub, id) in subs.iter_mut().zip(ids) {
        done(sub.wait(id, WAIT).unwrap());
    }
    assert_eq!(target.landed(tag), 5 * 4000 * 64);
    assert_eq!(target.arrivals_dropped(), 0);
    if let Some(referee) = fab.verbs.referee() {
        assert_eq!(referee.cq_overruns(), 0, "the target's CQ holds what its queue holds");
    }
    if let Some(sim) = sim {
        assert_eq!(sim.parked(), 0);
    }
}

/// Every (src → dst) block of every layer and kind holds the source bytes.
fn assert_moved(src: (&[Region], &KvLayout), dst: (&[Region], &KvLayout), src_ids: &[u64], dst_ids: &[u64]) {
    for layer in 0..src.1.layers() {
        let (ours, theirs) = (src.1.layer(layer).unwrap(), dst.1.layer(layer).unwrap());
        for (kind, (s_buf, d_buf)) in ours.iter().zip(theirs).enumerate() {
            let s_region = &src.0[layer as usize * ours.len() + kind];
            let d_region = &dst.0[layer as usize * theirs.len() + kind];
            for (&s, &d) in src_ids.iter().zip(dst_ids) {
                let want = read(s_region, s_buf.offset + s * s_buf.block_bytes, s_buf.block_bytes as usize);
                let got = read(d_region, d_buf.offset + d * d_buf.block_bytes, d_buf.block_bytes as usize);
                assert_eq!(want, got, "layer {layer} kind {kind} block {s}->{d}");
            }
        }
    }
}

#[test]
fn kv_push_pull_and_tagged_push_layer_between_gpu_layouts_over_rdma() {
    let fab = one_nic();
    let shape = CacheShape::mha(3, 32, 2, 64, 2, 1, 1).unwrap();
    let prefill = engine("kv-prefill", &fab);
    let decode = engine("kv-decode", &fab);
    let (p_regions, p_layout) = common::gpu_kv_cache(&prefill, shape, 7);
    let (d_regions, d_layout) = common::gpu_kv_cache(&decode, shape, 100);
    let segment = open(&prefill, &decode).unwrap();
    let remote = segment.kv_layout(WAIT).unwrap();
    p_layout.check_compatible(&remote).unwrap();
    let mut sub = prefill.submitter().unwrap();
    let id = sub.push_blocks(&segment, &p_layout, &remote, &[3, 4, 5, 9], &[0, 1, 2, 7]).unwrap();
    done(sub.wait(id, WAIT).unwrap());
    assert_moved((&p_regions, &p_layout), (&d_regions, &d_layout), &[3, 4, 5, 9], &[0, 1, 2, 7]);
    // Layer by layer, each counted on the decode side as it lands.
    for layer in 0..shape.layers {
        let id = sub.push_layer_tagged(&segment, &p_layout, &remote, layer, 11, &[20, 21], &[30, 31]).unwrap();
        let layer_bytes = 2 * (shape.key_block_bytes + shape.value_block_bytes);
        decode.wait_landed(arrival_tag(11, layer).unwrap(), layer_bytes, WAIT).unwrap();
        done(sub.wait(id, WAIT).unwrap());
        assert_eq!(decode.landed(arrival_tag(11, layer + 1).unwrap()), 0, "the next layer is not counted yet");
    }
    assert_moved((&p_regions, &p_layout), (&d_regions, &d_layout), &[20, 21], &[30, 31]);
    let id = sub.push_layer(&segment, &p_layout, &remote, 1, &[22], &[23]).unwrap();
    done(sub.wait(id, WAIT).unwrap());
    // Pull: the decode side reads prefill's blocks 10, 11 into its 12, 13.
    let back = open(&decode, &prefill).unwrap();
    let p_remote = back.kv_layout(WAIT).unwrap();
    let mut dsub = decode.submitter().unwrap();
    let id = dsub.pull_blocks(&back, &d_layout, &p_remote, &[10, 11], &[12, 13]).unwrap();
    done(dsub.wait(id, WAIT).unwrap());
    assert_moved((&p_regions, &p_layout), (&d_regions, &d_layout), &[10, 11], &[12, 13]);
    assert_eq!(prefill.rdma_device_mrs().dmabuf, p_regions.len() as u64, "one registration per region");
}

#[test]
fn mla_push_with_gpu_caches_from_prefill_tp2_to_decode_tp1_and_from_tp1_to_tp4_over_rdma() {
    let fab = one_nic();
    let shape = CacheShape::mla(3, 16, 576, 2, 8, 128).unwrap();
    // tp 2 -> tp 1: each decode rank's blocks from exactly one prefill rank.
    let prefills: Vec<_> = (0..2).map(|r| engine(&format!("prefill-{r}"), &fab)).collect();
    let caches: Vec<_> = prefills.iter().map(|p| common::gpu_kv_cache(p, shape, 7)).collect();
    let decode = engine("decode-0", &fab);
    let (d_regions, d_layout) = common::gpu_kv_cache(&decode, shape, 50);
    for (rank, prefill) in prefills.iter().enumerate() {
        let local = Rank { dp_size: 1, tp_size: 2, dp_rank: 0, tp_rank: rank as u32 };
        let remote = Rank { dp_size: 1, tp_size: 1, dp_rank: 0, tp_rank: 0 };
        assert_eq!(check_pd_topo(local, remote, Mode::Push, Attention::Mla), kvring::kv::TopoCheck::Heterogeneous);
        for target in push_targets(rank as u32, 2, 1) {
            assert_eq!(target, 0);
            let segment = open(prefill, &decode).unwrap();
            let mut sub = prefill.submitter().unwrap();
            let id = sub.push_blocks(&segment, &caches[rank].1, &d_layout, &[1, 2, 3], &[4, 5, 6]).unwrap();
            done(sub.wait(id, WAIT).unwrap());
        }
    }
    assert_moved((&caches[0].0, &caches[0].1), (&d_regions, &d_layout), &[1, 2, 3], &[4, 5, 6]);
    // tp 1 -> tp 4: the one prefill rank pushes to all four.
    let prefill = engine("prefill-solo", &fab);
    let (p_regions, p_layout) = common::gpu_kv_cache(&prefill, shape, 9);
    let decodes: Vec<_> = (0..4).map(|r| engine(&format!("decode-{r}"), &fab)).collect();
    let d_caches: Vec<_> = decodes.iter().map(|d| common::gpu_kv_cache(d, shape, 60)).collect();
    let targets: Vec<u32> = push_targets(0, 1, 4).collect();
    assert_eq!(targets, [0, 1, 2, 3]);
    let mut sub = prefill.submitter().unwrap();
    for &t in &targets {
        let segment = open(&prefill, &decodes[t as usize]).unwrap();
        let id = sub.push_blocks(&segment, &p_layout, &d_caches[t as usize].1, &[0, 5], &[15, 14]).unwrap();
        done(sub.wait(id, WAIT).unwrap());
    }
    for (regions, layout) in &d_caches {
        assert_moved((&p_regions, &p_layout), (regions, layout), &[0, 5], &[15, 14]);
    }
}
