//! PDs, completion channels, CQs, SRQs and QPs, with the checks their
//! man pages document.

use super::*;

/// A PD (the ibv_pd first) and what still hangs off it.
#[repr(C)]
pub struct FakePd {
    pub raw: ibv_pd,
    pub objects: AtomicU64,
}

#[no_mangle]
pub unsafe extern "C" fn ibv_alloc_pd(context: *mut ibv_context) -> *mut ibv_pd {
    // A failed device (control.rs, `fake_ibverbs_device_fatal`): EIO.
    if super::control::failed(context) {
        return null(libc::EIO);
    }
    count(context, 1);
    let pd = Box::into_raw(Box::new(FakePd { raw: ibv_pd { context, handle: 0 }, objects: AtomicU64::new(0) }));
    &mut (*pd).raw
}

#[no_mangle]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    let fake = pd as *mut FakePd;
    // ibv_alloc_pd(3): "ibv_dealloc_pd() may fail if any other resource is
    // still associated with the PD being freed" (EBUSY).
    if (*fake).objects.load(Ordering::Relaxed) != 0 {
        log("ibv_dealloc_pd: resources still on the PD");
        return ret(libc::EBUSY);
    }
    count((*pd).context, -1);
    drop(Box::from_raw(fake));
    0
}

pub(crate) fn pd_objects(pd: *mut ibv_pd, delta: i64) {
    // SAFETY: every PD the fake hands out is a FakePd.
    unsafe { (*(pd as *const FakePd)).objects.fetch_add(delta as u64, Ordering::Relaxed) };
}

/// A completion channel: an abstract unix datagram socket that any process
/// completing onto one of its CQs can signal.
#[repr(C)]
pub struct FakeChannel {
    pub raw: ibv_comp_channel,
    pub cqs: AtomicU64,
}

/// Process-local: CQ slot → its ibv_cq pointer (for ibv_get_cq_event).
pub fn local_cqs() -> &'static Mutex<HashMap<u32, usize>> {
    static MAP: std::sync::OnceLock<Mutex<HashMap<u32, usize>>> = std::sync::OnceLock::new();
    MAP.get_or_init(Default::default)
}

pub fn cq_address(slot: u32) -> libc::sockaddr_un {
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as u16;
    let fabric = std::env::var("FAKE_IBVERBS_FABRIC").unwrap_or_else(|_| "default".into());
    // SAFETY: getuid has no preconditions.
    let name = format!("kvring-fakeverbs-{}-{fabric}-cq{slot}", unsafe { libc::getuid() });
    for (i, b) in name.bytes().take(100).enumerate() {
        addr.sun_path[i + 1] = b as c_char; // abstract: sun_path[0] = 0
    }
    addr
}

pub fn cq_address_len(slot: u32) -> libc::socklen_t {
    let fabric = std::env::var("FAKE_IBVERBS_FABRIC").unwrap_or_else(|_| "default".into());
    // SAFETY: as above.
    let name = format!("kvring-fakeverbs-{}-{fabric}-cq{slot}", unsafe { libc::getuid() });
    (2 + 1 + name.len().min(100)) as libc::socklen_t
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(context: *mut ibv_context) -> *mut ibv_comp_channel {
    if super::control::failed(context) {
        return null(libc::EIO);
    }
    let fd = libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
    if fd < 0 {
        return std::ptr::null_mut();
    }
    count(context, 1);
    let channel = Box::into_raw(Box::new(FakeChannel {
        raw: ibv_comp_channel { context, fd, refcnt: 0 },
        cqs: AtomicU64::new(0),
    }));
    &mut (*channel).raw
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(channel: *mut ibv_comp_channel) -> c_int {
    let fake = channel as *mut FakeChannel;
    // ibv_create_comp_channel(3): fails while any CQ is still associated.
    if (*fake).cqs.load(Ordering::Relaxed) != 0 {
        log("ibv_destroy_comp_channel: CQs still use it");
        return ret(libc::EBUSY);
    }
    count((*channel).context, -1);
    libc::close((*channel).fd);
    drop(Box::from_raw(fake));
    0
}

/// A CQ (the ibv_cq first): its ring lives in the fabric.
#[repr(C)]
pub struct FakeCq {
    pub raw: ibv_cq,
    pub slot: u32,
    pub qps: AtomicU64,
    pub unacked: AtomicU64,
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    vector: c_int,
) -> *mut ibv_cq {
    if super::control::failed(context) {
        return null(libc::EIO);
    }
    // ibv_create_cq(3): cqe must be at least 1 and at most max_cqe.
    if cqe < 1 || cqe as usize > CQ_RING {
        return null(libc::EINVAL);
    }
    // ibv_create_cq(3): "comp_vector ... must be at least zero and less
    // than context->num_comp_vectors".
    if !(0..(*context).num_comp_vectors).contains(&vector) {
        log("ibv_create_cq: comp_vector outside num_comp_vectors");
        return null(libc::EINVAL);
    }
    let pid = std::process::id();
    let slot = locked(|f| {
        let slot = f.cqs.iter().position(|c| c.used == 0)?;
        let c = &mut f.cqs[slot];
        (c.used, c.pid, c.cqe, c.head, c.tail, c.armed, c.overrun) = (1, pid, cqe as u32, 0, 0, 0, 0);
        c.has_channel = u32::from(!channel.is_null());
        Some(slot as u32)
    });
    let Some(slot) = slot else { return null(libc::ENOMEM) };
    if !channel.is_null() {
        let addr = cq_address(slot);
        if libc::bind((*channel).fd, &addr as *const _ as *const libc::sockaddr, cq_address_len(slot)) != 0 {
            // One channel per CQ is what kvring uses; a second CQ on one
            // channel would need a second address.
            locked(|f| f.cqs[slot as usize].used = 0);
            return null(libc::EBUSY);
        }
        (*(channel as *mut FakeChannel)).cqs.fetch_add(1, Ordering::Relaxed);
    }
    count(context, 1);
    let mut raw: ibv_cq = std::mem::zeroed();
    raw.context = context;
    raw.channel = channel;
    raw.cq_context = cq_context;
    raw.cqe = cqe;
    let cq = Box::into_raw(Box::new(FakeCq { raw, slot, qps: AtomicU64::new(0), unacked: AtomicU64::new(0) }));
    local_cqs().lock().unwrap().insert(slot, cq as usize);
    &mut (*cq).raw
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    let fake = cq as *mut FakeCq;
    // ibv_create_cq(3) / ibv_destroy_cq: fails while a QP uses the CQ.
    if (*fake).qps.load(Ordering::Relaxed) != 0 {
        log("ibv_destroy_cq: a QP still uses it");
        return ret(libc::EBUSY);
    }
    // ibv_get_cq_event(3) NOTES: destroying a CQ waits until every event
    // taken from it is acknowledged; the fake fails loudly instead of hanging.
    if (*fake).unacked.load(Ordering::Relaxed) != 0 {
        log("ibv_destroy_cq: events taken but not acknowledged");
        return ret(libc::EBUSY);
    }
    let slot = (*fake).slot;
    locked(|f| f.cqs[slot as usize].used = 0);
    local_cqs().lock().unwrap().remove(&slot);
    if !(*cq).channel.is_null() {
        (*((*cq).channel as *mut FakeChannel)).cqs.fetch_sub(1, Ordering::Relaxed);
    }
    count((*cq).context, -1);
    drop(Box::from_raw(fake));
    0
}

/// An SRQ (the ibv_srq first): its receive ring lives in the fabric.
#[repr(C)]
pub struct FakeSrq {
    pub raw: ibv_srq,
    pub slot: u32,
    pub max_sge: u32,
    pub qps: AtomicU64,
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_srq(pd: *mut ibv_pd, init: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    let attr = (*init).attr;
    if super::control::failed((*pd).context) {
        return null(libc::EIO);
    }
    // A device without SRQs (max_srq 0): libibverbs' default op answers
    // EOPNOTSUPP (rdma-core libibverbs/dummy_ops.c, create_srq).
    if !spec_of((*pd).context).srq {
        return null(libc::EOPNOTSUPP);
    }
    // ibv_create_srq(3): max_wr and max_sge within the device's max_srq_wr
    // and max_srq_sge; the actual values are written back.
    if attr.max_wr == 0 || attr.max_wr as usize > SRQ_RING || attr.max_sge > 1 {
        return null(libc::EINVAL);
    }
    let pid = std::process::id();
    let slot = locked(|f| {
        let slot = f.srqs.iter().position(|s| s.used == 0)?;
        let s = &mut f.srqs[slot];
        (s.used, s.pid, s.max_wr, s.head, s.tail) = (1, pid, attr.max_wr, 0, 0);
        Some(slot as u32)
    });
    let Some(slot) = slot else { return null(libc::ENOMEM) };
    pd_objects(pd, 1);
    let mut raw: ibv_srq = std::mem::zeroed();
    raw.context = (*pd).context;
    raw.pd = pd;
    raw.srq_context = (*init).srq_context;
    let srq = Box::into_raw(Box::new(FakeSrq { raw, slot, max_sge: attr.max_sge, qps: AtomicU64::new(0) }));
    &mut (*srq).raw
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    let fake = srq as *mut FakeSrq;
    // ibv_create_srq(3) / ibv_destroy_srq: fails while a QP uses the SRQ.
    if (*fake).qps.load(Ordering::Relaxed) != 0 {
        log("ibv_destroy_srq: a QP still uses it");
        return ret(libc::EBUSY);
    }
    locked(|f| f.srqs[(*fake).slot as usize].used = 0);
    pd_objects((*srq).pd, -1);
    drop(Box::from_raw(fake));
    0
}

/// A QP (the ibv_qp first) and its send-queue bookkeeping.
#[repr(C)]
pub struct FakeQp {
    pub raw: ibv_qp,
    pub slot: u32,
    pub cap: ibv_qp_cap,
    /// WRs posted, and retired (freed by a polled signalled completion at or
    /// after them: ibv_post_send(3) IBV_SEND_SIGNALED, ibv_create_qp(3)).
    pub posted: AtomicU64,
    pub retired: AtomicU64,
    pub sig_all: bool,
    pub attr: Mutex<ibv_qp_attr>,
    pub wrs: AtomicU64,
    /// Async events about it taken and not yet acked.
    pub unacked_events: AtomicU64,
}

pub fn local_qps() -> &'static Mutex<HashMap<u32, usize>> {
    static MAP: std::sync::OnceLock<Mutex<HashMap<u32, usize>>> = std::sync::OnceLock::new();
    MAP.get_or_init(Default::default)
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    let i = &mut *init;
    let cap = i.cap;
    if super::control::failed((*pd).context) {
        return null(libc::EIO);
    }
    // ibv_create_qp(3): the requested caps must be within the device's
    // (ibv_query_device(3) max_qp_wr, max_sge; inline at most the provider's).
    if i.qp_type != IBV_QPT_RC || i.send_cq.is_null() || i.recv_cq.is_null() {
        return null(libc::EINVAL);
    }
    if cap.max_send_wr == 0
        || cap.max_send_wr > MAX_QP_WR
        || cap.max_send_sge > MAX_SGE
        || cap.max_inline_data > MAX_INLINE
    {
        log("ibv_create_qp: caps beyond the device's");
        return null(libc::EINVAL);
    }
    let recv_cq = (*(i.recv_cq as *const FakeCq)).slot;
    let srq = if i.srq.is_null() { 0 } else { (*(i.srq as *const FakeSrq)).slot + 1 };
    let spec = spec_of((*pd).context);
    let pid = std::process::id();
    let slot = locked(|f| {
        let slot = f.qps.iter().position(|q| q.used == 0)?;
        f.next_qpn = (f.next_qpn + 1) & 0x00ff_ffff;
        let qpn = (f.next_qpn.max(1) << 12 | slot as u32) & 0x00ff_ffff;
        let qpn = if qpn == 0 { slot as u32 + 1 } else { qpn };
        f.qps[slot] = fabric::QpRec {
            used: 1,
            pid,
            qpn,
            state: IBV_QPS_RESET,
            srq,
            recv_cq,
            access: 0,
            port_mtu: spec.mtu,
            device: spec.index,
            _pad: 0,
        };
        Some((slot as u32, qpn))
    });
    let Some((slot, qpn)) = slot else { return null(libc::ENOMEM) };
    // The provider may round caps up; it writes back what it made
    // (ibv_create_qp(3)): more slots than asked, inline at its own size.
    let actual = ibv_qp_cap {
        max_send_wr: cap.max_send_wr,
        max_recv_wr: if srq != 0 { 0 } else { cap.max_recv_wr },
        max_send_sge: cap.max_send_sge.max(1),
        max_recv_sge: cap.max_recv_sge,
        max_inline_data: cap.max_inline_data,
    };
    i.cap = actual;
    pd_objects(pd, 1);
    (*(i.send_cq as *const FakeCq)).qps.fetch_add(1, Ordering::Relaxed);
    if i.recv_cq != i.send_cq {
        (*(i.recv_cq as *const FakeCq)).qps.fetch_add(1, Ordering::Relaxed);
    }
    if !i.srq.is_null() {
        (*(i.srq as *const FakeSrq)).qps.fetch_add(1, Ordering::Relaxed);
    }
    let mut raw: ibv_qp = std::mem::zeroed();
    raw.context = (*pd).context;
    raw.qp_context = i.qp_context;
    raw.pd = pd;
    raw.send_cq = i.send_cq;
    raw.recv_cq = i.recv_cq;
    raw.srq = i.srq;
    raw.qp_num = qpn;
    raw.state = IBV_QPS_RESET;
    raw.qp_type = IBV_QPT_RC;
    let qp = Box::into_raw(Box::new(FakeQp {
        raw,
        slot,
        cap: actual,
        posted: AtomicU64::new(0),
        retired: AtomicU64::new(0),
        sig_all: i.sq_sig_all != 0,
        attr: Mutex::new(ibv_qp_attr::default()),
        wrs: AtomicU64::new(0),
        unacked_events: AtomicU64::new(0),
    }));
    local_qps().lock().unwrap().insert(qpn, qp as usize);
    &mut (*qp).raw
}

/// The RC rows of ibv_modify_qp(3)'s table: (from, to, required mask).
fn required(from: c_uint, to: c_uint) -> Option<c_int> {
    Some(match (from, to) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => IBV_QP_STATE,
        (IBV_QPS_RESET, IBV_QPS_INIT) => IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
        (IBV_QPS_INIT, IBV_QPS_RTR) => {
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER
        }
        (IBV_QPS_RTR, IBV_QPS_RTS) => {
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC
        }
        (IBV_QPS_INIT, IBV_QPS_INIT) => IBV_QP_STATE,
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    let fake = &*(qp as *const FakeQp);
    let a = *attr;
    let from = (*qp).state;
    if super::control::failed((*qp).context) {
        return ret(libc::EIO);
    }
    let to = if mask & IBV_QP_STATE != 0 { a.qp_state } else { from };
    // ibv_modify_qp(3): the table of required attributes per transition; an
    // illegal transition or a missing attribute fails with EINVAL and, as
    // its NOTES say, changes nothing.
    let Some(needed) = required(from, to) else {
        log(&format!("ibv_modify_qp: no transition {from} -> {to}"));
        return ret(libc::EINVAL);
    };
    if mask & needed != needed {
        log(&format!("ibv_modify_qp: {from} -> {to} lacks attributes {:#x}", needed & !mask));
        return ret(libc::EINVAL);
    }
    let spec = spec_of((*qp).context);
    if to == IBV_QPS_INIT && a.port_num != 1 {
        return ret(libc::EINVAL);
    }
    if to == IBV_QPS_RTR {
        // ibv_query_port(3) active_mtu bounds the path MTU of this port.
        if a.path_mtu > mtu_enum(spec.mtu) || a.path_mtu < 1 {
            log("ibv_modify_qp: path_mtu above the port's active_mtu");
            return ret(libc::EINVAL);
        }
        // ibv_query_device(3): max_dest_rd_atomic <= max_qp_rd_atom.
        if a.max_dest_rd_atomic > MAX_RD_ATOM {
            log("ibv_modify_qp: max_dest_rd_atomic above max_qp_rd_atom");
            return ret(libc::EINVAL);
        }
        // RoCE needs a GRH (ibv_query_port(3): IBV_QPF_GRH_REQUIRED on
        // Ethernet ports); the source GID index names a valid entry of the
        // port's table (ibv_query_gid_ex(3): an empty one is ENODATA).
        let sgid = a.ah_attr.grh.sgid_index;
        if (spec.ethernet && a.ah_attr.is_global == 0) || (a.ah_attr.is_global != 0 && !gid_valid((*qp).context, sgid))
        {
            log("ibv_modify_qp: bad address vector (GRH / sgid_index)");
            return ret(libc::EINVAL);
        }
        if a.ah_attr.is_global != 0 && a.ah_attr.grh.dgid.raw == [0; 16] {
            return ret(libc::EINVAL);
        }
    }
    if to == IBV_QPS_RTS && a.max_rd_atomic > MAX_RD_ATOM {
        log("ibv_modify_qp: max_rd_atomic above max_qp_init_rd_atom");
        return ret(libc::EINVAL);
    }
    if to == IBV_QPS_RTS && port_down() {
        return ret(libc::EINVAL);
    }
    let mut kept = fake.attr.lock().unwrap();
    if mask & IBV_QP_ACCESS_FLAGS != 0 {
        kept.qp_access_flags = a.qp_access_flags;
    }
    if mask & IBV_QP_PATH_MTU != 0 {
        kept.path_mtu = a.path_mtu;
    }
    if mask & IBV_QP_DEST_QPN != 0 {
        kept.dest_qp_num = a.dest_qp_num;
    }
    if mask & IBV_QP_RNR_RETRY != 0 {
        kept.rnr_retry = a.rnr_retry;
    }
    if mask & IBV_QP_TIMEOUT != 0 {
        kept.timeout = a.timeout;
    }
    if mask & IBV_QP_RETRY_CNT != 0 {
        kept.retry_cnt = a.retry_cnt;
    }
    kept.qp_state = to;
    drop(kept);
    (*qp).state = to;
    let slot = fake.slot as usize;
    locked(|f| {
        f.qps[slot].state = to;
        if mask & IBV_QP_ACCESS_FLAGS != 0 {
            f.qps[slot].access = a.qp_access_flags;
        }
    });
    if to == IBV_QPS_ERR && from != IBV_QPS_ERR && !(*qp).srq.is_null() {
        last_wqe_reached(qp);
    }
    if to == IBV_QPS_RESET {
        super::post::forget_held((*qp).qp_num);
        fake.posted.store(0, Ordering::Relaxed);
        fake.retired.store(0, Ordering::Relaxed);
        clean_cq(qp);
    }
    0
}

/// An SRQ-attached QP entered ERR: IBTA §10.3.1 (quoted in Linux commit
/// 844bc12e6da3) and ibv_get_async_event(3) IBV_EVENT_QP_LAST_WQE_REACHED:
/// no receive of the SRQ will complete on it any more. The fake completes
/// synchronously, so every completion it had is already on its CQ.
pub unsafe fn last_wqe_reached(qp: *mut ibv_qp) {
    raise_event((*qp).context, IBV_EVENT_QP_LAST_WQE_REACHED, qp as usize);
}

/// What mlx5 does when a QP goes to RESET or is destroyed
/// (providers/mlx5/verbs.c mlx5_modify_qp → mlx5_cq_clean, cq.c
/// free_res_cqe → mlx5_free_srq_wqe): its unpolled completions are removed
/// from its CQs, and the SRQ WQEs they consumed go back on the SRQ's free
/// list: their slots can take new receives, but the receives themselves
/// are gone (nobody re-posts them unless the caller counts them).
/// In the fake's ring the consumed receive already left the occupancy when
/// it was taken, so dropping the completion is the whole of it.
unsafe fn clean_cq(qp: *mut ibv_qp) {
    let qpn = (*qp).qp_num;
    let cq_slot = (*((*qp).recv_cq as *const FakeCq)).slot as usize;
    locked(|f| {
        let c = &mut f.cqs[cq_slot];
        let mut kept = Vec::new();
        while c.head != c.tail {
            let wc = c.ring[c.head as usize % CQ_RING];
            c.head = c.head.wrapping_add(1);
            if wc.qp_num != qpn {
                kept.push(wc);
            }
        }
        for wc in kept {
            c.ring[c.tail as usize % CQ_RING] = wc;
            c.tail = c.tail.wrapping_add(1);
        }
    });
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    let fake = qp as *mut FakeQp;
    // ibv_get_async_event(3): "ibv_destroy_qp() will wait for all affiliated
    // events to be acknowledged" (bounded here: a fake must not hang CI).
    forget_events((*qp).context, qp as usize);
    for _ in 0..5000 {
        if (*fake).unacked_events.load(Ordering::Relaxed) == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    if (*fake).unacked_events.load(Ordering::Relaxed) != 0 {
        log("ibv_destroy_qp: its async events were never acknowledged");
        return ret(libc::EBUSY);
    }
    super::post::forget_held((*qp).qp_num);
    clean_cq(qp);
    locked(|f| f.qps[(*fake).slot as usize].used = 0);
    local_qps().lock().unwrap().remove(&(*qp).qp_num);
    (*((*qp).send_cq as *const FakeCq)).qps.fetch_sub(1, Ordering::Relaxed);
    if (*qp).recv_cq != (*qp).send_cq {
        (*((*qp).recv_cq as *const FakeCq)).qps.fetch_sub(1, Ordering::Relaxed);
    }
    if !(*qp).srq.is_null() {
        (*((*qp).srq as *const FakeSrq)).qps.fetch_sub(1, Ordering::Relaxed);
    }
    pd_objects((*qp).pd, -1);
    drop(Box::from_raw(fake));
    0
}
