//! A lane's data connection dialled again, off the lane, when the target
//! closed a quiet one.
//!
//! A target closes a data connection that completed no frame for
//! [`IDLE_TIMEOUT`](super::target::IDLE_TIMEOUT), and, when its table is
//! full, takes the place of an idle one for a newcomer from a source that
//! holds less than its share (`net::admission`). Neither ever serves a byte
//! that arrives after it decided (the eviction's `IdleCell`, the idle
//! close's `frame_started`), and neither means the peer restarted. So a
//! link whose connection carries nothing of ours, and that finds it closed
//! when a chunk comes, dials again instead of failing the chunk: what comes
//! meanwhile is parked here, in order, and sent on the new connection. The
//! dial (connect, hello, and the session's proofs) runs on a thread of its
//! own, never on the lane; it names the epoch the handshake proved, so a
//! peer that did restart refuses it (`PeerRestarted`), as the first open
//! would have. A link also dials again before the target's idle close can
//! race its next chunk: once quiet for [`QUIET_REDIAL_AFTER`].
//!
//! A chunk already sent on a connection that then closes is not sent again:
//! the initiator cannot tell which of its bytes were served (a tagged push
//! counted twice would report its arrival early), so it fails as before.

use super::link::open;
use crate::auth::Session;
use crate::error::{Error, Result};
use crate::ring::Opcode;
use crate::seal::FrameSeal;
use crate::transport::{Block, ChunkEnd};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc::{sync_channel, Receiver, TryRecvError};
use std::time::{Duration, Instant};

/// A connection quiet this long is dialled again before its next chunk:
/// half the target's idle close, so that close never races the chunk.
pub(super) const QUIET_REDIAL_AFTER: Duration = Duration::from_secs(super::target::IDLE_TIMEOUT.as_secs() / 2);

/// How long a connection may be quiet before its next chunk dials again:
/// [`QUIET_REDIAL_AFTER`], or what a test set ([`set_quiet_redial_after`]).
pub(super) fn quiet_redial_after() -> Duration {
    #[cfg(feature = "testing")]
    {
        let ms = QUIET_OVERRIDE_MS.load(std::sync::atomic::Ordering::Relaxed);
        if ms != 0 {
            return Duration::from_millis(ms);
        }
    }
    QUIET_REDIAL_AFTER
}

#[cfg(feature = "testing")]
static QUIET_OVERRIDE_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Testing only: makes every link of this process dial again once quiet
/// for `quiet` instead of [`QUIET_REDIAL_AFTER`] (150 s), so that a test of
/// the early dial need not wait it out. Meant for a test alone in its
/// process.
#[cfg(feature = "testing")]
pub fn set_quiet_redial_after(quiet: Duration) {
    let ms = u64::try_from(quiet.as_millis()).unwrap_or(u64::MAX).max(1);
    QUIET_OVERRIDE_MS.store(ms, std::sync::atomic::Ordering::Relaxed);
}

/// What came for the link while it dialled, in order.
#[derive(Debug)]
pub(super) enum Parked {
    /// A chunk, as [`LaneLink::transfer`](crate::transport::LaneLink::transfer) got it.
    Chunk { op: Opcode, batch_id: u64, ticket: u64, blocks: Vec<Block> },
    /// A notification, as `post_notification` got it.
    Notification { ticket: u64, payload: Vec<u8> },
}

impl Parked {
    fn ticket(&self) -> u64 {
        match self {
            Parked::Chunk { ticket, .. } | Parked::Notification { ticket, .. } => *ticket,
        }
    }
}

/// What the dialling thread hands back.
pub(super) type Dialled = Result<(TcpStream, Option<FrameSeal>)>;

/// A dial in progress, and what waits for it.
#[derive(Debug)]
pub(super) struct Redial {
    answer: Receiver<Dialled>,
    /// The quiet connection was still open (dialled before the target's
    /// idle close could race a chunk), not found closed.
    pub old_open: bool,
    /// Waiting for the new connection, in the order they came.
    pub parked: Vec<Parked>,
}

// SAFETY: the parked blocks' raw pointers are into registered local regions
// the lane holds leases on until their chunk ends (`LaneLink::transfer`'s
// contract); only the lane that owns the link touches them, as it does the
// connection's (`Connection` is `Send` for the same reason).
unsafe impl Send for Redial {}

impl Redial {
    /// Starts dialling `addr` as the first open did (`link::open`), on a
    /// thread of its own, ending by `deadline`.
    pub fn start(
        addr: SocketAddr,
        peer: &str,
        epoch: u64,
        session: Option<Session>,
        deadline: Instant,
        old_open: bool,
    ) -> Result<Self> {
        let (tell, answer) = sync_channel(1);
        let name = peer.to_string();
        std::thread::Builder::new()
            .name("kvring-redial".into())
            .spawn(move || {
                let _ = tell.send(open(addr, &name, epoch, session.as_ref(), deadline));
            })
            .map_err(|e| Error::io("starting a thread to dial a data connection again", e))?;
        Ok(Self { answer, old_open, parked: Vec::new() })
    }

    /// The dial's outcome once it ended; `None` while it runs.
    pub fn outcome(&self) -> Option<Dialled> {
        match self.answer.try_recv() {
            Ok(dialled) => Some(dialled),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(Err(Error::io(
                "dialling a data connection again",
                std::io::Error::other("its thread ended without an answer"),
            ))),
        }
    }

    /// Ends the parked entries of `ticket` (a cancelled or late part), as
    /// nothing of them left; returns how many.
    pub fn withdraw(&mut self, ticket: u64, ended: &mut Vec<ChunkEnd>) -> usize {
        let before = self.parked.len();
        self.parked.retain(|parked| {
            let matches = parked.ticket() == ticket;
            if matches {
                ended.push((ticket, Err((Error::Cancelled { bytes: 0 }, 0))));
            }
            !matches
        });
        before - self.parked.len()
    }

    /// Ends every parked entry with `error` (each its own copy): nothing
    /// of them was sent.
    pub fn fail_all(self, error: &Error, peer: &str, ended: &mut Vec<ChunkEnd>) {
        for parked in self.parked {
            ended.push((parked.ticket(), Err((copy_of(error, peer), 0))));
        }
    }
}

/// Each parked entry's own copy of the dial's error (`Error` holds an
/// `io::Error`, so it is not `Clone`): the typed refusals as they came,
/// anything else as the connection gone.
fn copy_of(error: &Error, peer: &str) -> Error {
    match error {
        Error::PeerRestarted { segment, detail } => {
            Error::PeerRestarted { segment: segment.clone(), detail: detail.clone() }
        }
        Error::Unauthorized { reason } => Error::Unauthorized { reason: reason.clone() },
        Error::Remote { code, message } => Error::Remote { code: *code, message: message.clone() },
        Error::Timeout { what, waited } => Error::Timeout { what, waited: *waited },
        other => Error::PeerRestarted {
            segment: peer.to_string(),
            detail: format!("its data connection closed while quiet and could not be dialled again: {other}"),
        },
    }
}
