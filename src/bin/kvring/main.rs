//! The `kvring` command: `bench`, `serve`, `info`.

mod args;
mod bench;
mod flood;
mod kvbench;
mod models;
mod raw;
mod scratch;
mod serve;
mod settings;
mod soak;

use args::Args;

const USAGE: &str = "\
kvring — moves KV-cache blocks between prefill and decode engines

USAGE:
  kvring bench [--op write|read|both] [--block-size 4KiB,64KiB,1MiB] [--batch 64]
               [--total 1GiB] [--lanes 1] [--transport shm|null] [--inflight 8]
               [--region-size 128MiB] [--latency-samples 5000] [--peer ADDR] [--peer-raw ADDR]
               [--token T] [--duration 60s] [--kv deepseek-v3|llama3-8b [--tokens 8192]] [--json]
               [--metadata etcd://HOST:PORT[/PREFIX/]] [--metrics ADDR] [--metrics-overhead]
      With no --peer, starts `kvring serve` in a second process and moves blocks to it.
      --peer is a control address, or with --metadata etcd://... a segment name.
      --metrics-overhead: the baseline is this engine with its counters off (same run).
      Baseline: memcpy (shm, null), or a raw TCP stream to the target's sink (tcp).
      --duration: a soak of WRITE batches until the time is up; failures are events,
      not fatal; every batch reported done is verified on the target at the end.
      --kv: one request's KV cache (--tokens) from prefill (here) to decode (the target),
      planned from block ids; ms per request, GB/s, descriptors before/after coalescing.
  kvring serve [--name NAME] [--listen 127.0.0.1:0] [--region-size 256MiB] [--lanes 1] [--token T]
               [--kv MODEL --kv-blocks N] [--metadata etcd://HOST:PORT[/PREFIX/]] [--metadata-ttl 10s]
      A target engine with one shm-backed region; serves until SIGINT/SIGTERM.
      --metadata: publish this engine under its name in etcd, on a lease kept alive.
  kvring info [--json] [--config PATH] [--KEY VALUE ...]
      The resolved configuration and where each value came from, the advertised
      address, lanes and their cores, the metadata mode, RDMA devices, host limits.

CONFIGURATION:
  Every key can be set in kvring.toml (`version = 1`; --config PATH, $KVRING_CONFIG,
  or ./kvring.toml), overridden by $KVRING_<KEY>, then by --<key> on `serve` and `info`.
  Keys: name listen advertise lanes metadata metadata-ttl metadata-poll metrics token
        io-timeout control-timeout busy-poll segment-cache notify-queue region-size
";

fn main() {
    let mut argv = std::env::args().skip(1);
    let command = argv.next();
    let args = Args::new(argv);
    let result = match command.as_deref() {
        Some("bench") => bench::run(args),
        Some("serve") => serve::run(args),
        Some("info") => info(args),
        Some("help" | "--help" | "-h") | None => {
            print!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(format!("unknown command {other:?}\n\n{USAGE}")),
    };
    if let Err(message) = result {
        eprintln!("kvring: {message}");
        std::process::exit(1);
    }
}

fn info(mut args: Args) -> Result<(), String> {
    let config = settings::load(&mut args, None)?;
    let json = args.switch("--json");
    args.finish()?;
    let builder = config.builder();
    let engine = builder.settings();
    let advertised = builder.planned_advertise();
    let metadata = engine.metadata.to_string();
    let cores = builder.planned_lane_cores();
    let memlock = kvring::host::locked_memory_limit();
    let rdma = kvring::host::rdma_devices();
    let settings: Vec<_> = config
        .settings()
        .iter()
        .map(|s| {
            // A token is a secret: say whether it is set, not what it is.
            let value = match (&s.value, s.key.name) {
                (Some(_), "token") => Some("(set)".to_string()),
                (value, _) => value.clone(),
            };
            (s.key.name, value, s.source.to_string())
        })
        .collect();
    if json {
        let line = serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "config": settings.iter().map(|(key, value, source)| serde_json::json!({
                "key": key, "value": value, "source": source,
            })).collect::<Vec<_>>(),
            "advertised": match &advertised {
                Ok(a) => serde_json::json!({ "ip": a.ip.to_string(), "source": a.source }),
                Err(e) => serde_json::json!({ "error": e.to_string() }),
            },
            "lanes": cores.iter().enumerate().map(|(lane, core)| serde_json::json!({ "lane": lane, "core": core }))
                .collect::<Vec<_>>(),
            "metadata": metadata,
            "rdma": { "built": cfg!(feature = "rdma"), "devices": rdma.as_ref().ok(), "reason": rdma.as_ref().err() },
            "host": {
                "cores": core_affinity::get_core_ids().unwrap_or_default().len(),
                "memlock_bytes": memlock,
                "host_id": kvring::host::id(),
            },
            "transports": ["shm", "tcp", "null"],
        });
        println!("{line}");
        return Ok(());
    }
    println!("kvring {}", env!("CARGO_PKG_VERSION"));
    println!("configuration (file, then $KVRING_*, then flags):");
    for (key, value, source) in &settings {
        println!("  {key:<16} {:<28} {source}", value.as_deref().unwrap_or("-"));
    }
    match &advertised {
        Ok(a) => println!("advertised:       {} ({})", a.ip, a.source),
        Err(e) => println!("advertised:       none: {e}"),
    }
    let lanes: Vec<String> = cores
        .iter()
        .enumerate()
        .map(|(lane, core)| format!("{lane}→{}", core.map_or("unpinned".into(), |c| format!("core {c}"))))
        .collect();
    println!("lanes:            {}", lanes.join(", "));
    println!("metadata:         {metadata}");
    let built =
        if cfg!(feature = "rdma") { "verbs provider built" } else { "not in this build (cargo feature `rdma`)" };
    match &rdma {
        Ok(devices) => println!("rdma:             {built}; devices: {}", devices.join("; ")),
        Err(reason) => println!("rdma:             {built}; {reason}"),
    }
    println!("transports:       shm, tcp, null");
    println!("cores:            {}", core_affinity::get_core_ids().unwrap_or_default().len());
    match memlock {
        Some(u64::MAX) => println!("locked memory:    unlimited"),
        Some(bytes) => println!(
            "locked memory:    {} KiB (each lane needs {} KiB; glommio's floor is 512 KiB)",
            bytes / 1024,
            kvring::host::locked_memory_needed(1) / 1024
        ),
        None => println!("locked memory:    unknown"),
    }
    let shm = std::path::Path::new(kvring::host::SHM_DIR);
    println!("shared memory:    {} ({})", shm.display(), if shm.is_dir() { "present" } else { "missing" });
    println!("host id:          {}", kvring::host::id());
    Ok(())
}
