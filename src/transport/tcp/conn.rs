//! One non-blocking data connection from a lane to a target: the frames it
//! still has to send, the chunks waiting for replies, and where the reply
//! being read lands.
//!
//! The lane drives it from its loop the way it would poll a completion
//! queue: [`Connection::send`] writes as much as the socket takes with
//! vectored writes, [`Connection::receive`] reads as much as has arrived
//! and ends chunks as their replies complete. Nothing blocks, so a dead or
//! slow peer never holds up the lane's other peers, and any number of
//! chunks (of any number of batches) are in flight at once.

use super::frame::{
    FrameHeader, FrameOp, FLAG_CHECKSUM, FLAG_LAST, FLAG_TAGGED, FRAME_HEADER_BYTES, MAX_FRAME_PAYLOAD_BYTES,
};
use super::Landing;
use crate::error::{Error, Result};
use crate::proto::ErrorCode;
use crate::ring::Opcode;
use crate::seal::FrameSeal;
use crate::transport::{Block, ChunkEnd};
use std::collections::VecDeque;
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use zerocopy::IntoBytes;

/// Read-ahead buffer for replies: headers and small payloads come many to
/// a syscall; large payloads are read straight into local memory.
const REPLY_BUFFER_BYTES: usize = 256 * 1024;
/// Most slices one `writev` gathers (two per frame).
const MAX_IO_SLICES: usize = 64;
/// Below this, a payload is read through the buffer rather than directly.
const DIRECT_READ_MIN_BYTES: usize = 16 * 1024;

/// Who is at the other end, for error messages and frame headers.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The peer's segment name.
    pub name: String,
    /// Its data address.
    pub addr: SocketAddr,
    /// Its epoch, stamped on every frame.
    pub epoch: u64,
}

impl Peer {
    /// The error for a connection that is gone: the lane marks the segment
    /// stale, and the next open of its name reconnects.
    pub fn gone(&self, detail: impl Into<String>) -> Error {
        Error::PeerRestarted { segment: self.name.clone(), detail: detail.into() }
    }

    /// The detail of a connection's end, for the errors of every chunk it
    /// carried.
    pub fn detail(error: &Error) -> String {
        match error {
            Error::PeerRestarted { detail, .. } => detail.clone(),
            other => other.to_string(),
        }
    }

    /// Turns a reply's failure status into an error (of a chunk that
    /// named `grant`).
    fn refused(&self, reply: &FrameHeader, grant: u32) -> Error {
        let code = crate::error::code_of_status(reply.status);
        if code == ErrorCode::PeerRestarted {
            return self.gone(format!("it answered with another epoch than {:#x}", self.epoch));
        }
        if code == ErrorCode::Fenced {
            return Error::Fenced { region: crate::RegionId::from_raw(reply.region), grant };
        }
        Error::Remote {
            code,
            message: format!(
                "{} refused the block at region {} offset {}",
                self.name,
                crate::RegionId::from_raw(reply.region),
                reply.offset
            ),
        }
    }
}

/// One frame's share of a block.
#[derive(Debug, Clone, Copy)]
struct Span {
    local: *mut u8,
    region: u64,
    offset: u64,
    len: u64,
    /// Its offset in the local region (where the test hook names a READ's
    /// landing, `corrupt_landing_at`).
    local_offset: u64,
    /// The block's index in its batch (a `CORRUPT` ack names the frame).
    desc_index: u32,
    /// Its WRITE frame carries the CRC32C of its payload; its READ frame
    /// asks for the CRC32C of the bytes sent back, checked once they land.
    checksum: bool,
}

/// A frame queued for sending.
#[derive(Debug, Clone, Copy)]
struct OutFrame {
    header: FrameHeader,
    /// Payload (WRITE, NOTIFY); null with `len` 0 for READ requests.
    payload: *const u8,
    len: usize,
    /// The chunk it belongs to (a part's chunks share its ticket).
    chunk: u64,
    /// Numbered and signed (on a sealed connection, just before it is
    /// first offered to the socket): it must go, or the numbering breaks.
    sealed: bool,
}

impl OutFrame {
    fn total(&self) -> usize {
        FRAME_HEADER_BYTES + self.len
    }
}

/// A chunk (or a notification) whose replies are awaited, in send order.
#[derive(Debug)]
struct Awaited {
    ticket: u64,
    /// Its own id, unique on the connection: its frames carry it.
    chunk: u64,
    batch_id: u64,
    op: FrameOp,
    /// One per frame.
    spans: Vec<Span>,
    /// READ: frames answered so far.
    next: usize,
    /// Bytes in place so far.
    moved: u64,
    failure: Option<Error>,
    /// The grant a WRITE chunk named (0: none), for its `Fenced` error.
    grant: u32,
    /// A notification's encoded payload: never read, owned here so the
    /// queued frame that points into it stays valid until its reply.
    _payload: Vec<u8>,
    /// Bytes it moves: its share of the send window once admitted.
    window_bytes: u64,
    /// Admitted to the send window (its frames may leave).
    admitted: bool,
}

/// What the bytes being received are.
#[derive(Debug, Clone, Copy)]
enum Receiving {
    Header,
    /// A READ reply's payload, landing in the span's local range.
    Payload(Landing),
    /// A payload nobody wants any more (its chunk already failed).
    Discard {
        left: usize,
    },
}

/// A lane's data connection to one peer.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    out: VecDeque<OutFrame>,
    /// Bytes of the front frame (header, then payload) already written.
    front_sent: usize,
    awaiting: VecDeque<Awaited>,
    buffer: Box<[u8]>,
    start: usize,
    end: usize,
    receiving: Receiving,
    /// Span lists of ended chunks, reused: no allocation once warm.
    spare: Vec<Vec<Span>>,
    /// Since when replies have been awaited without a byte moving.
    stalled_since: Option<Instant>,
    /// Set when a send failed outside `poll`; the next poll fails all.
    dead: Option<Error>,
    /// Id of the next chunk queued.
    next_chunk: u64,
    /// Whether ended chunks' ids are kept (a staging link reads them).
    track_chunks: bool,
    /// Ids of ended chunks, in the order of their ends.
    ended_chunks: Vec<u64>,
    /// The frame seal of a tokened session's connection.
    seal: Option<FrameSeal>,
    /// The grant the last GRANT frame queued named (a connection starts at
    /// 0 at both ends).
    sent_grant: u32,
    /// Chunks with a smaller id are admitted to the send window (`window`).
    admit_below: u64,
    /// Bytes of the admitted chunks not yet ended (`window`).
    unacked_bytes: u64,
    /// The checksum of the READ payload landing now, if its span has one.
    read_sum: Option<read_data::ReadSum>,
}

// SAFETY: the raw pointers are into registered local regions that the
// lane holds leases on until the chunk they belong to ends
// (`LaneLink::transfer`'s contract), or into notification payloads the
// connection owns; only its lane drives it, and it moves to that lane (from
// the thread that opened it) before anything is queued on it.
unsafe impl Send for Connection {}

impl Connection {
    /// Wraps a connected stream, switching it to non-blocking.
    pub fn new(stream: TcpStream) -> std::io::Result<Self> {
        stream.set_nonblocking(true)?;
        let _ = stream.set_nodelay(true);
        Ok(Self {
            stream,
            out: VecDeque::with_capacity(256),
            front_sent: 0,
            awaiting: VecDeque::with_capacity(64),
            buffer: vec![0u8; REPLY_BUFFER_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            receiving: Receiving::Header,
            spare: Vec::new(),
            stalled_since: None,
            dead: None,
            next_chunk: 0,
            track_chunks: false,
            ended_chunks: Vec::new(),
            seal: None,
            sent_grant: 0,
            admit_below: 0,
            unacked_bytes: 0,
            read_sum: None,
        })
    }

    /// Seals every frame header from now on, each way (the connection
    /// proved a tokened session).
    pub fn seal_with(&mut self, seal: FrameSeal) {
        self.seal = Some(seal);
    }

    /// Numbers and signs the frames the next write may take, in order
    /// (never earlier: a frame dropped unsent must not leave a gap).
    fn seal_next(&mut self) {
        let Some(seal) = &mut self.seal else { return };
        let admit_below = self.admit_below;
        for frame in self.out.iter_mut().take(MAX_IO_SLICES / 2).take_while(|f| f.chunk < admit_below) {
            if !frame.sealed {
                frame.header.seal(seal);
                frame.sealed = true;
            }
        }
    }

    /// True when nothing is queued or awaited.
    pub fn is_idle(&self) -> bool {
        self.awaiting.is_empty()
    }

    /// True when the peer has closed (or reset) the connection: an end of
    /// stream or an error is waiting to be read. Asked only of an idle
    /// connection, so nothing of ours is lost with it; bytes waiting while
    /// nothing is awaited are left for `progress` to refuse as out of step.
    pub fn peer_closed(&self) -> bool {
        let mut byte = 0u8;
        // SAFETY: `byte` is valid for a write of one byte; MSG_PEEK leaves
        // what is read on the socket.
        let got = unsafe {
            libc::recv(
                std::os::fd::AsRawFd::as_raw_fd(&self.stream),
                (&raw mut byte).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match got {
            0 => true,
            n if n > 0 => false,
            _ => !matches!(
                std::io::Error::last_os_error().kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ),
        }
    }

    /// Queues a chunk: WRITE frames carry payloads, READ frames ask for
    /// them. Blocks larger than [`MAX_FRAME_PAYLOAD_BYTES`] span frames.
    /// Returns the chunk's id on this connection.
    ///
    /// # Safety
    ///
    /// As [`LaneLink::transfer`](crate::transport::LaneLink::transfer): the
    /// blocks' local ranges are read (WRITE) or written (READ) later, by
    /// `send` and `progress`, until the chunk's ticket ends.
    pub unsafe fn queue_chunk(&mut self, peer: &Peer, op: Opcode, batch_id: u64, ticket: u64, blocks: &[Block]) -> u64 {
        let frame_op = match op {
            Opcode::Write => FrameOp::Write,
            Opcode::Read => FrameOp::Read,
        };
        let mut spans = self.spare.pop().unwrap_or_default();
        spans.clear();
        for block in blocks {
            let mut done = 0;
            while done < block.desc.len {
                let len = (block.desc.len - done).min(MAX_FRAME_PAYLOAD_BYTES);
                spans.push(Span {
                    // The lane validated `local..local + desc.len`; `done < desc.len`.
                    local: block.local.wrapping_add(done as usize),
                    region: block.desc.remote_region.raw(),
                    offset: block.desc.remote_offset + done,
                    len,
                    local_offset: block.desc.local_offset + done,
                    desc_index: block.desc_index,
                    checksum: block.checksum,
                });
                done += len;
            }
        }
        let chunk = self.take_chunk_id();
        let count = spans.len();
        // A part's blocks share its grant: a GRANT frame goes before its
        // WRITE frames when it differs from the last one named.
        let grant = blocks.first().map_or(0, |b| b.grant);
        if op == Opcode::Write && grant != self.sent_grant {
            let header = FrameHeader::new(FrameOp::Grant, peer.epoch, batch_id, 0, u64::from(grant), 0);
            self.out.push_back(OutFrame { header, payload: std::ptr::null(), len: 0, chunk, sealed: false });
            self.sent_grant = grant;
        }
        // A part's blocks share its tag; READ never carries one.
        let tag = blocks.first().map_or(0, |b| b.tag);
        for (index, span) in spans.iter().enumerate() {
            let mut header = FrameHeader::new(frame_op, peer.epoch, batch_id, span.region, span.offset, span.len);
            if index + 1 == count {
                header.flags = FLAG_LAST;
            }
            if tag != 0 && op == Opcode::Write {
                header.flags |= FLAG_TAGGED;
                header.status = tag as i32;
            } else if span.checksum && op == Opcode::Read {
                header.flags |= FLAG_CHECKSUM;
            } else if span.checksum {
                header.flags |= FLAG_CHECKSUM;
                // SAFETY: the span lies in a block the lane validated and
                // leased for this chunk (our contract); a WRITE only reads it.
                let sum = unsafe { crate::transport::checksum::crc32c_host(span.local, span.len as usize) };
                header.status = sum as i32;
            }
            let (payload, len) = match op {
                Opcode::Write => (span.local as *const u8, span.len as usize),
                Opcode::Read => (std::ptr::null(), 0),
            };
            self.out.push_back(OutFrame { header, payload, len, chunk, sealed: false });
        }
        let window_bytes = spans.iter().map(|s| s.len).sum();
        self.await_reply(Awaited {
            ticket,
            chunk,
            batch_id,
            op: frame_op,
            spans,
            next: 0,
            moved: 0,
            failure: None,
            grant,
            _payload: Vec::new(),
            window_bytes,
            admitted: false,
        });
        chunk
    }

    /// Queues a notification (an encoded `Notification`) after everything
    /// queued before it.
    pub fn queue_notification(&mut self, peer: &Peer, ticket: u64, payload: Vec<u8>) {
        let header = FrameHeader::new(FrameOp::Notify, peer.epoch, 0, 0, 0, payload.len() as u64);
        let chunk = self.take_chunk_id();
        // The Vec's heap buffer does not move when the Vec does.
        self.out.push_back(OutFrame { header, payload: payload.as_ptr(), len: payload.len(), chunk, sealed: false });
        self.await_reply(Awaited {
            ticket,
            chunk,
            batch_id: 0,
            op: FrameOp::Notify,
            spans: Vec::new(),
            next: 0,
            moved: 0,
            failure: None,
            grant: 0,
            window_bytes: payload.len() as u64,
            _payload: payload,
            admitted: false,
        });
    }

    fn take_chunk_id(&mut self) -> u64 {
        let chunk = self.next_chunk;
        self.next_chunk = self.next_chunk.wrapping_add(1);
        chunk
    }

    fn await_reply(&mut self, awaited: Awaited) {
        if self.awaiting.is_empty() {
            self.stalled_since = None;
        }
        self.awaiting.push_back(awaited);
    }

    /// Sends what the socket takes now. On failure the connection is dead:
    /// the caller fails everything on it.
    pub fn send(&mut self, peer: &Peer) -> Result<bool> {
        let mut progressed = false;
        while !self.out.is_empty() {
            self.admit();
            self.seal_next();
            let mut slices = [IoSlice::new(&[]); MAX_IO_SLICES];
            let mut count = 0;
            let mut skip = self.front_sent;
            for frame in self.out.iter() {
                // Past the window: the rest waits for acks (`window`).
                if count + 2 > MAX_IO_SLICES || frame.chunk >= self.admit_below {
                    break;
                }
                let header = frame.header.as_bytes();
                let payload: &[u8] = if frame.len == 0 {
                    &[]
                } else {
                    // A frame is queued only while its chunk is awaited: WRITE payloads are
                    // leased registered memory until their chunk ends, notification payloads
                    // are owned by their `Awaited`; no chunk ends while a frame of it is queued
                    // (`on_header` refuses such a reply; `drop_unsent`, `fail_all` drop both).
                    // SAFETY: the payload is live for `frame.len` bytes, as above.
                    unsafe { std::slice::from_raw_parts(frame.payload, frame.len) }
                };
                if skip < header.len() {
                    slices[count] = IoSlice::new(&header[skip..]);
                    count += 1;
                    if !payload.is_empty() {
                        slices[count] = IoSlice::new(payload);
                        count += 1;
                    }
                } else {
                    slices[count] = IoSlice::new(&payload[skip - header.len()..]);
                    count += 1;
                }
                skip = 0;
            }
            if count == 0 {
                break;
            }
            match self.stream.write_vectored(&slices[..count]) {
                Ok(0) => return Err(peer.gone(format!("{} stopped taking bytes", peer.addr))),
                Ok(written) => {
                    progressed = true;
                    self.advance_sent(written);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(peer.gone(format!("sending to {}: {e}", peer.addr))),
            }
        }
        Ok(progressed)
    }

    fn advance_sent(&mut self, mut written: usize) {
        while written > 0 {
            let Some(front) = self.out.front() else { return };
            let left = front.total() - self.front_sent;
            if written >= left {
                written -= left;
                self.out.pop_front();
                self.front_sent = 0;
            } else {
                self.front_sent += written;
                written = 0;
            }
        }
    }

    /// Sends, receives, and ends chunks whose replies are complete. An
    /// `Err` means the connection is dead (closed, reset, out of step, or
    /// silent for `io_timeout` with replies awaited).
    pub fn progress(&mut self, peer: &Peer, io_timeout: Duration, finished: &mut Vec<ChunkEnd>) -> Result<bool> {
        if let Some(reason) = self.dead.take() {
            return Err(reason);
        }
        let mut sent = self.send(peer)?;
        let received = self.receive(peer, finished)?;
        // Acks open the window: what they let go leaves in this round.
        sent |= received && !self.out.is_empty() && self.send(peer)?;
        if sent || received || self.awaiting.is_empty() {
            self.stalled_since = None;
        } else {
            let since = *self.stalled_since.get_or_insert_with(Instant::now);
            if since.elapsed() > io_timeout {
                return Err(Error::PeerStalled {
                    segment: format!("{} ({})", peer.name, peer.addr),
                    waited: io_timeout,
                });
            }
        }
        Ok(sent || received)
    }

    /// Records a failed send outside `progress`; the next poll reports it.
    pub fn mark_dead(&mut self, reason: Error) {
        self.dead.get_or_insert(reason);
    }

    /// The socket's descriptor (for the lane's wake descriptor to name it).
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.stream)
    }

    /// Shuts the socket down both ways (the peer sees it closed even while
    /// another descriptor of it stays open).
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    fn receive(&mut self, peer: &Peer, finished: &mut Vec<ChunkEnd>) -> Result<bool> {
        let mut progressed = false;
        loop {
            match self.receiving {
                Receiving::Header => {
                    if self.end - self.start < FRAME_HEADER_BYTES {
                        // A large payload is next: read only its header, so
                        // the payload lands in local memory in one copy.
                        let limit = if self.large_reply_next() { FRAME_HEADER_BYTES } else { usize::MAX };
                        match self.fill(peer, limit)? {
                            0 => return Ok(progressed),
                            _ => {
                                progressed = true;
                                continue;
                            }
                        }
                    }
                    let bytes = &self.buffer[self.start..self.start + FRAME_HEADER_BYTES];
                    let (header, _) = FrameHeader::decode(bytes)
                        .map_err(|e| peer.gone(format!("{} sent a malformed reply: {e}", peer.addr)))?;
                    if let Some(seal) = &mut self.seal {
                        // Before anything of it is believed: a forged reply
                        // could otherwise end a chunk or aim a READ payload.
                        header.check_seal(seal)?;
                    }
                    if header.failure() == Some(-(ErrorCode::Unauthorized as i32)) {
                        // Only a connection-level refusal says this: one of
                        // our frames failed the session's MAC on arrival.
                        return Err(Error::Unauthorized {
                            reason: format!(
                                "{} refused a frame of this connection: it failed the session's MAC (tampered on \
                                 the path); the connection is closed",
                                peer.addr
                            ),
                        });
                    }
                    self.start += FRAME_HEADER_BYTES;
                    self.on_header(peer, &header, finished)?;
                }
                Receiving::Payload(landing) => {
                    let Landing { dest, left } = landing;
                    let buffered = self.end - self.start;
                    let took = if buffered > 0 {
                        let n = buffered.min(left);
                        // SAFETY: `dest..dest + left` is the READ span's leased local range; `n <= left`.
                        unsafe { std::ptr::copy_nonoverlapping(self.buffer.as_ptr().add(self.start), dest, n) };
                        self.start += n;
                        n
                    } else if left >= DIRECT_READ_MIN_BYTES {
                        // SAFETY: as above; the slice is the span's unfilled tail.
                        let target = unsafe { std::slice::from_raw_parts_mut(dest, left) };
                        match read_some(&mut self.stream, target, peer)? {
                            0 => return Ok(progressed),
                            n => n,
                        }
                    } else {
                        match self.fill(peer, usize::MAX)? {
                            0 => return Ok(progressed),
                            _ => {
                                progressed = true;
                                continue;
                            }
                        }
                    };
                    progressed = true;
                    // SAFETY: the `took` bytes at `dest` just landed in the span's leased range.
                    unsafe { self.sum_landed(dest, took) };
                    if took == left {
                        self.frame_done(finished)?;
                    } else {
                        self.receiving = Receiving::Payload(landing.advanced(took));
                    }
                }
                Receiving::Discard { left } => {
                    if self.end == self.start && self.fill(peer, usize::MAX)? == 0 {
                        return Ok(progressed);
                    }
                    let n = (self.end - self.start).min(left);
                    self.start += n;
                    progressed = true;
                    if n == left {
                        self.frame_done(finished)?;
                    } else {
                        self.receiving = Receiving::Discard { left: left - n };
                    }
                }
            }
        }
    }

    /// True when the next reply is a READ payload big enough to read
    /// straight into local memory.
    fn large_reply_next(&self) -> bool {
        self.awaiting.front().is_some_and(|front| {
            front.op == FrameOp::Read
                && front.failure.is_none()
                && front.spans.get(front.next).is_some_and(|span| span.len as usize >= DIRECT_READ_MIN_BYTES)
        })
    }

    /// Reads into the buffer's free tail (compacting first), stopping once
    /// the buffer holds `want` bytes; 0 when nothing has arrived.
    fn fill(&mut self, peer: &Peer, want: usize) -> Result<usize> {
        super::compact(&mut self.buffer, &mut self.start, &mut self.end);
        let room = (self.buffer.len() - self.end).min(want.saturating_sub(self.end - self.start).max(1));
        let n = read_some(&mut self.stream, &mut self.buffer[self.end..self.end + room], peer)?;
        self.end += n;
        Ok(n)
    }

    fn on_header(&mut self, peer: &Peer, reply: &FrameHeader, finished: &mut Vec<ChunkEnd>) -> Result<()> {
        let front = self
            .awaiting
            .front_mut()
            .ok_or_else(|| peer.gone(format!("{} sent a reply nobody asked for", peer.addr)))?;
        if reply.batch_id != front.batch_id {
            return Err(peer.gone(format!("{} answered out of order", peer.addr)));
        }
        match front.op {
            FrameOp::Write | FrameOp::Notify => {
                // Frames leave in order, so a chunk with a frame still queued
                // has it at the front. An ack for it now would end it while
                // its payload is still to be read from memory it no longer
                // holds: only a peer out of step does that.
                if self.out.front().is_some_and(|frame| frame.chunk == front.chunk) {
                    return Err(peer.gone(format!("{} acknowledged a chunk before it was sent", peer.addr)));
                }
                if reply.opcode != FrameOp::Ack as u8 {
                    return Err(
                        peer.gone(format!("{} answered a {:?} with opcode {}", peer.addr, front.op, reply.opcode))
                    );
                }
                let result = if reply.status == 0 {
                    Ok(front.spans.iter().map(|s| s.len).sum())
                } else {
                    let failed = |s: &&Span| s.region == reply.region && s.offset == reply.offset;
                    let before = front.spans.iter().take_while(|s| !failed(s)).map(|s| s.len).sum();
                    let corrupt = reply.status == -(ErrorCode::Corrupt as i32);
                    let error = match front.spans.iter().find(failed) {
                        Some(span) if corrupt && span.checksum => Error::Corrupt {
                            desc_index: span.desc_index,
                            detail: format!(
                                "{} computed another CRC32C over the bytes it received at region {} offset {}",
                                peer.name,
                                crate::RegionId::from_raw(reply.region),
                                reply.offset
                            ),
                        },
                        _ => peer.refused(reply, front.grant),
                    };
                    Err((error, before))
                };
                self.end_front(result, finished)
            }
            _ => self.on_read_data(peer, reply, finished),
        }
    }
}

/// One non-blocking read: 0 when nothing has arrived; an error when the
/// peer closed or reset the connection.
fn read_some(stream: &mut TcpStream, into: &mut [u8], peer: &Peer) -> Result<usize> {
    loop {
        return match stream.read(into) {
            Ok(0) => Err(peer.gone(format!("{} closed the connection", peer.addr))),
            Ok(n) => Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => Err(peer.gone(format!("reading from {}: {e}", peer.addr))),
        };
    }
}

mod ends;
mod read_data;
#[cfg(test)]
mod tests;
mod window;
