//! The receives that count arrivals: every NIC's shared receive queue is
//! filled when the node opens; a WRITE_WITH_IMM from an initiator consumes
//! one and completes it on the NIC's passive CQ with the tag (the
//! immediate) and the bytes it placed, after they are in place. One lane
//! polls those CQs from its loop ([`ArrivalReceiver`]), counts the bytes
//! under their tag and re-posts the receives, so the queue never holds
//! more than [`SRQ_DEPTH`] and a flood of immediates waits at its senders.

use super::RdmaNode;
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
        let _ = self.arrivals.set(arrivals.clone());
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
        let mut taken = 0;
        for nic in &self.node.nics {
            for _ in 0..RECV_POLLS_PER_ROUND {
                let polled = self.node.take_receives(nic, Some(&self.arrivals), &mut self.wcs, &mut self.repost);
                if polled == 0 {
                    break;
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
