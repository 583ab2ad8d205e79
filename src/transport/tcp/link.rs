//! The initiator side of the TCP transport: one connection per lane to the
//! peer's data listener, made when the segment is opened (on the caller's
//! thread, never on a lane), used only by its lane.
//!
//! A chunk of WRITE blocks goes out as frames written back to back with
//! vectored writes, the last one flagged, and one ack comes back for the
//! chunk. A chunk of READs is sent as one run of request headers; the
//! replies come back in order and each payload lands straight in local
//! memory. Blocks over [`MAX_FRAME_PAYLOAD_BYTES`] are split into frames.

use super::frame::{FrameHeader, FrameOp, FLAG_LAST, FRAME_HEADER_BYTES, MAX_FRAME_PAYLOAD_BYTES, MAX_NOTIFY_BYTES};
use crate::error::{Error, Result};
use crate::proto::ErrorCode;
use crate::ring::Opcode;
use crate::segment::TransportKind;
use crate::transport::{Block, Link, TransferError};
use prost::Message;
use std::io::{BufReader, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use zerocopy::IntoBytes;

/// Default deadline of one socket read or write on a data connection.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Blocks a lane hands the TCP link at once (one ack per chunk).
pub const TCP_CHUNK_BLOCKS: usize = 64;
/// Read-ahead buffer of a connection's replies.
const REPLY_BUFFER_BYTES: usize = 256 * 1024;

struct Connection {
    stream: TcpStream,
    /// Replies are read through a buffer: headers and small payloads come
    /// many to a syscall; large payloads bypass it into local memory.
    reader: BufReader<TcpStream>,
    /// Frame headers of the chunk being sent (reused, no allocation once warm).
    headers: Vec<FrameHeader>,
}

/// Connections to one peer, one per lane.
pub struct TcpLink {
    peer: String,
    addr: SocketAddr,
    epoch: u64,
    connections: Box<[Mutex<Option<Connection>>]>,
    broken: AtomicBool,
}

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLink").field("peer", &self.peer).field("addr", &self.addr).finish()
    }
}

impl TcpLink {
    /// Connects `lanes` connections to `data_addr` before `deadline`.
    pub fn connect(
        peer: &str,
        data_addr: &str,
        epoch: u64,
        lanes: usize,
        deadline: Instant,
        io_timeout: Duration,
    ) -> Result<Self> {
        let addr = data_addr
            .to_socket_addrs()
            .map_err(|e| Error::io(format!("resolving {peer}'s data address {data_addr}"), e))?
            .next()
            .ok_or_else(|| Error::invalid("data address", format!("{data_addr} resolves to nothing")))?;
        let mut connections = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout { waited: Duration::ZERO });
            }
            let stream = TcpStream::connect_timeout(&addr, left)
                .map_err(|e| Error::io(format!("connecting to {peer}'s data listener {addr}"), e))?;
            let _ = stream.set_nodelay(true);
            stream.set_read_timeout(Some(io_timeout)).map_err(|e| Error::io("setting read timeout", e))?;
            stream.set_write_timeout(Some(io_timeout)).map_err(|e| Error::io("setting write timeout", e))?;
            let reader = BufReader::with_capacity(
                REPLY_BUFFER_BYTES,
                stream.try_clone().map_err(|e| Error::io("cloning a socket", e))?,
            );
            connections.push(Mutex::new(Some(Connection {
                stream,
                reader,
                headers: Vec::with_capacity(TCP_CHUNK_BLOCKS),
            })));
        }
        Ok(Self {
            peer: peer.to_string(),
            addr,
            epoch,
            connections: connections.into_boxed_slice(),
            broken: AtomicBool::new(false),
        })
    }

    /// True once a connection broke or the peer reported another epoch.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn gone(&self, detail: impl Into<String>) -> Error {
        self.broken.store(true, Ordering::Release);
        Error::PeerRestarted { segment: self.peer.clone(), detail: detail.into() }
    }

    /// Turns a reply's failure status into an error.
    fn refused(&self, reply: &FrameHeader) -> Error {
        let code = ErrorCode::try_from(-reply.status).unwrap_or(ErrorCode::Internal);
        if code == ErrorCode::PeerRestarted {
            return self.gone(format!("it answered with another epoch than {:#x}", self.epoch));
        }
        Error::Remote {
            code,
            message: format!(
                "{} refused the block at region {} offset {}",
                self.peer,
                crate::RegionId::from_raw(reply.region),
                reply.offset
            ),
        }
    }

    fn frames(&self, op: FrameOp, batch_id: u64, blocks: &[Block], headers: &mut Vec<FrameHeader>) {
        headers.clear();
        for block in blocks {
            let mut done = 0;
            while done < block.desc.len {
                let len = (block.desc.len - done).min(MAX_FRAME_PAYLOAD_BYTES);
                let offset = block.desc.remote_offset + done;
                headers.push(FrameHeader::new(op, self.epoch, batch_id, block.desc.remote_region.raw(), offset, len));
                done += len;
            }
        }
        if let Some(last) = headers.last_mut() {
            last.flags = FLAG_LAST;
        }
    }

    /// Bytes of the blocks before the one a failing reply names.
    fn bytes_before(blocks: &[Block], reply: &FrameHeader) -> u64 {
        blocks
            .iter()
            .take_while(|b| {
                let d = &b.desc;
                !(d.remote_region.raw() == reply.region
                    && (d.remote_offset..d.remote_offset + d.len).contains(&reply.offset))
            })
            .map(|b| b.desc.len)
            .sum()
    }

    /// # Safety: as [`Link::transfer`].
    unsafe fn write_chunk(
        &self,
        connection: &mut Connection,
        batch_id: u64,
        blocks: &[Block],
    ) -> Result<u64, TransferError> {
        let Connection { stream, reader, headers } = connection;
        self.frames(FrameOp::Write, batch_id, blocks, headers);
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(headers.len() * 2);
        let mut frame = 0;
        for block in blocks {
            let mut done = 0u64;
            while done < block.desc.len {
                let len = headers[frame].len;
                // SAFETY: `block.local..+desc.len` is valid for reads (the
                // caller's contract) and `done + len <= desc.len`.
                let payload = unsafe { std::slice::from_raw_parts(block.local.add(done as usize), len as usize) };
                slices.push(IoSlice::new(headers[frame].as_bytes()));
                slices.push(IoSlice::new(payload));
                done += len;
                frame += 1;
            }
        }
        if let Err(e) = write_all_vectored(stream, &mut slices) {
            return Err((self.gone(format!("sending to {}: {e}", self.addr)), 0));
        }
        let reply = read_reply(reader).map_err(|e| (self.gone(format!("waiting for {}'s ack: {e}", self.addr)), 0))?;
        if reply.opcode != FrameOp::Ack as u8 || reply.batch_id != batch_id {
            return Err((self.gone(format!("{} answered out of order", self.addr)), 0));
        }
        if reply.status != 0 {
            return Err((self.refused(&reply), Self::bytes_before(blocks, &reply)));
        }
        Ok(blocks.iter().map(|b| b.desc.len).sum())
    }

    /// # Safety: as [`Link::transfer`].
    unsafe fn read_chunk(
        &self,
        connection: &mut Connection,
        batch_id: u64,
        blocks: &[Block],
    ) -> Result<u64, TransferError> {
        let Connection { stream, reader, headers } = connection;
        self.frames(FrameOp::Read, batch_id, blocks, headers);
        if let Err(e) = stream.write_all(headers.as_slice().as_bytes()) {
            return Err((self.gone(format!("sending to {}: {e}", self.addr)), 0));
        }
        let mut moved = 0u64;
        let mut failure: Option<Error> = None;
        let mut frame = 0;
        for block in blocks {
            let mut done = 0u64;
            while done < block.desc.len {
                let asked = headers[frame];
                frame += 1;
                let reply =
                    read_reply(reader).map_err(|e| (self.gone(format!("reading from {}: {e}", self.addr)), moved))?;
                if reply.opcode != FrameOp::ReadData as u8 || reply.batch_id != batch_id {
                    return Err((self.gone(format!("{} answered out of order", self.addr)), moved));
                }
                if reply.status != 0 {
                    // Keep reading the replies still coming, so the
                    // connection stays framed for the next chunk.
                    failure.get_or_insert_with(|| self.refused(&reply));
                } else if reply.len != asked.len {
                    return Err((
                        self.gone(format!("{} sent {} bytes for a {}-byte read", self.addr, reply.len, asked.len)),
                        moved,
                    ));
                } else if failure.is_some() {
                    discard(reader, reply.len)
                        .map_err(|e| (self.gone(format!("reading from {}: {e}", self.addr)), moved))?;
                } else {
                    // SAFETY: `block.local..+desc.len` is valid for writes (the
                    // caller's contract) and `done + len <= desc.len`.
                    let target =
                        unsafe { std::slice::from_raw_parts_mut(block.local.add(done as usize), reply.len as usize) };
                    reader
                        .read_exact(target)
                        .map_err(|e| (self.gone(format!("reading from {}: {e}", self.addr)), moved))?;
                }
                done += asked.len;
            }
            if failure.is_none() {
                moved += block.desc.len;
            }
        }
        match failure {
            None => Ok(moved),
            Some(error) => Err((error, moved)),
        }
    }
}

fn read_reply(reader: &mut BufReader<TcpStream>) -> Result<FrameHeader> {
    let mut bytes = [0u8; FRAME_HEADER_BYTES];
    reader.read_exact(&mut bytes).map_err(|e| Error::io("reading a reply", e))?;
    Ok(FrameHeader::decode(&bytes)?.0)
}

fn discard(reader: &mut BufReader<TcpStream>, len: u64) -> std::io::Result<()> {
    let copied = std::io::copy(&mut reader.take(len), &mut std::io::sink())?;
    if copied == len {
        Ok(())
    } else {
        Err(std::io::ErrorKind::UnexpectedEof.into())
    }
}

/// `write_all` for a list of slices, with one `writev` per round.
fn write_all_vectored(stream: &mut TcpStream, mut slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    while !slices.is_empty() {
        match stream.write_vectored(slices) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl TcpLink {
    /// Sends a notification on lane `lane`'s data connection, after
    /// everything that lane has sent to this peer, and waits for its ack.
    pub fn send_notification(&self, lane: usize, from: &str, message: &[u8]) -> Result<()> {
        if message.len() > MAX_NOTIFY_BYTES {
            return Err(Error::MessageTooLarge { len: message.len() as u64, max: MAX_NOTIFY_BYTES as u64 });
        }
        let payload = crate::proto::Notification { from: from.to_string(), message: message.to_vec() }.encode_to_vec();
        let slot = self.connections.get(lane).ok_or_else(|| Error::invalid("lane", format!("{lane} is not a lane")))?;
        let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        let connection =
            guard.as_mut().ok_or_else(|| self.gone("its connection was closed after an earlier failure"))?;
        let header = FrameHeader::new(FrameOp::Notify, self.epoch, 0, 0, 0, payload.len() as u64);
        let sent =
            write_all_vectored(&mut connection.stream, &mut [IoSlice::new(header.as_bytes()), IoSlice::new(&payload)]);
        let result = match sent {
            Err(e) => Err(self.gone(format!("sending to {}: {e}", self.addr))),
            Ok(()) => match read_reply(&mut connection.reader) {
                Err(e) => Err(self.gone(format!("waiting for {}'s ack: {e}", self.addr))),
                Ok(reply) if reply.status != 0 => Err(self.refused(&reply)),
                Ok(_) => Ok(()),
            },
        };
        if self.is_broken() {
            *guard = None;
        }
        result
    }
}

impl Link for TcpLink {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn max_chunk(&self) -> usize {
        TCP_CHUNK_BLOCKS
    }

    fn notify(&self, lane: usize, from: &str, message: &[u8]) -> Option<Result<()>> {
        Some(self.send_notification(lane, from, message))
    }

    unsafe fn transfer(&self, lane: usize, op: Opcode, batch_id: u64, blocks: &[Block]) -> Result<u64, TransferError> {
        let Some(slot) = self.connections.get(lane) else {
            return Err((Error::invalid("lane", format!("{lane} has no connection to {}", self.peer)), 0));
        };
        // Only this lane locks its slot: the mutex is never contended.
        let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        let Some(connection) = guard.as_mut() else {
            return Err((self.gone("its connection was closed after an earlier failure"), 0));
        };
        // SAFETY: forwarded from our caller.
        let result = unsafe {
            match op {
                Opcode::Write => self.write_chunk(connection, batch_id, blocks),
                Opcode::Read => self.read_chunk(connection, batch_id, blocks),
            }
        };
        if self.is_broken() {
            *guard = None;
        }
        result
    }
}
