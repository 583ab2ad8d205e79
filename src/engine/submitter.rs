//! The per-thread producer: submission rings, descriptor arenas, the status
//! table, and the completion rings it reaps.

use super::batch::{Batch, Completion, Event, Outcome};
use super::segment::Segment;
use super::EngineInner;
use crate::desc::{BlockDesc, RegionId};
use crate::error::{Error, Result, Side};
use crate::kv::KvLayout;
use crate::ring::Opcode;
use crate::ring::{channel, Consumer, Cqe, CqeKind, Producer, Sqe};
use crate::runtime::backoff::{Backoff, Snooze};
use crate::runtime::lane::{LaneCommand, LaneShared, SubmitterRings};
use crate::runtime::status::{BatchState, Finished, IdError, StatusTable};
use crate::runtime::watch::NotificationWatch;
use crate::runtime::BatchId;
use crate::transport::TransportKind;
use std::cell::Cell;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most lanes an engine may run (a batch splits into at most this many parts).
pub const MAX_LANES: usize = 64;

struct SubmitterLane {
    sq: Producer<Sqe>,
    descs: Producer<BlockDesc>,
    cq: Consumer<Cqe>,
    lane: Arc<LaneShared>,
    /// Descriptors pushed so far: the arena position of the next one.
    desc_position: u64,
}

/// A per-thread submitter: `Send`, not `Sync`, so one thread at a time owns
/// its rings. Make one per submitting thread with [`Engine::submitter`].
///
/// ```no_run
/// # fn demo(engine: &kvring::Engine, segment: &kvring::Segment, local: kvring::RegionId) -> kvring::Result<()> {
/// use kvring::{Batch, BlockDesc};
/// use std::time::Duration;
/// let mut sub = engine.submitter()?;
/// let descs = [BlockDesc::new(local, 0, segment.region(0)?, 0, 4096)];
/// let id = sub.submit(&Batch::write(segment).descs(&descs))?;
/// let outcome = sub.wait(id, Duration::from_secs(1))?;
/// assert!(outcome.is_done());
/// # Ok(()) }
/// ```
///
/// [`Engine::submitter`]: crate::Engine::submitter
pub struct Submitter {
    engine: Arc<EngineInner>,
    lanes: Vec<SubmitterLane>,
    status: Arc<StatusTable<Error>>,
    free_slots: Vec<u16>,
    /// The transport of the segment each slot's batch was submitted to,
    /// kept until the slot is reused: what carried the batch.
    slot_transports: Vec<TransportKind>,
    /// CQEs taken off the rings by `wait` but not yet reaped.
    pending: VecDeque<Cqe>,
    next_lane: usize,
    closed: Arc<AtomicBool>,
    watch: Arc<NotificationWatch>,
    /// A notification CQE was reaped: poll the engine's queue until empty.
    notifications_ready: bool,
    _not_sync: PhantomData<Cell<()>>,
}

impl std::fmt::Debug for Submitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submitter")
            .field("lanes", &self.lanes.len())
            .field("in_flight", &(self.status.capacity() - self.free_slots.len()))
            .finish()
    }
}

impl Submitter {
    pub(crate) fn new(engine: Arc<EngineInner>, tag: u16) -> Self {
        let config = &engine.config;
        let status = Arc::new(StatusTable::new(config.max_batches_in_flight, tag));
        let capacity = status.capacity();
        let closed = Arc::new(AtomicBool::new(false));
        let watch = Arc::new(NotificationWatch::default());
        let lanes = engine
            .lanes
            .iter()
            .map(|handle| {
                let (sq, sq_rx) = channel(config.ring_depth);
                let (descs, descs_rx) = channel(config.arena_descs);
                // Room for every batch not yet consumed, plus one in transit
                // per lane: a lane never finds this ring full (see lane.rs).
                let (cq_tx, cq) = channel(capacity + MAX_LANES);
                handle.shared.send(LaneCommand::AttachSubmitter(Box::new(SubmitterRings {
                    sq: sq_rx,
                    descs: descs_rx,
                    cq: cq_tx,
                    status: status.clone(),
                    closed: closed.clone(),
                    watch: watch.clone(),
                })));
                SubmitterLane { sq, descs, cq, lane: handle.shared.clone(), desc_position: 0 }
            })
            .collect();
        Self {
            lanes,
            free_slots: (0..capacity as u16).rev().collect(),
            slot_transports: vec![TransportKind::Null; capacity],
            pending: VecDeque::with_capacity(capacity + MAX_LANES),
            status,
            next_lane: tag as usize,
            closed,
            watch,
            notifications_ready: false,
            engine,
            _not_sync: PhantomData,
        }
    }

    /// A handle any thread can use to read this submitter's batch states.
    pub fn status_reader(&self) -> StatusReader {
        StatusReader { table: self.status.clone() }
    }

    /// Batches submitted and not yet consumed by `wait` or `reap`.
    pub fn in_flight(&self) -> usize {
        self.status.capacity() - self.free_slots.len()
    }

    /// Queues a batch. Large batches are split across lanes by bytes. A full
    /// ring, arena or status table is back-pressure: `Error::Busy`, nothing
    /// queued, and the batch is still the caller's to resubmit.
    ///
    /// ```no_run
    /// # fn demo(sub: &mut kvring::Submitter, batch: &kvring::Batch<'_>) -> kvring::Result<()> {
    /// let id = loop {
    ///     match sub.submit(batch) {
    ///         Ok(id) => break id,
    ///         // Make room: consume a finished batch, then resubmit.
    ///         Err(kvring::Error::Busy { .. }) => { let _ = sub.reap(); }
    ///         Err(e) => return Err(e),
    ///     }
    /// };
    /// # Ok(()) }
    /// ```
    pub fn submit(&mut self, batch: &Batch<'_>) -> Result<BatchId> {
        if self.engine.is_stopped() {
            return Err(Error::Shutdown);
        }
        let descs: &[BlockDesc] = &batch.descs;
        let segment = &batch.segment.inner;
        if segment.owner_epoch != self.engine.epoch {
            return Err(Error::invalid("segment", "handle was opened by another engine"));
        }
        if descs.is_empty() {
            return Err(Error::invalid("batch", "no descriptors"));
        }
        let arena = self.engine.config.arena_descs;
        if descs.len() > arena {
            return Err(Error::invalid(
                "batch",
                format!("{} descriptors exceed the per-lane arena of {arena}", descs.len()),
            ));
        }
        let mut parts = [(0usize, 0usize, 0usize); MAX_LANES];
        let part_count = self.plan_parts(descs, &mut parts)?;
        let parts = &parts[..part_count];

        // First: a dead lane's abort also leaves its peers' handles stale,
        // and the lane, not the peer, is what the caller must hear about.
        if let Some(dead) = parts.iter().find_map(|&(lane, _, _)| self.lanes[lane].lane.died()) {
            return Err(dead);
        }
        if segment.peer.is_stale() {
            return Err(Error::PeerRestarted {
                segment: segment.opened_as.clone(),
                detail: "an earlier batch found it gone; open it again to reconnect".into(),
            });
        }
        if segment.peer.is_closed() {
            return Err(Error::UnknownSegment { segment: segment.opened_as.clone() });
        }
        if self.free_slots.is_empty() {
            return Err(Error::Busy { queue: "batch status table", capacity: self.status.capacity() });
        }
        for &(lane, start, end) in parts {
            let lane = &mut self.lanes[lane];
            if !lane.sq.has_room(1) {
                return Err(Error::Busy { queue: "submission ring", capacity: lane.sq.capacity() });
            }
            if !lane.descs.has_room(end - start) {
                return Err(Error::Busy { queue: "descriptor arena", capacity: lane.descs.capacity() });
            }
        }
        self.lease_parts(descs, parts)?;

        let slot = self.free_slots.pop().expect("checked non-empty above");
        let id = self.status.begin(slot, part_count as u32);
        self.slot_transports[slot as usize] = segment.transport;
        let deadline_ns = batch.deadline.map_or(0, |d| self.engine.clock.deadline_ns(d));
        for &(lane_index, start, end) in parts {
            let lane = &mut self.lanes[lane_index];
            let count = end - start;
            let mut chunk = lane.descs.write_chunk(count).expect("room checked above");
            for desc in &descs[start..end] {
                let _ = chunk.push(*desc);
            }
            chunk.commit();
            let sqe = Sqe {
                user_data: batch.user_data,
                batch_id: id.raw(),
                deadline_ns,
                desc_position: lane.desc_position,
                desc_count: count as u32,
                segment: segment.key,
                desc_base: start as u32,
                opcode: batch.opcode as u8,
                flags: if batch.checksum.unwrap_or(self.engine.config.checksum) {
                    crate::ring::SQE_FLAG_CHECKSUM
                } else {
                    0
                },
                _reserved: [0; 2],
                arrival_tag: batch.arrival_tag,
                grant: batch.grant,
            };
            lane.desc_position += count as u64;
            // Room checked above; this submitter is the ring's only producer.
            let _ = lane.sq.push(sqe);
            lane.lane.doorbell.ring();
        }
        Ok(id)
    }

    /// Splits a batch into `(lane, start, end)` parts: by bytes across lanes
    /// when it is large, else whole on the next lane in turn.
    fn plan_parts(&mut self, descs: &[BlockDesc], parts: &mut [(usize, usize, usize); MAX_LANES]) -> Result<usize> {
        let lanes = self.lanes.len();
        let mut total: u64 = 0;
        for (index, desc) in descs.iter().enumerate() {
            if desc.len == 0 {
                return Err(Error::invalid("descriptor", format!("descriptor {index} has zero length")));
            }
            total = total.checked_add(desc.len).ok_or(Error::LengthOverflow {
                desc_index: index as u32,
                side: Side::Local,
                offset: total,
                len: desc.len,
            })?;
        }
        let first_lane = self.next_lane % lanes;
        self.next_lane = self.next_lane.wrapping_add(1);
        if lanes == 1 || descs.len() == 1 || total < self.engine.config.split_threshold_bytes {
            parts[0] = (first_lane, 0, descs.len());
            return Ok(1);
        }
        let want = lanes.min(descs.len());
        let share = total.div_ceil(want as u64);
        let (mut count, mut start, mut acc) = (0, 0, 0u64);
        for (index, desc) in descs.iter().enumerate() {
            acc += desc.len;
            let last = index + 1 == descs.len();
            if acc >= share * (count as u64 + 1) || last {
                parts[count] = ((first_lane + count) % lanes, start, index + 1);
                count += 1;
                start = index + 1;
                if count == want - 1 && !last {
                    parts[count] = ((first_lane + count) % lanes, start, descs.len());
                    return Ok(count + 1);
                }
            }
        }
        Ok(count)
    }

    /// Takes a lease on each run of equal local regions in each part, as
    /// the lanes release them; on failure releases what it took.
    fn lease_parts(&self, descs: &[BlockDesc], parts: &[(usize, usize, usize)]) -> Result<()> {
        let registry = &self.engine.registry;
        for (taken, region) in lease_runs(descs, parts).enumerate() {
            // Each lease travels with its part to the lane, which gives it
            // back once the part's chunks have ended.
            // A peer's checksum holds the region only while it reads: the
            // owner's batch waits for it rather than failing.
            let leased = registry.lease_after_read(region, std::time::Duration::from_secs(10));
            if let Err(error) = leased.map(|lease| lease.keep()) {
                for region in lease_runs(descs, parts).take(taken) {
                    // SAFETY: kept just above by this call, and not yet handed to a lane.
                    unsafe { registry.release_kept(region) };
                }
                return Err(error);
            }
        }
        Ok(())
    }

    /// Pushes blocks `src_ids` of every layer of `local` into blocks
    /// `dst_ids` of `remote` on `segment` (prefill → decode), as one batch;
    /// consecutive ids coalesce. Every check of the KV layer
    /// ([`kv::plan_blocks`](crate::kv::plan_blocks)) runs before anything is
    /// queued.
    ///
    /// ```no_run
    /// # fn demo(sub: &mut kvring::Submitter, decode: &kvring::Segment, mine: &kvring::kv::KvLayout) -> kvring::Result<()> {
    /// let theirs = decode.kv_layout(std::time::Duration::from_secs(1))?;
    /// let id = sub.push_blocks(decode, mine, &theirs, &[3, 4, 5, 9], &[0, 1, 2, 3])?;
    /// sub.wait(id, std::time::Duration::from_secs(1))?;
    /// # Ok(()) }
    /// ```
    pub fn push_blocks(
        &mut self,
        segment: &Segment,
        local: &KvLayout,
        remote: &KvLayout,
        src_ids: &[u64],
        dst_ids: &[u64],
    ) -> Result<BatchId> {
        let descs = crate::kv::plan_blocks(local, remote, Opcode::Write, src_ids, dst_ids)?;
        self.submit(&Batch::write(segment).descs(&descs))
    }

    /// Pulls blocks `remote_ids` of every layer of `remote` into blocks
    /// `local_ids` of `local` (decode reads from prefill), as one batch.
    /// The source's ids come first, as in a push; each is named for the
    /// layout it indexes, as [`kv::plan_blocks`](crate::kv::plan_blocks)
    /// names them.
    pub fn pull_blocks(
        &mut self,
        segment: &Segment,
        local: &KvLayout,
        remote: &KvLayout,
        remote_ids: &[u64],
        local_ids: &[u64],
    ) -> Result<BatchId> {
        let descs = crate::kv::plan_blocks(local, remote, Opcode::Read, local_ids, remote_ids)?;
        self.submit(&Batch::read(segment).descs(&descs))
    }

    /// Pushes one layer as soon as prefill has computed it, so the transfer
    /// overlaps the next layer's compute.
    pub fn push_layer(
        &mut self,
        segment: &Segment,
        local: &KvLayout,
        remote: &KvLayout,
        layer: u32,
        src_ids: &[u64],
        dst_ids: &[u64],
    ) -> Result<BatchId> {
        let descs = crate::kv::plan_layer(local, remote, Opcode::Write, layer, src_ids, dst_ids)?;
        self.submit(&Batch::write(segment).descs(&descs))
    }

    /// As [`push_layer`](Self::push_layer), the push tagged for the request
    /// in `request_slot` ([`kv::arrival_tag`](crate::kv::arrival_tag)), so
    /// the target can wait for this layer's bytes with
    /// [`Engine::wait_landed`](crate::Engine::wait_landed) and start it
    /// while later layers are in flight (tcp and rdma).
    #[allow(clippy::too_many_arguments)]
    pub fn push_layer_tagged(
        &mut self,
        segment: &Segment,
        local: &KvLayout,
        remote: &KvLayout,
        layer: u32,
        request_slot: u32,
        src_ids: &[u64],
        dst_ids: &[u64],
    ) -> Result<BatchId> {
        let tag = crate::kv::arrival_tag(request_slot, layer)?;
        let descs = crate::kv::plan_layer(local, remote, Opcode::Write, layer, src_ids, dst_ids)?;
        self.submit(&Batch::write(segment).descs(&descs).arrival_tag(tag))
    }

    /// As [`push_layer_tagged`](Self::push_layer_tagged) between ranks of
    /// different tensor-parallel sizes of an MHA/GQA cache: moves, per
    /// block, the KV heads `route` assigns from this rank into the
    /// destination rank, at their place in its blocks
    /// ([`kv::plan_layer_heads`](crate::kv::plan_layer_heads)). A route
    /// that gives this rank nothing for that destination submits nothing
    /// and returns `Ok(None)`.
    #[allow(clippy::too_many_arguments)]
    pub fn push_layer_heads_tagged(
        &mut self,
        segment: &Segment,
        local: &KvLayout,
        remote: &KvLayout,
        route: &crate::kv::HeadRoute,
        layer: u32,
        request_slot: u32,
        src_ids: &[u64],
        dst_ids: &[u64],
    ) -> Result<Option<BatchId>> {
        let tag = crate::kv::arrival_tag(request_slot, layer)?;
        let descs = crate::kv::plan_layer_heads(local, remote, Opcode::Write, route, layer, src_ids, dst_ids)?;
        if descs.is_empty() {
            return Ok(None);
        }
        self.submit(&Batch::write(segment).descs(&descs).arrival_tag(tag)).map(Some)
    }

    /// Waits up to `timeout` for a batch to end and consumes its result.
    /// `Error::Timeout` leaves the batch running (wait again or cancel).
    ///
    /// ```no_run
    /// # fn demo(sub: &mut kvring::Submitter, id: kvring::BatchId) -> kvring::Result<()> {
    /// use kvring::Outcome;
    /// match sub.wait(id, std::time::Duration::from_millis(100))? {
    ///     Outcome::Done { bytes } => println!("{bytes} bytes in place"),
    ///     Outcome::Failed(error) => eprintln!("{error}"),
    ///     Outcome::TimedOut { bytes } | Outcome::Cancelled { bytes } => eprintln!("partial: {bytes}"),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn wait(&mut self, id: BatchId, timeout: Duration) -> Result<Outcome> {
        self.wait_until(id, crate::deadline::deadline_after(timeout))
    }

    /// [`wait`](Self::wait) with an absolute deadline.
    pub fn wait_until(&mut self, id: BatchId, deadline: Instant) -> Result<Outcome> {
        let mut backoff: Option<Backoff> = None;
        loop {
            match self.status.take(id) {
                Ok(Some(finished)) => {
                    self.free_slots.push(id.slot());
                    self.absorb_completions(id);
                    return Ok(outcome_of(finished));
                }
                Ok(None) => {}
                Err(error) => return Err(id_error(error, id)),
            }
            let backoff = backoff.get_or_insert_with(|| Backoff::new(self.engine.config.wait_backoff, Some(deadline)));
            if backoff.snooze() == Snooze::Expired {
                return Err(Error::Timeout {
                    what: "the batch to end (it may still complete)",
                    waited: backoff.waited(),
                });
            }
        }
    }

    /// Moves CQEs from the rings to `pending`, dropping the one of `consumed`
    /// and any whose batch was already consumed, so the rings never fill
    /// for a caller who only waits.
    fn absorb_completions(&mut self, consumed: BatchId) {
        for lane in &mut self.lanes {
            for cqe in lane.cq.read_chunk(usize::MAX) {
                let id = BatchId::from_raw(cqe.batch_id);
                if cqe.kind == CqeKind::Notification as u32 || (id != consumed && self.status.state(id).is_ok()) {
                    self.pending.push_back(cqe);
                }
            }
        }
    }

    /// Reaps one completion, if any batch has ended and was not consumed
    /// by `wait`.
    ///
    /// ```no_run
    /// # fn demo(sub: &mut kvring::Submitter) {
    /// while let Some(done) = sub.reap() {
    ///     println!("request {} ended: {:?}", done.user_data, done.outcome);
    /// }
    /// # }
    /// ```
    pub fn reap(&mut self) -> Option<Completion> {
        loop {
            let cqe = match self.pending.pop_front() {
                Some(cqe) => cqe,
                None => self.lanes.iter_mut().find_map(|lane| lane.cq.pop())?,
            };
            if cqe.kind == CqeKind::Notification as u32 {
                // Cleared before the queue is polled, so a delivery lane 0
                // counts after this gets a CQE of its own.
                self.watch.reaped();
                self.notifications_ready = true;
                continue;
            }
            let id = BatchId::from_raw(cqe.batch_id);
            match self.status.take(id) {
                Ok(Some(finished)) => {
                    self.free_slots.push(id.slot());
                    let transport = self.slot_transports[id.slot() as usize];
                    return Some(Completion { id, user_data: cqe.user_data, transport, outcome: outcome_of(finished) });
                }
                // The status is published before the CQE, so a CQE always
                // finds its batch ended; keep it if not, rather than lose it.
                Ok(None) => {
                    self.pending.push_front(cqe);
                    return None;
                }
                // Already consumed by `wait`.
                Err(_) => continue,
            }
        }
    }

    /// Asks lane 0 for an [`Event::Notification`](crate::Event::Notification) in this submitter's
    /// completion ring whenever peers' notifications arrive, so one
    /// [`reap_event`](Self::reap_event) loop serves batches and
    /// notifications. Each notification goes to one reader: to the first
    /// watcher (or [`Engine::poll_notification`](crate::Engine::poll_notification)
    /// caller) that polls it.
    pub fn watch_notifications(&mut self, on: bool) {
        self.watch.set(on);
        if on && self.engine.notifications.delivered() > 0 {
            // Some may have arrived before watching began.
            self.notifications_ready = true;
        }
    }

    /// The next event: a batch that ended, or (when
    /// [`watch_notifications`](Self::watch_notifications) is on) a peer's
    /// notification.
    ///
    /// ```no_run
    /// # fn demo(sub: &mut kvring::Submitter) {
    /// use kvring::Event;
    /// sub.watch_notifications(true);
    /// while let Some(event) = sub.reap_event() {
    ///     match event {
    ///         Event::Batch(done) => println!("request {} ended: {:?}", done.user_data, done.outcome),
    ///         Event::Notification(n) => println!("{} says {:?}", n.from, n.message),
    ///     }
    /// }
    /// # }
    /// ```
    pub fn reap_event(&mut self) -> Option<Event> {
        if let Some(completion) = self.reap() {
            return Some(Event::Batch(completion));
        }
        if self.notifications_ready {
            match self.engine.notifications.poll() {
                Some(notification) => return Some(Event::Notification(notification)),
                None => self.notifications_ready = false,
            }
        }
        None
    }

    /// Reaps up to `max` completions into `out`; returns how many.
    pub fn reap_into(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut reaped = 0;
        while reaped < max {
            match self.reap() {
                Some(completion) => {
                    out.push(completion);
                    reaped += 1;
                }
                None => break,
            }
        }
        reaped
    }

    /// Drops the batch's descriptors not yet posted. The batch ends
    /// `Cancelled` once every posted descriptor has drained (or `Done` if
    /// all had already moved); wait for it before reusing its memory.
    ///
    /// ```no_run
    /// # fn demo(sub: &mut kvring::Submitter, id: kvring::BatchId) -> kvring::Result<()> {
    /// sub.cancel(id)?;
    /// let outcome = sub.wait(id, std::time::Duration::from_secs(1))?; // memory reusable after this
    /// # Ok(()) }
    /// ```
    pub fn cancel(&mut self, id: BatchId) -> Result<()> {
        self.status.request_cancel(id).map_err(|e| id_error(e, id))?;
        // A parked lane holding the batch's chunks must see it now, not at
        // its next wake-up.
        for lane in &self.lanes {
            lane.lane.doorbell.ring();
        }
        Ok(())
    }

    /// The transport that carries a batch (its segment's link): from its
    /// submission until it is consumed by `wait` or `reap` (a
    /// [`Completion`] carries it too). A consumed or forged id is an error.
    pub fn transport(&self, id: BatchId) -> Result<TransportKind> {
        self.status.state(id).map_err(|e| id_error(e, id))?;
        Ok(self.slot_transports[id.slot() as usize])
    }

    /// The state of a batch without consuming it.
    pub fn state(&self, id: BatchId) -> Result<BatchState> {
        self.status.state(id).map_err(|e| id_error(e, id))
    }
}

impl Drop for Submitter {
    fn drop(&mut self) {
        // Lanes finish what is queued (releasing its leases), then drop
        // the rings.
        self.closed.store(true, Ordering::Release);
        for lane in &self.lanes {
            lane.lane.doorbell.ring();
        }
    }
}

/// The local region of each run of equal local regions within each part:
/// exactly the leases a lane releases as it walks the part.
fn lease_runs<'a>(descs: &'a [BlockDesc], parts: &'a [(usize, usize, usize)]) -> impl Iterator<Item = RegionId> + 'a {
    parts.iter().flat_map(move |&(_, start, end)| {
        let part = &descs[start..end];
        part.iter()
            .enumerate()
            .filter(move |&(i, desc)| i == 0 || part[i - 1].local_region != desc.local_region)
            .map(|(_, desc)| desc.local_region)
    })
}

fn outcome_of(finished: Finished<Error>) -> Outcome {
    match finished.state {
        BatchState::Done => Outcome::Done { bytes: finished.bytes },
        BatchState::TimedOut => Outcome::TimedOut { bytes: finished.bytes },
        BatchState::Cancelled => Outcome::Cancelled { bytes: finished.bytes },
        BatchState::Failed | BatchState::Free | BatchState::Pending => Outcome::Failed(
            finished.failure.unwrap_or_else(|| Error::malformed("batch status", "failed without an error")),
        ),
    }
}

fn id_error(error: IdError, id: BatchId) -> Error {
    match error {
        IdError::Unknown => Error::UnknownBatch { id: id.raw() },
        IdError::Stale => Error::StaleBatch { id: id.raw() },
    }
}

/// Reads a submitter's batch states from any thread, without a lock.
///
/// ```no_run
/// # fn demo(sub: &kvring::Submitter, id: kvring::BatchId) {
/// let reader = sub.status_reader();
/// std::thread::spawn(move || println!("{:?}", reader.state(id)));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct StatusReader {
    table: Arc<StatusTable<Error>>,
}

impl StatusReader {
    /// The batch's state; a consumed or forged id is an error.
    pub fn state(&self, id: BatchId) -> Result<BatchState> {
        self.table.state(id).map_err(|e| id_error(e, id))
    }

    /// Bytes moved so far.
    pub fn bytes(&self, id: BatchId) -> Result<u64> {
        self.table.bytes(id).map_err(|e| id_error(e, id))
    }
}
