//! What a lane shares with the engine and the submitters: its commands, its
//! doorbell, its counters, the rings a submitter hands it, and the settings
//! it starts with.

use super::super::clock::Clock;
use super::super::doorbell::Doorbell;
use super::super::metrics::LaneMetrics;
use super::super::status::StatusTable;
use super::super::watch::NotificationWatch;
use crate::desc::BlockDesc;
use crate::error::{Error, Result};
use crate::notify::NotificationQueue;
use crate::ring::{Consumer, Cqe, Producer, Sqe};
use crate::segment::PeerSegment;
use crate::transport::{LaneLink, LinkState};
use crossbeam_queue::SegQueue;
use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::Duration;

/// One submitter's rings as a lane sees them.
#[derive(Debug)]
pub(crate) struct SubmitterRings {
    /// Submission ring (lane consumes).
    pub sq: Consumer<Sqe>,
    /// Descriptor arena (lane consumes).
    pub descs: Consumer<BlockDesc>,
    /// Completion ring (lane produces).
    pub cq: Producer<Cqe>,
    /// The submitter's status table.
    pub status: Arc<StatusTable<Error>>,
    /// Set when the submitter is dropped.
    pub closed: Arc<AtomicBool>,
    /// Whether (and whether already) to post notification CQEs.
    pub watch: Arc<NotificationWatch>,
}

/// Control messages to a lane.
#[derive(Debug)]
pub(crate) enum LaneCommand {
    /// A new submitter's rings.
    AttachSubmitter(Box<SubmitterRings>),
    /// A segment opened under a key (`slot:16 | generation:16`): the peer's
    /// checked descriptor and this lane's own link to it.
    AttachSegment {
        /// The key SQEs carry.
        key: u32,
        /// The peer's checked descriptor.
        peer: Arc<PeerSegment>,
        /// What the lanes' links share with the handle.
        state: Arc<LinkState>,
        /// This lane's link, from now on driven by this lane only.
        link: Box<dyn LaneLink>,
    },
    /// A segment's handle was retired: its link is dropped once its chunks
    /// in flight have ended (at once, for a broken one). `done`, when
    /// given, hears when the lane has let go of what can be reused.
    DetachSegment {
        /// Its key.
        key: u32,
        /// Told once the detach is done.
        done: Option<mpsc::SyncSender<()>>,
    },
    /// Serve a target's data connections from this lane's loop.
    Serve(Box<dyn crate::transport::Service>),
    /// Poll a target's receive completions (RDMA arrivals) from this
    /// lane's loop.
    Receive(Box<dyn crate::transport::Receiver>),
    /// A data connection accepted for this lane's service, booked under
    /// admission id `id`.
    Adopt {
        /// The accepted socket.
        stream: std::net::TcpStream,
        /// Its admission id.
        id: u64,
    },
    /// Close served connection `id` (out of the admission book already);
    /// `too_late`: tell it it did not prove itself in time.
    Evict {
        /// Its admission id.
        id: u64,
        /// Whether it ran out of time to prove itself.
        too_late: bool,
    },
    /// Send a notification on the segment's data path, after what this
    /// lane has queued to it; the result goes to `reply`.
    Notify {
        /// The segment's key.
        key: u32,
        /// The encoded `Notification`.
        payload: Vec<u8>,
        /// Where the result goes.
        reply: mpsc::SyncSender<Result<()>>,
    },
}

/// What submitters and the engine share with a lane.
#[derive(Debug)]
pub(crate) struct LaneShared {
    /// Lane number.
    pub index: usize,
    /// Core it is pinned to, if pinning succeeded.
    pub core: Option<usize>,
    /// Wakes the lane when it parks.
    pub doorbell: Doorbell,
    /// Commands, pushed by any thread (many producers are real here).
    pub commands: SegQueue<LaneCommand>,
    /// Counters (written by this lane only).
    pub metrics: CachePadded<LaneMetrics>,
    pub(super) stop: AtomicBool,
    /// Set once, when the lane panicked: the panic's message.
    pub(super) death: OnceLock<String>,
    /// Armed by a test: the lane panics while it executes its next part.
    #[cfg(feature = "testing")]
    pub(super) panic_next_part: AtomicBool,
}

impl LaneShared {
    /// Sends a command and wakes the lane.
    pub fn send(&self, command: LaneCommand) {
        self.commands.push(command);
        self.doorbell.ring();
    }

    /// Asks the lane to finish queued work and exit.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.doorbell.ring();
    }

    /// The error a dead lane answers with: `Some` once it panicked.
    pub fn died(&self) -> Option<Error> {
        self.death.get().map(|reason| Error::LaneDied { lane: self.index, reason: reason.clone() })
    }

    /// Arms a panic in the lane's next part, for tests of what a panicking
    /// lane does to its batches.
    #[cfg(feature = "testing")]
    pub fn panic_on_next_part(&self) {
        self.panic_next_part.store(true, Ordering::Release);
    }

    /// True once asked to stop.
    pub(super) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }
}

/// Settings a lane starts with.
#[derive(Debug, Clone)]
pub(crate) struct LaneConfig {
    /// Lane number.
    pub index: usize,
    /// Core to pin to; None leaves the thread unpinned.
    pub core: Option<usize>,
    /// Busy-poll window before parking.
    pub busy_poll: Duration,
    /// Longest single park.
    pub park_timeout: Duration,
    /// Most segment keys (slots) the engine hands out.
    pub max_segments: usize,
    /// Clock shared with submitters (deadlines).
    pub clock: Clock,
    /// The engine's notification queue, for the lane (lane 0) that posts
    /// notification CQEs to watching submitters; `None` on the others.
    pub notifications: Option<Arc<NotificationQueue>>,
    /// Whether lanes update their Prometheus counters (switchable at run
    /// time, so a benchmark can compare both in one run).
    pub metrics: Arc<AtomicBool>,
}
