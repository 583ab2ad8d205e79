//! The receiving side of the simulated NIC: shared receive queues, the
//! receive completion a WRITE_WITH_IMM makes on its peer's CQ, and CQs that
//! wake a sleeping thread through an eventfd (a completion channel).

use super::{misuse, Pending, State};
use crate::error::{Error, Result};
use crate::transport::rdma::verbs::*;
use std::os::fd::AsRawFd;

impl State {
    /// True when `srq` (the receiving QP's) has a receive posted.
    pub(super) fn receive_ready(&self, srq: Option<Srq>) -> bool {
        srq.and_then(|srq| self.srqs.get(&srq)).is_some_and(|s| !s.receives.is_empty())
    }

    /// Consumes one receive of `srq` and completes it on `qp`'s CQ with the
    /// immediate and the bytes placed; a full CQ drops it, counted.
    pub(super) fn deliver(&mut self, qp: Qp, srq: Option<Srq>, imm: u32, byte_len: u32) {
        let Some(wr_id) = srq.and_then(|srq| self.srqs.get_mut(&srq)).and_then(|s| s.receives.pop_front()) else {
            return;
        };
        let Some(cq) = self.qps.get(&qp).map(|q| q.cq) else { return };
        let ready_at = self.polls + self.delay_polls;
        let Some(entry) = self.cqs.get_mut(&cq) else { return };
        if entry.queue.len() >= entry.depth as usize {
            self.overruns += 1;
            return;
        }
        let wc = Wc { wr_id, status: WcStatus::Success, byte_len, imm: Some(imm) };
        entry.queue.push_back(Pending { wc, qp, frees: 0, ready_at });
        if let Some((fd, armed)) = entry.wake.as_mut().filter(|(_, armed)| *armed) {
            *armed = false;
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to our own eventfd;
            // a full counter (never, at one write per arming) only fails.
            unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        }
    }
}

impl State {
    /// Removes `qp`'s completions from `cq` (a move to RESET, or its
    /// destruction), as mlx5 cleans a CQ.
    pub(super) fn clean_cq(&mut self, cq: Cq, qp: Qp, _srq: Option<Srq>) {
        let Some(entry) = self.cqs.get_mut(&cq) else { return };
        // mlx5 (cq.c free_res_cqe → mlx5_free_srq_wqe) puts the SRQ WQE a
        // dropped completion consumed back on the SRQ's free list: its slot
        // takes a new receive, but the receive itself is gone, so a caller
        // that re-posts only what it polls loses it (finding 4).
        entry.queue.retain(|p| p.qp != qp);
    }
}

/// Posts `wr_ids` as receives on `srq`, then lets parked writes run.
pub(super) fn post(state: &mut State, srq: Srq, wr_ids: &[u64]) -> Result<()> {
    let entry = state.srqs.get_mut(&srq).ok_or_else(|| misuse("unknown srq"))?;
    if entry.receives.len() + wr_ids.len() > entry.depth as usize {
        return Err(Error::Device {
            device: "simulated".into(),
            reason: format!(
                "posting {} receives on a shared receive queue holding {} of {}: it is full",
                wr_ids.len(),
                entry.receives.len(),
                entry.depth
            ),
        });
    }
    entry.receives.extend(wr_ids);
    state.drain_parked();
    Ok(())
}

/// Arms a wakeable CQ for its next completion.
pub(super) fn arm(state: &mut State, cq: Cq) -> Result<()> {
    let entry = state.cqs.get_mut(&cq).ok_or_else(|| misuse("unknown cq"))?;
    let (_, armed) = entry.wake.as_mut().ok_or_else(|| misuse("arming a CQ without a completion channel"))?;
    *armed = true;
    Ok(())
}

/// Empties a wakeable CQ's eventfd.
pub(super) fn take_events(state: &State, cq: Cq) -> Result<()> {
    let entry = state.cqs.get(&cq).ok_or_else(|| misuse("unknown cq"))?;
    let (fd, _) = entry.wake.as_ref().ok_or_else(|| misuse("a CQ without a completion channel"))?;
    let mut count = [0u8; 8];
    // SAFETY: reads at most 8 bytes into a live buffer from our own
    // non-blocking eventfd (EAGAIN when empty, which is fine).
    unsafe { libc::read(fd.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
    Ok(())
}
