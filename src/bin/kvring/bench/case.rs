//! One case of the bench: its rounds against the same-run baseline, its
//! latency beside the floor, and the check of the bytes on the target.

use super::{Options, ROUNDS};
use crate::args::format_size;
use crate::drive::{latency, median, move_bytes, seed_case, verify, Progress, Route};
use kvring::{Engine, Opcode, Submitter, TransportKind};
use std::time::Instant;

pub(super) struct CaseResult {
    pub op: Opcode,
    pub block: u64,
    pub gbps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// p50 of the busy-polled raw ping-pong of the same shape, measured
    /// beside the case's round trips (tcp with a known raw sink).
    pub floor_p50_us: Option<f64>,
    /// Median GB/s of the baseline rounds; `None` when there was none to
    /// measure (tcp to a target whose raw sink is not known).
    pub baseline_gbps: Option<f64>,
    /// kvring's GB/s over the baseline's, per pair of rounds run back to
    /// back: the median, and the lowest and highest (the spread).
    pub ratio: Option<RatioSpread>,
    pub verified: bool,
    pub bytes: u64,
    pub seconds: f64,
    /// Requests to the metadata server while the case ran (opens only; 0).
    pub metadata_calls: u64,
}

/// A ratio measured over several paired rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RatioSpread {
    pub median: f64,
    pub low: f64,
    pub high: f64,
}

impl RatioSpread {
    /// Of the ratios `kvring[i] / baseline[i]` of rounds that ran back to
    /// back; `None` when no pair had a baseline above zero.
    pub fn of(pairs: &[(f64, f64)]) -> Option<Self> {
        let mut ratios: Vec<f64> = pairs.iter().filter(|&&(_, b)| b > 0.0).map(|&(k, b)| k / b).collect();
        if ratios.is_empty() {
            return None;
        }
        let median = median(&mut ratios);
        Some(Self { median, low: ratios[0], high: ratios[ratios.len() - 1] })
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn run_case(
    engine: &Engine,
    sub: &mut Submitter,
    route: Route<'_>,
    region_bytes: u64,
    op: Opcode,
    block: u64,
    options: &Options,
) -> Result<CaseResult, String> {
    let seed = (block << 8) ^ op as u64 ^ engine.epoch();
    let blocks_in_region = (region_bytes / block) as usize;

    let label = format!("{} {}", op.name(), format_size(block));
    seed_case(sub, route, region_bytes, (op, block, seed), (options.shape(), options.json), &label)?;

    // The case and its baseline alternate in ROUNDS rounds, each moving a
    // share of the total, and each reports its median round: on a shared,
    // noisy machine this keeps a burst of noise from landing on one side.
    let per_round = options.total.div_ceil(ROUNDS as u64).div_ceil(block) * block;
    // Every round starts at the region's first block and cycles through it,
    // so what the rounds cover is one round's worth, capped at the region.
    let covered = (blocks_in_region as u64 * block).min(per_round);
    // The progress line counts the whole case (and a baseline that moves
    // through kvring too), not one round.
    let passes = if options.metrics_overhead || options.idle_connections > 0 { 2 } else { 1 };
    let mut progress = Progress::new(label, per_round * ROUNDS as u64 * passes, options.json);
    let mut baseline_rounds = Vec::with_capacity(ROUNDS);
    let mut kvring_rounds = Vec::with_capacity(ROUNDS);
    // Each kvring round beside the baseline round next to it: one noisy
    // moment moves one pair, not the figure.
    let mut pairs = Vec::with_capacity(ROUNDS);
    let (mut bytes, mut seconds) = (0u64, 0f64);
    let timed = |sub: &mut Submitter, progress: &mut Progress| -> Result<(u64, f64), String> {
        let started = Instant::now();
        let moved = move_bytes(sub, route, op, region_bytes, block, per_round, options.shape(), progress)?;
        Ok((moved, started.elapsed().as_secs_f64()))
    };
    for round in 0..ROUNDS {
        let what = (op, block, per_round);
        // Odd rounds run kvring first, so neither side always follows the
        // other (a socket or cache the other just warmed or left busy).
        // With a flood the baseline goes first: it starts the flood.
        let kvring_first = round % 2 == 1 && options.idle_connections == 0;
        let early = if kvring_first { Some(timed(sub, &mut progress)?) } else { None };
        let (baseline, flood) = baseline_round(engine, sub, route, region_bytes, what, options, &mut progress)?;
        baseline_rounds.extend(baseline);
        let (moved, elapsed) = match early {
            Some(done) => done,
            None => timed(sub, &mut progress)?,
        };
        if let Some(flood) = flood {
            if flood.open() < options.idle_connections / 2 {
                return Err(format!(
                    "--idle-connections: only {} of {} held open",
                    flood.open(),
                    options.idle_connections
                ));
            }
        }
        kvring_rounds.push(moved as f64 / elapsed / 1e9);
        if let Some(baseline) = baseline {
            pairs.push((moved as f64 / elapsed / 1e9, baseline));
        }
        bytes += moved;
        seconds += elapsed;
    }
    drop(progress);
    let baseline_gbps = (!baseline_rounds.is_empty()).then(|| median(&mut baseline_rounds));
    let gbps = median(&mut kvring_rounds);
    let ratio = RatioSpread::of(&pairs);

    let lane_core = engine.lane_cores().first().copied().flatten();
    let (p50_us, p99_us, floor_p50_us) = round_trips(lane_core, sub, route, op, block, options)?;

    // Null moves nothing, so there is nothing to verify.
    let verified = options.transport == TransportKind::Null || verify(route, covered)?;
    Ok(CaseResult {
        op,
        block,
        gbps,
        p50_us,
        p99_us,
        floor_p50_us,
        baseline_gbps,
        ratio,
        verified,
        bytes,
        seconds,
        metadata_calls: 0,
    })
}

/// One round of the case's baseline (`what`: op, block size, bytes): GB/s,
/// `None` when there is none to measure; with `--idle-connections`, the
/// flood the measured round that follows runs beside.
#[allow(clippy::too_many_arguments)]
pub(super) fn baseline_round(
    engine: &Engine,
    sub: &mut Submitter,
    route: Route<'_>,
    region_bytes: u64,
    what: (Opcode, u64, u64),
    options: &Options,
    progress: &mut Progress,
) -> Result<(Option<f64>, Option<crate::flood::IdleFlood>), String> {
    let segment = route.segment;
    let (op, block, per_round) = what;
    let gbps = match (options.metrics_overhead, options.transport, &options.raw_peer) {
        _ if options.idle_connections > 0 => {
            // The same case without the flood; the measured round after
            // this one runs with it.
            let started = Instant::now();
            let moved = move_bytes(sub, route, op, region_bytes, block, per_round, options.shape(), progress)?;
            let gbps = moved as f64 / started.elapsed().as_secs_f64() / 1e9;
            let addr = segment.tcp_addr().ok_or("--idle-connections: the target serves no tcp")?;
            let addr = addr.parse().map_err(|e| format!("--idle-connections: {addr}: {e}"))?;
            return Ok((Some(gbps), Some(crate::flood::IdleFlood::start(addr, options.idle_connections))));
        }
        (true, _, _) => {
            // The same case on the same engine, its counters off.
            engine.set_metrics_enabled(false);
            let started = Instant::now();
            let moved = move_bytes(sub, route, op, region_bytes, block, per_round, options.shape(), progress);
            engine.set_metrics_enabled(true);
            Some(moved? as f64 / started.elapsed().as_secs_f64() / 1e9)
        }
        (false, TransportKind::Tcp, Some(raw)) => {
            // One connection per lane, each where its lane runs, each end
            // cycling through as much memory as kvring's rounds do.
            let what = (op == Opcode::Write, block, per_round);
            let span = region_bytes.min(per_round);
            Some(crate::raw::streams(raw, options.token.as_deref(), what, (span, &engine.lane_cores()))?)
        }
        // The target's raw sink is not known: no plain socket to compare with.
        (false, TransportKind::Tcp, None) => None,
        _ => {
            let lane_core = engine.lane_cores().first().copied().flatten();
            Some(crate::scratch::memcpy_baseline(block, per_round, region_bytes, lane_core)?)
        }
    };
    Ok((gbps, None))
}

/// The case's single-block round trips (p50, p99) and, for tcp with a known
/// raw sink, the floor's p50: the busy-polled raw ping-pong of the same
/// shape, measured in two halves around kvring's, so a burst of noise lands
/// on both.
#[allow(clippy::too_many_arguments)]
fn round_trips(
    lane_core: Option<usize>,
    sub: &mut Submitter,
    route: Route<'_>,
    op: Opcode,
    block: u64,
    options: &Options,
) -> Result<(f64, f64, Option<f64>), String> {
    let samples = options.latency_samples;
    let raw = match (options.transport, &options.raw_peer) {
        (TransportKind::Tcp, Some(raw)) if samples > 0 && block <= 1 << 20 => Some(raw.as_str()),
        _ => None,
    };
    let token = options.token.as_deref();
    let write = op == Opcode::Write;
    let floor_half = |samples| match raw {
        Some(raw) => crate::raw::on_core(lane_core, || crate::raw::floor(raw, token, write, block, samples)),
        None => Ok(Vec::new()),
    };
    let mut floor = floor_half(samples.div_ceil(2))?;
    let (p50, p99) = latency(sub, route, op, block, samples)?;
    floor.extend(floor_half(samples / 2)?);
    let floor_p50 = (!floor.is_empty()).then(|| {
        floor.sort_unstable();
        floor[(floor.len() - 1) / 2].as_secs_f64() * 1e6
    });
    Ok((p50, p99, floor_p50))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_is_the_median_of_paired_rounds_with_its_spread() {
        // A noisy baseline round (the third) moves one pair, not the median.
        let pairs = [(2.0, 2.0), (2.2, 2.0), (2.0, 0.5), (1.8, 2.0), (2.0, 2.0)];
        let spread = RatioSpread::of(&pairs).unwrap();
        assert_eq!(spread.median, 1.0);
        assert_eq!((spread.low, spread.high), (0.9, 4.0));
        assert_eq!(RatioSpread::of(&[(1.0, 0.0)]), None);
        assert_eq!(RatioSpread::of(&[]), None);
    }
}
