//! No silent fallback: an engine's allow-list of transports, tested as a
//! user meets it, with real engines over real shm, cma and tcp in one
//! process. Each fallback path of the transport order (shm not offered ->
//! cma; cma refused -> tcp; GPU memory with no GPU provider here -> staged
//! tcp; no RDMA -> the host order) is taken by default, and refused with
//! the reason when the allow-list excludes the fallback; every batch
//! reports the transport that carried it, and the metrics count its bytes
//! under that transport.

mod common;

use common::WAIT;
use kvring::gpu::{Gpu, SimGpu};
use kvring::{Batch, BlockDesc, Engine, Error, RegionId, RegionInfo, Segment, TransportKind};
use std::sync::Arc;
use std::time::Duration;

const LEN: usize = 8192;

/// A target whose only region is memory it owns (no peer can map it):
/// cma reaches it where the target allows it, else tcp.
fn caller_memory_target(name: &str, cma: bool) -> (Engine, RegionId, Box<[u8]>) {
    let target = common::builder(name).cma(cma).build().unwrap();
    let mut memory = vec![0u8; LEN].into_boxed_slice();
    // SAFETY: `memory` outlives the engine's use of it: the caller drops
    // the engine first (tests return the three together).
    let id = unsafe { target.register(memory.as_mut_ptr(), memory.len(), RegionInfo::raw()) }.unwrap();
    (target, id, memory)
}

fn addr(engine: &Engine) -> String {
    engine.control_addr().to_string()
}

/// The refusal's parts, or a panic naming what came instead.
fn refused(result: kvring::Result<Segment>) -> (Vec<&'static str>, Vec<(&'static str, String)>, String) {
    match result {
        Err(error @ Error::TransportRefused { .. }) => {
            let message = error.to_string();
            let Error::TransportRefused { offered, reasons, .. } = error else { unreachable!() };
            (offered, reasons, message)
        }
        Err(other) => panic!("expected TransportRefused, got {other}"),
        Ok(segment) => panic!("expected a refusal, got a link over {}", segment.transport().name()),
    }
}

fn reason<'a>(reasons: &'a [(&'static str, String)], kind: TransportKind) -> &'a str {
    reasons
        .iter()
        .find(|(k, _)| *k == kind.name())
        .map(|(_, why)| why.as_str())
        .unwrap_or_else(|| panic!("no reason for {kind:?} in {reasons:?}"))
}

/// Writes `LEN` bytes of `seed`'s pattern to `remote` and returns the
/// transport the batch reported, checked three ways: before it is consumed,
/// in its completion, and in the metrics' bytes for that transport.
fn write_reporting(initiator: &Engine, segment: &Segment, remote: RegionId, seed: u64) -> TransportKind {
    let local = initiator.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(seed) };
    let mut sub = initiator.submitter().unwrap();
    let descs = [BlockDesc::new(local.id(), 0, remote, 0, LEN as u64)];
    let id = sub.submit(&Batch::write(segment).descs(&descs).user_data(seed)).unwrap();
    let while_running = sub.transport(id).unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    let done = loop {
        if let Some(done) = sub.reap() {
            break done;
        }
        assert!(std::time::Instant::now() < deadline, "the batch did not end");
        std::thread::sleep(Duration::from_micros(100));
    };
    assert_eq!((done.id, done.user_data), (id, seed));
    assert!(done.outcome.is_done(), "{:?}", done.outcome);
    assert_eq!(done.transport, while_running, "the completion and the status agree");
    assert_eq!(done.transport, segment.transport(), "the segment's link carried it");
    assert!(matches!(sub.transport(id), Err(Error::StaleBatch { .. } | Error::UnknownBatch { .. })));
    let metrics = initiator.metrics_text();
    let line = format!("kvring_bytes_total{{op=\"write\",transport=\"{}\"}} {LEN}", done.transport.name());
    assert!(metrics.contains(&line), "{line} missing from\n{metrics}");
    done.transport
}

#[test]
fn shm_not_offered_falls_to_cma_and_an_allow_list_without_cma_refuses_with_the_reasons() {
    let (target, remote, memory) = caller_memory_target("cma-target", true);
    // Default: the peer offers no shm region, so cma carries the batch.
    let initiator = common::engine("any");
    let segment = initiator.open_segment(&addr(&target)).unwrap();
    assert_eq!(segment.transport(), TransportKind::Cma);
    assert_eq!(write_reporting(&initiator, &segment, remote, 7), TransportKind::Cma);

    // Only shm allowed: refused, naming what reaches the peer and why shm
    // does not.
    let only_shm = common::builder("only-shm").transports([TransportKind::Shm]).build().unwrap();
    let (offered, reasons, message) = refused(only_shm.open_segment(&addr(&target)));
    assert_eq!(offered, ["cma", "tcp"], "{message}");
    assert!(reason(&reasons, TransportKind::Shm).contains("none of its regions is shm-backed"), "{message}");
    assert!(message.contains("no allowed transport reaches cma-target: allowed shm"), "{message}");
    // Asking for the fallback by name does not get around the list.
    let (_, reasons, message) = refused(only_shm.open_segment_with(&addr(&target), Some(TransportKind::Cma), WAIT));
    assert!(reason(&reasons, TransportKind::Cma).contains("not in this engine's transports"), "{message}");
    drop((initiator, only_shm, target));
    assert_eq!(&memory[..], &common::pattern(LEN, 7)[..], "the cma write landed");
}

#[test]
fn cma_refused_falls_to_tcp_and_an_allow_list_without_tcp_refuses_with_the_reasons() {
    let (target, remote, memory) = caller_memory_target("no-cma-target", false);
    let initiator = common::engine("any");
    let segment = initiator.open_segment(&addr(&target)).unwrap();
    assert_eq!(segment.transport(), TransportKind::Tcp);
    assert_eq!(write_reporting(&initiator, &segment, remote, 8), TransportKind::Tcp);

    let same_host = common::builder("same-host").transports([TransportKind::Shm, TransportKind::Cma]).build().unwrap();
    let (offered, reasons, message) = refused(same_host.open_segment(&addr(&target)));
    assert_eq!(offered, ["tcp"], "{message}");
    assert!(reason(&reasons, TransportKind::Cma).contains("does not allow it"), "{message}");
    assert!(reason(&reasons, TransportKind::Shm).contains("none of its regions is shm-backed"), "{message}");
    drop((initiator, same_host, target));
    assert_eq!(&memory[..], &common::pattern(LEN, 8)[..], "the tcp write landed");
}

#[test]
fn gpu_memory_with_no_gpu_provider_here_goes_staged_over_tcp_or_is_refused() {
    let gpu = Arc::new(SimGpu::new(1, Duration::from_micros(100)));
    let target = common::builder("gpu-target").gpu(gpu.clone() as Arc<dyn Gpu>).build().unwrap();
    let remote = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    // This engine has no GPU provider (none given; no CUDA driver on the
    // machines this runs on), so cuda_ipc cannot open the peer's GPU
    // memory: tcp, which the target stages.
    let initiator = common::engine("host-only");
    let segment = initiator.open_segment(&addr(&target)).unwrap();
    assert_eq!(segment.transport(), TransportKind::Tcp);
    assert_eq!(write_reporting(&initiator, &segment, remote.id(), 9), TransportKind::Tcp);

    let no_staging = common::builder("no-staging")
        .transports([TransportKind::CudaIpc, TransportKind::Shm, TransportKind::Cma])
        .build()
        .unwrap();
    let (offered, reasons, message) = refused(no_staging.open_segment(&addr(&target)));
    assert_eq!(offered, ["tcp"], "{message}");
    assert!(reason(&reasons, TransportKind::CudaIpc).contains("no GPU provider"), "{message}");
    assert!(reason(&reasons, TransportKind::Shm).contains("has GPU memory"), "{message}");
    assert!(reason(&reasons, TransportKind::Cma).contains("has GPU memory"), "{message}");
}

#[test]
fn rdma_unavailable_is_refused_when_required_never_replaced_by_the_host_order() {
    let target = common::engine("rdma-target");
    let remote = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
    for initiator in [
        common::builder("rdma-only").require_transport(TransportKind::Rdma).build().unwrap(),
        common::builder("rdma-listed").transports([TransportKind::Rdma, TransportKind::Rdma]).build().unwrap(),
    ] {
        let (offered, reasons, message) = refused(initiator.open_segment(&addr(&target)));
        assert_eq!(offered, ["shm", "cma", "tcp"], "{message}");
        assert!(reason(&reasons, TransportKind::Rdma).contains("no RDMA device"), "{message}");
        assert_eq!(reasons.len(), 1, "{message}");
    }
    // The host order's own first choice, allowed, is taken.
    let initiator = common::builder("shm-or-tcp").transports([TransportKind::Tcp, TransportKind::Shm]).build().unwrap();
    let segment = initiator.open_segment(&addr(&target)).unwrap();
    assert_eq!(write_reporting(&initiator, &segment, remote.id(), 10), TransportKind::Shm);
}

#[test]
fn a_required_transport_carries_every_batch_and_only_its_bytes_are_counted() {
    let target = common::engine("tcp-target");
    let remote = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let initiator = common::builder("tcp-only").require_transport(TransportKind::Tcp).build().unwrap();
    // shm and cma both reach this peer; neither is taken.
    let segment = initiator.open_segment(&addr(&target)).unwrap();
    assert_eq!(write_reporting(&initiator, &segment, remote.id(), 11), TransportKind::Tcp);
    let metrics = initiator.metrics_text();
    for other in ["shm", "cma"] {
        assert!(metrics.contains(&format!("kvring_bytes_total{{op=\"write\",transport=\"{other}\"}} 0")), "{metrics}");
    }
    // Nor does the loopback segment get around it.
    let (_, reasons, message) = refused(initiator.open_self(TransportKind::Null));
    assert!(reason(&reasons, TransportKind::Null).contains("not in this engine's transports"), "{message}");
    assert_eq!(initiator.open_self(TransportKind::Tcp).unwrap().transport(), TransportKind::Tcp);
    let (_, reasons, message) = refused(initiator.open_segment_with(&addr(&target), Some(TransportKind::Shm), WAIT));
    assert!(reason(&reasons, TransportKind::Shm).contains("not in this engine's transports"), "{message}");
}

#[test]
fn the_allow_list_comes_from_kvring_toml_and_kvring_variables() {
    let dir = std::env::temp_dir().join(format!("kvring-fallback-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("kvring.toml");
    std::fs::write(&file, "version = 1\ntransports = [\"tcp\"]\n").unwrap();
    let target = common::engine("config-target");
    let _shm = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let from_file = kvring::config::Config::load(Some(&file), Vec::new()).unwrap();
    let engine = from_file.builder().pin(false).build().unwrap();
    assert_eq!(engine.open_segment(&addr(&target)).unwrap().transport(), TransportKind::Tcp);
    drop(engine);
    let env = vec![("KVRING_TRANSPORTS".to_string(), "cuda_ipc".to_string())];
    let from_env = kvring::config::Config::load(Some(&file), env).unwrap();
    let engine = from_env.builder().pin(false).build().unwrap();
    let (offered, _, message) = refused(engine.open_segment(&addr(&target)));
    assert_eq!(offered, ["shm", "cma", "tcp"], "{message}");
    assert!(message.contains("allowed cuda_ipc") && message.contains("no GPU provider"), "{message}");
    let _ = std::fs::remove_dir_all(&dir);
}
