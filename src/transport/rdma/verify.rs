//! End-to-end checksums over rdma: a checksummed chunk's work requests
//! complete with no CPU of the target involved, so the chunk is verified
//! afterwards, off the lane. Once its last completion is polled, its
//! blocks go to the link's verifier threads (two, shared by its lanes),
//! one of which sums the local side (a WRITE's source, a READ's landed
//! destination: the chunk still holds its leases, so those bytes are
//! stable) and asks the target, on the control plane, for the CRC32C of
//! the remote side
//! (`Crc32cRequest`, answered by `engine::crc32c`). The chunk ends when
//! the verdict comes back through [`Verifier::poll`]: `Ok`, `Corrupt`
//! naming the first block whose sums differ, or the request's error.
//!
//! A chunk waiting on its verdict can be withdrawn (deadline, cancel,
//! abort, the link dropped): it ends failed at once and a late verdict is
//! ignored. Its local bytes are read under a gate that the withdrawal
//! takes (`verify/gate.rs`, modelled under loom), so once a withdrawal
//! returns the worker reads them no more and the lane may give the leases
//! back. See docs/CHECKSUMS.md.

mod gate;

use crate::error::{Error, Result};
use crate::ring::Opcode;
use crate::transport::checksum::{corrupt, Crc32c};
use crate::transport::ChunkEnd;
use gate::{Gate, VERDICT_GRACE};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// Most ranges one `Crc32cRequest` carries (a target refuses more): a
/// chunk's blocks, [`crate::transport::MAX_CHUNK_BLOCKS`].
pub const MAX_CRC32C_RANGES: usize = crate::transport::MAX_CHUNK_BLOCKS;
/// Most bytes one `Crc32cRequest` asks the target to sum (a target refuses
/// more): a request holds one of the target's control threads while it
/// sums, at some 10-30 GB/s, so 1 GiB keeps one request well under the
/// control plane's 5 s message timeout even on a loaded core; a chunk
/// larger than this is verified in several requests.
pub const MAX_CRC32C_BYTES: u64 = 1 << 30;
/// Verification jobs queued to a worker before the lane keeps the rest in
/// its own backlog (sent on its next polls).
const JOB_QUEUE: usize = 64;
/// Bytes of a chunk's local side summed per hold of its gate: what a
/// withdrawal (on the lane) may wait for, some 50-100 µs of CRC32C.
const GATED_STEP_BYTES: usize = 1 << 20;
/// Threads verifying one link's chunks (all its lanes'): two, so one
/// chunk's local sum runs while another's question is with the target.
const WORKER_THREADS: usize = 2;

/// A range of the peer's memory to sum: (raw region id, offset, length).
pub(crate) type Range = (u64, u64, u64);
/// Asks the peer for the CRC32C of each range, in order, before the
/// deadline (one control exchange; a connection kept between calls).
pub(crate) type AskCrcs = Box<dyn FnMut(&[Range], Instant) -> Result<Vec<u32>> + Send>;

/// What a link needs to verify checksummed chunks with its peer.
#[derive(Clone)]
pub(crate) struct VerifyPeer {
    /// Makes the asker a verifier thread uses (a control client to the
    /// peer, dialed and handshaken at its first question).
    pub dial: Arc<dyn Fn() -> AskCrcs + Send + Sync>,
    /// Longest a chunk's verification may take (the engine's control
    /// timeout): a batch's own deadline ends it sooner through the lane.
    pub timeout: Duration,
}

impl std::fmt::Debug for VerifyPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerifyPeer").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

/// One block of a chunk to verify.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JobBlock {
    /// Its local bytes (leased by the chunk until it ends).
    pub local: usize,
    /// The peer's region (raw id) and offset.
    pub region: u64,
    pub offset: u64,
    pub len: u64,
    /// Its index in the batch, for `Corrupt`.
    pub desc_index: u32,
    /// Where it lands, as the `testing` feature's corruption hook names it.
    pub landing: u64,
}

struct Job {
    chunk: u64,
    op: Opcode,
    blocks: Vec<JobBlock>,
    /// Each question's own bound, counted from when it is asked: the queue
    /// ahead of it takes none of it.
    timeout: Duration,
    gate: Arc<Gate>,
    /// Where its verdict goes: its lane link's channel.
    reply: Sender<Verdict>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("chunk", &self.chunk).field("blocks", &self.blocks.len()).finish()
    }
}

/// A chunk whose verdict the lane waits for.
#[derive(Debug)]
struct Waiting {
    ticket: u64,
    bytes: u64,
    gate: Arc<Gate>,
}

/// A verdict: the chunk, and `Ok` or why it failed.
type Verdict = (u64, Result<()>);

/// The verifier threads of one link (all its lanes): started at the
/// first checksummed chunk of any lane, ended once every lane link is
/// dropped (the queue's sender is here) and its current question ended.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    jobs: OnceLock<std::result::Result<SyncSender<Job>, String>>,
    /// Its threads still running (one that panicked counts out).
    alive: Arc<AtomicUsize>,
}

impl Pool {
    /// Its threads still running.
    fn alive(&self) -> usize {
        self.alive.load(Ordering::Acquire)
    }

    /// The queue to the threads, started now if they were not.
    fn jobs(&self, peer: &str, with: &VerifyPeer) -> Result<&SyncSender<Job>> {
        match self.jobs.get_or_init(|| spawn(peer, with, &self.alive)) {
            Ok(jobs) => Ok(jobs),
            Err(why) => Err(Error::Unsupported { what: format!("checksums over rdma to {peer}: {why}") }),
        }
    }
}

/// One lane link's verifications: the link's threads (shared with its
/// other lanes), the jobs they have not taken yet, and the chunks waiting
/// on verdicts. Only the lane calls it.
#[derive(Debug)]
pub(crate) struct Verifier {
    peer: String,
    with: Option<(VerifyPeer, Arc<Pool>)>,
    told: Sender<Verdict>,
    verdicts: Receiver<Verdict>,
    backlog: VecDeque<Job>,
    waiting: HashMap<u64, Waiting>,
}

impl Verifier {
    /// A verifier for `peer`, on `pool` (shared by the link's lanes);
    /// `None`: this link cannot verify (checksummed chunks are refused).
    pub fn new(peer: &str, with: Option<(VerifyPeer, Arc<Pool>)>) -> Self {
        let (told, verdicts) = mpsc::channel();
        Self { peer: peer.to_string(), with, told, verdicts, backlog: VecDeque::new(), waiting: HashMap::new() }
    }

    /// Whether checksummed chunks can be verified at all.
    pub fn can_verify(&self) -> bool {
        self.with.is_some()
    }

    /// True while a chunk waits on its verdict.
    pub fn is_waiting(&self) -> bool {
        !self.waiting.is_empty()
    }

    /// Hands a completed chunk's blocks to the threads; `Err` (the chunk
    /// then ends failed) when none could be started.
    pub fn start(&mut self, chunk: u64, ticket: u64, bytes: u64, op: Opcode, blocks: Vec<JobBlock>) -> Result<()> {
        let Some((with, pool)) = &self.with else {
            return Err(Error::Unsupported { what: format!("checksums over rdma to {}: no control path", self.peer) });
        };
        pool.jobs(&self.peer, with)?;
        let gate = Arc::new(Gate::default());
        self.waiting.insert(chunk, Waiting { ticket, bytes, gate: gate.clone() });
        let reply = self.told.clone();
        self.backlog.push_back(Job { chunk, op, blocks, timeout: with.timeout, gate, reply });
        self.send_backlog();
        Ok(())
    }

    /// Queues what the threads have room for (the rest waits here; a
    /// queue whose threads are all gone keeps it until `poll` fails it).
    fn send_backlog(&mut self) {
        let Some(Ok(jobs)) = self.with.as_ref().and_then(|(_, pool)| pool.jobs.get()) else { return };
        while let Some(job) = self.backlog.pop_front() {
            if let Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) = jobs.try_send(job) {
                self.backlog.push_front(job);
                return;
            }
        }
    }

    /// Ends the chunks whose verdicts came, and those that waited past
    /// their deadline for one; true if any ended.
    pub fn poll(&mut self, ended: &mut Vec<ChunkEnd>) -> bool {
        if self.waiting.is_empty() {
            return false;
        }
        self.send_backlog();
        let mut progressed = false;
        while let Ok((chunk, verdict)) = self.verdicts.try_recv() {
            // A chunk withdrawn meanwhile has ended: its verdict is late.
            let Some(waiting) = self.waiting.remove(&chunk) else { continue };
            progressed = true;
            ended.push((waiting.ticket, verdict.map(|()| waiting.bytes).map_err(|e| (e, waiting.bytes))));
        }
        let now = Instant::now();
        // A step past its bound, or no thread left to take the jobs (one
        // that panicked): no verdict is coming.
        let orphaned = self.with.as_ref().is_some_and(|(_, pool)| pool.jobs.get().is_some() && pool.alive() == 0);
        if orphaned || self.waiting.values().any(|w| w.gate.given_up(now)) {
            let late = || Error::Timeout { what: "the peer's CRC32C of an rdma chunk", waited: VERDICT_GRACE };
            progressed |= self.fail_where(|w| orphaned || w.gate.given_up(now), &late, ended) > 0;
        }
        progressed
    }

    /// Ends (failed with `error`) the chunks of `ticket` waiting on a
    /// verdict: the NIC is done with them, so they may simply be dropped.
    pub fn withdraw(&mut self, ticket: u64, error: &dyn Fn() -> Error, ended: &mut Vec<ChunkEnd>) -> usize {
        self.fail_where(|w| w.ticket == ticket, error, ended)
    }

    /// Ends every chunk waiting on a verdict, failed with `error`.
    pub fn fail_all(&mut self, error: &dyn Fn() -> Error, ended: &mut Vec<ChunkEnd>) -> usize {
        self.fail_where(|_| true, error, ended)
    }

    fn fail_where(
        &mut self,
        which: impl Fn(&Waiting) -> bool,
        error: &dyn Fn() -> Error,
        ended: &mut Vec<ChunkEnd>,
    ) -> usize {
        let chunks: Vec<u64> = self.waiting.iter().filter(|(_, w)| which(w)).map(|(&c, _)| c).collect();
        for chunk in &chunks {
            let Some(waiting) = self.waiting.remove(chunk) else { continue };
            // Once this returns the threads read the chunk's bytes no more.
            waiting.gate.withdraw();
            ended.push((waiting.ticket, Err((error(), 0))));
        }
        self.backlog.retain(|job| self.waiting.contains_key(&job.chunk));
        chunks.len()
    }
}

impl Drop for Verifier {
    /// The threads let go of every chunk's bytes before the lane can give
    /// their leases back.
    fn drop(&mut self) {
        for waiting in self.waiting.values() {
            waiting.gate.withdraw();
        }
    }
}

/// Starts [`WORKER_THREADS`] threads taking jobs from one queue, each with
/// its own control connection; a thread that cannot start is skipped
/// while one did.
fn spawn(peer: &str, with: &VerifyPeer, alive: &Arc<AtomicUsize>) -> std::result::Result<SyncSender<Job>, String> {
    let (jobs, taken) = mpsc::sync_channel::<Job>(JOB_QUEUE);
    let taken = Arc::new(Mutex::new(taken));
    let mut started = 0;
    let mut failure = None;
    for _ in 0..WORKER_THREADS {
        let (dial, name, taken) = (with.dial.clone(), peer.to_string(), taken.clone());
        alive.fetch_add(1, Ordering::AcqRel);
        let counted = CountedOut(alive.clone());
        let thread = std::thread::Builder::new().name("kvring-rdma-verify".into()).spawn(move || {
            let _counted = counted;
            let mut ask = dial();
            loop {
                // The queue's lock is held only to take a job, never while
                // one is verified.
                let job = taken.lock().unwrap_or_else(PoisonError::into_inner).recv();
                let Ok(job) = job else { return };
                let verdict = verify(&name, &job, &mut ask);
                // A lane link dropped meanwhile no longer listens.
                let _ = job.reply.send((job.chunk, verdict));
            }
        });
        match thread {
            Ok(_) => started += 1,
            Err(error) => failure = Some(error),
        }
    }
    match (started, failure) {
        (0, Some(error)) => Err(format!("no verifier thread could start: {error}")),
        _ => Ok(jobs),
    }
}

/// Counts a verifier thread out of its pool's `alive` when it ends, by
/// return or by a panic (or when it never started).
struct CountedOut(Arc<AtomicUsize>);

impl Drop for CountedOut {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One piece of a block, summed at both ends.
#[derive(Clone, Copy)]
struct Piece {
    block: usize,
    local: usize,
    range: Range,
}

/// The blocks cut in pieces of at most [`MAX_CRC32C_BYTES`].
fn pieces(blocks: &[JobBlock]) -> Vec<Piece> {
    let mut out = Vec::with_capacity(blocks.len());
    for (index, block) in blocks.iter().enumerate() {
        let mut done = 0;
        loop {
            let len = (block.len - done).min(MAX_CRC32C_BYTES);
            let range = (block.region, block.offset + done, len);
            out.push(Piece { block: index, local: block.local + done as usize, range });
            done += len;
            if done >= block.len {
                break;
            }
        }
    }
    out
}

/// Verifies one chunk: its local sums (under the gate), then the peer's,
/// in requests of at most [`MAX_CRC32C_RANGES`] ranges and
/// [`MAX_CRC32C_BYTES`].
fn verify(peer: &str, job: &Job, ask: &mut AskCrcs) -> Result<()> {
    // The local sums are bounded as a question is (a 1 GiB piece on a
    // loaded core stays well inside the control timeout).
    job.gate.step_until(crate::deadline::deadline_after(job.timeout));
    let pieces = pieces(&job.blocks);
    let mut ours = Vec::with_capacity(pieces.len());
    for piece in &pieces {
        let mut sum = Crc32c::new();
        let len = piece.range.2 as usize;
        let mut done = 0;
        loop {
            // One step under the gate: a withdrawal, on the lane, waits at
            // most one step's sum (a piece may be 1 GiB).
            let n = (len - done).min(GATED_STEP_BYTES);
            let at = (piece.local + done) as *const u8;
            // The chunk holds its leases until it ends, which it cannot
            // (withdrawn) while the step holds the gate; a WRITE's source is
            // not written meanwhile (the caller's contract), a READ's
            // destination was placed before its completion and only its
            // chunk touches it.
            // SAFETY: inside the leased piece, which stays put (above).
            let read = || unsafe { sum.update_raw(at, n) };
            if job.gate.step(read).is_none() {
                return Ok(());
            }
            done += n;
            if done >= len {
                break;
            }
        }
        ours.push(sum.value());
    }
    let mut theirs = Vec::with_capacity(pieces.len());
    let mut start = 0;
    while start < pieces.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < pieces.len() && end - start < MAX_CRC32C_RANGES && bytes + pieces[end].range.2 <= MAX_CRC32C_BYTES {
            bytes += pieces[end].range.2;
            end += 1;
        }
        let deadline = crate::deadline::deadline_after(job.timeout);
        job.gate.step_until(deadline);
        let ranges: Vec<Range> = pieces[start..end].iter().map(|p| p.range).collect();
        let crcs = ask(&ranges, deadline)?;
        if crcs.len() != ranges.len() {
            return Err(Error::malformed(
                "crc32c answer",
                format!("{peer} sent {} CRCs for {} ranges", crcs.len(), ranges.len()),
            ));
        }
        theirs.extend(crcs);
        start = end;
    }
    for ((piece, &local), &remote) in pieces.iter().zip(&ours).zip(&theirs) {
        if local != remote {
            let index = job.blocks[piece.block].desc_index;
            return Err(match job.op {
                Opcode::Write => corrupt(index, local, remote, "in the peer's region once written over rdma"),
                Opcode::Read => corrupt(index, remote, local, "in this engine's region once read over rdma"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_larger_than_a_request_is_cut_and_its_pieces_fill_requests_in_order() {
        let blocks = [
            JobBlock { local: 0x1000, region: 7, offset: 10, len: MAX_CRC32C_BYTES + 5, desc_index: 3, landing: 0 },
            JobBlock { local: 0x9000, region: 8, offset: 0, len: 4, desc_index: 4, landing: 0 },
        ];
        let cut = pieces(&blocks);
        let ranges: Vec<Range> = cut.iter().map(|p| p.range).collect();
        assert_eq!(ranges, [(7, 10, MAX_CRC32C_BYTES), (7, 10 + MAX_CRC32C_BYTES, 5), (8, 0, 4)]);
        assert_eq!(cut[1].local, 0x1000 + MAX_CRC32C_BYTES as usize);
        assert_eq!(cut.iter().map(|p| p.block).collect::<Vec<_>>(), [0, 0, 1]);
    }

    /// Sums of host bytes the test owns: a matching peer passes, a peer
    /// whose CRC of block 1 differs fails `Corrupt` naming its index, a
    /// withdrawn job reads nothing, and a peer's error is the verdict.
    #[test]
    fn a_verdict_names_the_first_block_whose_sums_differ() {
        let data: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i; 4096]).collect();
        let blocks: Vec<JobBlock> = data
            .iter()
            .enumerate()
            .map(|(i, d)| JobBlock {
                local: d.as_ptr() as usize,
                region: 1,
                offset: i as u64 * 4096,
                len: 4096,
                desc_index: 10 + i as u32,
                landing: 0,
            })
            .collect();
        let truth: Vec<u32> = data.iter().map(|d| crate::transport::checksum::crc32c_of(d)).collect();
        let job = |op| Job {
            chunk: 1,
            op,
            blocks: blocks.clone(),
            timeout: Duration::from_secs(5),
            gate: Arc::default(),
            reply: mpsc::channel().0,
        };
        let honest = truth.clone();
        let mut ask: AskCrcs = Box::new(move |ranges, _| Ok(honest[..ranges.len()].to_vec()));
        assert!(verify("peer", &job(Opcode::Write), &mut ask).is_ok());
        let mut lying = truth.clone();
        lying[1] ^= 1;
        let mut ask: AskCrcs = Box::new(move |_, _| Ok(lying.clone()));
        let error = verify("peer", &job(Opcode::Read), &mut ask).unwrap_err();
        assert!(matches!(error, Error::Corrupt { desc_index: 11, .. }), "{error}");
        assert!(error.to_string().contains("once read over rdma"), "{error}");
        let mut short: AskCrcs = Box::new(|_, _| Ok(vec![0]));
        assert!(matches!(verify("peer", &job(Opcode::Write), &mut short), Err(Error::Malformed { .. })));
        let mut refused: AskCrcs = Box::new(|_, _| Err(Error::Unsupported { what: "older".into() }));
        assert!(matches!(verify("peer", &job(Opcode::Write), &mut refused), Err(Error::Unsupported { .. })));
        let withdrawn = job(Opcode::Write);
        withdrawn.gate.withdraw();
        let mut never: AskCrcs = Box::new(|_, _| panic!("a withdrawn job asks nothing"));
        assert!(verify("peer", &withdrawn, &mut never).is_ok());
    }

    /// Through the link's threads: a chunk whose sums agree ends with its
    /// bytes; one withdrawn while the peer has not answered ends failed at
    /// once, and its verdict, when it comes, is ignored.
    #[test]
    fn a_verdict_ends_its_chunk_and_a_withdrawn_chunk_ignores_its_late_verdict() {
        let data = vec![9u8; 4096];
        let block =
            JobBlock { local: data.as_ptr() as usize, region: 1, offset: 0, len: 4096, desc_index: 0, landing: 0 };
        let crc = crate::transport::checksum::crc32c_of(&data);
        // The peer answers chunk 1 at once, and chunk 2 once `release` is sent.
        let (release, held) = mpsc::channel::<()>();
        let held = Arc::new(Mutex::new(held));
        let dial = move || -> AskCrcs {
            let held = held.clone();
            Box::new(move |ranges: &[Range], _| {
                if ranges[0].1 == 8192 {
                    let _ = held.lock().unwrap().recv_timeout(Duration::from_secs(10));
                }
                Ok(vec![crc])
            })
        };
        let peer = VerifyPeer { dial: Arc::new(dial), timeout: Duration::from_secs(10) };
        let mut verifier = Verifier::new("peer", Some((peer, Arc::default())));
        let mut ended = Vec::new();
        let wait_for = |verifier: &mut Verifier, ended: &mut Vec<ChunkEnd>| {
            for _ in 0..10_000 {
                if verifier.poll(ended) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            panic!("no verdict");
        };
        verifier.start(1, 7, 4096, Opcode::Write, vec![block]).unwrap();
        wait_for(&mut verifier, &mut ended);
        assert!(matches!(ended.as_slice(), [(7, Ok(4096))]), "{ended:?}");
        ended.clear();
        verifier.start(2, 8, 4096, Opcode::Write, vec![JobBlock { offset: 8192, ..block }]).unwrap();
        assert!(verifier.is_waiting());
        assert_eq!(verifier.withdraw(8, &|| Error::Cancelled { bytes: 0 }, &mut ended), 1);
        assert!(matches!(ended.as_slice(), [(8, Err((Error::Cancelled { .. }, 0)))]), "{ended:?}");
        assert!(!verifier.is_waiting());
        release.send(()).unwrap();
        ended.clear();
        // Chunk 2's late verdict comes on the same channel as chunk 3's.
        verifier.start(3, 9, 4096, Opcode::Read, vec![block]).unwrap();
        wait_for(&mut verifier, &mut ended);
        assert!(matches!(ended.as_slice(), [(9, Ok(4096))]), "only chunk 3 ends: {ended:?}");
    }
}
