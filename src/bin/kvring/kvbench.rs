//! `kvring bench --kv MODEL`: one request's KV cache of `--tokens N` moved
//! from a prefill engine (this process) to a decode engine (`kvring serve
//! --kv MODEL`), planned by the KV layer from block ids, beside the same-run
//! baseline (memcpy of the same ranges for shm, a raw socket for tcp).

use crate::models::Model;
use kvring::kv::{plan_blocks, KvLayout};
use kvring::{Batch, BlockDesc, Engine, Opcode, Region, RegionInfo, Segment, TransportKind};
use std::time::{Duration, Instant};

/// Bytes the bench aims to move in all (at least `MIN_REQUESTS` requests).
const TARGET_BYTES: u64 = 1 << 30;
const MIN_REQUESTS: u64 = 10;
const MAX_REQUESTS: u64 = 2000;
/// Tokens of the planning figure the issue names.
const PLAN_TOKENS: u64 = 128 * 1024;
const PLAN_REPEATS: usize = 21;

/// What to run.
pub struct KvBench<'a> {
    pub model: Model,
    pub tokens: u64,
    pub transport: TransportKind,
    pub peer: &'a str,
    pub raw_peer: Option<&'a str>,
    /// The cluster's token, for the raw sink's challenge.
    pub token: Option<&'a str>,
    pub json: bool,
}

/// Blocks the decode side must hold for a request of `tokens`.
pub fn target_blocks(model: &Model, tokens: u64) -> u64 {
    2 * tokens.div_ceil(model.tokens_per_block).max(1)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Median time to plan a request of `tokens` (ids consecutive, or every
/// other block: the worst case for coalescing), in microseconds.
fn planning_us(model: &Model, tokens: u64, scattered: bool) -> Result<f64, String> {
    let blocks = tokens.div_ceil(model.tokens_per_block);
    let shape = model.shape(2 * blocks)?;
    let local = KvLayout::contiguous(shape, kvring::RegionId::new(0, 1), 0).map_err(|e| e.to_string())?;
    let remote = KvLayout::contiguous(shape, kvring::RegionId::new(1, 1), 0).map_err(|e| e.to_string())?;
    let src: Vec<u64> = (0..blocks).map(|i| if scattered { 2 * i } else { i }).collect();
    let dst: Vec<u64> = (0..blocks).map(|i| if scattered { 2 * i + 1 } else { blocks + i }).collect();
    let mut times = Vec::with_capacity(PLAN_REPEATS);
    for _ in 0..PLAN_REPEATS {
        let started = Instant::now();
        let plan = plan_blocks(&local, &remote, Opcode::Write, &src, &dst).map_err(|e| e.to_string())?;
        times.push(started.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(plan);
    }
    Ok(median(&mut times))
}

pub fn run(engine: &Engine, bench: &KvBench<'_>) -> Result<(), String> {
    let model = bench.model;
    let blocks = bench.tokens.div_ceil(model.tokens_per_block).max(1);
    let shape = model.shape(2 * blocks)?;
    let bytes = shape.bytes().map_err(|e| e.to_string())?;
    let region = engine.alloc_region(bytes as usize, RegionInfo::raw()).map_err(|e| e.to_string())?;
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { region.fill_pattern(0x4b56) };
    let local = KvLayout::contiguous(shape, region.id(), 0).map_err(|e| e.to_string())?;
    let segment = engine
        .open_segment_with(bench.peer, Some(bench.transport), Duration::from_secs(10))
        .map_err(|e| format!("opening {}: {e}", bench.peer))?;
    let remote =
        segment.kv_layout(Duration::from_secs(10)).map_err(|e| format!("memory info from {}: {e}", bench.peer))?;
    local.check_compatible(&remote).map_err(|e| e.to_string())?;
    let dst_base = if remote.blocks() >= 2 * blocks { blocks } else { 0 };
    let src: Vec<u64> = (0..blocks).collect();
    let dst: Vec<u64> = (dst_base..dst_base + blocks).collect();

    let started = Instant::now();
    let descs = plan_blocks(&local, &remote, Opcode::Write, &src, &dst).map_err(|e| e.to_string())?;
    let plan_us = started.elapsed().as_secs_f64() * 1e6;
    let descs_before = blocks * shape.kinds().count() as u64 * shape.layers as u64;
    let request_bytes: u64 = descs.iter().map(|d| d.len).sum();
    let requests = (TARGET_BYTES / request_bytes.max(1)).clamp(MIN_REQUESTS, MAX_REQUESTS);

    let rounds = measure(engine, bench, (&segment, &descs, bytes), (shape.key_block_bytes, request_bytes), requests)?;
    let Rounds { gbps, ms, baseline_gbps, ratio, requests } = rounds;
    let verified = verify(&region, &segment, &descs)?;
    let plan_128k_us = planning_us(&model, PLAN_TOKENS, false)?;
    let plan_128k_scattered_us = planning_us(&model, PLAN_TOKENS, true)?;
    let baseline = match bench.transport {
        TransportKind::Tcp if bench.raw_peer.is_some() => "raw-tcp",
        TransportKind::Tcp => "none",
        _ => "memcpy",
    };
    let round3 = |v: f64| (v * 1e3).round() / 1e3;
    if bench.json {
        let line = serde_json::json!({
            "mode": "kv", "model": model.name, "transport": bench.transport.name(), "tokens": bench.tokens,
            "blocks": blocks, "request_bytes": request_bytes, "requests": requests,
            "ms_per_request": round3(ms), "gbps": round3(gbps), "descs_before": descs_before, "descs_after": descs.len(),
            "plan_us": (plan_us * 10.0).round() / 10.0, "plan_128k_us": (plan_128k_us * 10.0).round() / 10.0,
            "plan_128k_scattered_us": (plan_128k_scattered_us * 10.0).round() / 10.0,
            "baseline": baseline, "baseline_gbps": baseline_gbps.map(round3),
            "ratio": ratio.map(|r| round3(r.median)), "ratio_low": ratio.map(|r| round3(r.low)),
            "ratio_high": ratio.map(|r| round3(r.high)), "rounds": crate::bench::ROUNDS,
            "verified": verified,
        });
        println!("{line}");
    } else {
        println!(
            "kv {} over {}: {} tokens = {blocks} blocks, {} per request, {requests} requests",
            model.name,
            bench.transport.name(),
            bench.tokens,
            crate::args::format_size(request_bytes)
        );
        let against = match (baseline_gbps, ratio) {
            (Some(b), Some(r)) => format!(
                "{baseline} {b:.2} GB/s ({:.1}% of it; paired rounds {:.1}-{:.1}%)",
                r.median * 100.0,
                r.low * 100.0,
                r.high * 100.0
            ),
            (Some(b), None) => format!("{baseline} {b:.2} GB/s"),
            (None, _) => {
                "no raw-TCP baseline: give --peer-raw ADDR (`kvring serve --raw-sink` prints its raw sink)".to_string()
            }
        };
        println!(
            "  {ms:.3} ms per request (p50), {gbps:.2} GB/s; {against}; {}",
            if verified { "verified" } else { "VERIFY FAILED" }
        );
        println!(
            "  descriptors: {descs_before} blocks x layers x kinds -> {} after coalescing; planning {plan_us:.1} us; 128k tokens: {plan_128k_us:.1} us (consecutive), {plan_128k_scattered_us:.1} us (every other block)",
            descs.len()
        );
    }
    if verified {
        Ok(())
    } else {
        Err("verification failed: the decode cache differs from what was pushed".into())
    }
}

/// What the rounds measured: kvring's GB/s (median round), its median
/// milliseconds per request, the baseline's GB/s (median round; none when
/// there is none to measure), the paired rounds' ratio, and the requests
/// pushed in all.
struct Rounds {
    gbps: f64,
    ms: f64,
    baseline_gbps: Option<f64>,
    ratio: Option<crate::bench::RatioSpread>,
    requests: u64,
}

/// kvring's pushes of the planned request and the same-run baseline
/// (memcpy of the same ranges, or the raw socket), alternating in
/// [`ROUNDS`](crate::bench::ROUNDS) rounds of `requests / ROUNDS` requests
/// each, odd rounds kvring first, as the other bench modes measure: one
/// noisy moment moves one pair, not the figure, and neither side always
/// follows the other. (Until 2026-11-27 the baseline ran once, before
/// all the pushes.)
fn measure(
    engine: &Engine,
    bench: &KvBench<'_>,
    (segment, descs, cache_bytes): (&Segment, &[BlockDesc], u64),
    (block, request_bytes): (u64, u64),
    requests: u64,
) -> Result<Rounds, String> {
    let rounds = crate::bench::ROUNDS as u64;
    let per_round = requests.div_ceil(rounds).max(1);
    let lane_cores = engine.lane_cores();
    // The memcpy baseline's two mappings as large as the cache, made once.
    let mut memcpy = match bench.transport {
        TransportKind::Tcp => None,
        _ => Some(Memcpy::new(descs, cache_bytes)?),
    };
    let baseline = |memcpy: &mut Option<Memcpy>| -> Result<Option<f64>, String> {
        match (bench.transport, bench.raw_peer, memcpy) {
            // One connection per lane, each on its lane's core, the ends
            // cycling through one request's bytes, as the pushes do.
            (TransportKind::Tcp, Some(raw), _) => crate::raw::streams(
                raw,
                bench.token,
                (true, block, request_bytes * per_round),
                (request_bytes, &lane_cores),
            )
            .map(Some),
            // None: tcp to a target whose raw sink is not known.
            (TransportKind::Tcp, None, _) => Ok(None),
            (_, _, Some(memcpy)) => memcpy.copy(per_round, lane_cores.first().copied().flatten()).map(Some),
            (_, _, None) => Ok(None),
        }
    };
    let mut sub = engine.submitter().map_err(|e| e.to_string())?;
    let (mut kvring_rounds, mut baseline_rounds, mut pairs, mut times) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let kvring_first = round % 2 == 1;
        let early =
            if kvring_first { Some(push_requests(&mut sub, segment, descs, per_round, &mut times)?) } else { None };
        let base = baseline(&mut memcpy)?;
        let seconds = match early {
            Some(seconds) => seconds,
            None => push_requests(&mut sub, segment, descs, per_round, &mut times)?,
        };
        let gbps = (request_bytes * per_round) as f64 / seconds / 1e9;
        kvring_rounds.push(gbps);
        if let Some(base) = base {
            baseline_rounds.push(base);
            pairs.push((gbps, base));
        }
    }
    Ok(Rounds {
        gbps: median(&mut kvring_rounds),
        ms: median(&mut times),
        baseline_gbps: (!baseline_rounds.is_empty()).then(|| median(&mut baseline_rounds)),
        ratio: crate::bench::RatioSpread::of(&pairs),
        requests: per_round * rounds,
    })
}

/// Pushes the planned request `requests` times, one at a time, adding each
/// one's milliseconds to `times`: the seconds they took.
fn push_requests(
    sub: &mut kvring::Submitter,
    segment: &Segment,
    descs: &[BlockDesc],
    requests: u64,
    times: &mut Vec<f64>,
) -> Result<f64, String> {
    let batch = Batch::write(segment).descs(descs);
    let all = Instant::now();
    for _ in 0..requests {
        let started = Instant::now();
        let id = sub.submit(&batch).map_err(|e| format!("submit: {e}"))?;
        match sub.wait(id, Duration::from_secs(30)).map_err(|e| format!("wait: {e}"))? {
            kvring::Outcome::Done { .. } => {}
            other => return Err(format!("request ended {other:?}")),
        }
        times.push(started.elapsed().as_secs_f64() * 1e3);
    }
    Ok(all.elapsed().as_secs_f64())
}

/// True when the decode side holds, range by range, what was pushed.
fn verify(region: &Region, segment: &Segment, descs: &[BlockDesc]) -> Result<bool, String> {
    let mut verified = true;
    for desc in descs {
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        let expected = unsafe { region.checksum(desc.local_offset, desc.len as usize) }.map_err(|e| e.to_string())?;
        let actual = segment
            .remote_checksum(desc.remote_region, desc.remote_offset, desc.len, Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        verified &= expected == actual;
    }
    Ok(verified)
}

/// The memcpy baseline: the plan's ranges copied between two shm mappings
/// as large as the cache, made once and kept for every round (as the
/// regions live through the whole bench).
struct Memcpy {
    src: memmap2::MmapMut,
    dst: memmap2::MmapMut,
    ranges: Vec<(usize, usize, usize)>,
}

impl Memcpy {
    fn new(descs: &[BlockDesc], bytes: u64) -> Result<Self, String> {
        let ranges: Vec<(usize, usize, usize)> =
            descs.iter().map(|d| (d.local_offset as usize, d.remote_offset as usize, d.len as usize)).collect();
        if ranges.iter().any(|&(s, d, l)| s + l > bytes as usize || d + l > bytes as usize) {
            return Err("baseline: a range falls outside the cache".into());
        }
        let src = crate::scratch::shm_buffer(bytes as usize)?;
        let dst = crate::scratch::shm_buffer(bytes as usize)?;
        Ok(Self { src, dst, ranges })
    }

    /// GB/s of copying the ranges `requests` times, on the lane's core.
    fn copy(&mut self, requests: u64, core: Option<usize>) -> Result<f64, String> {
        let (src_addr, dst_addr) = (self.src.as_mut_ptr() as usize, self.dst.as_mut_ptr() as usize);
        let ranges = &self.ranges;
        let copy = move || {
            if let Some(core) = core {
                core_affinity::set_for_current(core_affinity::CoreId { id: core });
            }
            let started = Instant::now();
            let mut moved = 0u64;
            for _ in 0..requests {
                for &(s, d, l) in ranges {
                    // SAFETY: both ranges lie inside their mappings (checked
                    // in `new`), which outlive this thread (joined below) and
                    // nothing else uses meanwhile (`&mut self`).
                    unsafe { std::ptr::copy((src_addr + s) as *const u8, (dst_addr + d) as *mut u8, l) };
                    moved += l as u64;
                }
            }
            moved as f64 / started.elapsed().as_secs_f64() / 1e9
        };
        std::thread::scope(|scope| scope.spawn(copy).join()).map_err(|_| "baseline thread panicked".to_string())
    }
}
