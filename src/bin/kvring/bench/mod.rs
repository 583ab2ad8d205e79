//! `kvring bench`: two engines on this host moving KV blocks.
//!
//! With no arguments it starts a target (`kvring serve`) in a second
//! process and drives it from this one over shm: WRITE and READ, 4 KiB,
//! 64 KiB and 1 MiB blocks, batches of 64, 1 GiB per case. Each case prints
//! throughput, single-block round-trip latency (p50/p99), and the same-run
//! baseline for the same block size (memcpy; over tcp, a raw socket to the
//! target's sink) measured in rounds alternating with kvring's, and
//! verifies the moved bytes by checksum on the target.

mod case;
mod checksummed;
mod cold;
mod output;
mod overhead;

use crate::args::{format_lanes, format_size, BenchArgs};
use crate::drive::{Route, Shape, Sweep};
use case::run_case;
pub(crate) use case::RatioSpread;
use kvring::{Engine, Opcode, Segment, Submitter, TransportKind};
use output::{baseline_name, print_result, write_report};
use std::time::Duration;

const DEFAULT_BLOCK_SIZES: [u64; 3] = [4 << 10, 64 << 10, 1 << 20];
/// Block size of a soak when none is given.
const DEFAULT_SOAK_BLOCK: u64 = 64 << 10;
/// Rounds each case alternates with its baseline.
pub(crate) const ROUNDS: usize = 5;

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
    /// Measure the cold path instead (`--cold`).
    cold: bool,
    /// Fresh pairs per transport, with `--cold`.
    cold_pairs: usize,
    /// Each case checksummed beside plain (`--checksum`).
    checksum: bool,
}

impl Options {
    /// How every case moves its bytes.
    fn shape(&self) -> Shape {
        Shape { batch: self.batch, inflight: self.inflight, checksum: false }
    }

    /// The sweep of cases the flags ask for.
    fn sweep(&self) -> Sweep<'_> {
        Sweep {
            ops: &self.ops,
            block_sizes: &self.block_sizes,
            shape: self.shape(),
            total: self.total,
            latency_samples: self.latency_samples,
            json: self.json,
        }
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
        cold: args.cold,
        cold_pairs: args.cold_pairs,
        checksum: args.checksum,
    };
    if options.transport == TransportKind::Rdma {
        // Said in one line before anything starts: no library, or no device.
        kvring::host::rdma_devices().map_err(|why| format!("--transport rdma: {why}"))?;
    }
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

/// Runs `kvring bench`: the cases, a soak (`--duration`), a KV request
/// (`--kv`) or the token overhead (`--token-overhead`).
pub fn run(args: BenchArgs) -> Result<(), String> {
    // The initiator engine takes the config file and KVRING_* variables;
    // the bench's own flags override them (it takes no key flags).
    let config = crate::settings::load(args.config.as_deref(), &[])?;
    let mut options = parse(args, &config)?;
    if options.cold || options.token_overhead {
        return if options.cold { cold::cold(&config, &options) } else { overhead::token_overhead(&config, &options) };
    }
    let (target, caller_shares) = own_target(&config, &options)?;
    let peer = options.peer.clone().unwrap_or_else(|| target.as_ref().expect("spawned").addr.clone());
    if options.raw_peer.is_none() {
        options.raw_peer = target.as_ref().and_then(|t| t.raw_addr.clone());
    }
    let gpu = match crate::gpubench::involves_gpu(options.memory) {
        true => Some(crate::gpubench::provider(&options.gpu)?),
        false => None,
    };
    let engine = initiator(&config, &options, gpu.clone(), caller_shares)?;
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
    // The target's region of the kind asked for (a `kvring serve --memory
    // gpu` serves a host region beside its GPU one).
    let wanted = options.memory.map(|(_, remote)| remote);
    let remote = segment
        .regions()
        .iter()
        .find(|r| wanted.is_none_or(|kind| r.memory == kind))
        .ok_or_else(|| format!("{peer} exposes no region{}", wanted.map_or(String::new(), |k| format!(" in {k:?}"))))?
        .clone();
    let region_bytes = options.region_bytes.min(remote.len);
    let info = crate::gpubench::local_info(options.memory);
    let local = engine.alloc_region(region_bytes as usize, info).map_err(|e| e.to_string())?;
    pin_caller(&engine);
    let mut sub = engine.submitter().map_err(|e| e.to_string())?;
    print_header(&engine, &segment, &peer, region_bytes, &options, gpu.as_deref());
    let route = Route { segment: &segment, local: &local, remote: remote.id };
    if let Some(gpu) = gpu {
        let result = gpu_cases((&engine, &mut sub), route, region_bytes, &options, gpu);
        drop(sub);
        engine.shutdown();
        drop(target);
        return result;
    }
    let results = match options.checksum {
        true => checksummed::cases(&engine, &mut sub, route, region_bytes, &options).map(|()| Vec::new()),
        false => sweep(&engine, &mut sub, route, region_bytes, &options),
    };
    drop(sub);
    engine.shutdown();
    drop(target);
    let results = results?;
    if let Some(dir) = &options.report {
        write_report(dir, &results, &options)?;
    }
    if results.iter().all(|r| r.verified) {
        Ok(())
    } else {
        Err("verification failed: the target's bytes differ from what was moved".into())
    }
}

/// Every case of the sweep, each printed as it ends.
fn sweep(
    engine: &Engine,
    sub: &mut Submitter,
    route: Route<'_>,
    region_bytes: u64,
    options: &Options,
) -> Result<Vec<case::CaseResult>, String> {
    let mut results = Vec::new();
    for &op in &options.ops {
        for &block in &options.block_sizes {
            let calls_before = engine.metadata_calls();
            let mut result = run_case(engine, sub, route, region_bytes, op, block, options)?;
            result.metadata_calls = engine.metadata_calls() - calls_before;
            print_result(&result, options);
            results.push(result);
        }
    }
    Ok(results)
}

/// Without `--peer`, the target the bench starts (`kvring serve`), on cores
/// its own lanes do not use; and whether the caller then shares a core
/// with the target's lane (a host too small to give it one of its own): its
/// waits should then yield from the start rather than spin, or the lane
/// would wait for the caller's spin.
fn own_target(
    config: &kvring::config::Config,
    options: &Options,
) -> Result<(Option<crate::serve::Target>, bool), String> {
    if options.peer.is_some() {
        return Ok((None, false));
    }
    let planned = initiator_cores(config, options);
    let cores = target_cores(&planned);
    let target = spawn_target(options, &cores)?;
    Ok((Some(target), caller_core(&planned).is_some_and(|core| cores.contains(&core))))
}

/// `--memory` with GPU memory: the cases over cuda_ipc, their report, and
/// whether every case verified.
fn gpu_cases(
    (engine, sub): (&kvring::Engine, &mut Submitter),
    route: Route<'_>,
    region_bytes: u64,
    options: &Options,
    gpu: std::sync::Arc<dyn kvring::gpu::Gpu>,
) -> Result<(), String> {
    let Route { segment, local, remote } = route;
    if options.transport == TransportKind::Tcp {
        return staged_tcp_cases((engine, sub), route, region_bytes, options);
    }
    let plan = crate::gpubench::Plan {
        sweep: options.sweep(),
        memory: options.memory.expect("GPU cases have --memory"),
        gpu,
        engine,
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

/// `--memory gpu --transport tcp`: GPU memory staged over tcp, beside
/// host-memory tcp of the same blocks (the target's host region beside its
/// GPU one) and the raw socket, same run.
fn staged_tcp_cases(
    (engine, sub): (&kvring::Engine, &mut Submitter),
    route: Route<'_>,
    region_bytes: u64,
    options: &Options,
) -> Result<(), String> {
    let Route { segment, local, remote } = route;
    let beside = segment.regions().iter().find(|r| r.memory == kvring::MemoryKind::Host && r.len >= region_bytes);
    let remote_host = beside
        .ok_or("the target serves no host region beside its GPU one (`kvring serve --memory gpu` serves one)")?
        .id;
    let local_host =
        engine.alloc_region(region_bytes as usize, kvring::RegionInfo::raw()).map_err(|e| e.to_string())?;
    let ends = crate::gputcp::Ends {
        local_gpu: local,
        remote_gpu: remote,
        local_host: &local_host,
        remote_host,
        region_bytes,
    };
    let plan = crate::gputcp::Plan {
        engine,
        sweep: options.sweep(),
        raw: options.raw_peer.as_deref().map(|addr| (addr, options.token.as_deref())),
        memory: {
            let (local, remote) = options.memory.expect("GPU cases have --memory");
            [crate::args::format_memory(local), crate::args::format_memory(remote)]
        },
    };
    let cases = crate::gputcp::run(sub, segment, &ends, &plan)?;
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
        // Which NIC each GPU would use, and why, from sysfs; why none only
        // where the run involves a GPU or a NIC (`kvring info` always says).
        match kvring::host::gpu_nics() {
            Ok(choices) => println!("gpu nics: {}", choices.join("; ")),
            Err(reason)
                if crate::gpubench::involves_gpu(options.memory) || options.transport == TransportKind::Rdma =>
            {
                println!("gpu nics: none: {reason}")
            }
            Err(_) => {}
        }
    }
    if baseline_name(options).is_none() {
        // An external target's sink is not known: say how to get the ratio.
        let hint = "no raw-TCP baseline: give --peer-raw ADDR (`kvring serve --raw-sink` prints its raw sink)";
        if options.json {
            eprintln!("kvring bench: {hint}");
        } else {
            println!("{hint}");
        }
    }
}

/// The target the bench starts when given no `--peer`: a `kvring serve`
/// child, with a KV cache for `--kv`.
fn spawn_target(options: &Options, cores: &[usize]) -> Result<crate::serve::Target, String> {
    let mut extra: Vec<String> = match &options.kv {
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
    if options.transport == TransportKind::Rdma {
        extra.extend(["--rdma".to_string(), "on".to_string()]);
    }
    if !cores.is_empty() {
        extra.extend(["--cores".to_string(), cores.iter().map(usize::to_string).collect::<Vec<_>>().join(",")]);
    }
    // As many lanes as the bench's: the initiator opens one connection per
    // lane, and the target hands each to its least loaded lane, so a peer's
    // chunks spread over lanes on both ends.
    extra.extend(["--lanes".to_string(), options.lanes.to_string()]);
    crate::serve::Target::spawn(options.region_bytes, &extra)
}

/// The cores the bench's own lanes will run on.
fn initiator_cores(config: &kvring::config::Config, options: &Options) -> Vec<Option<usize>> {
    config.builder().lanes(options.lanes).planned_lane_cores()
}

/// Cores for the target's lanes, so that they do not share cores with the
/// bench's own lanes: the usable cores less those, less the first where that
/// leaves some (left to the callers' threads). Empty: no core is left, or
/// the bench's lanes are unpinned; the target places its lanes as usual.
fn target_cores(initiator: &[Option<usize>]) -> Vec<usize> {
    let taken: Vec<usize> = initiator.iter().flatten().copied().collect();
    if taken.is_empty() {
        return Vec::new();
    }
    let free: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.id)
        .filter(|c| !taken.contains(c))
        .collect();
    let beyond_first: Vec<usize> = free.iter().copied().filter(|&c| c != 0).collect();
    if beyond_first.is_empty() {
        free
    } else {
        beyond_first
    }
}

/// The core [`pin_caller`] will choose: the first no lane of the bench uses.
fn caller_core(initiator: &[Option<usize>]) -> Option<usize> {
    let used: Vec<usize> = initiator.iter().flatten().copied().collect();
    core_affinity::get_core_ids().unwrap_or_default().into_iter().map(|c| c.id).find(|c| !used.contains(c))
}

/// The bench's own engine: the configuration, then its flags.
fn initiator(
    config: &kvring::config::Config,
    options: &Options,
    gpu: Option<std::sync::Arc<dyn kvring::gpu::Gpu>>,
    caller_shares: bool,
) -> Result<Engine, String> {
    let mut builder = config.builder().name("bench-initiator").lanes(options.lanes);
    if options.transport == TransportKind::Rdma {
        builder = config.rdma(builder, true);
    }
    if caller_shares {
        builder = builder.wait_backoff(kvring::BackoffPolicy { spin: Duration::ZERO, ..Default::default() });
    }
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

/// Pins the bench thread to a core no lane uses, when there is one.
pub(super) fn pin_caller(engine: &Engine) {
    if let Some(id) = caller_core(&engine.lane_cores()) {
        core_affinity::set_for_current(core_affinity::CoreId { id });
    }
}
