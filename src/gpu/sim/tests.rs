//! Tests of the simulated GPU provider.
use super::super::{CopySides, Place};
use super::super::{HandleKind, IPC_HANDLE_BYTES};
use super::*;
use std::process::Command;

const DELAY: Duration = Duration::from_millis(20);

fn gpu() -> SimGpu {
    SimGpu::new(2, DELAY)
}

/// Polls `event` until it completes (bounded), returning how long it took.
fn wait(gpu: &SimGpu, event: Event) -> Result<Duration> {
    let started = Instant::now();
    while !gpu.query(event)? {
        assert!(started.elapsed() < Duration::from_secs(5), "the event never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(started.elapsed())
}

/// Copies `copies` on a fresh stream of device 0 and waits for them.
fn run(gpu: &SimGpu, copies: &[Copy]) -> Result<()> {
    let stream = gpu.create_stream(0)?;
    let event = gpu.create_event(0)?;
    // SAFETY: the tests' host buffers outlive the wait below.
    unsafe { gpu.copy_batch(stream, copies, &[])? };
    gpu.record(stream, event)?;
    wait(gpu, event)?;
    gpu.destroy_event(event)?;
    gpu.destroy_stream(stream)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn device_memory_is_classified_and_its_addresses_cannot_be_touched_by_the_host() {
    let gpu = gpu();
    let ptr = gpu.alloc(1, 1 << 20).unwrap();
    let host = [0u8; 64];
    assert_eq!(gpu.classify(host.as_ptr() as u64, 64).unwrap(), Memory::Host);
    assert_eq!(gpu.classify(ptr.0 + 4096, 4096).unwrap(), Memory::Device { ordinal: 1, base: ptr, len: 1 << 20 });
    let error = gpu.classify(ptr.0 + 4096, 1 << 20).unwrap_err().to_string();
    assert!(error.contains("runs past its allocation"), "{error}");
    // The device range is mapped with no access at all: a host dereference
    // would fault, so no lane can read or write it by mistake.
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let start = format!("{:x}-", ptr.0);
    let line = maps.lines().find(|l| l.starts_with(&start)).expect("the device range is mapped");
    assert!(line.split_whitespace().nth(1) == Some("---s"), "{line}");
    // SAFETY: nothing uses the allocation any more.
    unsafe { gpu.free(ptr).unwrap() };
    assert_eq!(gpu.classify(ptr.0, 1).unwrap(), Memory::Host, "freed");
}

#[test]
fn copies_land_only_when_their_event_completes_host_to_device_to_device_to_host() {
    let gpu = gpu();
    let (a, b) = (gpu.alloc(0, 1 << 16).unwrap(), gpu.alloc(0, 1 << 16).unwrap());
    let source = pattern(1 << 16, 7);
    let mut back = vec![0u8; 1 << 16];
    let stream = gpu.create_stream(0).unwrap();
    let uploaded = gpu.create_event(0).unwrap();
    assert!(gpu.query(uploaded).unwrap(), "an event never recorded is complete, as CUDA's");
    let copies = [Copy { src: source.as_ptr() as u64, dst: a.0, len: 1 << 16 }];
    // SAFETY: `source` outlives the wait below.
    unsafe { gpu.copy_batch(stream, &copies, &[]).unwrap() };
    gpu.record(stream, uploaded).unwrap();
    assert!(!gpu.query(uploaded).unwrap(), "not before the copy engine's delay");
    assert!(wait(&gpu, uploaded).unwrap() + Duration::from_millis(2) >= DELAY / 2);
    // Recorded again: incomplete again until the new work is done.
    // SAFETY: as above.
    unsafe { gpu.copy_batch(stream, &copies, &[]).unwrap() };
    gpu.record(stream, uploaded).unwrap();
    assert!(!gpu.query(uploaded).unwrap(), "the latest recording counts");
    wait(&gpu, uploaded).unwrap();
    // Two halves device to device in one batch, then the whole back.
    let halves = [Copy { src: a.0, dst: b.0 + 32768, len: 32768 }, Copy { src: a.0 + 32768, dst: b.0, len: 32768 }];
    run(&gpu, &halves).unwrap();
    run(&gpu, &[Copy { src: b.0, dst: back.as_mut_ptr() as u64, len: 1 << 16 }]).unwrap();
    assert_eq!(&back[32768..], &source[..32768]);
    assert_eq!(&back[..32768], &source[32768..]);
    assert_eq!(gpu.copy_counts(), (4, 5), "calls and copies");
    assert_eq!(gpu.copy_method(), CopyMethod::Batched);
    let old = SimGpu::new(1, DELAY).with_copy_method(CopyMethod::PerCopy);
    assert_eq!(old.copy_method(), CopyMethod::PerCopy);
}

#[test]
fn a_run_of_pieces_is_one_range_and_copies_cross_its_piece_ends() {
    let gpu = gpu();
    let run_ptr = gpu.alloc_pieces(0, 8192, 4).unwrap();
    let whole = Memory::Device { ordinal: 0, base: run_ptr, len: 4 * 8192 };
    assert_eq!(gpu.classify(run_ptr.0 + 100, 3 * 8192).unwrap(), whole, "one range over four pieces");
    assert!(gpu.classify(run_ptr.0 + 100, 4 * 8192).is_err(), "past the run's end");
    let source = pattern(3 * 8192, 9);
    let mut back = vec![0u8; 3 * 8192];
    let at = run_ptr.0 + 4000;
    run(&gpu, &[Copy { src: source.as_ptr() as u64, dst: at, len: source.len() as u64 }]).unwrap();
    run(&gpu, &[Copy { src: at, dst: back.as_mut_ptr() as u64, len: back.len() as u64 }]).unwrap();
    assert_eq!(back, source, "through four pieces' own views");
    let export = gpu.export(at, 2 * 8192).unwrap();
    let kinds: Vec<_> = export.handles().iter().map(|h| (h.kind, h.offset, h.len)).collect();
    let fd = HandleKind::FileDescriptor;
    assert_eq!(kinds, [(fd, 4000, 8192), (fd, 0, 8192), (fd, 0, 8192)], "the pieces the range touches");
    // SAFETY: nothing uses it.
    unsafe { gpu.free(run_ptr).unwrap() };
    assert_eq!(gpu.classify(run_ptr.0 + 3 * 8192, 1).unwrap(), Memory::Host, "every piece freed");
}

#[test]
fn bad_copies_and_faults_are_clear_errors() {
    let gpu = gpu();
    let ptr = gpu.alloc(0, 4096).unwrap();
    let host = vec![0u8; 8192];
    let past = [Copy { src: host.as_ptr() as u64, dst: ptr.0 + 4000, len: 200 }];
    // SAFETY: refused before anything is queued.
    let error = unsafe { gpu.copy_batch(gpu.create_stream(0).unwrap(), &past, &[]) }.unwrap_err().to_string();
    assert!(error.contains("runs past its allocation"), "{error}");

    // A copy that fails on the device: its event reports it, and so does
    // every later query (GPU errors are sticky).
    gpu.fail_next_copy();
    let within = [Copy { src: host.as_ptr() as u64, dst: ptr.0, len: 4096 }];
    let error = run(&gpu, &within).unwrap_err().to_string();
    assert!(error.contains("a copy failed"), "{error}");
    let stream = gpu.create_stream(0).unwrap();
    let event = gpu.create_event(0).unwrap();
    gpu.record(stream, event).unwrap();
    assert!(gpu.query(event).is_err(), "sticky");

    // A lost device refuses everything.
    let other = SimGpu::new(2, DELAY);
    let on_one = other.alloc(1, 4096).unwrap();
    other.lose_device(1);
    assert!(other.alloc(1, 4096).unwrap_err().to_string().contains("the device was lost"));
    assert!(other.create_stream(1).is_err());
    assert_eq!(other.devices().unwrap().len(), 1);
    let to_lost = [Copy { src: host.as_ptr() as u64, dst: on_one.0, len: 16 }];
    // SAFETY: refused before anything is queued.
    let error = unsafe { other.copy_batch(other.create_stream(0).unwrap(), &to_lost, &[]) }.unwrap_err().to_string();
    assert!(error.contains("the device was lost"), "{error}");

    // Host registration twice is refused, as CUDA refuses it.
    // SAFETY: `host` outlives the registration.
    unsafe { gpu.host_register(host.as_ptr() as u64, 8192).unwrap() };
    assert!(gpu.is_host_registered(host.as_ptr() as u64));
    // SAFETY: refused.
    assert!(unsafe { gpu.host_register(host.as_ptr() as u64 + 4096, 16) }.is_err());
    gpu.host_unregister(host.as_ptr() as u64).unwrap();
    assert!(gpu.host_unregister(host.as_ptr() as u64).is_err());
    assert!(gpu.alloc(5, 16).unwrap_err().to_string().contains("no such device"));
}

/// A handle as text for a child process: kind, 8 payload words, offset, len.
fn handle_words(handle: &IpcHandle) -> String {
    let mut words = vec![handle.kind.to_wire() as u64];
    words.extend(handle.bytes.chunks(8).map(|w| u64::from_le_bytes(w.try_into().unwrap())));
    words.extend([handle.offset, handle.len]);
    words.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

fn parse_handle(text: &str) -> IpcHandle {
    let words: Vec<u64> = text.split(',').map(|w| w.parse().unwrap()).collect();
    let mut bytes = [0u8; IPC_HANDLE_BYTES];
    for (i, word) in words[1..9].iter().enumerate() {
        bytes[i * 8..i * 8 + 8].copy_from_slice(&word.to_le_bytes());
    }
    IpcHandle { kind: HandleKind::from_wire(words[0] as u32).unwrap(), bytes, offset: words[9], len: words[10] }
}

/// The child half of the cross-process test: opens the parent's export
/// named in `KVRING_SIM_GPU_HANDLES` (handles separated by `;`), each
/// handle's memory the descriptor the parent shared and left open across
/// exec (`KVRING_SIM_GPU_FDS`, numbers separated by `,`), and checks that
/// its first `KVRING_SIM_GPU_LEN` bytes are the pattern. Run only by
/// `exports_open_in_another_process_and_not_in_their_own`.
#[test]
#[ignore = "the child of a cross-process test"]
fn child_opens_an_export() {
    use std::os::fd::{FromRawFd, OwnedFd};
    let text = std::env::var("KVRING_SIM_GPU_HANDLES").expect("run by the cross-process test");
    let numbers: Vec<i32> =
        std::env::var("KVRING_SIM_GPU_FDS").unwrap().split(',').map(|n| n.parse().unwrap()).collect();
    let len: usize = std::env::var("KVRING_SIM_GPU_LEN").unwrap().parse().unwrap();
    let handles: Vec<IpcHandle> = text.split(';').map(parse_handle).collect();
    let gpu = gpu();
    let mut asked = Vec::new();
    let ptr = gpu
        .open(&handles, &mut |i| {
            asked.push(i);
            // SAFETY: inherited from the parent for this child alone, taken once.
            Ok(crate::gpu::Shareable::Fd(unsafe { OwnedFd::from_raw_fd(numbers[i]) }))
        })
        .unwrap();
    assert_eq!(asked, (0..handles.len()).collect::<Vec<_>>(), "each handle's descriptor, once, in order");
    for fd in &numbers {
        // SAFETY: fcntl on a number; no memory passed.
        assert_eq!(unsafe { libc::fcntl(*fd, libc::F_GETFD) }, -1, "descriptor {fd} is closed once imported");
    }
    let mut back = vec![0u8; len];
    run(&gpu, &[Copy { src: ptr.0, dst: back.as_mut_ptr() as u64, len: len as u64 }]).unwrap();
    assert_eq!(back, pattern(len, 3), "the peer's bytes, at the exported pointer");
    // SAFETY: no copy uses it any more.
    unsafe { gpu.close(ptr).unwrap() };
}

/// Runs the child on `export`, each handle's descriptor shared by `gpu`
/// and left open across exec for it.
fn child_reads(gpu: &SimGpu, export: &Export, len: usize) -> std::process::Output {
    use std::os::fd::AsRawFd;
    let text: Vec<String> = export.handles().iter().map(handle_words).collect();
    let shared: Vec<_> = export.handles().iter().map(|h| gpu.share(h).unwrap().unwrap().into_fd().unwrap()).collect();
    for fd in &shared {
        // SAFETY: fcntl on a descriptor this test owns: clears close-on-exec.
        assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) }, 0);
    }
    let numbers: Vec<String> = shared.iter().map(|fd| fd.as_raw_fd().to_string()).collect();
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "gpu::sim::tests::child_opens_an_export", "--test-threads=1"])
        .env("KVRING_SIM_GPU_HANDLES", text.join(";"))
        .env("KVRING_SIM_GPU_FDS", numbers.join(","))
        .env("KVRING_SIM_GPU_LEN", len.to_string())
        .output()
        .unwrap()
}

#[test]
fn exports_open_in_another_process_and_not_in_their_own() {
    let gpu = gpu();
    let legacy = gpu.alloc(0, 1 << 16).unwrap();
    let pieces = gpu.alloc_pieces(0, 8192, 3).unwrap();
    let source = pattern(12000, 3);
    for at in [legacy.0 + 8192, pieces.0 + 4000] {
        run(&gpu, &[Copy { src: source.as_ptr() as u64, dst: at, len: source.len() as u64 }]).unwrap();
        let export = gpu.export(at, source.len() as u64).unwrap();
        let own = |i: usize| gpu.share(&export.handles()[i]).map(Option::unwrap);
        let error = gpu.open(export.handles(), &mut { own }).unwrap_err().to_string();
        assert!(error.contains("its own"), "{error}");
        let child = child_reads(&gpu, &export, source.len());
        let out = String::from_utf8_lossy(&child.stdout);
        assert!(child.status.success() && out.contains("1 passed"), "{out}{}", String::from_utf8_lossy(&child.stderr));
    }
    let export = gpu.export(legacy.0 + 8192, 4096).unwrap();
    assert_eq!(export.handles()[0].kind, HandleKind::Legacy);
    assert_eq!((export.handles()[0].offset, export.handles()[0].len), (8192, 1 << 16));

    // Only handles of this process's own live memory are shared: one naming
    // another address, or memory freed since, shares nothing.
    let mut elsewhere = export.handles()[0];
    elsewhere.bytes[4..12].copy_from_slice(&(legacy.0 + 4096).to_le_bytes());
    assert!(gpu.share(&elsewhere).unwrap_err().to_string().contains("no longer memory this process exported"));
    let mut forged = export.handles()[0];
    forged.bytes[..4].copy_from_slice(b"KVFD");
    assert!(gpu.share(&forged).unwrap_err().to_string().contains("not a simulated handle"));
    let dropped = gpu.export(pieces.0, 8192).unwrap();
    // SAFETY: nothing uses the run.
    unsafe { gpu.free(pieces).unwrap() };
    assert!(gpu.share(&dropped.handles()[0]).is_err(), "a freed piece is shared no more");
    // A descriptor of another size than its handle says is refused.
    let wrong = gpu.share(&export.handles()[0]).unwrap().unwrap();
    let mut longer = export.handles()[0];
    longer.len *= 2;
    let other = SimGpu::new(1, DELAY);
    let mut once = Some(wrong);
    let error = other.open(&[longer], &mut |_| Ok(once.take().unwrap())).unwrap_err().to_string();
    assert!(error.contains("the handle says"), "{error}");
    other.fail_next_open();
    assert!(other
        .open(&[longer], &mut |_| unreachable!("refused first"))
        .unwrap_err()
        .to_string()
        .contains("injected"));
}

/// Queues `copies` (ends as `sides` say) on `stream`, records `event` after
/// them and waits: the method taken, and how the event ended.
fn launch(gpu: &SimGpu, stream: Stream, copies: &[Copy], sides: &[CopySides]) -> (CopyMethod, Result<Duration>) {
    let device = gpu.lock().streams[&stream.0].device;
    let event = gpu.create_event(device).unwrap();
    // SAFETY: the tests' host buffers outlive the wait below.
    let method = unsafe { gpu.copy_batch(stream, copies, sides) }.unwrap();
    gpu.record(stream, event).unwrap();
    (method, wait(gpu, event))
}

/// Reads `len` bytes of device memory at `src` with one plain copy.
fn read_back(gpu: &SimGpu, device: u32, src: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let stream = gpu.create_stream(device).unwrap();
    let event = gpu.create_event(device).unwrap();
    // SAFETY: `out` outlives the wait below.
    unsafe { gpu.copy_one(stream, Copy { src, dst: out.as_mut_ptr() as u64, len: len as u64 }).unwrap() };
    gpu.record(stream, event).unwrap();
    wait(gpu, event).unwrap();
    out
}

#[test]
fn the_copy_kernel_runs_only_where_it_cannot_fault_and_faults_where_it_would() {
    use Place::{Device, Host};
    let gpu = SimGpu::new(2, Duration::from_micros(100)).with_copy_method(CopyMethod::Kernel);
    assert_eq!(gpu.copy_method(), CopyMethod::Kernel, "a 12.0 driver whose kernel loads");
    let (dev, other) = (gpu.alloc(0, 1 << 16).unwrap(), gpu.alloc(1, 1 << 16).unwrap());
    let pinned = pattern(8192, 1);
    // SAFETY: `pinned` outlives its registration (unregistered below).
    unsafe { gpu.host_register(pinned.as_ptr() as u64, 8192).unwrap() };
    let pageable = pattern(4096, 2);
    let stream = gpu.create_stream(0).unwrap();
    let up = |src: &[u8], at: u64| Copy { src: src.as_ptr() as u64, dst: dev.0 + at, len: src.len() as u64 };
    let host_to_dev = [CopySides { src: Host, dst: Device(0) }];

    // Pinned host memory: the kernel, and the bytes land.
    let (method, ended) = launch(&gpu, stream, &[up(&pinned, 0)], &host_to_dev);
    assert_eq!((method, ended.is_ok()), (CopyMethod::Kernel, true));
    assert_eq!(read_back(&gpu, 0, dev.0, 8192), pinned);
    // Pageable memory, or ends nobody described: one call per copy.
    let (method, ended) = launch(&gpu, stream, &[up(&pageable, 8192)], &host_to_dev);
    assert_eq!((method, ended.is_ok()), (CopyMethod::PerCopy, true));
    let (method, _) = launch(&gpu, stream, &[up(&pinned, 0)], &[]);
    assert_eq!(method, CopyMethod::PerCopy, "unknown ends never reach the kernel");
    assert_eq!(read_back(&gpu, 0, dev.0 + 8192, 4096), pageable);
    // Another GPU's memory: the kernel with peer access; without it, one
    // call per copy.
    let across = [Copy { src: other.0, dst: dev.0, len: 4096 }];
    let (method, _) = launch(&gpu, stream, &across, &[CopySides { src: Device(1), dst: Device(0) }]);
    assert_eq!(method, CopyMethod::Kernel);
    let apart = SimGpu::new(2, Duration::from_micros(100)).with_copy_method(CopyMethod::Kernel).without_peer_access();
    let (a, b) = (apart.alloc(0, 4096).unwrap(), apart.alloc(1, 4096).unwrap());
    let apart_stream = apart.create_stream(0).unwrap();
    let across = [Copy { src: b.0, dst: a.0, len: 4096 }];
    let (method, ended) = launch(&apart, apart_stream, &across, &[CopySides { src: Device(1), dst: Device(0) }]);
    assert_eq!((method, ended.is_ok()), (CopyMethod::PerCopy, true));

    // Told wrong, the kernel is handed what it cannot touch: it faults, as
    // on a GPU (sticky on that GPU), instead of moving the bytes.
    let (method, ended) = launch(&apart, apart_stream, &across, &[CopySides { src: Device(0), dst: Device(0) }]);
    assert_eq!(method, CopyMethod::Kernel);
    let error = ended.unwrap_err().to_string();
    assert!(error.contains("without peer access"), "{error}");
    let lie = [CopySides { src: Device(0), dst: Device(0) }];
    let (method, ended) = launch(&gpu, stream, &[up(&pageable, 0)], &lie);
    assert_eq!(method, CopyMethod::Kernel);
    let error = ended.unwrap_err().to_string();
    assert!(error.contains("not pinned for the GPU") && error.contains("illegal address"), "{error}");
    // SAFETY: refused (the GPU's error is sticky).
    assert!(unsafe { gpu.copy_batch(stream, &[up(&pinned, 0)], &host_to_dev) }.is_err());
    gpu.host_unregister(pinned.as_ptr() as u64).unwrap();
}

#[test]
fn busy_kernel_slots_send_a_chunk_one_call_per_copy_and_free_again() {
    let gpu = SimGpu::new(1, Duration::from_millis(50)).with_copy_method(CopyMethod::Kernel);
    let dev = gpu.alloc(0, 1 << 20).unwrap();
    let stream = gpu.create_stream(0).unwrap();
    let sides = [CopySides { src: Place::Device(0), dst: Place::Device(0) }];
    let copy = [Copy { src: dev.0, dst: dev.0 + 4096, len: 4096 }];
    let methods: Vec<CopyMethod> = (0..KERNEL_SLOTS + 1)
        // SAFETY: device memory only.
        .map(|_| unsafe { gpu.copy_batch(stream, &copy, &sides) }.unwrap())
        .collect();
    assert!(methods[..KERNEL_SLOTS].iter().all(|&m| m == CopyMethod::Kernel), "{methods:?}");
    assert_eq!(methods[KERNEL_SLOTS], CopyMethod::PerCopy, "every slot busy");
    let (method, ended) = launch(&gpu, stream, &copy, &sides);
    assert_eq!(method, CopyMethod::PerCopy);
    ended.unwrap();
    assert_eq!(launch(&gpu, stream, &copy, &sides).0, CopyMethod::Kernel, "slots free once their launches ended");
    let too_many = vec![copy[0]; KERNEL_SLOT_COPIES + 1];
    let sides = vec![sides[0]; too_many.len()];
    assert_eq!(launch(&gpu, stream, &too_many, &sides).0, CopyMethod::PerCopy, "more than a slot holds");
}

#[test]
fn a_refused_call_queues_nothing_and_a_failed_copy_is_sticky_on_its_gpu_only() {
    let gpu = gpu();
    let (zero, one) = (gpu.alloc(0, 8192).unwrap(), gpu.alloc(1, 8192).unwrap());
    let (s0, s1) = (gpu.create_stream(0).unwrap(), gpu.create_stream(1).unwrap());
    let on_zero = [Copy { src: zero.0, dst: zero.0 + 4096, len: 4096 }];
    let on_one = [Copy { src: one.0, dst: one.0 + 4096, len: 4096 }];
    gpu.refuse_copy_call(1);
    // SAFETY: device memory only, here and below.
    unsafe { gpu.copy_batch(s0, &on_zero, &[]).unwrap() };
    // SAFETY: as above.
    let error = unsafe { gpu.copy_batch(s0, &on_zero, &[]) }.unwrap_err().to_string();
    assert!(error.contains("refused the copy call"), "{error}");
    assert_eq!(gpu.copy_counts(), (1, 1), "the refused call queued nothing");
    assert!(launch(&gpu, s0, &on_zero, &[]).1.is_ok(), "and the GPU is still usable");
    gpu.fail_next_copy();
    assert!(launch(&gpu, s0, &on_zero, &[]).1.is_err());
    // SAFETY: as above.
    let error = unsafe { gpu.copy_batch(s0, &on_zero, &[]) }.unwrap_err().to_string();
    assert!(error.contains("sim-gpu-0") && error.contains("injected"), "sticky on GPU 0: {error}");
    assert!(launch(&gpu, s1, &on_one, &[]).1.is_ok(), "GPU 1 is unharmed");
}
