//! GPU memory as an engine meets it today, on the simulated provider (where
//! device memory is mapped with no access: a host thread touching it would
//! crash this test): registration classifies every range, and no transport
//! ever copies device memory on a host thread.

mod common;

use kvring::gpu::{Copy, Gpu, SimGpu};
use kvring::{Batch, BlockDesc, Outcome, RegionInfo, TransportKind};
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(5);

fn sim() -> Arc<SimGpu> {
    Arc::new(SimGpu::new(2, Duration::from_millis(1)))
}

#[test]
fn registration_tells_device_memory_from_host_memory() {
    let gpu = sim();
    let engine = common::builder("gpu-0").gpu(gpu.clone()).build().unwrap();
    let device = gpu.alloc(0, 1 << 20).unwrap();
    let mut host = vec![0u8; 1 << 16];

    // A CUDA tensor's address handed to a host API: refused, saying how.
    // SAFETY: refused before anything is kept.
    let error = unsafe { engine.register(device.0 as *mut u8, 1 << 20, RegionInfo::raw()) }.unwrap_err();
    assert!(error.to_string().contains("is memory of GPU 0, registered as host memory"), "{error}");
    assert!(error.to_string().contains("RegionInfo::on_gpu(0)"), "{error}");
    // SAFETY: refused.
    let error = unsafe { engine.register(host.as_mut_ptr(), host.len(), RegionInfo::raw().on_gpu(0)) }.unwrap_err();
    assert!(error.to_string().contains("is host memory, registered as GPU 0's"), "{error}");
    // SAFETY: refused.
    let error = unsafe { engine.register(device.0 as *mut u8, 1 << 20, RegionInfo::raw().on_gpu(1)) }.unwrap_err();
    assert!(error.to_string().contains("is memory of GPU 0, registered as GPU 1's"), "{error}");
    // SAFETY: refused.
    let error = unsafe { engine.register(device.0 as *mut u8, 2 << 20, RegionInfo::raw().on_gpu(0)) }.unwrap_err();
    assert!(error.to_string().contains("runs past its allocation"), "{error}");

    // Told right, both register.
    // SAFETY: the allocation and `host` outlive the engine's use of them.
    let on_gpu = unsafe { engine.register(device.0 as *mut u8, 1 << 20, RegionInfo::raw().on_gpu(0)) }.unwrap();
    // SAFETY: as above.
    let on_host = unsafe { engine.register(host.as_mut_ptr(), host.len(), RegionInfo::raw()) }.unwrap();
    assert_ne!(on_gpu, on_host);
    assert!(engine.alloc_region(4096, RegionInfo::raw().on_gpu(0)).is_err(), "alloc_region is host memory");
    drop(engine);
    // SAFETY: the engine that registered it is gone.
    unsafe { gpu.free(device).unwrap() };
}

#[test]
fn without_a_gpu_provider_a_gpu_region_is_refused() {
    if kvring::host::gpus().is_ok() {
        return; // a host with a CUDA driver classifies for real
    }
    let engine = common::engine("gpu-none");
    let mut host = vec![0u8; 4096];
    // SAFETY: refused.
    let error = unsafe { engine.register(host.as_mut_ptr(), 4096, RegionInfo::raw().on_gpu(0)) }.unwrap_err();
    assert!(error.to_string().contains("no GPU provider"), "{error}");
}

#[test]
fn no_transport_copies_device_memory_on_a_host_thread() {
    let gpu = sim();
    let target = common::builder("gpu-target").gpu(gpu.clone()).build().unwrap();
    let initiator = common::builder("gpu-initiator").gpu(gpu.clone()).build().unwrap();
    let device = gpu.alloc(0, 1 << 20).unwrap();
    // The bytes a device region holds, written by the copy engine only.
    let source = common::pattern(4096, 5);
    let stream = gpu.create_stream(0).unwrap();
    // SAFETY: `source` outlives the wait below.
    unsafe { gpu.copy_batch(stream, &[Copy { src: source.as_ptr() as u64, dst: device.0, len: 4096 }]).unwrap() };
    let event = gpu.record(stream).unwrap();
    while !gpu.query(event).unwrap() {
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: the allocation outlives both engines.
    let on_gpu = unsafe { initiator.register(device.0 as *mut u8, 1 << 20, RegionInfo::raw().on_gpu(0)) }.unwrap();
    let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let mut sub = initiator.submitter().unwrap();
    for transport in [TransportKind::Shm, TransportKind::Tcp] {
        let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
        for batch in [Batch::write(&segment), Batch::read(&segment)] {
            let desc = [BlockDesc::new(on_gpu, 0, remote.id(), 0, 4096)];
            let id = sub.submit(&batch.descs(&desc)).unwrap();
            match sub.wait(id, WAIT).unwrap() {
                Outcome::Failed(error) => assert!(error.to_string().contains("moving GPU memory"), "{error}"),
                other => panic!("{transport:?}: {other:?}"),
            }
        }
    }

    // The other way: a peer writing into this engine's GPU region over tcp
    // is refused by the target before its thread touches a byte.
    let gpu_target = common::builder("gpu-holder").gpu(gpu.clone()).build().unwrap();
    let other = gpu.alloc(1, 1 << 16).unwrap();
    // SAFETY: the allocation outlives the engine.
    let theirs = unsafe { gpu_target.register(other.0 as *mut u8, 1 << 16, RegionInfo::raw().on_gpu(1)) }.unwrap();
    let local = initiator.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    let segment =
        initiator.open_segment_with(&gpu_target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let desc = [BlockDesc::new(local.id(), 0, theirs, 0, 4096)];
    let id = sub.submit(&Batch::write(&segment).descs(&desc)).unwrap();
    match sub.wait(id, WAIT).unwrap() {
        // The target's reply carries the code, not its words.
        Outcome::Failed(error) => assert!(error.to_string().contains("answered UNSUPPORTED"), "{error}"),
        other => panic!("{other:?}"),
    }
    let error = segment.remote_checksum(theirs, 0, 4096, WAIT).unwrap_err();
    assert!(error.to_string().contains("GPU memory"), "{error}");
}
