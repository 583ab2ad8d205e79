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
use super::status::{BatchState, PartEnd, StatusTable};
use crate::desc::{BlockDesc, RegionId};
use crate::error::{Error, Result, Side};
use crate::mem::{Access, Registry};
use crate::proto::ErrorCode;
use crate::ring::{Consumer, Cqe, CqeKind, Opcode, Producer, Sqe};
use crate::segment::PeerSegment;
use crate::transport::{Block, Link};
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
    rings: Vec<SubmitterRings>,
    /// Indexed by segment slot; `(key, segment)`.
    segments: Vec<Option<(u32, LaneSegment)>>,
    /// CQEs that found their ring full. By construction (a completion ring
    /// has room for every unconsumed batch) this stays empty; it exists so a
    /// broken invariant delays a completion instead of losing it.
    cq_backlog: VecDeque<(usize, Cqe)>,
    /// Validated blocks of the chunk being built (preallocated).
    chunk: Vec<Block>,
    /// Regions whose runs ended in the chunk being built: their leases are
    /// released once the chunk has been transferred.
    ended_runs: Vec<RegionId>,
    config: LaneConfig,
}

/// Most blocks any link takes per chunk; the lane's chunk buffer is
/// allocated once with this capacity.
pub const MAX_CHUNK_BLOCKS: usize = 256;

impl Lane {
    async fn run(mut self) {
        let mut idle_since: Option<Instant> = None;
        let mut rounds: u32 = 0;
        loop {
            let commands = self.take_commands();
            let worked = self.poll_rings() + commands;
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
                    Some(_) => std::hint::spin_loop(),
                }
            }
            rounds = rounds.wrapping_add(1);
            if rounds % 64 == 0 {
                // Let other tasks on this executor (future transports) run.
                glommio::yield_if_needed().await;
            }
        }
    }

    fn drained(&mut self) -> bool {
        self.cq_backlog.is_empty() && self.rings.iter_mut().all(|r| r.sq.is_empty())
    }

    fn park(&mut self) {
        let shared = self.shared.clone();
        let rings = &mut self.rings;
        let parked = shared.doorbell.park(self.config.park_timeout, || {
            !shared.commands.is_empty()
                || shared.stop.load(Ordering::Acquire)
                || rings.iter_mut().any(|r| !r.sq.is_empty())
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
                LaneCommand::AttachSubmitter(rings) => self.rings.push(*rings),
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
            }
        }
        taken
    }

    /// One pass over every submitter's ring. Returns SQEs executed.
    fn poll_rings(&mut self) -> usize {
        self.flush_cq_backlog();
        let mut executed = 0;
        let mut index = 0;
        while index < self.rings.len() {
            let ring = &mut self.rings[index];
            let available = ring.sq.slots().min(DEFAULT_MAX_SQES_PER_POLL);
            if available == 0 {
                if ring.closed.load(Ordering::Acquire) && ring.sq.is_empty() {
                    self.rings.swap_remove(index);
                    continue;
                }
                index += 1;
                continue;
            }
            for _ in 0..available {
                let Some(sqe) = self.rings[index].sq.pop() else { break };
                self.execute_part(index, sqe);
                executed += 1;
            }
            index += 1;
        }
        executed
    }

    fn flush_cq_backlog(&mut self) {
        while let Some(&(ring, cqe)) = self.cq_backlog.front() {
            match self.rings.get_mut(ring).map(|r| r.cq.push(cqe)) {
                Some(Err(_)) => return,
                _ => {
                    self.cq_backlog.pop_front();
                }
            }
        }
    }

    fn execute_part(&mut self, ring_index: usize, sqe: Sqe) {
        let id = super::status::BatchId::from_raw(sqe.batch_id);
        let Lane { shared, registry, rings, segments, config, cq_backlog, chunk, ended_runs } = self;
        let ring = &mut rings[ring_index];
        let segment = segments
            .get(sqe.segment as u16 as usize)
            .and_then(Option::as_ref)
            .filter(|(key, _)| *key == sqe.segment)
            .map(|(_, s)| s);
        let op = Opcode::from_u8(sqe.opcode);
        let status = &ring.status;

        let mut end: Option<PartEnd<Error>> = match (segment, op) {
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
        let max_chunk = segment.map_or(1, |s| s.link.max_chunk().clamp(1, MAX_CHUNK_BLOCKS));
        let mut part = PartProgress { bytes: 0, executed: 0 };
        let mut run: Option<RegionId> = None;
        chunk.clear();
        ended_runs.clear();
        // Every descriptor of the part is consumed from the arena, executed
        // or not, so the next batch never waits behind a failed one; leases
        // are released run by run exactly as the submitter took them, but
        // only after the chunk using them has been transferred.
        let descs = ring.descs.read_chunk(sqe.desc_count as usize);
        debug_assert_eq!(descs.len(), sqe.desc_count as usize, "descriptors are published before their SQE");
        for (offset, desc) in descs.enumerate() {
            if run != Some(desc.local_region) {
                if let Some(region) = run {
                    ended_runs.push(region);
                }
                run = Some(desc.local_region);
            }
            if end.is_some() {
                continue;
            }
            let (Some(segment), Some(op)) = (segment, op) else { continue };
            if chunk.is_empty() {
                if status.cancel_requested(id) {
                    end = Some(PartEnd::Cancelled);
                    continue;
                }
                if sqe.deadline_ns != 0 && config.clock.now_ns() > sqe.deadline_ns {
                    end = Some(PartEnd::TimedOut);
                    continue;
                }
            }
            let desc_index = sqe.desc_base + offset as u32;
            match validate(registry, segment, &desc, desc_index, local_needs, remote_needs) {
                Ok(local) => chunk.push(Block { local, desc, desc_index }),
                Err(error) => {
                    // Blocks validated before the bad one still move, as
                    // they would have one by one.
                    end = flush(config.index, segment, op, id, chunk, registry, ended_runs, &mut part);
                    part.executed += 1;
                    end.get_or_insert(PartEnd::Failed(error));
                    continue;
                }
            }
            if chunk.len() >= max_chunk {
                end = flush(config.index, segment, op, id, chunk, registry, ended_runs, &mut part);
            }
        }
        if end.is_none() {
            if let (Some(segment), Some(op)) = (segment, op) {
                end = flush(config.index, segment, op, id, chunk, registry, ended_runs, &mut part);
            }
        }
        chunk.clear();
        for region in ended_runs.drain(..).chain(run) {
            registry.release(region);
        }
        if let (Some(segment), Some(PartEnd::Failed(Error::PeerRestarted { .. }))) = (segment, &end) {
            // The peer is gone or restarted: later batches to this handle
            // fail at once, and the next open of its name reconnects.
            segment.peer.mark_stale();
        }
        let stats = &shared.stats;
        stats.parts.fetch_add(1, Ordering::Relaxed);
        stats.descs.fetch_add(part.executed, Ordering::Relaxed);
        stats.bytes.fetch_add(part.bytes, Ordering::Relaxed);

        let finished = status.finish_part(id, part.bytes, end.unwrap_or(PartEnd::Done), result_code);
        if let Some(completion) = finished {
            let cqe = Cqe {
                user_data: sqe.user_data,
                batch_id: sqe.batch_id,
                bytes: completion.bytes,
                result: completion.result,
                kind: CqeKind::Batch as u32,
            };
            if ring.cq.push(cqe).is_err() {
                cq_backlog.push_back((ring_index, cqe));
            }
        }
    }
}

/// Bytes and descriptors a part has moved so far.
struct PartProgress {
    bytes: u64,
    executed: u64,
}

/// Transfers the chunk, then releases the leases of the runs that ended in
/// it. Returns the part's end if the transfer failed.
#[allow(clippy::too_many_arguments)]
fn flush(
    lane: usize,
    segment: &LaneSegment,
    op: Opcode,
    id: super::status::BatchId,
    chunk: &mut Vec<Block>,
    registry: &Registry,
    ended_runs: &mut Vec<RegionId>,
    part: &mut PartProgress,
) -> Option<PartEnd<Error>> {
    if chunk.is_empty() {
        return None;
    }
    // SAFETY: every block was validated against a region this part holds a
    // lease on (`validate`), and those leases are released only below.
    let result = unsafe { segment.link.transfer(lane, op, id.raw(), chunk) };
    part.executed += chunk.len() as u64;
    chunk.clear();
    for region in ended_runs.drain(..) {
        registry.release(region);
    }
    match result {
        Ok(bytes) => {
            part.bytes += bytes;
            None
        }
        Err((error, bytes)) => {
            part.bytes += bytes;
            Some(PartEnd::Failed(error))
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
