//! `kvring bench --checksum`: each case moved plain and checksummed end to
//! end (`Batch::checksum`), beside the same-run baseline (memcpy for shm
//! and cma, the raw socket for tcp), the three interleaved round by round
//! so a burst of noise lands on all of them; each ratio is the median of
//! the per-round ratios.

use super::case::{baseline_round, RatioSpread};
use super::output::baseline_name;
use super::{Options, ROUNDS};
use crate::args::format_size;
use crate::drive::{median, move_bytes, seed_case, verify, Progress, Route, Shape};
use kvring::{Engine, Opcode, Submitter};
use std::time::Instant;

/// Every case of the sweep, plain and checksummed; fails when a target's
/// bytes differ from what was moved.
pub(super) fn cases(
    engine: &Engine,
    sub: &mut Submitter,
    route: Route<'_>,
    region_bytes: u64,
    options: &Options,
) -> Result<(), String> {
    let base = baseline_name(options).unwrap_or("none");
    if !options.json {
        println!("{:<6} {:>9} {:>10} {:>16} {:>24}", "op", "block", base, "plain", "checksummed");
    }
    let mut all_verified = true;
    for &op in &options.ops {
        for &block in &options.block_sizes {
            all_verified &= one_case(engine, sub, route, region_bytes, (op, block), options, base)?;
        }
    }
    match all_verified {
        true => Ok(()),
        false => Err("verification failed: the target's bytes differ from what was moved".into()),
    }
}

/// GB/s of one round moving `bytes` with `shape`.
fn round(
    sub: &mut Submitter,
    route: Route<'_>,
    (op, region_bytes, block, bytes): (Opcode, u64, u64, u64),
    shape: Shape,
    progress: &mut Progress,
) -> Result<f64, String> {
    let started = Instant::now();
    let moved = move_bytes(sub, route, op, region_bytes, block, bytes, shape, progress)?;
    Ok(moved as f64 / started.elapsed().as_secs_f64() / 1e9)
}

fn one_case(
    engine: &Engine,
    sub: &mut Submitter,
    route: Route<'_>,
    region_bytes: u64,
    (op, block): (Opcode, u64),
    options: &Options,
    base: &str,
) -> Result<bool, String> {
    let label = format!("{} {}", op.name(), format_size(block));
    let seed = (block << 8) ^ op as u64 ^ engine.epoch() ^ 0xc5c;
    seed_case(sub, route, region_bytes, (op, block, seed), (options.shape(), options.json), &label)?;
    let per_round = options.total.div_ceil(ROUNDS as u64).div_ceil(block) * block;
    let covered = ((region_bytes / block) * block).min(per_round);
    let mut progress = Progress::new(label.clone(), per_round * ROUNDS as u64 * 2, options.json);
    let plain = options.shape();
    let checked = Shape { checksum: true, ..plain };
    let what = (op, region_bytes, block, per_round);
    let (mut bases, mut plains, mut checks) = (Vec::new(), Vec::new(), Vec::new());
    let (mut plain_pairs, mut checked_pairs, mut checked_to_plain) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        let (baseline, _) =
            baseline_round(engine, sub, route, region_bytes, (op, block, per_round), options, &mut progress)?;
        let p = round(sub, route, what, plain, &mut progress)?;
        let c = round(sub, route, what, checked, &mut progress)?;
        if let Some(b) = baseline {
            bases.push(b);
            plain_pairs.push((p, b));
            checked_pairs.push((c, b));
        }
        checked_to_plain.push((c, p));
        plains.push(p);
        checks.push(c);
    }
    drop(progress);
    let verified = verify(route, covered)?;
    let ratio = |pairs: &[(f64, f64)]| RatioSpread::of(pairs).map(|s| s.median);
    let (base_gbps, plain_gbps, checked_gbps) =
        ((!bases.is_empty()).then(|| median(&mut bases)), median(&mut plains), median(&mut checks));
    let (plain_ratio, checked_ratio, to_plain) = (ratio(&plain_pairs), ratio(&checked_pairs), ratio(&checked_to_plain));
    if options.json {
        let line = serde_json::json!({
            "op": op.name(), "transport": options.transport.name(), "block_bytes": block,
            "baseline": base, "baseline_gbps": base_gbps,
            "plain_gbps": plain_gbps, "plain_to_baseline": plain_ratio,
            "checksummed_gbps": checked_gbps, "checksummed_to_baseline": checked_ratio,
            "checksummed_to_plain": to_plain, "rounds": ROUNDS, "verified": verified,
        });
        println!("{line}");
    } else {
        let x = |r: Option<f64>| r.map_or("-".to_string(), |r| format!("{r:.2}x"));
        let gbps = |g: Option<f64>| g.map_or("-".to_string(), |g| format!("{g:.2} GB/s"));
        println!(
            "{:<6} {:>9} {:>10} {:>10} ({:>5}) {:>10} ({:>5}, {:>5} of plain){}",
            op.name(),
            format_size(block),
            gbps(base_gbps),
            gbps(Some(plain_gbps)),
            x(plain_ratio),
            gbps(Some(checked_gbps)),
            x(checked_ratio),
            x(to_plain),
            if verified { "" } else { "  NOT VERIFIED" }
        );
    }
    Ok(verified)
}
