//! The fake libibverbs' late landings (`FAKE_IBVERBS_DELAY_FILE`,
//! tests/fakes/ibverbs/src/delay.rs) keep its documented rules: a kept
//! WRITE places nothing and completes nothing until it is due, then is
//! placed before its completion is polled; one QP's WRs complete in posting
//! order; a QP moved to ERR flushes its kept WRs, placing nothing
//! (ibv_poll_cq(3)); a responder QP in ERR takes nothing; RESET drops kept
//! WRs uncompleted (ibv_modify_qp(3)). Run by .ci/stage-fence-rdma.sh over
//! the fake; one test, as the knob acts on every WR of the process.

mod common;

use common::verbs::FakeDelay;
use kvring::rdma::{IbVerbs, MrAccess, QpCaps, QpEndpoint, QpTransition, SendWr, Verbs, Wc, WcStatus, WrOp};
use std::time::Instant;

struct Side {
    verbs: IbVerbs,
    context: kvring::rdma::Context,
    pd: kvring::rdma::Pd,
    cq: kvring::rdma::Cq,
    qp: kvring::rdma::Qp,
    endpoint: QpEndpoint,
}

fn side() -> Side {
    let verbs = IbVerbs::new();
    let context = verbs.open("fakeroce0").unwrap();
    let pd = verbs.alloc_pd(context).unwrap();
    let cq = verbs.create_cq(context, 256).unwrap();
    let caps = QpCaps { max_send_wr: 64, max_inline: 64, port: 1, gid_index: 1, srq: None };
    let (qp, endpoint) = verbs.create_qp(pd, cq, caps).unwrap();
    Side { verbs, context, pd, cq, qp, endpoint }
}

fn connect(a: &Side, b: &QpEndpoint) {
    a.verbs.modify_qp(a.qp, QpTransition::Init).unwrap();
    a.verbs.modify_qp(a.qp, QpTransition::ReadyToReceive(*b)).unwrap();
    a.verbs.modify_qp(a.qp, QpTransition::ReadyToSend).unwrap();
}

/// Every completion polled until none comes for a few polls in a row.
fn poll_all(side: &Side) -> Vec<Wc> {
    let mut wcs = [Wc::new(0, WcStatus::Success); 8];
    let mut got = Vec::new();
    let mut idle = 0;
    while idle < 100 {
        let n = side.verbs.poll_cq(side.cq, &mut wcs).unwrap();
        got.extend_from_slice(&wcs[..n]);
        idle = if n == 0 { idle + 1 } else { 0 };
    }
    got
}

/// Polls until `n` completions came (each poll runs what is due).
fn poll_n(side: &Side, n: usize) -> Vec<Wc> {
    let mut wcs = [Wc::new(0, WcStatus::Success); 8];
    let mut got = Vec::new();
    let deadline = Instant::now() + common::WAIT;
    while got.len() < n {
        assert!(Instant::now() < deadline, "{} of {n} completions came", got.len());
        let polled = side.verbs.poll_cq(side.cq, &mut wcs).unwrap();
        got.extend_from_slice(&wcs[..polled]);
    }
    got
}

fn write(wr_id: u64, local: &kvring::rdma::Mr, remote: &kvring::rdma::Mr, at: u64, len: u32) -> SendWr {
    SendWr {
        wr_id,
        op: WrOp::Write,
        local_addr: local.addr + at,
        len,
        lkey: local.lkey,
        remote_addr: remote.addr + at,
        rkey: remote.rkey,
        signaled: true,
        inline: false,
    }
}

#[test]
fn kept_writes_land_before_their_completion_in_order_and_never_after_err_or_reset() {
    // The only test of this binary: no other thread posts while the knob is
    // pointed (before any verb) and turned.
    if std::env::var_os("FAKE_IBVERBS_DELAY_FILE").is_none() {
        let path = std::env::temp_dir().join(format!("kvring-fake-delay-{}", std::process::id()));
        std::env::set_var("FAKE_IBVERBS_DELAY_FILE", path);
    }
    let verbs = IbVerbs::new();
    if !verbs.devices().is_ok_and(|d| d.iter().any(|d| d.name == "fakeroce0")) {
        let why = "the fake libibverbs is not on LD_LIBRARY_PATH (run .ci/stage-fence-rdma.sh)";
        assert!(std::env::var_os("FAKE_IBVERBS_REQUIRED").is_none(), "{why}");
        eprintln!("skipped: {why}");
        return;
    }
    let Some(delay) = FakeDelay::find() else { return };
    let (a, b) = (side(), side());
    connect(&a, &b.endpoint);
    connect(&b, &a.endpoint);
    let source: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8 + 1).collect();
    let mut target = vec![0u8; 8192];
    // SAFETY: both buffers outlive their registrations (deregistered below).
    let (mr_a, mr_b) = unsafe {
        (
            a.verbs.reg_mr(a.pd, source.as_ptr() as u64, 8192, MrAccess::ALL).unwrap(),
            b.verbs.reg_mr(b.pd, target.as_mut_ptr() as u64, 8192, MrAccess::ALL).unwrap(),
        )
    };
    let landed = |at: usize, len: usize| {
        // SAFETY: a plain read of our buffer; the fake writes it only inside
        // the poll calls of this thread.
        let now = unsafe { std::slice::from_raw_parts(target.as_ptr().add(at), len) };
        now == &source[at..at + len]
    };
    let untouched = |at: usize, len: usize| {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(target.as_ptr().add(at), len) }.iter().all(|&x| x == 0)
    };

    // Held: nothing placed, nothing completed, however often polled.
    delay.hold();
    a.verbs.post_send(a.qp, &[write(1, &mr_a, &mr_b, 0, 1024)]).unwrap();
    assert_eq!(delay.kept(), 1);
    assert!(poll_all(&a).is_empty(), "a held WRITE completed");
    assert!(untouched(0, 1024), "a held WRITE was placed");
    // Released with a second WR posted behind it: both land, in order, each
    // placed by the time its completion is polled.
    delay.release();
    a.verbs.post_send(a.qp, &[write(2, &mr_a, &mr_b, 1024, 1024)]).unwrap();
    let wcs = poll_n(&a, 2);
    assert_eq!(wcs, [Wc::new(1, WcStatus::Success), Wc::new(2, WcStatus::Success)], "in posting order");
    assert!(landed(0, 2048), "completed before its bytes were placed");

    // Due after a delay: not before it, then placed and completed.
    delay.delay_ms(100);
    a.verbs.post_send(a.qp, &[write(3, &mr_a, &mr_b, 2048, 1024)]).unwrap();
    let posted = Instant::now();
    let wcs = poll_n(&a, 1);
    assert!(posted.elapsed() >= std::time::Duration::from_millis(100), "completed before its delay");
    assert_eq!(wcs, [Wc::new(3, WcStatus::Success)]);
    assert!(landed(2048, 1024));

    // The requester's QP moved to ERR with WRs kept: flushed, nothing placed.
    delay.hold();
    a.verbs.post_send(a.qp, &[write(4, &mr_a, &mr_b, 3072, 512), write(5, &mr_a, &mr_b, 3584, 512)]).unwrap();
    a.verbs.modify_qp(a.qp, QpTransition::Error).unwrap();
    delay.release();
    assert_eq!(poll_n(&a, 2), [Wc::new(4, WcStatus::Flushed), Wc::new(5, WcStatus::Flushed)]);
    assert!(untouched(3072, 1024), "a flushed WRITE was placed");

    // The responder's QP moved to ERR while a WRITE to it is kept: it takes
    // nothing; the requester's retries run out.
    a.verbs.modify_qp(a.qp, QpTransition::Reset).unwrap();
    connect(&a, &b.endpoint);
    delay.hold();
    a.verbs.post_send(a.qp, &[write(6, &mr_a, &mr_b, 4096, 1024)]).unwrap();
    b.verbs.modify_qp(b.qp, QpTransition::Error).unwrap();
    delay.release();
    assert_eq!(poll_n(&a, 1), [Wc::new(6, WcStatus::RetryExceeded)]);
    assert!(untouched(4096, 1024), "a WRITE was placed at a responder in ERR");

    // RESET drops kept WRs with the send queue: no completion, no bytes.
    b.verbs.modify_qp(b.qp, QpTransition::Reset).unwrap();
    connect(&b, &a.endpoint);
    a.verbs.modify_qp(a.qp, QpTransition::Reset).unwrap();
    connect(&a, &b.endpoint);
    delay.hold();
    a.verbs.post_send(a.qp, &[write(7, &mr_a, &mr_b, 5120, 1024)]).unwrap();
    a.verbs.modify_qp(a.qp, QpTransition::Reset).unwrap();
    assert_eq!(delay.kept(), 0, "RESET kept a WR");
    delay.release();
    assert!(poll_all(&a).is_empty(), "a WR dropped at RESET completed");
    assert!(untouched(5120, 1024));

    for s in [&a, &b] {
        s.verbs.destroy_qp(s.qp).unwrap();
        s.verbs.destroy_cq(s.cq).unwrap();
    }
    a.verbs.dereg_mr(mr_a.handle).unwrap();
    b.verbs.dereg_mr(mr_b.handle).unwrap();
    for s in [&a, &b] {
        s.verbs.dealloc_pd(s.pd).unwrap();
        s.verbs.close(s.context).unwrap();
    }
}
