//! The receiving side: shared receive queues, receives without buffers
//! (a WRITE_WITH_IMM places its bytes by address and consumes one), and
//! CQs with a completion channel whose descriptor wakes a sleeping lane.

use super::{failed, unknown, Tables};
use crate::error::Result;
use crate::transport::rdma::verbs::{Context, Cq, Pd, Srq};
use rdma_sys::*;
use std::os::fd::RawFd;

/// Creates a CQ of `depth` with a completion channel of its own, whose
/// descriptor is made non-blocking (taking events never blocks a lane).
pub(super) fn create_wakeable_cq(tables: &mut Tables, context: Context, depth: u32) -> Result<(Cq, RawFd)> {
    let (raw, name) = tables.contexts.get(&context.0).cloned().ok_or_else(|| unknown("context"))?;
    // SAFETY: `raw` is a live context.
    let channel = unsafe { ibv_create_comp_channel(raw) };
    if channel.is_null() {
        return Err(failed(&name, "creating a completion channel"));
    }
    // SAFETY: the channel was just created; its descriptor is its own.
    let fd = unsafe { (*channel).fd };
    // SAFETY: fcntl on a live descriptor, flags only.
    let nonblocking = unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
    // SAFETY: `raw` is live; the channel is ours, no CQ context pointer.
    let cq = (nonblocking == 0)
        .then(|| unsafe { ibv_create_cq(raw, depth as i32, std::ptr::null_mut(), channel, 0) })
        .filter(|cq| !cq.is_null());
    let Some(cq) = cq else {
        // SAFETY: the channel has no CQ; destroyed once.
        unsafe { ibv_destroy_comp_channel(channel) };
        return Err(failed(&name, "creating a wakeable completion queue"));
    };
    let handle = tables.take_handle();
    tables.cqs.insert(handle, cq);
    tables.channels.insert(handle, channel);
    tables.counts.cqs.0 += 1;
    Ok((Cq(handle), fd))
}

/// Takes (and acknowledges) every event waiting on a wakeable CQ's channel.
pub(super) fn take_events(tables: &Tables, cq: Cq) -> Result<()> {
    let channel = *tables.channels.get(&cq.0).ok_or_else(|| unknown("completion channel"))?;
    loop {
        let mut event_cq = std::ptr::null_mut();
        let mut context = std::ptr::null_mut();
        // SAFETY: a live channel whose descriptor is non-blocking: returns
        // -1 (EAGAIN) at once when no event waits.
        if unsafe { ibv_get_cq_event(channel, &mut event_cq, &mut context) } != 0 {
            return Ok(());
        }
        // SAFETY: one event was taken from this CQ; each is acknowledged
        // (destroying the CQ waits for every event to be).
        unsafe { ibv_ack_cq_events(event_cq, 1) };
    }
}

/// Creates a shared receive queue of `depth` receives of one SGE.
pub(super) fn create_srq(tables: &mut Tables, pd: Pd, depth: u32) -> Result<Srq> {
    let raw_pd = *tables.pds.get(&pd.0).ok_or_else(|| unknown("pd"))?;
    // SAFETY: zeroed init attributes are valid plain C data, filled below.
    let mut init: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
    init.attr.max_wr = depth;
    init.attr.max_sge = 1;
    // SAFETY: `raw_pd` is live and `init` filled.
    let srq = unsafe { ibv_create_srq(raw_pd, &mut init) };
    if srq.is_null() {
        return Err(failed("verbs", "creating a shared receive queue"));
    }
    let handle = tables.take_handle();
    tables.srqs.insert(handle, srq);
    tables.counts.srqs.0 += 1;
    Ok(Srq(handle))
}

/// Posts one receive without buffers per `wr_ids` entry on `srq`.
///
/// # Safety
///
/// `srq` is live.
pub(super) unsafe fn post_receives(srq: *mut ibv_srq, wr_ids: &[u64]) -> Result<()> {
    if wr_ids.is_empty() {
        return Ok(());
    }
    // SAFETY: zeroed receive requests are valid plain C data (no SGE).
    let mut list: Vec<ibv_recv_wr> = wr_ids.iter().map(|_| unsafe { std::mem::zeroed() }).collect();
    let base = list.as_mut_ptr();
    for (i, (wr, &id)) in list.iter_mut().zip(wr_ids).enumerate() {
        wr.wr_id = id;
        wr.num_sge = 0;
        // SAFETY: `i + 1 < len` when followed; the last one ends the chain.
        wr.next = if i + 1 < wr_ids.len() { unsafe { base.add(i + 1) } } else { std::ptr::null_mut() };
    }
    let mut bad = std::ptr::null_mut();
    // SAFETY: `srq` is live (our caller's contract); the list lives until return.
    if unsafe { ibv_post_srq_recv(srq, base, &mut bad) } != 0 {
        return Err(failed("verbs", "posting receives"));
    }
    Ok(())
}
