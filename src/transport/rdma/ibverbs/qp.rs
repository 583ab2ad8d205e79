//! Queue pairs: creation sized within the device's limits, the RC state
//! walk, posting send lists and polling completions. Post and poll turn
//! handles into pointers through the lock-free slots and call the
//! context's ops as verbs.h's inline `ibv_post_send` / `ibv_poll_cq` do.

use super::ffi::*;
use super::{failed, failed_code, mtu_bytes, mtu_enum, unknown, IbVerbs, QpInfo, POLL_MAX, RD_ATOMIC};
use crate::error::{Error, Result};
use crate::transport::rdma::verbs::*;

/// A fresh 24-bit starting PSN for each QP (finding 16: a fixed hash of the
/// QPN let a reused QP accept packets of its previous connection;
/// rc_pingpong.c picks `lrand48() & 0xffffff`).
fn random_psn() -> u32 {
    let mut bytes = [0u8; 4];
    // SAFETY: getrandom fills the 4 bytes of our buffer.
    let filled = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), 4, 0) };
    if filled != 4 {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        bytes = nanos.subsec_nanos().to_le_bytes();
    }
    u32::from_le_bytes(bytes) & 0x00ff_ffff
}

/// Creates an RC QP on `pd` whose sends and receives complete on `cq`.
pub(super) fn create(verbs: &IbVerbs, pd: Pd, cq: Cq, caps: QpCaps) -> Result<(Qp, QpEndpoint)> {
    let lib = verbs.lib()?;
    let raw_pd = verbs.pd(pd)?;
    let raw_cq = verbs.cqs.get(cq.0).ok_or_else(|| unknown("cq"))?;
    let raw_srq = match caps.srq {
        Some(srq) => verbs.srqs.get(srq.0).ok_or_else(|| unknown("srq"))?,
        None => std::ptr::null_mut(),
    };
    // SAFETY: `raw_pd` is live; its context is the device's.
    let context = unsafe { (*raw_pd.0).context };
    let limits = verbs
        .lock()
        .contexts
        .values()
        .find(|(raw, ..)| raw.0 == context)
        .map(|(_, _, limits)| *limits)
        .ok_or_else(|| unknown("context"))?;
    let mut init = ibv_qp_init_attr {
        qp_context: std::ptr::null_mut(),
        send_cq: raw_cq,
        recv_cq: raw_cq,
        // Receives come from the shared queue, if any; the QP's own receive
        // queue is then ignored (ibv_create_qp(3)).
        srq: raw_srq,
        cap: ibv_qp_cap {
            max_send_wr: caps.max_send_wr.min(limits.max_qp_wr),
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: caps.max_inline,
        },
        qp_type: IBV_QPT_RC,
        sq_sig_all: 0,
    };
    // SAFETY: `raw_pd` is live and `init` is filled.
    let qp = unsafe { (lib.create_qp)(raw_pd.0, &mut init) };
    if qp.is_null() {
        return Err(failed("verbs", "creating a queue pair"));
    }
    // SAFETY: `qp` is live.
    let qpn = unsafe { (*qp).qp_num };
    let mut port: ibv_port_attr = super::query::zeroed_port();
    let mut gid = ibv_gid::default();
    // SAFETY: `context` is live; the out-pointers are ours and as large as
    // verbs.h's structs.
    let rc = unsafe {
        let rc = (lib.query_port)(context, caps.port, &mut port);
        if rc != 0 {
            rc
        } else {
            (lib.query_gid)(context, caps.port, i32::from(caps.gid_index), &mut gid)
        }
    };
    // The GID is queried again at every QP, so an address that went away
    // since the node opened is refused here, by index, rather than at RTR or
    // as RETRY_EXC_ERR (finding 12). InfiniBand routes by LID as well.
    let empty = rc == 0 && port.link_layer == IBV_LINK_LAYER_ETHERNET && gid.raw == [0; 16];
    let Some(handle) = (rc == 0 && !empty).then(|| verbs.qps.insert(qp)).flatten() else {
        // SAFETY: destroying the QP just created, once.
        unsafe { (lib.destroy_qp)(qp) };
        return Err(Error::Device {
            device: "verbs".into(),
            reason: match (rc, empty) {
                (0, true) => {
                    format!("GID index {} of port {} is empty (no address there now)", caps.gid_index, caps.port)
                }
                (0, false) => "too many queue pairs".into(),
                _ => format!("querying port {} and GID index {} failed", caps.port, caps.gid_index),
            },
        });
    };
    let psn = random_psn();
    let info = QpInfo {
        port: caps.port,
        gid_index: caps.gid_index,
        psn,
        active_mtu: port.active_mtu,
        rd_atom: (limits.max_qp_init_rd_atom, limits.max_qp_rd_atom),
        state: IBV_QPS_RESET,
    };
    let mut tables = verbs.lock();
    tables.qps.insert(handle, info);
    tables.qp_handles.insert(qp as usize, handle);
    tables.counts.qps.0 += 1;
    let endpoint = QpEndpoint { qpn, psn, gid: gid.raw, lid: port.lid, mtu: mtu_bytes(port.active_mtu) };
    Ok((Qp(handle), endpoint))
}

/// Moves a QP one step of the RC walk, with exactly the attributes
/// ibv_modify_qp(3)'s table requires for that step.
pub(super) fn modify(verbs: &IbVerbs, qp: Qp, transition: QpTransition) -> Result<()> {
    let lib = verbs.lib()?;
    let raw = verbs.qps.get(qp.0).ok_or_else(|| unknown("qp"))?;
    let info = *verbs.lock().qps.get(&qp.0).ok_or_else(|| unknown("qp"))?;
    let mut attr = ibv_qp_attr::default();
    let mask = match transition {
        QpTransition::Init => {
            attr.qp_state = IBV_QPS_INIT;
            attr.port_num = info.port;
            attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS
        }
        QpTransition::ReadyToReceive(remote) => {
            attr.qp_state = IBV_QPS_RTR;
            // Neither end may send more than its own port carries (finding 5).
            attr.path_mtu = mtu_enum(remote.mtu).min(info.active_mtu.max(IBV_MTU_256));
            attr.dest_qp_num = remote.qpn;
            attr.rq_psn = remote.psn;
            attr.max_dest_rd_atomic = RD_ATOMIC.min(info.rd_atom.1.max(1));
            attr.min_rnr_timer = 12;
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = info.gid_index;
            attr.ah_attr.grh.hop_limit = 64;
            attr.ah_attr.grh.traffic_class = verbs.options.traffic_class;
            attr.ah_attr.sl = verbs.options.service_level;
            attr.ah_attr.dlid = remote.lid;
            attr.ah_attr.port_num = info.port;
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER
        }
        QpTransition::ReadyToSend => {
            attr.qp_state = IBV_QPS_RTS;
            attr.timeout = 14;
            attr.retry_cnt = 7;
            attr.rnr_retry = 7;
            attr.sq_psn = info.psn;
            attr.max_rd_atomic = RD_ATOMIC.min(info.rd_atom.0.max(1));
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC
        }
        QpTransition::Reset => {
            attr.qp_state = IBV_QPS_RESET;
            IBV_QP_STATE
        }
        QpTransition::Error => {
            attr.qp_state = IBV_QPS_ERR;
            IBV_QP_STATE
        }
    };
    // SAFETY: `raw` is a live QP; `attr` is filled for exactly the fields
    // `mask` names. It returns the errno value (ibv_modify_qp(3)).
    let rc = unsafe { (lib.modify_qp)(raw, &mut attr, mask) };
    if rc != 0 {
        return Err(failed_code("verbs", &format!("moving a queue pair: {transition:?}"), rc));
    }
    if let Some(info) = verbs.lock().qps.get_mut(&qp.0) {
        info.state = attr.qp_state;
    }
    Ok(())
}

/// Posts `wrs` as one list.
pub(super) fn post_send(verbs: &IbVerbs, qp: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
    let invalid = |why: &str| PostError { posted: 0, error: PostFailure::Invalid(why.into()) };
    let raw = verbs.qps.get(qp.0).ok_or_else(|| invalid("unknown qp handle"))?;
    if wrs.is_empty() {
        return Ok(());
    }
    let mut sges: Vec<ibv_sge> =
        wrs.iter().map(|w| ibv_sge { addr: w.local_addr, length: w.len, lkey: w.lkey }).collect();
    // SAFETY: zeroed send WRs are valid plain C data, filled below.
    let mut list: Vec<ibv_send_wr> = (0..wrs.len()).map(|_| unsafe { std::mem::zeroed() }).collect();
    let base = list.as_mut_ptr();
    for (i, (wr, raw_wr)) in wrs.iter().zip(list.iter_mut()).enumerate() {
        raw_wr.wr_id = wr.wr_id;
        raw_wr.sg_list = &mut sges[i];
        raw_wr.num_sge = 1;
        raw_wr.opcode = match wr.op {
            WrOp::Write => IBV_WR_RDMA_WRITE,
            WrOp::Read => IBV_WR_RDMA_READ,
            WrOp::WriteImm(imm) => {
                // Network byte order on the wire, as the receiver reads it.
                raw_wr.imm_data = imm.to_be();
                IBV_WR_RDMA_WRITE_WITH_IMM
            }
        };
        let mut flags = 0;
        if wr.signaled {
            flags |= IBV_SEND_SIGNALED;
        }
        if wr.inline {
            flags |= IBV_SEND_INLINE;
        }
        raw_wr.send_flags = flags;
        raw_wr.remote_addr = wr.remote_addr;
        raw_wr.rkey = wr.rkey;
        // SAFETY: `i + 1 < len` when followed; the last one ends the chain.
        raw_wr.next = if i + 1 < wrs.len() { unsafe { base.add(i + 1) } } else { std::ptr::null_mut() };
    }
    let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
    // SAFETY: `raw` is a live QP whose context's ops verbs.h's inline
    // ibv_post_send calls; the list and its SGEs live until return.
    let rc = unsafe {
        match (*(*raw).context).ops.post_send {
            Some(post) => post(raw, base, &mut bad),
            None => return Err(invalid("this provider has no post_send")),
        }
    };
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: `bad` points into `list` when set.
    let posted = if bad.is_null() { 0 } else { unsafe { bad.offset_from(base) }.max(0) as usize };
    // ENOMEM is the full send queue (ibv_post_send(3)), but mlx5 also
    // answers it for a QP that is not ready to send (providers/mlx5/qp.c
    // `_mlx5_post_send`), which no amount of polling fixes: only a QP kvring
    // moved to RTS is full (finding 13). Anything else can never be posted
    // as is. The table is read on this failure path only.
    let state = verbs.lock().qps.get(&qp.0).map(|info| info.state);
    let error = match (rc, state) {
        (libc::ENOMEM, Some(IBV_QPS_RTS)) => PostFailure::QueueFull,
        (libc::ENOMEM, state) => PostFailure::Invalid(format!(
            "ibv_post_send: {} on a queue pair not ready to send (state {})",
            std::io::Error::from_raw_os_error(rc),
            state.map_or("unknown".into(), |s| s.to_string())
        )),
        _ => PostFailure::Invalid(format!("ibv_post_send: {}", std::io::Error::from_raw_os_error(rc))),
    };
    Err(PostError { posted, error })
}

/// Takes up to `out.len()` completions.
pub(super) fn poll_cq(verbs: &IbVerbs, cq: Cq, out: &mut [Wc]) -> Result<usize> {
    let raw = verbs.cqs.get(cq.0).ok_or_else(|| unknown("cq"))?;
    // On the stack: a lane polls every round, and an empty poll must
    // cost no allocation.
    let mut wcs = [ibv_wc::default(); POLL_MAX];
    let want = out.len().min(POLL_MAX);
    // SAFETY: `raw` is a live CQ whose context's ops verbs.h's inline
    // ibv_poll_cq calls; `wcs` holds at least `want` entries.
    let n = unsafe {
        match (*(*raw).context).ops.poll_cq {
            Some(poll) => poll(raw, want as i32, wcs.as_mut_ptr()),
            None => return Err(unknown("poll_cq op")),
        }
    };
    if n < 0 {
        // ibv_poll_cq(3): "a negative value" on failure; errno is not set.
        return Err(Error::Device { device: "verbs".into(), reason: format!("polling a completion queue: {n}") });
    }
    for (slot, wc) in out.iter_mut().zip(&wcs[..n as usize]) {
        let status = match wc.status {
            IBV_WC_SUCCESS => WcStatus::Success,
            IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
            IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
            IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
            IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
            other => WcStatus::Other(other),
        };
        if status != WcStatus::Success {
            tracing::debug!(wr_id = wc.wr_id, status = wc.status, vendor_err = wc.vendor_err, "error completion");
        }
        // On an error completion only wr_id, status, qp_num and vendor_err
        // are valid (ibv_poll_cq(3)).
        let ok = wc.status == IBV_WC_SUCCESS;
        let imm = (ok && wc.wc_flags & IBV_WC_WITH_IMM != 0).then(|| u32::from_be(wc.imm_data));
        *slot = Wc { wr_id: wc.wr_id, status, byte_len: if ok { wc.byte_len } else { 0 }, imm };
    }
    Ok(n as usize)
}
