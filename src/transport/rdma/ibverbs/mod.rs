//! The real verbs provider: libibverbs loaded at run time (`lib.rs`),
//! through declarations of its C interface kept in this crate (`ffi.rs`).
//!
//! Every object kvring creates is kept in a table keyed by its handle, so a
//! handle that was never issued, or was already destroyed, is an error
//! rather than a dangling pointer handed to libibverbs. QPs, CQs and SRQs,
//! which lanes look up on every post and poll, sit in lock-free slots
//! (`slots.rs`); no lock is held across a verb (review finding 3).
//!
//! In CI it runs against a fake libibverbs (`tests/fakes/ibverbs`) that
//! follows rdma-core's documented rules; `benches/rdma_check.sh` runs it on
//! a host with a NIC. Shared receive queues, receives and completion
//! channels are `recv.rs`; registration `reg.rs`; device queries `query.rs`.

pub mod ffi;
pub mod lib;
mod qp;
mod query;
mod recv;
mod reg;
mod slots;

use super::verbs::*;
use crate::error::{Error, Result};
use crate::gpu::DmaBufRange;
use ffi::*;
use slots::Slots;
use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Mutex;

/// Most completions one `poll_cq` call takes.
const POLL_MAX: usize = 64;
/// Most live QPs (active and accepted, over every NIC) one provider keeps.
const MAX_QPS: u32 = 1 << 17;
/// Most live CQs, and SRQs.
const MAX_CQS: u32 = 1 << 14;
/// The responder resources and initiator depth kvring asks for, clamped to
/// the device's `max_qp_rd_atom` / `max_qp_init_rd_atom` (finding 10).
const RD_ATOMIC: u8 = 16;

/// Where RoCE traffic goes on the fabric: the GRH traffic class (DSCP << 2,
/// e.g. 106 for the lossless class many RoCE fabrics use) and the service
/// level (finding 7). Defaults are the verbs defaults, 0 and 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IbOptions {
    /// `ibv_global_route.traffic_class` (ibv_create_ah(3)).
    pub traffic_class: u8,
    /// `ibv_ah_attr.sl` (ibv_create_ah(3)).
    pub service_level: u8,
}

/// A QP's pointer lives in the slots; what `modify_qp` needs besides.
#[derive(Debug, Clone, Copy)]
struct QpInfo {
    port: u8,
    gid_index: u8,
    psn: u32,
    /// This port's active MTU (`ibv_mtu`), the bound of the path MTU.
    active_mtu: u32,
    /// The device's limits for `max_rd_atomic` / `max_dest_rd_atomic`.
    rd_atom: (u8, u8),
    /// The state kvring last moved it to (`IBV_QPS_*`): a post refused with
    /// ENOMEM is a full queue only when this is RTS (finding 13).
    state: u32,
}

/// Objects that are not on the post/poll path, by handle.
#[derive(Debug, Default)]
struct Tables {
    next: u64,
    contexts: HashMap<u64, (Raw<ibv_context>, String, Limits)>,
    pds: HashMap<u64, Raw<ibv_pd>>,
    mrs: HashMap<u64, Raw<ibv_mr>>,
    qps: HashMap<u64, QpInfo>,
    /// The completion channel of each wakeable CQ.
    channels: HashMap<u64, Raw<ibv_comp_channel>>,
    /// QP pointer → handle, for the QP an async event names.
    qp_handles: HashMap<usize, u64>,
    counts: ObjectCounts,
}

/// A raw libibverbs pointer (Send: libibverbs objects may be used from any
/// thread; mlx5 locks its queues itself).
struct Raw<T>(*mut T);
impl<T> std::fmt::Debug for Raw<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:p}", self.0)
    }
}
impl<T> Clone for Raw<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Raw<T> {}

/// The limits of `ibv_query_device` kvring clamps to.
#[derive(Debug, Clone, Copy, Default)]
struct Limits {
    max_qp_wr: u32,
    max_cqe: u32,
    max_qp_rd_atom: u8,
    max_qp_init_rd_atom: u8,
}

/// libibverbs, loaded at run time.
#[derive(Debug)]
pub struct IbVerbs {
    lib: std::result::Result<&'static lib::Lib, &'static str>,
    options: IbOptions,
    tables: Mutex<Tables>,
    qps: Slots<ibv_qp>,
    cqs: Slots<ibv_cq>,
    srqs: Slots<ibv_srq>,
    /// CQs created so far, for spreading them over completion vectors.
    next_vector: std::sync::atomic::AtomicU32,
}

// SAFETY: the raw pointers are libibverbs objects, usable from any thread
// (libibverbs.md; mlx5 locks its SQ and CQ internally); the tables are
// behind a mutex and the slots are atomics.
unsafe impl Send for IbVerbs {}
// SAFETY: as above.
unsafe impl Sync for IbVerbs {}

impl Tables {
    /// A new handle number.
    fn take_handle(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

fn failed_code(device: &str, what: &str, code: c_int) -> Error {
    Error::Device { device: device.into(), reason: format!("{what}: {}", std::io::Error::from_raw_os_error(code)) }
}

/// For verbs documented to return NULL and set errno.
fn failed(device: &str, what: &str) -> Error {
    let os = std::io::Error::last_os_error();
    let hint = if os.raw_os_error() == Some(libc::ENOMEM) {
        " (registered and queue memory is locked memory: raise `ulimit -l`)"
    } else {
        ""
    };
    Error::Device { device: device.into(), reason: format!("{what}: {os}{hint}") }
}

fn unknown(what: &str) -> Error {
    Error::Device { device: "verbs".into(), reason: format!("unknown {what} handle") }
}

fn mtu_enum(bytes: u32) -> u32 {
    match bytes {
        0..=256 => IBV_MTU_256,
        257..=512 => IBV_MTU_256 + 1,
        513..=1024 => IBV_MTU_256 + 2,
        1025..=2048 => IBV_MTU_256 + 3,
        _ => IBV_MTU_4096,
    }
}

fn mtu_bytes(mtu: u32) -> u32 {
    128 << mtu.clamp(IBV_MTU_256, IBV_MTU_4096)
}

impl Default for IbVerbs {
    fn default() -> Self {
        Self::with_options(IbOptions::default())
    }
}

impl IbVerbs {
    /// A provider over this process's libibverbs (nothing is opened yet; a
    /// host without one gets an error naming why from [`Verbs::devices`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// As [`IbVerbs::new`], with the fabric settings `options`.
    pub fn with_options(options: IbOptions) -> Self {
        Self {
            lib: lib::lib(),
            options,
            tables: Mutex::new(Tables::default()),
            qps: Slots::new(MAX_QPS),
            cqs: Slots::new(MAX_CQS),
            srqs: Slots::new(MAX_CQS),
            next_vector: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// Why this host has no usable libibverbs, if it has none.
    pub fn unavailable() -> Option<&'static str> {
        lib::lib().err()
    }

    fn lib(&self) -> Result<&'static lib::Lib> {
        self.lib.map_err(|why| Error::Device { device: "verbs".into(), reason: why.into() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn context(&self, context: Context) -> Result<(Raw<ibv_context>, String, Limits)> {
        self.lock().contexts.get(&context.0).cloned().ok_or_else(|| unknown("context"))
    }

    fn pd(&self, pd: Pd) -> Result<Raw<ibv_pd>> {
        self.lock().pds.get(&pd.0).copied().ok_or_else(|| unknown("pd"))
    }

    /// Books a registration just made; returns its keys.
    fn keep_mr(&self, mr: *mut ibv_mr, addr: u64, len: u64) -> Mr {
        let mut tables = self.lock();
        let handle = tables.take_handle();
        tables.mrs.insert(handle, Raw(mr));
        tables.counts.mrs.0 += 1;
        // SAFETY: `mr` is the live registration just made.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Mr { handle: MrHandle(handle), addr, len, lkey, rkey }
    }
}

impl Verbs for IbVerbs {
    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        query::devices(self.lib()?)
    }

    fn open(&self, device: &str) -> Result<Context> {
        let lib = self.lib()?;
        let (context, limits) = query::open(lib, device)?;
        let mut tables = self.lock();
        let handle = tables.take_handle();
        tables.contexts.insert(handle, (Raw(context), device.to_string(), limits));
        Ok(Context(handle))
    }

    fn close(&self, context: Context) -> Result<()> {
        let lib = self.lib()?;
        let (raw, name, _) = self.lock().contexts.remove(&context.0).ok_or_else(|| unknown("context"))?;
        // SAFETY: `raw` came from ibv_open_device and is closed once (removed above).
        let rc = unsafe { (lib.close_device)(raw.0) };
        if rc != 0 {
            return Err(failed(&name, "closing"));
        }
        Ok(())
    }

    fn alloc_pd(&self, context: Context) -> Result<Pd> {
        let lib = self.lib()?;
        let (raw, name, _) = self.context(context)?;
        // SAFETY: `raw` is a live context (in the table).
        let pd = unsafe { (lib.alloc_pd)(raw.0) };
        if pd.is_null() {
            return Err(failed(&name, "allocating a protection domain"));
        }
        let mut tables = self.lock();
        let handle = tables.take_handle();
        tables.pds.insert(handle, Raw(pd));
        tables.counts.pds.0 += 1;
        Ok(Pd(handle))
    }

    fn dealloc_pd(&self, pd: Pd) -> Result<()> {
        let lib = self.lib()?;
        let raw = self.lock().pds.remove(&pd.0).ok_or_else(|| unknown("pd"))?;
        // SAFETY: `raw` came from ibv_alloc_pd and is freed once. It returns
        // the errno value (ibv_alloc_pd(3)).
        let rc = unsafe { (lib.dealloc_pd)(raw.0) };
        if rc != 0 {
            return Err(failed_code("verbs", "deallocating a protection domain", rc));
        }
        self.lock().counts.pds.1 += 1;
        Ok(())
    }

    unsafe fn reg_mr(&self, pd: Pd, addr: u64, len: u64, access: MrAccess) -> Result<Mr> {
        let lib = self.lib()?;
        let raw_pd = self.pd(pd)?;
        // No lock is held here: pinning a large region takes seconds.
        // SAFETY: forwarded from our caller: the range stays valid until dereg.
        let mr = unsafe { reg::host(lib, raw_pd.0, addr, len, access)? };
        Ok(self.keep_mr(mr, addr, len))
    }

    unsafe fn reg_dmabuf_mr(&self, pd: Pd, dmabuf: DmaBufRange<'_>, iova: u64, access: MrAccess) -> Result<Mr> {
        let lib = self.lib()?;
        let raw_pd = self.pd(pd)?;
        // SAFETY: forwarded from our caller: the memory stays allocated until dereg.
        let mr = unsafe { reg::dmabuf(lib, raw_pd.0, dmabuf, iova, access)? };
        Ok(self.keep_mr(mr, iova, dmabuf.len))
    }

    fn create_wakeable_cq(&self, context: Context, depth: u32) -> Result<(Cq, std::os::fd::RawFd)> {
        recv::create_wakeable_cq(self, context, depth)
    }

    fn arm_cq(&self, cq: Cq) -> Result<()> {
        let raw = self.cqs.get(cq.0).ok_or_else(|| unknown("cq"))?;
        // SAFETY: a live CQ; verbs.h's inline ibv_req_notify_cq calls its
        // context's op. It returns the errno value (ibv_req_notify_cq(3)).
        let rc = unsafe { ((*(*raw).context).ops.req_notify_cq.ok_or_else(|| unknown("req_notify_cq op"))?)(raw, 0) };
        if rc != 0 {
            return Err(failed_code("verbs", "arming a completion queue", rc));
        }
        Ok(())
    }

    fn take_cq_events(&self, cq: Cq) -> Result<()> {
        recv::take_events(self, cq)
    }

    fn create_srq(&self, pd: Pd, depth: u32) -> Result<Srq> {
        recv::create_srq(self, pd, depth)
    }

    fn destroy_srq(&self, srq: Srq) -> Result<()> {
        let lib = self.lib()?;
        let raw = self.srqs.remove(srq.0).ok_or_else(|| unknown("srq"))?;
        // SAFETY: `raw` came from ibv_create_srq and is destroyed once.
        let rc = unsafe { (lib.destroy_srq)(raw) };
        if rc != 0 {
            return Err(failed_code("verbs", "destroying a shared receive queue", rc));
        }
        self.lock().counts.srqs.1 += 1;
        Ok(())
    }

    fn post_srq_recv(&self, srq: Srq, wr_ids: &[u64]) -> Result<()> {
        let raw = self.srqs.get(srq.0).ok_or_else(|| unknown("srq"))?;
        // SAFETY: a live SRQ (in the slots).
        unsafe { recv::post_receives(raw, wr_ids) }
    }

    fn dereg_mr(&self, mr: MrHandle) -> Result<()> {
        let lib = self.lib()?;
        let raw = self.lock().mrs.remove(&mr.0).ok_or_else(|| unknown("mr"))?;
        // SAFETY: `raw` came from ibv_reg_mr and is deregistered once.
        let rc = unsafe { (lib.dereg_mr)(raw.0) };
        if rc != 0 {
            return Err(failed_code("verbs", "deregistering memory", rc));
        }
        self.lock().counts.mrs.1 += 1;
        Ok(())
    }

    fn create_cq(&self, context: Context, depth: u32) -> Result<Cq> {
        recv::create_cq(self, context, depth, false).map(|(cq, _)| cq)
    }

    fn destroy_cq(&self, cq: Cq) -> Result<()> {
        recv::destroy_cq(self, cq)
    }

    fn create_qp(&self, pd: Pd, cq: Cq, caps: QpCaps) -> Result<(Qp, QpEndpoint)> {
        qp::create(self, pd, cq, caps)
    }

    fn modify_qp(&self, qp: Qp, transition: QpTransition) -> Result<()> {
        qp::modify(self, qp, transition)
    }

    fn destroy_qp(&self, qp: Qp) -> Result<()> {
        let lib = self.lib()?;
        let raw = self.qps.remove(qp.0).ok_or_else(|| unknown("qp"))?;
        // SAFETY: `raw` came from ibv_create_qp and is destroyed once.
        let rc = unsafe { (lib.destroy_qp)(raw) };
        if rc != 0 {
            return Err(failed_code("verbs", "destroying a queue pair", rc));
        }
        let mut tables = self.lock();
        tables.qps.remove(&qp.0);
        tables.qp_handles.remove(&(raw as usize));
        tables.counts.qps.1 += 1;
        Ok(())
    }

    fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        qp::post_send(self, qp, wrs)
    }

    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize> {
        qp::poll_cq(self, cq, out)
    }

    fn counts(&self) -> ObjectCounts {
        self.lock().counts
    }

    fn async_fd(&self, context: Context) -> Option<std::os::fd::RawFd> {
        let (raw, ..) = self.context(context).ok()?;
        // SAFETY: a live context; its descriptor is plain data, made
        // non-blocking when the context was opened.
        Some(unsafe { (*raw.0).async_fd })
    }

    fn take_async_events(&self, context: Context, out: &mut Vec<AsyncEvent>) -> Result<()> {
        let lib = self.lib()?;
        let (raw, ..) = self.context(context)?;
        // Bounded: a context raises few events; more wait for the next call.
        for _ in 0..64 {
            let mut event = ibv_async_event { element: std::ptr::null_mut(), event_type: 0 };
            // SAFETY: a live context whose async_fd is non-blocking: -1
            // (EAGAIN) at once when no event waits (ibv_get_async_event(3)).
            if unsafe { (lib.get_async_event)(raw.0, &mut event) } != 0 {
                break;
            }
            // Port events carry the port number in the element's low bits.
            let port = event.element as usize as u8;
            out.push(match event.event_type {
                IBV_EVENT_PORT_ERR => AsyncEvent::PortError { port },
                IBV_EVENT_PORT_ACTIVE => AsyncEvent::PortActive { port },
                IBV_EVENT_DEVICE_FATAL => AsyncEvent::DeviceFatal,
                IBV_EVENT_CQ_ERR | IBV_EVENT_QP_FATAL => AsyncEvent::QueueFatal,
                IBV_EVENT_GID_CHANGE => AsyncEvent::GidChange { port },
                IBV_EVENT_QP_LAST_WQE_REACHED => match self.lock().qp_handles.get(&(event.element as usize)) {
                    Some(&handle) => AsyncEvent::LastWqeReached { qp: Qp(handle) },
                    None => AsyncEvent::Other(IBV_EVENT_QP_LAST_WQE_REACHED),
                },
                other => AsyncEvent::Other(other),
            });
            // SAFETY: the event just taken, acknowledged once (every event
            // must be: destroying its object waits for it).
            unsafe { (lib.ack_async_event)(&mut event) };
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sizes and offsets of verbs.h as `tests/fakes/ibverbs/layout.c`
    /// prints them (x86_64, rdma-core 44; CI recompiles it against the
    /// installed headers and compares).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_declared_structs_match_verbs_h() {
        use std::mem::{offset_of, size_of};
        let ours: HashMap<&str, usize> = [
            ("ibv_context", size_of::<ibv_context>()),
            ("ibv_qp", size_of::<ibv_qp>()),
            ("ibv_cq", size_of::<ibv_cq>()),
            ("ibv_send_wr", size_of::<ibv_send_wr>()),
            ("ibv_wc", size_of::<ibv_wc>()),
            ("ibv_qp_attr", size_of::<ibv_qp_attr>()),
            ("ibv_port_attr", size_of::<ibv_port_attr>()),
            ("ibv_device_attr", size_of::<ibv_device_attr>()),
            ("ibv_srq", size_of::<ibv_srq>()),
            ("ibv_mr", size_of::<ibv_mr>()),
            ("ibv_qp_init_attr", size_of::<ibv_qp_init_attr>()),
            ("ibv_recv_wr", size_of::<ibv_recv_wr>()),
            ("ibv_async_event", size_of::<ibv_async_event>()),
            ("ibv_gid_entry", size_of::<ibv_gid_entry>()),
            ("ibv_context.ops", offset_of!(ibv_context, ops)),
            ("ibv_context.async_fd", offset_of!(ibv_context, async_fd)),
            ("ibv_context.abi_compat", offset_of!(ibv_context, abi_compat)),
            ("ibv_context_ops.poll_cq", offset_of!(ibv_context_ops, poll_cq)),
            ("ibv_context_ops.req_notify_cq", offset_of!(ibv_context_ops, req_notify_cq)),
            ("ibv_context_ops.post_srq_recv", offset_of!(ibv_context_ops, post_srq_recv)),
            ("ibv_context_ops.post_send", offset_of!(ibv_context_ops, post_send)),
            ("ibv_context_ops.post_recv", offset_of!(ibv_context_ops, post_recv)),
            ("ibv_qp.qp_num", offset_of!(ibv_qp, qp_num)),
            ("ibv_qp.events_completed", offset_of!(ibv_qp, events_completed)),
            ("ibv_send_wr.imm_data", offset_of!(ibv_send_wr, imm_data)),
            ("ibv_send_wr.wr.rdma.remote_addr", offset_of!(ibv_send_wr, remote_addr)),
            ("ibv_send_wr.wr.rdma.rkey", offset_of!(ibv_send_wr, rkey)),
            ("ibv_send_wr.qp_type", offset_of!(ibv_send_wr, _tail)),
            ("ibv_wc.imm_data", offset_of!(ibv_wc, imm_data)),
            ("ibv_wc.wc_flags", offset_of!(ibv_wc, wc_flags)),
            ("ibv_qp_attr.ah_attr", offset_of!(ibv_qp_attr, ah_attr)),
            ("ibv_qp_attr.max_rd_atomic", offset_of!(ibv_qp_attr, max_rd_atomic)),
            ("ibv_qp_attr.rate_limit", offset_of!(ibv_qp_attr, rate_limit)),
            ("ibv_ah_attr.sl", offset_of!(ibv_ah_attr, sl)),
            ("ibv_global_route.traffic_class", offset_of!(ibv_global_route, traffic_class)),
            ("ibv_port_attr.link_layer", offset_of!(ibv_port_attr, link_layer)),
            ("ibv_device_attr.max_qp_rd_atom", offset_of!(ibv_device_attr, max_qp_rd_atom)),
            ("ibv_device_attr.phys_port_cnt", offset_of!(ibv_device_attr, phys_port_cnt)),
            ("ibv_cq.cqe", offset_of!(ibv_cq, cqe)),
            ("ibv_cq.async_events_completed", offset_of!(ibv_cq, async_events_completed)),
            ("ibv_srq.events_completed", offset_of!(ibv_srq, events_completed)),
            ("ibv_gid_entry.gid_type", offset_of!(ibv_gid_entry, gid_type)),
        ]
        .into_iter()
        .collect();
        let expected = include_str!("../../../../tests/fakes/ibverbs/layout.expected");
        let mut checked = 0;
        for line in expected.lines() {
            let (name, value) = line.split_once(' ').unwrap();
            assert_eq!(ours.get(name), Some(&value.parse::<usize>().unwrap()), "{name}");
            checked += 1;
        }
        assert_eq!(checked, ours.len(), "every declared figure is in layout.expected");
    }

    #[test]
    fn without_a_device_every_call_is_an_error_not_a_crash() {
        let verbs = IbVerbs::new();
        match IbVerbs::unavailable() {
            Some(why) => {
                let error = verbs.devices().unwrap_err().to_string();
                assert!(error.contains(why), "{error}");
            }
            None => assert!(verbs.open("kvring-no-such-device").is_err()),
        }
        assert!(verbs.alloc_pd(Context(77)).is_err());
        assert!(verbs.post_send(Qp(5), &[]).is_err(), "an unknown QP is refused even with nothing to post");
        assert!(verbs.poll_cq(Cq(1 << 32 | 1), &mut []).is_err());
        assert!(verbs.counts().balanced());
    }
}
