//! The control-plane client: one request, one response, within a deadline.

use super::frame::{
    check_preface, decode_response, preface, read_frame, request, write_sealed, MAX_CONTROL_MESSAGE_BYTES,
    PREFACE_BYTES, PREFACE_MAGIC,
};
use crate::auth::{random_bytes, Initiator, Nonce, Seen, Session, Token, NONCE_BYTES};
use crate::error::{Error, Result};
use crate::net::DeadlineIo;
use crate::proto::{request, response, ChecksumRequest, HandshakeRequest, Notification};
use crate::seal::{check_descriptor_seal, ControlSeal, End};
use crate::segment::SegmentDescriptor;
use prost::Message as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Default deadline of one control RPC (connect, send, answer).
pub const DEFAULT_CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to a peer's control server.
#[derive(Debug)]
pub struct ControlClient {
    stream: TcpStream,
    peer: SocketAddr,
    /// Whether the peer's preface has been read and checked.
    greeted: bool,
    /// Set once a tokened handshake completed: every later message each
    /// way carries the session's MAC.
    seal: Option<ControlSeal>,
}

/// What a completed handshake gives: the peer's descriptor, and the
/// session data connections prove when the peer requires a token.
#[derive(Debug, Clone)]
pub struct Handshake {
    /// The peer's checked descriptor.
    pub descriptor: SegmentDescriptor,
    /// Set when the handshake was tokened.
    pub session: Option<Session>,
}

impl ControlClient {
    /// Connects to `addr` (`host:port`) before `deadline`, and sends the
    /// preface.
    pub fn connect(addr: &str, deadline: Instant) -> Result<Self> {
        let candidates: Vec<SocketAddr> =
            addr.to_socket_addrs().map_err(|e| Error::io(format!("resolving control address {addr}"), e))?.collect();
        let mut last_error = None;
        for peer in candidates {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout { what: CONNECT, waited: Duration::ZERO });
            }
            match TcpStream::connect_timeout(&peer, left) {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    DeadlineIo::new(&stream, deadline)
                        .write_all(&preface())
                        .map_err(|e| timeout_or(e, left, CONNECT, format!("greeting control server {peer}")))?;
                    return Ok(Self { stream, peer, greeted: false, seal: None });
                }
                // A peer whose SYN queue is full (or a host that drops
                // the SYN) ends at the deadline: a typed `Timeout`.
                Err(e) => {
                    last_error = Some(timeout_or(e, left, CONNECT, format!("connecting to control server {peer}")))
                }
            }
        }
        Err(last_error.unwrap_or_else(|| Error::invalid("control address", format!("{addr} resolves to no address"))))
    }

    /// Sends one request and reads its response before `deadline`: the
    /// whole exchange, however slowly the peer's bytes come.
    pub fn call(&mut self, body: request::Body, deadline: Instant) -> Result<response::Body> {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout { what: ANSWER, waited: Duration::ZERO });
        }
        let peer = self.peer;
        write_sealed(&mut DeadlineIo::new(&self.stream, deadline), &request(body), self.seal.as_mut())
            .map_err(|e| timeout_in(e, left))?;
        if !self.greeted {
            self.read_preface(deadline, left)?;
            self.greeted = true;
        }
        let mut io = DeadlineIo::new(&self.stream, deadline);
        let frame = read_frame(&mut io, MAX_CONTROL_MESSAGE_BYTES).map_err(|e| timeout_in(e, left))?;
        let frame = frame.ok_or_else(|| {
            Error::malformed("control response", format!("{peer} closed the connection without answering"))
        })?;
        match &mut self.seal {
            Some(seal) => decode_response(seal.open(&frame)?),
            None => decode_response(&frame),
        }
    }

    /// Reads and checks the peer's preface. It peeks first, so that what a
    /// stranger sent (an HTTP error page, an SSH banner) can be shown in
    /// the error without consuming a kvring peer's response.
    fn read_preface(&mut self, deadline: Instant, waited: Duration) -> Result<()> {
        let mut seen = [0u8; 64];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout { what: PREFACE, waited });
            }
            self.stream.set_read_timeout(Some(left)).map_err(|e| Error::io("setting a read timeout", e))?;
            let n = match self.stream.peek(&mut seen) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if crate::net::is_timeout(&e) => return Err(Error::Timeout { what: PREFACE, waited }),
                Err(e) => return Err(Error::io(format!("reading the preface of {}", self.peer), e)),
            };
            let agrees = seen[..n.min(4)] == PREFACE_MAGIC[..n.min(4)];
            if n == 0 || n >= PREFACE_BYTES || !agrees {
                check_preface(&seen[..n], &self.peer.to_string())?;
                let mut preface = [0u8; PREFACE_BYTES];
                return DeadlineIo::new(&self.stream, deadline)
                    .read_exact(&mut preface)
                    .map_err(|e| timeout_or(e, waited, PREFACE, format!("reading the preface of {}", self.peer)));
            }
            // A preface cut in two: the rest follows at once.
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// The handshake: the peer's checked descriptor and, when the peer
    /// requires a token, the session. With `token`, the peer must prove it
    /// holds the same token before this side proves anything; the token
    /// itself is never sent.
    pub fn handshake(&mut self, initiator: &Initiator, token: Option<&Token>, deadline: Instant) -> Result<Handshake> {
        let cn: Nonce = random_bytes();
        let first = HandshakeRequest {
            initiator: initiator.name.clone(),
            initiator_epoch: initiator.epoch,
            client_nonce: cn.to_vec(),
            initiator_addr: initiator.addr.clone(),
            ..Default::default()
        };
        let reply = self.handshake_step(first, deadline)?;
        let peer = self.peer;
        let Some(challenge) = reply.challenge else {
            if token.is_some() {
                return Err(Error::Unauthorized {
                    reason: format!(
                        "{peer} runs without a token while this engine has one; refusing it \
                         (both ends of a tokened cluster must prove the token)"
                    ),
                });
            }
            let segment = reply.segment.ok_or_else(|| Error::malformed("handshake", "no segment descriptor"))?;
            let descriptor =
                self.answered_by(SegmentDescriptor::from_proto(*segment)?, reply.answering_fd, deadline)?;
            return Ok(Handshake { descriptor, session: None });
        };
        let Some(token) = token else {
            return Err(Error::Unauthorized {
                reason: format!("{peer} requires a token; configure the cluster's token on this engine too"),
            });
        };
        let sn: Nonce = challenge.server_nonce.as_slice().try_into().map_err(|_| {
            Error::malformed(
                "handshake",
                format!("a server nonce of {} bytes, not {NONCE_BYTES}", challenge.server_nonce.len()),
            )
        })?;
        if !token.check_server_proof(&cn, &sn, challenge.epoch, &challenge.proof) {
            return Err(Error::Unauthorized {
                reason: format!("{peer} does not prove the token; nothing was sent to it"),
            });
        }
        // What this side saw of the connection goes under its proof: a relay
        // is an address the target never answered on.
        let seen = Seen {
            dialed: peer.to_string(),
            local: self.stream.local_addr().map(|a| a.to_string()).unwrap_or_default(),
        };
        let proof = token.client_proof(&cn, &sn, challenge.epoch, initiator, &seen);
        let second = HandshakeRequest {
            initiator: initiator.name.clone(),
            initiator_epoch: initiator.epoch,
            client_nonce: cn.to_vec(),
            server_nonce: sn.to_vec(),
            proof: proof.to_vec(),
            initiator_addr: initiator.addr.clone(),
            dialed: seen.dialed,
            local: seen.local,
        };
        let reply = self.handshake_step(second, deadline)?;
        let session = token.session(cn, sn, challenge.epoch);
        let descriptor = open_step_two(&session, &proof, &reply, challenge.epoch, &peer.to_string())?;
        let descriptor = self.answered_by(descriptor, reply.answering_fd, deadline)?;
        self.seal = Some(ControlSeal::new(&session, End::Initiator));
        Ok(Handshake { session: Some(session), descriptor })
    }

    /// A same-host descriptor is trusted for shm and cma only when its pid
    /// holds the other end of this connection (`transport::cma::owner`);
    /// `hint` is the descriptor number the peer says it holds it at. The
    /// check is bounded by the handshake's `deadline` (`Timeout` past it).
    fn answered_by(
        &self,
        mut descriptor: SegmentDescriptor,
        hint: Option<u32>,
        deadline: Instant,
    ) -> Result<SegmentDescriptor> {
        let (ours, theirs) = (self.stream.local_addr().ok(), self.stream.peer_addr().ok());
        crate::transport::cma::owner::bind_to_answering_process(&mut descriptor, ours, theirs, hint, deadline)?;
        Ok(descriptor)
    }

    fn handshake_step(
        &mut self,
        request: HandshakeRequest,
        deadline: Instant,
    ) -> Result<crate::proto::HandshakeResponse> {
        match self.call(request::Body::Handshake(request), deadline)? {
            response::Body::Handshake(reply) => Ok(reply),
            other => Err(Error::malformed("handshake", format!("unexpected answer {other:?}"))),
        }
    }

    /// The peer's name and epoch: is it alive, and which start is it?
    /// Needs no handshake.
    pub fn probe(&mut self, deadline: Instant) -> Result<(String, u64)> {
        match self.call(request::Body::Probe(crate::proto::ProbeRequest {}), deadline)? {
            response::Body::Probe(reply) => Ok((reply.name, reply.epoch)),
            other => Err(Error::malformed("probe", format!("unexpected answer {other:?}"))),
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
    /// the peer's, each checked; with the peer's fence tables (`None`: an
    /// older peer that pushes no fences). `push_key` goes to the peer alone:
    /// the fences it pushes to us carry it.
    pub fn rdma_connect(
        &mut self,
        nics: usize,
        ours: &[crate::transport::rdma::verbs::QpEndpoint],
        push_key: &[u8],
        deadline: Instant,
    ) -> Result<(Vec<crate::transport::rdma::verbs::QpEndpoint>, Option<Vec<crate::proto::RdmaFenceTable>>)> {
        let request = crate::proto::RdmaConnectRequest {
            initiator: String::new(),
            nics: nics as u32,
            endpoints: ours.iter().map(crate::transport::rdma::verbs::QpEndpoint::to_proto).collect(),
            checks_fences: true,
            push_key: push_key.to_vec(),
        };
        match self.call(request::Body::RdmaConnect(request), deadline)? {
            response::Body::RdmaConnect(reply) => {
                let endpoints = reply
                    .endpoints
                    .iter()
                    .map(crate::transport::rdma::verbs::QpEndpoint::from_proto)
                    .collect::<Result<_>>()?;
                Ok((endpoints, reply.pushes_fences.then_some(reply.fences)))
            }
            other => Err(Error::malformed("rdma connect", format!("unexpected answer {other:?}"))),
        }
    }

    /// Pushes a fence of ours to an initiator that holds QPs on us: `Ok`
    /// once its writes before the fence are done.
    pub fn rdma_fence(&mut self, request: crate::proto::RdmaFenceRequest, deadline: Instant) -> Result<()> {
        match self.call(request::Body::RdmaFence(request), deadline)? {
            response::Body::RdmaFence(_) => Ok(()),
            other => Err(Error::malformed("rdma fence", format!("unexpected answer {other:?}"))),
        }
    }

    /// The CRC32C of each of `ranges` (region, offset, length) of the peer's
    /// memory, in order. A peer older than the request answers it as a
    /// message with no body: that is `Unsupported`, naming the peer.
    pub fn crc32c(&mut self, ranges: &[(u64, u64, u64)], deadline: Instant) -> Result<Vec<u32>> {
        let ranges =
            ranges.iter().map(|&(region, offset, len)| crate::proto::Crc32cRange { region, offset, len }).collect();
        let reply = self.call(request::Body::Crc32c(crate::proto::Crc32cRequest { ranges }), deadline);
        match reply {
            Ok(response::Body::Crc32c(reply)) => Ok(reply.crcs),
            Ok(other) => Err(Error::malformed("crc32c", format!("unexpected answer {other:?}"))),
            Err(error) => Err(older_peer(error, &self.peer.to_string())),
        }
    }

    /// Checksum of a range of one of the peer's regions.
    pub fn checksum(&mut self, region: u64, offset: u64, len: u64, deadline: Instant) -> Result<u64> {
        match self.call(request::Body::Checksum(ChecksumRequest { region, offset, len }), deadline)? {
            response::Body::Checksum(reply) => Ok(reply.checksum),
            other => Err(Error::malformed("checksum", format!("unexpected answer {other:?}"))),
        }
    }
}

/// A tokened handshake's second answer, opened: the descriptor counts only
/// as the bytes the session sealed with this handshake's transcript (the
/// initiator's `proof`), so nothing on the path can rewrite it; its epoch
/// must be the challenge's. Bytes from outside: fuzzed.
pub(crate) fn open_step_two(
    session: &Session,
    proof: &[u8],
    reply: &crate::proto::HandshakeResponse,
    epoch: u64,
    peer: &str,
) -> Result<SegmentDescriptor> {
    if reply.segment.is_some() || !check_descriptor_seal(session, proof, &reply.sealed_segment, &reply.seal) {
        return Err(Error::Unauthorized {
            reason: format!(
                "{peer}'s descriptor is not sealed by this handshake's session: it was rewritten on the way (a \
                 relay?) or the peer speaks another version; refusing it"
            ),
        });
    }
    let segment = crate::proto::SegmentDescriptor::decode(reply.sealed_segment.as_slice())
        .map_err(|e| Error::malformed("handshake", format!("sealed descriptor: {e}")))?;
    let descriptor = SegmentDescriptor::from_proto(segment)?;
    if descriptor.epoch != epoch {
        return Err(Error::malformed(
            "handshake",
            format!("the challenge was for epoch {epoch:#x} but the descriptor says {:#x}", descriptor.epoch),
        ));
    }
    Ok(descriptor)
}

/// A peer older than the CRC32C request decodes it as a request with no
/// body (an unknown field) and says so: that is `Unsupported`, naming it.
fn older_peer(error: Error, peer: &str) -> Error {
    match error {
        Error::Remote { code: crate::proto::ErrorCode::MalformedMessage, message } if message.contains("no body") => {
            Error::Unsupported {
                what: format!(
                    "checksums over rdma to {peer}: it runs an older kvring that does not answer CRC32C requests \
                     ({message})"
                ),
            }
        }
        other => other,
    }
}

/// The waits of a control exchange, as `Error::Timeout` names them.
const CONNECT: &str = "the peer's control port to accept";
const PREFACE: &str = "the peer's control preface";
const ANSWER: &str = "the peer's control answer";

/// A deadline-bounded I/O error as kvring reports it: `Timeout` when the
/// deadline passed, else the error in its context.
fn timeout_or(error: std::io::Error, waited: Duration, what: &'static str, context: String) -> Error {
    if crate::net::is_timeout(&error) {
        Error::Timeout { what, waited }
    } else {
        Error::io(context, error)
    }
}

/// A framing error whose cause was the deadline becomes `Timeout`.
fn timeout_in(error: Error, waited: Duration) -> Error {
    match error {
        Error::Io { source, .. } if crate::net::is_timeout(&source) => Error::Timeout { what: ANSWER, waited },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::frame::{decode_request, error_response};

    /// What an older target answers a CRC32C request with: its decoder
    /// knows no field 9 of `Request`, so it sees a request with no body.
    /// The same bytes with the body under a field no version knows (99)
    /// get that answer from this decoder; the initiator names the peer.
    #[test]
    fn an_older_target_that_cannot_decode_the_request_is_named_unsupported() {
        let version = super::super::frame::CONTROL_VERSION as u8;
        // version = 4; field 99, length-delimited (tag 99 << 3 | 2 = 0x31a), empty.
        let unknown = [0x08, version, 0x9a, 0x06, 0x00];
        let refused = decode_request(&unknown).unwrap_err();
        let wire = error_response(&refused).encode_to_vec();
        let answered = super::super::frame::decode_response(&wire).unwrap_err();
        let error = older_peer(answered, "10.0.0.2:7000");
        assert!(
            matches!(&error, Error::Unsupported { what } if what.contains("older kvring") && what.contains("10.0.0.2:7000")),
            "{error}"
        );
        let other =
            older_peer(Error::Remote { code: crate::proto::ErrorCode::AccessDenied, message: "no".into() }, "p");
        assert!(matches!(other, Error::Remote { .. }), "other errors pass through: {other}");
    }
}
