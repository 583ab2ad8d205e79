//! The verbs path on the simulated provider: what a NIC checks, what it
//! moves, how it completes, and every fault it can throw; device memory
//! registered through a dma-buf or peer memory; WRITE_WITH_IMM into a
//! shared receive queue.

use kvring::gpu::{DmaBufRange, Gpu, SimGpu};
use kvring::rdma::SimVerbs;
use kvring::rdma::*;
use kvring::testing::rdma::{build, KeyedBlock, Keys, PostConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One side: a PD, a CQ, one MR over `memory`, one QP.
struct Side {
    context: Context,
    pd: Pd,
    cq: Cq,
    mr: Mr,
    qp: Qp,
    endpoint: QpEndpoint,
    memory: Vec<u8>,
}

fn side(sim: &SimVerbs, len: usize, access: MrAccess, depth: u32) -> Side {
    let context = sim.open("sim0").unwrap();
    let pd = sim.alloc_pd(context).unwrap();
    let cq = sim.create_cq(context, 256).unwrap();
    let memory = vec![0u8; len];
    // SAFETY: `memory` lives in the Side, which deregisters before dropping it.
    let mr = unsafe { sim.reg_mr(pd, memory.as_ptr() as u64, len as u64, access) }.unwrap();
    let caps = QpCaps { max_send_wr: depth, max_inline: 64, port: 1, gid_index: 1, srq: None };
    let (qp, endpoint) = sim.create_qp(pd, cq, caps).unwrap();
    Side { context, pd, cq, mr, qp, endpoint, memory }
}

fn connect(sim: &SimVerbs, a: &Side, b: &Side) {
    for (me, peer) in [(a, b), (b, a)] {
        sim.modify_qp(me.qp, QpTransition::Init).unwrap();
        sim.modify_qp(me.qp, QpTransition::ReadyToReceive(peer.endpoint)).unwrap();
        sim.modify_qp(me.qp, QpTransition::ReadyToSend).unwrap();
    }
}

fn teardown(sim: &SimVerbs, side: Side) {
    sim.destroy_qp(side.qp).unwrap();
    sim.dereg_mr(side.mr.handle).unwrap();
    sim.destroy_cq(side.cq).unwrap();
    sim.dealloc_pd(side.pd).unwrap();
    sim.close(side.context).unwrap();
}

fn wr(op: WrOp, local: &Side, local_off: u64, remote: &Side, remote_off: u64, len: u32, id: u64) -> SendWr {
    SendWr {
        wr_id: id,
        op,
        local_addr: local.mr.addr + local_off,
        len,
        lkey: local.mr.lkey,
        remote_addr: remote.mr.addr + remote_off,
        rkey: remote.mr.rkey,
        signaled: true,
        inline: false,
    }
}

fn poll_all(sim: &SimVerbs, cq: Cq) -> Vec<Wc> {
    let mut out = [Wc::new(0, WcStatus::Success); 64];
    let n = sim.poll_cq(cq, &mut out).unwrap();
    out[..n].to_vec()
}

struct SideKeys<'a>(&'a Side, &'a Side);

impl Keys for SideKeys<'_> {
    fn lkey(&self, _nic: usize, _region: u64) -> u32 {
        self.0.mr.lkey
    }
    fn rkey(&self, _nic: usize, _region: u64) -> u32 {
        self.1.mr.rkey
    }
}

#[test]
fn a_batch_of_writes_and_reads_moves_the_bytes_and_completes_selectively() {
    let sim = SimVerbs::new();
    let mut a = side(&sim, 1 << 20, MrAccess::ALL, 256);
    let b = side(&sim, 1 << 20, MrAccess::ALL, 256);
    connect(&sim, &a, &b);
    for (i, byte) in a.memory.iter_mut().enumerate() {
        *byte = (i % 251) as u8;
    }
    // 64 blocks of 4 KiB, every other one, so nothing coalesces.
    let blocks: Vec<KeyedBlock> = (0..64u64)
        .map(|i| KeyedBlock {
            local_addr: a.mr.addr + i * 8192,
            remote_addr: b.mr.addr + i * 8192,
            len: 4096,
            local_region: 0,
            remote_region: 0,
        })
        .collect();
    let config = PostConfig { signal_every: 16, ..PostConfig::default() };
    let mut out = vec![Vec::new()];
    assert_eq!(build(WrOp::Write, &blocks, &config, &SideKeys(&a, &b), |s| s, &mut out), 64);
    sim.post_send(a.qp, &out[0]).unwrap();
    let completions = poll_all(&sim, a.cq);
    assert_eq!(completions.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [15, 31, 47, 63], "selective signalling");
    assert!(completions.iter().all(|w| w.status == WcStatus::Success));
    assert_eq!(sim.outstanding(a.qp), Some(0), "polled signalled completions free the send queue");
    for i in 0..64usize {
        assert_eq!(b.memory[i * 8192..i * 8192 + 4096], a.memory[i * 8192..i * 8192 + 4096]);
        assert!(b.memory[i * 8192 + 4096..(i + 1) * 8192].iter().all(|&x| x == 0), "the gaps are untouched");
    }
    // READ back into another part of A.
    sim.post_send(a.qp, &[wr(WrOp::Read, &a, 512 * 1024, &b, 0, 4096, 99)]).unwrap();
    assert_eq!(poll_all(&sim, a.cq), [Wc::new(99, WcStatus::Success)]);
    assert_eq!(a.memory[512 * 1024..512 * 1024 + 4096], a.memory[..4096]);
    teardown(&sim, a);
    teardown(&sim, b);
    assert!(sim.counts().balanced());
}

#[test]
fn unregistered_keys_and_ranges_past_an_mr_fail_and_write_nothing() {
    let sim = SimVerbs::new();
    let a = side(&sim, 8192, MrAccess::ALL, 64);
    let read_only = MrAccess { local_write: true, remote_write: false, remote_read: true, relaxed_ordering: false };
    let b = side(&sim, 8192, read_only, 64);
    connect(&sim, &a, &b);
    let cases = [
        (SendWr { rkey: 0xdead, ..wr(WrOp::Write, &a, 0, &b, 0, 64, 1) }, WcStatus::RemoteAccess),
        (wr(WrOp::Write, &a, 0, &b, 8192 - 32, 64, 2), WcStatus::RemoteAccess), // past B's end
        (SendWr { lkey: 0xbeef, ..wr(WrOp::Write, &a, 0, &b, 0, 64, 3) }, WcStatus::LocalProtection),
        (wr(WrOp::Write, &a, 8192 - 32, &b, 0, 64, 4), WcStatus::LocalProtection), // past A's end
        (wr(WrOp::Write, &a, 0, &b, 0, 64, 5), WcStatus::RemoteAccess),            // B allows no remote write
    ];
    for (request, expected) in cases {
        // Each error moves the QP to the error state: reconnect between cases.
        sim.modify_qp(a.qp, QpTransition::Reset).unwrap();
        sim.modify_qp(a.qp, QpTransition::Init).unwrap();
        sim.modify_qp(a.qp, QpTransition::ReadyToReceive(b.endpoint)).unwrap();
        sim.modify_qp(a.qp, QpTransition::ReadyToSend).unwrap();
        let unsignalled = SendWr { signaled: false, ..request };
        let follow = wr(WrOp::Read, &a, 0, &b, 0, 64, 77);
        sim.post_send(a.qp, &[unsignalled, follow]).unwrap();
        let completions = poll_all(&sim, a.cq);
        assert_eq!(completions[0], Wc::new(request.wr_id, expected), "errors are always reported");
        assert_eq!(completions[1], Wc::new(77, WcStatus::Flushed), "and flush what follows");
    }
    assert!(b.memory.iter().all(|&x| x == 0), "nothing was written anywhere");
    // Posting on a QP that is not ready to send is refused at post.
    sim.modify_qp(a.qp, QpTransition::Reset).unwrap();
    let refused = sim.post_send(a.qp, &[wr(WrOp::Write, &a, 0, &b, 0, 64, 1)]).unwrap_err();
    assert!(matches!(refused.error, PostFailure::Invalid(ref why) if why.contains("not ready")), "{refused:?}");
    let oversized_inline = SendWr { inline: true, len: 4096, ..wr(WrOp::Write, &a, 0, &b, 0, 64, 1) };
    sim.modify_qp(a.qp, QpTransition::Init).unwrap();
    sim.modify_qp(a.qp, QpTransition::ReadyToReceive(b.endpoint)).unwrap();
    sim.modify_qp(a.qp, QpTransition::ReadyToSend).unwrap();
    let refused = sim.post_send(a.qp, &[oversized_inline]).unwrap_err();
    assert!(matches!(refused.error, PostFailure::Invalid(ref why) if why.contains("inline")), "{refused:?}");
}

#[test]
fn a_full_send_queue_takes_the_rest_after_a_poll_and_delayed_or_failed_completions_arrive() {
    let sim = SimVerbs::new();
    let a = side(&sim, 1 << 16, MrAccess::ALL, 4);
    let b = side(&sim, 1 << 16, MrAccess::ALL, 4);
    connect(&sim, &a, &b);
    sim.delay_completions(2);
    let wrs: Vec<SendWr> = (0..6).map(|i| wr(WrOp::Write, &a, i * 64, &b, i * 64, 64, i)).collect();
    let full = sim.post_send(a.qp, &wrs).unwrap_err();
    assert_eq!((full.posted, full.error), (4, PostFailure::QueueFull), "a chain is cut at the queue's depth");
    assert!(poll_all(&sim, a.cq).is_empty(), "delayed: not yet visible");
    let completions = poll_all(&sim, a.cq);
    assert_eq!(completions.len(), 4);
    sim.post_send(a.qp, &wrs[4..]).unwrap();
    sim.delay_completions(0);
    sim.fail_next(WcStatus::RetryExceeded);
    sim.post_send(a.qp, &[wr(WrOp::Write, &a, 0, &b, 0, 64, 42)]).unwrap();
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.extend(poll_all(&sim, a.cq));
    }
    assert!(seen.contains(&Wc::new(42, WcStatus::RetryExceeded)), "{seen:?}");
}

#[test]
fn a_peer_that_resets_its_qps_is_seen_as_retry_exceeded_and_reconnecting_works() {
    let sim = SimVerbs::new();
    let a = side(&sim, 1 << 16, MrAccess::ALL, 64);
    let b = side(&sim, 1 << 16, MrAccess::ALL, 64);
    connect(&sim, &a, &b);
    sim.reset_qp(b.qp);
    sim.post_send(a.qp, &[wr(WrOp::Write, &a, 0, &b, 0, 64, 1)]).unwrap();
    assert_eq!(poll_all(&sim, a.cq), [Wc::new(1, WcStatus::RetryExceeded)]);
    // The restart path: both QPs reset and re-handshaked.
    sim.modify_qp(a.qp, QpTransition::Reset).unwrap();
    connect(&sim, &a, &b);
    sim.post_send(a.qp, &[wr(WrOp::Write, &a, 0, &b, 0, 64, 2)]).unwrap();
    assert_eq!(poll_all(&sim, a.cq), [Wc::new(2, WcStatus::Success)]);
}

#[test]
fn a_device_that_disappears_is_a_clear_error_not_a_crash() {
    let sim = SimVerbs::new();
    let a = side(&sim, 4096, MrAccess::ALL, 8);
    sim.remove_device("sim0");
    let error = sim.alloc_pd(a.context).unwrap_err().to_string();
    assert!(error.contains("rdma device sim0: it is no longer present"), "{error}");
    assert!(sim.poll_cq(a.cq, &mut [Wc::new(0, WcStatus::Success); 1]).is_err());
    assert!(sim.open("sim0").unwrap_err().to_string().contains("no such device"));
}

#[test]
fn a_thousand_peer_restarts_leak_no_qp_mr_or_cq() {
    let sim = Arc::new(SimVerbs::new());
    let a = side(&sim, 1 << 16, MrAccess::ALL, 64);
    for round in 0..1000u64 {
        // The peer starts, is connected to, used, and goes away.
        let b = side(&sim, 4096, MrAccess::ALL, 64);
        sim.modify_qp(a.qp, QpTransition::Reset).unwrap();
        connect(&sim, &a, &b);
        sim.post_send(a.qp, &[wr(WrOp::Write, &a, 0, &b, 0, 64, round)]).unwrap();
        assert_eq!(poll_all(&sim, a.cq), [Wc::new(round, WcStatus::Success)]);
        teardown(&sim, b);
    }
    teardown(&sim, a);
    let counts = sim.counts();
    assert!(counts.balanced(), "{counts:?}");
    assert_eq!(counts.qps, (1001, 1001));
}

/// Reads `len` bytes of simulated device memory at `addr` through the GPU's
/// own copy engine (a host thread touching it would fault).
fn device_bytes(gpu: &SimGpu, addr: u64, len: usize) -> Vec<u8> {
    let out = vec![0u8; len];
    let copy = kvring::gpu::Copy { src: addr, dst: out.as_ptr() as u64, len: len as u64 };
    on_copy_engine(gpu, copy);
    out
}

/// Runs one copy on a stream of GPU 0 and waits for its event (bounded).
fn on_copy_engine(gpu: &SimGpu, copy: kvring::gpu::Copy) {
    let stream = gpu.create_stream(0).unwrap();
    let event = gpu.create_event(0).unwrap();
    // SAFETY: the host side outlives the copy, which is waited for below.
    unsafe { gpu.copy_one(stream, copy) }.unwrap();
    gpu.record(stream, event).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !gpu.query(event).unwrap() {
        assert!(Instant::now() < deadline, "the copy never completed");
        std::thread::yield_now();
    }
    gpu.destroy_event(event).unwrap();
    gpu.destroy_stream(stream).unwrap();
}

/// A QP over `memory` registered some other way (device memory).
fn qp_over(sim: &SimVerbs, context: Context, pd: Pd, mr: Mr, memory: Vec<u8>) -> Side {
    let cq = sim.create_cq(context, 256).unwrap();
    let caps = QpCaps { max_send_wr: 64, max_inline: 64, port: 1, gid_index: 1, srq: None };
    let (qp, endpoint) = sim.create_qp(pd, cq, caps).unwrap();
    Side { context, pd, cq, mr, qp, endpoint, memory }
}

#[test]
fn device_memory_registers_through_a_dmabuf_or_peer_memory_and_is_reached_through_the_gpus_own_pages() {
    let sim = SimVerbs::new();
    let gpu = Arc::new(SimGpu::new(1, Duration::ZERO));
    sim.attach_gpu(gpu.clone());
    let mut a = side(&sim, 1 << 20, MrAccess::ALL, 64);
    let device = gpu.alloc(0, 1 << 20).unwrap().0;
    let context = sim.open("sim0").unwrap();
    let pd = sim.alloc_pd(context).unwrap();

    // The device pointer as host memory, with no peer-memory module: a NIC
    // cannot pin it, and says so (nothing is ever dereferenced).
    // SAFETY: refused.
    let refused = unsafe { sim.reg_mr(pd, device, 1 << 20, MrAccess::ALL) }.unwrap_err().to_string();
    assert!(refused.contains("no peer-memory module") && refused.contains("dma-buf"), "{refused}");
    // A fabric that was never told of the GPU still refuses it: the range
    // is not mapped readable here.
    let blind = SimVerbs::new();
    let blind_pd = blind.alloc_pd(blind.open("sim0").unwrap()).unwrap();
    // SAFETY: refused.
    let refused = unsafe { blind.reg_mr(blind_pd, device, 4096, MrAccess::ALL) }.unwrap_err().to_string();
    assert!(refused.contains("bad address") && refused.contains("---"), "{refused}");

    // Through a dma-buf: the device address is the registration's address.
    let dmabuf = gpu.export_dmabuf(device, 1 << 20).unwrap();
    // SAFETY: the allocation outlives the registration (deregistered below).
    let whole = DmaBufRange { len: 1 << 20, ..dmabuf.range() };
    let mr = unsafe { sim.reg_dmabuf_mr(pd, whole, device, MrAccess::ALL) }.unwrap();
    assert_eq!((mr.addr, sim.mr_paths(device)), (device, vec![MrPath::DmaBuf]));
    let b = qp_over(&sim, context, pd, mr, Vec::new());
    connect(&sim, &a, &b);
    for (i, byte) in a.memory.iter_mut().enumerate() {
        *byte = (i % 241) as u8;
    }
    // Host to device, then device back to host elsewhere.
    sim.post_send(a.qp, &[wr(WrOp::Write, &a, 0, &b, 4096, 8192, 1)]).unwrap();
    assert_eq!(poll_all(&sim, a.cq), [Wc::new(1, WcStatus::Success)]);
    assert_eq!(device_bytes(&gpu, device + 4096, 8192), a.memory[..8192], "landed in the GPU's memory");
    sim.post_send(a.qp, &[wr(WrOp::Read, &a, 512 << 10, &b, 4096, 8192, 2)]).unwrap();
    assert_eq!(poll_all(&sim, a.cq), [Wc::new(2, WcStatus::Success)]);
    assert_eq!(a.memory[512 << 10..(512 << 10) + 8192], a.memory[..8192]);

    // With peer memory loaded, the device pointer registers as it is; the
    // NIC reaches the same pages.
    sim.peer_memory(true);
    // SAFETY: as above.
    let by_pointer = unsafe { sim.reg_mr(pd, device, 1 << 20, MrAccess::ALL) }.unwrap();
    assert_eq!(sim.mr_paths(device).len(), 2);
    assert!(sim.mr_paths(device).contains(&MrPath::PeerMemory));
    let through_peer = SendWr { rkey: by_pointer.rkey, ..wr(WrOp::Write, &a, 0, &b, 65536, 4096, 3) };
    sim.post_send(a.qp, &[through_peer]).unwrap();
    assert_eq!(poll_all(&sim, a.cq), [Wc::new(3, WcStatus::Success)]);
    assert_eq!(device_bytes(&gpu, device + 65536, 4096), a.memory[..4096]);

    // Relaxed ordering where the device refuses it, and no dma-buf support.
    sim.relaxed_ordering(false);
    let relaxed = MrAccess { relaxed_ordering: true, ..MrAccess::ALL };
    // SAFETY: refused.
    let refused = unsafe { sim.reg_mr(pd, device, 4096, relaxed) }.unwrap_err().to_string();
    assert!(refused.contains("relaxed ordering"), "{refused}");
    sim.dmabuf(false);
    // SAFETY: refused.
    let refused =
        unsafe { sim.reg_dmabuf_mr(pd, DmaBufRange { offset: 0, len: 4096, ..dmabuf.range() }, device, MrAccess::ALL) }
            .unwrap_err();
    assert!(refused.to_string().contains("not supported"), "{refused}");
    // Past the memory behind the dma-buf: refused, never mapped.
    sim.dmabuf(true);
    // SAFETY: refused.
    let past = unsafe {
        sim.reg_dmabuf_mr(pd, DmaBufRange { offset: 4096, len: 1 << 20, ..dmabuf.range() }, device, MrAccess::ALL)
    };
    assert!(past.unwrap_err().to_string().contains("run past"));

    sim.dereg_mr(by_pointer.handle).unwrap();
    teardown(&sim, b);
    teardown(&sim, a);
    // SAFETY: nothing uses the allocation any more.
    unsafe { gpu.free(kvring::gpu::DevicePtr(device)) }.unwrap();
    assert!(sim.counts().balanced(), "{:?}", sim.counts());
}

/// A side whose QP takes its receives from a shared receive queue of
/// `receives`, completing on a wakeable CQ of `cq_depth`.
fn receiving_side(sim: &SimVerbs, len: usize, receives: u32, cq_depth: u32) -> (Side, Srq, std::os::fd::RawFd) {
    let context = sim.open("sim0").unwrap();
    let pd = sim.alloc_pd(context).unwrap();
    let (cq, fd) = sim.create_wakeable_cq(context, cq_depth).unwrap();
    let srq = sim.create_srq(pd, receives).unwrap();
    let memory = vec![0u8; len];
    // SAFETY: `memory` lives in the Side, which deregisters before dropping it.
    let mr = unsafe { sim.reg_mr(pd, memory.as_ptr() as u64, len as u64, MrAccess::ALL) }.unwrap();
    let caps = QpCaps { max_send_wr: 64, max_inline: 64, port: 1, gid_index: 1, srq: Some(srq) };
    let (qp, endpoint) = sim.create_qp(pd, cq, caps).unwrap();
    (Side { context, pd, cq, mr, qp, endpoint, memory }, srq, fd)
}

fn readable(fd: std::os::fd::RawFd) -> bool {
    let mut poll = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd, no wait.
    unsafe { libc::poll(&mut poll, 1, 0) == 1 }
}

#[test]
fn write_with_imm_completes_a_receive_with_its_tag_after_the_bytes_land_and_waits_while_none_is_posted() {
    let sim = SimVerbs::new();
    let mut a = side(&sim, 1 << 16, MrAccess::ALL, 64);
    let (b, srq, wake) = receiving_side(&sim, 1 << 16, 4, 4);
    connect(&sim, &a, &b);
    a.memory.iter_mut().enumerate().for_each(|(i, byte)| *byte = (i % 199) as u8 + 1);
    sim.post_srq_recv(srq, &[100, 101]).unwrap();
    sim.arm_cq(b.cq).unwrap();
    assert!(!readable(wake));
    let imm = |tag, at, len, id| SendWr { op: WrOp::WriteImm(tag), ..wr(WrOp::Write, &a, at, &b, at, len, id) };
    let plain_after = wr(WrOp::Write, &a, 12288, &b, 12288, 512, 4);
    sim.post_send(a.qp, &[imm(7, 0, 4096, 1), imm(8, 4096, 64, 2), imm(9, 8192, 100, 3), plain_after]).unwrap();
    // Two receives: two writes landed and completed there, with their tags
    // and byte counts; the third waits for a receive, and the plain write
    // behind it waits too (an RC QP keeps order).
    let landed = poll_all(&sim, b.cq);
    let seen: Vec<_> = landed.iter().map(|w| (w.wr_id, w.byte_len, w.imm)).collect();
    assert_eq!(seen, [(100, 4096, Some(7)), (101, 64, Some(8))]);
    assert!(readable(wake), "the armed CQ woke its channel");
    sim.take_cq_events(b.cq).unwrap();
    assert!(!readable(wake));
    assert_eq!(b.memory[..4160], a.memory[..4160]);
    assert!(b.memory[8192..8292].iter().all(|&x| x == 0) && b.memory[12288..12800].iter().all(|&x| x == 0));
    assert_eq!(sim.parked(), 2);
    assert_eq!(poll_all(&sim, a.cq), [Wc::new(1, WcStatus::Success), Wc::new(2, WcStatus::Success)]);
    // A receive posted: the rest runs, in order.
    sim.post_srq_recv(srq, &[102]).unwrap();
    assert_eq!(sim.parked(), 0);
    assert_eq!(b.memory[8192..8292], a.memory[8192..8292]);
    assert_eq!(b.memory[12288..12800], a.memory[12288..12800]);
    let seen: Vec<_> = poll_all(&sim, b.cq).iter().map(|w| (w.wr_id, w.byte_len, w.imm)).collect();
    assert_eq!(seen, [(102, 100, Some(9))]);
    // The shared receive queue holds no more than its depth.
    let full = sim.post_srq_recv(srq, &[1, 2, 3, 4, 5]).unwrap_err();
    assert!(full.to_string().contains("it is full"), "{full}");
    // A receive completion still on the CQ when its QP is reset is dropped
    // with the receive it consumed: mlx5 frees only the WQE's slot
    // (cq.c free_res_cqe → mlx5_free_srq_wqe), so the queue takes a new
    // receive but holds one less until someone posts it (kvring moves such
    // a QP to ERR and drains the CQ first: VERBS-REVIEW finding 4).
    sim.post_srq_recv(srq, &[103]).unwrap();
    sim.post_send(a.qp, &[imm(10, 0, 64, 5)]).unwrap();
    assert_eq!(sim.srq_receives(srq), Some(0));
    sim.modify_qp(b.qp, QpTransition::Reset).unwrap();
    assert_eq!(sim.srq_receives(srq), Some(0), "the receive went with its completion");
    assert!(poll_all(&sim, b.cq).is_empty());
    sim.post_srq_recv(srq, &[104]).unwrap();
    assert_eq!(sim.cq_overruns(), 0);
    teardown(&sim, a);
    teardown(&sim, b);
    sim.destroy_srq(srq).unwrap();
    assert!(sim.counts().balanced(), "{:?}", sim.counts());
}

#[test]
fn a_cq_smaller_than_its_receive_queue_overruns_and_the_overrun_is_counted() {
    let sim = SimVerbs::new();
    let a = side(&sim, 1 << 16, MrAccess::ALL, 64);
    let (b, srq, _) = receiving_side(&sim, 1 << 16, 4, 1);
    connect(&sim, &a, &b);
    sim.post_srq_recv(srq, &[1, 2]).unwrap();
    let imm = |id| SendWr { op: WrOp::WriteImm(3), ..wr(WrOp::Write, &a, 0, &b, 0, 64, id) };
    sim.post_send(a.qp, &[imm(1), imm(2)]).unwrap();
    assert_eq!(sim.cq_overruns(), 1, "kvring sizes the CQ to its receive queue so this never happens");
    assert_eq!(poll_all(&sim, b.cq).len(), 1);
    teardown(&sim, a);
    teardown(&sim, b);
    sim.destroy_srq(srq).unwrap();
}
