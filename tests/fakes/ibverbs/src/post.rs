//! The data path: ibv_post_send (executed at once, against the remote
//! QP's and MR's records in the fabric), receives on SRQs, completions,
//! and completion events.

use super::objects::{cq_address, cq_address_len, local_cqs, local_qps, FakeCq, FakeQp, FakeSrq};
use super::*;
use fabric::Fabric;

/// Poison for the fields of an error completion that ibv_poll_cq(3) says
/// are not valid ("only wr_id, status, qp_num and vendor_err").
const POISON: u32 = 0xdead_beef;

/// Pushes `wc` onto CQ `slot`; true when an armed channel must be signalled.
fn push(f: &mut Fabric, slot: u32, wc: ibv_wc) -> bool {
    let c = &mut f.cqs[slot as usize];
    if c.used == 0 {
        return false;
    }
    // ibv_poll_cq(3) NOTES / ibv_create_cq(3): more completions than `cqe`
    // overrun the CQ; it is unusable after (IBV_EVENT_CQ_ERR).
    if c.tail.wrapping_sub(c.head) >= c.cqe {
        if c.overrun == 0 {
            log("CQ overrun");
            super::control::overran();
        }
        c.overrun = 1;
        return false;
    }
    c.ring[c.tail as usize % CQ_RING] = wc;
    c.tail = c.tail.wrapping_add(1);
    // ibv_req_notify_cq(3): one event for the next completion, then disarmed.
    let notify = c.armed != 0 && c.has_channel != 0;
    c.armed = 0;
    notify
}

fn signal(slot: u32) {
    static SENDER: std::sync::OnceLock<c_int> = std::sync::OnceLock::new();
    // SAFETY: a datagram socket of our own.
    let fd = *SENDER.get_or_init(|| unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) });
    let addr = cq_address(slot);
    let bytes = slot.to_ne_bytes();
    // SAFETY: sends 4 bytes to an abstract address; a missing receiver is fine.
    unsafe {
        libc::sendto(
            fd,
            bytes.as_ptr().cast(),
            4,
            libc::MSG_DONTWAIT,
            &addr as *const _ as *const libc::sockaddr,
            cq_address_len(slot),
        )
    };
}

fn complete(slot: u32, wc: ibv_wc) {
    if locked(|f| push(f, slot, wc)) {
        signal(slot);
    }
}

fn mtu_bytes(mtu: c_uint) -> u32 {
    128 << mtu.clamp(1, 5)
}

/// Checks a key against the fabric's MR records: the registration of
/// `pid` with that key covering [addr, addr+len) and granting `need`.
/// Where those bytes lie in `pid`'s address space (a dma-buf MR's iova is
/// not an address its owner can touch: the bytes are at the fake's mapping
/// of the dma-buf's pages, as a NIC reaches a GPU's pages, never through
/// the device address).
fn key_ok(f: &Fabric, key: u32, pid: u32, addr: u64, len: u64, need: c_uint) -> Option<u64> {
    let m = &f.mrs[(key & 0x1fff) as usize];
    let ok = m.used == 1
        && m.key == key
        && m.pid == pid
        && addr >= m.addr
        && addr.checked_add(len).is_some_and(|end| end <= m.addr + m.len)
        && m.access & need == need;
    ok.then(|| m.host + (addr - m.addr))
}

/// Executes one WR; the completion status.
pub unsafe fn execute(qp: &FakeQp, wr: &ibv_send_wr, inline: Option<&[u8]>) -> c_uint {
    let me = std::process::id();
    let attr = *qp.attr.lock().unwrap();
    let sge = if wr.num_sge > 0 { *wr.sg_list } else { ibv_sge::default() };
    let len = u64::from(sge.length);
    let read = wr.opcode == IBV_WR_RDMA_READ;
    let with_imm = wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
    let remote = locked(|f| f.qps.iter().find(|q| q.used == 1 && q.qpn == attr.dest_qp_num).copied());
    // A peer that is gone, or whose QP cannot receive, never acknowledges:
    // the requester's retries run out (ibv_poll_cq(3) IBV_WC_RETRY_EXC_ERR).
    let Some(remote) = remote.filter(|r| alive(r.pid) && (r.state == IBV_QPS_RTR || r.state == IBV_QPS_RTS)) else {
        return IBV_WC_RETRY_EXC_ERR;
    };
    // Packets larger than the receiving port's MTU are dropped on the way.
    if len > u64::from(remote.port_mtu) && mtu_bytes(attr.path_mtu) > remote.port_mtu {
        return IBV_WC_RETRY_EXC_ERR;
    }
    let local_need = if read { IBV_ACCESS_LOCAL_WRITE } else { 0 };
    let remote_need = if read { IBV_ACCESS_REMOTE_READ } else { IBV_ACCESS_REMOTE_WRITE };
    let (local_at, remote_at) = locked(|f| {
        // The L_Key is not checked for inline data (ibv_post_send(3)).
        let local_at = if inline.is_some() || len == 0 {
            Some(sge.addr)
        } else {
            key_ok(f, sge.lkey, me, sge.addr, len, local_need)
        };
        // The responder checks the R_Key, its range and access, and its QP's
        // access flags (ibv_reg_mr(3), ibv_modify_qp(3) qp_access_flags).
        let remote_at = if len == 0 && !read {
            Some(wr.remote_addr)
        } else {
            key_ok(f, wr.rkey, remote.pid, wr.remote_addr, len, remote_need)
        };
        (local_at, remote_at.filter(|_| remote.access & remote_need == remote_need))
    });
    let Some(local_at) = local_at else { return IBV_WC_LOC_PROT_ERR };
    let Some(remote_at) = remote_at else { return IBV_WC_REM_ACCESS_ERR };
    // WRITE_WITH_IMM consumes one receive at the responder; with none
    // posted the responder answers RNR and the requester retries
    // `rnr_retry` times, 7 meaning without end (ibv_modify_qp(3)). The fake
    // bounds "without end" at 30 s so a broken test fails instead of hanging.
    let mut receive = None;
    if with_imm {
        let tries = if attr.rnr_retry >= 7 { 300_000 } else { u32::from(attr.rnr_retry) + 1 };
        for _ in 0..tries {
            receive = locked(|f| {
                let s = &mut f.srqs[remote.srq.checked_sub(1)? as usize];
                (s.head != s.tail).then(|| {
                    let id = s.ring[s.head as usize % SRQ_RING];
                    s.head = s.head.wrapping_add(1);
                    id
                })
            });
            if receive.is_some() || remote.srq == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        if receive.is_none() {
            return IBV_WC_RNR_RETRY_EXC_ERR;
        }
    }
    // Placed under the fabric lock, with the responder's QP checked again:
    // once its owner moved it out of RTR/RTS (ibv_modify_qp(3), which takes
    // this lock) it takes no packet, so nothing lands after that call
    // returned, however long ago this WR was posted (delay.rs).
    let moved = locked(|f| {
        let ready = f
            .qps
            .iter()
            .any(|q| q.used == 1 && q.qpn == remote.qpn && (q.state == IBV_QPS_RTR || q.state == IBV_QPS_RTS));
        ready.then(|| match (read, inline) {
            (true, _) => copy(remote.pid, remote_at, me, local_at, len as usize),
            (false, Some(bytes)) => copy(me, bytes.as_ptr() as u64, remote.pid, remote_at, bytes.len()),
            (false, None) => copy(me, local_at, remote.pid, remote_at, len as usize),
        })
    });
    match moved {
        None => return IBV_WC_RETRY_EXC_ERR,
        Some(false) => return IBV_WC_REM_ACCESS_ERR,
        Some(true) => {}
    }
    super::control::count_moved(spec_of(qp.raw.context).index, wr.rkey, len);
    if let Some(wr_id) = receive {
        let wc = ibv_wc {
            wr_id,
            status: IBV_WC_SUCCESS,
            opcode: IBV_WC_RECV_RDMA_WITH_IMM,
            byte_len: sge.length,
            imm_data: wr.imm_data,
            qp_num: remote.qpn,
            wc_flags: IBV_WC_WITH_IMM,
            ..Default::default()
        };
        complete(remote.recv_cq, wc);
    }
    IBV_WC_SUCCESS
}

fn error_wc(wr_id: u64, status: c_uint, qpn: u32, seq: u64) -> ibv_wc {
    ibv_wc {
        wr_id,
        status,
        opcode: POISON,
        vendor_err: 0x42,
        byte_len: POISON,
        imm_data: POISON,
        qp_num: qpn,
        src_qp: seq as u32,
        wc_flags: POISON,
        ..Default::default()
    }
}

fn fail_after() -> Option<u64> {
    static N: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var("FAKE_IBVERBS_QP_ERROR_AFTER").ok().and_then(|v| v.parse().ok()))
}

/// `FAKE_IBVERBS_QP_ERROR_FILE`: while that file exists, every WR posted
/// fails as a link that stopped answering would (read at each post, so a
/// test turns the fault on and off).
fn fault_now() -> bool {
    std::env::var_os("FAKE_IBVERBS_QP_ERROR_FILE").is_some_and(|p| std::path::Path::new(&p).exists())
}

pub(crate) unsafe fn to_error(qp: *mut ibv_qp) {
    let fake = &*(qp as *const FakeQp);
    (*qp).state = IBV_QPS_ERR;
    fake.attr.lock().unwrap().qp_state = IBV_QPS_ERR;
    locked(|f| f.qps[fake.slot as usize].state = IBV_QPS_ERR);
    if !(*qp).srq.is_null() {
        super::objects::last_wqe_reached(qp);
    }
}

/// A WR posted while its port is down: no packet leaves, so no ACK comes;
/// the requester retransmits `retry_cnt` times, each after the local ACK
/// timeout of 4.096 µs × 2^`timeout` (ibv_modify_qp(3) `timeout`,
/// `retry_cnt`; the formula is the IBTA's, as the InfiniBand Architecture
/// Specification Vol 1 §9.7.6.1.3 gives it), then completes it with
/// IBV_WC_RETRY_EXC_ERR. Kept until then and completed at a later poll.
struct Held {
    qpn: u32,
    wr_id: u64,
    seq: u64,
    due: std::time::Instant,
}

fn held() -> &'static Mutex<Vec<Held>> {
    static HELD: std::sync::OnceLock<Mutex<Vec<Held>>> = std::sync::OnceLock::new();
    HELD.get_or_init(Default::default)
}

/// A QP moved to RESET or destroyed: its WRs still waiting for an answer
/// are gone with its send queue (ibv_modify_qp(3): RESET is the state of a
/// newly created QP).
pub fn forget_held(qpn: u32) {
    held().lock().unwrap().retain(|h| h.qpn != qpn);
    super::delay::forget(qpn);
}

/// When a WR posted now on a QP with these attributes runs out of retries.
fn retry_deadline(attr: &ibv_qp_attr) -> std::time::Instant {
    let ack_timeout_ns = 4096u64 << attr.timeout.min(31);
    let tries = u64::from(attr.retry_cnt.min(7)) + 1;
    std::time::Instant::now() + std::time::Duration::from_nanos(ack_timeout_ns * tries)
}

/// Completes the held WRs whose retries have run out (first one
/// RETRY_EXC_ERR, which moves its QP to ERR; later ones of that QP flushed).
unsafe fn expire_held() {
    let now = std::time::Instant::now();
    let due: Vec<Held> = {
        let mut list = held().lock().unwrap();
        if list.is_empty() {
            return;
        }
        let (due, kept): (Vec<Held>, Vec<Held>) = list.drain(..).partition(|h| h.due <= now);
        *list = kept;
        due
    };
    let qps = local_qps().lock().unwrap().clone();
    for h in due {
        let Some(&qp) = qps.get(&h.qpn) else { continue };
        let qp = qp as *mut ibv_qp;
        let status = if (*qp).state == IBV_QPS_ERR { IBV_WC_WR_FLUSH_ERR } else { IBV_WC_RETRY_EXC_ERR };
        if status == IBV_WC_RETRY_EXC_ERR {
            to_error(qp);
        }
        let send_cq = (*((*qp).send_cq as *const FakeCq)).slot;
        complete(send_cq, error_wc(h.wr_id, status, h.qpn, h.seq));
    }
}

pub unsafe extern "C" fn post_send(qp: *mut ibv_qp, mut wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> c_int {
    let fake = &*(qp as *const FakeQp);
    let qpn = (*qp).qp_num;
    while !wr.is_null() {
        let w = &*wr;
        let fail = |code| {
            *bad = wr;
            ret(code)
        };
        let state = (*qp).state;
        // Posting is allowed in RTS, and in ERR where every WR is flushed;
        // anywhere else the post fails (ibv_post_send(3): "the value of
        // errno"). mlx5 answers ENOMEM there (providers/mlx5/qp.c
        // _mlx5_post_send: a QP not yet RTS, or back in RESET, has
        // `qp_state_max_gs` -1, and the size check fails as an overflow), so
        // the fake does too: a caller reading every ENOMEM as "queue full"
        // spins on a QP that can never send (VERBS-REVIEW finding 13).
        if state != IBV_QPS_RTS && state != IBV_QPS_ERR {
            return fail(libc::ENOMEM);
        }
        if w.num_sge < 0 || w.num_sge as u32 > fake.cap.max_send_sge {
            return fail(libc::EINVAL);
        }
        let inline = w.send_flags & IBV_SEND_INLINE != 0;
        let len: u64 = (0..w.num_sge as usize).map(|i| u64::from((*w.sg_list.add(i)).length)).sum();
        // ibv_post_send(3): IBV_SEND_INLINE is for sends and RDMA WRITEs, up
        // to the QP's max_inline_data.
        if inline && (w.opcode == IBV_WR_RDMA_READ || len > u64::from(fake.cap.max_inline_data)) {
            log("ibv_post_send: inline READ or inline beyond max_inline_data");
            return fail(libc::EINVAL);
        }
        // A WR holds its send-queue slot until a signalled completion at or
        // after it is polled: with max_send_wr outstanding the queue is full.
        let posted = fake.posted.load(Ordering::Relaxed);
        if posted - fake.retired.load(Ordering::Acquire) >= u64::from(fake.cap.max_send_wr) {
            return fail(libc::ENOMEM);
        }
        let seq = posted + 1;
        fake.posted.store(seq, Ordering::Relaxed);
        let signalled = fake.sig_all || w.send_flags & IBV_SEND_SIGNALED != 0;
        // Inline data is read inside this call (ibv_post_send(3) NOTES: the
        // buffer can be reused once it returns): device memory faults here.
        let inline_bytes = inline.then(|| {
            let mut bytes = Vec::with_capacity(len as usize);
            for i in 0..w.num_sge as usize {
                let s = *w.sg_list.add(i);
                bytes.extend_from_slice(std::slice::from_raw_parts(s.addr as *const u8, s.length as usize));
            }
            bytes
        });
        let nth = fake.wrs.fetch_add(1, Ordering::Relaxed) + 1;
        if super::control::failed((*qp).context) {
            // control.rs: a failed device's doorbells ring nowhere; the WR
            // is neither executed nor completed.
            wr = w.next;
            continue;
        }
        check_port((*qp).context);
        if let Some(due) = super::delay::keep_now(qpn, state) {
            let fails = state == IBV_QPS_RTS && (fail_after().is_some_and(|n| nth >= n) || fault_now());
            super::delay::keep(qpn, w, seq, len, inline_bytes, signalled, fails, due);
            wr = w.next;
            continue;
        }
        if state == IBV_QPS_RTS && port_down() {
            let due = retry_deadline(&fake.attr.lock().unwrap());
            held().lock().unwrap().push(Held { qpn, wr_id: w.wr_id, seq, due });
            wr = w.next;
            continue;
        }
        let asked = if state == IBV_QPS_RTS { super::control::take_fault(w.remote_addr, len) } else { None };
        if asked == Some(IBV_WC_WR_FLUSH_ERR) {
            // control.rs: the QP entered ERR with this WR outstanding.
            to_error(qp);
            finish(qp, true, w.wr_id, w.opcode, len, IBV_WC_WR_FLUSH_ERR, seq, signalled);
            wr = w.next;
            continue;
        }
        let status = if state == IBV_QPS_ERR {
            IBV_WC_WR_FLUSH_ERR
        } else if let Some(status) = asked {
            status
        } else if fail_after().is_some_and(|n| nth >= n) || fault_now() {
            IBV_WC_RETRY_EXC_ERR
        } else {
            execute(fake, w, inline_bytes.as_deref())
        };
        finish(qp, state == IBV_QPS_ERR, w.wr_id, w.opcode, len, status, seq, signalled);
        wr = w.next;
    }
    ret(0)
}

/// Completes an executed (or flushed) WR of `qp`: an error moves the QP to
/// ERR; a success is reported when signalled.
#[allow(clippy::too_many_arguments)]
pub unsafe fn finish(
    qp: *mut ibv_qp,
    was_err: bool,
    wr_id: u64,
    opcode: c_uint,
    len: u64,
    status: c_uint,
    seq: u64,
    signalled: bool,
) {
    let send_cq = (*((*qp).send_cq as *const FakeCq)).slot;
    let qpn = (*qp).qp_num;
    if status != IBV_WC_SUCCESS {
        // ibv_poll_cq(3): after an error completion the QP is in ERR and
        // every outstanding and later WR completes with WR_FLUSH_ERR,
        // signalled or not.
        if !was_err {
            to_error(qp);
        }
        complete(send_cq, error_wc(wr_id, status, qpn, seq));
    } else if signalled {
        let read = opcode == IBV_WR_RDMA_READ;
        let wc = ibv_wc {
            wr_id,
            status,
            opcode: if read { IBV_WC_RDMA_READ } else { IBV_WC_RDMA_WRITE },
            byte_len: if read { len as u32 } else { 0 },
            qp_num: qpn,
            src_qp: seq as u32,
            ..Default::default()
        };
        complete(send_cq, wc);
    }
}

pub unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, out: *mut ibv_wc) -> c_int {
    check_port((*cq).context);
    expire_held();
    super::delay::run_due();
    let slot = (*(cq as *const FakeCq)).slot as usize;
    let taken = locked(|f| {
        let c = &mut f.cqs[slot];
        if c.overrun != 0 {
            return None;
        }
        let mut taken = Vec::new();
        while taken.len() < n.max(0) as usize && c.head != c.tail {
            taken.push(c.ring[c.head as usize % CQ_RING]);
            c.head = c.head.wrapping_add(1);
        }
        Some(taken)
    });
    // ibv_poll_cq(3): a negative value on failure (an overrun CQ).
    let Some(taken) = taken else { return -1 };
    let qps = local_qps().lock().unwrap();
    for (i, wc) in taken.iter().enumerate() {
        let mut wc = *wc;
        if wc.opcode & 0x80 == 0 || wc.status != IBV_WC_SUCCESS {
            // A polled send completion frees its slot and every earlier one.
            if let Some(&qp) = qps.get(&wc.qp_num) {
                let qp = &*(qp as *const FakeQp);
                let seq = u64::from(wc.src_qp);
                if seq > qp.retired.load(Ordering::Relaxed) && seq <= qp.posted.load(Ordering::Relaxed) {
                    qp.retired.store(seq, Ordering::Release);
                }
            }
            if wc.status == IBV_WC_SUCCESS {
                wc.src_qp = 0;
            } else {
                wc.src_qp = POISON;
            }
        }
        *out.add(i) = wc;
    }
    taken.len() as c_int
}

pub unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, _solicited: c_int) -> c_int {
    let slot = (*(cq as *const FakeCq)).slot as usize;
    locked(|f| f.cqs[slot].armed = 1);
    ret(0)
}

pub unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    mut wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    let fake = &*(srq as *const FakeSrq);
    while !wr.is_null() {
        let w = &*wr;
        // ibv_post_srq_recv(3): num_sge within the SRQ's max_sge, and no more
        // outstanding receives than its max_wr.
        if w.num_sge < 0 || w.num_sge as u32 > fake.max_sge {
            *bad = wr;
            return ret(libc::EINVAL);
        }
        let pushed = locked(|f| {
            let s = &mut f.srqs[fake.slot as usize];
            if s.tail.wrapping_sub(s.head) >= s.max_wr {
                return false;
            }
            s.ring[s.tail as usize % SRQ_RING] = w.wr_id;
            s.tail = s.tail.wrapping_add(1);
            true
        });
        if !pushed {
            *bad = wr;
            return ret(libc::ENOMEM);
        }
        wr = w.next;
    }
    ret(0)
}

pub unsafe extern "C" fn post_recv(qp: *mut ibv_qp, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    // kvring posts receives only to SRQs; a QP with an SRQ takes none of its
    // own (ibv_post_recv(3)).
    let _ = qp;
    *bad = wr;
    ret(libc::EINVAL)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    let mut bytes = [0u8; 4];
    // Blocking or not as the caller set the descriptor (ibv_get_cq_event(3)
    // shows O_NONBLOCK on the channel's fd).
    let got = libc::recv((*channel).fd, bytes.as_mut_ptr().cast(), 4, 0);
    if got != 4 {
        return -1;
    }
    let slot = u32::from_ne_bytes(bytes);
    let Some(&raw) = local_cqs().lock().unwrap().get(&slot) else { return -1 };
    let fake = &*(raw as *const FakeCq);
    fake.unacked.fetch_add(1, Ordering::Relaxed);
    *cq = raw as *mut ibv_cq;
    *cq_context = fake.raw.cq_context;
    0
}

#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, n: c_uint) {
    (*(cq as *const FakeCq)).unacked.fetch_sub(u64::from(n), Ordering::Relaxed);
}
