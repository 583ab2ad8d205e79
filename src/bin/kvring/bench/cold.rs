//! `--cold`: the cold path, measured over many fresh engines in this
//! process (one host, loopback).
//!
//! - Cold first transfer: for each of `--cold-pairs` fresh (target,
//!   initiator) pairs, the time from the initiator's `open_segment` (the
//!   handshake, the transport's connect, the lanes' attach) to its first
//!   4 KiB WRITE completed; p50 and p99, over tcp and shm, and rdma where
//!   this host has a device.
//! - Group open: each round, 8 fresh targets, opened by one fresh initiator
//!   with one `open_many` call and by another fresh initiator with 8
//!   `open_segment` calls in turn (which goes first alternates by round).
//!   The ratio is `open_many`'s time over the median single open of the
//!   same round: the target is ≤ 2.
//!
//! - CPU: the process's CPU time (every thread: the initiator's and the
//!   in-process targets' alike) spent by the group's `open_many` and by
//!   its 8 single opens, per open, and the floor it sets: the group's CPU
//!   time spread over this host's cores, over the single open's wall time.
//!   Where the ratio sits at that floor, the opens overlap and the group
//!   is bound by CPU, not by waiting.
//!
//! Every measurement of a round runs in turn with the others, transports
//! alternating, so a loaded host shifts all of them alike.

use super::Options;
use kvring::{Batch, BlockDesc, Engine, Outcome, RegionInfo, TransportKind};
use std::time::{Duration, Instant};

/// Bytes of the first transfer.
const FIRST_BLOCK: usize = 4096;
/// Peers of one group open (a TP-8 group).
const GROUP: usize = 8;
/// Deadline of every open and transfer of the bench.
const COLD_DEADLINE: Duration = Duration::from_secs(10);
/// The transports measured, in the order of their rows: tcp and shm, and
/// rdma where this host has a device (a NIC, or the fake libibverbs).
fn transports() -> Vec<TransportKind> {
    let mut measured = vec![TransportKind::Tcp, TransportKind::Shm];
    if kvring::host::rdma_devices().is_ok() {
        measured.push(TransportKind::Rdma);
    }
    measured
}

/// A fresh engine on loopback, one unpinned lane (many live at once here),
/// with rdma on when it is measured.
fn fresh(config: &kvring::config::Config, name: &str, transport: TransportKind) -> Result<Engine, String> {
    let loopback = "127.0.0.1:0".parse().expect("a valid address");
    let builder = config.builder().name(name).lanes(1).pin(false).listen(loopback);
    let builder = match transport {
        TransportKind::Rdma => config.rdma(builder, true),
        _ => builder,
    };
    builder.build().map_err(|e| format!("starting {name}: {e}"))
}

/// A fresh target with one region of `FIRST_BLOCK` bytes.
fn target(
    config: &kvring::config::Config,
    name: &str,
    transport: TransportKind,
) -> Result<(Engine, kvring::Region), String> {
    let engine = fresh(config, name, transport)?;
    let region = engine.alloc_region(FIRST_BLOCK, RegionInfo::raw()).map_err(|e| e.to_string())?;
    Ok((engine, region))
}

/// One fresh pair: the time from `open_segment` to the first 4 KiB WRITE
/// done, checked on the target.
fn first_transfer(config: &kvring::config::Config, transport: TransportKind, seed: u64) -> Result<Duration, String> {
    let (target, remote) = target(config, "cold-target", transport)?;
    let initiator = fresh(config, "cold-initiator", transport)?;
    let local = initiator.alloc_region(FIRST_BLOCK, RegionInfo::raw()).map_err(|e| e.to_string())?;
    let expected: Vec<u8> = (0..FIRST_BLOCK).map(|i| (i as u64 ^ seed.wrapping_mul(0x9e37_79b9)) as u8).collect();
    // SAFETY: no batch or peer touches this fresh region yet.
    unsafe { local.write_at(0, &expected).map_err(|e| e.to_string())? };
    // What an engine sets up once, before it knows its peers.
    let mut sub = initiator.submitter().map_err(|e| e.to_string())?;
    let addr = target.control_addr().to_string();
    let start = Instant::now();
    let segment = initiator
        .open_segment_with(&addr, Some(transport), COLD_DEADLINE)
        .map_err(|e| format!("opening {addr} over {}: {e}", transport.name()))?;
    let desc = BlockDesc::new(local.id(), 0, remote.id(), 0, FIRST_BLOCK as u64);
    let id = sub.submit(&Batch::write(&segment).descs(&[desc])).map_err(|e| e.to_string())?;
    let outcome = sub.wait(id, COLD_DEADLINE).map_err(|e| e.to_string())?;
    let took = start.elapsed();
    if !matches!(outcome, Outcome::Done { .. }) {
        return Err(format!("first transfer over {}: {outcome:?}", transport.name()));
    }
    let mut landed = vec![0u8; FIRST_BLOCK];
    // SAFETY: the one batch naming these bytes is done.
    unsafe { remote.read_at(0, &mut landed).map_err(|e| e.to_string())? };
    if landed != expected {
        return Err(format!("first transfer over {}: the target's bytes differ", transport.name()));
    }
    drop(sub);
    initiator.shutdown();
    target.shutdown();
    Ok(took)
}

/// CPU time this process has used so far, all its threads together.
fn process_cpu() -> Duration {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `now` is a valid timespec for the call to fill.
    let failed = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) } != 0;
    match failed {
        true => Duration::ZERO,
        false => Duration::new(now.tv_sec as u64, now.tv_nsec as u32),
    }
}

/// One round of the group open.
struct GroupRound {
    /// `open_many`'s wall time.
    many: Duration,
    /// The median wall time of the 8 single opens.
    one: Duration,
    /// Process CPU time of the `open_many` call, per peer.
    many_cpu: Duration,
    /// Process CPU time of the 8 single opens, per open.
    one_cpu: Duration,
}

/// One round of the group open over `transport`.
fn group_round(
    config: &kvring::config::Config,
    transport: TransportKind,
    many_first: bool,
) -> Result<GroupRound, String> {
    let targets: Vec<_> =
        (0..GROUP).map(|i| target(config, &format!("cold-rank-{i}"), transport)).collect::<Result<_, _>>()?;
    let addrs: Vec<String> = targets.iter().map(|(t, _)| t.control_addr().to_string()).collect();
    let (mut many, mut singles) = (Duration::ZERO, Vec::with_capacity(GROUP));
    let (mut many_cpu, mut one_cpu) = (Duration::ZERO, Duration::ZERO);
    for many_now in [many_first, !many_first] {
        let initiator = fresh(config, "cold-group", transport)?;
        if many_now {
            let (start, cpu) = (Instant::now(), process_cpu());
            let opened = initiator.open_many(&addrs, Some(transport), COLD_DEADLINE);
            (many, many_cpu) = (start.elapsed(), process_cpu().saturating_sub(cpu));
            for (addr, result) in addrs.iter().zip(opened) {
                result.map_err(|e| format!("open_many of {addr}: {e}"))?;
            }
        } else {
            for addr in &addrs {
                let (start, cpu) = (Instant::now(), process_cpu());
                initiator.open_segment_with(addr, Some(transport), COLD_DEADLINE).map_err(|e| e.to_string())?;
                singles.push(start.elapsed());
                one_cpu += process_cpu().saturating_sub(cpu);
            }
        }
        initiator.shutdown();
    }
    for (target, _) in targets {
        target.shutdown();
    }
    singles.sort();
    let per_open = |total: Duration| total / GROUP as u32;
    Ok(GroupRound { many, one: singles[GROUP / 2], many_cpu: per_open(many_cpu), one_cpu: per_open(one_cpu) })
}

/// The `q` quantile (0..=1) of `values`, in microseconds.
fn quantile_us(values: &[Duration], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort();
    let at = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[at].as_secs_f64() * 1e6
}

/// `kvring bench --cold`.
pub(super) fn cold(config: &kvring::config::Config, options: &Options) -> Result<(), String> {
    let pairs = options.cold_pairs.max(1);
    let measured = transports();
    let mut first = vec![Vec::new(); measured.len()];
    let mut groups: Vec<Vec<GroupRound>> = (0..measured.len()).map(|_| Vec::new()).collect();
    for round in 0..pairs {
        // Each round starts at another transport, so none always goes first.
        for step in 0..measured.len() {
            let t = (round + step) % measured.len();
            first[t].push(first_transfer(config, measured[t], round as u64)?);
            groups[t].push(group_round(config, measured[t], round % 2 == 0)?);
        }
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()).min(GROUP);
    if !options.json {
        println!("kvring bench --cold: {pairs} fresh pairs and {pairs} groups of {GROUP} per transport, in-process, loopback, interleaved");
        println!(
            "{:<6} {:>12} {:>12} {:>14} {:>12} {:>8} {:>13} {:>13} {:>10}",
            "",
            "first p50 µs",
            "first p99 µs",
            "open_many8 p50",
            "one open p50",
            "ratio",
            "cpu/open many",
            "cpu/open one",
            "cpu floor"
        );
    }
    for (t, transport) in measured.iter().enumerate() {
        let rounds = &groups[t];
        // Ratios per round (same targets, same moment), then their medians.
        let per_round = |f: &dyn Fn(&GroupRound) -> f64| {
            let mut values: Vec<f64> = rounds.iter().map(f).collect();
            crate::drive::median(&mut values)
        };
        let ratio = per_round(&|g| g.many.as_secs_f64() / g.one.as_secs_f64().max(1e-9));
        // The group's CPU time spread over `cores`, against one open.
        let floor =
            per_round(&|g| (g.many_cpu.as_secs_f64() * GROUP as f64 / cores as f64) / g.one.as_secs_f64().max(1e-9));
        let times = |f: fn(&GroupRound) -> Duration| rounds.iter().map(f).collect::<Vec<_>>();
        let row = [
            quantile_us(&first[t], 0.5),
            quantile_us(&first[t], 0.99),
            quantile_us(&times(|g| g.many), 0.5),
            quantile_us(&times(|g| g.one), 0.5),
            quantile_us(&times(|g| g.many_cpu), 0.5),
            quantile_us(&times(|g| g.one_cpu), 0.5),
        ];
        if options.json {
            let line = serde_json::json!({
                "case": "cold", "transport": transport.name(), "pairs": pairs, "group": GROUP,
                "first_p50_us": row[0], "first_p99_us": row[1],
                "open_many_p50_us": row[2], "one_open_p50_us": row[3], "open_many_ratio": ratio,
                "open_many_cpu_per_open_us": row[4], "one_open_cpu_us": row[5],
                "cpu_floor_ratio": floor, "cores": cores,
            });
            println!("{line}");
        } else {
            println!(
                "{:<6} {:>12.0} {:>12.0} {:>14.0} {:>12.0} {:>7.2}x {:>13.0} {:>13.0} {:>9.2}x",
                transport.name(),
                row[0],
                row[1],
                row[2],
                row[3],
                ratio,
                row[4],
                row[5],
                floor
            );
        }
    }
    Ok(())
}
