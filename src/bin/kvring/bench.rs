//! `kvring bench`: two engines on this host moving KV blocks.
//!
//! With no arguments it starts a target (`kvring serve`) in a second
//! process and drives it from this one over shm: WRITE and READ, 4 KiB,
//! 64 KiB and 1 MiB blocks, batches of 64, 1 GiB per case. Each case prints
//! throughput, single-block round-trip latency (p50/p99), and the memcpy
//! baseline for the same block size measured just before it, and verifies
//! the moved bytes by checksum on the target.

use crate::args::{format_size, Args};
use kvring::{
    Batch, BatchId, BlockDesc, Engine, Opcode, Outcome, Region, RegionInfo, Segment, Submitter, TransportKind,
};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const DEFAULT_BLOCK_SIZES: [u64; 3] = [4 << 10, 64 << 10, 1 << 20];
const DEFAULT_BATCH: usize = 64;
/// Block size of a soak when none is given.
const DEFAULT_SOAK_BLOCK: u64 = 64 << 10;
const DEFAULT_TOTAL: u64 = 1 << 30;
const DEFAULT_REGION: u64 = 128 << 20;
const DEFAULT_INFLIGHT: usize = 8;
const DEFAULT_LATENCY_SAMPLES: usize = 5000;
const LATENCY_WARMUP: usize = 200;
/// Deadline of one wait in the bench: generous, never unbounded.
const WAIT_TIMEOUT: Duration = Duration::from_secs(30);
const PROGRESS_EVERY: Duration = Duration::from_millis(500);
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
    metrics: Option<String>,
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
}

fn parse(mut args: Args) -> Result<Options, String> {
    let ops = match args.value("--op")?.as_deref() {
        None | Some("both") => vec![Opcode::Write, Opcode::Read],
        Some("write") => vec![Opcode::Write],
        Some("read") => vec![Opcode::Read],
        Some(other) => return Err(format!("--op: {other:?} is not write, read or both")),
    };
    let block_sizes = match args.value("--block-size")? {
        None if args.has("--duration") => vec![DEFAULT_SOAK_BLOCK],
        None => DEFAULT_BLOCK_SIZES.to_vec(),
        Some(list) => list
            .split(',')
            .map(crate::args::parse_size)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("--block-size: {e}"))?,
    };
    let options = Options {
        ops,
        block_sizes,
        batch: args.number("--batch")?.unwrap_or(DEFAULT_BATCH),
        total: args.size("--total")?.unwrap_or(DEFAULT_TOTAL),
        lanes: args.number("--lanes")?.unwrap_or(1),
        transport: match args.value("--transport")? {
            None => TransportKind::Shm,
            Some(name) => TransportKind::parse(&name).map_err(|e| format!("--transport: {e}"))?,
        },
        json: args.switch("--json"),
        peer: args.value("--peer")?,
        region_bytes: args.size("--region-size")?.unwrap_or(DEFAULT_REGION),
        inflight: args.number("--inflight")?.unwrap_or(DEFAULT_INFLIGHT),
        latency_samples: args.number("--latency-samples")?.unwrap_or(DEFAULT_LATENCY_SAMPLES),
        token: args.value("--token")?,
        raw_peer: args.value("--peer-raw")?,
        metadata: args.value("--metadata")?,
        metrics: args.value("--metrics")?,
        metrics_overhead: args.switch("--metrics-overhead"),
        duration: args.duration("--duration")?,
        kv: args.value("--kv")?.map(|name| crate::models::find(&name)).transpose()?,
        tokens: args.number("--tokens")?.unwrap_or(8192) as u64,
        idle_connections: args.number("--idle-connections")?.unwrap_or(0),
        token_overhead: args.switch("--token-overhead"),
    };
    args.finish()?;
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

/// The target process started by the bench; killed and reaped on drop.
struct Target {
    child: Child,
    addr: String,
    raw_addr: Option<String>,
}

impl Target {
    fn spawn(region_bytes: u64, extra: &[String]) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("locating the kvring binary: {e}"))?;
        let mut child = Command::new(exe)
            .args(["serve", "--name", "bench-target", "--listen", "127.0.0.1:0", "--parent-watch"])
            .args(["--region-size", &region_bytes.to_string()])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting `kvring serve`: {e}"))?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        let field = |key: &str| line.split_whitespace().find_map(|f| f.strip_prefix(key)).map(str::to_string);
        let (addr, raw_addr) = (field("listen="), field("raw="));
        match (read, addr) {
            (Ok(_), Some(addr)) => Ok(Self { child, addr, raw_addr }),
            _ => {
                let _ = child.kill();
                let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
                Err(format!("`kvring serve` did not start ({status}); its error is above"))
            }
        }
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        // SAFETY: sending SIGTERM to our own child, which we still own.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct CaseResult {
    op: Opcode,
    block: u64,
    gbps: f64,
    p50_us: f64,
    p99_us: f64,
    baseline_gbps: f64,
    verified: bool,
    bytes: u64,
    seconds: f64,
    /// Requests to the metadata server while the case ran (opens only; 0).
    metadata_calls: u64,
}

pub fn run(mut args: Args) -> Result<(), String> {
    // The initiator engine takes the config file and KVRING_* variables;
    // the bench's own flags (below) override them.
    let config = crate::settings::load(&mut args, Some(&[]))?;
    let lanes_flag = args.has("--lanes");
    let mut options = parse(args)?;
    if !lanes_flag {
        options.lanes = config.get("lanes").and_then(|v| v.parse().ok()).unwrap_or(1);
    }
    if options.token_overhead {
        return token_overhead(&config, &options);
    }
    // Without --peer, the bench starts its own target (`kvring serve`).
    let target = if options.peer.is_some() { None } else { Some(spawn_target(&options)?) };
    let peer = options.peer.clone().unwrap_or_else(|| target.as_ref().expect("spawned").addr.clone());
    if options.raw_peer.is_none() {
        options.raw_peer = target.as_ref().and_then(|t| t.raw_addr.clone());
    }
    let engine = initiator(&config, &options)?;
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
    let local = engine.alloc_region(region_bytes as usize, RegionInfo::raw()).map_err(|e| e.to_string())?;
    pin_caller(&engine);
    let mut sub = engine.submitter().map_err(|e| e.to_string())?;
    if !options.json {
        println!(
            "kvring bench: {} lanes {:?}, peer {} ({}), transport {}, region {}, batch {}, {} per case",
            options.lanes,
            engine.lane_cores(),
            segment.name(),
            peer,
            options.transport.name(),
            format_size(region_bytes),
            options.batch,
            format_size(options.total)
        );
    }
    let mut all_verified = true;
    for &op in &options.ops {
        for &block in &options.block_sizes {
            let calls_before = engine.metadata_calls();
            let mut result =
                run_case(&engine, &mut sub, &segment, &local, remote.id, region_bytes, op, block, &options)?;
            result.metadata_calls = engine.metadata_calls() - calls_before;
            all_verified &= result.verified;
            print_result(&result, &options);
        }
    }
    drop(sub);
    engine.shutdown();
    drop(target);
    if all_verified {
        Ok(())
    } else {
        Err("verification failed: the target's bytes differ from what was moved".into())
    }
}

/// The target the bench starts when given no `--peer`: a `kvring serve`
/// child, with a KV cache for `--kv`.
fn spawn_target(options: &Options) -> Result<Target, String> {
    let extra: Vec<String> = match &options.kv {
        Some(model) => {
            let blocks = crate::kvbench::target_blocks(model, options.tokens);
            vec!["--kv".into(), model.name.into(), "--kv-blocks".into(), blocks.to_string()]
        }
        None => Vec::new(),
    };
    Target::spawn(options.region_bytes, &extra)
}

/// The bench's own engine: the configuration, then its flags.
fn initiator(config: &kvring::config::Config, options: &Options) -> Result<Engine, String> {
    let mut builder = config.builder().name("bench-initiator").lanes(options.lanes);
    if let Some(token) = &options.token {
        builder = builder.token(token.as_str());
    }
    if let Some(url) = &options.metadata {
        let mode = kvring::MetadataMode::parse(url).map_err(|e| format!("--metadata: {e}"))?;
        builder = builder.metadata(mode);
    }
    if let Some(addr) = &options.metrics {
        builder = builder.metrics(addr.parse().map_err(|_| format!("--metrics: {addr:?} is not an IP:port address"))?);
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
        targets.push(Target::spawn(options.region_bytes, &extra)?);
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
            let moved = move_bytes(
                &mut sub,
                &segment,
                &local,
                remote,
                Opcode::Write,
                region_bytes,
                block,
                per_round,
                options,
                "1MiB",
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
    // Null moves nothing, so there is nothing to verify.
    let verify_transport = options.transport != TransportKind::Null;

    // Prepare: the source holds a fresh pattern, the destination something else.
    match op {
        Opcode::Write => local.fill_pattern(seed),
        Opcode::Read => {
            local.fill_pattern(seed);
            let whole = (region_bytes / block) * block;
            move_bytes(sub, segment, local, remote, Opcode::Write, region_bytes, block, whole, options, "seeding")?;
            local.fill_pattern(!seed);
        }
    }

    // The case and its baseline alternate in ROUNDS rounds, each moving a
    // share of the total, and each reports its median round: on a shared,
    // noisy machine this keeps a burst of noise from landing on one side.
    let label = format!("{} {}", op.name(), format_size(block));
    let lane_core = engine.lane_cores().first().copied().flatten();
    let per_round = options.total.div_ceil(ROUNDS as u64).div_ceil(block) * block;
    // Every round starts at the region's first block and cycles through it,
    // so what the rounds cover is one round's worth, capped at the region.
    let covered = (blocks_in_region as u64 * block).min(per_round);
    let mut baseline_rounds = Vec::with_capacity(ROUNDS);
    let mut kvring_rounds = Vec::with_capacity(ROUNDS);
    let (mut bytes, mut seconds) = (0u64, 0f64);
    for _ in 0..ROUNDS {
        let mut flood = None;
        baseline_rounds.push(match (options.metrics_overhead, options.transport, &options.raw_peer) {
            _ if options.idle_connections > 0 => {
                // The same case without the flood; the measured round below
                // runs with it.
                let started = Instant::now();
                let moved =
                    move_bytes(sub, segment, local, remote, op, region_bytes, block, per_round, options, &label)?;
                let gbps = moved as f64 / started.elapsed().as_secs_f64() / 1e9;
                let addr = segment.tcp_addr().ok_or("--idle-connections: the target serves no tcp")?;
                let addr = addr.parse().map_err(|e| format!("--idle-connections: {addr}: {e}"))?;
                flood = Some(crate::flood::IdleFlood::start(addr, options.idle_connections));
                gbps
            }
            (true, _, _) => {
                // The same case on the same engine, its counters off.
                engine.set_metrics_enabled(false);
                let started = Instant::now();
                let moved =
                    move_bytes(sub, segment, local, remote, op, region_bytes, block, per_round, options, &label);
                engine.set_metrics_enabled(true);
                moved? as f64 / started.elapsed().as_secs_f64() / 1e9
            }
            (false, TransportKind::Tcp, Some(raw)) => {
                crate::raw::baseline(raw, options.token.as_deref(), op == Opcode::Write, block, per_round)?
            }
            (false, TransportKind::Tcp, None) => 0.0,
            _ => memcpy_baseline(block, per_round, region_bytes, lane_core)?,
        });
        let started = Instant::now();
        let moved = move_bytes(sub, segment, local, remote, op, region_bytes, block, per_round, options, &label)?;
        let elapsed = started.elapsed().as_secs_f64();
        if let Some(flood) = flood.take() {
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
    let baseline_gbps = median(&mut baseline_rounds);
    let gbps = median(&mut kvring_rounds);

    let (p50_us, p99_us) = latency(sub, segment, local, remote, op, block, options.latency_samples)?;

    let verified = if verify_transport {
        let expected = local.checksum(0, covered as usize).map_err(|e| e.to_string())?;
        let actual = segment.remote_checksum(remote, 0, covered, Duration::from_secs(30)).map_err(|e| e.to_string())?;
        expected == actual
    } else {
        true
    };
    Ok(CaseResult { op, block, gbps, p50_us, p99_us, baseline_gbps, verified, bytes, seconds, metadata_calls: 0 })
}

/// Moves `total` bytes in batches of `options.batch` blocks, cycling over
/// the region, with up to `options.inflight` batches in flight.
#[allow(clippy::too_many_arguments)]
fn move_bytes(
    sub: &mut Submitter,
    segment: &Segment,
    local: &Region,
    remote: kvring::RegionId,
    op: Opcode,
    region_bytes: u64,
    block: u64,
    total: u64,
    options: &Options,
    label: &str,
) -> Result<u64, String> {
    let blocks_in_region = region_bytes / block;
    let total_blocks = total.div_ceil(block);
    let mut descs: Vec<BlockDesc> = Vec::with_capacity(options.batch);
    let mut in_flight: VecDeque<BatchId> = VecDeque::with_capacity(options.inflight);
    let mut next_block = 0u64;
    let mut moved = 0u64;
    let mut last_progress = Instant::now();
    let progress = !options.json && std::io::stderr().is_terminal();
    while next_block < total_blocks || !in_flight.is_empty() {
        if next_block < total_blocks && in_flight.len() < options.inflight {
            descs.clear();
            let count = (options.batch as u64).min(total_blocks - next_block);
            for i in 0..count {
                let offset = ((next_block + i) % blocks_in_region) * block;
                descs.push(BlockDesc::new(local.id(), offset, remote, offset, block));
            }
            match sub.submit(&Batch::new(op, segment).descs(&descs)) {
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
            Outcome::Done { bytes } => moved += bytes,
            other => return Err(format!("{label}: batch ended {other:?}")),
        }
        if progress && last_progress.elapsed() >= PROGRESS_EVERY {
            last_progress = Instant::now();
            eprint!("\r  {label}: {} / {}   ", format_size(moved & !((1 << 20) - 1)), format_size(total));
            let _ = std::io::stderr().flush();
        }
    }
    if progress {
        eprint!("\r{:60}\r", "");
    }
    Ok(moved)
}

/// Single-block round trips: submit one block, wait for it; p50 and p99.
fn latency(
    sub: &mut Submitter,
    segment: &Segment,
    local: &Region,
    remote: kvring::RegionId,
    op: Opcode,
    block: u64,
    samples: usize,
) -> Result<(f64, f64), String> {
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

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// memcpy of `total` bytes in `block`-sized copies between two page-aligned,
/// pre-faulted shared mappings of the same size as the bench's regions, on
/// the lane's core: what the shm transport's copy costs alone.
fn memcpy_baseline(block: u64, total: u64, region_bytes: u64, core: Option<usize>) -> Result<f64, String> {
    let mut src = crate::scratch::shm_buffer(region_bytes as usize)?;
    let mut dst = crate::scratch::shm_buffer(region_bytes as usize)?;
    crate::scratch::fill(&mut src, block);
    let (src_addr, dst_addr) = (src.as_mut_ptr() as usize, dst.as_mut_ptr() as usize);
    let copy = move || {
        if let Some(core) = core {
            core_affinity::set_for_current(core_affinity::CoreId { id: core });
        }
        let blocks_in_region = region_bytes / block;
        let count = total.div_ceil(block);
        let started = Instant::now();
        for i in 0..count {
            let offset = ((i % blocks_in_region) * block) as usize;
            // SAFETY: offset + block <= region_bytes (blocks_in_region whole
            // blocks); both mappings are region_bytes long, distinct, and
            // outlive this thread (joined below).
            unsafe { std::ptr::copy((src_addr + offset) as *const u8, (dst_addr + offset) as *mut u8, block as usize) };
        }
        (count * block) as f64 / started.elapsed().as_secs_f64() / 1e9
    };
    let gbps = std::thread::spawn(copy).join().map_err(|_| "memcpy baseline thread panicked".to_string())?;
    drop((src, dst));
    Ok(gbps)
}

/// What the case is measured against.
fn baseline_name(options: &Options) -> &'static str {
    if options.metrics_overhead {
        return "metrics-off";
    }
    if options.idle_connections > 0 {
        return "no-flood";
    }
    match (options.transport, &options.raw_peer) {
        (TransportKind::Tcp, Some(_)) => "raw-tcp",
        (TransportKind::Tcp, None) => "none",
        _ => "memcpy",
    }
}

fn print_result(r: &CaseResult, options: &Options) {
    let ratio = if r.baseline_gbps > 0.0 { r.gbps / r.baseline_gbps } else { 0.0 };
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
            "baseline": baseline_name(options),
            "baseline_gbps": r.baseline_gbps,
            "ratio": ratio,
            "verified": r.verified,
            "metadata_calls": r.metadata_calls,
            "metadata_calls_per_batch": r.metadata_calls as f64 / batches as f64,
        });
        println!("{line}");
    } else {
        println!(
            "{:5} {:>6}  {:7.2} GB/s  p50 {:7.2} us  p99 {:7.2} us  {} {:7.2} GB/s  ({:5.1}% of it)  {}",
            r.op.name(),
            format_size(r.block),
            r.gbps,
            r.p50_us,
            r.p99_us,
            baseline_name(options),
            r.baseline_gbps,
            ratio * 100.0,
            if r.verified { "verified" } else { "VERIFY FAILED" }
        );
        if options.metadata.is_some() {
            println!("      metadata: {} requests over {batches} batches (resolved once, at open)", r.metadata_calls);
        }
    }
}
