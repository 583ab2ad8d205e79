//! The verbs path on the simulated provider: what a NIC checks, what it
//! moves, how it completes, and every fault it can throw.

use kvring::rdma::SimVerbs;
use kvring::rdma::*;
use kvring::testing::rdma::{build, KeyedBlock, Keys, PostConfig};
use std::sync::Arc;

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
    let caps = QpCaps { max_send_wr: depth, max_inline: 64, port: 1, gid_index: 1 };
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
    let mut out = [Wc { wr_id: 0, status: WcStatus::Success }; 64];
    let n = sim.poll_cq(cq, &mut out).unwrap();
    out[..n].to_vec()
}

struct SideKeys<'a>(&'a Side, &'a Side);

impl Keys for SideKeys<'_> {
    fn lkey(&self, _nic: usize, _region: u32) -> u32 {
        self.0.mr.lkey
    }
    fn rkey(&self, _nic: usize, _region: u32) -> u32 {
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
    assert_eq!(poll_all(&sim, a.cq), [Wc { wr_id: 99, status: WcStatus::Success }]);
    assert_eq!(a.memory[512 * 1024..512 * 1024 + 4096], a.memory[..4096]);
    teardown(&sim, a);
    teardown(&sim, b);
    assert!(sim.counts().balanced());
}

#[test]
fn unregistered_keys_and_ranges_past_an_mr_fail_and_write_nothing() {
    let sim = SimVerbs::new();
    let a = side(&sim, 8192, MrAccess::ALL, 64);
    let read_only = MrAccess { local_write: true, remote_write: false, remote_read: true };
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
        assert_eq!(completions[0], Wc { wr_id: request.wr_id, status: expected }, "errors are always reported");
        assert_eq!(completions[1], Wc { wr_id: 77, status: WcStatus::Flushed }, "and flush what follows");
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
    assert!(seen.contains(&Wc { wr_id: 42, status: WcStatus::RetryExceeded }), "{seen:?}");
}

#[test]
fn a_peer_that_resets_its_qps_is_seen_as_retry_exceeded_and_reconnecting_works() {
    let sim = SimVerbs::new();
    let a = side(&sim, 1 << 16, MrAccess::ALL, 64);
    let b = side(&sim, 1 << 16, MrAccess::ALL, 64);
    connect(&sim, &a, &b);
    sim.reset_qp(b.qp);
    sim.post_send(a.qp, &[wr(WrOp::Write, &a, 0, &b, 0, 64, 1)]).unwrap();
    assert_eq!(poll_all(&sim, a.cq), [Wc { wr_id: 1, status: WcStatus::RetryExceeded }]);
    // The restart path: both QPs reset and re-handshaked.
    sim.modify_qp(a.qp, QpTransition::Reset).unwrap();
    connect(&sim, &a, &b);
    sim.post_send(a.qp, &[wr(WrOp::Write, &a, 0, &b, 0, 64, 2)]).unwrap();
    assert_eq!(poll_all(&sim, a.cq), [Wc { wr_id: 2, status: WcStatus::Success }]);
}

#[test]
fn a_device_that_disappears_is_a_clear_error_not_a_crash() {
    let sim = SimVerbs::new();
    let a = side(&sim, 4096, MrAccess::ALL, 8);
    sim.remove_device("sim0");
    let error = sim.alloc_pd(a.context).unwrap_err().to_string();
    assert!(error.contains("rdma device sim0: it is no longer present"), "{error}");
    assert!(sim.poll_cq(a.cq, &mut [Wc { wr_id: 0, status: WcStatus::Success }; 1]).is_err());
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
        assert_eq!(poll_all(&sim, a.cq), [Wc { wr_id: round, status: WcStatus::Success }]);
        teardown(&sim, b);
    }
    teardown(&sim, a);
    let counts = sim.counts();
    assert!(counts.balanced(), "{counts:?}");
    assert_eq!(counts.qps, (1001, 1001));
}
