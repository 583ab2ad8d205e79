//! A simulated verbs provider, in-process, with the same interface as the
//! real one. Every engine of a process that shares one `SimVerbs` is on the
//! same simulated fabric: QPs find their peers by QP number.
//!
//! It checks what a NIC checks: the QP is connected and ready to send, the
//! local range lies in an MR of the QP's PD under that lkey, the remote
//! range lies in an MR of the peer's PD under that rkey with the right
//! access. It then executes the WRITE or READ as a copy between the two
//! registered ranges (never outside them) and completes through the CQ,
//! signalling only what was asked, as hardware does (`exec.rs`). It can
//! inject faults: delayed completions, an error completion, a peer that
//! resets its QPs, a full send queue, and a device that disappears.
//!
//! Device memory (`device.rs`): it learns the simulated GPUs' memory from
//! [`SimGpu`] ([`SimVerbs::attach_gpu`]). Such memory registers through a
//! dma-buf, or by its device pointer only when a peer-memory module is
//! "loaded" ([`SimVerbs::peer_memory`]); a plain registration of memory no
//! host thread may touch is refused, as a real NIC's pinning of it fails.
//! A registered device range is reached through a mapping of the GPU's own
//! memory that the simulator makes, never through the device address.
//!
//! Receives (`recv.rs`): a WRITE_WITH_IMM consumes one receive of the
//! peer QP's shared receive queue and completes it on the peer's CQ with
//! the immediate and the bytes placed, after the bytes are in place. With
//! no receive posted the write waits (a real NIC's receiver-not-ready
//! retries, which kvring asks to be unbounded), holding back what was
//! posted after it on that QP, until a receive is posted or the peer is
//! gone. A receive completion that finds its CQ full is dropped and
//! counted ([`SimVerbs::cq_overruns`]: a real CQ overrun is fatal).

mod device;
mod exec;
mod recv;

use super::verbs::*;
use crate::error::{Error, Result};
use crate::gpu::{DmaBufRange, SimGpu};
use device::Alias;
use std::collections::{HashMap as StdHashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::os::fd::{OwnedFd, RawFd};
use std::sync::{Arc, Mutex};

/// The simulator's tables are keyed by ids it hands out itself, so hashing
/// them through SipHash (DoS-resistant, ~20 ns) buys nothing: the id is
/// its own hash.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }
    fn write_u32(&mut self, value: u32) {
        self.0 = u64::from(value).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type HashMap<K, V> = StdHashMap<K, V, BuildHasherDefault<IdHasher>>;

/// The simulated fabric and every object on it.
#[derive(Debug, Default)]
pub struct SimVerbs {
    state: Mutex<State>,
}

/// How a simulated registration reaches its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MrPath {
    /// Host memory, by address.
    Host,
    /// Device memory, through a dma-buf (`ibv_reg_dmabuf_mr`).
    DmaBuf,
    /// Device memory, by its device pointer through a peer-memory module.
    PeerMemory,
}

#[derive(Debug)]
struct MrEntry {
    pd: Pd,
    mr: Mr,
    access: MrAccess,
    path: MrPath,
    /// Device memory: where the simulated NIC reaches it.
    alias: Option<Alias>,
}

impl MrEntry {
    /// Where the simulated NIC reaches `addr` (inside this MR): the address
    /// itself for host memory, its place in the alias for device memory.
    fn reach(&self, addr: u64) -> u64 {
        match &self.alias {
            None => addr,
            Some(alias) => alias.start() + (addr - self.mr.addr),
        }
    }
}

#[derive(Debug)]
struct QpEntry {
    pd: Pd,
    cq: Cq,
    qpn: u32,
    caps: QpCaps,
    state: QpState,
    remote_qpn: Option<u32>,
    /// The peer QP, resolved at RTR.
    remote_qp: Option<Qp>,
    /// Requests posted and not yet freed by a polled signalled completion.
    outstanding: u32,
    /// Unsignalled requests since the last signalled one.
    unsignaled_run: u32,
    /// Bytes its successful requests moved.
    moved: u64,
    /// Requests waiting for the peer's receive (the first one a
    /// WRITE_WITH_IMM), in posting order.
    parked: VecDeque<SendWr>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Error,
}

#[derive(Debug)]
struct Pending {
    wc: Wc,
    qp: Qp,
    /// Send-queue slots its polling frees.
    frees: u32,
    /// Visible from this poll count on.
    ready_at: u64,
}

#[derive(Debug)]
struct CqEntry {
    context: Context,
    queue: VecDeque<Pending>,
    depth: u32,
    /// A wakeable CQ's eventfd, and whether it is armed.
    wake: Option<(OwnedFd, bool)>,
}

#[derive(Debug)]
struct SrqEntry {
    /// Receives posted and not yet consumed, by `wr_id`.
    receives: VecDeque<u64>,
    depth: u32,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    devices: Vec<DeviceInfo>,
    contexts: HashMap<Context, String>,
    pds: HashMap<Pd, Context>,
    mrs: HashMap<MrHandle, MrEntry>,
    by_lkey: HashMap<u32, MrHandle>,
    by_rkey: HashMap<u32, MrHandle>,
    cqs: HashMap<Cq, CqEntry>,
    qps: HashMap<Qp, QpEntry>,
    by_qpn: HashMap<u32, Qp>,
    srqs: HashMap<Srq, SrqEntry>,
    /// Requests parked on every QP together.
    parked: usize,
    /// Receive completions dropped on a full CQ.
    overruns: u64,
    polls: u64,
    delay_polls: u64,
    /// No completion becomes visible (a stalled fabric).
    held: bool,
    fail_next: VecDeque<WcStatus>,
    /// Check everything but skip the copy (benchmarks of posting alone).
    skip_copy: bool,
    /// Bytes moved by QPs since destroyed, by their PD (live QPs count
    /// their own, so posting pays no extra lookup).
    moved_by_destroyed: HashMap<Pd, u64>,
    counts: ObjectCounts,
    /// The simulated GPUs whose memory the NICs may be handed.
    gpus: Vec<Arc<SimGpu>>,
    /// A peer-memory module is loaded: device pointers register as they are.
    peer_memory: bool,
    /// The devices register no dma-buf.
    no_dmabuf: bool,
    /// The devices refuse relaxed ordering.
    no_relaxed_ordering: bool,
    /// The devices have no shared receive queues.
    no_srq: bool,
}

fn gone(device: &str) -> Error {
    Error::Device { device: device.to_string(), reason: "it is no longer present".into() }
}

fn misuse(reason: impl Into<String>) -> Error {
    Error::Device { device: "simulated".into(), reason: reason.into() }
}

impl State {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn device_of(&self, context: Context) -> Result<&str> {
        let name = self.contexts.get(&context).ok_or_else(|| misuse(format!("unknown context {}", context.0)))?;
        if self.devices.iter().any(|d| &d.name == name) {
            Ok(name)
        } else {
            Err(gone(name))
        }
    }

    fn pd_device(&self, pd: Pd) -> Result<&str> {
        let context = *self.pds.get(&pd).ok_or_else(|| misuse(format!("unknown pd {}", pd.0)))?;
        self.device_of(context)
    }

    /// Checks what every registration checks: a live PD, a range that does
    /// not wrap, and relaxed ordering only where the device allows it.
    fn check_registration(&self, pd: Pd, addr: u64, len: u64, access: MrAccess) -> Result<()> {
        let device = self.pd_device(pd)?;
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(misuse(format!("registering {len} bytes at {addr:#x}")));
        }
        if access.relaxed_ordering && self.no_relaxed_ordering {
            return Err(Error::Device {
                device: device.to_string(),
                reason: "registering with relaxed ordering: invalid argument (the device refuses it)".into(),
            });
        }
        Ok(())
    }

    /// Records a registration; its keys are distinct per registration, like
    /// a NIC's.
    fn insert_mr(&mut self, pd: Pd, addr: u64, len: u64, access: MrAccess, path: MrPath, alias: Option<Alias>) -> Mr {
        let id = self.id();
        let key = (id as u32).wrapping_mul(0x9e37_79b9) | 1;
        let mr = Mr { handle: MrHandle(id), addr, len, lkey: key, rkey: key ^ 0x5a5a_0000 };
        self.mrs.insert(mr.handle, MrEntry { pd, mr, access, path, alias });
        self.by_lkey.insert(mr.lkey, mr.handle);
        self.by_rkey.insert(mr.rkey, mr.handle);
        self.counts.mrs.0 += 1;
        mr
    }

    /// Drops what `qp` had parked (it is reset or destroyed).
    fn unpark(&mut self, qp: Qp) {
        if let Some(entry) = self.qps.get_mut(&qp) {
            self.parked -= entry.parked.len();
            entry.parked.clear();
        }
    }
}

impl SimVerbs {
    /// A fabric with one simulated device, `sim0`, one active port, NUMA node 0.
    pub fn new() -> Self {
        Self::with_devices(vec![Self::device("sim0", Some(0))])
    }

    /// A fabric with these devices.
    pub fn with_devices(devices: Vec<DeviceInfo>) -> Self {
        let sim = Self::default();
        sim.lock().devices = devices;
        sim
    }

    /// A synthetic device with one active RoCE v2 port.
    pub fn device(name: &str, numa_node: Option<u32>) -> DeviceInfo {
        let mut v2 = [0u8; 16];
        v2[10] = 0xff;
        v2[11] = 0xff;
        v2[12..].copy_from_slice(&[10, 0, 0, 1]);
        DeviceInfo {
            name: name.into(),
            numa_node,
            pci_path: None,
            ports: vec![PortInfo {
                port: 1,
                active: true,
                mtu: 4096,
                lid: 0,
                gids: vec![(0, [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], false), (1, v2, true)],
                link_layer: LinkLayer::Ethernet,
            }],
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Completions become visible only after `polls` more polls.
    pub fn delay_completions(&self, polls: u64) {
        self.lock().delay_polls = polls;
    }

    /// While `held`, no completion becomes visible to a poll (a stalled
    /// fabric: work stays in flight, and requests the send queue had no
    /// room for wait); released, everything due shows again.
    pub fn hold_completions(&self, held: bool) {
        self.lock().held = held;
    }

    /// The next request executed fails with `status`.
    pub fn fail_next(&self, status: WcStatus) {
        self.lock().fail_next.push_back(status);
    }

    /// The peer resets `qp` (as a restarted process would lose it): requests
    /// towards it end `RetryExceeded`.
    pub fn reset_qp(&self, qp: Qp) {
        let mut state = self.lock();
        state.unpark(qp);
        if let Some(entry) = state.qps.get_mut(&qp) {
            entry.state = QpState::Reset;
            entry.remote_qpn = None;
            entry.remote_qp = None;
        }
    }

    /// The device disappears (hot-unplug, driver reset): its contexts fail.
    pub fn remove_device(&self, name: &str) {
        self.lock().devices.retain(|d| d.name != name);
    }

    /// Checks every request but skips the copy: benchmarks of posting alone
    /// ("the copy itself excluded").
    pub fn skip_copy(&self, skip: bool) {
        self.lock().skip_copy = skip;
    }

    /// The NICs may be handed `gpu`'s memory: they tell it from host memory
    /// and reach it through the GPU's own memory, never its device address.
    pub fn attach_gpu(&self, gpu: Arc<SimGpu>) {
        self.lock().gpus.push(gpu);
    }

    /// Whether a peer-memory module (nvidia-peermem) is loaded, so that a
    /// device pointer registers as it is (`ibv_reg_mr`); off at first.
    pub fn peer_memory(&self, loaded: bool) {
        self.lock().peer_memory = loaded;
    }

    /// Whether the devices register dma-bufs (`ibv_reg_dmabuf_mr`: rdma-core
    /// 34 and Linux 5.12); on at first.
    pub fn dmabuf(&self, supported: bool) {
        self.lock().no_dmabuf = !supported;
    }

    /// Whether the devices accept relaxed ordering on a registration; on at
    /// first (refused, a registration asking for it fails).
    pub fn relaxed_ordering(&self, allowed: bool) {
        self.lock().no_relaxed_ordering = !allowed;
    }

    /// Whether the devices create shared receive queues; on at first.
    pub fn shared_receive_queues(&self, supported: bool) {
        self.lock().no_srq = !supported;
    }

    /// Bytes moved by requests posted through `device`'s QPs (the
    /// initiating side's NIC), over the fabric's life.
    pub fn bytes_moved(&self, device: &str) -> u64 {
        let state = self.lock();
        let on_device = |pd: &Pd| {
            let context = state.pds.get(pd);
            context.and_then(|c| state.contexts.get(c)).is_some_and(|name| name == device)
        };
        let live = state.qps.values().filter(|q| on_device(&q.pd)).map(|q| q.moved);
        let gone = state.moved_by_destroyed.iter().filter(|(pd, _)| on_device(pd)).map(|(_, bytes)| *bytes);
        live.chain(gone).sum()
    }

    /// The rights of the MR registered at `addr` (the first one found): a
    /// NIC enforces these on every remote request, whatever the initiator
    /// checked (the simulator does too).
    pub fn mr_rights(&self, addr: u64) -> Option<MrAccess> {
        self.lock().mrs.values().find(|entry| entry.mr.addr == addr).map(|entry| entry.access)
    }

    /// How each live registration at `addr` reaches its memory (one per
    /// NIC that registered it).
    pub fn mr_paths(&self, addr: u64) -> Vec<MrPath> {
        self.lock().mrs.values().filter(|entry| entry.mr.addr == addr).map(|entry| entry.path).collect()
    }

    /// Requests posted on `qp` and not yet freed by a polled completion.
    pub fn outstanding(&self, qp: Qp) -> Option<u32> {
        self.lock().qps.get(&qp).map(|q| q.outstanding)
    }

    /// Requests waiting for a receive on their peer's shared receive queue.
    pub fn parked(&self) -> usize {
        self.lock().parked
    }

    /// The sizes `qp` was created with.
    pub fn qp_caps(&self, qp: Qp) -> Option<QpCaps> {
        self.lock().qps.get(&qp).map(|q| q.caps)
    }

    /// Receives posted on `srq` and not yet consumed.
    pub fn srq_receives(&self, srq: Srq) -> Option<usize> {
        self.lock().srqs.get(&srq).map(|s| s.receives.len())
    }

    /// Receive completions dropped because their CQ was full (a real CQ
    /// overrun, fatal to the CQ): zero when receives are bounded by the CQ.
    pub fn cq_overruns(&self) -> u64 {
        self.lock().overruns
    }
}

impl Verbs for SimVerbs {
    fn devices(&self) -> Result<Vec<DeviceInfo>> {
        Ok(self.lock().devices.clone())
    }

    fn open(&self, device: &str) -> Result<Context> {
        let mut state = self.lock();
        if !state.devices.iter().any(|d| d.name == device) {
            return Err(Error::Device { device: device.into(), reason: "no such device".into() });
        }
        let context = Context(state.id());
        state.contexts.insert(context, device.to_string());
        Ok(context)
    }

    fn close(&self, context: Context) -> Result<()> {
        let mut state = self.lock();
        if state.pds.values().any(|&c| c == context) || state.cqs.values().any(|c| c.context == context) {
            return Err(misuse("closing a context with live PDs or CQs"));
        }
        state.contexts.remove(&context).map(drop).ok_or_else(|| misuse("unknown context"))
    }

    fn alloc_pd(&self, context: Context) -> Result<Pd> {
        let mut state = self.lock();
        state.device_of(context)?;
        let pd = Pd(state.id());
        state.pds.insert(pd, context);
        state.counts.pds.0 += 1;
        Ok(pd)
    }

    fn dealloc_pd(&self, pd: Pd) -> Result<()> {
        let mut state = self.lock();
        if state.mrs.values().any(|m| m.pd == pd) || state.qps.values().any(|q| q.pd == pd) {
            return Err(misuse("deallocating a PD with live MRs or QPs"));
        }
        state.pds.remove(&pd).ok_or_else(|| misuse("unknown pd"))?;
        state.counts.pds.1 += 1;
        Ok(())
    }

    unsafe fn reg_mr(&self, pd: Pd, addr: u64, len: u64, access: MrAccess) -> Result<Mr> {
        let mut state = self.lock();
        state.check_registration(pd, addr, len, access)?;
        let (path, alias) = device::pin(&state.gpus, state.peer_memory, addr, len, access)?;
        Ok(state.insert_mr(pd, addr, len, access, path, alias))
    }

    unsafe fn reg_dmabuf_mr(&self, pd: Pd, dmabuf: DmaBufRange<'_>, iova: u64, access: MrAccess) -> Result<Mr> {
        let mut state = self.lock();
        state.check_registration(pd, iova, dmabuf.len, access)?;
        if state.no_dmabuf {
            let device = state.pd_device(pd)?.to_string();
            return Err(Error::Device {
                device,
                reason: "registering a dma-buf: operation not supported (rdma-core 34 and Linux 5.12 needed)".into(),
            });
        }
        let alias = device::map_parts(&[(dmabuf.fd, dmabuf.offset, dmabuf.len)])?;
        Ok(state.insert_mr(pd, iova, dmabuf.len, access, MrPath::DmaBuf, Some(alias)))
    }

    fn dereg_mr(&self, mr: MrHandle) -> Result<()> {
        let mut state = self.lock();
        let entry = state.mrs.remove(&mr).ok_or_else(|| misuse("unknown mr"))?;
        state.by_lkey.remove(&entry.mr.lkey);
        state.by_rkey.remove(&entry.mr.rkey);
        state.counts.mrs.1 += 1;
        Ok(())
    }

    fn create_cq(&self, context: Context, depth: u32) -> Result<Cq> {
        self.new_cq(context, depth, None)
    }

    fn create_wakeable_cq(&self, context: Context, depth: u32) -> Result<(Cq, RawFd)> {
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: eventfd takes no pointer; the descriptor is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::io("creating a completion channel", std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = fd.as_raw_fd();
        Ok((self.new_cq(context, depth, Some(fd))?, raw))
    }

    fn arm_cq(&self, cq: Cq) -> Result<()> {
        recv::arm(&mut self.lock(), cq)
    }

    fn take_cq_events(&self, cq: Cq) -> Result<()> {
        recv::take_events(&self.lock(), cq)
    }

    fn create_srq(&self, pd: Pd, depth: u32) -> Result<Srq> {
        let mut state = self.lock();
        state.pd_device(pd)?;
        if depth == 0 {
            return Err(misuse("a shared receive queue of depth 0"));
        }
        if state.no_srq {
            return Err(Error::Device {
                device: state.pd_device(pd)?.to_string(),
                reason: "creating a shared receive queue: operation not supported".into(),
            });
        }
        let srq = Srq(state.id());
        state.srqs.insert(srq, SrqEntry { receives: VecDeque::new(), depth });
        state.counts.srqs.0 += 1;
        Ok(srq)
    }

    fn destroy_srq(&self, srq: Srq) -> Result<()> {
        let mut state = self.lock();
        if state.qps.values().any(|q| q.caps.srq == Some(srq)) {
            return Err(misuse("destroying a shared receive queue with live QPs"));
        }
        state.srqs.remove(&srq).ok_or_else(|| misuse("unknown srq"))?;
        state.counts.srqs.1 += 1;
        Ok(())
    }

    fn post_srq_recv(&self, srq: Srq, wr_ids: &[u64]) -> Result<()> {
        recv::post(&mut self.lock(), srq, wr_ids)
    }

    fn destroy_cq(&self, cq: Cq) -> Result<()> {
        let mut state = self.lock();
        if state.qps.values().any(|q| q.cq == cq) {
            return Err(misuse("destroying a CQ with live QPs"));
        }
        state.cqs.remove(&cq).ok_or_else(|| misuse("unknown cq"))?;
        state.counts.cqs.1 += 1;
        Ok(())
    }

    fn create_qp(&self, pd: Pd, cq: Cq, caps: QpCaps) -> Result<(Qp, QpEndpoint)> {
        let mut state = self.lock();
        let device = state.pd_device(pd)?.to_string();
        if !state.cqs.contains_key(&cq) {
            return Err(misuse("unknown cq"));
        }
        if caps.srq.is_some_and(|srq| !state.srqs.contains_key(&srq)) {
            return Err(misuse("unknown srq"));
        }
        let id = state.id();
        let qp = Qp(id);
        let qpn = (id as u32) & 0x00ff_ffff;
        let port = state.devices.iter().find(|d| d.name == device).and_then(|d| d.ports.first()).cloned();
        let gid = port.as_ref().and_then(|p| p.gids.iter().find(|g| g.0 == caps.gid_index)).map_or([0; 16], |g| g.1);
        let endpoint = QpEndpoint { qpn, psn: qpn ^ 0x5555, gid, lid: port.as_ref().map_or(0, |p| p.lid), mtu: 4096 };
        state.qps.insert(
            qp,
            QpEntry {
                pd,
                cq,
                qpn,
                caps,
                state: QpState::Reset,
                remote_qpn: None,
                remote_qp: None,
                outstanding: 0,
                unsignaled_run: 0,
                moved: 0,
                parked: VecDeque::new(),
            },
        );
        state.by_qpn.insert(qpn, qp);
        state.counts.qps.0 += 1;
        Ok((qp, endpoint))
    }

    fn modify_qp(&self, qp: Qp, transition: QpTransition) -> Result<()> {
        let mut state = self.lock();
        let pd = state.qps.get(&qp).ok_or_else(|| misuse("unknown qp"))?.pd;
        state.pd_device(pd)?;
        let peer = match transition {
            QpTransition::ReadyToReceive(remote) => state.by_qpn.get(&remote.qpn).copied(),
            _ => None,
        };
        if transition == QpTransition::Reset {
            state.unpark(qp);
        }
        let entry = state.qps.get_mut(&qp).expect("checked above");
        entry.state = match (entry.state, transition) {
            (QpState::Reset, QpTransition::Init) => QpState::Init,
            (QpState::Init, QpTransition::ReadyToReceive(remote)) => {
                entry.remote_qpn = Some(remote.qpn);
                entry.remote_qp = peer;
                QpState::Rtr
            }
            (QpState::Rtr, QpTransition::ReadyToSend) => QpState::Rts,
            (_, QpTransition::Error) => QpState::Error,
            (_, QpTransition::Reset) => {
                entry.remote_qpn = None;
                entry.remote_qp = None;
                entry.outstanding = 0;
                entry.unsignaled_run = 0;
                QpState::Reset
            }
            (from, to) => return Err(misuse(format!("qp transition {to:?} from {from:?}"))),
        };
        if entry.state == QpState::Reset {
            // A move to RESET also removes the QP's completions from its CQ
            // (mlx5 cleans the CQ there), so a reused QP sees none of its
            // earlier life.
            let (cq, srq) = (entry.cq, entry.caps.srq);
            state.clean_cq(cq, qp, srq);
        }
        Ok(())
    }

    fn destroy_qp(&self, qp: Qp) -> Result<()> {
        let mut state = self.lock();
        state.unpark(qp);
        let entry = state.qps.remove(&qp).ok_or_else(|| misuse("unknown qp"))?;
        *state.moved_by_destroyed.entry(entry.pd).or_default() += entry.moved;
        state.by_qpn.remove(&entry.qpn);
        state.clean_cq(entry.cq, qp, entry.caps.srq);
        state.counts.qps.1 += 1;
        Ok(())
    }

    fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        exec::post(&mut self.lock(), qp, wrs)
    }

    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize> {
        exec::poll(&mut self.lock(), cq, out)
    }

    fn counts(&self) -> ObjectCounts {
        self.lock().counts
    }
}

impl SimVerbs {
    fn new_cq(&self, context: Context, depth: u32, wake: Option<OwnedFd>) -> Result<Cq> {
        let mut state = self.lock();
        state.device_of(context)?;
        let cq = Cq(state.id());
        let entry = CqEntry { context, queue: VecDeque::new(), depth: depth.max(1), wake: wake.map(|fd| (fd, false)) };
        state.cqs.insert(cq, entry);
        state.counts.cqs.0 += 1;
        Ok(cq)
    }
}
