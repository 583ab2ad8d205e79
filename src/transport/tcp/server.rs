//! The target side of the TCP transport: a listener whose connections each
//! get a thread that reads frames, checks every block against this engine's
//! own registry (region exists, access, bounds, epoch), and only then
//! touches memory.
//!
//! A bad block fails its chunk (the rest of the chunk's payload is read and
//! dropped, so framing survives) and the chunk's ack carries the error. A
//! frame that cannot be framed (bad magic, version, opcode, oversized) is
//! answered once and the connection closed. Other connections never notice.

use super::frame::{FrameHeader, FrameOp, FLAG_LAST, FRAME_HEADER_BYTES};
use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::mem::registry::{access_name, check_range};
use crate::mem::{Access, Registry};
use crate::net::Acceptor;
use crate::transport::notify::{Notification, NotificationQueue};
use prost::Message;
use std::io::{BufReader, BufWriter, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zerocopy::IntoBytes;

/// Most data connections served at once.
pub const MAX_DATA_CONNECTIONS: usize = 256;
/// A data connection idle this long is closed.
pub const DATA_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Longest a started frame may take to arrive in full.
pub const FRAME_READ_TIMEOUT: Duration = Duration::from_secs(10);
const STOP_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// A running data server.
#[derive(Debug)]
pub struct TcpDataServer {
    acceptor: Acceptor,
}

struct Context {
    registry: Arc<Registry>,
    notifications: Arc<NotificationQueue>,
    epoch: u64,
}

impl TcpDataServer {
    /// Binds `listen` (only that address) and serves `registry`'s regions.
    pub fn start(
        listen: SocketAddr,
        registry: Arc<Registry>,
        notifications: Arc<NotificationQueue>,
        epoch: u64,
    ) -> Result<Self> {
        let context = Context { registry, notifications, epoch };
        let refuse = |stream: &mut TcpStream| {
            let error = Error::Busy { queue: "tcp data connection table", capacity: MAX_DATA_CONNECTIONS };
            let _ = send_status(stream, FrameOp::Ack, &FrameHeader::new(FrameOp::Ack, 0, 0, 0, 0, 0), &error);
        };
        let serve = move |stream: TcpStream, stop: &AtomicBool| {
            let _ = serve_connection(stream, &context, stop);
        };
        Ok(Self { acceptor: Acceptor::start(listen, "tcp-data", MAX_DATA_CONNECTIONS, refuse, serve)? })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }

    /// Stops accepting and cuts every open connection.
    pub fn stop(&mut self) {
        self.acceptor.stop();
    }
}

/// The first failure of the chunk being received, if any.
struct Chunk {
    failure: Option<(FrameHeader, Error)>,
}

/// Bytes of frames read ahead: small frames cost one syscall per many.
const READ_BUFFER_BYTES: usize = 256 * 1024;
/// Bytes of replies gathered before a write.
const WRITE_BUFFER_BYTES: usize = 256 * 1024;

fn serve_connection(stream: TcpStream, context: &Context, stop: &AtomicBool) -> Result<()> {
    let _ = stream.set_nodelay(true);
    stream.set_write_timeout(Some(FRAME_READ_TIMEOUT)).map_err(|e| Error::io("setting write timeout", e))?;
    // Reads go through a buffer (headers and small payloads arrive many to
    // a syscall; large payloads bypass it straight into region memory);
    // replies go out on the stream itself.
    let mut reader =
        BufReader::with_capacity(READ_BUFFER_BYTES, stream.try_clone().map_err(|e| Error::io("cloning a socket", e))?);
    // Replies are buffered too, and flushed whenever no request is waiting:
    // a run of small READs is answered with a few large writes.
    let mut writer =
        BufWriter::with_capacity(WRITE_BUFFER_BYTES, stream.try_clone().map_err(|e| Error::io("cloning a socket", e))?);
    let mut chunk = Chunk { failure: None };
    let mut header_bytes = [0u8; FRAME_HEADER_BYTES];
    let mut idle_since = Instant::now();
    loop {
        if reader.buffer().is_empty() {
            writer.flush().map_err(|e| Error::io("sending replies", e))?;
            if !wait_readable(&stream, stop, &mut idle_since)? {
                return Ok(());
            }
            // Waiting used a short timeout; a started frame gets the long
            // one. Only here: a frame already buffered needs no syscall.
            stream.set_read_timeout(Some(FRAME_READ_TIMEOUT)).map_err(|e| Error::io("setting read timeout", e))?;
        }
        if reader.read_exact(&mut header_bytes).is_err() {
            // Disconnected or stalled mid-header: nothing to answer.
            return Ok(());
        }
        if stop.load(Ordering::Acquire) {
            // Stopping: take no more writes, so nothing lands after the
            // engine is gone.
            return Ok(());
        }
        let (header, op) = match FrameHeader::decode(&header_bytes) {
            Ok(decoded) => decoded,
            Err(error) => {
                // Framing is lost: answer once, close.
                let _ = send_status(&mut writer, FrameOp::Ack, &FrameHeader::new(FrameOp::Ack, 0, 0, 0, 0, 0), &error);
                let _ = writer.flush();
                return Ok(());
            }
        };
        match op {
            FrameOp::Write => receive_write(&mut reader, &mut writer, context, &header, &mut chunk)?,
            FrameOp::Read => serve_read(&mut writer, context, &header)?,
            FrameOp::Notify => receive_notify(&mut reader, &mut writer, context, &header)?,
            FrameOp::Ack | FrameOp::ReadData => {
                let error = Error::malformed("frame", format!("{op:?} is a reply, not a request"));
                let _ = send_status(&mut writer, FrameOp::Ack, &header, &error);
                let _ = writer.flush();
                return Ok(());
            }
        }
        idle_since = Instant::now();
    }
}

/// Waits until a frame starts, honouring the stop flag and the idle limit.
/// False when the connection should end.
fn wait_readable(stream: &TcpStream, stop: &AtomicBool, idle_since: &mut Instant) -> Result<bool> {
    stream.set_read_timeout(Some(STOP_CHECK_INTERVAL)).map_err(|e| Error::io("setting read timeout", e))?;
    let mut probe = [0u8; 1];
    loop {
        if stop.load(Ordering::Acquire) || idle_since.elapsed() > DATA_IDLE_TIMEOUT {
            return Ok(false);
        }
        match stream.peek(&mut probe) {
            Ok(0) => return Ok(false),
            Ok(_) => return Ok(true),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return Ok(false),
        }
    }
}

/// Checks one block against the registry; on success returns its address
/// with a lease held (the caller releases `region`).
fn check_block(context: &Context, header: &FrameHeader, needs: Access) -> Result<usize> {
    if header.epoch != context.epoch {
        return Err(Error::PeerRestarted {
            segment: "this target".into(),
            detail: format!("frame for epoch {:#x}, but the current epoch is {:#x}", header.epoch, context.epoch),
        });
    }
    let region = RegionId::from_raw(header.region);
    context.registry.lease(region).map_err(|_| Error::UnknownRegion { side: Side::Remote, region })?;
    let checked = (|| {
        let entry = context.registry.leased(region)?;
        if !entry.info.access.contains(needs) {
            return Err(Error::AccessDenied { desc_index: 0, side: Side::Remote, region, needs: access_name(needs) });
        }
        check_range(region, Side::Remote, 0, header.offset, header.len, entry.len as u64)?;
        Ok(entry.addr + header.offset as usize)
    })();
    if checked.is_err() {
        context.registry.release(region);
    }
    checked
}

fn receive_write(
    reader: &mut BufReader<TcpStream>,
    out: &mut impl Write,
    context: &Context,
    header: &FrameHeader,
    chunk: &mut Chunk,
) -> Result<()> {
    let len = header.len as usize;
    if chunk.failure.is_none() {
        match check_block(context, header, Access::REMOTE_WRITE) {
            Ok(addr) => {
                // SAFETY: `addr..addr+len` lies in a registered region (checked
                // above) that our lease keeps registered until released below.
                let target = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
                let received = reader.read_exact(target);
                context.registry.release(RegionId::from_raw(header.region));
                if received.is_err() {
                    // The initiator went away mid-frame: bytes before the
                    // cut are in place, and no ack says the chunk is done.
                    return Err(Error::malformed("frame", "connection ended inside a payload"));
                }
            }
            Err(error) => {
                chunk.failure = Some((*header, error));
                discard(reader, len)?;
            }
        }
    } else {
        discard(reader, len)?;
    }
    if header.flags & FLAG_LAST != 0 {
        let failure = chunk.failure.take();
        match failure {
            None => {
                let mut ack = FrameHeader::new(FrameOp::Ack, context.epoch, header.batch_id, 0, 0, 0);
                ack.status = 0;
                out.write_all(ack.as_bytes()).map_err(|e| Error::io("sending ack", e))?;
            }
            Some((failed, error)) => send_status(out, FrameOp::Ack, &failed, &error)?,
        }
    }
    Ok(())
}

fn receive_notify(
    reader: &mut BufReader<TcpStream>,
    out: &mut impl Write,
    context: &Context,
    header: &FrameHeader,
) -> Result<()> {
    let mut payload = vec![0u8; header.len as usize];
    reader.read_exact(&mut payload).map_err(|_| Error::malformed("frame", "connection ended inside a payload"))?;
    let delivered = if header.epoch != context.epoch {
        Err(Error::PeerRestarted { segment: "this target".into(), detail: "notification for another epoch".into() })
    } else {
        crate::proto::Notification::decode(payload.as_slice())
            .map_err(|e| Error::malformed("notification", e.to_string()))
            .and_then(|n| context.notifications.deliver(Notification { from: n.from, message: n.message }))
    };
    match delivered {
        Ok(()) => {
            let ack = FrameHeader::new(FrameOp::Ack, context.epoch, header.batch_id, 0, 0, 0);
            out.write_all(ack.as_bytes()).map_err(|e| Error::io("sending ack", e))
        }
        Err(error) => send_status(out, FrameOp::Ack, header, &error),
    }
}

/// READ payloads at least this large are written straight from region
/// memory rather than through the reply buffer.
const DIRECT_WRITE_MIN_BYTES: usize = 16 * 1024;

fn serve_read(out: &mut BufWriter<TcpStream>, context: &Context, header: &FrameHeader) -> Result<()> {
    match check_block(context, header, Access::REMOTE_READ) {
        Ok(addr) => {
            let reply = FrameHeader::new(
                FrameOp::ReadData,
                context.epoch,
                header.batch_id,
                header.region,
                header.offset,
                header.len,
            );
            // SAFETY: as in `receive_write`; the lease is released below.
            let source = unsafe { std::slice::from_raw_parts(addr as *const u8, header.len as usize) };
            let sent = if source.len() >= DIRECT_WRITE_MIN_BYTES {
                // Large payloads skip the reply buffer: one writev, no copy.
                out.flush().and_then(|()| write_all_vectored(out.get_mut(), reply.as_bytes(), source))
            } else {
                out.write_all(reply.as_bytes()).and_then(|()| out.write_all(source))
            };
            context.registry.release(RegionId::from_raw(header.region));
            sent.map_err(|e| Error::io("sending read data", e))
        }
        Err(error) => send_status(out, FrameOp::ReadData, header, &error),
    }
}

/// Writes a header and its payload with as few `writev`s as it takes.
fn write_all_vectored(stream: &mut TcpStream, header: &[u8], payload: &[u8]) -> std::io::Result<()> {
    let mut slices = [IoSlice::new(header), IoSlice::new(payload)];
    let mut slices = &mut slices[..];
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

/// Reads and drops `len` payload bytes, keeping the framing.
fn discard(reader: &mut BufReader<TcpStream>, len: usize) -> Result<()> {
    let copied = std::io::copy(&mut reader.take(len as u64), &mut std::io::sink())
        .map_err(|e| Error::io("discarding a refused payload", e))?;
    if copied != len as u64 {
        return Err(Error::malformed("frame", "connection ended inside a payload"));
    }
    Ok(())
}

/// Sends a reply header that reports `error` for the frame `about`.
fn send_status(out: &mut impl Write, op: FrameOp, about: &FrameHeader, error: &Error) -> Result<()> {
    let mut reply = FrameHeader::new(op, about.epoch, about.batch_id, about.region, about.offset, 0);
    reply.status = -(error.code() as i32);
    reply.len = 0;
    out.write_all(reply.as_bytes()).map_err(|e| Error::io("sending an error reply", e))
}
