//! The RDMA link: one RC QP per (lane, peer, NIC), connected through the
//! control plane when the segment is opened (on the caller's thread), then
//! driven by its lane only. A chunk becomes work requests (`post.rs`),
//! posted in chains no longer than the send queue takes (the rest waits for
//! the next poll); the lane's `poll` polls the CQs, and a chunk ends when
//! the signalled completions it expects have arrived.
//!
//! Any error completion leaves the QP in the error state, so the link is
//! broken: the failing chunk gets the mapped error, everything else in
//! flight on that lane `PeerRestarted`, and the segment goes stale; the next
//! open reconnects (the restart path tcp takes too). The broken link's QPs
//! are reset when it is dropped and handed to that next connection, which
//! re-handshakes them through the control plane: a reconnect creates no QP.

use super::node::RdmaNode;
use super::post::{build, KeyedBlock, Keys, PostConfig};
use super::verbs::*;
use crate::error::{Error, Result};
use crate::proto::ErrorCode;
use crate::ring::Opcode;
use crate::segment::{SegmentDescriptor, TransportKind};
use crate::transport::{Block, Finished, Link, Posted};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Blocks a lane hands the RDMA link at once.
pub const RDMA_CHUNK_BLOCKS: usize = 256;
/// Completions taken per CQ poll.
const POLL_BATCH: usize = 64;

/// One chunk in flight (a part's chunks share its ticket, so chunks have
/// ids of their own).
#[derive(Debug)]
struct InFlight {
    ticket: u64,
    signals: u32,
    bytes: u64,
}

#[derive(Debug)]
struct LaneQps {
    /// Per NIC: QP, its CQ, and the endpoint it was created with.
    qps: Vec<(Qp, Cq, QpEndpoint)>,
    /// Per NIC: requests the send queue had no room for yet.
    pending: Vec<VecDeque<SendWr>>,
    /// By chunk id (the high half of each request's `wr_id`).
    in_flight: HashMap<u64, InFlight>,
    next_chunk: u32,
    /// Scratch, reused: no allocation per chunk once warm.
    out: Vec<Vec<SendWr>>,
    keyed: Vec<KeyedBlock>,
    wcs: Vec<Wc>,
    broken: bool,
}

/// Connections to one peer over RDMA, one QP per lane and NIC.
#[derive(Debug)]
pub struct RdmaLink {
    peer: String,
    node: Arc<RdmaNode>,
    /// Peer region (raw id) → (address, rkey per NIC).
    remote: HashMap<u32, (u64, Vec<u32>)>,
    lanes: Box<[Mutex<LaneQps>]>,
    config: PostConfig,
    broken: AtomicBool,
}

struct LinkKeys<'a> {
    local: &'a dyn Fn(u32, usize) -> Option<u32>,
    remote: &'a HashMap<u32, (u64, Vec<u32>)>,
}

impl Keys for LinkKeys<'_> {
    fn lkey(&self, nic: usize, region: u32) -> u32 {
        (self.local)(region, nic).unwrap_or(0)
    }
    fn rkey(&self, nic: usize, region: u32) -> u32 {
        self.remote.get(&region).and_then(|(_, keys)| keys.get(nic)).copied().unwrap_or(0)
    }
}

fn wc_error(peer: &str, status: WcStatus) -> Error {
    match status {
        WcStatus::RetryExceeded | WcStatus::Flushed => Error::PeerRestarted {
            segment: peer.to_string(),
            detail: format!("the NIC gave up on it ({status:?}): it restarted or is unreachable"),
        },
        WcStatus::RemoteAccess => {
            Error::Remote { code: ErrorCode::AccessDenied, message: format!("{peer} refused a remote key or range") }
        }
        WcStatus::LocalProtection => Error::Remote {
            code: ErrorCode::AccessDenied,
            message: "the local NIC refused a local key or range".into(),
        },
        WcStatus::Other(code) => Error::Device { device: "verbs".into(), reason: format!("completion error {code}") },
        WcStatus::Success => Error::Device { device: "verbs".into(), reason: "no error".into() },
    }
}

impl RdmaLink {
    /// Creates `lanes × nics` QPs, exchanges them with the peer through
    /// `exchange` (the control-plane RPC), and connects them.
    pub fn connect(
        node: Arc<RdmaNode>,
        descriptor: &SegmentDescriptor,
        lanes: usize,
        exchange: impl FnOnce(usize, &[QpEndpoint]) -> Result<Vec<QpEndpoint>>,
    ) -> Result<Self> {
        let info = descriptor
            .rdma
            .as_ref()
            .ok_or_else(|| Error::Unsupported { what: format!("rdma to {}: it serves no RDMA", descriptor.name) })?;
        let nics = node.nics().len().min(info.nics as usize).max(1);
        let mut made: Vec<(Qp, Cq, QpEndpoint)> = Vec::with_capacity(lanes * nics);
        let result = (|| {
            for _lane in 0..lanes {
                for nic in 0..nics {
                    made.push(node.take_qp(nic, super::node::QP_DEPTH * 2)?);
                }
            }
            let endpoints: Vec<QpEndpoint> = made.iter().map(|&(_, _, endpoint)| endpoint).collect();
            let theirs = exchange(nics, &endpoints)?;
            if theirs.len() != endpoints.len() {
                return Err(Error::malformed(
                    "rdma connect reply",
                    format!("{} endpoints for {}", theirs.len(), endpoints.len()),
                ));
            }
            for (&(qp, _, _), remote) in made.iter().zip(&theirs) {
                node.connect_qp(qp, *remote)?;
            }
            Ok(())
        })();
        if let Err(error) = result {
            for (index, (qp, cq, endpoint)) in made.into_iter().enumerate() {
                node.release_qp(index % nics, qp, cq, endpoint);
            }
            return Err(error);
        }
        let lanes: Vec<Mutex<LaneQps>> = made
            .chunks(nics)
            .map(|qps| {
                Mutex::new(LaneQps {
                    qps: qps.to_vec(),
                    pending: vec![VecDeque::new(); nics],
                    in_flight: HashMap::new(),
                    next_chunk: 0,
                    out: vec![Vec::with_capacity(RDMA_CHUNK_BLOCKS); nics],
                    keyed: Vec::with_capacity(RDMA_CHUNK_BLOCKS),
                    wcs: vec![Wc { wr_id: 0, status: WcStatus::Success }; POLL_BATCH],
                    broken: false,
                })
            })
            .collect();
        let remote = info.regions.iter().map(|(id, addr, rkeys)| (id.raw(), (*addr, rkeys.clone()))).collect();
        Ok(Self {
            peer: descriptor.name.clone(),
            node,
            remote,
            lanes: lanes.into_boxed_slice(),
            config: PostConfig::default(),
            broken: AtomicBool::new(false),
        })
    }

    fn lane(&self, lane: usize) -> Option<std::sync::MutexGuard<'_, LaneQps>> {
        // Only lane `lane` locks it: never contended.
        self.lanes.get(lane).map(|l| l.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Fails everything in flight on a lane and marks the link broken.
    fn break_lane(&self, state: &mut LaneQps, first: Option<(u64, Error)>, finished: &mut Vec<Finished>) {
        self.broken.store(true, Ordering::Release);
        state.broken = true;
        for queue in &mut state.pending {
            queue.clear();
        }
        if let Some((chunk, error)) = first {
            if let Some(entry) = state.in_flight.remove(&chunk) {
                finished.push((entry.ticket, Err((error, 0))));
            }
        }
        for (_, InFlight { ticket, .. }) in state.in_flight.drain() {
            let error = Error::PeerRestarted { segment: self.peer.clone(), detail: "its queue pair failed".into() };
            finished.push((ticket, Err((error, 0))));
        }
    }

    /// Posts what each NIC's send queue takes; false if a post was refused
    /// for a reason other than a full queue.
    fn post_pending(&self, state: &mut LaneQps) -> std::result::Result<(), String> {
        let verbs = self.node.verbs();
        for (nic, queue) in state.pending.iter_mut().enumerate() {
            while !queue.is_empty() {
                let (front, _) = queue.as_slices();
                let chain: Vec<SendWr> = front.iter().take(super::node::QP_DEPTH as usize).copied().collect();
                match verbs.post_send(state.qps[nic].0, &chain) {
                    Ok(()) => {
                        queue.drain(..chain.len());
                    }
                    Err(PostError { posted, error: PostFailure::QueueFull }) => {
                        queue.drain(..posted);
                        break;
                    }
                    Err(PostError { error: PostFailure::Invalid(why), .. }) => return Err(why),
                }
            }
        }
        Ok(())
    }
}

impl Link for RdmaLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn max_chunk(&self) -> usize {
        RDMA_CHUNK_BLOCKS
    }

    /// True once a QP failed (the segment must be reopened).
    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    unsafe fn transfer(&self, lane: usize, op: Opcode, _batch_id: u64, ticket: u64, blocks: &[Block]) -> Posted {
        let Some(mut state) = self.lane(lane) else {
            return Posted::Failed((Error::invalid("lane", format!("{lane} has no QP to {}", self.peer)), 0));
        };
        if state.broken {
            let error = Error::PeerRestarted { segment: self.peer.clone(), detail: "its queue pair failed".into() };
            return Posted::Failed((error, 0));
        }
        let state = &mut *state;
        state.keyed.clear();
        let mut bytes = 0;
        for block in blocks {
            let Some((base, _)) = self.remote.get(&block.desc.remote_region.raw()) else {
                let error = Error::UnknownRegion { side: crate::Side::Remote, region: block.desc.remote_region };
                return Posted::Failed((error, 0));
            };
            bytes += block.desc.len;
            state.keyed.push(KeyedBlock {
                local_addr: block.local as u64,
                remote_addr: base + block.desc.remote_offset,
                len: block.desc.len,
                local_region: block.desc.local_region.raw(),
                remote_region: block.desc.remote_region.raw(),
            });
        }
        let verb = match op {
            Opcode::Write => WrOp::Write,
            Opcode::Read => WrOp::Read,
        };
        let chunk = u64::from(state.next_chunk);
        state.next_chunk = state.next_chunk.wrapping_add(1);
        let LaneQps { keyed, out, pending, in_flight, .. } = state;
        self.node.with_lkeys(|local| {
            let keys = LinkKeys { local, remote: &self.remote };
            build(verb, keyed, &self.config, &keys, |seq| chunk << 32 | seq, out);
        });
        // One completion comes back per signalled request (each NIC's last
        // one is always signalled).
        let signals = out.iter().flatten().filter(|w| w.signaled).count() as u32;
        in_flight.insert(chunk, InFlight { ticket, signals, bytes });
        for (nic, list) in out.iter_mut().enumerate() {
            pending[nic].extend(list.drain(..));
        }
        if self.post_pending(state).is_err() {
            // The QP refused the post: the next poll fails this chunk and
            // everything else in flight on the lane.
            state.broken = true;
            self.broken.store(true, Ordering::Release);
        }
        Posted::InFlight
    }

    fn poll(&self, lane: usize, finished: &mut Vec<Finished>) -> bool {
        let Some(mut state) = self.lane(lane) else { return false };
        let state = &mut *state;
        if state.broken {
            let had = !state.in_flight.is_empty();
            self.break_lane(state, None, finished);
            return had;
        }
        if let Err(why) = self.post_pending(state) {
            let error = Error::Device { device: "verbs".into(), reason: format!("posting to {}: {why}", self.peer) };
            let first = state.in_flight.keys().next().copied().map(|t| (t, error));
            self.break_lane(state, first, finished);
            return true;
        }
        let verbs = self.node.verbs();
        let mut progressed = false;
        for nic in 0..state.qps.len() {
            let cq = state.qps[nic].1;
            let polled = match verbs.poll_cq(cq, &mut state.wcs) {
                Ok(n) => n,
                Err(error) => {
                    let first = state.in_flight.keys().next().copied().map(|t| (t, error));
                    self.break_lane(state, first, finished);
                    return true;
                }
            };
            for index in 0..polled {
                progressed = true;
                let wc = state.wcs[index];
                let chunk = wc.wr_id >> 32;
                if wc.status != WcStatus::Success {
                    self.break_lane(state, Some((chunk, wc_error(&self.peer, wc.status))), finished);
                    return true;
                }
                if let Some(entry) = state.in_flight.get_mut(&chunk) {
                    entry.signals = entry.signals.saturating_sub(1);
                    if entry.signals == 0 {
                        let (ticket, bytes) = (entry.ticket, entry.bytes);
                        state.in_flight.remove(&chunk);
                        finished.push((ticket, Ok(bytes)));
                    }
                }
            }
        }
        progressed
    }

    /// A broken link's QPs go back to the node at once, reset, for the
    /// reconnect that follows: its QPs are re-handshaked, not recreated.
    /// Chunks still listed in flight end `PeerRestarted` at their lane's
    /// next poll (the reset QP touches their memory no more).
    fn retire(&self) {
        if !self.is_broken() {
            return;
        }
        for lane in self.lanes.iter() {
            let mut state = lane.lock().unwrap_or_else(|p| p.into_inner());
            state.broken = true;
            self.release_qps(&mut state);
        }
    }

    fn abort(&self, lane: usize, reason: &str, finished: &mut Vec<Finished>) {
        let Some(mut state) = self.lane(lane) else { return };
        if state.in_flight.is_empty() {
            return;
        }
        // Requests already posted cannot be recalled: reset the QPs so the
        // NIC stops touching the chunks' memory, then fail them.
        for &(qp, _, _) in &state.qps {
            let _ = self.node.verbs().modify_qp(qp, QpTransition::Reset);
        }
        let error = Error::PeerRestarted { segment: self.peer.clone(), detail: reason.to_string() };
        let first = state.in_flight.keys().next().copied().map(|t| (t, error));
        self.break_lane(&mut state, first, finished);
    }
}

impl RdmaLink {
    /// Takes lane `state`'s QPs out and hands them to the node, reset.
    fn release_qps(&self, state: &mut LaneQps) {
        for (nic, (qp, cq, endpoint)) in state.qps.drain(..).enumerate() {
            self.node.release_qp(nic, qp, cq, endpoint);
        }
    }
}

impl Drop for RdmaLink {
    /// The QPs go back to the node, reset, for the next connection (to this
    /// peer again, once it reopens, or to another).
    fn drop(&mut self) {
        for lane in self.lanes.iter() {
            self.release_qps(&mut lane.lock().unwrap_or_else(|p| p.into_inner()));
        }
    }
}
