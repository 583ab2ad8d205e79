//! What every bench case does: move bytes in batches with some in flight,
//! time single-block round trips, and show a progress line.

use kvring::{Batch, BatchId, BlockDesc, Opcode, Outcome, Region, Segment, Submitter};
use std::collections::VecDeque;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Round trips run before the timed ones.
const LATENCY_WARMUP: usize = 200;
/// Deadline of one wait in the bench: generous, never unbounded.
pub const WAIT_TIMEOUT: Duration = Duration::from_secs(30);
const PROGRESS_EVERY: Duration = Duration::from_millis(500);

/// How a case moves its bytes.
#[derive(Clone, Copy)]
pub struct Shape {
    /// Blocks per batch.
    pub batch: usize,
    /// Batches in flight at once.
    pub inflight: usize,
    /// Checksummed end to end (`Batch::checksum`).
    pub checksum: bool,
}

/// The progress line of one case (on a terminal, not with `--json`): the
/// share of the case's bytes moved over all its rounds, so it climbs once
/// per case instead of restarting each round. Cleared when dropped.
pub struct Progress {
    pub label: String,
    done: u64,
    total: u64,
    last: Instant,
    on: bool,
}

impl Progress {
    /// A line for `label` over `total` bytes, shown unless `quiet`.
    pub fn new(label: String, total: u64, quiet: bool) -> Self {
        let on = !quiet && std::io::stderr().is_terminal();
        Self { label, done: 0, total: total.max(1), last: Instant::now(), on }
    }

    /// Counts `bytes` more moved.
    pub fn add(&mut self, bytes: u64) {
        self.done += bytes;
        if self.on && self.last.elapsed() >= PROGRESS_EVERY {
            self.last = Instant::now();
            eprint!("\r  {}: {:3}%   ", self.label, (100 * self.done / self.total).min(100));
            let _ = std::io::stderr().flush();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if self.on {
            eprint!("\r{:70}\r", "");
        }
    }
}

/// What a sweep of cases runs: each op at each block size, `total` bytes a
/// case in batches of `shape`, `latency_samples` round trips, printed as
/// JSON or text.
#[derive(Clone, Copy)]
pub struct Sweep<'a> {
    pub ops: &'a [Opcode],
    pub block_sizes: &'a [u64],
    pub shape: Shape,
    pub total: u64,
    pub latency_samples: usize,
    pub json: bool,
}

/// Where a bench's batches go: the target's segment, this side's region
/// and the target's region.
#[derive(Debug, Clone, Copy)]
pub struct Route<'a> {
    /// The target, opened.
    pub segment: &'a Segment,
    /// This side's region.
    pub local: &'a Region,
    /// The target's region.
    pub remote: kvring::RegionId,
}

/// Readies a case: this side's region holds the pattern of `seed`, except
/// for a READ, where the target's holds it (moved there first) and this
/// side's something else.
pub fn seed_case(
    sub: &mut Submitter,
    route: Route<'_>,
    region_bytes: u64,
    (op, block, seed): (Opcode, u64, u64),
    (shape, json): (Shape, bool),
    label: &str,
) -> Result<(), String> {
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { route.local.fill_pattern(seed) };
    if op == Opcode::Read {
        let whole = (region_bytes / block) * block;
        let mut seeding = Progress::new(format!("{label}: seeding"), whole, json);
        move_bytes(sub, route, Opcode::Write, region_bytes, block, whole, shape, &mut seeding)?;
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { route.local.fill_pattern(!seed) };
    }
    Ok(())
}

/// True when the first `covered` bytes of the target's region are the
/// local region's (by checksum on both sides).
pub fn verify(route: Route<'_>, covered: u64) -> Result<bool, String> {
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    let expected = unsafe { route.local.checksum(0, covered as usize) }.map_err(|e| e.to_string())?;
    let actual = route
        .segment
        .remote_checksum(route.remote, 0, covered, std::time::Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    Ok(expected == actual)
}

/// Moves `total` bytes in batches of `shape.batch` blocks, cycling over
/// the region, with up to `shape.inflight` batches in flight.
#[allow(clippy::too_many_arguments)]
pub fn move_bytes(
    sub: &mut Submitter,
    route: Route<'_>,
    op: Opcode,
    region_bytes: u64,
    block: u64,
    total: u64,
    shape: Shape,
    progress: &mut Progress,
) -> Result<u64, String> {
    let Route { segment, local, remote } = route;
    let label = progress.label.clone();
    let blocks_in_region = region_bytes / block;
    let total_blocks = total.div_ceil(block);
    let mut descs: Vec<BlockDesc> = Vec::with_capacity(shape.batch);
    let mut in_flight: VecDeque<BatchId> = VecDeque::with_capacity(shape.inflight);
    let mut next_block = 0u64;
    let mut moved = 0u64;
    while next_block < total_blocks || !in_flight.is_empty() {
        if next_block < total_blocks && in_flight.len() < shape.inflight {
            descs.clear();
            let count = (shape.batch as u64).min(total_blocks - next_block);
            for i in 0..count {
                let offset = ((next_block + i) % blocks_in_region) * block;
                descs.push(BlockDesc::new(local.id(), offset, remote, offset, block));
            }
            match sub.submit(&Batch::new(op, segment).descs(&descs).checksum(shape.checksum)) {
                Ok(id) => {
                    in_flight.push_back(id);
                    next_block += count;
                    continue;
                }
                Err(kvring::Error::Busy { .. }) if !in_flight.is_empty() => {}
                Err(e) => return Err(format!("{label}: submit: {e}")),
            }
        }
        let id = in_flight.pop_front().expect("something is in flight");
        match sub.wait(id, WAIT_TIMEOUT).map_err(|e| format!("{label}: wait: {e}"))? {
            Outcome::Done { bytes } => {
                moved += bytes;
                progress.add(bytes);
            }
            other => return Err(format!("{label}: batch ended {other:?}")),
        }
    }
    Ok(moved)
}

/// Single-block round trips: submit one block, wait for it; p50 and p99.
pub fn latency(
    sub: &mut Submitter,
    route: Route<'_>,
    op: Opcode,
    block: u64,
    samples: usize,
) -> Result<(f64, f64), String> {
    let Route { segment, local, remote } = route;
    if samples == 0 {
        return Ok((0.0, 0.0));
    }
    let descs = [BlockDesc::new(local.id(), 0, remote, 0, block)];
    let batch = Batch::new(op, segment).descs(&descs);
    let mut times = Vec::with_capacity(samples);
    for i in 0..LATENCY_WARMUP + samples {
        let started = Instant::now();
        let id = sub.submit(&batch).map_err(|e| format!("latency: submit: {e}"))?;
        let outcome = sub.wait(id, WAIT_TIMEOUT).map_err(|e| format!("latency: wait: {e}"))?;
        let elapsed = started.elapsed();
        if !outcome.is_done() {
            return Err(format!("latency: batch ended {outcome:?}"));
        }
        if i >= LATENCY_WARMUP {
            times.push(elapsed);
        }
    }
    times.sort_unstable();
    let at = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6;
    Ok((at(0.50), at(0.99)))
}

/// The median of `values` (sorted in place).
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
