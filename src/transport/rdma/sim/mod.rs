//! A simulated verbs provider, in-process, with the same interface as the
//! real one. Every engine of a process that shares one `SimVerbs` is on the
//! same simulated fabric: QPs find their peers by QP number.
//!
//! It checks what a NIC checks: the QP is connected and ready to send, the
//! local range lies in an MR of the QP's PD under that lkey, the remote
//! range lies in an MR of the peer's PD under that rkey with the right
//! access. It then executes the WRITE or READ as a copy between the two
//! registered ranges (never outside them) and completes through the CQ,
//! signalling only what was asked, as hardware does. It can inject faults:
//! delayed completions, an error completion, a peer that resets its QPs, a
//! full send queue, and a device that disappears.

use super::verbs::*;
use crate::error::{Error, Result};
use std::collections::{HashMap as StdHashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

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

#[derive(Debug)]
struct MrEntry {
    pd: Pd,
    mr: Mr,
    access: MrAccess,
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

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    devices: Vec<DeviceInfo>,
    contexts: HashMap<Context, String>,
    pds: HashMap<Pd, Context>,
    mrs: HashMap<MrHandle, MrEntry>,
    by_lkey: HashMap<u32, MrHandle>,
    by_rkey: HashMap<u32, MrHandle>,
    cqs: HashMap<Cq, (Context, VecDeque<Pending>)>,
    qps: HashMap<Qp, QpEntry>,
    by_qpn: HashMap<u32, Qp>,
    polls: u64,
    delay_polls: u64,
    fail_next: VecDeque<WcStatus>,
    /// Check everything but skip the copy (benchmarks of posting alone).
    skip_copy: bool,
    /// Bytes moved by QPs since destroyed, by their PD (live QPs count
    /// their own, so posting pays no extra lookup).
    moved_by_destroyed: HashMap<Pd, u64>,
    counts: ObjectCounts,
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

    /// The MR of `pd` under `key` covering `addr..addr+len`, if any.
    fn covering(&self, pd: Pd, key: u32, addr: u64, len: u64, remote: bool) -> Option<&MrEntry> {
        let handle = if remote { self.by_rkey.get(&key) } else { self.by_lkey.get(&key) }?;
        let entry = self.mrs.get(handle)?;
        let mr = &entry.mr;
        (entry.pd == pd && addr >= mr.addr && addr.checked_add(len).is_some_and(|end| end <= mr.addr + mr.len))
            .then_some(entry)
    }

    fn complete(&mut self, qp: Qp, wr: &SendWr, status: WcStatus) {
        let Some(entry) = self.qps.get_mut(&qp) else { return };
        let failed = status != WcStatus::Success;
        if !failed {
            entry.moved += u64::from(wr.len);
        }
        if failed && entry.state != QpState::Error {
            entry.state = QpState::Error;
        }
        // Hardware reports successes only when asked, failures always.
        if wr.signaled || failed {
            let frees = entry.unsignaled_run + 1;
            entry.unsignaled_run = 0;
            let cq = entry.cq;
            let ready_at = self.polls + self.delay_polls;
            if let Some((_, queue)) = self.cqs.get_mut(&cq) {
                queue.push_back(Pending { wc: Wc { wr_id: wr.wr_id, status }, qp, frees, ready_at });
            }
        } else {
            entry.unsignaled_run += 1;
        }
    }

    /// Executes one request; returns its completion status.
    fn execute(&mut self, qp: Qp, wr: &SendWr) -> WcStatus {
        let Some(entry) = self.qps.get(&qp) else { return WcStatus::Other(0) };
        if entry.state == QpState::Error {
            return WcStatus::Flushed;
        }
        if let Some(status) = self.fail_next.pop_front() {
            return status;
        }
        let len = u64::from(wr.len);
        let local_pd = entry.pd;
        let Some(local) = self.covering(local_pd, wr.lkey, wr.local_addr, len, false) else {
            return WcStatus::LocalProtection;
        };
        if wr.op == WrOp::Read && !local.access.local_write {
            return WcStatus::LocalProtection;
        }
        let remote_qp = entry.remote_qp.and_then(|q| self.qps.get(&q)).filter(|q| Some(q.qpn) == entry.remote_qpn);
        let Some(remote_qp) = remote_qp.filter(|q| matches!(q.state, QpState::Rtr | QpState::Rts)) else {
            // Nobody answers at the other end: the transport retries, then gives up.
            return WcStatus::RetryExceeded;
        };
        let Some(remote) = self.covering(remote_qp.pd, wr.rkey, wr.remote_addr, len, true) else {
            return WcStatus::RemoteAccess;
        };
        let allowed = match wr.op {
            WrOp::Write => remote.access.remote_write,
            WrOp::Read => remote.access.remote_read,
        };
        if !allowed {
            return WcStatus::RemoteAccess;
        }
        let (source, target) = match wr.op {
            WrOp::Write => (wr.local_addr, wr.remote_addr),
            WrOp::Read => (wr.remote_addr, wr.local_addr),
        };
        if self.skip_copy {
            return WcStatus::Success;
        }
        // SAFETY: both ranges were just checked to lie inside MRs, whose
        // registrants promised them valid until deregistration (`reg_mr`'s
        // contract); `copy` allows them to overlap (one engine's loopback).
        unsafe { std::ptr::copy(source as *const u8, target as *mut u8, wr.len as usize) };
        WcStatus::Success
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
            ports: vec![PortInfo {
                port: 1,
                active: true,
                mtu: 4096,
                lid: 0,
                gids: vec![(0, [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], false), (1, v2, true)],
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

    /// The next request executed fails with `status`.
    pub fn fail_next(&self, status: WcStatus) {
        self.lock().fail_next.push_back(status);
    }

    /// The peer resets `qp` (as a restarted process would lose it): requests
    /// towards it end `RetryExceeded`.
    pub fn reset_qp(&self, qp: Qp) {
        if let Some(entry) = self.lock().qps.get_mut(&qp) {
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

    /// Requests posted on `qp` and not yet freed by a polled completion.
    pub fn outstanding(&self, qp: Qp) -> Option<u32> {
        self.lock().qps.get(&qp).map(|q| q.outstanding)
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
        if state.pds.values().any(|&c| c == context) || state.cqs.values().any(|(c, _)| *c == context) {
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
        state.pd_device(pd)?;
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(misuse(format!("registering {len} bytes at {addr:#x}")));
        }
        let id = state.id();
        // Keys are distinct per registration, like a NIC's.
        let key = (id as u32).wrapping_mul(0x9e37_79b9) | 1;
        let mr = Mr { handle: MrHandle(id), addr, len, lkey: key, rkey: key ^ 0x5a5a_0000 };
        state.mrs.insert(mr.handle, MrEntry { pd, mr, access });
        state.by_lkey.insert(mr.lkey, mr.handle);
        state.by_rkey.insert(mr.rkey, mr.handle);
        state.counts.mrs.0 += 1;
        Ok(mr)
    }

    fn dereg_mr(&self, mr: MrHandle) -> Result<()> {
        let mut state = self.lock();
        let entry = state.mrs.remove(&mr).ok_or_else(|| misuse("unknown mr"))?;
        state.by_lkey.remove(&entry.mr.lkey);
        state.by_rkey.remove(&entry.mr.rkey);
        state.counts.mrs.1 += 1;
        Ok(())
    }

    fn create_cq(&self, context: Context, _depth: u32) -> Result<Cq> {
        let mut state = self.lock();
        state.device_of(context)?;
        let cq = Cq(state.id());
        state.cqs.insert(cq, (context, VecDeque::new()));
        state.counts.cqs.0 += 1;
        Ok(cq)
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
        let entry = state.qps.get_mut(&qp).expect("checked above");
        entry.state = match (entry.state, transition) {
            (QpState::Reset, QpTransition::Init) => QpState::Init,
            (QpState::Init, QpTransition::ReadyToReceive(remote)) => {
                entry.remote_qpn = Some(remote.qpn);
                entry.remote_qp = peer;
                QpState::Rtr
            }
            (QpState::Rtr, QpTransition::ReadyToSend) => QpState::Rts,
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
            let cq = entry.cq;
            if let Some((_, queue)) = state.cqs.get_mut(&cq) {
                queue.retain(|p| p.qp != qp);
            }
        }
        Ok(())
    }

    fn destroy_qp(&self, qp: Qp) -> Result<()> {
        let mut state = self.lock();
        let entry = state.qps.remove(&qp).ok_or_else(|| misuse("unknown qp"))?;
        *state.moved_by_destroyed.entry(entry.pd).or_default() += entry.moved;
        state.by_qpn.remove(&entry.qpn);
        for (_, queue) in state.cqs.values_mut() {
            queue.retain(|p| p.qp != qp);
        }
        state.counts.qps.1 += 1;
        Ok(())
    }

    fn post_send(&self, qp: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        let mut state = self.lock();
        for (posted, wr) in wrs.iter().enumerate() {
            let invalid = |why: String| PostError { posted, error: PostFailure::Invalid(why) };
            let Some(entry) = state.qps.get_mut(&qp) else { return Err(invalid("unknown qp".into())) };
            if !matches!(entry.state, QpState::Rts | QpState::Error) {
                return Err(invalid(format!("qp is {:?}, not ready to send", entry.state)));
            }
            if entry.outstanding >= entry.caps.max_send_wr {
                return Err(PostError { posted, error: PostFailure::QueueFull });
            }
            if wr.inline && wr.len > entry.caps.max_inline {
                return Err(invalid(format!("{} bytes inline, at most {}", wr.len, entry.caps.max_inline)));
            }
            entry.outstanding += 1;
            let status = state.execute(qp, wr);
            state.complete(qp, wr, status);
        }
        Ok(())
    }

    fn poll_cq(&self, cq: Cq, out: &mut [Wc]) -> Result<usize> {
        let mut state = self.lock();
        state.polls += 1;
        let polls = state.polls;
        let context = state.cqs.get(&cq).map(|(c, _)| *c).ok_or_else(|| misuse("unknown cq"))?;
        state.device_of(context)?;
        let mut taken = Vec::new();
        if let Some((_, queue)) = state.cqs.get_mut(&cq) {
            while taken.len() < out.len() && queue.front().is_some_and(|p| p.ready_at <= polls) {
                taken.push(queue.pop_front().expect("checked"));
            }
        }
        for (slot, pending) in out.iter_mut().zip(&taken) {
            *slot = pending.wc;
            if let Some(entry) = state.qps.get_mut(&pending.qp) {
                entry.outstanding = entry.outstanding.saturating_sub(pending.frees);
            }
        }
        Ok(taken.len())
    }

    fn counts(&self) -> ObjectCounts {
        self.lock().counts
    }
}
