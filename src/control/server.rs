//! The control-plane server: handshakes (the engine's segment descriptor,
//! behind the token's mutual proof when the engine has one), checksums
//! (the bench's, and rdma's CRC32Cs),
//! notifications, memory info and RDMA connects.
//!
//! It runs on its own threads, never on a lane. It binds exactly the address
//! it is given and books every connection with the listener's admission
//! policy: a connection must send the preface and prove itself (complete
//! the tokened handshake, or with no token send one valid request) within
//! the admission deadline; each message must arrive whole within
//! [`MESSAGE_TIMEOUT`] of its first byte; a connection that completes no
//! request for [`DEFAULT_CONTROL_IDLE`] is closed, whatever it sends. Between
//! requests an admitted connection is idle, and is closed for a newcomer
//! while its source holds more than its fair share of a full table
//! (`net::admission`); never in the middle of a request. Every
//! bad message gets an error reply naming the problem.

use super::frame::{
    self, decode_request, error_response, preface, read_frame, write_frame, MAX_CONTROL_MESSAGE_BYTES, PREFACE_BYTES,
};
use crate::auth::{Authenticator, Initiator, Nonce, Seen, NONCE_BYTES};
use crate::error::{Error, Result};
use crate::net::{Acceptor, AdmissionLimits, Admitted, DeadlineIo};
use crate::proto::{
    request, response, ChecksumRequest, ChecksumResponse, HandshakeChallenge, HandshakeRequest, HandshakeResponse,
    NotifyResponse,
};
use crate::seal::{descriptor_seal, ControlSeal, End};
use crate::segment::SegmentDescriptor;
use prost::Message as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most control connections served at once.
pub const MAX_CONTROL_CONNECTIONS: usize = 64;
/// Most control connections from one address.
pub const MAX_CONTROL_CONNECTIONS_PER_SOURCE: usize = 32;
/// A control connection that completes no request for this long is closed.
pub const DEFAULT_CONTROL_IDLE: Duration = Duration::from_secs(30);
/// A message must arrive whole within this of its first byte.
pub const MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a connection thread looks at the stop flag while idle.
const STOP_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// What the server asks of the engine.
pub(crate) trait ControlHandler: Send + Sync + 'static {
    /// The token check, when the engine has a token.
    fn authenticator(&self) -> Option<&Authenticator>;
    /// The engine's epoch (a challenge's proof covers it).
    fn epoch(&self) -> u64;
    /// The engine's current segment descriptor.
    fn describe(&self) -> SegmentDescriptor;
    /// The engine's name.
    fn name(&self) -> &str;
    /// Checksum of a remote-readable range of one of the engine's regions.
    fn checksum(&self, request: &ChecksumRequest, source: Option<std::net::IpAddr>) -> Result<u64>;
    /// CRC32C of each range of the engine's remote-readable host regions
    /// (an rdma initiator verifying a checksummed chunk).
    fn crc32c(&self, request: &crate::proto::Crc32cRequest, source: Option<std::net::IpAddr>) -> Result<Vec<u32>>;
    /// Queues a notification from `sender` (the proven or claimed name).
    fn notify(&self, sender: &str, message: Vec<u8>) -> Result<()>;
    /// The registered KV-cache layout.
    fn memory_info(&self) -> Result<crate::proto::KvLayoutInfo>;
    /// Connects QPs of ours to `initiator`'s (RDMA): ours, in its order,
    /// with the snapshot of our fence tables.
    fn rdma_connect(
        &self,
        initiator: &Initiator,
        request: &crate::proto::RdmaConnectRequest,
    ) -> Result<crate::proto::RdmaConnectResponse>;
    /// Enters a fence that `target` (the handshake's identity: a target of
    /// one of our rdma links) pushed, once our lanes' writes before it are
    /// done.
    fn rdma_fence(&self, target: &Initiator, request: &crate::proto::RdmaFenceRequest) -> Result<()>;
}

/// A running control server.
#[derive(Debug)]
pub struct ControlServer {
    acceptor: Acceptor,
}

impl ControlServer {
    /// Binds `listen` (only that address) and serves until stopped.
    pub(crate) fn start(
        listen: SocketAddr,
        handler: Arc<dyn ControlHandler>,
        admission: AdmissionLimits,
    ) -> Result<Self> {
        let limits = AdmissionLimits {
            max_per_source: admission.max_per_source.min(MAX_CONTROL_CONNECTIONS_PER_SOURCE),
            ..admission
        }
        .capped(MAX_CONTROL_CONNECTIONS);
        let refuse = |stream: &mut TcpStream, bound: &'static str| {
            let error = Error::Busy { queue: bound, capacity: MAX_CONTROL_CONNECTIONS };
            let mut io = DeadlineIo::new(stream, Instant::now() + Duration::from_millis(100));
            let _ = io.write_all(&preface());
            let _ = write_frame(&mut io, &error_response(&error));
        };
        let serve = move |stream: TcpStream, conn: &Admitted<'_>| serve_connection(stream, &*handler, conn);
        Ok(Self { acceptor: Acceptor::start(listen, "control", limits, refuse, serve)? })
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

/// Where one connection's authentication stands.
#[derive(Debug, Default)]
pub(crate) struct ConnectionAuth {
    /// The challenge this connection was sent: (client nonce, server nonce).
    challenge: Option<(Nonce, Nonce)>,
    /// Who the peer is: proven (with a token) or claimed (without).
    identity: Option<Initiator>,
    /// Proven itself: completed the tokened handshake, or with no token,
    /// made one valid request.
    admitted: bool,
    /// The address this connection was accepted on (what an initiator
    /// must have dialed, unless it dialed the advertised one).
    local: Option<SocketAddr>,
    /// Set once a tokened handshake completed: every later message each
    /// way carries the session's MAC.
    seal: Option<ControlSeal>,
    /// The seal of a handshake just completed, in force once its answer
    /// (sealed under the one before, if any) is sent.
    pending: Option<ControlSeal>,
    /// This connection's descriptor number here: the handshake's answer
    /// names it, so a same-host initiator's owner check reads one entry of
    /// our `/proc/<pid>/fd` instead of listing them all
    /// (`transport::cma::owner`).
    fd: Option<u32>,
    /// The address the connection came from (bounds what one source runs).
    peer: Option<std::net::IpAddr>,
}

impl ConnectionAuth {
    /// A connection accepted on `local` from `peer`.
    pub(crate) fn accepted_on(local: Option<SocketAddr>, fd: Option<u32>, peer: Option<std::net::IpAddr>) -> Self {
        Self { local, fd, peer, ..Self::default() }
    }

    /// Opens a request: checks and strips its session MAC once the
    /// connection is sealed.
    pub(crate) fn open<'a>(&mut self, message: &'a [u8]) -> Result<&'a [u8]> {
        match &mut self.seal {
            Some(seal) => seal.open(message),
            None => Ok(message),
        }
    }

    /// The seal the next answer goes under; a handshake's new seal is in
    /// force after it.
    fn answer_seal(&mut self) -> Option<&mut ControlSeal> {
        self.seal.as_mut()
    }

    fn answered(&mut self) {
        if let Some(seal) = self.pending.take() {
            self.seal = Some(seal);
        }
    }

    /// True once the peer has an identity (proven, with a token).
    #[cfg(feature = "testing")]
    pub(crate) fn is_proven(&self) -> bool {
        self.identity.is_some()
    }
}

/// Largest message a tokened engine reads before the handshake proved the
/// peer: a handshake (names, nonces, an address, a proof) is well under.
pub const MAX_UNPROVEN_MESSAGE_BYTES: u32 = 16 << 10;
/// Largest opening message of a connection to an engine without a token:
/// room for its largest request that may open one, a notification.
pub const MAX_OPENING_MESSAGE_BYTES: u32 = crate::notify::MAX_NOTIFY_FRAME_BYTES as u32 + (16 << 10);

fn serve_connection(stream: TcpStream, handler: &dyn ControlHandler, conn: &Admitted<'_>) {
    let _ = stream.set_nodelay(true);
    let mut greeting = [0u8; PREFACE_BYTES];
    let greeted = DeadlineIo::new(&stream, conn.admission_deadline()).read_exact(&mut greeting);
    // Always answer with ours, so a kvring client of another version can
    // say which versions differ.
    let _ = DeadlineIo::new(&stream, Instant::now() + MESSAGE_TIMEOUT).write_all(&preface());
    if greeted.is_err() || frame::check_preface(&greeting, "a client").is_err() {
        return;
    }
    let fd = u32::try_from(std::os::fd::AsRawFd::as_raw_fd(&stream)).ok();
    let mut auth = ConnectionAuth::accepted_on(stream.local_addr().ok(), fd, stream.peer_addr().ok().map(|a| a.ip()));
    let mut last_served = Instant::now();
    loop {
        // Wait for the next message's first byte, honouring the stop flag,
        // the admission deadline and the idle limit.
        let limit = if auth.admitted { last_served + DEFAULT_CONTROL_IDLE } else { conn.admission_deadline() };
        if conn.stopping() || Instant::now() >= limit {
            return;
        }
        let _ = stream.set_read_timeout(Some(STOP_CHECK_INTERVAL));
        let mut first = [0u8; 1];
        match stream.peek(&mut first) {
            Ok(0) => return,
            // Evicted for a newcomer while idle: the request never began.
            Ok(_) if !conn.busy() => return,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(_) => return,
        }
        let message_deadline = (Instant::now() + MESSAGE_TIMEOUT).min(limit.max(Instant::now() + STOP_CHECK_INTERVAL));
        let mut io = DeadlineIo::new(&stream, message_deadline);
        // Before a connection is proven its frames are small: decoding
        // multiplies bytes (an empty repeated element is 2 bytes on the wire
        // and tens in memory), and pending connections prove nothing. On a
        // tokened engine only the handshake's proof counts: a `Probe` admits
        // a connection but proves nothing (`review10_control`).
        let max = match (handler.authenticator().is_some(), auth.identity.is_some(), auth.admitted) {
            (true, true, _) | (false, _, true) => MAX_CONTROL_MESSAGE_BYTES,
            (true, false, _) => MAX_UNPROVEN_MESSAGE_BYTES,
            (false, _, false) => MAX_OPENING_MESSAGE_BYTES,
        };
        let (reply, keep_open) = match read_frame(&mut io, max) {
            Ok(None) => return,
            Ok(Some(body)) => {
                let was_admitted = auth.admitted;
                let opened = auth.open(&body).map(<[u8]>::to_vec);
                let sealed = auth.seal.is_some();
                match opened.and_then(|body| decode_request(&body)).and_then(|body| handle(handler, body, &mut auth)) {
                    Ok(reply) if auth.admitted && !was_admitted => match conn.admit() {
                        Ok(()) => (frame::response(reply), true),
                        Err(bound) => {
                            (error_response(&Error::Busy { queue: bound, capacity: MAX_CONTROL_CONNECTIONS }), false)
                        }
                    },
                    Ok(reply) => (frame::response(reply), true),
                    // A failed proof (or session MAC) ends the connection: a
                    // guesser must pay for a new one (and its admission) per
                    // guess.
                    Err(error @ Error::Unauthorized { .. }) => {
                        if sealed {
                            // The peer's numbering is lost: it gets no answer
                            // it could check.
                            return;
                        }
                        (error_response(&error), false)
                    }
                    // The frame boundary is intact, so the connection
                    // survives any other bad message.
                    Err(error) => (error_response(&error), true),
                }
            }
            // Lost framing (oversized, truncated or too slow): answer, close.
            Err(error) => (error_response(&error), false),
        };
        last_served = Instant::now();
        let mut io = DeadlineIo::new(&stream, Instant::now() + MESSAGE_TIMEOUT);
        if frame::write_sealed(&mut io, &reply, auth.answer_seal()).is_err() || !keep_open {
            return;
        }
        auth.answered();
        conn.idle();
    }
}

/// Answers one request, moving the connection's authentication along.
/// Bytes from outside reach it whole (fuzzed with its state).
pub(crate) fn handle(
    handler: &dyn ControlHandler,
    body: request::Body,
    auth: &mut ConnectionAuth,
) -> Result<response::Body> {
    let tokened = handler.authenticator().is_some();
    match body {
        request::Body::Handshake(request) => handshake(handler, &request, auth),
        request::Body::Probe(_) => {
            // A probe proves nothing: on a tokened engine only the
            // handshake admits (a probing peer's connection stays pending,
            // closed at the admission deadline; kvring probes on a fresh
            // connection each time).
            if !tokened {
                auth.admitted = true;
            }
            Ok(response::Body::Probe(crate::proto::ProbeResponse {
                name: handler.name().to_string(),
                epoch: handler.epoch(),
            }))
        }
        _ if tokened && auth.identity.is_none() => {
            Err(Error::Unauthorized { reason: "this engine requires a token: complete the handshake first".into() })
        }
        request::Body::Checksum(request) => {
            let checksum = handler.checksum(&request, auth.peer)?;
            auth.admitted = true;
            Ok(response::Body::Checksum(ChecksumResponse { checksum }))
        }
        request::Body::Crc32c(request) => {
            let crcs = handler.crc32c(&request, auth.peer)?;
            auth.admitted = true;
            Ok(response::Body::Crc32c(crate::proto::Crc32cResponse { crcs }))
        }
        request::Body::Notify(notification) => {
            // A proven sender is counted under its proven name; without a
            // token, the name it claims is all there is.
            let sender = auth.identity.as_ref().map_or(notification.from.as_str(), |i| i.name.as_str());
            handler.notify(sender, notification.message)?;
            auth.admitted = true;
            Ok(response::Body::Notify(NotifyResponse {}))
        }
        request::Body::MemoryInfo(_) => {
            let layout = handler.memory_info()?;
            auth.admitted = true;
            Ok(response::Body::MemoryInfo(crate::proto::MemoryInfoResponse { layout: Some(layout) }))
        }
        request::Body::RdmaConnect(request) => {
            let initiator = auth.identity.as_ref().ok_or_else(|| {
                Error::invalid("rdma connect", "handshake first: the QPs belong to the handshake's initiator")
            })?;
            Ok(response::Body::RdmaConnect(handler.rdma_connect(initiator, &request)?))
        }
        request::Body::RdmaFence(request) => {
            let target = auth.identity.as_ref().ok_or_else(|| {
                Error::invalid("rdma fence", "handshake first: a fence is its target's, named by the handshake")
            })?;
            handler.rdma_fence(target, &request)?;
            Ok(response::Body::RdmaFence(crate::proto::RdmaFenceResponse {}))
        }
    }
}

fn nonce(bytes: &[u8], what: &'static str) -> Result<Nonce> {
    bytes
        .try_into()
        .map_err(|_| Error::malformed("handshake", format!("a {what} of {} bytes, not {NONCE_BYTES}", bytes.len())))
}

fn handshake(
    handler: &dyn ControlHandler,
    request: &HandshakeRequest,
    auth: &mut ConnectionAuth,
) -> Result<response::Body> {
    if request.initiator.is_empty() || request.initiator.len() > crate::segment::descriptor::MAX_SEGMENT_NAME_BYTES {
        return Err(Error::malformed("handshake", "the initiator name must be 1..=256 bytes"));
    }
    if request.initiator_addr.len() > 256 {
        return Err(Error::malformed("handshake", "the initiator address is over 256 bytes"));
    }
    let initiator = Initiator {
        name: request.initiator.clone(),
        epoch: request.initiator_epoch,
        addr: request.initiator_addr.clone(),
    };
    let Some(authenticator) = handler.authenticator() else {
        auth.identity = Some(initiator);
        auth.admitted = true;
        let segment = Some(Box::new(handler.describe().to_proto()));
        return Ok(response::Body::Handshake(HandshakeResponse {
            segment,
            answering_fd: auth.fd,
            ..Default::default()
        }));
    };
    let cn = nonce(&request.client_nonce, "client nonce")?;
    if request.server_nonce.is_empty() {
        // First step: challenge, proving our token to the initiator first.
        let (sn, proof) = authenticator.challenge(&cn);
        auth.challenge = Some((cn, sn));
        return Ok(response::Body::Handshake(HandshakeResponse {
            segment: None,
            challenge: Some(HandshakeChallenge {
                server_nonce: sn.to_vec(),
                epoch: handler.epoch(),
                proof: proof.to_vec(),
            }),
            ..Default::default()
        }));
    }
    // Second step: the proof must answer this connection's own challenge.
    let sn = nonce(&request.server_nonce, "server nonce")?;
    let challenged = auth.challenge.take();
    let seen = Seen { dialed: request.dialed.clone(), local: request.local.clone() };
    if challenged != Some((cn, sn)) || !authenticator.check_client(&cn, &sn, &initiator, &seen, &request.proof) {
        return Err(Error::Unauthorized {
            reason: format!("{:?} did not prove the token in its handshake", request.initiator),
        });
    }
    let described = handler.describe();
    check_dialed(&seen.dialed, auth.local, &described.control_addr)?;
    let session = authenticator
        .session_for(&cn, &sn)
        .ok_or_else(|| Error::Unauthorized { reason: "a handshake this start did not issue".into() })?;
    // The descriptor goes as bytes, sealed with the transcript: the
    // initiator takes it only if nothing on the path changed a byte.
    let sealed_segment = described.to_proto().encode_to_vec();
    let seal = descriptor_seal(&session, &request.proof, &sealed_segment).to_vec();
    // Its data connections (proving this session) land arrivals as it.
    authenticator.remember_sender(&cn, &sn, &initiator.name);
    auth.identity = Some(initiator);
    auth.admitted = true;
    auth.pending = Some(ControlSeal::new(&session, End::Target));
    Ok(response::Body::Handshake(HandshakeResponse {
        sealed_segment,
        seal,
        answering_fd: auth.fd,
        ..Default::default()
    }))
}

/// A proven initiator must have dialed this engine: the address its
/// connection was accepted on, or the control address it advertises (a
/// NAT'd or proxied deployment advertises the address its peers dial).
/// Anything else is a relay between them.
fn check_dialed(dialed: &str, local: Option<SocketAddr>, advertised: &str) -> Result<()> {
    // A dual-stack listener sees an IPv4 peer's connection on an
    // IPv4-mapped address: compare canonical forms.
    let canonical = |a: SocketAddr| (a.ip().to_canonical(), a.port());
    let dialed_addr = dialed.parse::<SocketAddr>().ok().map(canonical);
    let advertised_addr = advertised.parse::<SocketAddr>().ok().map(canonical);
    let matches = dialed_addr.is_some_and(|d| Some(d) == local.map(canonical) || Some(d) == advertised_addr);
    if matches {
        return Ok(());
    }
    let on = local.map_or_else(|| "an unknown address".to_string(), |a| a.to_string());
    Err(Error::Unauthorized {
        reason: format!(
            "the initiator dialed {dialed:?} but reached this engine on {on} (advertised {advertised:?}): a relay \
             sits between them; refusing the handshake"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::check_dialed;
    use crate::error::Error;

    #[test]
    fn only_the_address_accepted_on_or_advertised_passes_as_dialed() {
        let local = Some("127.0.0.1:7000".parse().unwrap());
        assert!(check_dialed("127.0.0.1:7000", local, "10.0.0.2:7000").is_ok());
        assert!(check_dialed("10.0.0.2:7000", local, "10.0.0.2:7000").is_ok(), "the advertised address");
        let mapped = Some("[::ffff:127.0.0.1]:7000".parse().unwrap());
        assert!(check_dialed("127.0.0.1:7000", mapped, "").is_ok(), "a dual-stack listener");
        for relayed in ["127.0.0.1:7001", "127.0.0.3:7000", "", "relay.example:7000"] {
            let error = check_dialed(relayed, local, "10.0.0.2:7000").unwrap_err();
            assert!(matches!(&error, Error::Unauthorized { reason } if reason.contains("relay")), "{error}");
        }
        assert!(check_dialed("127.0.0.1:7000", None, "").is_err());
    }
}
