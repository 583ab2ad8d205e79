//! The receives that count arrivals: every NIC's shared receive queue is
//! filled when the node opens; a WRITE_WITH_IMM from an initiator consumes
//! one and completes it on the NIC's passive CQ with the tag (the
//! immediate) and the bytes it placed, after they are in place. One lane
//! polls those CQs from its loop ([`ArrivalReceiver`]), counts the bytes
//! under their tag and re-posts the receives, so the queue never holds
//! more than [`SRQ_DEPTH`] and a flood of immediates waits at its senders.

use super::{RdmaNode, SRQ_DEPTH};
use crate::arrival::Arrivals;
use crate::transport::rdma::verbs::{Wc, WcStatus};
use crate::transport::Receiver;
use std::os::fd::RawFd;
use std::sync::Arc;

/// Completions taken per CQ poll.
const RECV_BATCH: usize = 64;
/// Polls per NIC per lane round: a flood cannot keep the lane here.
const RECV_POLLS_PER_ROUND: usize = 4;

/// A target's RDMA receives, driven by one lane.
#[derive(Debug)]
pub(crate) struct ArrivalReceiver {
    node: Arc<RdmaNode>,
    arrivals: Arc<Arrivals>,
    wcs: Vec<Wc>,
    repost: Vec<u64>,
}

impl RdmaNode {
    /// The receiver that counts `arrivals` for this node's NICs.
    pub(crate) fn receiver(self: &Arc<Self>, arrivals: Arc<Arrivals>) -> ArrivalReceiver {
        ArrivalReceiver {
            node: self.clone(),
            arrivals,
            wcs: vec![Wc::new(0, WcStatus::Success); RECV_BATCH],
            repost: Vec::with_capacity(RECV_BATCH),
        }
    }
}

impl Receiver for ArrivalReceiver {
    fn poll(&mut self) -> usize {
        // An engine that accepted no QP (one that only initiates) has
        // nothing that could complete: one atomic load, no verbs call.
        if !self.node.accepting() {
            return 0;
        }
        let verbs = self.node.verbs();
        let mut taken = 0;
        for nic in &self.node.nics {
            let Some((srq, _)) = nic.receives else { continue };
            for _ in 0..RECV_POLLS_PER_ROUND {
                // A CQ that cannot be polled (its device vanished) counts
                // nothing more; the links to that device fail on their own.
                let polled = verbs.poll_cq(nic.passive_cq, &mut self.wcs).unwrap_or(0);
                if polled == 0 {
                    break;
                }
                self.repost.clear();
                for wc in &self.wcs[..polled] {
                    // A flushed receive (its QP failed) placed nothing, and a
                    // zero-length WRITE_WITH_IMM placed no bytes: neither
                    // counts as an arrival.
                    if let (WcStatus::Success, Some(tag), 1..) = (wc.status, wc.imm, wc.byte_len) {
                        self.arrivals.land(tag, u64::from(wc.byte_len));
                    }
                    // Only receives of this node complete here, and each
                    // goes back once: the queue stays at its depth.
                    if wc.wr_id < u64::from(SRQ_DEPTH) {
                        self.repost.push(wc.wr_id);
                    }
                }
                // A receive not re-posted is gone from the SRQ for good (RNR
                // stalls later): say so rather than drop it (finding 17).
                if let Err(error) = verbs.post_srq_recv(srq, &self.repost) {
                    tracing::warn!(device = %nic.name, %error, lost = self.repost.len(), "re-posting receives failed");
                }
                taken += polled;
            }
        }
        taken
    }

    fn wake_fds(&self) -> Vec<RawFd> {
        self.node.nics.iter().filter_map(|nic| nic.receives.map(|(_, fd)| fd)).collect()
    }

    fn arm(&mut self) -> bool {
        let verbs = self.node.verbs();
        for nic in self.node.nics.iter().filter(|nic| nic.receives.is_some()) {
            let _ = verbs.take_cq_events(nic.passive_cq);
            let _ = verbs.arm_cq(nic.passive_cq);
        }
        // A completion that came before the arming raised no event.
        self.poll() > 0
    }
}
