//! The initiator side of the TCP transport: one non-blocking connection per
//! lane to the peer's data listener, made when the segment is opened (on the
//! caller's thread, never on a lane), then owned and driven by its lane.
//!
//! A chunk is queued on the lane's [`Connection`] and sent as far as the
//! socket takes it; the lane's loop polls the link for the rest and for the
//! replies, so any number of chunks are in flight and a silent peer costs
//! the lane nothing but its own batches, which fail after `io_timeout` or
//! at their deadline. WRITE chunks are frames back to back, the last one
//! flagged, acknowledged once; READ chunks are request headers whose
//! replies land straight in local memory. Blocks over
//! [`MAX_FRAME_PAYLOAD_BYTES`](super::frame::MAX_FRAME_PAYLOAD_BYTES) span
//! frames.

use super::conn::{Connection, Peer};
use super::hello::{ClientHello, ClientProof, ServerHello, FLAG_PROOF_REQUIRED, HELLO_MAGIC, SERVER_HELLO_BYTES};
#[cfg(test)]
use super::redial::QUIET_REDIAL_AFTER;
use super::redial::{quiet_redial_after, Parked, Redial};
use super::staged::Stager;
use crate::auth::{random_bytes, Nonce, Session};
use crate::error::{Error, Result};
use crate::net::DeadlineIo;
use crate::notify::MAX_NOTIFY_FRAME_BYTES;
use crate::ring::Opcode;
use crate::seal::{check_listener_proof, End, FrameSeal};
use crate::transport::{Block, ChunkEnd, LaneLink, Link, LinkState, Posted, TransportKind};
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zerocopy::IntoBytes;

/// Default time a connection may go without a byte moving while replies are
/// awaited before it is declared dead.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Blocks a lane hands the TCP link at once (one ack per chunk).
pub const TCP_CHUNK_BLOCKS: usize = 64;

/// One lane's connection to one peer, driven by that lane only.
pub(crate) struct TcpLink {
    peer: Peer,
    io_timeout: Duration,
    /// The connection, or why it is gone.
    connection: Result<Box<Connection>, String>,
    state: Arc<LinkState>,
    /// A second descriptor of the socket, registered with the lane's poller
    /// so a reply, or room in a full send buffer, wakes a parked lane; it
    /// lives as long as the link, so the
    /// registration never outlives it (a closed connection is shut down,
    /// which the peer sees at once).
    wake: Option<std::os::fd::OwnedFd>,
    /// Staging of GPU blocks, where this engine has a GPU provider.
    stager: Option<Stager>,
    /// Scratch: the connection's chunk ends, routed through the stager.
    ends: Vec<ChunkEnd>,
    /// The session the handshake proved, for a connection dialled again.
    session: Option<Session>,
    /// A connection being dialled again (`redial.rs`), and what waits for it.
    redial: Option<Redial>,
    /// When a chunk or notification was last queued on the connection.
    last_used: Instant,
    /// The wake descriptor names a new socket: the lane registers it again.
    rewoken: bool,
    /// Parked entries are being queued after a dial: straight onto the
    /// connection, never parked (or dialled for) again.
    unparking: bool,
}

impl std::fmt::Debug for TcpLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLink").field("peer", &self.peer.name).field("addr", &self.peer.addr).finish()
    }
}

impl TcpLink {
    /// Connects `lanes` connections to `data_addr` before `deadline`, each
    /// opened with the hello (and `session`'s proof when the target
    /// requires one), one per lane.
    pub fn connect(
        peer: &str,
        data_addr: &str,
        epoch: u64,
        session: Option<&Session>,
        stagers: Vec<Option<Stager>>,
        deadline: Instant,
        io_timeout: Duration,
    ) -> Result<Link> {
        let addr = data_addr
            .to_socket_addrs()
            .map_err(|e| Error::io(format!("resolving {peer}'s data address {data_addr}"), e))?
            .next()
            .ok_or_else(|| Error::invalid("data address", format!("{data_addr} resolves to nothing")))?;
        let state = LinkState::new(TransportKind::Tcp, true);
        let mut links: Vec<Box<dyn LaneLink>> = Vec::with_capacity(stagers.len());
        for stager in stagers {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout { what: "the data connections", waited: Duration::ZERO });
            }
            let (stream, seal) = open(addr, peer, epoch, session, deadline)?;
            let wake = stream.try_clone().ok().map(std::os::fd::OwnedFd::from);
            let connection = configured(stream, seal, stager.is_some())?;
            links.push(Box::new(TcpLink {
                peer: Peer { name: peer.to_string(), addr, epoch },
                io_timeout,
                connection: Ok(connection),
                state: state.clone(),
                wake,
                stager,
                ends: Vec::new(),
                session: session.cloned(),
                redial: None,
                last_used: Instant::now(),
                rewoken: false,
                unparking: false,
            }));
        }
        Ok(Link { state, lanes: links })
    }

    /// Fails everything on the connection and closes it.
    fn close(&mut self, why: &Error, ended: &mut Vec<ChunkEnd>) {
        self.state.mark_broken();
        let reason = Peer::detail(why);
        let mut from_connection = std::mem::take(&mut self.ends);
        if let Ok(connection) = &mut self.connection {
            connection.fail_all_for(&self.peer, why, &mut from_connection);
            if let Some(stager) = &mut self.stager {
                stager.note_chunks(connection.ended_chunks());
            }
            // The wake descriptor keeps the socket open: shut it down now.
            connection.shutdown();
        }
        self.connection = Err(reason);
        match &mut self.stager {
            Some(stager) => {
                stager.abort(&self.peer.gone(Peer::detail(why)), ended);
                stager.poll(None, &self.peer, &mut from_connection, ended);
            }
            None => ended.append(&mut from_connection),
        }
        self.ends = from_connection;
    }
}

/// A connection around a dialled `stream`: sealed with a tokened session's
/// `seal`, and `tracked` for a link that stages (the stager matches the
/// connection's chunk ends by id).
fn configured(stream: TcpStream, seal: Option<FrameSeal>, tracked: bool) -> Result<Box<Connection>> {
    let mut connection = Connection::new(stream).map_err(|e| Error::io("configuring a data connection", e))?;
    if let Some(seal) = seal {
        connection.seal_with(seal);
    }
    if tracked {
        connection.track_chunks();
    }
    Ok(Box::new(connection))
}

/// The open connection, or the error a chunk gets for its absence.
fn open_connection<'a>(peer: &Peer, connection: &'a mut Result<Box<Connection>, String>) -> Result<&'a mut Connection> {
    match connection {
        Ok(connection) => Ok(connection),
        Err(reason) => Err(peer.gone(format!("connection closed: {reason}"))),
    }
}

impl LaneLink for TcpLink {
    fn max_chunk(&self) -> usize {
        TCP_CHUNK_BLOCKS
    }

    unsafe fn transfer(&mut self, op: Opcode, batch_id: u64, ticket: u64, blocks: &[Block]) -> Posted {
        match self.dialling() {
            Ok(false) => {}
            Ok(true) => {
                self.park(Parked::Chunk { op, batch_id, ticket, blocks: blocks.to_vec() });
                return Posted::InFlight;
            }
            Err(error) => return Posted::Failed((error, 0)),
        }
        self.last_used = Instant::now();
        let TcpLink { peer, connection, stager, .. } = self;
        let connection = match open_connection(peer, connection) {
            Ok(connection) => connection,
            Err(error) => return Posted::Failed((error, 0)),
        };
        let device = blocks.iter().any(|b| b.memory != crate::mem::MemoryKind::Host);
        if device && blocks.iter().any(|b| b.checksum) {
            return Posted::Failed((crate::transport::checksum::device_refused(), 0));
        }
        match stager {
            Some(stager) if device => {
                // SAFETY: forwarded from our caller: the blocks stay leased
                // until this chunk's ticket ends through `poll` or `abort`.
                let staged = unsafe { stager.transfer(connection, peer, (op, batch_id, ticket), blocks) };
                if let Err(failed) = staged {
                    return Posted::Failed(failed);
                }
            }
            Some(stager) => {
                // SAFETY: as above.
                let chunk = unsafe { connection.queue_chunk(peer, op, batch_id, ticket, blocks) };
                stager.queued_plain(ticket, chunk);
            }
            None if device => {
                let what = "GPU memory over tcp without a GPU provider in this engine".to_string();
                return Posted::Failed((Error::Unsupported { what }, 0));
            }
            None => {
                // SAFETY: as above.
                unsafe { connection.queue_chunk(peer, op, batch_id, ticket, blocks) };
            }
        }
        // Start sending now: a lone small chunk often leaves in this call.
        if let Err(error) = connection.send(peer) {
            connection.mark_dead(error);
        }
        Posted::InFlight
    }

    fn poll(&mut self, ended: &mut Vec<ChunkEnd>) -> bool {
        if self.redial.is_some() {
            return self.poll_redial(ended);
        }
        let TcpLink { peer, connection, stager, ends, io_timeout, .. } = self;
        let Some(stager) = stager else {
            let Ok(connection) = connection else { return false };
            return match connection.progress(peer, *io_timeout, ended) {
                Ok(progressed) => progressed,
                Err(error) => {
                    self.close(&error, ended);
                    true
                }
            };
        };
        let progress = match connection {
            Ok(connection) => {
                let progress = connection.progress(peer, *io_timeout, ends);
                stager.note_chunks(connection.ended_chunks());
                progress
            }
            Err(_) => Ok(false),
        };
        match progress {
            Ok(progressed) => stager.poll(connection.as_deref_mut().ok(), peer, ends, ended) | progressed,
            Err(error) => {
                self.close(&error, ended);
                true
            }
        }
    }

    fn abort(&mut self, reason: &str, ended: &mut Vec<ChunkEnd>) {
        if let Some(redial) = self.redial.take() {
            // Nothing parked was sent; the dial's answer is dropped unread.
            redial.fail_all(&self.peer.gone(reason), &self.peer.name, ended);
        }
        let staging = self.stager.as_ref().is_some_and(Stager::busy);
        if staging || matches!(&self.connection, Ok(c) if !c.is_idle()) {
            self.close(&self.peer.gone(reason), ended);
        }
    }

    fn moves_device_memory(&self) -> bool {
        // Local GPU blocks are staged here; a peer's GPU regions are staged
        // by the peer, which registered them with its own GPU provider.
        true
    }

    fn waiting_on_copies(&self) -> bool {
        // A dial's end raises no edge on the lane's poller either.
        self.redial.is_some() || self.stager.as_ref().is_some_and(Stager::copies_running)
    }

    fn rewoken(&mut self) -> bool {
        std::mem::take(&mut self.rewoken)
    }

    fn withdraw(&mut self, ticket: u64, ended: &mut Vec<ChunkEnd>) -> usize {
        if let Some(redial) = &mut self.redial {
            let withdrawn = redial.withdraw(ticket, ended);
            if redial.parked.is_empty() {
                // Nothing waits for the dial: its answer is dropped unread
                // (a connection it made closes), and the next chunk starts
                // afresh rather than meet a stale answer.
                self.redial = None;
            }
            return withdrawn;
        }
        match (&mut self.stager, &mut self.connection) {
            // Staged chunks end through the stager, which gives their pages
            // back: only those still waiting for pages are dropped.
            (Some(stager), _) => stager.withdraw(ticket, ended),
            (None, Ok(connection)) => connection.withdraw_unsent(ticket, ended),
            (None, Err(_)) => 0,
        }
    }

    fn max_staged_chunk_bytes(&self) -> u64 {
        super::staged::MAX_STAGED_CHUNK_BYTES
    }

    fn checksums_on_wire(&self, _op: Opcode) -> bool {
        // A WRITE frame carries its CRC32C, checked by the target; a READ
        // asks for it, checked here once the bytes land.
        true
    }

    fn counts_arrivals(&self) -> bool {
        true
    }

    fn checks_grants(&self) -> bool {
        true
    }

    fn wake_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        self.wake.as_ref().map(AsRawFd::as_raw_fd)
    }

    fn post_notification(&mut self, ticket: u64, payload: Vec<u8>) -> Result<()> {
        if payload.len() > MAX_NOTIFY_FRAME_BYTES {
            return Err(Error::MessageTooLarge { len: payload.len() as u64, max: MAX_NOTIFY_FRAME_BYTES as u64 });
        }
        if self.dialling()? {
            self.park(Parked::Notification { ticket, payload });
            return Ok(());
        }
        self.last_used = Instant::now();
        let TcpLink { peer, connection, .. } = self;
        let connection = open_connection(peer, connection)?;
        connection.queue_notification(peer, ticket, payload);
        if let Err(error) = connection.send(peer) {
            connection.mark_dead(error);
        }
        Ok(())
    }
}

impl TcpLink {
    /// True when what comes now must be parked (`redial.rs`): a dial is in
    /// progress, or the quiet connection was found closed (or quiet long
    /// enough) and a dial starts now; an error when it cannot start.
    fn dialling(&mut self) -> Result<bool> {
        if self.unparking {
            return Ok(false);
        }
        if self.redial.is_some() {
            return Ok(true);
        }
        let quiet = match &self.connection {
            Ok(connection) => connection.is_idle() && !self.stager.as_ref().is_some_and(Stager::busy),
            Err(_) => false,
        };
        if !quiet {
            return Ok(false);
        }
        let closed = self.connection.as_ref().is_ok_and(|c| c.peer_closed());
        if !closed && self.last_used.elapsed() < quiet_redial_after() {
            return Ok(false);
        }
        tracing::debug!(
            peer = %self.peer.name,
            addr = %self.peer.addr,
            closed,
            "dialling a quiet data connection again (the target closed it, or would soon)"
        );
        let deadline = Instant::now() + self.io_timeout;
        let session = self.session.clone();
        self.redial =
            Some(Redial::start(self.peer.addr, &self.peer.name, self.peer.epoch, session, deadline, !closed)?);
        Ok(true)
    }

    /// Keeps `entry` for the connection being dialled ([`Self::dialling`]).
    fn park(&mut self, entry: Parked) {
        if let Some(redial) = &mut self.redial {
            redial.parked.push(entry);
        }
    }

    /// Takes the dial's answer once it came: the new connection replaces
    /// the quiet one and carries what was parked, in order. A refusal ends
    /// what was parked with it, unless the quiet one was still open (dialled
    /// before the target's idle close could race it) and the refusal says
    /// nothing of the peer (`Busy`, a timeout, an I/O error): the parked
    /// entries then go on the quiet one, as they would have.
    fn poll_redial(&mut self, ended: &mut Vec<ChunkEnd>) -> bool {
        let Some(outcome) = self.redial.as_ref().and_then(Redial::outcome) else { return false };
        let Some(redial) = self.redial.take() else { return false };
        match outcome.and_then(|dialled| self.install(dialled)) {
            Ok(()) => self.unpark(redial.parked, ended),
            Err(error)
                if redial.old_open && !matches!(error, Error::PeerRestarted { .. } | Error::Unauthorized { .. }) =>
            {
                tracing::debug!(peer = %self.peer.name, %error, "a quiet data connection was not dialled again: it carries on");
                self.last_used = Instant::now();
                self.unpark(redial.parked, ended);
            }
            // A full target (its admission's `Busy`) may have room for the
            // next chunk: the closed connection stays, to be dialled again.
            Err(error @ Error::Remote { code: crate::proto::ErrorCode::Busy, .. }) => {
                redial.fail_all(&error, &self.peer.name, ended);
            }
            Err(error) => {
                // The peer restarted, went away, or refuses this session:
                // the handle goes stale, as for a connection that broke.
                if let Ok(old) = &self.connection {
                    old.shutdown();
                }
                self.state.mark_broken();
                self.connection = Err(Peer::detail(&error));
                redial.fail_all(&error, &self.peer.name, ended);
            }
        }
        true
    }

    /// Queues what was parked on the connection now in place, in order,
    /// without parking or dialling again: an entry that meets a closed
    /// connection fails (it is never sent twice), so a peer that closes
    /// each new connection at once costs one dial per parked run, not a
    /// loop of them.
    fn unpark(&mut self, parked: Vec<Parked>, ended: &mut Vec<ChunkEnd>) {
        self.unparking = true;
        for entry in parked {
            self.send_parked(entry, ended);
        }
        self.unparking = false;
    }

    /// Puts a dialled connection in the quiet one's place, and its socket
    /// under the lane's wake descriptor (same number; the lane registers it
    /// again, [`LaneLink::rewoken`]).
    fn install(&mut self, (stream, seal): (TcpStream, Option<FrameSeal>)) -> Result<()> {
        use std::os::fd::AsRawFd;
        let connection = configured(stream, seal, self.stager.is_some())?;
        if let Ok(old) = &self.connection {
            old.shutdown();
        }
        if let Some(wake) = &self.wake {
            // The wake number now names the new socket (close-on-exec, as
            // before); the old socket's last descriptor closes with the old
            // connection below, which takes it off the lane's poller.
            // SAFETY: dup3 of two descriptors this link owns; no memory.
            if unsafe { libc::dup3(connection.raw_fd(), wake.as_raw_fd(), libc::O_CLOEXEC) } >= 0 {
                self.rewoken = true;
            }
        }
        self.connection = Ok(connection);
        self.last_used = Instant::now();
        Ok(())
    }

    /// Queues a parked entry on the new connection, as it would have been.
    fn send_parked(&mut self, parked: Parked, ended: &mut Vec<ChunkEnd>) {
        match parked {
            Parked::Chunk { op, batch_id, ticket, blocks } => {
                // SAFETY: the blocks came through `transfer`, whose caller
                // keeps them leased until this ticket ends (our contract).
                match unsafe { self.transfer(op, batch_id, ticket, &blocks) } {
                    Posted::InFlight => {}
                    Posted::Done(bytes) => ended.push((ticket, Ok(bytes))),
                    Posted::Failed(failed) => ended.push((ticket, Err(failed))),
                }
            }
            Parked::Notification { ticket, payload } => {
                if let Err(error) = self.post_notification(ticket, payload) {
                    ended.push((ticket, Err((error, 0))));
                }
            }
        }
    }
}

/// Connects one data connection and runs its opening: the hello, and with
/// a session the listener's proof of it (a listener that asks no proof or
/// proves nothing is refused: it is not the engine the handshake proved)
/// and then ours. A refusal comes back as the target's reason (`Busy` from
/// its admission policy, `PeerRestarted` for another epoch,
/// `Unauthorized`). With a session, the connection's frame seal comes too.
pub(super) fn open(
    addr: SocketAddr,
    peer: &str,
    epoch: u64,
    session: Option<&Session>,
    deadline: Instant,
) -> Result<(TcpStream, Option<FrameSeal>)> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(Error::Timeout { what: "the data connections", waited: left });
    }
    // A listener that never completes the connect ends at the deadline.
    let stream = TcpStream::connect_timeout(&addr, left).map_err(|e| match crate::net::is_timeout(&e) {
        true => Error::Timeout { what: "the data listener to accept", waited: left },
        false => Error::io(format!("connecting to {peer}'s data listener {addr}"), e),
    })?;
    let _ = stream.set_nodelay(true);
    let mut io = DeadlineIo::new(&stream, deadline);
    let timed = |e: std::io::Error, what: &str| {
        if crate::net::is_timeout(&e) {
            Error::Timeout { what: "the data listener's hello", waited: left }
        } else {
            Error::io(format!("{what} {peer}'s data listener {addr}"), e)
        }
    };
    let (cn, sn) = session.map_or(([0; 16], [0; 16]), |s| (s.client_nonce, s.server_nonce));
    let nonce: Nonce = if session.is_some() { random_bytes() } else { [0; 16] };
    io.write_all(ClientHello::new(epoch, cn, sn, nonce).as_bytes()).map_err(|e| timed(e, "greeting"))?;
    let answer = read_answer(&mut io, &addr.to_string()).map_err(|e| match e {
        Error::Io { source, .. } => timed(source, "reading the answer of"),
        other => other,
    })?;
    if let Some(refusal) = answer.refused(peer) {
        return Err(refusal);
    }
    let required = answer.flags & FLAG_PROOF_REQUIRED != 0;
    if let (Some(_), false) = (session, required) {
        return Err(Error::Unauthorized {
            reason: format!(
                "{peer}'s data listener {addr} asks no proof of this engine's tokened session: it is not the engine \
                 the handshake proved (a relay?); refusing it"
            ),
        });
    }
    if required {
        let session = session.ok_or_else(|| Error::Unauthorized {
            reason: format!("{peer}'s data listener requires a token's session; this engine has no token"),
        })?;
        if !check_listener_proof(session, &nonce, &answer.nonce, epoch, &answer.proof) {
            return Err(Error::Unauthorized {
                reason: format!(
                    "{peer}'s data listener {addr} does not prove this engine's session: it is not the engine the \
                     handshake proved (a relay?); nothing was sent to it"
                ),
            });
        }
        let proof = ClientProof::new(session.data_proof(&answer.nonce, epoch));
        io.write_all(proof.as_bytes()).map_err(|e| timed(e, "proving the session to"))?;
        let verdict = read_answer(&mut io, &addr.to_string()).map_err(|e| match e {
            Error::Io { source, .. } => timed(source, "reading the answer of"),
            other => other,
        })?;
        if let Some(refusal) = verdict.refused(peer) {
            return Err(refusal);
        }
        let seal = FrameSeal::new(session, &nonce, &answer.nonce, epoch, End::Initiator);
        return Ok((stream, Some(seal)));
    }
    Ok((stream, None))
}

/// Reads one [`ServerHello`]; what is cut short or not a hello is named as
/// not a kvring peer, with what it sent.
fn read_answer(io: &mut impl Read, addr: &str) -> Result<ServerHello> {
    let mut bytes = [0u8; SERVER_HELLO_BYTES];
    let mut got = 0;
    while got < SERVER_HELLO_BYTES {
        match io.read(&mut bytes[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // Bytes that start a hello are a kvring peer that stalled: its
            // deadline ends it (`Timeout`, through the caller). Anything
            // else is a stranger, shown as what it sent.
            Err(e) if got > 0 && crate::net::is_timeout(&e) && !starts_a_hello(&bytes[..got]) => break,
            Err(e) => return Err(Error::io("reading a server hello", e)),
        }
    }
    ServerHello::decode(&bytes[..got], addr)
}

/// True when `bytes` agree with the start of a hello (its magic).
fn starts_a_hello(bytes: &[u8]) -> bool {
    let magic = HELLO_MAGIC.to_le_bytes();
    let n = bytes.len().min(magic.len());
    bytes[..n] == magic[..n]
}

#[cfg(test)]
#[path = "redial_tests.rs"]
mod tests;
