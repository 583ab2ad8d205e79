//! The receiving side: shared receive queues, receives without buffers
//! (a WRITE_WITH_IMM places its bytes by address and consumes one), and
//! CQs with a completion channel whose descriptor wakes a sleeping lane.

use super::ffi::*;
use super::{failed, failed_code, unknown, IbVerbs, Raw};
use crate::error::{Error, Result};
use crate::transport::rdma::verbs::{Context, Cq, Pd, Srq};
use std::os::fd::RawFd;

/// Creates a CQ of `depth` (within the device's `max_cqe`), with a
/// completion channel of its own when `wakeable`, whose descriptor is made
/// non-blocking (taking events never blocks a lane).
pub(super) fn create_cq(verbs: &IbVerbs, context: Context, depth: u32, wakeable: bool) -> Result<(Cq, RawFd)> {
    let lib = verbs.lib()?;
    let (raw, name, limits) = verbs.context(context)?;
    let depth = depth.min(limits.max_cqe).max(1);
    let mut channel = std::ptr::null_mut();
    let mut fd = -1;
    if wakeable {
        // SAFETY: `raw` is a live context.
        channel = unsafe { (lib.create_comp_channel)(raw.0) };
        if channel.is_null() {
            return Err(failed(&name, "creating a completion channel"));
        }
        // SAFETY: the channel was just created; its descriptor is its own.
        fd = unsafe { (*channel).fd };
        // SAFETY: fcntl on a live descriptor, flags only.
        let nonblocking = unsafe { libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK) };
        if nonblocking != 0 {
            // SAFETY: the channel has no CQ; destroyed once.
            unsafe { (lib.destroy_comp_channel)(channel) };
            return Err(failed(&name, "making a completion channel non-blocking"));
        }
    }
    // SAFETY: `raw` is a live context; its vector count is plain data.
    let vectors = unsafe { (*raw.0).num_comp_vectors };
    let vector = comp_vector(verbs.next_vector.fetch_add(1, std::sync::atomic::Ordering::Relaxed), vectors);
    // SAFETY: `raw` is live; the channel (or none) is ours; no CQ context.
    let cq = unsafe { (lib.create_cq)(raw.0, depth as i32, std::ptr::null_mut(), channel, vector) };
    let handle = (!cq.is_null()).then(|| verbs.cqs.insert(cq)).flatten();
    let Some(handle) = handle else {
        let error = failed(&name, "creating a completion queue");
        if !cq.is_null() {
            // SAFETY: destroying the CQ just made, once.
            unsafe { (lib.destroy_cq)(cq) };
        }
        if !channel.is_null() {
            // SAFETY: the channel has no CQ; destroyed once.
            unsafe { (lib.destroy_comp_channel)(channel) };
        }
        return Err(error);
    };
    let mut tables = verbs.lock();
    if !channel.is_null() {
        tables.channels.insert(handle, Raw(channel));
    }
    tables.counts.cqs.0 += 1;
    Ok((Cq(handle), fd))
}

/// The completion vector of the `nth` CQ created: round robin over the
/// context's `num_comp_vectors` (ibv_create_cq(3): at least 0 and below
/// it), so CQs' interrupts spread over the device's vectors instead of all
/// landing on vector 0 (VERBS-REVIEW finding 19).
pub(super) fn comp_vector(nth: u32, num_comp_vectors: i32) -> i32 {
    if num_comp_vectors <= 1 {
        return 0;
    }
    (nth % num_comp_vectors as u32) as i32
}

/// A CQ whose channel wakes a lane.
pub(super) fn create_wakeable_cq(verbs: &IbVerbs, context: Context, depth: u32) -> Result<(Cq, RawFd)> {
    create_cq(verbs, context, depth, true)
}

/// Destroys a CQ, then its channel (ibv_create_comp_channel(3): a channel
/// outlives its CQs).
pub(super) fn destroy_cq(verbs: &IbVerbs, cq: Cq) -> Result<()> {
    let lib = verbs.lib()?;
    let raw = verbs.cqs.remove(cq.0).ok_or_else(|| unknown("cq"))?;
    // SAFETY: `raw` came from ibv_create_cq and is destroyed once; every
    // event taken from it was acknowledged as it was taken.
    let rc = unsafe { (lib.destroy_cq)(raw) };
    if rc != 0 {
        return Err(failed_code("verbs", "destroying a completion queue", rc));
    }
    let channel = {
        let mut tables = verbs.lock();
        tables.counts.cqs.1 += 1;
        tables.channels.remove(&cq.0)
    };
    if let Some(channel) = channel {
        // SAFETY: the channel's only CQ is destroyed; destroyed once.
        unsafe { (lib.destroy_comp_channel)(channel.0) };
    }
    Ok(())
}

/// Takes (and acknowledges) every event waiting on a wakeable CQ's channel.
pub(super) fn take_events(verbs: &IbVerbs, cq: Cq) -> Result<()> {
    let lib = verbs.lib()?;
    let channel = *verbs.lock().channels.get(&cq.0).ok_or_else(|| unknown("completion channel"))?;
    loop {
        let mut event_cq = std::ptr::null_mut();
        let mut context = std::ptr::null_mut();
        // SAFETY: a live channel whose descriptor is non-blocking: returns
        // -1 (EAGAIN) at once when no event waits.
        if unsafe { (lib.get_cq_event)(channel.0, &mut event_cq, &mut context) } != 0 {
            return Ok(());
        }
        // SAFETY: one event was taken from this CQ; each is acknowledged
        // (destroying the CQ waits for every event to be: ibv_get_cq_event(3)).
        unsafe { (lib.ack_cq_events)(event_cq, 1) };
    }
}

/// Creates a shared receive queue of `depth` receives of one SGE.
pub(super) fn create_srq(verbs: &IbVerbs, pd: Pd, depth: u32) -> Result<Srq> {
    let lib = verbs.lib()?;
    let raw_pd = verbs.pd(pd)?;
    let mut init = ibv_srq_init_attr {
        srq_context: std::ptr::null_mut(),
        attr: ibv_srq_attr { max_wr: depth, max_sge: 1, srq_limit: 0 },
    };
    // SAFETY: `raw_pd` is live and `init` filled.
    let srq = unsafe { (lib.create_srq)(raw_pd.0, &mut init) };
    if srq.is_null() {
        return Err(failed("verbs", "creating a shared receive queue"));
    }
    let Some(handle) = verbs.srqs.insert(srq) else {
        // SAFETY: destroying the SRQ just made, once.
        unsafe { (lib.destroy_srq)(srq) };
        return Err(Error::Device { device: "verbs".into(), reason: "too many shared receive queues".into() });
    };
    verbs.lock().counts.srqs.0 += 1;
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
    let mut list: Vec<ibv_recv_wr> = wr_ids
        .iter()
        .map(|&wr_id| ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: std::ptr::null_mut(), num_sge: 0 })
        .collect();
    let base = list.as_mut_ptr();
    for (i, wr) in list.iter_mut().enumerate().take(wr_ids.len().saturating_sub(1)) {
        // SAFETY: `i + 1 < len`.
        wr.next = unsafe { base.add(i + 1) };
    }
    let mut bad = std::ptr::null_mut();
    // SAFETY: `srq` is live (our caller's contract); verbs.h's inline
    // ibv_post_srq_recv calls its context's op; the list lives until return.
    let rc = unsafe {
        match (*(*srq).context).ops.post_srq_recv {
            Some(post) => post(srq, base, &mut bad),
            None => return Err(unknown("post_srq_recv op")),
        }
    };
    if rc != 0 {
        // ibv_post_srq_recv(3) returns the errno value and leaves errno alone
        // (finding 17).
        return Err(failed_code("verbs", "posting receives", rc));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::comp_vector;

    #[test]
    fn cqs_spread_over_every_completion_vector_and_stay_below_the_count() {
        let used: std::collections::BTreeSet<i32> = (0..8).map(|n| comp_vector(n, 4)).collect();
        assert_eq!(used.into_iter().collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(comp_vector(7, 1), 0);
        assert_eq!(comp_vector(7, 0), 0, "a provider reporting none still gets vector 0");
    }
}
