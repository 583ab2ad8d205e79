//! `kvring bench --memory gpu --transport tcp`: GPU memory crossing hosts
//! over tcp, staged through pinned pages on both ends, beside two baselines
//! measured in the same run over the same connection's path: the same
//! blocks between host regions over kvring's tcp (what staging costs), and
//! a raw socket streaming the same bytes (the wire's roof).

use crate::args::format_size;
use crate::drive::{latency, median, move_bytes, seed_case, verify, Progress, Route, Sweep};
use kvring::{Engine, Opcode, Region, RegionId, Segment, Submitter};
use std::time::Instant;

/// Rounds each case alternates with its baselines.
const ROUNDS: usize = 5;

/// The regions a case moves between: GPU on both ends, and host on both
/// ends for the baseline.
pub struct Ends<'a> {
    pub local_gpu: &'a Region,
    pub remote_gpu: RegionId,
    pub local_host: &'a Region,
    pub remote_host: RegionId,
    pub region_bytes: u64,
}

/// What the cases need besides their ends.
pub struct Plan<'a> {
    pub engine: &'a Engine,
    /// The cases to run.
    pub sweep: Sweep<'a>,
    /// The target's raw sink and the token it asks for.
    pub raw: Option<(&'a str, Option<&'a str>)>,
    /// Memory of (this side, the target), as `--memory` names them.
    pub memory: [String; 2],
}

/// One case's figures.
pub struct Case {
    pub op: Opcode,
    pub block: u64,
    pub gbps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub host_gbps: f64,
    pub raw_gbps: Option<f64>,
    pub verified: bool,
}

/// Runs every (op, block size) case; returns them, printed.
pub fn run(sub: &mut Submitter, segment: &Segment, ends: &Ends, plan: &Plan) -> Result<Vec<Case>, String> {
    let mut cases = Vec::new();
    for &op in plan.sweep.ops {
        for &block in plan.sweep.block_sizes {
            let case = run_case(sub, segment, ends, plan, op, block)?;
            print(&case, plan);
            cases.push(case);
        }
    }
    Ok(cases)
}

fn run_case(
    sub: &mut Submitter,
    segment: &Segment,
    ends: &Ends,
    plan: &Plan,
    op: Opcode,
    block: u64,
) -> Result<Case, String> {
    let seed = (block << 8) ^ op as u64 ^ 0x9e37;
    let label = format!("{} {}", op.name(), format_size(block));
    let bytes = ends.region_bytes;
    let whole = (bytes / block) * block;
    for (local, remote) in [(ends.local_gpu, ends.remote_gpu), (ends.local_host, ends.remote_host)] {
        seed_case(
            sub,
            Route { segment, local, remote },
            bytes,
            (op, block, seed),
            (plan.sweep.shape, plan.sweep.json),
            &label,
        )?;
    }
    let per_round = plan.sweep.total.div_ceil(ROUNDS as u64).div_ceil(block) * block;
    let covered = whole.min(per_round);
    let mut progress = Progress::new(label, per_round * ROUNDS as u64 * 2, plan.sweep.json);
    let (mut ours, mut host, mut raw) = (Vec::new(), Vec::new(), Vec::new());
    let mut round = |local: &Region, remote: RegionId, progress: &mut Progress| -> Result<f64, String> {
        let started = Instant::now();
        let moved =
            move_bytes(sub, Route { segment, local, remote }, op, bytes, block, per_round, plan.sweep.shape, progress)?;
        Ok(moved as f64 / started.elapsed().as_secs_f64() / 1e9)
    };
    for _ in 0..ROUNDS {
        host.push(round(ends.local_host, ends.remote_host, &mut progress)?);
        if let Some((addr, token)) = plan.raw {
            let write = op == Opcode::Write;
            // Each end cycles through memory the size of the regions.
            let (what, span) = ((write, block, per_round), ends.region_bytes);
            raw.push(crate::raw::streams(addr, token, what, (span, &plan.engine.lane_cores()))?);
        }
        ours.push(round(ends.local_gpu, ends.remote_gpu, &mut progress)?);
    }
    drop(progress);
    let (p50_us, p99_us) = latency(
        sub,
        Route { segment, local: ends.local_gpu, remote: ends.remote_gpu },
        op,
        block,
        plan.sweep.latency_samples,
    )?;
    let verified = verify(Route { segment, local: ends.local_gpu, remote: ends.remote_gpu }, covered)?;
    Ok(Case {
        op,
        block,
        gbps: median(&mut ours),
        p50_us,
        p99_us,
        host_gbps: median(&mut host),
        raw_gbps: (!raw.is_empty()).then(|| median(&mut raw)),
        verified,
    })
}

fn print(case: &Case, plan: &Plan) {
    let of_host = case.gbps / case.host_gbps;
    let of_raw = case.raw_gbps.map(|raw| case.gbps / raw);
    if plan.sweep.json {
        let line = serde_json::json!({
            "op": case.op.name(),
            "transport": "tcp",
            "memory": plan.memory,
            "block_bytes": case.block,
            "batch": plan.sweep.shape.batch,
            "gbps": case.gbps,
            "p50_us": case.p50_us,
            "p99_us": case.p99_us,
            "baseline_host_tcp_gbps": case.host_gbps,
            "ratio_host_tcp": of_host,
            "baseline_raw_tcp_gbps": case.raw_gbps,
            "ratio_raw_tcp": of_raw,
            "verified": case.verified,
        });
        println!("{line}");
    } else {
        let raw = match (case.raw_gbps, of_raw) {
            (Some(gbps), Some(ratio)) => format!("raw-tcp {gbps:7.2} GB/s ({:5.1}% of it)", ratio * 100.0),
            _ => "no raw-tcp baseline".to_string(),
        };
        println!(
            "{:5} {:>6}  {:7.2} GB/s  p50 {:7.2} us  p99 {:7.2} us  host-tcp {:7.2} GB/s ({:5.1}% of it)  {raw}  {}",
            case.op.name(),
            format_size(case.block),
            case.gbps,
            case.p50_us,
            case.p99_us,
            case.host_gbps,
            of_host * 100.0,
            if case.verified { "verified" } else { "VERIFY FAILED" }
        );
    }
}
