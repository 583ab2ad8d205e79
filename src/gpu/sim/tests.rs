//! Tests of the simulated GPU provider.
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
    // SAFETY: the tests' host buffers outlive the wait below.
    unsafe { gpu.copy_batch(stream, copies)? };
    let event = gpu.record(stream)?;
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
    let copies = [Copy { src: source.as_ptr() as u64, dst: a.0, len: 1 << 16 }];
    // SAFETY: `source` outlives the wait below.
    unsafe { gpu.copy_batch(stream, &copies).unwrap() };
    let uploaded = gpu.record(stream).unwrap();
    assert!(!gpu.query(uploaded).unwrap(), "not before the copy engine's delay");
    assert!(wait(&gpu, uploaded).unwrap() + Duration::from_millis(2) >= DELAY / 2);
    // Two halves device to device in one batch, then the whole back.
    let halves = [Copy { src: a.0, dst: b.0 + 32768, len: 32768 }, Copy { src: a.0 + 32768, dst: b.0, len: 32768 }];
    run(&gpu, &halves).unwrap();
    run(&gpu, &[Copy { src: b.0, dst: back.as_mut_ptr() as u64, len: 1 << 16 }]).unwrap();
    assert_eq!(&back[32768..], &source[..32768]);
    assert_eq!(&back[..32768], &source[32768..]);
}

#[test]
fn bad_copies_and_faults_are_clear_errors() {
    let gpu = gpu();
    let ptr = gpu.alloc(0, 4096).unwrap();
    let host = vec![0u8; 8192];
    let past = [Copy { src: host.as_ptr() as u64, dst: ptr.0 + 4000, len: 200 }];
    // SAFETY: refused before anything is queued.
    let error = unsafe { gpu.copy_batch(gpu.create_stream(0).unwrap(), &past) }.unwrap_err().to_string();
    assert!(error.contains("runs past its allocation"), "{error}");

    // A copy that fails on the device: its event reports it, and so does
    // every later query (GPU errors are sticky).
    gpu.fail_next_copy();
    let within = [Copy { src: host.as_ptr() as u64, dst: ptr.0, len: 4096 }];
    let error = run(&gpu, &within).unwrap_err().to_string();
    assert!(error.contains("a copy failed"), "{error}");
    let stream = gpu.create_stream(0).unwrap();
    let event = gpu.record(stream).unwrap();
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
    let error = unsafe { other.copy_batch(other.create_stream(0).unwrap(), &to_lost) }.unwrap_err().to_string();
    assert!(error.contains("the device was lost"), "{error}");

    // Host registration twice is refused, as CUDA refuses it.
    // SAFETY: `host` outlives the registration.
    unsafe { gpu.host_register(host.as_ptr() as u64, 8192).unwrap() };
    // SAFETY: refused.
    assert!(unsafe { gpu.host_register(host.as_ptr() as u64 + 4096, 16) }.is_err());
    gpu.host_unregister(host.as_ptr() as u64).unwrap();
    assert!(gpu.host_unregister(host.as_ptr() as u64).is_err());
    assert!(gpu.alloc(5, 16).unwrap_err().to_string().contains("no such device"));
}

/// The child half of the cross-process test: opens the parent's export
/// named in `KVRING_SIM_GPU_HANDLE` and checks its bytes. Run only by
/// `an_export_opens_in_another_process_and_not_in_its_own`.
#[test]
#[ignore = "the child of a cross-process test"]
fn child_opens_an_export() {
    let text = std::env::var("KVRING_SIM_GPU_HANDLE").expect("run by the cross-process test");
    let words: Vec<u64> = text.split(',').map(|w| w.parse().unwrap()).collect();
    let mut bytes = [0u8; 64];
    for (i, word) in words[..8].iter().enumerate() {
        bytes[i * 8..i * 8 + 8].copy_from_slice(&word.to_le_bytes());
    }
    let handle = IpcHandle { bytes, offset: words[8], len: words[9] };
    let gpu = gpu();
    let ptr = gpu.open(&handle).unwrap();
    let mut back = vec![0u8; 4096];
    run(&gpu, &[Copy { src: ptr.0, dst: back.as_mut_ptr() as u64, len: 4096 }]).unwrap();
    assert_eq!(back, pattern(4096, 3), "the peer's bytes, at the exported pointer");
    // SAFETY: no copy uses it any more.
    unsafe { gpu.close(ptr).unwrap() };
}

#[test]
fn an_export_opens_in_another_process_and_not_in_its_own() {
    let gpu = gpu();
    let ptr = gpu.alloc(0, 1 << 16).unwrap();
    let source = pattern(4096, 3);
    let at = ptr.0 + 8192;
    run(&gpu, &[Copy { src: source.as_ptr() as u64, dst: at, len: 4096 }]).unwrap();
    let handle = gpu.export(DevicePtr(at)).unwrap();
    assert_eq!((handle.offset, handle.len), (8192, 1 << 16));
    assert!(gpu.open(&handle).unwrap_err().to_string().contains("its own IPC handle"));

    let mut words: Vec<String> =
        handle.bytes.chunks(8).map(|w| u64::from_le_bytes(w.try_into().unwrap()).to_string()).collect();
    words.push(handle.offset.to_string());
    words.push(handle.len.to_string());
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "gpu::sim::tests::child_opens_an_export", "--test-threads=1"])
        .env("KVRING_SIM_GPU_HANDLE", words.join(","))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&child.stdout);
    assert!(child.status.success() && out.contains("1 passed"), "{out}{}", String::from_utf8_lossy(&child.stderr));

    // A handle whose process is gone (a pid that cannot exist) is refused.
    let mut gone = handle;
    gone.bytes[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    let error = gpu.open(&gone).unwrap_err().to_string();
    assert!(error.contains("is gone or its memory is freed"), "{error}");
    gpu.fail_next_open();
    let mut other = handle;
    other.bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(gpu.open(&other).unwrap_err().to_string().contains("injected"));
}
