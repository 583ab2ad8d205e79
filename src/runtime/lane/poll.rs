//! The lane's loop: take commands, poll the links with chunks in flight,
//! serve the target connections the poller says are ready, drain the
//! submission rings, announce notifications; busy-poll while there is work
//! or was lately, then sleep in the poller until the doorbell, a served
//! connection or a link's socket wakes it.

use super::execute::Ticket;
use super::links::{acknowledge, Links};
use super::shared::{LaneCommand, LaneConfig, LaneShared, SubmitterRings};
use super::{MAX_CHUNK_BLOCKS, MAX_TICKETS};
use crate::desc::RegionId;
use crate::mem::Registry;
use crate::ring::{Cqe, CqeKind};
use crate::transport::{Block, ChunkEnd, Service, LINK_KEY_BASE};
use mio::{Events, Poll};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most SQEs a lane takes from one ring before visiting the next.
const MAX_SQES_PER_POLL: usize = 32;
/// Longest a lane parks while chunks are in flight on a link whose
/// progress no socket announces (a GPU's copies): it looks again this often.
const IN_FLIGHT_PARK: Duration = Duration::from_micros(200);
/// Longest between two looks at the served connections' deadlines (a frame
/// started after a look gets its deadline checked within this).
const TICK_CAP: Duration = Duration::from_secs(1);
/// How soon after a connection is adopted the deadlines are looked at (a
/// burst of adoptions is looked at once).
const ADOPT_TICK: Duration = Duration::from_millis(100);
/// Readiness events taken per poll.
const EVENTS_PER_POLL: usize = 256;
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
    /// No part in flight passes its deadline before this (clock ns;
    /// `u64::MAX`: none has one); lowered as parts start, recomputed by
    /// the scan that finds it passed.
    pub next_expiry_ns: u64,
    pub config: LaneConfig,
    /// Where the lane sleeps, and what wakes it: its doorbell, its
    /// service's connections, its links' sockets.
    pub poller: Poll,
    events: Events,
    /// The target connections this lane serves, if it serves any.
    pub service: Option<Box<dyn Service>>,
    /// The target's receive completions this lane polls, if any.
    pub receiver: Option<Box<dyn crate::transport::Receiver>>,
    /// When the service next needs its deadlines looked at.
    pub next_tick: Option<Instant>,
}

/// What the loop carries from one round to the next.
#[derive(Default)]
pub(super) struct RoundState {
    /// Since when nothing was done (busy-poll window).
    idle_since: Option<Instant>,
    /// Since when the lane was asked to stop with work left.
    stopping_since: Option<Instant>,
    rounds: u32,
}

/// One submitter's rings and the lane's count of its tickets.
pub(super) struct RingSlot {
    pub rings: SubmitterRings,
    /// Tickets of this ring not yet ended.
    pub tickets: u32,
    /// The submitter's cancel count when this lane last looked.
    pub cancels_seen: u64,
}

impl Lane {
    /// A lane with every table preallocated.
    pub fn new(config: LaneConfig, shared: Arc<LaneShared>, registry: Arc<Registry>, poller: Poll) -> Self {
        // A lane whose poller's registry cannot be shared still serves its
        // links: their replies are then found by polling alone.
        let link_registry = poller.registry().try_clone().ok();
        Self {
            links: Links::new(config.max_segments, link_registry),
            poller,
            events: Events::with_capacity(EVENTS_PER_POLL),
            service: None,
            receiver: None,
            next_tick: None,
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
            next_expiry_ns: u64::MAX,
            config,
        }
    }

    /// The lane's loop. A panic anywhere in a round is caught here: the
    /// lane then ends what it holds with [`Error::LaneDied`] and only
    /// refuses work from then on (`death.rs`).
    ///
    /// [`Error::LaneDied`]: crate::Error::LaneDied
    pub fn run(mut self) {
        let mut state = RoundState::default();
        loop {
            // The lane's state after a panic is whatever the round left:
            // `die` trusts none of it beyond what each ticket says it holds.
            match catch_unwind(AssertUnwindSafe(|| self.round(&mut state))) {
                Ok(true) => {}
                Ok(false) => break,
                Err(payload) => return self.die_and_refuse(payload),
            }
            state.rounds = state.rounds.wrapping_add(1);
        }
        let finished = catch_unwind(AssertUnwindSafe(|| {
            self.abort_all("the lane stopped");
            if let Some(service) = self.service.as_mut() {
                // Peers see the engine gone at once.
                service.close_all(self.poller.registry());
            }
        }));
        if let Err(payload) = finished {
            self.die_and_refuse(payload);
        }
    }

    /// One round of the loop; false once the lane should exit.
    fn round(&mut self, state: &mut RoundState) -> bool {
        let commands = self.take_commands();
        let served = if self.serving() { self.poll_io(Some(Duration::ZERO)) } else { 0 };
        let worked = self.poll_links()
            + self.poll_rings()
            + self.announce_notifications()
            + self.poll_receiver()
            + commands
            + served;
        let rounds = state.rounds;
        if self.free_tickets.len() < self.tickets.len() {
            self.cancel_in_flight();
            if worked == 0 || rounds.is_multiple_of(DEADLINE_CHECK_ROUNDS) {
                self.expire_in_flight();
            }
        }
        if self.next_tick.is_some() && (worked == 0 || rounds.is_multiple_of(DEADLINE_CHECK_ROUNDS)) {
            self.tick_service();
        }
        if worked > 0 {
            state.idle_since = None;
        } else if self.shared.stopping() {
            let since = *state.stopping_since.get_or_insert_with(Instant::now);
            if self.drained() {
                return false;
            }
            if since.elapsed() > STOP_GRACE {
                // A peer that trickles replies (or none) must not hold
                // the engine's drop: end what is still in flight.
                self.abort_all("the engine stopped");
                if since.elapsed() > 2 * STOP_GRACE {
                    return false;
                }
            }
        } else {
            let now = Instant::now();
            match state.idle_since {
                None => state.idle_since = Some(now),
                Some(since) if now - since >= self.config.busy_poll => {
                    // Still idle unless what woke it brought work: a
                    // timeout or a stray wake parks again at once rather
                    // than spinning a whole window (an idle lane costs
                    // nothing).
                    if self.arm_receiver() || self.park() > 0 {
                        state.idle_since = None;
                    }
                }
                // Waiting only on a GPU's copies, which need no thread:
                // keep polling their events.
                Some(_) if self.links.any_active() && !self.links.any_waiting_on_peers() => std::hint::spin_loop(),
                // Waiting on peers' replies, or on nothing in the busy
                // window: let a thread that shares this core run (often
                // the very peer on loopback, or the caller waiting on
                // this lane's completion); with none, yielding returns
                // at once and the lane keeps polling.
                Some(_) => std::thread::yield_now(),
            }
        }
        true
    }

    fn drained(&mut self) -> bool {
        self.cq_backlog.is_empty()
            && self.free_tickets.len() == self.tickets.len()
            && self.rings.iter_mut().flatten().all(|r| r.rings.sq.is_empty())
    }

    /// Sleeps in the poller until the doorbell rings, a served connection
    /// or a link's socket is ready, or the next deadline (a tick of the
    /// served connections, a part in flight); returns the work done on what
    /// woke it.
    pub(super) fn park(&mut self) -> usize {
        let timeout = self.park_timeout();
        let Lane { shared, poller, events, rings, config, seen_notifications, .. } = self;
        let notifications = config.notifications.as_deref();
        let seen = *seen_notifications;
        let parked = shared.doorbell.park_with(
            timeout,
            || {
                !shared.commands.is_empty()
                    || notifications.is_some_and(|queue| queue.delivered() != seen)
                    || shared.stopping()
                    || rings.iter_mut().flatten().any(|r| !r.rings.sq.is_empty())
            },
            |timeout| {
                let _ = poller.poll(events, Some(timeout));
            },
        );
        if parked {
            self.shared.metrics.parked();
        }
        self.serve_events()
    }

    /// How long the lane may sleep: the park timeout (a safety net), but no
    /// later than its next deadline: the service's next tick, the earliest
    /// deadline of a part in flight, and a short look while a link with
    /// chunks in flight has no socket to wake it.
    fn park_timeout(&self) -> Duration {
        let now = Instant::now();
        let mut timeout = self.config.park_timeout;
        if self.links.any_active_without_wake() || self.service.as_ref().is_some_and(|s| s.waiting_on_copies()) {
            timeout = timeout.min(IN_FLIGHT_PARK);
        }
        if let Some(at) = self.next_tick {
            timeout = timeout.min(at.saturating_duration_since(now));
        }
        let clock_now = self.config.clock.now_ns();
        let earliest = self
            .tickets
            .iter()
            .filter(|t| t.outstanding > 0 && t.sqe.deadline_ns != 0)
            .map(|t| t.sqe.deadline_ns)
            .min();
        if let Some(deadline) = earliest {
            timeout = timeout.min(Duration::from_nanos(deadline.saturating_sub(clock_now)));
        }
        timeout
    }

    /// True when the lane serves connections: its busy loop then polls
    /// their readiness each round.
    fn serving(&self) -> bool {
        self.next_tick.is_some()
    }

    /// Takes what is ready now (or within `timeout`) and serves it.
    fn poll_io(&mut self, timeout: Option<Duration>) -> usize {
        if self.poller.poll(&mut self.events, timeout).is_err() {
            return 0;
        }
        self.serve_events()
    }

    /// Serves the readiness events taken: the service's connections (a
    /// link's socket only woke the lane, whose loop polls the link).
    fn serve_events(&mut self) -> usize {
        let Lane { service, events, poller, .. } = self;
        let Some(service) = service.as_mut() else { return 0 };
        let now = Instant::now();
        let mut worked = usize::from(service.drive_again(poller.registry(), now));
        for event in events.iter().filter(|e| e.token().0 < LINK_KEY_BASE) {
            worked += usize::from(service.ready(poller.registry(), event.token().0, now));
        }
        worked
    }

    /// Looks at the served connections' deadlines when it is time to.
    fn tick_service(&mut self) {
        let now = Instant::now();
        if self.next_tick.is_some_and(|at| now < at) {
            return;
        }
        let Some(service) = self.service.as_mut() else { return };
        self.next_tick = service.tick(self.poller.registry(), now).map(|next| next.min(now + TICK_CAP));
    }

    /// Takes every queued command; returns how many.
    pub fn take_commands(&mut self) -> usize {
        let mut taken = 0;
        while let Some(command) = self.shared.commands.pop() {
            taken += 1;
            if self.shared.death.get().is_some() {
                self.dead_command(command);
                continue;
            }
            match command {
                LaneCommand::AttachSubmitter(rings) => self.attach_submitter(*rings),
                LaneCommand::AttachSegment { key, peer, state, link } => {
                    self.links.attach(key, peer, state, link, &mut self.ended)
                }
                LaneCommand::DetachSegment { key, done } => {
                    self.links.detach(key, &mut self.ended);
                    acknowledge(done);
                }
                LaneCommand::Notify { key, payload, reply } => self.post_notification(key, payload, reply),
                LaneCommand::Serve(service) => self.service = Some(service),
                LaneCommand::Receive(receiver) => self.adopt_receiver(receiver),
                LaneCommand::Adopt { stream, id } => {
                    // Without a service the stream is dropped: closed.
                    if let Some(service) = self.service.as_mut() {
                        let now = Instant::now();
                        service.adopt(self.poller.registry(), stream, id, now);
                        let soon = now + ADOPT_TICK;
                        self.next_tick = Some(self.next_tick.map_or(soon, |at| at.min(soon)));
                    }
                }
                LaneCommand::Evict { id, too_late } => {
                    if let Some(service) = self.service.as_mut() {
                        service.evict(self.poller.registry(), id, too_late);
                    }
                }
            }
        }
        if !self.ended.is_empty() {
            self.end_reported();
        }
        taken
    }

    /// Takes a new submitter's rings into a free slot.
    pub(super) fn attach_submitter(&mut self, rings: SubmitterRings) {
        let slot = RingSlot { rings, tickets: 0, cancels_seen: 0 };
        match self.rings.iter_mut().find(|r| r.is_none()) {
            Some(free) => *free = Some(slot),
            None => self.rings.push(Some(slot)),
        }
    }

    /// Posts one notification CQE to each watching submitter that has none
    /// pending, when deliveries happened since the last look.
    pub(super) fn announce_notifications(&mut self) -> usize {
        let Some(queue) = &self.config.notifications else { return 0 };
        if !queue.deliveries().changed_since(&mut self.seen_notifications) {
            return 0;
        }
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

    pub(super) fn flush_cq_backlog(&mut self) {
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
        // Scanned only once the earliest deadline in flight has passed, so a
        // lane waiting on replies does not walk its tickets every round.
        if now <= self.next_expiry_ns {
            return;
        }
        self.next_expiry_ns = u64::MAX;
        for index in 0..self.tickets.len() {
            let ticket = &mut self.tickets[index];
            let expired = ticket.outstanding > 0
                && ticket.notify_reply.is_none()
                && ticket.sqe.deadline_ns != 0
                && now > ticket.sqe.deadline_ns;
            if !expired {
                if ticket.outstanding > 0 && ticket.sqe.deadline_ns != 0 && ticket.end.is_none() {
                    self.next_expiry_ns = self.next_expiry_ns.min(ticket.sqe.deadline_ns);
                }
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
                let outstanding = ticket.outstanding as usize;
                let batch_id = ticket.sqe.batch_id;
                let slot = self.links.get_mut(link);
                // Chunks that have not left (waiting for staging pages) are
                // simply dropped; only bytes already on their way force the
                // connection closed.
                if slot.link.withdraw(index as u64, &mut self.ended) == outstanding {
                    continue;
                }
                let reason = format!(
                    "batch {batch_id:#x} passed its deadline with blocks in flight, so its connection was closed"
                );
                slot.link.abort(&reason, &mut self.ended);
                slot.peer.mark_stale();
            }
        }
        self.end_reported();
    }

    /// Ends the parts in flight whose batch was cancelled: the chunks that
    /// have not left are withdrawn at once; those already on their way end
    /// through their replies (or their copies), so the part ends
    /// `Cancelled` only when nothing of it can still touch the caller's
    /// memory. One atomic load per ring while nobody cancels.
    fn cancel_in_flight(&mut self) {
        for ring_index in 0..self.rings.len() {
            let Some(slot) = self.rings[ring_index].as_mut() else { continue };
            let requested = slot.rings.status.cancels_requested();
            if requested == slot.cancels_seen || slot.tickets == 0 {
                slot.cancels_seen = requested;
                continue;
            }
            slot.cancels_seen = requested;
            let status = std::sync::Arc::clone(&slot.rings.status);
            for index in 0..self.tickets.len() {
                let ticket = &mut self.tickets[index];
                if ticket.ring != ring_index
                    || ticket.outstanding == 0
                    || ticket.notify_reply.is_some()
                    || ticket.end.is_some()
                    || !status.cancel_requested(super::super::status::BatchId::from_raw(ticket.sqe.batch_id))
                {
                    continue;
                }
                // Only a part that lost chunks to the cancel ends Cancelled:
                // one whose every chunk had left ends as its chunks do (the
                // cancel came too late to save anything).
                let Some(link) = ticket.link else { continue };
                if self.links.get_mut(link).link.withdraw(index as u64, &mut self.ended) > 0 {
                    self.tickets[index].end = Some(super::super::status::PartEnd::Cancelled);
                }
            }
        }
        self.end_reported();
    }

    /// Ends everything in flight (the lane is exiting).
    pub(super) fn abort_all(&mut self, reason: &str) {
        self.links.abort_all(reason, &mut self.ended);
        self.end_reported();
    }
}
