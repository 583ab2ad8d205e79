//! The RDMA link: one RC QP per (lane, peer, NIC), connected through the
//! control plane when the segment is opened (on the caller's thread), then
//! owned and driven by its lane only. A chunk becomes work requests (`post.rs`),
//! posted in chains no longer than the send queue takes (the rest waits for
//! the next poll); the lane's `poll` polls the CQs, and a chunk ends when
//! the signalled completions it expects have arrived.
//!
//! Device memory moves like host memory (GPUDirect RDMA: the NIC reads and
//! writes it), once its region is registered with the NICs on both ends; a
//! block of a device region that is not is refused with the reason, before
//! anything is posted. A tagged push's writes go as WRITE_WITH_IMM, the tag
//! as the immediate, which the target counts as they land.
//!
//! Any error completion leaves the QP in the error state, so the link is
//! broken: the failing chunk gets the mapped error, everything else in
//! flight on that lane `PeerRestarted`, and the segment goes stale; the next
//! open reconnects (the restart path tcp takes too). The broken link's QPs
//! are reset when it is dropped and handed to that next connection, which
//! re-handshakes them through the control plane: a reconnect creates no QP.

use super::fences::Mirrors;
use super::node::{LocalKeys, RdmaNode};
use super::post::{build, KeyedBlock, Keys, PostConfig};
use super::verbs::*;
use super::verify::{JobBlock, Verifier, VerifyPeer};
use crate::desc::RegionId;
use crate::error::{Error, Result};
use crate::mem::fence::Held;
use crate::proto::ErrorCode;
use crate::ring::Opcode;
use crate::segment::SegmentDescriptor;
use crate::transport::checksum::{corrupt_remote_landing, device_refused, flip_first_byte, take_corruption};
use crate::transport::{Block, ChunkEnd, LaneLink, Link, LinkState, Posted, TransportKind};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Blocks a lane hands the RDMA link at once.
pub const RDMA_CHUNK_BLOCKS: usize = 256;
/// Completions taken per CQ poll.
const POLL_BATCH: usize = 64;

/// What the connect's exchange gives back: the peer's endpoints, and its
/// fence tables (`None`: an older peer that pushes no fences).
pub(crate) type Exchanged = (Vec<QpEndpoint>, Option<Vec<crate::proto::RdmaFenceTable>>);

/// One chunk in flight (a part's chunks share its ticket, so chunks have
/// ids of their own).
#[derive(Debug)]
struct InFlight {
    ticket: u64,
    signals: u32,
    bytes: u64,
    /// A WRITE's counts in the mirrors of the target's fence tables, one
    /// per run of blocks into one region: given back at its completion.
    holds: Vec<Held>,
    /// A checksummed chunk's blocks, verified once it completed (`verify.rs`).
    verify: Option<(Opcode, Vec<JobBlock>)>,
}

/// One lane's queue pairs to one peer (one per NIC), owned and driven by
/// that lane only.
#[derive(Debug)]
pub(crate) struct RdmaLink {
    peer: String,
    node: Arc<RdmaNode>,
    /// Peer region (raw id) → (address, rkey per NIC), shared by the lanes.
    remote: Arc<HashMap<u64, (u64, Vec<u32>)>>,
    /// Peer device regions its NICs could not register, with why.
    unreachable: Arc<HashMap<u64, String>>,
    /// The peer counts WRITE_WITH_IMM arrivals (its NICs have receive queues).
    arrivals: bool,
    config: PostConfig,
    state: Arc<LinkState>,
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
    /// This lane's QPs failed (or were handed back): nothing more moves.
    broken: bool,
    /// Per NIC, its fault count when the link was made (see
    /// `RdmaNode::faults`).
    faults: Vec<u64>,
    /// Mirrors of the target's fence tables, that every WRITE is checked
    /// against (`None`: an older target that pushes no fences; a granted
    /// write is then refused, as before).
    mirrors: Option<Arc<Mirrors>>,
    /// Per peer region (raw id): whether peers may read it and whether it
    /// is host memory, what verifying a checksummed chunk needs there.
    summable: Arc<HashMap<u64, (bool, bool)>>,
    /// Checksummed chunks completed and waiting on their verdicts.
    verifier: Verifier,
}

struct LinkKeys<'a> {
    local: &'a LocalKeys<'a>,
    remote: &'a HashMap<u64, (u64, Vec<u32>)>,
}

impl Keys for LinkKeys<'_> {
    fn lkey(&self, nic: usize, region: u64) -> u32 {
        self.local.lkey(region, nic).unwrap_or(0)
    }
    fn rkey(&self, nic: usize, region: u64) -> u32 {
        self.remote.get(&region).and_then(|(_, keys)| keys.get(nic)).copied().unwrap_or(0)
    }
    fn nics(&self, region: u64) -> u32 {
        self.local.nics(region)
    }
    fn host_memory(&self, region: u64) -> bool {
        self.local.host_memory(region)
    }
}

/// Per peer region (raw id): whether peers may read it and whether it is
/// host memory, what verifying a checksummed chunk needs there.
fn summable(descriptor: &SegmentDescriptor) -> Arc<HashMap<u64, (bool, bool)>> {
    let regions = descriptor.regions.iter().map(|r| {
        let readable = r.access.contains(crate::mem::Access::REMOTE_READ);
        (r.id.raw(), (readable, r.memory == crate::mem::MemoryKind::Host))
    });
    Arc::new(regions.collect())
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
    /// `exchange` (the control-plane RPC), and connects them: one lane link
    /// per lane, each owning its QPs. `verify` asks the peer for CRC32Cs of
    /// its memory (`None`: checksummed chunks are refused).
    pub fn connect(
        node: Arc<RdmaNode>,
        descriptor: &SegmentDescriptor,
        lanes: usize,
        exchange: impl FnOnce(usize, &[QpEndpoint], &[u8]) -> Result<Exchanged>,
        verify: Option<VerifyPeer>,
    ) -> Result<Link> {
        let info = descriptor
            .rdma
            .as_ref()
            .ok_or_else(|| Error::Unsupported { what: format!("rdma to {}: it serves no RDMA", descriptor.name) })?;
        let nics = node.nics().len().min(info.nics as usize).max(1);
        // In the book before the connect: a fence the target pushes once it
        // listed us finds them (kept until the snapshot is in). The key
        // goes to the target alone, in the connect: its pushes carry it.
        let booked = Mirrors::new(info.regions.iter().map(|(id, _, _)| id.raw()));
        let push_key = node.mirrors().insert(&descriptor.name, descriptor.epoch, &booked);
        let mut made: Vec<(Qp, Cq, QpEndpoint)> = Vec::with_capacity(lanes * nics);
        let result = (|| {
            for _lane in 0..lanes {
                for nic in 0..nics {
                    made.push(node.take_qp(nic, super::node::QP_DEPTH * 2)?);
                }
            }
            let endpoints: Vec<QpEndpoint> = made.iter().map(|&(_, _, endpoint)| endpoint).collect();
            let (theirs, fences) = exchange(nics, &endpoints, &push_key)?;
            if theirs.len() != endpoints.len() {
                return Err(Error::malformed(
                    "rdma connect reply",
                    format!("{} endpoints for {}", theirs.len(), endpoints.len()),
                ));
            }
            for (&(qp, _, _), remote) in made.iter().zip(&theirs) {
                node.connect_qp(qp, *remote)?;
            }
            match fences {
                Some(tables) => booked.install(&tables).map(|()| Some(booked.clone())),
                None => Ok(None),
            }
        })();
        let mirrors = match result {
            Ok(mirrors) => mirrors,
            Err(error) => {
                node.mirrors().remove(&booked, false);
                for (index, (qp, cq, endpoint)) in made.into_iter().enumerate() {
                    node.release_qp(index % nics, qp, cq, endpoint);
                }
                return Err(error);
            }
        };
        match &mirrors {
            // Its reply came: the target accepted these QPs and let go of
            // every set it held for us before.
            Some(mirrors) => node.mirrors().installed(mirrors),
            // An older target: it pushes nothing to look up.
            None => node.mirrors().remove(&booked, false),
        }
        let remote: Arc<HashMap<_, _>> =
            Arc::new(info.regions.iter().map(|(id, addr, rkeys)| (id.raw(), (*addr, rkeys.clone()))).collect());
        let unreachable: Arc<HashMap<_, _>> =
            Arc::new(info.unreachable.iter().map(|(id, why)| (id.raw(), why.clone())).collect());
        let summable = summable(descriptor);
        // One pool of verifier threads for the link's lanes.
        let verify = verify.map(|peer| (peer, Arc::new(super::verify::Pool::default())));
        let state = LinkState::new(TransportKind::Rdma, false);
        let lanes = made
            .chunks(nics)
            .map(|qps| {
                Box::new(RdmaLink {
                    peer: descriptor.name.clone(),
                    node: node.clone(),
                    remote: remote.clone(),
                    unreachable: unreachable.clone(),
                    arrivals: info.arrivals,
                    config: PostConfig::default(),
                    state: state.clone(),
                    qps: qps.to_vec(),
                    pending: vec![VecDeque::new(); nics],
                    in_flight: HashMap::new(),
                    next_chunk: 0,
                    out: vec![Vec::with_capacity(RDMA_CHUNK_BLOCKS); nics],
                    keyed: Vec::with_capacity(RDMA_CHUNK_BLOCKS),
                    wcs: vec![Wc::new(0, WcStatus::Success); POLL_BATCH],
                    broken: false,
                    faults: (0..nics).map(|nic| node.faults(nic)).collect(),
                    mirrors: mirrors.clone(),
                    summable: summable.clone(),
                    verifier: Verifier::new(&descriptor.name, verify.clone()),
                }) as Box<dyn LaneLink>
            })
            .collect();
        Ok(Link { state, lanes })
    }

    /// Fails everything in flight and marks the link broken.
    fn break_lane(&mut self, first: Option<(u64, Error)>, ended: &mut Vec<ChunkEnd>) {
        self.state.mark_broken();
        self.broken = true;
        for queue in &mut self.pending {
            queue.clear();
        }
        if let Some(mirrors) = &self.mirrors {
            // A fence pushed from now on is answered "no such link": the
            // target cuts the link off rather than wait for it.
            self.node.mirrors().remove(mirrors, !self.in_flight.is_empty());
            for entry in self.in_flight.values_mut() {
                // SAFETY: the mirrors are `self.mirrors`, alive.
                unsafe { super::fences::poison(&mut entry.holds) };
            }
        }
        if let Some((chunk, error)) = first {
            if let Some(entry) = self.in_flight.remove(&chunk) {
                ended.push((entry.ticket, Err((error, 0))));
            }
        }
        for (_, InFlight { ticket, .. }) in self.in_flight.drain() {
            let error = Error::PeerRestarted { segment: self.peer.clone(), detail: "its queue pair failed".into() };
            ended.push((ticket, Err((error, 0))));
        }
        let peer = &self.peer;
        let failed = || Error::PeerRestarted { segment: peer.clone(), detail: "its queue pair failed".into() };
        self.verifier.fail_all(&failed, ended);
    }

    /// Posts what each NIC's send queue takes; an error if a post was
    /// refused for a reason other than a full queue.
    fn post_pending(&mut self) -> std::result::Result<(), String> {
        let verbs = self.node.verbs();
        for (nic, queue) in self.pending.iter_mut().enumerate() {
            while !queue.is_empty() {
                let (front, _) = queue.as_slices();
                let chain: Vec<SendWr> = front.iter().take(super::node::QP_DEPTH as usize).copied().collect();
                match verbs.post_send(self.qps[nic].0, &chain) {
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

    /// Why the peer's region `region` has no keys: its NICs could not
    /// register it (device memory, with the peer's reason), or it is unknown.
    fn no_remote_keys(&self, region: RegionId) -> Error {
        match self.unreachable.get(&region.raw()) {
            Some(why) => Error::Unsupported { what: format!("rdma to {}: its region {region}: {why}", self.peer) },
            None => Error::UnknownRegion { side: crate::Side::Remote, region },
        }
    }

    /// Why this engine's region `region` (raw id) has no local key.
    fn no_local_keys(&self, region: u64) -> Error {
        let id = RegionId::from_raw(region);
        let why = self.node.unreachable(region).unwrap_or_else(|| "it is not registered with them".into());
        Error::Unsupported { what: format!("rdma to {}: this engine's region {id}: {why}", self.peer) }
    }

    /// Hands this lane's QPs back to the node, reset, for the next
    /// connection (to this peer again, once it reopens, or to another).
    fn release_qps(&mut self) {
        for (nic, (qp, cq, endpoint)) in self.qps.drain(..).enumerate() {
            self.node.release_qp(nic, qp, cq, endpoint);
        }
    }
}

impl LaneLink for RdmaLink {
    fn max_chunk(&self) -> usize {
        RDMA_CHUNK_BLOCKS
    }

    /// The NIC reads and writes device memory (GPUDirect RDMA); a block of a
    /// device region without keys on either end is refused in `transfer`.
    fn moves_device_memory(&self) -> bool {
        true
    }

    /// The target counts each WRITE_WITH_IMM's bytes under its immediate,
    /// where its NICs have receive queues (its descriptor says so).
    fn counts_arrivals(&self) -> bool {
        self.arrivals
    }

    /// Every WRITE is checked against mirrors of the target's fence
    /// tables, which the target keeps current (`fences.rs`); an older
    /// target's link checks nothing, and refuses granted writes.
    fn checks_grants(&self) -> bool {
        self.mirrors.is_some()
    }

    /// A checksummed chunk is verified once it completed, by asking the
    /// target for the CRC32C of what landed (`verify.rs`).
    fn verifies_completed(&self) -> bool {
        self.verifier.can_verify()
    }

    /// Nothing wakes the lane when a verdict comes: it looks again soon.
    fn waiting_on_copies(&self) -> bool {
        self.verifier.is_waiting()
    }

    /// Chunks waiting on a verdict have completed (the NIC is done with
    /// them): they end failed at once, their late verdicts ignored. Those
    /// still on the NIC cannot be recalled.
    fn withdraw(&mut self, ticket: u64, ended: &mut Vec<ChunkEnd>) -> usize {
        self.verifier.withdraw(ticket, &|| Error::Cancelled { bytes: 0 }, ended)
    }

    unsafe fn transfer(&mut self, op: Opcode, _batch_id: u64, ticket: u64, blocks: &[Block]) -> Posted {
        if self.broken {
            let error = Error::PeerRestarted { segment: self.peer.clone(), detail: "its queue pair failed".into() };
            return Posted::Failed((error, 0));
        }
        let verify = match self.to_verify(op, blocks) {
            Ok(verify) => verify.map(|blocks| (op, blocks)),
            Err(error) => return Posted::Failed((error, 0)),
        };
        self.keyed.clear();
        let mut bytes = 0;
        for block in blocks {
            let Some((base, _)) = self.remote.get(&block.desc.remote_region.raw()) else {
                return Posted::Failed((self.no_remote_keys(block.desc.remote_region), 0));
            };
            // The base is the peer's word: an address near the top of the
            // space is refused, not wrapped (nor a panic in debug builds).
            let Some(remote_addr) = base.checked_add(block.desc.remote_offset) else {
                let error = Error::malformed("rdma region address", format!("{base:#x} + offset overflows 64 bits"));
                return Posted::Failed((error, 0));
            };
            bytes += block.desc.len;
            self.keyed.push(KeyedBlock {
                local_addr: block.local as u64,
                remote_addr,
                len: block.desc.len,
                local_region: block.desc.local_region.raw(),
                remote_region: block.desc.remote_region.raw(),
            });
        }
        // A part's blocks share its tag (the lane refused one on a READ).
        let verb = match (op, blocks.first().map_or(0, |b| b.tag)) {
            (Opcode::Write, 0) => WrOp::Write,
            (Opcode::Write, tag) => WrOp::WriteImm(tag),
            (Opcode::Read, _) => WrOp::Read,
        };
        let mut holds = Vec::new();
        if let (Some(mirrors), Opcode::Write) = (&self.mirrors, op) {
            if let Err(error) = mirrors.enter_chunk(blocks, &mut holds) {
                // SAFETY: the mirrors are `self.mirrors`, alive.
                unsafe { super::fences::release(&mut holds) };
                return Posted::Failed((error, 0));
            }
        }
        let chunk = u64::from(self.next_chunk);
        let RdmaLink { keyed, out, node, remote, config, .. } = self;
        let unkeyed = node.with_lkeys(|local| {
            // A local device region may be registered with no NIC: checked
            // once per run of blocks of one region, before anything is built.
            let mut checked = None;
            for block in keyed.iter() {
                if checked != Some(block.local_region) {
                    if local.lkey(block.local_region, 0).is_none() {
                        return Some(block.local_region);
                    }
                    checked = Some(block.local_region);
                }
            }
            let keys = LinkKeys { local, remote };
            build(verb, keyed, config, &keys, |seq| chunk << 32 | seq, out);
            None
        });
        if let Some(region) = unkeyed {
            // SAFETY: the mirrors are `self.mirrors`, alive.
            unsafe { super::fences::release(&mut holds) };
            return Posted::Failed((self.no_local_keys(region), 0));
        }
        self.next_chunk = self.next_chunk.wrapping_add(1);
        let RdmaLink { out, pending, in_flight, .. } = self;
        // One completion comes back per signalled request (each NIC's last
        // one is always signalled).
        let signals = out.iter().flatten().filter(|w| w.signaled).count() as u32;
        in_flight.insert(chunk, InFlight { ticket, signals, bytes, holds, verify });
        for (nic, list) in out.iter_mut().enumerate() {
            pending[nic].extend(list.drain(..));
        }
        if self.post_pending().is_err() {
            // The QP refused the post: the next poll fails this chunk and
            // everything else in flight on the lane.
            self.broken = true;
            self.state.mark_broken();
        }
        Posted::InFlight
    }

    fn poll(&mut self, ended: &mut Vec<ChunkEnd>) -> bool {
        if self.broken {
            let had = !self.in_flight.is_empty() || self.verifier.is_waiting();
            self.break_lane(None, ended);
            return had;
        }
        // A NIC whose port went down (or that failed) completes nothing
        // more: what is in flight fails now with the reason its async event
        // gave, not after the NIC's retries or at the batch's deadline.
        if let Some(nic) = (0..self.faults.len()).find(|&nic| self.node.faults(nic) != self.faults[nic]) {
            let (device, reason) = self.node.fault(nic);
            for (_, InFlight { ticket, .. }) in self.in_flight.drain() {
                let error = Error::Device { device: device.clone(), reason: reason.clone() };
                ended.push((ticket, Err((error, 0))));
            }
            self.break_lane(None, ended);
            return true;
        }
        if let Err(why) = self.post_pending() {
            let error = Error::Device { device: "verbs".into(), reason: format!("posting to {}: {why}", self.peer) };
            let first = self.in_flight.keys().next().copied().map(|t| (t, error));
            self.break_lane(first, ended);
            return true;
        }
        let mut progressed = false;
        for nic in 0..self.qps.len() {
            let cq = self.qps[nic].1;
            let polled = match self.node.verbs().poll_cq(cq, &mut self.wcs) {
                Ok(n) => n,
                Err(error) => {
                    let first = self.in_flight.keys().next().copied().map(|t| (t, error));
                    self.break_lane(first, ended);
                    return true;
                }
            };
            for index in 0..polled {
                progressed = true;
                let wc = self.wcs[index];
                let chunk = wc.wr_id >> 32;
                if wc.status != WcStatus::Success {
                    let error = wc_error(&self.peer, wc.status);
                    self.break_lane(Some((chunk, error)), ended);
                    return true;
                }
                if let Some(entry) = self.in_flight.get_mut(&chunk) {
                    entry.signals = entry.signals.saturating_sub(1);
                    if entry.signals == 0 {
                        let (ticket, bytes) = (entry.ticket, entry.bytes);
                        // Completed: every byte is placed at the target
                        // (the fence waiting on these counts may return).
                        // SAFETY: the mirrors are `self.mirrors`, alive.
                        unsafe { super::fences::release(&mut entry.holds) };
                        let verify = entry.verify.take();
                        self.in_flight.remove(&chunk);
                        match verify {
                            None => ended.push((ticket, Ok(bytes))),
                            Some((op, blocks)) => self.completed_checksummed(chunk, ticket, bytes, op, blocks, ended),
                        }
                    }
                }
            }
        }
        progressed | self.verifier.poll(ended)
    }

    /// A broken link's QPs go back to the node at once, reset, for the
    /// reconnect that follows: its QPs are re-handshaked, not recreated.
    /// What was still in flight on them ends `PeerRestarted` (the reset QP
    /// touches its memory no more).
    fn retire(&mut self, ended: &mut Vec<ChunkEnd>) {
        if !self.state.is_broken() {
            return;
        }
        self.break_lane(None, ended);
        self.release_qps();
    }

    fn abort(&mut self, reason: &str, ended: &mut Vec<ChunkEnd>) {
        // Completed chunks waiting on a verdict: the NIC is done with them.
        let peer = &self.peer;
        let failed = || Error::PeerRestarted { segment: peer.clone(), detail: reason.to_string() };
        self.verifier.fail_all(&failed, ended);
        if self.in_flight.is_empty() {
            return;
        }
        // Requests already posted cannot be recalled: reset the QPs so the
        // NIC stops touching the chunks' memory, then fail them.
        for &(qp, _, _) in &self.qps {
            let _ = self.node.verbs().modify_qp(qp, QpTransition::Reset);
        }
        let error = Error::PeerRestarted { segment: self.peer.clone(), detail: reason.to_string() };
        let first = self.in_flight.keys().next().copied().map(|t| (t, error));
        self.break_lane(first, ended);
    }
}

impl RdmaLink {
    /// The blocks of a checksummed chunk to verify once it completes
    /// (`None`: not checksummed), or why it cannot be: GPU memory on
    /// either end (no checksum kernel), a peer region its peers may not
    /// read (the target sums only what it would let us read), no control
    /// path to ask it.
    fn to_verify(&self, op: Opcode, blocks: &[Block]) -> Result<Option<Vec<JobBlock>>> {
        // A chunk's blocks are one part's, which share its flags.
        if !blocks.first().is_some_and(|b| b.checksum) {
            return Ok(None);
        }
        if !self.verifier.can_verify() {
            return Err(Error::Unsupported { what: format!("checksums over rdma to {}: no control path", self.peer) });
        }
        let mut out = Vec::with_capacity(blocks.len());
        for block in blocks {
            let region = block.desc.remote_region;
            match self.summable.get(&region.raw()) {
                _ if block.memory != crate::mem::MemoryKind::Host => return Err(device_refused()),
                Some((_, false)) => return Err(device_refused()),
                Some((false, true)) => {
                    return Err(Error::Unsupported {
                        what: format!(
                            "a checksummed rdma transfer into {}'s region {region}: it does not let peers read it, \
                             and an rdma chunk is verified by asking the target for the CRC32C of what landed (a \
                             CRC of a region peers may not read would reveal its contents)",
                            self.peer
                        ),
                    })
                }
                Some((true, true)) => {}
                None => return Err(self.no_remote_keys(region)),
            }
            out.push(JobBlock {
                local: block.local as usize,
                region: region.raw(),
                offset: block.desc.remote_offset,
                len: block.desc.len,
                desc_index: block.desc_index,
                landing: crate::transport::checksum::landing_offset(op, block),
            });
        }
        Ok(Some(out))
    }

    /// A checksummed chunk completed: its bytes are placed, and it waits
    /// on its verdict (its leases held). With the `testing` feature, a
    /// landed block the hook names is corrupted first, where it landed.
    fn completed_checksummed(
        &mut self,
        chunk: u64,
        ticket: u64,
        bytes: u64,
        op: Opcode,
        blocks: Vec<JobBlock>,
        ended: &mut Vec<ChunkEnd>,
    ) {
        for block in blocks.iter().filter(|b| b.len > 0) {
            if take_corruption(block.landing) {
                match op {
                    Opcode::Write => corrupt_remote_landing(block.region, block.offset),
                    // SAFETY: the READ completed, so the NIC is done with
                    // the leased destination and only this lane touches it.
                    Opcode::Read => unsafe { flip_first_byte(block.local as *mut u8) },
                }
            }
        }
        if let Err(error) = self.verifier.start(chunk, ticket, bytes, op, blocks) {
            ended.push((ticket, Err((error, bytes))));
        }
    }
}

impl Drop for RdmaLink {
    /// The QPs go back to the node, reset, for the next connection (to this
    /// peer again, once it reopens, or to another).
    fn drop(&mut self) {
        if let (Some(mirrors), false) = (&self.mirrors, self.in_flight.is_empty()) {
            // Reset with WRITEs posted: the target may place them while it
            // keeps our QPs, so no other link of ours answers its pushes
            // until one connected after this one (`MirrorBook::remove`).
            self.node.mirrors().remove(mirrors, true);
        }
        self.release_qps();
    }
}
