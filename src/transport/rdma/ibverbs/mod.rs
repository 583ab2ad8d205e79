//! The real verbs provider over rdma-sys (cargo feature `rdma`).
//!
//! Every object kvring creates is kept in a table keyed by its handle, so a
//! handle that was never issued, or was already destroyed, is an error
//! rather than a dangling pointer handed to libibverbs.
//!
//! This code compiles in CI with the feature on; it has not yet run on a
//! real NIC (none exists on these machines). The README gives the commands
//! to run its test on one.
//!
//! Functions newer than the oldest libibverbs kvring links against
//! (`ibv_reg_dmabuf_mr`, rdma-core 34; `ibv_reg_mr_iova2`, rdma-core 22)
//! are looked up at run time, not linked, so the binary loads with an
//! older library and says what it lacks when asked for them (`reg.rs`).
//! Shared receive queues, receives and completion channels are `recv.rs`.

mod recv;
mod reg;

use super::devices::{read_sysfs, SYSFS_ROOT};
use super::verbs::*;
use crate::error::{Error, Result};
use rdma_sys::*;
use std::collections::HashMap;
use std::ffi::CStr;
use std::path::Path;
use std::sync::Mutex;

/// Most completions one `poll_cq` call takes.
const POLL_MAX: usize = 64;

/// Raw pointers of live objects, by handle.
#[derive(Debug, Default)]
struct Tables {
    next: u64,
    contexts: HashMap<u64, (*mut ibv_context, String)>,
    pds: HashMap<u64, *mut ibv_pd>,
    mrs: HashMap<u64, *mut ibv_mr>,
    cqs: HashMap<u64, *mut ibv_cq>,
    /// QP, its context, port, GID index and local PSN.
    qps: HashMap<u64, (*mut ibv_qp, u8, u8, u32)>,
    srqs: HashMap<u64, *mut ibv_srq>,
    /// The completion channel of each wakeable CQ.
    channels: HashMap<u64, *mut ibv_comp_channel>,
    counts: ObjectCounts,
}

/// libibverbs, through rdma-sys.
#[derive(Debug, Default)]
pub struct IbVerbs {
    tables: Mutex<Tables>,
}

// SAFETY: the pointers are only dereferenced by libibverbs calls made while
// holding the table lock (or on objects looked up under it); libibverbs
// objects may be used from any thread.
unsafe impl Send for IbVerbs {}
// SAFETY: as above; all access to the tables goes through the mutex.
unsafe impl Sync for IbVerbs {}

impl Tables {
    /// Books a registration just made; returns its keys.
    fn keep_mr(&mut self, mr: *mut ibv_mr, addr: u64, len: u64) -> Mr {
        self.next += 1;
        let handle = self.next;
        self.mrs.insert(handle, mr);
        self.counts.mrs.0 += 1;
        // SAFETY: `mr` is the live registration just made.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Mr { handle: MrHandle(handle), addr, len, lkey, rkey }
    }

    /// A new handle number.
    fn take_handle(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

fn failed(device: &str, what: &str) -> Error {
    Error::Device { device: device.into(), reason: format!("{what}: {}", std::io::Error::last_os_error()) }
}

fn unknown(what: &str) -> Error {
    Error::Device { device: "verbs".into(), reason: format!("unknown {what} handle") }
}

fn mtu_enum(bytes: u32) -> ibv_mtu::Type {
    match bytes {
        0..=256 => ibv_mtu::IBV_MTU_256,
        257..=512 => ibv_mtu::IBV_MTU_512,
        513..=1024 => ibv_mtu::IBV_MTU_1024,
        1025..=2048 => ibv_mtu::IBV_MTU_2048,
        _ => ibv_mtu::IBV_MTU_4096,
    }
}

fn mtu_bytes(mtu: ibv_mtu::Type) -> u32 {
    128 << mtu.clamp(1, 5)
}

impl IbVerbs {
    /// A provider (nothing is opened yet).
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Device names libibverbs lists (none without a device: errno 38).
    fn device_names() -> Vec<String> {
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer; the list is freed below.
        let list = unsafe { ibv_get_device_list(&mut count) };
        if list.is_null() {
            return Vec::new();
        }
        let names = (0..count.max(0) as usize)
            .filter_map(|i| {
                // SAFETY: `list` holds `count` valid device pointers.
                let device = unsafe { *list.add(i) };
                // SAFETY: `device` is a listed device.
                let name = unsafe { ibv_get_device_name(device) };
                (!name.is_null()).then(|| {
                    // SAFETY: libibverbs returns a NUL-terminated name it owns
                    // for as long as the list lives.
                    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
                })
            })
            .collect();
        // SAFETY: `list` came from ibv_get_device_list and is freed once.
        unsafe { ibv_free_device_list(list) };
        names
    }
}

impl Verbs for IbVerbs {
    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let names = Self::device_names();
        Ok(read_sysfs(Path::new(SYSFS_ROOT)).into_iter().filter(|d| names.contains(&d.name)).collect())
    }

    fn open(&self, device: &str) -> Result<Context> {
        let mut count = 0;
        // SAFETY: as in `device_names`.
        let list = unsafe { ibv_get_device_list(&mut count) };
        if list.is_null() {
            return Err(Error::Device { device: device.into(), reason: "no RDMA devices on this host".into() });
        }
        let mut context = std::ptr::null_mut();
        for i in 0..count.max(0) as usize {
            // SAFETY: `list` holds `count` valid device pointers with names.
            let candidate = unsafe { *list.add(i) };
            // SAFETY: as in `device_names`.
            let name = unsafe { CStr::from_ptr(ibv_get_device_name(candidate)) };
            if name.to_string_lossy() == device {
                // SAFETY: `candidate` is a listed device, opened before the list is freed.
                context = unsafe { ibv_open_device(candidate) };
                break;
            }
        }
        // SAFETY: freed once, after the open.
        unsafe { ibv_free_device_list(list) };
        if context.is_null() {
            return Err(Error::Device { device: device.into(), reason: "not found or could not be opened".into() });
        }
        let mut tables = self.lock();
        tables.next += 1;
        let handle = tables.next;
        tables.contexts.insert(handle, (context, device.to_string()));
        Ok(Context(handle))
    }

    fn close(&self, context: Context) -> Result<()> {
        let (raw, name) = self.lock().contexts.remove(&context.0).ok_or_else(|| unknown("context"))?;
        // SAFETY: `raw` came from ibv_open_device and is closed once (removed above).
        if unsafe { ibv_close_device(raw) } != 0 {
            return Err(failed(&name, "closing"));
        }
        Ok(())
    }

    fn alloc_pd(&self, context: Context) -> Result<Pd> {
        let mut tables = self.lock();
        let (raw, name) = tables.contexts.get(&context.0).cloned().ok_or_else(|| unknown("context"))?;
        // SAFETY: `raw` is a live context (in the table).
        let pd = unsafe { ibv_alloc_pd(raw) };
        if pd.is_null() {
            return Err(failed(&name, "allocating a protection domain"));
        }
        tables.next += 1;
        let handle = tables.next;
        tables.pds.insert(handle, pd);
        tables.counts.pds.0 += 1;
        Ok(Pd(handle))
    }

    fn dealloc_pd(&self, pd: Pd) -> Result<()> {
        let mut tables = self.lock();
        let raw = tables.pds.remove(&pd.0).ok_or_else(|| unknown("pd"))?;
        // SAFETY: `raw` came from ibv_alloc_pd and is freed once.
        if unsafe { ibv_dealloc_pd(raw) } != 0 {
            return Err(failed("verbs", "deallocating a protection domain"));
        }
        tables.counts.pds.1 += 1;
        Ok(())
    }

    unsafe fn reg_mr(&self, pd: Pd, addr: u64, len: u64, access: MrAccess) -> Result<Mr> {
        let mut tables = self.lock();
        let raw_pd = *tables.pds.get(&pd.0).ok_or_else(|| unknown("pd"))?;
        // SAFETY: forwarded from our caller: the range stays valid until dereg.
        let mr = unsafe { reg::host(raw_pd, addr, len, access)? };
        Ok(tables.keep_mr(mr, addr, len))
    }

    unsafe fn reg_dmabuf_mr(
        &self,
        pd: Pd,
        dmabuf: std::os::fd::BorrowedFd<'_>,
        offset: u64,
        len: u64,
        iova: u64,
        access: MrAccess,
    ) -> Result<Mr> {
        let mut tables = self.lock();
        let raw_pd = *tables.pds.get(&pd.0).ok_or_else(|| unknown("pd"))?;
        // SAFETY: forwarded from our caller: the memory stays allocated until dereg.
        let mr = unsafe { reg::dmabuf(raw_pd, dmabuf, offset, len, iova, access)? };
        Ok(tables.keep_mr(mr, iova, len))
    }

    fn create_wakeable_cq(&self, context: Context, depth: u32) -> Result<(Cq, std::os::fd::RawFd)> {
        recv::create_wakeable_cq(&mut self.lock(), context, depth)
    }

    fn arm_cq(&self, cq: Cq) -> Result<()> {
        let raw = *self.lock().cqs.get(&cq.0).ok_or_else(|| unknown("cq"))?;
        // SAFETY: a live CQ (in the table); asks for one event at the next completion.
        if unsafe { ibv_req_notify_cq(raw, 0) } != 0 {
            return Err(failed("verbs", "arming a completion queue"));
        }
        Ok(())
    }

    fn take_cq_events(&self, cq: Cq) -> Result<()> {
        recv::take_events(&self.lock(), cq)
    }

    fn create_srq(&self, pd: Pd, depth: u32) -> Result<Srq> {
        recv::create_srq(&mut self.lock(), pd, depth)
    }

    fn destroy_srq(&self, srq: Srq) -> Result<()> {
        let mut tables = self.lock();
        let raw = tables.srqs.remove(&srq.0).ok_or_else(|| unknown("srq"))?;
        // SAFETY: `raw` came from ibv_create_srq and is destroyed once.
        if unsafe { ibv_destroy_srq(raw) } != 0 {
            return Err(failed("verbs", "destroying a shared receive queue"));
        }
        tables.counts.srqs.1 += 1;
        Ok(())
    }

    fn post_srq_recv(&self, srq: Srq, wr_ids: &[u64]) -> Result<()> {
        let raw = *self.lock().srqs.get(&srq.0).ok_or_else(|| unknown("srq"))?;
        // SAFETY: a live SRQ (in the table).
        unsafe { recv::post_receives(raw, wr_ids) }
    }

    fn dereg_mr(&self, mr: MrHandle) -> Result<()> {
        let mut tables = self.lock();
        let raw = tables.mrs.remove(&mr.0).ok_or_else(|| unknown("mr"))?;
        // SAFETY: `raw` came from ibv_reg_mr and is deregistered once.
        if unsafe { ibv_dereg_mr(raw) } != 0 {
            return Err(failed("verbs", "deregistering memory"));
        }
        tables.counts.mrs.1 += 1;
        Ok(())
    }

    fn create_cq(&self, context: Context, depth: u32) -> Result<Cq> {
        let mut tables = self.lock();
        let (raw, name) = tables.contexts.get(&context.0).cloned().ok_or_else(|| unknown("context"))?;
        // SAFETY: `raw` is a live context; no channel, no context pointer.
        let cq = unsafe { ibv_create_cq(raw, depth as i32, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(failed(&name, "creating a completion queue"));
        }
        tables.next += 1;
        let handle = tables.next;
        tables.cqs.insert(handle, cq);
        tables.counts.cqs.0 += 1;
        Ok(Cq(handle))
    }

    fn destroy_cq(&self, cq: Cq) -> Result<()> {
        let mut tables = self.lock();
        let raw = tables.cqs.remove(&cq.0).ok_or_else(|| unknown("cq"))?;
        // SAFETY: `raw` came from ibv_create_cq and is destroyed once.
        if unsafe { ibv_destroy_cq(raw) } != 0 {
            return Err(failed("verbs", "destroying a completion queue"));
        }
        tables.counts.cqs.1 += 1;
        if let Some(channel) = tables.channels.remove(&cq.0) {
            // SAFETY: the channel's only CQ is destroyed (its events were
            // acknowledged as they were taken); destroyed once.
            unsafe { ibv_destroy_comp_channel(channel) };
        }
        Ok(())
    }

    fn create_qp(&self, pd: Pd, cq: Cq, caps: QpCaps) -> Result<(Qp, QpEndpoint)> {
        let mut tables = self.lock();
        let raw_pd = *tables.pds.get(&pd.0).ok_or_else(|| unknown("pd"))?;
        let raw_cq = *tables.cqs.get(&cq.0).ok_or_else(|| unknown("cq"))?;
        let raw_srq = match caps.srq {
            Some(srq) => *tables.srqs.get(&srq.0).ok_or_else(|| unknown("srq"))?,
            None => std::ptr::null_mut(),
        };
        // SAFETY: a zeroed init-attr is a valid starting point (plain C data).
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = raw_cq;
        init.recv_cq = raw_cq;
        // Receives come from the shared queue, if any; the QP's own receive
        // queue is then ignored by the NIC.
        init.srq = raw_srq;
        init.cap = ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: caps.max_inline,
        };
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        // SAFETY: `raw_pd` is live and `init` is filled.
        let qp = unsafe { ibv_create_qp(raw_pd, &mut init) };
        if qp.is_null() {
            return Err(failed("verbs", "creating a queue pair"));
        }
        // SAFETY: `qp` is live; its context is the device's.
        let (qpn, context) = unsafe { ((*qp).qp_num, (*qp).context) };
        // SAFETY: zeroed port attributes are a valid out-parameter.
        let mut port: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: a zeroed GID is a valid out-parameter.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: `context` is live; the out-pointers are ours.
        let queried = unsafe {
            ___ibv_query_port(context, caps.port, &mut port) == 0
                && ibv_query_gid(context, caps.port, i32::from(caps.gid_index), &mut gid) == 0
        };
        if !queried {
            // SAFETY: destroying the QP just created, once.
            unsafe { ibv_destroy_qp(qp) };
            return Err(failed("verbs", "querying the port and GID"));
        }
        let psn = (qpn.wrapping_mul(2_654_435_761)) & 0x00ff_ffff;
        tables.next += 1;
        let handle = tables.next;
        tables.qps.insert(handle, (qp, caps.port, caps.gid_index, psn));
        tables.counts.qps.0 += 1;
        // SAFETY: `raw` is the union's byte view of the GID just read.
        let gid = unsafe { gid.raw };
        Ok((Qp(handle), QpEndpoint { qpn, psn, gid, lid: port.lid, mtu: mtu_bytes(port.active_mtu) }))
    }

    fn modify_qp(&self, qp: Qp, transition: QpTransition) -> Result<()> {
        let tables = self.lock();
        let (raw, port, gid_index, psn) = *tables.qps.get(&qp.0).ok_or_else(|| unknown("qp"))?;
        // SAFETY: a zeroed attribute block is valid plain C data.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        let mask = match transition {
            QpTransition::Init => {
                attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
                attr.port_num = port;
                attr.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
                    | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
                    | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0) as _;
                ibv_qp_attr_mask::IBV_QP_STATE
                    | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                    | ibv_qp_attr_mask::IBV_QP_PORT
                    | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS
            }
            QpTransition::ReadyToReceive(remote) => {
                attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
                attr.path_mtu = mtu_enum(remote.mtu);
                attr.dest_qp_num = remote.qpn;
                attr.rq_psn = remote.psn;
                attr.max_dest_rd_atomic = 16;
                attr.min_rnr_timer = 12;
                attr.ah_attr.is_global = 1;
                attr.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
                attr.ah_attr.grh.sgid_index = gid_index;
                attr.ah_attr.grh.hop_limit = 64;
                attr.ah_attr.dlid = remote.lid;
                attr.ah_attr.port_num = port;
                ibv_qp_attr_mask::IBV_QP_STATE
                    | ibv_qp_attr_mask::IBV_QP_AV
                    | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                    | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                    | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                    | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                    | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER
            }
            QpTransition::ReadyToSend => {
                attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
                attr.timeout = 14;
                attr.retry_cnt = 7;
                attr.rnr_retry = 7;
                attr.sq_psn = psn;
                attr.max_rd_atomic = 16;
                ibv_qp_attr_mask::IBV_QP_STATE
                    | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                    | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                    | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                    | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                    | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC
            }
            QpTransition::Reset => {
                attr.qp_state = ibv_qp_state::IBV_QPS_RESET;
                ibv_qp_attr_mask::IBV_QP_STATE
            }
        };
        // SAFETY: `raw` is a live QP (in the table, lock held); `attr` is filled
        // for exactly the fields `mask` names.
        if unsafe { ibv_modify_qp(raw, &mut attr, mask.0 as i32) } != 0 {
            return Err(failed("verbs", &format!("moving a queue pair: {transition:?}")));
        }
        Ok(())
    }

    fn destroy_qp(&self, qp: Qp) -> Result<()> {
        let mut tables = self.lock();
        let (raw, ..) = tables.qps.remove(&qp.0).ok_or_else(|| unknown("qp"))?;
        // SAFETY: `raw` came from ibv_create_qp and is destroyed once.
        if unsafe { ibv_destroy_qp(raw) } != 0 {
            return Err(failed("verbs", "destroying a queue pair"));
        }
        tables.counts.qps.1 += 1;
        Ok(())
    }

    fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        let invalid = |why: &str| PostError { posted: 0, error: PostFailure::Invalid(why.into()) };
        let raw = self.lock().qps.get(&qp.0).map(|q| q.0).ok_or_else(|| invalid("unknown qp handle"))?;
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
                WrOp::Write => ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                WrOp::Read => ibv_wr_opcode::IBV_WR_RDMA_READ,
                WrOp::WriteImm(imm) => {
                    // Network byte order on the wire, as the receiver reads it.
                    raw_wr.imm_data_invalidated_rkey_union =
                        imm_data_invalidated_rkey_union_t { imm_data: imm.to_be() };
                    ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
                }
            };
            let mut flags = 0;
            if wr.signaled {
                flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
            }
            if wr.inline {
                flags |= ibv_send_flags::IBV_SEND_INLINE.0;
            }
            raw_wr.send_flags = flags;
            raw_wr.wr.rdma = rdma_t { remote_addr: wr.remote_addr, rkey: wr.rkey };
            // SAFETY: `i + 1 <= len`; a pointer one past the end is never followed.
            raw_wr.next = if i + 1 < wrs.len() { unsafe { base.add(i + 1) } } else { std::ptr::null_mut() };
        }
        if list.is_empty() {
            return Ok(());
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `raw` is a live QP; the list and its SGEs live until return.
        let rc = unsafe { ibv_post_send(raw, base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: `bad` points into `list` when set.
        let posted = if bad.is_null() { 0 } else { unsafe { bad.offset_from(base) }.max(0) as usize };
        let error =
            if rc == libc::ENOMEM { PostFailure::QueueFull } else { PostFailure::Invalid(format!("errno {rc}")) };
        Err(PostError { posted, error })
    }

    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize> {
        let raw = *self.lock().cqs.get(&cq.0).ok_or_else(|| unknown("cq"))?;
        // On the stack: a lane polls every round, and an empty poll must
        // cost no allocation.
        // SAFETY: zeroed work completions are valid out-parameters.
        let mut wcs: [ibv_wc; POLL_MAX] = unsafe { std::mem::zeroed() };
        let want = out.len().min(POLL_MAX);
        // SAFETY: `raw` is a live CQ; `wcs` holds at least `want` entries.
        let n = unsafe { ibv_poll_cq(raw, want as i32, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(failed("verbs", "polling a completion queue"));
        }
        for (slot, wc) in out.iter_mut().zip(&wcs[..n as usize]) {
            let status = match wc.status {
                ibv_wc_status::IBV_WC_SUCCESS => WcStatus::Success,
                ibv_wc_status::IBV_WC_RETRY_EXC_ERR => WcStatus::RetryExceeded,
                ibv_wc_status::IBV_WC_REM_ACCESS_ERR => WcStatus::RemoteAccess,
                ibv_wc_status::IBV_WC_LOC_PROT_ERR => WcStatus::LocalProtection,
                ibv_wc_status::IBV_WC_WR_FLUSH_ERR => WcStatus::Flushed,
                other => WcStatus::Other(other),
            };
            let with_imm = wc.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            // SAFETY: the union holds the immediate when the flag says so.
            let imm = with_imm.then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
            *slot = Wc { wr_id: wc.wr_id, status, byte_len: wc.byte_len, imm };
        }
        Ok(n as usize)
    }

    fn counts(&self) -> ObjectCounts {
        self.lock().counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs on a host with a device; elsewhere it says why it skips.
    #[test]
    fn a_real_device_opens_registers_and_connects_a_qp_to_itself() {
        let verbs = IbVerbs::new();
        let devices = verbs.devices().unwrap();
        let Some(device) = devices.iter().find(|d| d.ports.iter().any(|p| p.active)) else {
            eprintln!("skipped: no RDMA device with an active port under {SYSFS_ROOT}");
            assert!(verbs.open("mlx5_0").is_err(), "no device: opening one is an error, not a crash");
            return;
        };
        let port = device.ports.iter().find(|p| p.active).unwrap();
        let gid_index = super::super::devices::pick_gid(port).unwrap_or(0);
        let context = verbs.open(&device.name).unwrap();
        let pd = verbs.alloc_pd(context).unwrap();
        let cq = verbs.create_cq(context, 64).unwrap();
        let memory = vec![7u8; 8192];
        // SAFETY: `memory` outlives the registration.
        let mr = unsafe { verbs.reg_mr(pd, memory.as_ptr() as u64, 8192, MrAccess::ALL) }.unwrap();
        let caps = QpCaps { max_send_wr: 64, max_inline: 64, port: port.port, gid_index, srq: None };
        let (qp, endpoint) = verbs.create_qp(pd, cq, caps).unwrap();
        verbs.modify_qp(qp, QpTransition::Init).unwrap();
        verbs.modify_qp(qp, QpTransition::ReadyToReceive(endpoint)).unwrap();
        verbs.modify_qp(qp, QpTransition::ReadyToSend).unwrap();
        let wr = SendWr {
            wr_id: 1,
            op: WrOp::Write,
            local_addr: mr.addr,
            len: 4096,
            lkey: mr.lkey,
            remote_addr: mr.addr + 4096,
            rkey: mr.rkey,
            signaled: true,
            inline: false,
        };
        verbs.post_send(qp, &[wr]).unwrap();
        let mut wcs = [Wc::new(0, WcStatus::Success); 4];
        let started = std::time::Instant::now();
        while verbs.poll_cq(cq, &mut wcs).unwrap() == 0 {
            assert!(started.elapsed() < std::time::Duration::from_secs(5), "no completion");
        }
        assert_eq!(wcs[0], Wc::new(1, WcStatus::Success));
        verbs.destroy_qp(qp).unwrap();
        verbs.dereg_mr(mr.handle).unwrap();
        verbs.destroy_cq(cq).unwrap();
        verbs.dealloc_pd(pd).unwrap();
        verbs.close(context).unwrap();
        assert!(verbs.counts().balanced());
    }
}
