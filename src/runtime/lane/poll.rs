//! The lane's loop: take commands, poll the links with chunks in flight,
//! drain the submission rings, announce notifications; busy-poll while
//! there is work or was lately, then park on the doorbell.

use super::execute::Ticket;
use super::links::{acknowledge, Links};
use super::shared::{LaneCommand, LaneConfig, LaneShared, SubmitterRings};
use super::{MAX_CHUNK_BLOCKS, MAX_TICKETS};
use crate::desc::RegionId;
use crate::mem::Registry;
use crate::ring::{Cqe, CqeKind};
use crate::transport::{Block, ChunkEnd};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most SQEs a lane takes from one ring before visiting the next.
const MAX_SQES_PER_POLL: usize = 32;
/// Longest a lane parks while chunks are in flight: replies wake no
/// doorbell, so it looks again this often.
const IN_FLIGHT_PARK: Duration = Duration::from_micros(200);
/// How long a stopping lane waits for its chunks in flight to end before it
/// aborts them (their connections closed, their batches failed).
const STOP_GRACE: Duration = Duration::from_secs(2);
/// Rounds between deadline checks of parts in flight.
const DEADLINE_CHECK_ROUNDS: u32 = 256;

/// A lane's state, owned by its thread.
pub(super) struct Lane {
    pub shared: Arc<LaneShared>,
    pub registry: Arc<Registry>,
    /// Submitters' rings by stable slot (a slot is emptied, never shifted,
    /// because tickets in flight name it).
    pub rings: Vec<Option<RingSlot>>,
    /// The links this lane owns, by segment key.
    pub links: Links,
    /// CQEs that found their ring full. By construction (a completion ring
    /// has room for every unconsumed batch) this stays empty; it exists so a
    /// broken invariant delays a completion instead of losing it.
    pub cq_backlog: VecDeque<(usize, Cqe)>,
    /// Validated blocks of the chunk being built (preallocated).
    pub chunk: Vec<Block>,
    /// Regions whose runs ended in the chunk being built: their leases are
    /// released once the chunk has ended.
    pub ended_runs: Vec<RegionId>,
    /// Parts and notifications being executed, by ticket (preallocated).
    pub tickets: Vec<Ticket>,
    pub free_tickets: Vec<u32>,
    /// Chunks links reported ended (reused buffer).
    pub ended: Vec<ChunkEnd>,
    /// Local copy of the peak-in-flight counter (no atomic read per part).
    pub peak_in_flight: u64,
    /// Notification deliveries already announced to watchers.
    seen_notifications: u64,
    pub config: LaneConfig,
}

/// One submitter's rings and the lane's count of its tickets.
pub(super) struct RingSlot {
    pub rings: SubmitterRings,
    /// Tickets of this ring not yet ended.
    pub tickets: u32,
}

impl Lane {
    /// A lane with every table preallocated.
    pub fn new(config: LaneConfig, shared: Arc<LaneShared>, registry: Arc<Registry>) -> Self {
        Self {
            links: Links::new(config.max_segments),
            shared,
            registry,
            rings: Vec::new(),
            cq_backlog: VecDeque::new(),
            chunk: Vec::with_capacity(MAX_CHUNK_BLOCKS),
            ended_runs: Vec::with_capacity(MAX_CHUNK_BLOCKS),
            tickets: (0..MAX_TICKETS).map(|_| Ticket::new()).collect(),
            free_tickets: (0..MAX_TICKETS as u32).rev().collect(),
            ended: Vec::with_capacity(MAX_TICKETS),
            peak_in_flight: 0,
            seen_notifications: 0,
            config,
        }
    }

    pub async fn run(mut self) {
        let mut idle_since: Option<Instant> = None;
        let mut stopping_since: Option<Instant> = None;
        let mut rounds: u32 = 0;
        loop {
            let commands = self.take_commands();
            let worked = self.poll_links() + self.poll_rings() + self.announce_notifications() + commands;
            if self.free_tickets.len() < self.tickets.len()
                && (worked == 0 || rounds.is_multiple_of(DEADLINE_CHECK_ROUNDS))
            {
                self.expire_in_flight();
            }
            if worked > 0 {
                idle_since = None;
            } else if self.shared.stopping() {
                let since = *stopping_since.get_or_insert_with(Instant::now);
                if self.drained() {
                    break;
                }
                if since.elapsed() > STOP_GRACE {
                    // A peer that trickles replies (or none) must not hold
                    // the engine's drop: end what is still in flight.
                    self.abort_all("the engine stopped");
                    if since.elapsed() > 2 * STOP_GRACE {
                        break;
                    }
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
                    // this core (often the very peer, on loopback) run. A
                    // GPU's copies need no thread: keep polling their events.
                    Some(_) if self.links.any_waiting_on_peers() => std::thread::yield_now(),
                    Some(_) => std::hint::spin_loop(),
                }
            }
            rounds = rounds.wrapping_add(1);
            if rounds.is_multiple_of(64) {
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
        let timeout = if self.links.any_active() {
            self.config.park_timeout.min(IN_FLIGHT_PARK)
        } else {
            self.config.park_timeout
        };
        let rings = &mut self.rings;
        let notifications = self.config.notifications.as_deref();
        let seen = self.seen_notifications;
        let parked = shared.doorbell.park(timeout, || {
            !shared.commands.is_empty()
                || notifications.is_some_and(|queue| queue.delivered() != seen)
                || shared.stopping()
                || rings.iter_mut().flatten().any(|r| !r.rings.sq.is_empty())
        });
        if parked {
            shared.metrics.parked();
        }
    }

    /// Takes every queued command; returns how many.
    pub fn take_commands(&mut self) -> usize {
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
                LaneCommand::AttachSegment { key, peer, state, link } => {
                    self.links.attach(key, peer, state, link, &mut self.ended)
                }
                LaneCommand::DetachSegment { key, done } => {
                    self.links.detach(key, &mut self.ended);
                    acknowledge(done);
                }
                LaneCommand::Notify { key, payload, reply } => self.post_notification(key, payload, reply),
            }
        }
        if !self.ended.is_empty() {
            self.end_reported();
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

    /// One pass over every submitter's ring. Returns SQEs taken.
    fn poll_rings(&mut self) -> usize {
        self.flush_cq_backlog();
        let mut executed = 0;
        let mut waiting = 0;
        for index in 0..self.rings.len() {
            let Some(slot) = self.rings[index].as_mut() else { continue };
            let slots = slot.rings.sq.slots();
            waiting += slots;
            let available = slots.min(MAX_SQES_PER_POLL);
            if available == 0 {
                if slot.rings.closed.load(Ordering::Acquire) && slot.rings.sq.is_empty() && slot.tickets == 0 {
                    self.rings[index] = None;
                }
                continue;
            }
            for _ in 0..available {
                // Checked before each pop, not once: executing a part can
                // run lane commands (a notification takes a ticket too), and
                // an SQE taken without a ticket would be lost with its
                // descriptors still in the arena.
                if self.free_tickets.is_empty() {
                    break;
                }
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
        if !self.links.any_active() {
            return 0;
        }
        let progressed = self.links.poll_active(&mut self.ended);
        self.end_reported();
        progressed
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
            ticket.end.get_or_insert(super::super::status::PartEnd::TimedOut);
            if let Some(link) = ticket.link {
                if self.links.get(link).link.ends_on_its_own() {
                    // Its chunks end when their copies do (they cannot be
                    // recalled); the part then ends TimedOut, with nothing
                    // of it still writing the caller's memory.
                    continue;
                }
                let reason = format!(
                    "batch {:#x} passed its deadline with blocks in flight, so its connection was closed",
                    ticket.sqe.batch_id
                );
                let slot = self.links.get_mut(link);
                slot.link.abort(&reason, &mut self.ended);
                slot.peer.mark_stale();
            }
        }
        self.end_reported();
    }

    /// Ends everything in flight (the lane is exiting).
    fn abort_all(&mut self, reason: &str) {
        self.links.abort_all(reason, &mut self.ended);
        self.end_reported();
    }
}
