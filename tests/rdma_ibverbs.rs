//! The real verbs provider, `IbVerbs`, over the fake libibverbs of
//! `tests/fakes/ibverbs` (loaded by the same `dlopen("libibverbs.so.1")`
//! production uses). `.ci/stage-fakeverbs.sh` builds the fake and runs this
//! file with `LD_LIBRARY_PATH` pointing at it, `FAKE_IBVERBS_REQUIRED=1`
//! and the devices below; run without the fake, each test says so and
//! returns (and fails when the stage asked for the fake).
//!
//! Devices (`FAKE_IBVERBS_DEVICES`, set by the stage):
//! `fakeroce0:eth:4096:active,fakeroce1:eth:1024:active,fakeib0:ib:4096:active,fakedown0:eth:4096:down`.

mod common;

use common::{pattern, WAIT};
use kvring::rdma::{
    IbVerbs, LinkLayer, MrAccess, PostFailure, QpCaps, QpEndpoint, QpTransition, SendWr, Verbs, Wc, WcStatus, WrOp,
};
use kvring::{Batch, BlockDesc, Engine, Outcome, RegionInfo, TransportKind};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The provider over the fake, or `None` (with the reason printed) when
/// the fake is not on the library path.
fn fake() -> Option<IbVerbs> {
    let verbs = IbVerbs::new();
    let listed = verbs.devices().map(|d| d.iter().any(|d| d.name.starts_with("fakeroce"))).unwrap_or(false);
    if listed {
        return Some(verbs);
    }
    let why = "the fake libibverbs is not on LD_LIBRARY_PATH (run .ci/stage-fakeverbs.sh)";
    assert!(std::env::var_os("FAKE_IBVERBS_REQUIRED").is_none(), "{why}");
    eprintln!("skipped: {why}");
    None
}

fn engine(name: &str, devices: &[&str]) -> Engine {
    common::builder(name).rdma(Arc::new(IbVerbs::new())).rdma_devices(devices.iter().copied()).build().unwrap()
}

#[test]
fn devices_ports_link_layers_and_gids_come_from_verbs_queries() {
    let Some(verbs) = fake() else { return };
    let devices = verbs.devices().unwrap();
    let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, ["fakedown0", "fakeib0", "fakeroce0", "fakeroce1"], "natural order");
    let roce = &devices[2].ports[0];
    assert!(roce.active && roce.link_layer == LinkLayer::Ethernet && roce.mtu == 4096);
    // A ConnectX-like table: link-local and IPv4-mapped, each RoCE v1 and
    // v2, the types from _ibv_query_gid_ex (no sysfs tree here).
    let kinds: Vec<(u8, bool, bool)> = roce.gids.iter().map(|(i, g, v2)| (*i, g[10] == 0xff, *v2)).collect();
    assert_eq!(kinds, [(0, false, false), (1, false, true), (2, true, false), (3, true, true)]);
    let ib = &devices[1].ports[0];
    assert_eq!((ib.link_layer, ib.lid), (LinkLayer::InfiniBand, 3), "IB ports have a LID");
    assert_eq!(devices[3].ports[0].mtu, 1024);
    assert!(!devices[0].ports[0].active);
}

#[test]
fn blocks_move_both_ways_through_engines_on_the_real_provider() {
    if fake().is_none() {
        return;
    }
    let target = engine("ib-decode", &["fakeroce0"]);
    let remote = target.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    let initiator = engine("ib-prefill", &["fakeroce0"]);
    let local = initiator.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(9) };
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    assert_eq!(segment.transport(), TransportKind::Rdma);
    let mut descs: Vec<BlockDesc> =
        (0..64).map(|i| BlockDesc::new(local.id(), i * 8192, remote.id(), i * 8192, 4096)).collect();
    descs.push(BlockDesc::new(local.id(), 1 << 20, remote.id(), 1 << 20, 3 << 20));
    // Small blocks (inline-sized) too.
    descs.extend((0..8).map(|i| BlockDesc::new(local.id(), 600_000 + i * 64, remote.id(), 600_000 + i * 64, 48)));
    let mut sub = initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    let source = pattern(4 << 20, 9);
    let mut got = vec![0u8; 4 << 20];
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { remote.read_at(0, &mut got).unwrap() };
    for i in 0..64usize {
        assert_eq!(got[i * 8192..i * 8192 + 4096], source[i * 8192..i * 8192 + 4096]);
    }
    assert_eq!(got[1 << 20..], source[1 << 20..]);
    for i in 0..8 {
        let at = 600_000 + i * 64;
        assert_eq!(got[at..at + 48], source[at..at + 48], "small block {i}");
    }
    // READ back.
    let back = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let reads: Vec<BlockDesc> =
        (0..16).map(|i| BlockDesc::new(back.id(), i * 4096, remote.id(), (1 << 20) + i * 4096, 4096)).collect();
    let id = sub.submit(&Batch::read(&segment).descs(&reads)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    let mut read = vec![0u8; 65536];
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { back.read_at(0, &mut read).unwrap() };
    assert_eq!(read, source[1 << 20..(1 << 20) + 65536]);
    // More WRs than a send queue holds.
    let many: Vec<BlockDesc> =
        (0..2000).map(|i| BlockDesc::new(local.id(), i * 2048, remote.id(), i * 2048, 1024)).collect();
    let id = sub.submit(&Batch::write(&segment).descs(&many)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(matches!(outcome, Outcome::Done { bytes } if bytes == 2000 * 1024), "{outcome:?}");
}

#[test]
fn a_named_device_that_is_missing_or_down_is_refused_by_name() {
    if fake().is_none() {
        return;
    }
    let error = common::builder("ib-missing").rdma(Arc::new(IbVerbs::new())).rdma_devices(["mlx5_9"]).build();
    let error = error.unwrap_err().to_string();
    assert!(error.contains("mlx5_9") && error.contains("no such RDMA device"), "{error}");
    let error = common::builder("ib-down").rdma(Arc::new(IbVerbs::new())).rdma_devices(["fakedown0"]).build();
    let error = error.unwrap_err().to_string();
    assert!(error.contains("fakedown0") && error.contains("no active port"), "{error}");
}

/// One device opened with a PD, a CQ and an RTS QP connected to `peer` (or
/// to itself), and a registered buffer.
struct Side {
    verbs: IbVerbs,
    context: kvring::rdma::Context,
    pd: kvring::rdma::Pd,
    cq: kvring::rdma::Cq,
    qp: kvring::rdma::Qp,
    endpoint: QpEndpoint,
}

fn side(device: &str, gid_index: u8, max_send_wr: u32) -> Side {
    let verbs = IbVerbs::new();
    let context = verbs.open(device).unwrap();
    let pd = verbs.alloc_pd(context).unwrap();
    let cq = verbs.create_cq(context, 256).unwrap();
    let caps = QpCaps { max_send_wr, max_inline: 64, port: 1, gid_index, srq: None };
    let (qp, endpoint) = verbs.create_qp(pd, cq, caps).unwrap();
    Side { verbs, context, pd, cq, qp, endpoint }
}

fn connect(a: &Side, b: &QpEndpoint) -> kvring::Result<()> {
    a.verbs.modify_qp(a.qp, QpTransition::Init)?;
    a.verbs.modify_qp(a.qp, QpTransition::ReadyToReceive(*b))?;
    a.verbs.modify_qp(a.qp, QpTransition::ReadyToSend)
}

fn poll_one(side: &Side) -> Wc {
    let mut wcs = [Wc::new(0, WcStatus::Success); 1];
    let started = Instant::now();
    loop {
        if side.verbs.poll_cq(side.cq, &mut wcs).unwrap() == 1 {
            return wcs[0];
        }
        assert!(started.elapsed() < Duration::from_secs(10), "no completion");
    }
}

fn write(wr_id: u64, local: &kvring::rdma::Mr, remote_addr: u64, rkey: u32, len: u32) -> SendWr {
    SendWr {
        wr_id,
        op: WrOp::Write,
        local_addr: local.addr,
        len,
        lkey: local.lkey,
        remote_addr,
        rkey,
        signaled: true,
        inline: false,
    }
}

#[test]
fn writes_without_remote_write_outside_the_region_or_with_a_stale_key_fail_and_flush() {
    if fake().is_none() {
        return;
    }
    let a = side("fakeroce0", 1, 64);
    let b = side("fakeroce0", 1, 64);
    connect(&a, &b.endpoint).unwrap();
    connect(&b, &a.endpoint).unwrap();
    let source = vec![3u8; 8192];
    let mut target = vec![0u8; 8192];
    // SAFETY: both buffers outlive their registrations (deregistered below).
    let (mr_a, read_only, writable) = unsafe {
        let read = MrAccess { local_write: false, remote_write: false, remote_read: true, relaxed_ordering: false };
        (
            a.verbs.reg_mr(a.pd, source.as_ptr() as u64, 8192, MrAccess::ALL).unwrap(),
            b.verbs.reg_mr(b.pd, target.as_mut_ptr() as u64, 4096, read).unwrap(),
            b.verbs.reg_mr(b.pd, target.as_mut_ptr() as u64 + 4096, 4096, MrAccess::ALL).unwrap(),
        )
    };
    // ibv_reg_mr(3): an MR without REMOTE_WRITE refuses a peer's WRITE.
    a.verbs.post_send(a.qp, &[write(1, &mr_a, read_only.addr, read_only.rkey, 64)]).unwrap();
    assert_eq!(poll_one(&a), Wc::new(1, WcStatus::RemoteAccess));
    // The QP is in ERR now: later WRs are flushed, signalled or not.
    a.verbs.post_send(a.qp, &[write(2, &mr_a, writable.addr, writable.rkey, 64)]).unwrap();
    assert_eq!(poll_one(&a), Wc::new(2, WcStatus::Flushed));
    assert_eq!(target, vec![0u8; 8192], "nothing was written");
    // Reset and reconnect; a WRITE past the region's end is refused.
    a.verbs.modify_qp(a.qp, QpTransition::Reset).unwrap();
    connect(&a, &b.endpoint).unwrap();
    a.verbs.post_send(a.qp, &[write(3, &mr_a, writable.addr + 4000, writable.rkey, 200)]).unwrap();
    assert_eq!(poll_one(&a), Wc::new(3, WcStatus::RemoteAccess));
    // A stale rkey after dereg is refused.
    a.verbs.modify_qp(a.qp, QpTransition::Reset).unwrap();
    connect(&a, &b.endpoint).unwrap();
    a.verbs.post_send(a.qp, &[write(4, &mr_a, writable.addr, writable.rkey, 64)]).unwrap();
    assert_eq!(poll_one(&a), Wc::new(4, WcStatus::Success));
    assert_eq!(target[4096..4160], [3u8; 64]);
    b.verbs.dereg_mr(writable.handle).unwrap();
    a.verbs.post_send(a.qp, &[write(5, &mr_a, writable.addr + 64, writable.rkey, 64)]).unwrap();
    assert_eq!(poll_one(&a), Wc::new(5, WcStatus::RemoteAccess));
    assert_eq!(target[4160..4224], [0u8; 64]);
    for s in [&a, &b] {
        s.verbs.destroy_qp(s.qp).unwrap();
        s.verbs.destroy_cq(s.cq).unwrap();
    }
    a.verbs.dereg_mr(mr_a.handle).unwrap();
    b.verbs.dereg_mr(read_only.handle).unwrap();
    for s in [&a, &b] {
        s.verbs.dealloc_pd(s.pd).unwrap();
        s.verbs.close(s.context).unwrap();
        assert!(s.verbs.counts().balanced());
    }
}

#[test]
fn a_qp_not_ready_to_send_is_an_error_and_a_full_send_queue_is_queue_full() {
    if fake().is_none() {
        return;
    }
    let a = side("fakeroce0", 1, 8);
    let b = side("fakeroce0", 1, 8);
    let buffer = vec![1u8; 4096];
    // SAFETY: `buffer` outlives the registration.
    let mr = unsafe { a.verbs.reg_mr(a.pd, buffer.as_ptr() as u64, 4096, MrAccess::ALL) }.unwrap();
    let mut remote = vec![0u8; 4096];
    // SAFETY: `remote` outlives the registration.
    let rmr = unsafe { b.verbs.reg_mr(b.pd, remote.as_mut_ptr() as u64, 4096, MrAccess::ALL) }.unwrap();
    // ibv_modify_qp(3): RESET -> RTS is no transition.
    assert!(a.verbs.modify_qp(a.qp, QpTransition::ReadyToSend).is_err());
    // ibv_post_send(3) outside RTS: refused, and not as a full queue.
    let error = a.verbs.post_send(a.qp, &[write(1, &mr, rmr.addr, rmr.rkey, 8)]).unwrap_err();
    assert!(matches!(error.error, PostFailure::Invalid(_)), "{error:?}");
    connect(&a, &b.endpoint).unwrap();
    connect(&b, &a.endpoint).unwrap();
    // Unsignalled WRs hold their slots: the 9th of 8 finds the queue full.
    let unsignalled = |i| SendWr { signaled: false, ..write(i, &mr, rmr.addr, rmr.rkey, 8) };
    let wrs: Vec<SendWr> = (0..9).map(unsignalled).collect();
    let error = a.verbs.post_send(a.qp, &wrs).unwrap_err();
    assert_eq!((error.posted, error.error), (8, PostFailure::QueueFull));
    // No completion frees them until a signalled one is polled; none can be
    // posted, so the queue stays full.
    assert_eq!(a.verbs.post_send(a.qp, &wrs[..1]).unwrap_err().error, PostFailure::QueueFull);
    drop(remote);
}

#[test]
fn the_path_mtu_is_the_smaller_port_mtu_and_the_rd_atomic_depth_fits_the_device() {
    if fake().is_none() {
        return;
    }
    // fakeroce1's port runs 1024-byte MTU; fakeroce0's 4096.
    let small = side("fakeroce1", 1, 16);
    let large = side("fakeroce0", 1, 16);
    assert_eq!((small.endpoint.mtu, large.endpoint.mtu), (1024, 4096));
    connect(&small, &large.endpoint).expect("path MTU clamped to this port's 1024");
    connect(&large, &small.endpoint).unwrap();
    let source = pattern(1 << 20, 4);
    let mut target = vec![0u8; 1 << 20];
    // SAFETY: both outlive their registrations for the test's length.
    let (mr, rmr) = unsafe {
        (
            small.verbs.reg_mr(small.pd, source.as_ptr() as u64, 1 << 20, MrAccess::ALL).unwrap(),
            large.verbs.reg_mr(large.pd, target.as_mut_ptr() as u64, 1 << 20, MrAccess::ALL).unwrap(),
        )
    };
    // Both directions carry a 1 MiB message (many packets of the path MTU).
    small.verbs.post_send(small.qp, &[write(7, &mr, rmr.addr, rmr.rkey, 1 << 20)]).unwrap();
    assert_eq!(poll_one(&small), Wc::new(7, WcStatus::Success));
    assert_eq!(target, source);
    large.verbs.post_send(large.qp, &[write(8, &rmr, mr.addr, mr.rkey, 1 << 20)]).unwrap();
    assert_eq!(poll_one(&large), Wc::new(8, WcStatus::Success));
}

#[test]
fn the_gid_index_defaults_to_roce_v2_ipv4_mapped_and_a_configured_one_must_exist() {
    if fake().is_none() {
        return;
    }
    let built = |index: Option<u8>| {
        let builder = common::builder("ib-gid").rdma(Arc::new(IbVerbs::new())).rdma_devices(["fakeroce0"]);
        match index {
            Some(index) => builder.rdma_gid_index(index),
            None => builder,
        }
        .build()
    };
    // Index 9 is inside the 16-entry table but empty; 200 is past it.
    for index in [9, 200] {
        let error = built(Some(index)).unwrap_err().to_string();
        assert!(error.contains(&format!("GID index {index} is out of range")), "{error}");
        assert!(error.contains("fakeroce0") && error.contains("3 (::ffff:127.0.0.1 RoCE v2)"), "{error}");
    }
    // The default and a configured valid index both connect and move bytes.
    for index in [None, Some(1)] {
        let target = built(index).unwrap();
        let remote = target.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
        let initiator = built(index).unwrap();
        let local = initiator.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
        // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
        unsafe { local.fill_pattern(5) };
        let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
        assert_eq!(segment.transport(), TransportKind::Rdma);
        let mut sub = initiator.submitter().unwrap();
        let id =
            sub.submit(&Batch::write(&segment).block(BlockDesc::new(local.id(), 0, remote.id(), 0, 8192))).unwrap();
        assert!(sub.wait(id, WAIT).unwrap().is_done(), "gid index {index:?}");
    }
}

#[test]
fn an_empty_gid_or_one_past_the_table_is_refused_by_index() {
    if fake().is_none() {
        return;
    }
    let b = side("fakeroce0", 3, 8);
    // kvring queries the GID at every QP and refuses an empty entry by index.
    let caps = QpCaps { max_send_wr: 8, max_inline: 0, port: 1, gid_index: 9, srq: None };
    let error = b.verbs.create_qp(b.pd, b.cq, caps).unwrap_err().to_string();
    assert!(error.contains("GID index 9 of port 1 is empty"), "{error}");
    // Past the table, ibv_query_gid(3) itself refuses.
    let error = b.verbs.create_qp(b.pd, b.cq, QpCaps { gid_index: 16, ..caps }).unwrap_err().to_string();
    assert!(error.contains("GID index 16 failed"), "{error}");
    connect(&b, &b.endpoint).expect("a valid RoCE v2 GID index");
}

/// `kvring info` with the fake's devices `devices` and the sysfs tree
/// `sysfs`: its `rdma:` line.
fn info_rdma_line(devices: &str, sysfs: &std::path::Path) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvring"))
        .arg("info")
        .env("FAKE_IBVERBS_DEVICES", devices)
        .env("KVRING_RDMA_SYSFS_ROOT", sysfs)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    text.lines().find(|l| l.starts_with("rdma:")).unwrap_or_else(|| panic!("no rdma line: {text}")).to_string()
}

#[test]
fn kvring_info_lists_the_devices_ports_link_layers_gids_and_numa_nodes_from_verbs_and_sysfs() {
    if fake().is_none() {
        return;
    }
    // A sysfs tree for what verbs do not say: fakeroce0's NUMA node.
    let sysfs = std::env::temp_dir().join(format!("kvring-info-sysfs-{}", std::process::id()));
    std::fs::create_dir_all(sysfs.join("fakeroce0/device")).unwrap();
    std::fs::write(sysfs.join("fakeroce0/device/numa_node"), "1\n").unwrap();
    let line = info_rdma_line("fakeroce0:eth:4096:active,fakeib0:ib:2048:active,fakedown0:eth:4096:down", &sysfs);
    let none = info_rdma_line("", &sysfs);
    let _ = std::fs::remove_dir_all(&sysfs);
    assert!(line.contains("fakeroce0 (numa 1; port 1 active Ethernet mtu 4096 lid 0 gid 3 ["), "{line}");
    assert!(line.contains("3=::ffff:127.0.0.1 v2]"), "the GID table with types: {line}");
    assert!(line.contains("fakeib0 (numa ?; port 1 active InfiniBand mtu 2048 lid 2 gid 0 [0=fe80::2]"), "{line}");
    assert!(line.contains("fakedown0 (numa ?; port 1 down Ethernet"), "{line}");
    assert!(line.find("fakedown0") < line.find("fakeib0") && line.find("fakeib0") < line.find("fakeroce0"));
    assert_eq!(none, "rdma:             no RDMA device (libibverbs lists none)");
}

/// tests/rdma_gpu.rs's tagged push, host memory only (the fake has no
/// dma-buf or peer-memory registration of GPU memory): WRITE_WITH_IMMs
/// consume the target's SRQ receives, complete on its passive CQ with the
/// tag and byte count, and are counted; the receives are posted again.
#[test]
fn a_tagged_push_is_counted_on_the_target_through_its_shared_receive_queue() {
    if fake().is_none() {
        return;
    }
    let target = engine("tag-decode", &["fakeroce0"]);
    let remote = target.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    let initiator = engine("tag-prefill", &["fakeroce0"]);
    let local = initiator.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(3) };
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let tag = kvring::kv::arrival_tag(7, 3).unwrap();
    let small: Vec<_> = (0..64u64).map(|i| BlockDesc::new(local.id(), i * 8192, remote.id(), i * 8192, 4096)).collect();
    let big = [BlockDesc::new(local.id(), 1 << 20, remote.id(), 1 << 20, 3 << 20)];
    let mut expected = 0;
    // More tagged writes than the SRQ holds receives, over several rounds:
    // a receive that was not posted again would stall them (RNR).
    for _ in 0..80 {
        for descs in [&small[..], &big[..]] {
            let id = sub.submit(&Batch::write(&segment).descs(descs).arrival_tag(tag)).unwrap();
            expected += descs.iter().map(|d| d.len).sum::<u64>();
            target.wait_landed(tag, expected, WAIT).unwrap();
            assert!(sub.wait(id, WAIT).unwrap().is_done());
        }
    }
    assert_eq!(target.landed(tag), expected);
    let mut got = vec![0u8; 3 << 20];
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { remote.read_at(1 << 20, &mut got).unwrap() };
    assert_eq!(got, pattern(4 << 20, 3)[1 << 20..]);
    assert_eq!(target.forget_arrival(tag), expected);
    assert_eq!(target.arrivals_dropped(), 0);
}

#[test]
fn the_c_abi_reaches_the_gid_index_by_name() {
    if fake().is_none() {
        return;
    }
    // tests/c/config.c's "rdma" mode: index 9 (empty in the fake's table)
    // refused by index, index 1 used, both through kvring_config_set.
    let program = common::c::compile("config.c");
    let output = std::process::Command::new(&program).arg("rdma").output().unwrap();
    let _ = std::fs::remove_file(&program);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(stdout.trim(), "config rdma ok");
}
