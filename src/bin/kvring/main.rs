//! The `kvring` command: `bench`, `serve`, `info`.

mod args;
mod bench;
mod kvbench;
mod models;
mod raw;
mod serve;
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
  kvring info
      What this host offers kvring: cores, locked-memory limit, /dev/shm.
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

fn info(args: Args) -> Result<(), String> {
    args.finish()?;
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let memlock = kvring::runtime::lane::memlock_limit_bytes();
    println!("kvring {}", env!("CARGO_PKG_VERSION"));
    println!("cores:            {}", cores.len());
    match memlock {
        Some(u64::MAX) => println!("locked memory:    unlimited"),
        Some(bytes) => println!(
            "locked memory:    {} KiB (each lane needs {} KiB; glommio's floor is 512 KiB)",
            bytes / 1024,
            kvring::runtime::lane::memlock_needed_bytes(1, kvring::runtime::lane::DEFAULT_IO_MEMORY_BYTES) / 1024
        ),
        None => println!("locked memory:    unknown"),
    }
    let shm = std::path::Path::new(kvring::mem::shm::SHM_DIR);
    println!("shared memory:    {} ({})", shm.display(), if shm.is_dir() { "present" } else { "missing" });
    println!("host id:          {}", kvring::segment::local_host_id());
    println!("transports:       shm, tcp, null (rdma: not in this build)");
    println!("metadata:         peer handshake (no server)");
    Ok(())
}
