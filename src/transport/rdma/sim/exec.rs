//! What the simulated NIC does with a posted request: check it as a NIC
//! does, move the bytes between the two registrations (through a device
//! registration's alias, never a device address), hand a WRITE_WITH_IMM's
//! immediate to the peer's receive, and complete it, signalling only what
//! was asked; a WRITE_WITH_IMM with no receive posted waits, with what
//! follows it on its QP.

use super::{misuse, Pending, QpState, State};
use crate::error::Result;
use crate::transport::rdma::verbs::*;

/// What executing one request did.
enum Step {
    /// It ended (moved, or failed) with this status.
    Done(WcStatus),
    /// It waits for a receive on the peer's shared receive queue.
    Parked,
}

impl State {
    /// The MR of `pd` under `key` covering `addr..addr+len`, if any.
    fn covering(&self, pd: Pd, key: u32, addr: u64, len: u64, remote: bool) -> Option<&super::MrEntry> {
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
            if let Some(entry) = self.cqs.get_mut(&cq) {
                entry.queue.push_back(Pending { wc: Wc::new(wr.wr_id, status), qp, frees, ready_at });
            }
        } else {
            entry.unsignaled_run += 1;
        }
    }

    /// Executes one request.
    fn execute(&mut self, qp: Qp, wr: &SendWr) -> Step {
        let Some(entry) = self.qps.get(&qp) else { return Step::Done(WcStatus::Other(0)) };
        if entry.state == QpState::Error {
            return Step::Done(WcStatus::Flushed);
        }
        if let Some(status) = self.fail_next.pop_front() {
            return Step::Done(status);
        }
        let len = u64::from(wr.len);
        let Some(local) = self.covering(entry.pd, wr.lkey, wr.local_addr, len, false) else {
            return Step::Done(WcStatus::LocalProtection);
        };
        if wr.op == WrOp::Read && !local.access.local_write {
            return Step::Done(WcStatus::LocalProtection);
        }
        let remote = entry.remote_qp.and_then(|q| self.qps.get(&q).map(|peer| (q, peer)));
        let remote = remote.filter(|(_, peer)| {
            Some(peer.qpn) == entry.remote_qpn && matches!(peer.state, QpState::Rtr | QpState::Rts)
        });
        // Nobody answers at the other end: the transport retries, then gives up.
        let Some((remote_qp, peer)) = remote else { return Step::Done(WcStatus::RetryExceeded) };
        let Some(remote) = self.covering(peer.pd, wr.rkey, wr.remote_addr, len, true) else {
            return Step::Done(WcStatus::RemoteAccess);
        };
        let allowed = if wr.op.writes() { remote.access.remote_write } else { remote.access.remote_read };
        if !allowed {
            return Step::Done(WcStatus::RemoteAccess);
        }
        let srq = peer.caps.srq;
        if matches!(wr.op, WrOp::WriteImm(_)) && !self.receive_ready(srq) {
            // The receiver is not ready: nothing is placed, the NIC retries.
            return Step::Parked;
        }
        let (local_at, remote_at) = (local.reach(wr.local_addr), remote.reach(wr.remote_addr));
        let (source, target) = if wr.op.writes() { (local_at, remote_at) } else { (remote_at, local_at) };
        if !self.skip_copy {
            // SAFETY: both ranges were just checked to lie inside MRs whose
            // registrants promised them valid until deregistration
            // (`reg_mr`'s and `reg_dmabuf_mr`'s contracts); device ranges
            // are reached through the registration's own mapping of the
            // device memory; `copy` allows overlap (one engine's loopback).
            unsafe { std::ptr::copy(source as *const u8, target as *mut u8, wr.len as usize) };
        }
        if let WrOp::WriteImm(imm) = wr.op {
            // After the bytes are in place, as the peer's NIC reports them.
            self.deliver(remote_qp, srq, imm, wr.len);
        }
        Step::Done(WcStatus::Success)
    }

    /// Runs what QPs have parked, in order per QP, until each finds no
    /// receive again or has run everything.
    pub(super) fn drain_parked(&mut self) {
        if self.parked == 0 {
            return;
        }
        let waiting: Vec<Qp> = self.qps.iter().filter(|(_, e)| !e.parked.is_empty()).map(|(&qp, _)| qp).collect();
        for qp in waiting {
            while let Some(wr) = self.qps.get_mut(&qp).and_then(|e| e.parked.pop_front()) {
                self.parked -= 1;
                match self.execute(qp, &wr) {
                    Step::Parked => {
                        self.park(qp, wr);
                        break;
                    }
                    Step::Done(status) => self.complete(qp, &wr, status),
                }
            }
        }
    }

    fn park(&mut self, qp: Qp, wr: SendWr) {
        if let Some(entry) = self.qps.get_mut(&qp) {
            entry.parked.push_front(wr);
            self.parked += 1;
        }
    }
}

/// Posts `wrs` on `qp` in order.
pub(super) fn post(state: &mut State, qp: Qp, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
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
        if !entry.parked.is_empty() {
            // Behind a request waiting for a receive: an RC QP keeps order.
            entry.parked.push_back(*wr);
            state.parked += 1;
            continue;
        }
        match state.execute(qp, wr) {
            Step::Parked => {
                if let Some(entry) = state.qps.get_mut(&qp) {
                    entry.parked.push_back(*wr);
                    state.parked += 1;
                }
            }
            Step::Done(status) => state.complete(qp, wr, status),
        }
    }
    Ok(())
}

/// Takes up to `out.len()` visible completions of `cq`; parked requests get
/// another try first (a real NIC keeps retrying them).
pub(super) fn poll(state: &mut State, cq: Cq, out: &mut [Wc]) -> Result<usize> {
    state.polls += 1;
    let polls = state.polls;
    let context = state.cqs.get(&cq).map(|c| c.context).ok_or_else(|| misuse("unknown cq"))?;
    state.device_of(context)?;
    if state.held {
        return Ok(0);
    }
    state.drain_parked();
    let State { cqs, qps, .. } = state;
    let Some(entry) = cqs.get_mut(&cq) else { return Ok(0) };
    let mut taken = 0;
    while taken < out.len() && entry.queue.front().is_some_and(|p| p.ready_at <= polls) {
        let pending = entry.queue.pop_front().expect("checked");
        out[taken] = pending.wc;
        taken += 1;
        // Receive completions free no send-queue slot.
        if pending.frees > 0 {
            if let Some(qp) = qps.get_mut(&pending.qp) {
                qp.outstanding = qp.outstanding.saturating_sub(pending.frees);
            }
        }
    }
    Ok(taken)
}
