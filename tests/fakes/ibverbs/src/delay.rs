//! `FAKE_IBVERBS_DELAY_FILE`: late execution of send WRs, so a test can
//! see what a caller does while a WRITE it posted has not landed yet.
//!
//! While the named file exists, each send WR posted to an RTS QP is kept
//! instead of executed: its bytes are placed (or read, for a READ) and its
//! completion is generated together, at a later `ibv_poll_cq` (of any CQ
//! of the process), once the WR is due. The file's content says when: a
//! number `N` makes each WR posted then due `N` ms after its post; anything
//! else (an empty file) holds it until the file is removed (released).
//! Removing the file makes every kept WR due. `fake_ibverbs_delayed()`
//! (exported; tests find it with `dlsym`) counts the WRs kept now.
//!
//! Why this is a legal NIC, rule by rule:
//! - A WR's buffers stay in use until it "is fully executed and a work
//!   completion has been retrieved" (ibv_post_send(3) NOTES), and
//!   ibv_poll_cq(3) returns the completions available when it is called,
//!   promising none by any time: a NIC may place a WRITE's bytes, and
//!   report it, any time after the post. The fake places first and
//!   completes after, never the other way: an RC requester retires a
//!   WRITE on the responder's acknowledge, sent once the bytes are placed
//!   (InfiniBand Architecture Specification Vol 1, ch. 9, the reliable
//!   connected service).
//! - WRs of one send queue execute and complete in the order posted (the
//!   same chapter's ordering rules for RC, and ch. 10's work completions of
//!   a queue returned in order): once a QP has a kept WR, every later WR of
//!   that QP is kept behind it, due no sooner.
//! - A QP moved to ERR completes every outstanding WR with
//!   IBV_WC_WR_FLUSH_ERR and executes none (ibv_poll_cq(3), ibv_modify_qp(3)
//!   IBV_QPS_ERR): a kept WR whose QP is in ERR when it is due is flushed,
//!   nothing placed. A responder QP that is not RTR/RTS takes no packet,
//!   so a kept WRITE to one places nothing and its retries run out
//!   (IBV_WC_RETRY_EXC_ERR), checked at placement, under the fabric lock
//!   the responder's state change takes (`post::execute`).
//! - A QP moved to RESET or destroyed loses its kept WRs with its send
//!   queue, completing none (ibv_modify_qp(3): RESET is a new QP's state).

use super::objects::{local_qps, FakeQp};
use super::*;
use std::time::{Duration, Instant};

/// One kept WR: the fields `post::execute` reads, its inline bytes (read
/// at post, ibv_post_send(3) NOTES), and when it is due (`None`: when the
/// file is removed).
struct Kept {
    qpn: u32,
    seq: u64,
    wr_id: u64,
    opcode: c_uint,
    send_flags: c_uint,
    imm_data: u32,
    remote_addr: u64,
    rkey: u32,
    num_sge: c_int,
    sge: ibv_sge,
    len: u64,
    inline: Option<Vec<u8>>,
    signalled: bool,
    /// The post-time fault knobs said this WR fails.
    fails: bool,
    due: Option<Instant>,
}

fn kept() -> &'static Mutex<Vec<Kept>> {
    static KEPT: std::sync::OnceLock<Mutex<Vec<Kept>>> = std::sync::OnceLock::new();
    KEPT.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, Vec<Kept>> {
    kept().lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether the file exists now, and if so the due time of a WR posted now
/// (`Some(None)`: held until released). Read at each post, so a test turns
/// the delay on and off.
fn delaying() -> Option<Option<Instant>> {
    let path = std::env::var_os("FAKE_IBVERBS_DELAY_FILE")?;
    let text = std::fs::read_to_string(path).ok()?;
    Some(text.trim().parse::<u64>().ok().map(|ms| Instant::now() + Duration::from_millis(ms)))
}

fn released() -> bool {
    std::env::var_os("FAKE_IBVERBS_DELAY_FILE").is_none_or(|p| !std::path::Path::new(&p).exists())
}

/// When a WR posted now to QP `qpn` in `state` is to be kept: the file
/// exists (and the QP is RTS), or an earlier WR of the QP is still kept.
pub fn keep_now(qpn: u32, state: c_uint) -> Option<Option<Instant>> {
    let behind = lock().iter().any(|k| k.qpn == qpn);
    match delaying() {
        Some(due) if state == IBV_QPS_RTS => Some(due),
        _ if behind => Some(Some(Instant::now())),
        _ => None,
    }
}

/// Keeps WR `w` (checked and counted by `post_send`) until `due`.
///
/// # Safety
///
/// `w` is a WR `post_send` was given, its `sg_list` readable.
#[allow(clippy::too_many_arguments)]
pub unsafe fn keep(
    qpn: u32,
    w: &ibv_send_wr,
    seq: u64,
    len: u64,
    inline: Option<Vec<u8>>,
    signalled: bool,
    fails: bool,
    due: Option<Instant>,
) {
    let sge = if w.num_sge > 0 { *w.sg_list } else { ibv_sge::default() };
    lock().push(Kept {
        qpn,
        seq,
        wr_id: w.wr_id,
        opcode: w.opcode,
        send_flags: w.send_flags,
        imm_data: w.imm_data,
        remote_addr: w.remote_addr,
        rkey: w.rkey,
        num_sge: w.num_sge,
        sge,
        len,
        inline,
        signalled,
        fails,
        due,
    });
}

/// A QP moved to RESET or destroyed: its kept WRs are gone, uncompleted.
pub fn forget(qpn: u32) {
    lock().retain(|k| k.qpn != qpn);
}

/// Executes the kept WRs that are due, each QP's in posting order (the
/// first not yet due holds the ones behind it), completing each after its
/// placement. Runs under the list's lock, so two pollers never reorder one
/// QP's WRs, and a QP's destroy (which forgets its kept WRs, taking that
/// lock, before it frees the QP) waits until no QP pointer is in use here.
pub unsafe fn run_due() {
    let mut list = lock();
    if list.is_empty() {
        return;
    }
    let now = Instant::now();
    let released = released();
    let mut waiting: Vec<u32> = Vec::new();
    let mut due = Vec::new();
    let mut kept = Vec::new();
    for k in list.drain(..) {
        let ready = released || k.due.is_some_and(|d| d <= now);
        if ready && !waiting.contains(&k.qpn) {
            due.push(k);
        } else {
            waiting.push(k.qpn);
            kept.push(k);
        }
    }
    *list = kept;
    let qps = local_qps().lock().unwrap().clone();
    for k in due {
        let Some(&raw) = qps.get(&k.qpn) else { continue };
        let qp = raw as *mut ibv_qp;
        let fake = &*(qp as *const FakeQp);
        let was_err = (*qp).state == IBV_QPS_ERR;
        let status = if was_err {
            IBV_WC_WR_FLUSH_ERR
        } else if k.fails {
            IBV_WC_RETRY_EXC_ERR
        } else {
            let mut sge = k.sge;
            let wr = ibv_send_wr {
                wr_id: k.wr_id,
                next: std::ptr::null_mut(),
                sg_list: &mut sge,
                num_sge: k.num_sge,
                opcode: k.opcode,
                send_flags: k.send_flags,
                imm_data: k.imm_data,
                remote_addr: k.remote_addr,
                rkey: k.rkey,
                _wr_rest: [0; 5],
                _tail: [0; 7],
            };
            super::post::execute(fake, &wr, k.inline.as_deref())
        };
        super::post::finish(qp, was_err, k.wr_id, k.opcode, k.len, status, k.seq, k.signalled);
    }
}

/// How many WRs this process keeps now (for tests, through `dlsym`).
#[no_mangle]
pub extern "C" fn fake_ibverbs_delayed() -> u64 {
    lock().len() as u64
}
