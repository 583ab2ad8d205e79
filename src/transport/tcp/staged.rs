//! Device blocks on a tcp link: staged through pinned pages the link owns.
//!
//! A WRITE chunk with blocks in GPU memory takes pages from the link's pool,
//! has the GPU copy those blocks into them (one batched copy for the chunk,
//! on the lane's stream) and is queued on the connection once the copy's
//! event says the bytes are there: the device-to-host copy of chunk k+1
//! runs while chunk k is on the wire. A READ chunk's replies land in pages,
//! and once its last reply is in, one copy moves them into GPU memory; the
//! chunk ends `Done` only when that copy's event completed. A chunk that
//! finds too few pages free waits (its part's deadline bounds it), never
//! failing the chunks behind it; pages go back when the chunk has ended and
//! no copy of theirs is still running.
//!
//! Every chunk this link queues is booked here in queue order, so the
//! connection's ends (which come per ticket, in queue order) are matched to
//! their chunk's pages and pending copies.

use super::conn::{Connection, Peer};
use crate::error::{Error, Result};
use crate::gpu::{CopyCounters, CopySides, Gpu, Place};
use crate::mem::MemoryKind;
use crate::ring::Opcode;
use crate::transport::cuda_ipc::{DeviceCopier, DeviceCopy};
use crate::transport::stage::{pages_for, Packer, StageCounters, StagePool, STAGE_PAGE_BYTES};
use crate::transport::{Block, ChunkEnd, TransferError};
use std::collections::VecDeque;
use std::sync::Arc;

/// Pages of one link's pool (16 MiB): what a lane may have staged to one
/// peer at once.
pub(crate) const LINK_STAGE_PAGES: usize = 16;
/// Most staged bytes one chunk carries, so a chunk always fits the pool
/// with room for the next one's copy to overlap its sending.
pub(crate) const MAX_STAGED_CHUNK_BYTES: u64 = (LINK_STAGE_PAGES / 2 * STAGE_PAGE_BYTES) as u64;

/// A chunk waiting for pages.
#[derive(Debug)]
struct Waiting {
    op: Opcode,
    batch_id: u64,
    ticket: u64,
    blocks: Vec<Block>,
}

/// A WRITE chunk whose blocks are being copied out of GPU memory.
#[derive(Debug)]
struct Copying {
    id: u64,
    batch_id: u64,
    ticket: u64,
    blocks: Vec<Block>,
    pages: Vec<u32>,
    /// Set when the link was aborted meanwhile: the chunk ends with it once
    /// the copy is done (its pages are the copy's until then).
    aborted: Option<Error>,
}

/// A chunk queued on the connection.
#[derive(Debug)]
struct Sent {
    /// Its id on the connection.
    chunk: u64,
    ticket: u64,
    pages: Vec<u32>,
    /// READ: the copies into GPU memory to make once its replies are in.
    landing: Vec<(DeviceCopy, u64)>,
}

/// A READ chunk whose bytes are being copied into GPU memory.
#[derive(Debug)]
struct Landing {
    id: u64,
    ticket: u64,
    pages: Vec<u32>,
    /// The chunk's bytes, as the connection counted them.
    bytes: u64,
}

/// One tcp link's staging: its pool, its copier, and its chunks by stage.
#[derive(Debug)]
pub(crate) struct Stager {
    pool: StagePool,
    copier: DeviceCopier,
    next_id: u64,
    waiting: VecDeque<Waiting>,
    copying: VecDeque<Copying>,
    sent: VecDeque<Sent>,
    landing: Vec<Landing>,
    /// Scratch for the connection's and the copier's ends.
    ends: Vec<ChunkEnd>,
    /// The connection's ended chunk ids, in the order of its ends.
    chunk_ids: VecDeque<u64>,
}

// SAFETY: the blocks' raw pointers are into registered regions their parts
// hold leases on until the chunk ends, or into this stager's own pages; only
// the link's lane drives it, and it moves to that lane (from the thread that
// opened the link) before any chunk is staged.
unsafe impl Send for Stager {}

impl Stager {
    /// Staging through `gpu`, counting its chunks' copy methods in the
    /// lane's `counters` and its pool in the lane's `staging`; nothing is allocated until a chunk needs pages.
    pub fn new(gpu: Arc<dyn Gpu>, counters: Arc<CopyCounters>, staging: Arc<StageCounters>) -> Self {
        Self {
            pool: StagePool::new(gpu.clone(), LINK_STAGE_PAGES, staging),
            copier: DeviceCopier::new(gpu, counters),
            next_id: 0,
            waiting: VecDeque::new(),
            copying: VecDeque::new(),
            sent: VecDeque::new(),
            landing: Vec::new(),
            ends: Vec::new(),
            chunk_ids: VecDeque::new(),
        }
    }

    /// Notes the ids of chunks the connection ended, in order: each end it
    /// reports is matched to its chunk by them.
    pub fn note_chunks(&mut self, ids: impl Iterator<Item = u64>) {
        self.chunk_ids.extend(ids);
    }

    /// True while copies of its chunks run (or chunks wait for pages that
    /// their ends free).
    pub fn copies_running(&self) -> bool {
        !(self.copying.is_empty() && self.landing.is_empty() && self.waiting.is_empty())
    }

    /// True while anything is waiting, copying or in flight here.
    pub fn busy(&self) -> bool {
        !(self.waiting.is_empty() && self.copying.is_empty() && self.sent.is_empty() && self.landing.is_empty())
    }

    /// Takes a chunk: queued now, or once pages free up.
    ///
    /// # Safety
    ///
    /// As [`LaneLink::transfer`](crate::transport::LaneLink::transfer).
    pub unsafe fn transfer(
        &mut self,
        connection: &mut Connection,
        peer: &Peer,
        chunk: (Opcode, u64, u64),
        blocks: &[Block],
    ) -> std::result::Result<(), TransferError> {
        let (op, batch_id, ticket) = chunk;
        if self.waiting.is_empty() {
            // SAFETY: forwarded.
            match unsafe { self.start(connection, peer, op, batch_id, ticket, blocks) } {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(error) => return Err((error, 0)),
            }
        }
        self.waiting.push_back(Waiting { op, batch_id, ticket, blocks: blocks.to_vec() });
        Ok(())
    }

    /// Starts a chunk if its pages are free: false when they are not.
    ///
    /// # Safety
    ///
    /// As [`LaneLink::transfer`](crate::transport::LaneLink::transfer).
    unsafe fn start(
        &mut self,
        connection: &mut Connection,
        peer: &Peer,
        op: Opcode,
        batch_id: u64,
        ticket: u64,
        blocks: &[Block],
    ) -> Result<bool> {
        let device = |b: &&Block| b.memory != MemoryKind::Host;
        let need = pages_for(blocks.iter().filter(device).map(|b| b.desc.len));
        let mut pages = Vec::with_capacity(need);
        if need > 0 && !self.pool.take(need, &mut pages)? {
            return Ok(false);
        }
        let mut staged = Vec::with_capacity(blocks.len());
        let mut copies = Vec::new();
        let mut packer = Packer::new(&self.pool, &pages);
        for block in blocks {
            let MemoryKind::Gpu(ordinal) = block.memory else {
                staged.push(*block);
                continue;
            };
            packer.place(block.desc.len, |at, offset, len| {
                let mut desc = block.desc;
                desc.local_offset += offset;
                desc.remote_offset += offset;
                desc.len = len;
                staged.push(Block { local: at, memory: MemoryKind::Host, desc, ..*block });
                let device_at = block.local as u64 + offset;
                let (src, dst) = match op {
                    Opcode::Write => ((device_at, Place::Device(ordinal)), (at as u64, Place::Host)),
                    Opcode::Read => ((at as u64, Place::Host), (device_at, Place::Device(ordinal))),
                };
                let sides = CopySides { src: src.1, dst: dst.1 };
                copies.push((DeviceCopy { src: src.0, dst: dst.0, sides, device: ordinal }, len));
            });
        }
        match op {
            Opcode::Write if !copies.is_empty() => {
                let id = self.issue(&copies).inspect_err(|_| self.pool.give(&mut pages))?;
                let aborted = None;
                self.copying.push_back(Copying { id, batch_id, ticket, blocks: staged, pages, aborted });
            }
            _ => {
                // SAFETY: host blocks as our caller guarantees; staged ones
                // point into pages this chunk holds until it has ended.
                let chunk = unsafe { connection.queue_chunk(peer, op, batch_id, ticket, &staged) };
                let landing = if op == Opcode::Read { copies } else { Vec::new() };
                self.sent.push_back(Sent { chunk, ticket, pages, landing });
            }
        }
        Ok(true)
    }

    /// Issues `copies` as one batched copy; returns its id.
    fn issue(&mut self, copies: &[(DeviceCopy, u64)]) -> Result<u64> {
        for &(copy, len) in copies {
            self.copier.add(copy, len);
        }
        self.next_id += 1;
        // SAFETY: the host ends are pages of this pool, held by the chunk
        // until the copier reports the copy ended; device ends are
        // registered regions the chunk's part holds leases on.
        unsafe { self.copier.issue(self.next_id, 0, None) }?;
        Ok(self.next_id)
    }

    /// Books a chunk queued on the connection without staging (so the
    /// connection's ends stay matched to chunks in order).
    pub fn queued_plain(&mut self, ticket: u64, chunk: u64) {
        self.sent.push_back(Sent { chunk, ticket, pages: Vec::new(), landing: Vec::new() });
    }

    /// Routes the connection's ends (`from_connection`) and the copier's
    /// into `ended`; queues WRITE chunks whose copies finished and starts
    /// waiting chunks that now fit. Returns true if anything moved.
    pub fn poll(
        &mut self,
        connection: Option<&mut Connection>,
        peer: &Peer,
        from_connection: &mut Vec<ChunkEnd>,
        ended: &mut Vec<ChunkEnd>,
    ) -> bool {
        let mut moved = !from_connection.is_empty();
        for (ticket, result) in from_connection.drain(..) {
            let chunk = self.chunk_ids.pop_front();
            self.connection_ended(ticket, chunk, result, ended);
        }
        let mut copies = std::mem::take(&mut self.ends);
        moved |= self.copier.poll(&mut copies);
        let mut connection = connection;
        for (id, result) in copies.drain(..) {
            self.copy_ended(id, result, connection.as_deref_mut(), peer, ended);
        }
        self.ends = copies;
        if let Some(connection) = connection {
            while let Some(front) = self.waiting.front() {
                let (op, batch_id, ticket) = (front.op, front.batch_id, front.ticket);
                let blocks = std::mem::take(&mut self.waiting.front_mut().expect("front exists").blocks);
                // SAFETY: the blocks were handed to `transfer` under its
                // contract and their chunk has not ended.
                match unsafe { self.start(connection, peer, op, batch_id, ticket, &blocks) } {
                    Ok(true) => {
                        self.waiting.pop_front();
                        moved = true;
                    }
                    Ok(false) => {
                        self.waiting.front_mut().expect("front exists").blocks = blocks;
                        break;
                    }
                    Err(error) => {
                        self.waiting.pop_front();
                        ended.push((ticket, Err((error, 0))));
                        moved = true;
                    }
                }
            }
        }
        moved
    }

    fn connection_ended(
        &mut self,
        ticket: u64,
        chunk: Option<u64>,
        result: std::result::Result<u64, TransferError>,
        ended: &mut Vec<ChunkEnd>,
    ) {
        // Matched by the chunk's id (a part's chunks share its ticket and
        // do not always end in queue order); a notification has no booking.
        let Some(at) = self.sent.iter().position(|s| Some(s.chunk) == chunk && s.ticket == ticket) else {
            ended.push((ticket, result));
            return;
        };
        let mut sent = self.sent.remove(at).expect("position is in range");
        match result {
            Ok(bytes) if !sent.landing.is_empty() => match self.issue(&sent.landing) {
                Ok(id) => self.landing.push(Landing { id, ticket, pages: sent.pages, bytes }),
                Err(error) => {
                    self.pool.give(&mut sent.pages);
                    ended.push((ticket, Err((error, 0))));
                }
            },
            result => {
                self.pool.give(&mut sent.pages);
                ended.push((ticket, result));
            }
        }
    }

    fn copy_ended(
        &mut self,
        id: u64,
        result: std::result::Result<u64, TransferError>,
        connection: Option<&mut Connection>,
        peer: &Peer,
        ended: &mut Vec<ChunkEnd>,
    ) {
        if let Some(at) = self.landing.iter().position(|l| l.id == id) {
            let mut landing = self.landing.swap_remove(at);
            self.pool.give(&mut landing.pages);
            ended.push((landing.ticket, result.map(|_| landing.bytes)));
            return;
        }
        let Some(at) = self.copying.iter().position(|c| c.id == id) else { return };
        let mut copying = self.copying.remove(at).expect("position is in range");
        let failure = match (result, copying.aborted.take(), connection) {
            (Err(failure), _, _) => failure,
            (Ok(_), Some(aborted), _) => (aborted, 0),
            (Ok(_), None, None) => (peer.gone("the connection is closed"), 0),
            (Ok(_), None, Some(connection)) => {
                // SAFETY: the staged blocks point into this chunk's pages,
                // now holding its bytes, held until the chunk ends.
                let chunk = unsafe {
                    connection.queue_chunk(peer, Opcode::Write, copying.batch_id, copying.ticket, &copying.blocks)
                };
                let (ticket, pages) = (copying.ticket, copying.pages);
                self.sent.push_back(Sent { chunk, ticket, pages, landing: Vec::new() });
                return;
            }
        };
        self.pool.give(&mut copying.pages);
        ended.push((copying.ticket, Err(failure)));
    }

    /// Drops `ticket`'s chunks still waiting for pages (its deadline
    /// passed): they end failed, the others go on. Returns how many.
    pub fn withdraw(&mut self, ticket: u64, ended: &mut Vec<ChunkEnd>) -> usize {
        let before = self.waiting.len();
        self.waiting.retain(|waiting| {
            if waiting.ticket != ticket {
                return true;
            }
            let error = Error::DeadlinePassed { bytes: 0 };
            ended.push((ticket, Err((error, 0))));
            false
        });
        before - self.waiting.len()
    }

    /// Ends what waits with `error`; chunks whose copies are running end
    /// when their copies do. The connection's own chunks are ended by its
    /// `fail_all`, whose ends come back through [`Stager::poll`].
    pub fn abort(&mut self, error: &Error, ended: &mut Vec<ChunkEnd>) {
        for waiting in self.waiting.drain(..) {
            ended.push((waiting.ticket, Err((clone_error(error), 0))));
        }
        for copying in &mut self.copying {
            copying.aborted.get_or_insert_with(|| clone_error(error));
        }
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        // The lane stops with chunks in flight.
        self.copier.drain_before_unmap(&mut self.ends, &mut self.pool);
    }
}

fn clone_error(error: &Error) -> Error {
    match error {
        Error::PeerRestarted { segment, detail } => {
            Error::PeerRestarted { segment: segment.clone(), detail: detail.clone() }
        }
        Error::PeerStalled { segment, waited } => Error::PeerStalled { segment: segment.clone(), waited: *waited },
        other => Error::Unsupported { what: other.to_string() },
    }
}
