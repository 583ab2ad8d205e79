//! One data connection as the target serves it: a state machine fed by
//! whatever the socket has, that never blocks and never trusts a byte.
//!
//! It opens with the hellos (`hello.rs`): nothing is read as a frame before
//! the initiator named this start's epoch and, with a token, proved its
//! session. Then each frame is checked against this engine's own registry
//! (the region exists, allows the operation, and holds the range, with
//! checked arithmetic) before memory is touched: a WRITE payload is read
//! straight into the region under a lease; a READ is answered from the
//! region under a lease held until its bytes are on the socket; a refused
//! block fails its chunk (its payload is read and dropped so the framing
//! survives) and the chunk's ack carries the error; a notification is
//! bounded and handed to the engine's queue, whose quotas may refuse it.
//! A frame that cannot be framed is answered once and the connection closed.
//!
//! The driver (the server's poll loop) calls [`TargetConn::on_readable`] and
//! [`TargetConn::on_writable`] with the socket, and closes the connection
//! when either says so or when [`TargetConn::expired`] does: a connection
//! must prove itself within the admission deadline, finish each frame within
//! [`FRAME_TIMEOUT`] of its first byte, and is closed when idle for
//! [`IDLE_TIMEOUT`], whatever it sends. Generic over the stream, so the fuzz
//! target drives the same code with bytes.

use super::frame::{FrameHeader, FrameOp, FRAME_HEADER_BYTES};
use super::Landing;
use crate::auth::{Authenticator, Nonce};
use crate::desc::RegionId;
use crate::error::Error;
use crate::mem::Registry;
use crate::notify::NotificationQueue;
use std::collections::VecDeque;
use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest a started frame may take to arrive in full.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection that completes no frame for this long is closed.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Bytes of the read-ahead buffer: headers and small payloads arrive many
/// to a syscall; large payloads bypass it straight into region memory.
const READ_BUFFER_BYTES: usize = 64 * 1024;
/// Bytes of the buffer before the connection proves itself: room for its
/// hello and proof.
const HELLO_BUFFER_BYTES: usize = 256;
const _: () = assert!(
    HELLO_BUFFER_BYTES >= super::hello::CLIENT_HELLO_BYTES && HELLO_BUFFER_BYTES >= super::hello::CLIENT_PROOF_BYTES
);
// A reply's fixed part holds a frame header or a server hello.
const _: () = assert!(FRAME_HEADER_BYTES >= super::hello::SERVER_HELLO_BYTES);
/// Bytes one [`TargetConn::on_readable`] reads at most before it lets the
/// lane serve others (a whole largest frame).
const READ_BUDGET_BYTES: usize = 1 << 20;
/// Payloads at least this large are read straight into region memory.
const DIRECT_READ_MIN_BYTES: usize = 16 * 1024;
/// A buffer unused this long is freed, so idle connections cost little.
const BUFFER_IDLE_FREE: Duration = Duration::from_secs(1);
/// Replies queued before the connection stops reading requests (a client
/// that asks without reading the answers holds no more than this).
const MAX_QUEUED_REPLIES: usize = 1024;
/// Most slices one `writev` gathers.
const MAX_IO_SLICES: usize = 64;

/// What a target's connections share: its registry, notification queue,
/// epoch, and token check.
#[derive(Debug)]
pub(crate) struct TargetContext {
    /// The regions served.
    pub registry: Arc<Registry>,
    /// Where notifications go.
    pub notifications: Arc<NotificationQueue>,
    /// This start's epoch.
    pub epoch: u64,
    /// Set when the engine has a token.
    pub auth: Option<Arc<Authenticator>>,
    /// Where tagged pushes are counted.
    pub arrivals: Arc<crate::arrival::Arrivals>,
}

/// Why the driver must close the connection.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Close {
    /// The peer closed or reset it.
    PeerGone,
    /// This side ended it (refusal, broken framing, a deadline); `what`
    /// says why, for the logs.
    Ended(&'static str),
}

/// Asks the listener's admission policy to admit a connection that just
/// proved itself; `Err` names the full bound.
pub(crate) type Admit<'a> = &'a mut dyn FnMut() -> std::result::Result<(), &'static str>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Awaiting the [`ClientHello`].
    Hello,
    /// Awaiting the [`ClientProof`] over `nonce`, for session (cn, sn), on
    /// the connection the initiator opened with `client`.
    Proof { nonce: Nonce, client: Nonce, cn: Nonce, sn: Nonce },
    /// Serving frames.
    Serving,
    /// Sending its last replies; reading nothing more.
    Closing,
}

#[derive(Debug, Clone, Copy)]
enum Receiving {
    Header,
    /// A WRITE payload landing in `region` (leased), or in its staging
    /// pages (`staged`: a GPU region's bytes, copied later).
    Payload {
        landing: Landing,
        region: RegionId,
        staged: bool,
    },
    /// A payload nobody will use (its chunk already failed).
    Discard {
        left: usize,
    },
    /// A notification's payload, gathered in `notify`.
    Notify {
        left: usize,
    },
}

/// A reply queued for the socket: a fixed part copied here, and for READ
/// data the region's bytes, sent from the region under a lease.
#[derive(Debug)]
struct Reply {
    head: [u8; FRAME_HEADER_BYTES],
    head_len: usize,
    payload: *const u8,
    payload_len: usize,
    lease: Option<RegionId>,
    /// Waits for the copies of staging groups `first..=last` before it goes
    /// (an ack once its chunk's bytes reached the GPU, READ data once copied
    /// out of it).
    gate: Option<(u32, u32)>,
    /// Sent from staging group `group`'s pages, given back after it.
    group: Option<u32>,
}

impl Reply {
    fn total(&self) -> usize {
        self.head_len + self.payload_len
    }
}

/// One data connection, target side.
#[derive(Debug)]
pub(crate) struct TargetConn {
    phase: Phase,
    buffer: Vec<u8>,
    start: usize,
    end: usize,
    receiving: Receiving,
    /// The frame whose payload is being received.
    current: FrameHeader,
    /// The first refusal in the WRITE chunk being received.
    chunk_failure: Option<(FrameHeader, Error)>,
    notify: Vec<u8>,
    replies: VecDeque<Reply>,
    /// Bytes of the front reply already written.
    front_sent: usize,
    opened: Instant,
    admission_timeout: Duration,
    /// When the frame being received began, if one is.
    frame_started: Option<Instant>,
    last_active: Instant,
    /// The last read stopped at its budget (see [`TargetConn::unread`]).
    unread: bool,
    /// The lane's staging, swapped in while the lane drives this connection.
    stage: staging::StagingSlot,
    /// This connection's key in its copies' ids.
    stage_key: u32,
    /// A frame waits for staging pages.
    stalled: bool,
    /// Since when the frame waiting for pages has waited.
    stalled_since: Option<Instant>,
    /// The proven session its staging pages count against (none: the
    /// connection alone).
    stage_identity: Option<u64>,
    /// Since when the front reply, sent from staging pages, has been ready
    /// to go (its peer has [`staging::STAGED_SEND_TIMEOUT`] to take it).
    staged_front_since: Option<Instant>,
    /// The WRITE frames' pages being filled, and the READ frames'.
    write_group: staging::Group,
    read_group: staging::Group,
    /// Groups issued, until settled.
    groups: Vec<staging::Group>,
    next_group: u32,
    /// The first group of the WRITE chunk being received, if it has one.
    chunk_groups: Option<u32>,
    /// A WRITE chunk's first frames were served and its last was not:
    /// its ack is owed, so the connection is in the middle of a request,
    /// and its next frame is owed within `FRAME_TIMEOUT` of the last.
    chunk_open: bool,
    /// With a token: the connection's frame seal, once it proved its
    /// session (every header each way is numbered and MAC'd).
    seal: Option<crate::seal::FrameSeal>,
    /// The initiator its session's handshake proved (its engine's name):
    /// whom its tagged writes count for. None without a proven session.
    sender: Option<Arc<str>>,
    /// The grant the last GRANT frame named (0: none yet).
    grant: u32,
    /// That grant was never issued by this process: every WRITE under it
    /// is refused `Fenced` (its payload read and dropped, the stream kept).
    made_up: bool,
    /// The fence table the current WRITE payload lands under, while its
    /// lease is kept (none for a staged payload).
    fence: Option<fenced::FrameFence>,
    /// The last WRITE payload was large enough to read straight into its
    /// region: the next header, at an empty buffer, is read alone, so its
    /// payload does not come through the buffer (a copy more).
    header_alone: bool,
}

// SAFETY: the raw pointers are into registered regions under leases this
// connection holds until the bytes are moved (it releases them in `release`
// at the latest); one thread drives a connection at a time.
unsafe impl Send for TargetConn {}

impl TargetConn {
    /// A connection accepted `now`, with `admission_timeout` to prove itself.
    pub(crate) fn new(now: Instant, admission_timeout: Duration) -> Self {
        Self {
            phase: Phase::Hello,
            buffer: Vec::new(),
            start: 0,
            end: 0,
            receiving: Receiving::Header,
            current: FrameHeader::new(FrameOp::Ack, 0, 0, 0, 0, 0),
            chunk_failure: None,
            notify: Vec::new(),
            replies: VecDeque::new(),
            front_sent: 0,
            opened: now,
            admission_timeout,
            frame_started: None,
            last_active: now,
            unread: false,
            stage: Default::default(),
            stage_key: 0,
            stalled: false,
            stalled_since: None,
            stage_identity: None,
            staged_front_since: None,
            write_group: Default::default(),
            read_group: Default::default(),
            groups: Vec::new(),
            next_group: 0,
            chunk_groups: None,
            chunk_open: false,
            seal: None,
            sender: None,
            grant: 0,
            made_up: false,
            fence: None,
            header_alone: false,
        }
    }

    /// True when the last [`on_readable`](Self::on_readable) stopped at its
    /// read budget with the socket not known to be empty: drive it again.
    pub(crate) fn unread(&self) -> bool {
        self.unread
    }

    /// True when replies wait for the socket (the fuzz target's driver
    /// asks; the lanes' edge-triggered driver simply tries to write).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn wants_write(&self) -> bool {
        !self.replies.is_empty()
    }

    /// True while it takes more requests (false while too many replies
    /// wait, or once it is closing).
    pub(crate) fn wants_read(&self) -> bool {
        self.phase != Phase::Closing && self.replies.len() < MAX_QUEUED_REPLIES && !self.stalled
    }

    /// True while serving and between requests with nothing in hand: no
    /// frame begun, no WRITE chunk's ack owed, no byte buffered or left
    /// unread at the read budget, no reply queued, no staging page or copy
    /// held. Only such a connection may be evicted for a newcomer.
    pub(crate) fn quiet(&self) -> bool {
        self.phase == Phase::Serving
            && matches!(self.receiving, Receiving::Header)
            && self.frame_started.is_none()
            && !self.chunk_open
            && !self.unread
            && self.start == self.end
            && self.replies.is_empty()
            && !self.stalled
            && self.staged_front_since.is_none()
            && self.groups.is_empty()
    }

    /// True once closing and everything queued is sent.
    pub(crate) fn finished(&self) -> bool {
        self.phase == Phase::Closing && self.replies.is_empty()
    }

    /// Why it must close now, if a deadline passed: proof, frame, idle.
    pub(crate) fn expired(&self, now: Instant) -> Option<Close> {
        match self.phase {
            Phase::Hello | Phase::Proof { .. } if now >= self.opened + self.admission_timeout => {
                Some(Close::Ended("did not prove itself in time"))
            }
            _ if self.frame_started.is_some_and(|t| now >= t + FRAME_TIMEOUT) => {
                Some(Close::Ended("a frame took too long to arrive"))
            }
            _ if self.frame_started.is_none() && now >= self.last_active + IDLE_TIMEOUT => Some(Close::Ended("idle")),
            _ if self.staged_front_since.is_some_and(|t| now >= t + staging::STAGED_SEND_TIMEOUT) => {
                Some(Close::Ended("its staged READ answers were not taken in time"))
            }
            _ => None,
        }
    }

    /// When [`expired`](Self::expired) or
    /// [`shrink_if_idle`](Self::shrink_if_idle) next has something to do.
    pub(crate) fn next_deadline(&self) -> Instant {
        let next = match (self.phase, self.frame_started) {
            (Phase::Hello | Phase::Proof { .. }, _) => self.opened + self.admission_timeout,
            (_, Some(started)) => started + FRAME_TIMEOUT,
            (_, None) if self.buffer.capacity() > 0 => self.last_active + BUFFER_IDLE_FREE,
            (_, None) => self.last_active + IDLE_TIMEOUT,
        };
        let next = match self.staged_front_since {
            Some(since) => next.min(since + staging::STAGED_SEND_TIMEOUT),
            None => next,
        };
        // A frame waiting for staging pages is refused `Busy` at its stall
        // limit even if no page ever comes back to wake it.
        match self.stalled_since.filter(|_| self.stalled) {
            Some(since) => next.min(since + staging::STAGE_STALL_LIMIT),
            None => next,
        }
    }

    /// True when a frame has waited for staging pages past the limit: it
    /// must be driven again (and refused) without waiting for a page.
    pub(crate) fn stall_expired(&self, now: Instant) -> bool {
        self.stalled && self.stalled_since.is_some_and(|since| now >= since + staging::STAGE_STALL_LIMIT)
    }

    /// The connection ran out of time to prove itself: queues a refusal
    /// saying so (sent by the driver's last write before it closes).
    pub(crate) fn too_late(&mut self, epoch: u64) {
        if matches!(self.phase, Phase::Hello | Phase::Proof { .. }) {
            self.refuse(
                &Error::Timeout { what: "the data hello and its proof", waited: self.admission_timeout },
                epoch,
            );
        }
    }

    /// Frees the read buffer of a connection that has been quiet a while
    /// (it is allocated again on the next read).
    pub(crate) fn shrink_if_idle(&mut self, now: Instant) {
        if self.start == self.end && self.frame_started.is_none() && now >= self.last_active + BUFFER_IDLE_FREE {
            self.buffer = Vec::new();
            self.start = 0;
            self.end = 0;
            if self.replies.is_empty() {
                self.replies = VecDeque::new();
            }
            if self.notify.is_empty() {
                self.notify = Vec::new();
            }
        }
    }

    /// Bytes this connection holds in buffers now.
    #[cfg(test)]
    pub(crate) fn buffered_bytes(&self) -> usize {
        self.buffer.capacity() + self.notify.capacity() + self.replies.capacity() * std::mem::size_of::<Reply>()
    }

    /// Reads what has arrived and serves it, until the socket has nothing
    /// more or too many replies wait. `Ok(true)` when anything moved.
    pub(crate) fn on_readable<S: Read>(
        &mut self,
        io: &mut S,
        ctx: &TargetContext,
        admit: Admit<'_>,
        now: Instant,
        stage: &mut StagingSlot,
    ) -> std::result::Result<bool, Close> {
        self.swap_stage(stage);
        if self.stalled && self.pages_free() {
            self.stalled = false;
        }
        let read = self.read_frames(io, ctx, admit, now);
        // What this pass staged is copied now: the READ frames' copy out of
        // the GPU (their replies wait for it), and the WRITE frames' copy in
        // (a peer that goes quiet mid-chunk holds no page for long).
        self.issue(ctx, staging::Direction::Out);
        // Not while a staged payload is still arriving: its copy would
        // carry what is not there yet.
        if !matches!(self.receiving, Receiving::Payload { staged: true, .. }) {
            self.issue(ctx, staging::Direction::In);
        }
        self.swap_stage(stage);
        read
    }

    fn read_frames<S: Read>(
        &mut self,
        io: &mut S,
        ctx: &TargetContext,
        admit: Admit<'_>,
        now: Instant,
    ) -> std::result::Result<bool, Close> {
        let mut progressed = false;
        let mut drained = false;
        let mut taken = 0usize;
        self.unread = false;
        loop {
            self.process(ctx, admit, now);
            // A read that took less than it asked for emptied the socket's
            // queue (a stream socket): the next arrival raises a new edge, so
            // asking again now would only hear "would block".
            if drained || !self.wants_read() {
                return Ok(progressed);
            }
            // A peer that keeps the socket full must not keep the lane: past
            // its budget the connection yields, to be driven again once the
            // lane has served the others (no new edge would come for it).
            if taken >= READ_BUDGET_BYTES {
                self.unread = true;
                return Ok(progressed);
            }
            let (n, asked) = match self.receiving {
                Receiving::Payload { landing, region, staged }
                    if self.start == self.end && landing.left >= DIRECT_READ_MIN_BYTES =>
                {
                    let Landing { dest, left } = landing;
                    let piece = self.piece(left);
                    // SAFETY: `piece` is set only while the frame keeps its lease.
                    let pass = match piece.as_ref().map(|(f, at)| unsafe { f.admit(*at, left as u64) }).transpose() {
                        Ok(pass) => pass,
                        Err(error) => {
                            // Fenced: the rest is read into the buffer and dropped.
                            self.refuse_rest(ctx, left, error);
                            continue;
                        }
                    };
                    // SAFETY: `dest..dest + left` is the unfilled tail of a
                    // checked WRITE range in `region`, leased until the
                    // payload ends.
                    let target = unsafe { std::slice::from_raw_parts_mut(dest, left) };
                    let n = read_some(io, target)?;
                    drop(pass);
                    if n > 0 {
                        self.payload_landed(ctx, (landing, region, staged), n, now);
                    }
                    (n, left)
                }
                _ => self.fill(io)?,
            };
            if n == 0 {
                return Ok(progressed);
            }
            drained = n < asked;
            taken += n;
            progressed = true;
            if self.frame_started.is_none() {
                self.frame_started = Some(now);
            }
        }
    }

    /// Reads into the buffer's free tail (allocating or compacting first):
    /// the bytes read, and how many it asked for.
    fn fill<S: Read>(&mut self, io: &mut S) -> std::result::Result<(usize, usize), Close> {
        // Until the connection proves itself it gets a buffer of a few
        // hundred bytes (a hello, a proof), so thousands of connections that
        // never send a frame hold little; frames get the full buffer, with
        // whatever is buffered carried over.
        let wanted = if self.phase == Phase::Serving { READ_BUFFER_BYTES } else { HELLO_BUFFER_BYTES };
        if self.buffer.len() < wanted {
            let mut grown = vec![0u8; wanted];
            grown[..self.end - self.start].copy_from_slice(&self.buffer[self.start..self.end]);
            self.end -= self.start;
            self.start = 0;
            self.buffer = grown;
        }
        super::compact(&mut self.buffer, &mut self.start, &mut self.end);
        // A buffer-sized read at a frame's start would bring up to 64 KiB of
        // a large payload through the buffer, copied a second time into the
        // region: after a large WRITE, read the next header alone (a small
        // read more per frame; at 64 KiB frames nearly every byte was copied
        // twice).
        let room = self.buffer.len() - self.end;
        let asked = match self.receiving {
            _ if !self.header_alone => room,
            Receiving::Header if self.start == self.end => FRAME_HEADER_BYTES,
            // A payload's tail too short to read straight in, and the
            // header after it.
            Receiving::Payload { landing, .. } => landing.left + FRAME_HEADER_BYTES,
            _ => room,
        }
        .min(room);
        let n = read_some(io, &mut self.buffer[self.end..self.end + asked])?;
        self.end += n;
        Ok((n, asked))
    }

    /// Consumes buffered bytes as far as they go.
    fn process(&mut self, ctx: &TargetContext, admit: Admit<'_>, now: Instant) {
        while self.wants_read() {
            let progressed = match self.phase {
                Phase::Hello => self.on_hello(ctx, admit),
                Phase::Proof { nonce, client, cn, sn } => self.on_proof(ctx, admit, nonce, client, (cn, sn)),
                Phase::Serving => self.serve_buffered(ctx, now),
                Phase::Closing => false,
            };
            if !progressed {
                return;
            }
        }
    }

    fn take(&mut self, len: usize) -> Option<&[u8]> {
        if self.end - self.start < len {
            return None;
        }
        let taken = &self.buffer[self.start..self.start + len];
        self.start += len;
        Some(taken)
    }

    /// Serves one step of buffered frame bytes; false when more are needed.
    fn serve_buffered(&mut self, ctx: &TargetContext, now: Instant) -> bool {
        match self.receiving {
            Receiving::Header => {
                let Some(bytes) = self.take(FRAME_HEADER_BYTES) else {
                    // A WRITE chunk left open owes its next frame in time.
                    if self.start == self.end && !self.chunk_open {
                        self.frame_started = None;
                    }
                    return false;
                };
                let decoded = FrameHeader::decode(bytes).and_then(|(header, op)| match &mut self.seal {
                    // Checked before anything of it is believed.
                    Some(seal) => header.check_seal(seal).map(|()| (header, op)),
                    None => Ok((header, op)),
                });
                match decoded {
                    Ok((header, op)) => {
                        self.current = header;
                        if !self.on_frame(ctx, op, now) {
                            return false;
                        }
                    }
                    Err(error) => {
                        // Framing (or the session's numbering) is lost:
                        // answer once, close.
                        self.queue_status(FrameOp::Ack, &FrameHeader::new(FrameOp::Ack, 0, 0, 0, 0, 0), &error);
                        self.phase = Phase::Closing;
                    }
                }
                true
            }
            Receiving::Payload { landing, region, staged } => {
                let Landing { dest, left } = landing;
                let n = left.min(self.end - self.start);
                if n == 0 {
                    return false;
                }
                let piece = self.piece(left);
                // SAFETY: `piece` is set only while the frame keeps its lease.
                let pass = match piece.as_ref().map(|(f, at)| unsafe { f.admit(*at, n as u64) }).transpose() {
                    Ok(pass) => pass,
                    Err(error) => {
                        self.refuse_rest(ctx, left, error);
                        return true;
                    }
                };
                // SAFETY: `dest..dest + left` is the unfilled tail of a
                // checked, leased WRITE range, and `n <= left`; the buffer
                // is our own memory, so the two never overlap.
                unsafe { std::ptr::copy_nonoverlapping(self.buffer.as_ptr().add(self.start), dest, n) };
                drop(pass);
                self.start += n;
                self.payload_landed(ctx, (landing, region, staged), n, now);
                true
            }
            Receiving::Discard { left } => {
                let n = left.min(self.end - self.start);
                if n == 0 {
                    return false;
                }
                self.start += n;
                if n == left {
                    self.receiving = Receiving::Header;
                    self.write_frame_ended(ctx, now);
                } else {
                    self.receiving = Receiving::Discard { left: left - n };
                }
                true
            }
            Receiving::Notify { left } => {
                let n = left.min(self.end - self.start);
                if n == 0 {
                    return false;
                }
                let (start, end) = (self.start, self.start + n);
                self.notify.extend_from_slice(&self.buffer[start..end]);
                self.start = end;
                if n == left {
                    self.receiving = Receiving::Header;
                    self.deliver_notification(ctx, now);
                } else {
                    self.receiving = Receiving::Notify { left: left - n };
                }
                true
            }
        }
    }

    /// `n` more bytes of the WRITE payload are in place.
    fn payload_landed(
        &mut self,
        ctx: &TargetContext,
        (landing, region, staged): (Landing, RegionId, bool),
        n: usize,
        now: Instant,
    ) {
        if n < landing.left {
            self.receiving = Receiving::Payload { landing: landing.advanced(n), region, staged };
            return;
        }
        self.receiving = Receiving::Header;
        self.fence = None;
        if staged {
            if self.current.checksum().is_some() {
                self.chunk_failure.get_or_insert((self.current, crate::transport::checksum::device_refused()));
            }
            // In its pages: the region's lease and the tag wait for the copy.
            self.staged_payload_landed(region);
            self.write_frame_ended(ctx, now);
            return;
        }
        // The frame's end: its whole range was checked and is still leased
        // for this frame.
        let end = landing.advanced(n).dest;
        // SAFETY: `end` closes the frame's checked range, leased for this frame.
        unsafe { crate::transport::checksum::verify_frame(&self.current, end, &mut self.chunk_failure) };
        // SAFETY: `check_block` kept this lease for this frame; it is given back once, here.
        unsafe { ctx.registry.release_kept(region) };
        // Its bytes are in the region now: count them under its tag.
        if let Some(tag) = self.current.arrival_tag() {
            let (current, sender) = (&self.current, self.sender.as_deref());
            ctx.arrivals.land_at(tag, current.region, current.offset, current.len.into(), sender);
        }
        self.write_frame_ended(ctx, now);
    }
}

/// One non-blocking read: 0 when nothing has arrived.
fn read_some<S: Read>(io: &mut S, into: &mut [u8]) -> std::result::Result<usize, Close> {
    loop {
        return match io.read(into) {
            Ok(0) => Err(Close::PeerGone),
            Ok(n) => Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => Err(Close::PeerGone),
        };
    }
}

mod fenced;
mod frames;
mod opening;
mod sending;
mod staging;

pub(crate) use staging::StagingSlot;
#[cfg(test)]
mod tests;
