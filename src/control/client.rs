//! The control-plane client: one request, one response, within a deadline.

use super::frame::{decode_response, read_frame, request, write_frame, MAX_CONTROL_MESSAGE_BYTES};
use crate::error::{Error, Result};
use crate::proto::{request, response, ChecksumRequest, HandshakeRequest, Notification};
use crate::segment::SegmentDescriptor;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Default deadline of one control RPC (connect, send, answer).
pub const DEFAULT_CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to a peer's control server.
#[derive(Debug)]
pub struct ControlClient {
    stream: TcpStream,
    peer: SocketAddr,
}

impl ControlClient {
    /// Connects to `addr` (`host:port`) before `deadline`.
    pub fn connect(addr: &str, deadline: Instant) -> Result<Self> {
        let candidates: Vec<SocketAddr> =
            addr.to_socket_addrs().map_err(|e| Error::io(format!("resolving control address {addr}"), e))?.collect();
        let mut last_error = None;
        for peer in candidates {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout { waited: Duration::ZERO });
            }
            match TcpStream::connect_timeout(&peer, left) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(Self { stream, peer });
                }
                Err(e) => last_error = Some(Error::io(format!("connecting to control server {peer}"), e)),
            }
        }
        Err(last_error.unwrap_or_else(|| Error::invalid("control address", format!("{addr} resolves to no address"))))
    }

    /// Sends one request and reads its response before `deadline`.
    pub fn call(&mut self, body: request::Body, deadline: Instant) -> Result<response::Body> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout { waited: Duration::ZERO });
        }
        self.stream.set_write_timeout(Some(left)).map_err(|e| Error::io("setting control timeout", e))?;
        self.stream.set_read_timeout(Some(left)).map_err(|e| Error::io("setting control timeout", e))?;
        write_frame(&mut self.stream, &request(body))?;
        let peer = self.peer;
        let frame = read_frame(&mut self.stream, MAX_CONTROL_MESSAGE_BYTES).map_err(|e| match e {
            Error::Io { source, .. }
                if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) =>
            {
                Error::Timeout { waited: left }
            }
            other => other,
        })?;
        let frame = frame.ok_or_else(|| {
            Error::malformed("control response", format!("{peer} closed the connection without answering"))
        })?;
        decode_response(&frame)
    }

    /// The handshake: the peer's segment descriptor, checked. `token` is the
    /// pre-shared token, if the cluster uses one.
    pub fn handshake(&mut self, initiator: &str, token: Option<&[u8]>, deadline: Instant) -> Result<SegmentDescriptor> {
        let request = HandshakeRequest { initiator: initiator.to_string(), token: token.unwrap_or_default().to_vec() };
        match self.call(request::Body::Handshake(request), deadline)? {
            response::Body::Handshake(reply) => {
                let segment = reply.segment.ok_or_else(|| Error::malformed("handshake", "no segment descriptor"))?;
                SegmentDescriptor::from_proto(segment)
            }
            other => Err(Error::malformed("handshake", format!("unexpected answer {other:?}"))),
        }
    }

    /// Sends a notification to the peer.
    pub fn notify(&mut self, from: &str, message: &[u8], deadline: Instant) -> Result<()> {
        let notification = Notification { from: from.to_string(), message: message.to_vec() };
        match self.call(request::Body::Notify(notification), deadline)? {
            response::Body::Notify(_) => Ok(()),
            other => Err(Error::malformed("notify", format!("unexpected answer {other:?}"))),
        }
    }

    /// The peer's registered KV-cache layout, checked.
    pub fn memory_info(&mut self, deadline: Instant) -> Result<crate::kv::KvLayout> {
        match self.call(request::Body::MemoryInfo(crate::proto::MemoryInfoRequest {}), deadline)? {
            response::Body::MemoryInfo(reply) => {
                let layout = reply.layout.ok_or_else(|| Error::malformed("memory info", "no layout"))?;
                crate::kv::KvLayout::from_proto(layout)
            }
            other => Err(Error::malformed("memory info", format!("unexpected answer {other:?}"))),
        }
    }

    /// Exchanges RDMA QP endpoints: ours (lane-major over `nics` NICs) for
    /// the peer's, each checked.
    pub fn rdma_connect(
        &mut self,
        initiator: &str,
        nics: usize,
        ours: &[crate::transport::rdma::verbs::QpEndpoint],
        deadline: Instant,
    ) -> Result<Vec<crate::transport::rdma::verbs::QpEndpoint>> {
        let request = crate::proto::RdmaConnectRequest {
            initiator: initiator.to_string(),
            nics: nics as u32,
            endpoints: ours.iter().map(endpoint_to_proto).collect(),
        };
        match self.call(request::Body::RdmaConnect(request), deadline)? {
            response::Body::RdmaConnect(reply) => reply.endpoints.iter().map(endpoint_from_proto).collect(),
            other => Err(Error::malformed("rdma connect", format!("unexpected answer {other:?}"))),
        }
    }

    /// Checksum of a range of one of the peer's regions.
    pub fn checksum(&mut self, region: u32, offset: u64, len: u64, deadline: Instant) -> Result<u64> {
        match self.call(request::Body::Checksum(ChecksumRequest { region, offset, len }), deadline)? {
            response::Body::Checksum(reply) => Ok(reply.checksum),
            other => Err(Error::malformed("checksum", format!("unexpected answer {other:?}"))),
        }
    }
}

/// A QP endpoint's wire form.
pub fn endpoint_to_proto(endpoint: &crate::transport::rdma::verbs::QpEndpoint) -> crate::proto::QpEndpointInfo {
    crate::proto::QpEndpointInfo {
        qpn: endpoint.qpn,
        psn: endpoint.psn,
        gid: endpoint.gid.to_vec(),
        lid: u32::from(endpoint.lid),
        mtu: endpoint.mtu,
    }
}

/// Checks and converts a QP endpoint from a peer.
pub fn endpoint_from_proto(info: &crate::proto::QpEndpointInfo) -> Result<crate::transport::rdma::verbs::QpEndpoint> {
    let gid: [u8; 16] = info
        .gid
        .as_slice()
        .try_into()
        .map_err(|_| Error::malformed("qp endpoint", format!("a gid of {} bytes, not 16", info.gid.len())))?;
    let lid = u16::try_from(info.lid).map_err(|_| Error::malformed("qp endpoint", format!("lid {}", info.lid)))?;
    if info.qpn > 0x00ff_ffff || info.psn > 0x00ff_ffff || !(256..=4096).contains(&info.mtu) {
        return Err(Error::malformed(
            "qp endpoint",
            format!("qpn {:#x}, psn {:#x} or mtu {} out of range", info.qpn, info.psn, info.mtu),
        ));
    }
    Ok(crate::transport::rdma::verbs::QpEndpoint { qpn: info.qpn, psn: info.psn, gid, lid, mtu: info.mtu })
}
