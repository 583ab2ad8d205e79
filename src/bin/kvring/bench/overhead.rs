//! `--token-overhead`: the token's cost on the data path, round by round.

use super::{pin_caller, Options, ROUNDS};
use crate::drive::{latency, median, move_bytes, Progress, Route};
use kvring::{Opcode, RegionInfo, TransportKind};
use std::time::{Duration, Instant};

/// `--token-overhead`: tcp to a target with a token against tcp to one
/// without, from two initiators in this process, round by round: WRITE
/// 1 MiB throughput and WRITE 4 KiB single-block p50. The token is proven at
/// connect time; on the data path it costs one HMAC-SHA256 per frame
/// header each way (the header's number and MAC), never per payload byte.
pub(super) fn token_overhead(config: &kvring::config::Config, options: &Options) -> Result<(), String> {
    const TOKEN: &str = "bench-token-overhead";
    let sides = [None, Some(TOKEN)];
    let mut targets = Vec::new();
    for token in sides {
        let extra: Vec<String> = token.map(|t| vec!["--token".to_string(), t.to_string()]).unwrap_or_default();
        targets.push(crate::serve::Target::spawn(options.region_bytes, &extra)?);
    }
    let block = 1 << 20;
    let per_round = options.total.div_ceil(ROUNDS as u64).div_ceil(block) * block;
    let samples = (options.latency_samples / ROUNDS).max(100);
    let mut gbps = [Vec::new(), Vec::new()];
    let mut p50 = [Vec::new(), Vec::new()];
    for round in 0..ROUNDS {
        // Alternate which goes first; each side's initiator exists only for
        // its own measurement, so no idle engine's lanes spin beside it.
        for side in [round % 2, 1 - round % 2] {
            let mut builder = config.builder().name("bench-initiator").lanes(options.lanes);
            if let Some(token) = sides[side] {
                builder = builder.token(token);
            }
            let engine = builder.build().map_err(|e| e.to_string())?;
            let addr = &targets[side].addr;
            let segment = engine
                .open_segment_with(addr, Some(TransportKind::Tcp), Duration::from_secs(10))
                .map_err(|e| format!("opening {addr}: {e}"))?;
            let remote = segment.region(0).map_err(|e| e.to_string())?;
            let region_bytes = options.region_bytes.min(segment.regions()[0].len);
            let local = engine.alloc_region(region_bytes as usize, RegionInfo::raw()).map_err(|e| e.to_string())?;
            // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
            unsafe { local.fill_pattern(7) };
            let mut sub = engine.submitter().map_err(|e| e.to_string())?;
            pin_caller(&engine);
            let started = Instant::now();
            let label = format!("token overhead, round {}/{ROUNDS}", round + 1);
            let mut progress = Progress::new(label, per_round, options.json);
            let moved = move_bytes(
                &mut sub,
                Route { segment: &segment, local: &local, remote },
                Opcode::Write,
                region_bytes,
                block,
                per_round,
                options.shape(),
                &mut progress,
            )?;
            gbps[side].push(moved as f64 / started.elapsed().as_secs_f64() / 1e9);
            p50[side].push(
                latency(&mut sub, Route { segment: &segment, local: &local, remote }, Opcode::Write, 4096, samples)?.0,
            );
            drop(sub);
            engine.shutdown();
        }
    }
    let (plain_gbps, token_gbps) = (median(&mut gbps[0]), median(&mut gbps[1]));
    let (plain_p50, token_p50) = (median(&mut p50[0]), median(&mut p50[1]));
    if options.json {
        println!(
            "{}",
            serde_json::json!({
                "case": "token_overhead",
                "write_1mib_gbps": {"no_token": plain_gbps, "token": token_gbps, "ratio": token_gbps / plain_gbps},
                "write_4kib_p50_us": {"no_token": plain_p50, "token": token_p50, "ratio": token_p50 / plain_p50},
            })
        );
    } else {
        println!(
            "token overhead (tcp, same run, {ROUNDS} rounds each):\n  WRITE 1MiB  {token_gbps:7.2} GB/s with a token, {plain_gbps:7.2} GB/s without ({:5.1}%)\n  WRITE 4KiB  p50 {token_p50:7.2} us with a token, {plain_p50:7.2} us without ({:5.1}%)",
            100.0 * token_gbps / plain_gbps,
            100.0 * token_p50 / plain_p50
        );
    }
    Ok(())
}
