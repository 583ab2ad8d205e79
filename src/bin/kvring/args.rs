//! The command line, defined once with clap: parsing, every command's
//! `--help` and the shell completions all come from these types. Sizes and
//! durations take units; a bad value's error names the flag, the value and
//! what would do instead (the units, the transports of this build).

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Arg, ArgMatches, Args, Parser, Subcommand, ValueEnum};
use kvring::config::{Kind, KEYS};
use kvring::{MemoryKind, Opcode, TransportKind};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use kvring::config::{parse_duration, parse_size};

/// kvring: moves KV-cache blocks between prefill and decode engines.
#[derive(Parser)]
#[command(name = "kvring", version = version(), after_help = after_help())]
pub struct Cli {
    /// What to do; with none, this help.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The subcommands.
#[derive(Subcommand)]
pub enum Command {
    /// Measures two engines moving KV blocks: GB/s, latency, and a same-run baseline.
    ///
    /// With no --peer, starts `kvring serve` in a second process and moves
    /// blocks to it. Each case is measured against a baseline in the same run:
    /// memcpy (shm, null), or a raw TCP stream to the target's sink (tcp).
    /// --duration runs a soak instead; --kv moves one request's KV cache.
    Bench(Box<BenchArgs>),
    /// Runs a target engine with one shm-backed region until SIGINT/SIGTERM.
    ///
    /// Its first line on stdout names its addresses: `listen=` (control),
    /// `tcp=` (data) and `raw=` (the raw-TCP baseline sink, for `kvring bench
    /// --peer-raw`, with --raw-sink; `raw=-` without).
    Serve(ServeArgs),
    /// Prints the resolved configuration and where each value came from.
    ///
    /// Also the advertised address, the lanes and their cores, the metadata
    /// mode, the transports of this build, RDMA devices and host limits.
    Info(InfoArgs),
    /// Prints a shell completion script (e.g. `source <(kvring completions bash)`).
    Completions {
        /// The shell to complete for.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// `kvring bench`'s flags.
#[derive(Args)]
pub struct BenchArgs {
    /// Which operations to measure.
    #[arg(long, value_enum, default_value_t = OpChoice::Both)]
    pub op: OpChoice,
    /// Block sizes, comma-separated [default: 4KiB,64KiB,1MiB; 64KiB with --duration].
    #[arg(long, value_name = "SIZES", value_delimiter = ',', value_parser = parse_size)]
    pub block_size: Vec<u64>,
    /// Blocks per batch.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub batch: usize,
    /// Bytes moved per case (GB = 10^9 bytes, GiB = 2^30).
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "1GiB")]
    pub total: u64,
    /// Lanes (poller threads) of this engine [default: the configuration's `lanes`].
    #[arg(long, value_name = "N")]
    pub lanes: Option<usize>,
    /// Transport to move blocks over [default: shm; cuda_ipc with GPU memory; cma serves the target's own memory] (rdma needs libibverbs and a device with an active port).
    #[arg(long, value_parser = transport_parser())]
    pub transport: Option<TransportKind>,
    /// Memory of each end, LOCAL[,REMOTE]: `host` or `gpu[:N]` (one value for both) [default: host].
    #[arg(long, value_name = "LOCAL[,REMOTE]", value_parser = parse_memory_pair,
          conflicts_with_all = ["kv", "duration", "token_overhead", "metrics_overhead", "idle_connections"])]
    pub memory: Option<(MemoryKind, MemoryKind)>,
    /// The GPU provider, with --memory gpu.
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// Batches in flight at once.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub inflight: usize,
    /// Size of this side's region (the target's, when the bench starts it).
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "128MiB")]
    pub region_size: u64,
    /// Single-block round trips timed per case for p50/p99 (0: none).
    #[arg(long, value_name = "N", default_value_t = 5000)]
    pub latency_samples: usize,
    /// A running target: its control address, or with --metadata etcd://... its name.
    #[arg(long, value_name = "ADDR")]
    pub peer: Option<String>,
    /// The target's raw-TCP sink, for the tcp baseline (`kvring serve` prints it as raw=ADDR).
    #[arg(long, value_name = "ADDR")]
    pub peer_raw: Option<String>,
    /// Pre-shared token for handshakes (and the raw sink's challenge).
    #[arg(long, value_name = "TOKEN")]
    pub token: Option<String>,
    /// Soak instead: WRITE batches until this is up; failures are events, not fatal.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Move one request's KV cache of this model preset instead (prefill here, decode on the target).
    #[arg(long, value_name = "MODEL", value_parser = model_parser())]
    pub kv: Option<crate::models::Model>,
    /// Tokens of that request (with --kv).
    #[arg(long, value_name = "N", default_value_t = 8192)]
    pub tokens: u64,
    /// One JSON line per case instead of text.
    #[arg(long)]
    pub json: bool,
    /// Find --peer by name in etcd: etcd://HOST:PORT[/PREFIX/].
    #[arg(long, value_name = "URL")]
    pub metadata: Option<String>,
    /// Serve /metrics on this address while the bench runs.
    #[arg(long, value_name = "IP:PORT")]
    pub metrics: Option<SocketAddr>,
    /// Baseline: this engine with its counters off, same run.
    #[arg(long)]
    pub metrics_overhead: bool,
    /// Baseline: the case without N idle connections held open to the target's data port.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub idle_connections: usize,
    /// Measure tcp with a token against tcp without one, same run.
    #[arg(long, conflicts_with_all = ["kv", "duration"])]
    pub token_overhead: bool,
    /// Write bench.json and one SVG per transport into this directory.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["kv", "duration", "token_overhead"])]
    pub report: Option<PathBuf>,
    /// Config file for this engine (default $KVRING_CONFIG, else ./kvring.toml when it exists).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Measure the cold path instead: fresh engine pairs' open_segment to first 4 KiB done (tcp, shm), and open_many of 8 against one open.
    #[arg(long, conflicts_with_all = ["kv", "duration", "token_overhead", "report", "peer", "memory"])]
    pub cold: bool,
    /// Measure end-to-end checksums: each case's checksummed run beside its plain run and the baseline, interleaved.
    #[arg(long, conflicts_with_all = ["kv", "duration", "token_overhead", "report", "cold", "memory", "metrics_overhead"])]
    pub checksum: bool,
    /// Fresh pairs (and groups of 8) per transport, with --cold.
    #[arg(long, value_name = "N", default_value_t = 50)]
    pub cold_pairs: usize,
}

/// `kvring bench --op`.
#[derive(Clone, Copy, ValueEnum)]
pub enum OpChoice {
    /// WRITE (push) only.
    Write,
    /// READ (pull) only.
    Read,
    /// WRITE, then READ.
    Both,
}

impl OpChoice {
    /// The opcodes measured, in order.
    pub fn opcodes(self) -> Vec<Opcode> {
        match self {
            OpChoice::Write => vec![Opcode::Write],
            OpChoice::Read => vec![Opcode::Read],
            OpChoice::Both => vec![Opcode::Write, Opcode::Read],
        }
    }
}

/// `kvring serve`'s flags.
#[derive(Args)]
pub struct ServeArgs {
    /// The configuration: file, variables, key flags.
    #[command(flatten)]
    pub settings: Layered,
    /// Exit when standard input closes, so a crashed parent never leaves this behind.
    #[arg(long)]
    pub parent_watch: bool,
    /// Serve a KV cache of this model preset, published as the engine's layout.
    #[arg(long, value_name = "MODEL", value_parser = model_parser())]
    pub kv: Option<crate::models::Model>,
    /// Blocks of that cache (with --kv).
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub kv_blocks: u64,
    /// Where the served region lives: `host` (shared memory) or `gpu[:N]`.
    #[arg(long, value_name = "MEMORY", value_parser = parse_memory, default_value = "host")]
    pub memory: MemoryKind,
    /// Serve plain memory this process maps itself (as an engine's own tensors are), not kvring's shared memory:
    /// same-host peers then reach it over cma, or tcp.
    #[arg(long, conflicts_with = "memory")]
    pub caller_memory: bool,
    /// The GPU provider, with --memory gpu.
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// Also serve the raw-TCP baseline sink (printed as `raw=`) for `kvring bench --peer-raw`: a bench's
    /// baseline only, off otherwise (it streams to whoever passes its token check, on the lanes' cores).
    #[arg(long)]
    pub raw_sink: bool,
}

/// The GPU provider flags of `bench` and `serve`.
#[derive(Args, Clone)]
pub struct GpuArgs {
    /// GPU provider: the CUDA driver (loaded at run time) or a simulated GPU, which runs anywhere.
    #[arg(long, value_enum, default_value_t = GpuChoice::Cuda)]
    pub gpu: GpuChoice,
    /// The simulated GPU's copy-engine delay (with --gpu sim).
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "10us")]
    pub sim_copy_delay: Duration,
}

/// `--gpu`.
#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
pub enum GpuChoice {
    /// The CUDA driver (libcuda, loaded at run time).
    Cuda,
    /// kvring's simulated GPU: device memory no host thread can touch, copies after a delay.
    Sim,
}

/// `host`, `gpu` (GPU 0) or `gpu:N`.
pub fn parse_memory(text: &str) -> Result<MemoryKind, String> {
    match text.trim() {
        "host" => Ok(MemoryKind::Host),
        "gpu" => Ok(MemoryKind::Gpu(0)),
        other => other
            .strip_prefix("gpu:")
            .and_then(|n| n.parse().ok())
            .map(MemoryKind::Gpu)
            .ok_or_else(|| format!("{other:?} is not a memory (host, gpu or gpu:N)")),
    }
}

/// `LOCAL[,REMOTE]`: one value names both ends.
fn parse_memory_pair(text: &str) -> Result<(MemoryKind, MemoryKind), String> {
    match text.split_once(',') {
        Some((local, remote)) => Ok((parse_memory(local)?, parse_memory(remote)?)),
        None => parse_memory(text).map(|both| (both, both)),
    }
}

/// How a memory is written on the command line.
pub fn format_memory(memory: MemoryKind) -> String {
    match memory {
        MemoryKind::Host => "host".into(),
        MemoryKind::Gpu(n) => format!("gpu:{n}"),
    }
}

/// `kvring info`'s flags.
#[derive(Args)]
pub struct InfoArgs {
    /// The configuration: file, variables, key flags.
    #[command(flatten)]
    pub settings: Layered,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The layered configuration's command-line part: the file to read, and
/// the flags that override it and the `KVRING_*` variables.
#[derive(Args)]
pub struct Layered {
    /// Config file (default $KVRING_CONFIG, else ./kvring.toml when it exists).
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// `--<key> VALUE` for each configuration key.
    #[command(flatten)]
    pub keys: KeyFlags,
}

/// One flag per configuration key (`io_timeout` is `--io-timeout`), built
/// from [`KEYS`] so a new key is a new flag, with its help, by itself. The
/// values stay text: `Config::set_flag` checks them, so a bad one reads the
/// same as from the file or the environment.
#[derive(Default)]
pub struct KeyFlags {
    /// `(key, value)` of each key given, in [`KEYS`] order.
    pub values: Vec<(&'static str, String)>,
}

/// Help heading of the key flags.
const KEY_HEADING: &str = "Configuration keys (override the file and $KVRING_<KEY>)";

impl clap::FromArgMatches for KeyFlags {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = Self::default();
        flags.update_from_arg_matches(matches)?;
        Ok(flags)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        for key in KEYS {
            if let Some(value) = matches.get_one::<String>(key.name) {
                self.values.retain(|(name, _)| *name != key.name);
                self.values.push((key.name, value.clone()));
            }
        }
        Ok(())
    }
}

impl Args for KeyFlags {
    fn augment_args(command: clap::Command) -> clap::Command {
        KEYS.iter().fold(command, |command, key| {
            let help = match key.default {
                Some(default) => format!("{} [default: {default}]", key.help),
                None => key.help.to_string(),
            };
            command.arg(
                Arg::new(key.name)
                    .long(key.name.replace('_', "-"))
                    .value_name(value_name(key.name, key.kind))
                    .value_parser(clap::value_parser!(String))
                    .help(help)
                    .help_heading(KEY_HEADING),
            )
        })
    }

    fn augment_args_for_update(command: clap::Command) -> clap::Command {
        Self::augment_args(command)
    }
}

/// What a key flag's value looks like in the help.
fn value_name(name: &str, kind: Kind) -> String {
    match kind {
        Kind::Text => name.to_ascii_uppercase(),
        Kind::Count => "N".into(),
        Kind::Duration => "DURATION".into(),
        Kind::Size => "SIZE".into(),
        Kind::SocketAddr => "IP:PORT".into(),
        Kind::Ip => "IP".into(),
        Kind::Metadata => "MODE".into(),
        Kind::Cores => "CPUS".into(),
        Kind::Switch => "on|off".into(),
        Kind::Mode => "auto|on|off".into(),
        Kind::Byte => "0-255".into(),
        Kind::Transports => "shm,cma,tcp,...".into(),
    }
}

/// The transports this build can use, in the order every message lists
/// them (rdma is in every build: whether this host can use it is said
/// when it is asked for).
pub fn transports() -> Vec<&'static str> {
    vec!["shm", "cuda_ipc", "cma", "tcp", "null", "rdma"]
}

/// `--transport`: one of [`transports`]; an error lists them.
fn transport_parser() -> impl TypedValueParser<Value = TransportKind> {
    PossibleValuesParser::new(transports())
        .map(|name| TransportKind::parse(&name).expect("every transport of this build parses"))
}

/// `--kv`: one of the model presets; an error lists them.
fn model_parser() -> impl TypedValueParser<Value = crate::models::Model> {
    PossibleValuesParser::new(crate::models::MODELS.iter().map(|m| m.name))
        .map(|name| crate::models::find(&name).expect("every listed preset is found"))
}

/// The cargo features this binary was built with.
fn features() -> Vec<&'static str> {
    [("python", cfg!(feature = "python"))].into_iter().filter_map(|(name, on)| on.then_some(name)).collect()
}

/// `kvring --version`: `0.1.0 (features: rdma)`, or `(features: none)`.
fn version() -> String {
    let features = features();
    let features = if features.is_empty() { "none".to_string() } else { features.join(", ") };
    format!("{} (features: {features})", env!("CARGO_PKG_VERSION"))
}

/// The top-level help's closing notes: how configuration layers, the units.
fn after_help() -> String {
    let keys: Vec<String> = KEYS.iter().map(|k| k.name.replace('_', "-")).collect();
    format!(
        "Configuration: every key can be set in kvring.toml (`version = 1`; --config PATH, $KVRING_CONFIG,\n\
         or ./kvring.toml), overridden by $KVRING_<KEY>, then by --<key> on `serve` and `info`.\n\
         Keys: {}\n\
         Sizes: 4096 or 512B; KB, MB, GB, TB are decimal (10^3 ..); KiB, MiB, GiB, TiB binary (2^10 ..).\n\
         Transports in this build: {}. Logs: RUST_LOG (e.g. RUST_LOG=kvring=debug).",
        keys.join(" "),
        transports().join(", ")
    )
}

/// `4096` → `4KiB`, `1000000000` → `1GB`, for printing: the binary unit
/// when it divides exactly, else the decimal one, else bytes.
pub fn format_size(bytes: u64) -> String {
    for (unit, scale) in
        [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("GB", 1_000_000_000), ("MB", 1_000_000)]
            .into_iter()
            .chain([("KB", 1_000)])
    {
        if bytes >= scale && bytes.is_multiple_of(scale) {
            return format!("{}{unit}", bytes / scale);
        }
    }
    format!("{bytes}B")
}

/// `1 lane (core 1)`, `2 lanes (cores 1, 0)`, `1 lane (unpinned)`: the
/// lanes and the cores they run on, for the bench's header.
pub fn format_lanes(cores: &[Option<usize>]) -> String {
    let lanes = if cores.len() == 1 { "1 lane".to_string() } else { format!("{} lanes", cores.len()) };
    let names: Vec<String> = cores.iter().map(|c| c.map_or("unpinned".to_string(), |c| c.to_string())).collect();
    match (cores.iter().all(Option::is_none), cores.len()) {
        (true, _) => format!("{lanes} (unpinned)"),
        (false, 1) => format!("{lanes} (core {})", names[0]),
        (false, _) => format!("{lanes} (cores {})", names.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_configuration_key_is_a_flag_of_serve_and_info() {
        let command = Cli::command();
        for name in ["serve", "info"] {
            let sub = command.find_subcommand(name).unwrap();
            for key in KEYS {
                let long = key.name.replace('_', "-");
                assert!(sub.get_arguments().any(|a| a.get_long() == Some(long.as_str())), "{name} --{long}");
            }
        }
        let parsed = Cli::try_parse_from(["kvring", "info", "--io-timeout", "9s", "--lanes=2"]).unwrap();
        let Some(Command::Info(info)) = parsed.command else { panic!("info") };
        assert_eq!(info.settings.keys.values, [("lanes", "2".to_string()), ("io_timeout", "9s".to_string())]);
    }

    #[test]
    fn bench_sizes_take_decimal_and_binary_units() {
        let parsed = Cli::try_parse_from(["kvring", "bench", "--total", "1GB", "--block-size", "4KiB,1MB"]).unwrap();
        let Some(Command::Bench(bench)) = parsed.command else { panic!("bench") };
        assert_eq!(bench.total, 1_000_000_000);
        assert_eq!(bench.block_size, [4096, 1_000_000]);
        let error = Cli::try_parse_from(["kvring", "bench", "--block-size", "3XB"]).err().unwrap().to_string();
        assert!(error.contains("--block-size") && error.contains("3XB") && error.contains("KiB"), "{error}");
        let error = Cli::try_parse_from(["kvring", "bench", "--transport", "ib"]).err().unwrap().to_string();
        assert!(error.contains(&transports().join(", ")), "{error}");
    }

    #[test]
    fn sizes_and_lanes_print_as_people_read_them() {
        assert_eq!(format_size(65536), "64KiB");
        assert_eq!(format_size(1 << 30), "1GiB");
        assert_eq!(format_size(1_000_000_000), "1GB");
        assert_eq!(format_size(1000), "1KB");
        assert_eq!(format_size(1001), "1001B");
        assert_eq!(format_lanes(&[Some(1)]), "1 lane (core 1)");
        assert_eq!(format_lanes(&[Some(1), Some(0)]), "2 lanes (cores 1, 0)");
        assert_eq!(format_lanes(&[None]), "1 lane (unpinned)");
        assert_eq!(format_lanes(&[Some(3), None]), "2 lanes (cores 3, unpinned)");
        assert!(version().starts_with(env!("CARGO_PKG_VERSION")) && version().contains("(features: "));
    }
}
