//! A lane: one pinned poller thread running a glommio executor, and the
//! rings, segments and statistics it owns.
//!
//! The loop: take control commands (new submitters, opened and closed
//! segments), drain each submitter's submission ring in chunks, validate and
//! execute every descriptor, publish status and completions. With no work
//! for `busy_poll` it parks on its [`Doorbell`]; a submitter's next push
//! wakes it. Nothing in the loop allocates, locks or formats a string on the
//! success path: segments arrive pre-resolved and per-lane tables are
//! preallocated when the lane starts.

use super::doorbell::Doorbell;
use super::metrics::LaneMetrics;
use super::status::{BatchState, PartEnd, StatusTable};
use super::watch::NotificationWatch;
use crate::desc::{BlockDesc, RegionId};
use crate::error::{Error, Result, Side};
use crate::mem::{Access, Registry};
use crate::proto::ErrorCode;
use crate::ring::{Consumer, Cqe, CqeKind, Opcode, Producer, Sqe};
use crate::segment::PeerSegment;
use crate::transport::notify::NotificationQueue;
use crate::transport::{Block, Finished, Link, Posted, TransferError};
use bytemuck::Zeroable;
use crossbeam_queue::SegQueue;
use crossbeam_utils::CachePadded;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Default busy-poll window before an idle lane parks.
pub const DEFAULT_BUSY_POLL: Duration = Duration::from_millis(2);
/// Default longest a parked lane sleeps before looking again on its own
/// (a safety net: the doorbell wakes it as soon as work arrives).
pub const DEFAULT_PARK_TIMEOUT: Duration = Duration::from_millis(50);
/// Most SQEs a lane takes from one ring before visiting the next.
pub const DEFAULT_MAX_SQES_PER_POLL: usize = 32;
/// Default io_uring buffer memory per lane executor: kvring does no storage
/// I/O through glommio, so the minimum glommio accepts.
pub const DEFAULT_IO_MEMORY_BYTES: usize = 64 * 1024;
/// io_uring submission depth per lane executor.
pub const IO_RING_DEPTH: usize = 64;
/// glommio refuses to start below this locked-memory limit.
pub const MIN_MEMLOCK_BYTES: u64 = 512 * 1024;

/// The engine's monotonic clock: nanoseconds since the engine started.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    base: Instant,
}

impl Clock {
    /// A clock starting now.
    pub fn new() -> Self {
        Self { base: Instant::now() }
    }

    /// Nanoseconds since the clock started (never 0, so 0 can mean "none").
    #[inline]
    pub fn now_ns(&self) -> u64 {
        self.base.elapsed().as_nanos() as u64 + 1
    }

    /// The clock reading `after` from now.
    pub fn deadline_ns(&self, after: Duration) -> u64 {
        self.now_ns().saturating_add(after.as_nanos().min(u64::MAX as u128) as u64)
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

/// A lane's counters: written by the lane only, read by anyone.
#[derive(Debug, Default)]
pub struct LaneStats {
    /// Batch parts executed.
    pub parts: AtomicU64,
    /// Descriptors executed (moved or failed).
    pub descs: AtomicU64,
    /// Bytes moved.
    pub bytes: AtomicU64,
    /// Times the lane parked.
    pub parks: AtomicU64,
    /// Most parts and notifications the lane has had in flight at once.
    pub peak_in_flight: AtomicU64,
}

/// One submitter's rings as a lane sees them.
#[derive(Debug)]
pub struct SubmitterRings {
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

/// A segment as a lane uses it: the peer's region table and the link.
#[derive(Debug, Clone)]
pub struct LaneSegment {
    /// The peer's checked descriptor.
    pub peer: Arc<PeerSegment>,
    /// The transport link to it.
    pub link: Arc<dyn Link>,
}

/// Control messages to a lane.
#[derive(Debug)]
pub enum LaneCommand {
    /// A new submitter's rings.
    AttachSubmitter(Box<SubmitterRings>),
    /// A segment opened under a key (`slot:16 | generation:16`).
    AttachSegment {
        /// The key SQEs carry.
        key: u32,
        /// The segment.
        segment: LaneSegment,
    },
    /// A segment closed.
    DetachSegment {
        /// Its key.
        key: u32,
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
pub struct LaneShared {
    /// Lane number.
    pub index: usize,
    /// Core it is pinned to, if pinning succeeded.
    pub core: Option<usize>,
    /// Wakes the lane when it parks.
    pub doorbell: Doorbell,
    /// Commands, pushed by any thread (many producers are real here).
    pub commands: SegQueue<LaneCommand>,
    /// Counters.
    pub stats: CachePadded<LaneStats>,
    /// Prometheus counters (written by this lane only).
    pub metrics: CachePadded<LaneMetrics>,
    stop: AtomicBool,
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
}

/// Settings a lane starts with.
#[derive(Debug, Clone)]
pub struct LaneConfig {
    /// Lane number.
    pub index: usize,
    /// Core to pin to; None leaves the thread unpinned.
    pub core: Option<usize>,
    /// Busy-poll window before parking.
    pub busy_poll: Duration,
    /// Longest single park.
    pub park_timeout: Duration,
    /// glommio io_uring buffer memory.
    pub io_memory_bytes: usize,
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

/// A running lane: its shared part and its thread.
#[derive(Debug)]
pub struct LaneHandle {
    /// Shared with submitters.
    pub shared: Arc<LaneShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LaneHandle {
    /// Starts a lane thread, pins it, builds its glommio executor and waits
    /// until it runs (or reports why it could not).
    pub fn start(config: LaneConfig, registry: Arc<Registry>) -> Result<Self> {
        let (ready_tx, ready_rx) = mpsc::channel::<Result<Arc<LaneShared>>>();
        let index = config.index;
        let thread = std::thread::Builder::new()
            .name(format!("kvring-lane-{index}"))
            .spawn(move || lane_thread(config, registry, ready_tx))
            .map_err(|e| Error::io(format!("spawning lane {index}"), e))?;
        match ready_rx.recv() {
            Ok(Ok(shared)) => Ok(Self { shared, thread: Some(thread) }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(Error::LaneStart { lane: index, reason: "lane thread exited during start".into() })
            }
        }
    }

    /// Stops the lane after it drains its rings, and joins its thread.
    pub fn stop_and_join(&mut self) {
        self.shared.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for LaneHandle {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

fn lane_thread(config: LaneConfig, registry: Arc<Registry>, ready: mpsc::Sender<Result<Arc<LaneShared>>>) {
    let index = config.index;
    let core = config.core.filter(|&core| core_affinity::set_for_current(core_affinity::CoreId { id: core }));
    let executor = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .name(&format!("kvring-lane-{index}"))
        .io_memory(config.io_memory_bytes)
        .ring_depth(IO_RING_DEPTH)
        .make();
    let executor = match executor {
        Ok(executor) => executor,
        Err(e) => {
            let _ = ready.send(Err(map_glommio_error(index, e)));
            return;
        }
    };
    let shared = Arc::new(LaneShared {
        index,
        core,
        doorbell: Doorbell::for_current_thread(),
        commands: SegQueue::new(),
        stats: CachePadded::new(LaneStats::default()),
        metrics: CachePadded::new(LaneMetrics::new()),
        stop: AtomicBool::new(false),
    });
    let lane = Lane {
        segments: vec![None; config.max_segments],
        shared: shared.clone(),
        registry,
        rings: Vec::new(),
        cq_backlog: VecDeque::new(),
        chunk: Vec::with_capacity(MAX_CHUNK_BLOCKS),
        ended_runs: Vec::with_capacity(MAX_CHUNK_BLOCKS),
        tickets: (0..MAX_TICKETS).map(|_| Ticket::new()).collect(),
        free_tickets: (0..MAX_TICKETS as u32).rev().collect(),
        active: Vec::with_capacity(16),
        finished: Vec::with_capacity(MAX_TICKETS),
        peak_in_flight: 0,
        seen_notifications: 0,
        config,
    };
    if ready.send(Ok(shared)).is_err() {
        return;
    }
    executor.run(lane.run());
}

fn map_glommio_error(lane: usize, error: glommio::GlommioError<()>) -> Error {
    let text = error.to_string();
    if text.contains("memlock") {
        let have = memlock_limit_bytes().unwrap_or(0);
        Error::LockedMemoryLimit { have_bytes: have, need_bytes: MIN_MEMLOCK_BYTES }
    } else {
        Error::LaneStart { lane, reason: text }
    }
}

/// The soft RLIMIT_MEMLOCK in bytes (`u64::MAX` when unlimited).
pub fn memlock_limit_bytes() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    (rc == 0).then_some(if limit.rlim_cur == libc::RLIM_INFINITY { u64::MAX } else { limit.rlim_cur })
}

/// Locked memory `lanes` lanes need: glommio's floor, or each lane's
/// io_uring buffers and rings, whichever is larger.
pub fn memlock_needed_bytes(lanes: usize, io_memory_bytes: usize) -> u64 {
    let per_lane = io_memory_bytes.max(64 * 1024) as u64 + 3 * (IO_RING_DEPTH as u64) * 128;
    (lanes as u64 * per_lane).max(MIN_MEMLOCK_BYTES)
}

struct Lane {
    shared: Arc<LaneShared>,
    registry: Arc<Registry>,
    /// Submitters' rings by stable slot (a slot is emptied, never shifted,
    /// because tickets in flight name it).
    rings: Vec<Option<RingSlot>>,
    /// Indexed by segment slot; `(key, segment)`.
    segments: Vec<Option<(u32, LaneSegment)>>,
    /// CQEs that found their ring full. By construction (a completion ring
    /// has room for every unconsumed batch) this stays empty; it exists so a
    /// broken invariant delays a completion instead of losing it.
    cq_backlog: VecDeque<(usize, Cqe)>,
    /// Validated blocks of the chunk being built (preallocated).
    chunk: Vec<Block>,
    /// Regions whose runs ended in the chunk being built: their leases are
    /// released once the chunk has ended.
    ended_runs: Vec<RegionId>,
    /// Parts and notifications being executed, by ticket (preallocated).
    tickets: Vec<Ticket>,
    free_tickets: Vec<u32>,
    /// Links with chunks in flight, polled every round.
    active: Vec<ActiveLink>,
    /// Chunks links reported ended (reused buffer).
    finished: Vec<Finished>,
    /// Local copy of `stats.peak_in_flight` (no atomic read per part).
    peak_in_flight: u64,
    /// Notification deliveries already announced to watchers.
    seen_notifications: u64,
    config: LaneConfig,
}

struct RingSlot {
    rings: SubmitterRings,
    /// Tickets of this ring not yet ended.
    tickets: u32,
}

struct ActiveLink {
    link: Arc<dyn Link>,
    chunks: u32,
}

/// One part (or notification) the lane is executing, from its SQE until
/// every chunk of it has ended.
struct Ticket {
    ring: usize,
    sqe: Sqe,
    segment: Option<LaneSegment>,
    /// Chunks handed to the link and not yet ended.
    outstanding: u32,
    progress: PartProgress,
    end: Option<PartEnd<Error>>,
    /// Leases held until the part ends (once any chunk went in flight).
    leases: Vec<RegionId>,
    /// Set for a notification: where its result goes.
    notify_reply: Option<mpsc::SyncSender<Result<()>>>,
    /// When the lane took the part (engine clock), for the latency histogram.
    started_ns: u64,
}

impl Ticket {
    fn new() -> Self {
        Self {
            ring: 0,
            sqe: Sqe::zeroed(),
            segment: None,
            outstanding: 0,
            progress: PartProgress::default(),
            end: None,
            leases: Vec::new(),
            notify_reply: None,
            started_ns: 0,
        }
    }
}

/// Most blocks any link takes per chunk; the lane's chunk buffer is
/// allocated once with this capacity.
pub const MAX_CHUNK_BLOCKS: usize = 256;
/// Parts (and notifications) a lane executes at once; SQEs wait in their
/// ring while all are taken.
pub const MAX_TICKETS: usize = 512;
/// Longest a lane parks while chunks are in flight: replies wake no
/// doorbell, so it looks again this often.
const IN_FLIGHT_PARK: Duration = Duration::from_micros(200);
/// Rounds between deadline checks of parts in flight.
const DEADLINE_CHECK_ROUNDS: u32 = 256;

impl Lane {
    async fn run(mut self) {
        let mut idle_since: Option<Instant> = None;
        let mut rounds: u32 = 0;
        loop {
            let commands = self.take_commands();
            let worked = self.poll_links() + self.poll_rings() + self.announce_notifications() + commands;
            if self.free_tickets.len() < self.tickets.len() && (worked == 0 || rounds % DEADLINE_CHECK_ROUNDS == 0) {
                self.expire_in_flight();
            }
            if worked > 0 {
                idle_since = None;
            } else if self.shared.stop.load(Ordering::Acquire) {
                if self.drained() {
                    break;
                }
            } else {
                let now = Instant::now();
                match idle_since {
                    None => idle_since = Some(now),
                    Some(since) if now - since >= self.config.busy_poll => {
                        self.park();
                        idle_since = None;
                    }
                    // Waiting on peers' replies only: let a thread that shares
                    // this core (often the very peer, on loopback) run.
                    Some(_) if !self.active.is_empty() => std::thread::yield_now(),
                    Some(_) => std::hint::spin_loop(),
                }
            }
            rounds = rounds.wrapping_add(1);
            if rounds % 64 == 0 {
                // Let other tasks on this executor (future transports) run.
                glommio::yield_if_needed().await;
            }
        }
        self.abort_all("the lane stopped");
    }

    fn drained(&mut self) -> bool {
        self.cq_backlog.is_empty()
            && self.free_tickets.len() == self.tickets.len()
            && self.rings.iter_mut().flatten().all(|r| r.rings.sq.is_empty())
    }

    fn park(&mut self) {
        let shared = self.shared.clone();
        let timeout = if self.active.is_empty() {
            self.config.park_timeout
        } else {
            self.config.park_timeout.min(IN_FLIGHT_PARK)
        };
        let rings = &mut self.rings;
        let notifications = self.config.notifications.as_deref();
        let seen = self.seen_notifications;
        let parked = shared.doorbell.park(timeout, || {
            !shared.commands.is_empty()
                || notifications.is_some_and(|queue| queue.delivered() != seen)
                || shared.stop.load(Ordering::Acquire)
                || rings.iter_mut().flatten().any(|r| !r.rings.sq.is_empty())
        });
        if parked {
            shared.stats.parks.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn take_commands(&mut self) -> usize {
        let mut taken = 0;
        while let Some(command) = self.shared.commands.pop() {
            taken += 1;
            match command {
                LaneCommand::AttachSubmitter(rings) => {
                    let slot = RingSlot { rings: *rings, tickets: 0 };
                    match self.rings.iter_mut().find(|r| r.is_none()) {
                        Some(free) => *free = Some(slot),
                        None => self.rings.push(Some(slot)),
                    }
                }
                LaneCommand::AttachSegment { key, segment } => {
                    if let Some(entry) = self.segments.get_mut(key as u16 as usize) {
                        *entry = Some((key, segment));
                    }
                }
                LaneCommand::DetachSegment { key } => {
                    if let Some(entry) = self.segments.get_mut(key as u16 as usize) {
                        if entry.as_ref().is_some_and(|(k, _)| *k == key) {
                            *entry = None;
                        }
                    }
                }
                LaneCommand::Notify { key, payload, reply } => self.post_notification(key, payload, reply),
            }
        }
        taken
    }

    /// Posts one notification CQE to each watching submitter that has none
    /// pending, when deliveries happened since the last look.
    fn announce_notifications(&mut self) -> usize {
        let Some(queue) = &self.config.notifications else { return 0 };
        let delivered = queue.delivered();
        if delivered == self.seen_notifications {
            return 0;
        }
        self.seen_notifications = delivered;
        for (index, slot) in self.rings.iter_mut().enumerate() {
            let Some(slot) = slot else { continue };
            // The claim is taken after reading `delivered` (see watch.rs).
            if !slot.rings.watch.claim_post() {
                continue;
            }
            let cqe = Cqe { user_data: 0, batch_id: 0, bytes: 0, result: 0, kind: CqeKind::Notification as u32 };
            if slot.rings.cq.push(cqe).is_err() {
                self.cq_backlog.push_back((index, cqe));
            }
        }
        1
    }

    fn segment(&self, key: u32) -> Option<&LaneSegment> {
        self.segments.get(key as u16 as usize).and_then(Option::as_ref).filter(|(k, _)| *k == key).map(|(_, s)| s)
    }

    fn post_notification(&mut self, key: u32, payload: Vec<u8>, reply: mpsc::SyncSender<Result<()>>) {
        let Some(segment) = self.segment(key).cloned() else {
            let _ = reply.send(Err(Error::UnknownSegment { segment: format!("key {key:#x}") }));
            return;
        };
        let Some(index) = self.free_tickets.pop() else {
            let _ = reply.send(Err(Error::Busy { queue: "lane tickets", capacity: MAX_TICKETS }));
            return;
        };
        match segment.link.post_notification(self.config.index, index as u64, payload) {
            Ok(()) => {
                let ticket = &mut self.tickets[index as usize];
                ticket.outstanding = 1;
                ticket.notify_reply = Some(reply);
                activate(&mut self.active, &segment.link);
                ticket.segment = Some(segment);
            }
            Err(error) => {
                if matches!(error, Error::PeerRestarted { .. }) {
                    segment.peer.mark_stale();
                }
                let _ = reply.send(Err(error));
                self.free_tickets.push(index);
            }
        }
    }

    /// One pass over every submitter's ring. Returns SQEs taken.
    fn poll_rings(&mut self) -> usize {
        self.flush_cq_backlog();
        let mut executed = 0;
        let mut waiting = 0;
        for index in 0..self.rings.len() {
            let Some(slot) = self.rings[index].as_mut() else { continue };
            let slots = slot.rings.sq.slots();
            waiting += slots;
            let available = slots.min(DEFAULT_MAX_SQES_PER_POLL);
            if available == 0 {
                if slot.rings.closed.load(Ordering::Acquire) && slot.rings.sq.is_empty() && slot.tickets == 0 {
                    self.rings[index] = None;
                }
                continue;
            }
            for _ in 0..available.min(self.free_tickets.len()) {
                let Some(sqe) = self.rings[index].as_mut().and_then(|slot| slot.rings.sq.pop()) else { break };
                self.execute_part(index, sqe);
                executed += 1;
            }
        }
        if self.config.metrics.load(Ordering::Relaxed) {
            let in_flight = (self.tickets.len() - self.free_tickets.len()) as u64;
            self.shared.metrics.occupancy(waiting.saturating_sub(executed) as u64, in_flight);
        }
        executed
    }

    fn flush_cq_backlog(&mut self) {
        while let Some(&(ring, cqe)) = self.cq_backlog.front() {
            match self.rings.get_mut(ring).and_then(Option::as_mut).map(|r| r.rings.cq.push(cqe)) {
                Some(Err(_)) => return,
                _ => {
                    self.cq_backlog.pop_front();
                }
            }
        }
    }

    /// Polls every link with chunks in flight and ends what they report.
    fn poll_links(&mut self) -> usize {
        if self.active.is_empty() {
            return 0;
        }
        let mut progressed = 0;
        for active in &self.active {
            progressed += active.link.poll(self.config.index, &mut self.finished) as usize;
        }
        self.end_finished();
        progressed
    }

    fn end_finished(&mut self) {
        let mut finished = std::mem::take(&mut self.finished);
        for (ticket, result) in finished.drain(..) {
            self.end_chunk(ticket as usize, result);
        }
        self.finished = finished;
    }

    /// Fails the parts in flight whose deadline has passed. Their chunks
    /// cannot be recalled from a byte stream, so the link closes what
    /// carries them (and with it everything else in flight on it: those
    /// parts fail `PeerRestarted` and the segment is reopened by name).
    fn expire_in_flight(&mut self) {
        let now = self.config.clock.now_ns();
        for index in 0..self.tickets.len() {
            let ticket = &mut self.tickets[index];
            let expired = ticket.outstanding > 0
                && ticket.notify_reply.is_none()
                && ticket.sqe.deadline_ns != 0
                && now > ticket.sqe.deadline_ns;
            if !expired {
                continue;
            }
            ticket.end.get_or_insert(PartEnd::TimedOut);
            if let Some(segment) = ticket.segment.clone() {
                let reason = format!(
                    "batch {:#x} passed its deadline with blocks in flight, so its connection was closed",
                    ticket.sqe.batch_id
                );
                segment.link.abort(self.config.index, &reason, &mut self.finished);
                segment.peer.mark_stale();
            }
        }
        self.end_finished();
    }

    /// Ends everything in flight (the lane is exiting).
    fn abort_all(&mut self, reason: &str) {
        let links: Vec<_> = self.active.iter().map(|a| a.link.clone()).collect();
        for link in links {
            link.abort(self.config.index, reason, &mut self.finished);
        }
        self.end_finished();
    }

    fn end_chunk(&mut self, index: usize, result: Result<u64, TransferError>) {
        let Some(ticket) = self.tickets.get_mut(index) else { return };
        if ticket.outstanding == 0 {
            return;
        }
        ticket.outstanding -= 1;
        match result {
            Ok(bytes) => ticket.progress.bytes += bytes,
            Err((error, bytes)) => {
                ticket.progress.bytes += bytes;
                ticket.end.get_or_insert(PartEnd::Failed(error));
            }
        }
        if let Some(segment) = &ticket.segment {
            deactivate(&mut self.active, &segment.link);
        }
        if ticket.outstanding == 0 {
            self.end_ticket(index);
        }
    }

    fn execute_part(&mut self, ring_index: usize, sqe: Sqe) {
        if self.rings[ring_index].is_none() {
            return;
        }
        let Some(ticket_index) = self.free_tickets.pop() else { return };
        let id = super::status::BatchId::from_raw(sqe.batch_id);
        let segment = match self.segment(sqe.segment) {
            Some(segment) => Some(segment.clone()),
            None => {
                // A segment's attach command is pushed before any SQE naming
                // it, but the lane may have drained its commands just before
                // both arrived: drain again before calling the key unknown.
                self.take_commands();
                self.segment(sqe.segment).cloned()
            }
        };
        let in_use = (MAX_TICKETS - self.free_tickets.len()) as u64;
        if in_use > self.peak_in_flight {
            self.peak_in_flight = in_use;
            self.shared.stats.peak_in_flight.store(in_use, Ordering::Relaxed);
        }
        let Lane { registry, rings, config, chunk, ended_runs, tickets, active, .. } = self;
        let Some(slot) = rings[ring_index].as_mut() else { unreachable!("checked above") };
        slot.tickets += 1;
        let ring = &mut slot.rings;
        let ticket = &mut tickets[ticket_index as usize];
        ticket.ring = ring_index;
        ticket.sqe = sqe;
        ticket.started_ns = if config.metrics.load(Ordering::Relaxed) { config.clock.now_ns() } else { 0 };
        ticket.progress = PartProgress::default();
        ticket.leases.clear();
        let op = Opcode::from_u8(sqe.opcode);
        let status = &ring.status;

        ticket.end = match (&segment, op) {
            (None, _) => Some(PartEnd::Failed(Error::UnknownSegment { segment: format!("key {:#x}", sqe.segment) })),
            (_, None) => Some(PartEnd::Failed(Error::UnknownOpcode { opcode: sqe.opcode })),
            (Some(segment), _) if segment.peer.is_stale() => Some(PartEnd::Failed(Error::PeerRestarted {
                segment: segment.peer.descriptor().name.clone(),
                detail: "an earlier batch found it gone".into(),
            })),
            _ => None,
        };
        let (local_needs, remote_needs) = match op {
            Some(Opcode::Read) => (Access::LOCAL_WRITE, Access::REMOTE_READ),
            _ => (Access::LOCAL_READ, Access::REMOTE_WRITE),
        };
        let max_chunk = segment.as_ref().map_or(1, |s| s.link.max_chunk().clamp(1, MAX_CHUNK_BLOCKS));
        let mut run: Option<RegionId> = None;
        chunk.clear();
        ended_runs.clear();
        let mut post = Poster { lane: config.index, ticket_index, id, registry, chunk, ended_runs, active };
        // Every descriptor of the part is consumed from the arena, executed
        // or not, so the next batch never waits behind a failed one; leases
        // are released run by run exactly as the submitter took them, but
        // only once the chunk using them has ended.
        let descs = ring.descs.read_chunk(sqe.desc_count as usize);
        debug_assert_eq!(descs.len(), sqe.desc_count as usize, "descriptors are published before their SQE");
        for (offset, desc) in descs.enumerate() {
            if run != Some(desc.local_region) {
                if let Some(region) = run {
                    post.ended_runs.push(region);
                }
                run = Some(desc.local_region);
            }
            if ticket.end.is_some() {
                continue;
            }
            let (Some(segment), Some(op)) = (&segment, op) else { continue };
            if post.chunk.is_empty() {
                if status.cancel_requested(id) {
                    ticket.end = Some(PartEnd::Cancelled);
                    continue;
                }
                if sqe.deadline_ns != 0 && config.clock.now_ns() > sqe.deadline_ns {
                    ticket.end = Some(PartEnd::TimedOut);
                    continue;
                }
            }
            let desc_index = sqe.desc_base + offset as u32;
            match validate(post.registry, segment, &desc, desc_index, local_needs, remote_needs) {
                Ok(local) => post.chunk.push(Block { local, desc, desc_index }),
                Err(error) => {
                    // Blocks validated before the bad one still move, as
                    // they would have one by one.
                    post.flush(ticket, segment, op);
                    ticket.progress.executed += 1;
                    ticket.end.get_or_insert(PartEnd::Failed(error));
                    continue;
                }
            }
            if post.chunk.len() >= max_chunk {
                post.flush(ticket, segment, op);
            }
        }
        if ticket.end.is_none() {
            if let (Some(segment), Some(op)) = (&segment, op) {
                post.flush(ticket, segment, op);
            }
        }
        post.chunk.clear();
        for region in post.ended_runs.drain(..).chain(run) {
            if ticket.outstanding > 0 {
                ticket.leases.push(region);
            } else {
                post.registry.release(region);
            }
        }
        ticket.segment = segment;
        if ticket.outstanding == 0 {
            self.end_ticket(ticket_index as usize);
        }
    }

    /// Ends a ticket whose chunks have all ended: releases its leases and
    /// publishes its part's status and completion (or a notification's
    /// result), then frees it.
    fn end_ticket(&mut self, index: usize) {
        let Lane { shared, registry, rings, tickets, free_tickets, cq_backlog, config, .. } = self;
        let ticket = &mut tickets[index];
        for region in ticket.leases.drain(..) {
            registry.release(region);
        }
        let segment = ticket.segment.take();
        let end = ticket.end.take();
        if let (Some(segment), Some(PartEnd::Failed(error))) = (&segment, &end) {
            // The peer is gone or restarted, or the link broke: later
            // batches to this handle fail at once, and the next open of its
            // name reconnects.
            if matches!(error, Error::PeerRestarted { .. }) || segment.link.is_broken() {
                segment.peer.mark_stale();
            }
        }
        free_tickets.push(index as u32);
        if let Some(reply) = ticket.notify_reply.take() {
            let result = match end {
                Some(PartEnd::Failed(error)) => Err(error),
                _ => Ok(()),
            };
            let _ = reply.send(result);
            return;
        }
        let stats = &shared.stats;
        stats.parts.fetch_add(1, Ordering::Relaxed);
        stats.descs.fetch_add(ticket.progress.executed, Ordering::Relaxed);
        stats.bytes.fetch_add(ticket.progress.bytes, Ordering::Relaxed);
        let Some(slot) = rings.get_mut(ticket.ring).and_then(Option::as_mut) else { return };
        slot.tickets -= 1;
        let sqe = ticket.sqe;
        let id = super::status::BatchId::from_raw(sqe.batch_id);
        let finished =
            slot.rings.status.finish_part(id, ticket.progress.bytes, end.unwrap_or(PartEnd::Done), result_code);
        if let (Some(op), true) = (Opcode::from_u8(sqe.opcode), ticket.started_ns != 0) {
            let transport = segment.as_ref().map(|s| s.link.kind());
            let metrics = &shared.metrics;
            metrics.part(op, transport, ticket.progress.bytes);
            if let Some(completion) = &finished {
                let latency = config.clock.now_ns().saturating_sub(ticket.started_ns);
                metrics.batch(op, transport, completion.result, latency);
            }
        }
        if let Some(completion) = finished {
            let cqe = Cqe {
                user_data: sqe.user_data,
                batch_id: sqe.batch_id,
                bytes: completion.bytes,
                result: completion.result,
                kind: CqeKind::Batch as u32,
            };
            if slot.rings.cq.push(cqe).is_err() {
                cq_backlog.push_back((ticket.ring, cqe));
            }
        }
    }
}

/// Counts a chunk in flight on `link`, so the lane polls it.
fn activate(active: &mut Vec<ActiveLink>, link: &Arc<dyn Link>) {
    match active.iter_mut().find(|a| same_link(&a.link, link)) {
        Some(entry) => entry.chunks += 1,
        None => active.push(ActiveLink { link: link.clone(), chunks: 1 }),
    }
}

/// Counts a chunk of `link` ended; a link with none left is not polled.
fn deactivate(active: &mut Vec<ActiveLink>, link: &Arc<dyn Link>) {
    if let Some(position) = active.iter().position(|a| same_link(&a.link, link)) {
        active[position].chunks -= 1;
        if active[position].chunks == 0 {
            active.swap_remove(position);
        }
    }
}

fn same_link(a: &Arc<dyn Link>, b: &Arc<dyn Link>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// Bytes and descriptors a part has moved so far.
#[derive(Debug, Default, Clone, Copy)]
struct PartProgress {
    bytes: u64,
    executed: u64,
}

/// Hands a part's chunks to its link.
struct Poster<'a> {
    lane: usize,
    ticket_index: u32,
    id: super::status::BatchId,
    registry: &'a Registry,
    chunk: &'a mut Vec<Block>,
    ended_runs: &'a mut Vec<RegionId>,
    active: &'a mut Vec<ActiveLink>,
}

impl Poster<'_> {
    /// Transfers the chunk; releases the leases of the runs that ended in it
    /// once it has ended (now, or when the part ends if any chunk of it is
    /// in flight).
    fn flush(&mut self, ticket: &mut Ticket, segment: &LaneSegment, op: Opcode) {
        if self.chunk.is_empty() {
            return;
        }
        let (batch_id, ticket_id) = (self.id.raw(), self.ticket_index as u64);
        // SAFETY: every block was validated against a region this part holds a lease on
        // (`validate`); the leases are released only after the chunk ended (below, or in `end_ticket`).
        let posted = unsafe { segment.link.transfer(self.lane, op, batch_id, ticket_id, self.chunk) };
        ticket.progress.executed += self.chunk.len() as u64;
        self.chunk.clear();
        match posted {
            Posted::Done(bytes) => ticket.progress.bytes += bytes,
            Posted::Failed((error, bytes)) => {
                ticket.progress.bytes += bytes;
                ticket.end.get_or_insert(PartEnd::Failed(error));
            }
            Posted::InFlight => {
                ticket.outstanding += 1;
                activate(self.active, &segment.link);
            }
        }
        if ticket.outstanding > 0 {
            ticket.leases.append(self.ended_runs);
        } else {
            for region in self.ended_runs.drain(..) {
                self.registry.release(region);
            }
        }
    }
}

/// A CQE's result: 0 for done, else the negated wire code of the outcome.
fn result_code(state: BatchState, failure: Option<&Error>) -> i32 {
    let code = match (state, failure) {
        (_, Some(error)) => error.code(),
        (BatchState::TimedOut, None) => ErrorCode::Timeout,
        (BatchState::Cancelled, None) => ErrorCode::Cancelled,
        (BatchState::Done | BatchState::Failed | BatchState::Free | BatchState::Pending, None) => return 0,
    };
    -(code as i32)
}

/// Checks a descriptor's local range against the leased registry entry and
/// its remote range against the peer's descriptor; returns the local address.
#[inline]
fn validate(
    registry: &Registry,
    segment: &LaneSegment,
    desc: &BlockDesc,
    desc_index: u32,
    local_needs: Access,
    remote_needs: Access,
) -> Result<*mut u8> {
    let local = registry.leased(desc.local_region)?;
    let local_addr =
        local.check(desc.local_region, Side::Local, desc_index, desc.local_offset, desc.len, local_needs)?;
    segment.peer.region(desc.remote_region)?.check(desc_index, desc.remote_offset, desc.len, remote_needs)?;
    Ok(local_addr as *mut u8)
}
