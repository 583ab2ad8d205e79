//! The control-plane server: answers handshakes (the engine's segment
//! descriptor) and checksum requests on a TCP listener.
//!
//! It runs on its own threads, never on a lane. It binds exactly the address
//! it is given, bounds its connections, frame sizes and idle time, and
//! answers every bad message with an error reply naming the problem.

use super::frame::{self, decode_request, error_response, read_frame, write_frame, MAX_CONTROL_MESSAGE_BYTES};
use crate::error::{Error, Result};
use crate::net::Acceptor;
use crate::proto::{
    request, response, ChecksumRequest, ChecksumResponse, HandshakeRequest, HandshakeResponse, Notification,
    NotifyResponse,
};
use crate::segment::SegmentDescriptor;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most control connections served at once.
pub const MAX_CONTROL_CONNECTIONS: usize = 64;
/// A control connection idle this long is closed.
pub const DEFAULT_CONTROL_IDLE: Duration = Duration::from_secs(30);
/// How often a connection thread looks at the stop flag while idle.
const STOP_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// What the server asks of the engine.
pub trait ControlHandler: Send + Sync + 'static {
    /// The engine's current segment descriptor, once the request's token is
    /// checked (`Error::Unauthorized` when it is wrong or missing).
    fn handshake(&self, request: &HandshakeRequest) -> Result<SegmentDescriptor>;
    /// True when a connection must complete a handshake before any other
    /// request (the engine has a token).
    fn requires_handshake(&self) -> bool;
    /// Checksum of a remote-readable range of one of the engine's regions.
    fn checksum(&self, request: &ChecksumRequest) -> Result<u64>;
    /// Queues a notification from a peer.
    fn notify(&self, notification: Notification) -> Result<()>;
    /// The registered KV-cache layout.
    fn memory_info(&self) -> Result<crate::proto::KvLayoutInfo>;
    /// Connects QPs of ours to an initiator's (RDMA); ours, in its order.
    fn rdma_connect(&self, request: &crate::proto::RdmaConnectRequest) -> Result<Vec<crate::proto::QpEndpointInfo>>;
}

/// A running control server.
#[derive(Debug)]
pub struct ControlServer {
    acceptor: Acceptor,
}

impl ControlServer {
    /// Binds `listen` (only that address) and serves until stopped.
    pub fn start(listen: SocketAddr, handler: Arc<dyn ControlHandler>) -> Result<Self> {
        let refuse = |stream: &mut TcpStream| {
            let error = Error::Busy { queue: "control connection table", capacity: MAX_CONTROL_CONNECTIONS };
            let _ = write_frame(stream, &error_response(&error));
        };
        let serve = move |stream: TcpStream, stop: &AtomicBool| serve_connection(stream, &*handler, stop);
        Ok(Self { acceptor: Acceptor::start(listen, "control", MAX_CONTROL_CONNECTIONS, refuse, serve)? })
    }

    /// The bound address (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }

    /// Stops accepting and cuts every open connection.
    pub fn stop(&mut self) {
        self.acceptor.stop();
    }
}

fn serve_connection(mut stream: TcpStream, handler: &dyn ControlHandler, stop: &AtomicBool) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(STOP_CHECK_INTERVAL));
    let _ = stream.set_write_timeout(Some(DEFAULT_CONTROL_IDLE));
    let mut idle_since = Instant::now();
    let mut authenticated = !handler.requires_handshake();
    loop {
        if stop.load(Ordering::Acquire) || idle_since.elapsed() > DEFAULT_CONTROL_IDLE {
            return;
        }
        // Wait for the first byte with the short timeout, so the stop flag
        // and the idle limit are honoured; then read the frame whole.
        let mut first = [0u8; 1];
        match stream.peek(&mut first) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(_) => return,
        }
        let _ = stream.set_read_timeout(Some(DEFAULT_CONTROL_IDLE));
        let frame = read_frame(&mut stream, MAX_CONTROL_MESSAGE_BYTES);
        let _ = stream.set_read_timeout(Some(STOP_CHECK_INTERVAL));
        idle_since = Instant::now();
        let (reply, keep_open) = match frame {
            Ok(None) => return,
            Ok(Some(body)) => match decode_request(&body).and_then(|body| handle(handler, body, &mut authenticated)) {
                Ok(reply) => (frame::response(reply), true),
                // The frame boundary is intact, so the connection survives a
                // bad message.
                Err(error) => (error_response(&error), true),
            },
            // Lost framing (oversized or truncated): answer, then close.
            Err(error) => (error_response(&error), false),
        };
        if write_frame(&mut stream, &reply).is_err() || !keep_open {
            return;
        }
    }
}

fn handle(handler: &dyn ControlHandler, body: request::Body, authenticated: &mut bool) -> Result<response::Body> {
    match body {
        request::Body::Handshake(request) => {
            let descriptor = handler.handshake(&request)?;
            *authenticated = true;
            Ok(response::Body::Handshake(HandshakeResponse { segment: Some(descriptor.to_proto()) }))
        }
        _ if !*authenticated => {
            Err(Error::Unauthorized { reason: "this engine needs a handshake with its token first".into() })
        }
        request::Body::Checksum(request) => {
            Ok(response::Body::Checksum(ChecksumResponse { checksum: handler.checksum(&request)? }))
        }
        request::Body::Notify(notification) => {
            handler.notify(notification)?;
            Ok(response::Body::Notify(NotifyResponse {}))
        }
        request::Body::MemoryInfo(_) => {
            Ok(response::Body::MemoryInfo(crate::proto::MemoryInfoResponse { layout: Some(handler.memory_info()?) }))
        }
        request::Body::RdmaConnect(request) => Ok(response::Body::RdmaConnect(crate::proto::RdmaConnectResponse {
            endpoints: handler.rdma_connect(&request)?,
        })),
    }
}
