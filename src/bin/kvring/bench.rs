//! `kvring bench`: two engines on this host moving KV blocks.
//!
//! With no arguments it starts a target (`kvring serve`) in a second
//! process and drives it from this one over shm: WRITE and READ, 4 KiB,
//! 64 KiB and 1 MiB blocks, batches of 64, 1 GiB per case. Each case prints
//! throughput, single-block round-trip latency (p50/p99), and the memcpy
//! baseline for the same block size measured just before it, and verifies
//! the moved bytes by checksum on the target.

use crate::args::{format_lanes, format_size, BenchArgs};
use crate::drive::{latency, median, move_bytes, Progress, Shape};
use kvring::{Engine, Opcode, Region, RegionInfo, Segment, Submitter, TransportKind};
use std::time::{Duration, Instant};

const DEFAULT_BLOCK_SIZES: [u64; 3] = [4 << 10, 64 << 10, 1 << 20];
/// Block size of a soak when none is given.
const DEFAULT_SOAK_BLOCK: u64 = 64 << 10;
/// Rounds each case alternates with its baseline.
const ROUNDS: usize = 5;

struct Options {
    ops: Vec<Opcode>,
    block_sizes: Vec<u64>,
    batch: usize,
    total: u64,
    lanes: usize,
    transport: TransportKind,
    json: bool,
    peer: Option<String>,
    region_bytes: u64,
    inflight: usize,
    latency_samples: usize,
    token: Option<String>,
    /// The target's raw-TCP sink, for the tcp baseline.
    raw_peer: Option<String>,
    metadata: Option<String>,
    /// Serve `/metrics` on this address while the bench runs.
    metrics: Option<std::net::SocketAddr>,
    /// Measure against the same engine with its counters off instead of
    /// memcpy or a raw socket.
    metrics_overhead: bool,
    /// Soak for this long instead of running the cases.
    duration: Option<Duration>,
    /// Move one request's KV cache of this model instead.
    kv: Option<crate::models::Model>,
    /// Tokens of that request.
    tokens: u64,
    /// Measure each case with this many idle connections held open to the
    /// target's data port, against the same case without them.
    idle_connections: usize,
    /// Measure tcp with a token against tcp without one, same run.
    token_overhead: bool,
    /// Write the report (JSON and SVG plots) of the cases here.
    report: Option<std::path::PathBuf>,
    /// Memory of (this side, the target), with `--memory`.
    memory: Option<(kvring::MemoryKind, kvring::MemoryKind)>,
    /// The GPU provider flags.
    gpu: crate::args::GpuArgs,
}

impl Options {
    /// How every case moves its bytes.
    fn shape(&self) -> Shape {
        Shape { batch: self.batch, inflight: self.inflight }
    }
}

/// The bench's options from its flags; `--lanes` falls back to the
/// configuration's `lanes`.
fn parse(args: BenchArgs, config: &kvring::config::Config) -> Result<Options, String> {
    let block_sizes = match args.block_size {
        sizes if !sizes.is_empty() => sizes,
        _ if args.duration.is_some() => vec![DEFAULT_SOAK_BLOCK],
        _ => DEFAULT_BLOCK_SIZES.to_vec(),
    };
    let options = Options {
        ops: args.op.opcodes(),
        block_sizes,
        batch: args.batch,
        total: args.total,
        lanes: args.lanes.unwrap_or_else(|| config.get("lanes").and_then(|v| v.parse().ok()).unwrap_or(1)),
        transport: args.transport.unwrap_or(if crate::gpubench::involves_gpu(args.memory) {
            TransportKind::CudaIpc
        } else {
            TransportKind::Shm
        }),
        json: args.json,
        peer: args.peer,
        region_bytes: args.region_size,
        inflight: args.inflight,
        latency_samples: args.latency_samples,
        token: args.token,
        raw_peer: args.peer_raw,
        metadata: args.metadata,
        metrics: args.metrics,
        metrics_overhead: args.metrics_overhead,
        duration: args.duration,
        kv: args.kv,
        tokens: args.tokens,
        idle_connections: args.idle_connections,
        token_overhead: args.token_overhead,
        report: args.report,
        memory: args.memory,
        gpu: args.gpu,
    };
    if options.batch == 0 || options.inflight == 0 || options.total == 0 {
        return Err("--batch, --inflight and --total must be greater than zero".into());
    }
    for &block in &options.block_sizes {
        if block == 0 || block > options.region_bytes {
            return Err(format!(
                "--block-size {} must be within 1..=--region-size ({})",
                format_size(block),
                format_size(options.region_bytes)
            ));
        }
    }
    Ok(options)
}

struct CaseResult {
    op: Opcode,
    block: u64,
    gbps: f64,
    p50_us: f64,
    p99_us: f64,
    /// Median GB/s of the baseline rounds; `None` when there was none to
    /// measure (tcp to a target whose raw sink is not known).
    baseline_gbps: Option<f64>,
    verified: bool,
    bytes: u64,
    seconds: f64,
    /// Requests to the metadata server while the case ran (opens only; 0).
    metadata_calls: u64,
}

/// Runs `kvring bench`: the cases, a soak (`--duration`), a KV request
/// (`--kv`) or the token overhead (`--token-overhead`).
pub fn run(args: BenchArgs) -> Result<(), String> {
    // The initiator engine takes the config file and KVRING_* variables;
    // the bench's own flags override them (it takes no key flags).
    let config = crate::settings::load(args.config.as_deref(), &[])?;
    let mut options = parse(args, &config)?;
    if options.token_overhead {
        return token_overhead(&config, &options);
    }
    // Without --peer, the bench starts its own target (`kvring serve`).
    let target = if options.peer.is_some() { None } else { Some(spawn_target(&options)?) };
    let peer = options.peer.clone().unwrap_or_else(|| target.as_ref().expect("spawned").addr.clone());
    if options.raw_peer.is_none() {
        options.raw_peer = target.as_ref().and_then(|t| t.raw_addr.clone());
    }
    let gpu = match crate::gpubench::involves_gpu(options.memory) {
        true => Some(crate::gpubench::provider(&options.gpu)?),
        false => None,
    };
    let engine = initiator(&config, &options, gpu.clone())?;
    if let (Some(addr), false) = (engine.metrics_addr(), options.json) {
        println!("kvring bench: metrics at http://{addr}/metrics");
    }
    if let Some(model) = options.kv {
        pin_caller(&engine);
        let bench = crate::kvbench::KvBench {
            model,
            tokens: options.tokens,
            transport: options.transport,
            peer: &peer,
            raw_peer: options.raw_peer.as_deref(),
            token: options.token.as_deref(),
            json: options.json,
        };
        let result = crate::kvbench::run(&engine, &bench);
        engine.shutdown();
        drop(target);
        return result;
    }
    if let Some(duration) = options.duration {
        let plan = crate::soak::SoakPlan {
            peer: &peer,
            transport: options.transport,
            block: options.block_sizes[0],
            batch: options.batch,
            region_bytes: options.region_bytes,
            duration,
            json: options.json,
        };
        let result = crate::soak::run(&engine, &plan);
        engine.shutdown();
        drop(target);
        return result;
    }
    let segment = engine
        .open_segment_with(&peer, Some(options.transport), Duration::from_secs(10))
        .map_err(|e| format!("opening {peer}: {e}"))?;
    let remote = segment.regions().first().ok_or_else(|| format!("{peer} exposes no region"))?.clone();
    let region_bytes = options.region_bytes.min(remote.len);
    let info = crate::gpubench::local_info(options.memory);
    let local = engine.alloc_region(region_bytes as usize, info).map_err(|e| e.to_string())?;
    pin_caller(&engine);
    let mut sub = engine.submitter().map_err(|e| e.to_string())?;
    print_header(&engine, &segment, &peer, region_bytes, &options, gpu.as_deref());
    if let Some(gpu) = gpu {
        let result = gpu_cases(&mut sub, &segment, &local, remote.id, region_bytes, &options, gpu);
        drop(sub);
        engine.shutdown();
        drop(target);
        return result;
    }
    let mut results = Vec::new();
    for &op in &options.ops {
        for &block in &options.block_sizes {
            let calls_before = engine.metadata_calls();
            let mut result =
                run_case(&engine, &mut sub, &segment, &local, remote.id, region_bytes, op, block, &options)?;
            result.metadata_calls = engine.metadata_calls() - calls_before;
            print_result(&result, &options);
            results.push(result);
        }
    }
    drop(sub);
    engine.shutdown();
    drop(target);
    if let Some(dir) = &options.report {
        write_report(dir, &results, &options)?;
    }
    if results.iter().all(|r| r.verified) {
        Ok(())
    } else {
        Err("verification failed: the target's bytes differ from what was moved".into())
    }
}

/// `--memory` with GPU memory: the cases over cuda_ipc, their report, and
/// whether every case verified.
fn gpu_cases(
    sub: &mut Submitter,
    segment: &Segment,
    local: &Region,
    remote: kvring::RegionId,
    region_bytes: u64,
    options: &Options,
    gpu: std::sync::Arc<dyn kvring::gpu::Gpu>,
) -> Result<(), String> {
    let plan = crate::gpubench::Plan {
        ops: &options.ops,
        block_sizes: &options.block_sizes,
        shape: options.shape(),
        total: options.total,
        latency_samples: options.latency_samples,
        json: options.json,
        memory: options.memory.expect("GPU cases have --memory"),
        gpu,
    };
    let cases = crate::gpubench::run(sub, segment, local, remote, region_bytes, &plan)?;
    if let Some(dir) = &options.report {
        let paths = crate::report::write(dir, &crate::gpubench::report_rows(&cases))
            .map_err(|e| format!("--report {}: {e}", dir.display()))?;
        paths.iter().for_each(|path| eprintln!("kvring bench: report: {}", path.display()));
    }
    match cases.iter().all(|c| c.verified) {
        true => Ok(()),
        false => Err("verification failed: the target's bytes differ from what was moved".into()),
    }
}

/// The cases' header: lanes and cores, peer, transport, memory, sizes;
/// and, when the cases have no baseline, how to get one.
fn print_header(
    engine: &Engine,
    segment: &Segment,
    peer: &str,
    region_bytes: u64,
    options: &Options,
    gpu: Option<&dyn kvring::gpu::Gpu>,
) {
    if !options.json {
        let memory = match (options.memory, gpu) {
            (Some((local, remote)), Some(gpu)) => format!(
                ", memory {} -> {} on {}",
                crate::args::format_memory(local),
                crate::args::format_memory(remote),
                crate::gpubench::describe(&options.gpu, gpu)
            ),
            _ => String::new(),
        };
        println!(
            "kvring bench: {}, peer {} ({}), transport {}{memory}, region {}, batch {}, {} per case",
            format_lanes(&engine.lane_cores()),
            segment.name(),
            peer,
            options.transport.name(),
            format_size(region_bytes),
            options.batch,
            format_size(options.total)
        );
    }
    if baseline_name(options).is_none() {
        // An external target's sink is not known: say how to get the ratio.
        let hint = "no raw-TCP baseline: give --peer-raw ADDR (kvring serve prints its raw sink)";
        if options.json {
            eprintln!("kvring bench: {hint}");
        } else {
            println!("{hint}");
        }
    }
}

/// The target the bench starts when given no `--peer`: a `kvring serve`
/// child, with a KV cache for `--kv`.
fn spawn_target(options: &Options) -> Result<crate::serve::Target, String> {
    let extra: Vec<String> = match &options.kv {
        Some(model) => {
            let blocks = crate::kvbench::target_blocks(model, options.tokens);
            vec!["--kv".into(), model.name.into(), "--kv-blocks".into(), blocks.to_string()]
        }
        None => match options.memory {
            Some((_, remote)) => crate::gpubench::target_flags(remote, &options.gpu),
            // cma is for memory a peer cannot map: the target serves its own.
            None if options.transport == TransportKind::Cma => vec!["--caller-memory".into()],
            None => Vec::new(),
        },
    };
    crate::serve::Target::spawn(options.region_bytes, &extra)
}

/// The bench's own engine: the configuration, then its flags.
fn initiator(
    config: &kvring::config::Config,
    options: &Options,
    gpu: Option<std::sync::Arc<dyn kvring::gpu::Gpu>>,
) -> Result<Engine, String> {
    let mut builder = config.builder().name("bench-initiator").lanes(options.lanes);
    if let Some(gpu) = gpu {
        builder = builder.gpu(gpu);
    }
    if let Some(token) = &options.token {
        builder = builder.token(token.as_str());
    }
    if let Some(url) = &options.metadata {
        let mode = kvring::MetadataMode::parse(url).map_err(|e| format!("--metadata: {e}"))?;
        builder = builder.metadata(mode);
    }
    if let Some(addr) = options.metrics {
        builder = builder.metrics(addr);
    }
    builder.build().map_err(|e| e.to_string())
}

/// `--token-overhead`: tcp to a target with a token against tcp to one
/// without, from two initiators in this process, round by round: WRITE
/// 1 MiB throughput and WRITE 4 KiB single-block p50. The token is proven at
/// connect time only, so the data path should not notice it.
fn token_overhead(config: &kvring::config::Config, options: &Options) -> Result<(), String> {
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
            local.fill_pattern(7);
            let mut sub = engine.submitter().map_err(|e| e.to_string())?;
            pin_caller(&engine);
            let started = Instant::now();
            let label = format!("token overhead, round {}/{ROUNDS}", round + 1);
            let mut progress = Progress::new(label, per_round, options.json);
            let moved = move_bytes(
                &mut sub,
                &segment,
                &local,
                remote,
                Opcode::Write,
                region_bytes,
                block,
                per_round,
                options.shape(),
                &mut progress,
            )?;
            gbps[side].push(moved as f64 / started.elapsed().as_secs_f64() / 1e9);
            p50[side].push(latency(&mut sub, &segment, &local, remote, Opcode::Write, 4096, samples)?.0);
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

/// Pins the bench thread to a core no lane uses, when there is one.
fn pin_caller(engine: &Engine) {
    let used: Vec<usize> = engine.lane_cores().into_iter().flatten().collect();
    if let Some(core) = core_affinity::get_core_ids().unwrap_or_default().into_iter().find(|c| !used.contains(&c.id)) {
        core_affinity::set_for_current(core);
    }
}

#[allow(clippy::too_many_arguments)]
fn run_case(
    engine: &Engine,
    sub: &mut Submitter,
    segment: &Segment,
    local: &Region,
    remote: kvring::RegionId,
    region_bytes: u64,
    op: Opcode,
    block: u64,
    options: &Options,
) -> Result<CaseResult, String> {
    let seed = (block << 8) ^ op as u64 ^ engine.epoch();
    let blocks_in_region = (region_bytes / block) as usize;

    // Prepare: the source holds a fresh pattern, the destination something else.
    let label = format!("{} {}", op.name(), format_size(block));
    match op {
        Opcode::Write => local.fill_pattern(seed),
        Opcode::Read => {
            local.fill_pattern(seed);
            let whole = (region_bytes / block) * block;
            let mut seeding = Progress::new(format!("{label}: seeding"), whole, options.json);
            move_bytes(
                sub,
                segment,
                local,
                remote,
                Opcode::Write,
                region_bytes,
                block,
                whole,
                options.shape(),
                &mut seeding,
            )?;
            local.fill_pattern(!seed);
        }
    }

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
    let (mut bytes, mut seconds) = (0u64, 0f64);
    for _ in 0..ROUNDS {
        let what = (op, block, per_round);
        let (baseline, flood) =
            baseline_round(engine, sub, segment, local, remote, region_bytes, what, options, &mut progress)?;
        baseline_rounds.extend(baseline);
        let started = Instant::now();
        let moved = move_bytes(
            sub,
            segment,
            local,
            remote,
            op,
            region_bytes,
            block,
            per_round,
            options.shape(),
            &mut progress,
        )?;
        let elapsed = started.elapsed().as_secs_f64();
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
        bytes += moved;
        seconds += elapsed;
    }
    drop(progress);
    let baseline_gbps = (!baseline_rounds.is_empty()).then(|| median(&mut baseline_rounds));
    let gbps = median(&mut kvring_rounds);

    let (p50_us, p99_us) = latency(sub, segment, local, remote, op, block, options.latency_samples)?;

    // Null moves nothing, so there is nothing to verify.
    let verified = if options.transport != TransportKind::Null {
        let expected = local.checksum(0, covered as usize).map_err(|e| e.to_string())?;
        let actual = segment.remote_checksum(remote, 0, covered, Duration::from_secs(30)).map_err(|e| e.to_string())?;
        expected == actual
    } else {
        true
    };
    Ok(CaseResult { op, block, gbps, p50_us, p99_us, baseline_gbps, verified, bytes, seconds, metadata_calls: 0 })
}

/// One round of the case's baseline (`what`: op, block size, bytes): GB/s,
/// `None` when there is none to measure; with `--idle-connections`, the
/// flood the measured round that follows runs beside.
#[allow(clippy::too_many_arguments)]
fn baseline_round(
    engine: &Engine,
    sub: &mut Submitter,
    segment: &Segment,
    local: &Region,
    remote: kvring::RegionId,
    region_bytes: u64,
    what: (Opcode, u64, u64),
    options: &Options,
    progress: &mut Progress,
) -> Result<(Option<f64>, Option<crate::flood::IdleFlood>), String> {
    let (op, block, per_round) = what;
    let gbps = match (options.metrics_overhead, options.transport, &options.raw_peer) {
        _ if options.idle_connections > 0 => {
            // The same case without the flood; the measured round after
            // this one runs with it.
            let started = Instant::now();
            let moved =
                move_bytes(sub, segment, local, remote, op, region_bytes, block, per_round, options.shape(), progress)?;
            let gbps = moved as f64 / started.elapsed().as_secs_f64() / 1e9;
            let addr = segment.tcp_addr().ok_or("--idle-connections: the target serves no tcp")?;
            let addr = addr.parse().map_err(|e| format!("--idle-connections: {addr}: {e}"))?;
            return Ok((Some(gbps), Some(crate::flood::IdleFlood::start(addr, options.idle_connections))));
        }
        (true, _, _) => {
            // The same case on the same engine, its counters off.
            engine.set_metrics_enabled(false);
            let started = Instant::now();
            let moved =
                move_bytes(sub, segment, local, remote, op, region_bytes, block, per_round, options.shape(), progress);
            engine.set_metrics_enabled(true);
            Some(moved? as f64 / started.elapsed().as_secs_f64() / 1e9)
        }
        (false, TransportKind::Tcp, Some(raw)) => {
            Some(crate::raw::baseline(raw, options.token.as_deref(), op == Opcode::Write, block, per_round)?)
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

/// What the case is measured against; `None` when nothing is (tcp to a
/// target whose raw sink is not known).
fn baseline_name(options: &Options) -> Option<&'static str> {
    if options.metrics_overhead {
        return Some("metrics-off");
    }
    if options.idle_connections > 0 {
        return Some("no-flood");
    }
    match (options.transport, &options.raw_peer) {
        (TransportKind::Tcp, Some(_)) => Some("raw-tcp"),
        (TransportKind::Tcp, None) => None,
        _ => Some("memcpy"),
    }
}

fn print_result(r: &CaseResult, options: &Options) {
    let ratio = r.baseline_gbps.filter(|&b| b > 0.0).map(|b| r.gbps / b);
    let batches = r.bytes.div_ceil(r.block * options.batch as u64).max(1);
    if options.json {
        let line = serde_json::json!({
            "op": r.op.name(),
            "transport": options.transport.name(),
            "block_bytes": r.block,
            "batch": options.batch,
            "lanes": options.lanes,
            "total_bytes": r.bytes,
            "seconds": r.seconds,
            "gbps": r.gbps,
            "p50_us": r.p50_us,
            "p99_us": r.p99_us,
            "baseline": baseline_name(options).unwrap_or("none"),
            "baseline_gbps": r.baseline_gbps,
            "ratio": ratio,
            "verified": r.verified,
            "metadata_calls": r.metadata_calls,
            "metadata_calls_per_batch": r.metadata_calls as f64 / batches as f64,
        });
        println!("{line}");
    } else {
        let against = match (baseline_name(options), r.baseline_gbps) {
            (Some(name), Some(gbps)) => {
                format!("{name} {gbps:7.2} GB/s  ({:5.1}% of it)", ratio.unwrap_or(0.0) * 100.0)
            }
            _ => format!("{:34}", "no baseline"),
        };
        println!(
            "{:5} {:>6}  {:7.2} GB/s  p50 {:7.2} us  p99 {:7.2} us  {against}  {}",
            r.op.name(),
            format_size(r.block),
            r.gbps,
            r.p50_us,
            r.p99_us,
            if r.verified { "verified" } else { "VERIFY FAILED" }
        );
        if options.metadata.is_some() {
            println!("      metadata: {} requests over {batches} batches (resolved once, at open)", r.metadata_calls);
        }
    }
}

/// `--report DIR`: the cases as the report plots them; prints the paths
/// written (on stderr with `--json`, whose stdout is one line per case).
fn write_report(dir: &std::path::Path, results: &[CaseResult], options: &Options) -> Result<(), String> {
    let baseline = baseline_name(options);
    let rows: Vec<crate::report::Row> = results
        .iter()
        .map(|r| crate::report::Row {
            transport: options.transport.name().to_string(),
            op: r.op.name().to_string(),
            block_bytes: r.block,
            gbps: r.gbps,
            p50_us: r.p50_us,
            p99_us: r.p99_us,
            baseline: baseline.zip(r.baseline_gbps).map(|(name, gbps)| (name.to_string(), gbps)),
        })
        .collect();
    let paths = crate::report::write(dir, &rows).map_err(|e| format!("--report {}: {e}", dir.display()))?;
    for path in paths {
        if options.json {
            eprintln!("kvring bench: report: {}", path.display());
        } else {
            println!("report: {}", path.display());
        }
    }
    Ok(())
}
