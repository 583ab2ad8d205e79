//! The `kvring` command: `bench`, `serve`, `info`, `completions`.

mod args;
mod bench;
mod drive;
mod flood;
mod gpubench;
mod gputcp;
mod kvbench;
mod logging;
mod models;
mod raw;
mod report;
mod scratch;
mod serve;
mod settings;
mod soak;

use args::{Cli, Command, InfoArgs};
use clap::{CommandFactory, Parser};

fn main() {
    // A bad flag or value ends here: clap names it, shows the usage and
    // exits with status 2.
    let cli = Cli::parse();
    // A target run by hand says what it does; a bench (and the target it
    // starts for itself) prints its table and warnings only.
    logging::init(match &cli.command {
        Some(Command::Serve(args)) if !args.parent_watch => "kvring=info",
        _ => "kvring=warn",
    });
    let result = match cli.command {
        Some(Command::Bench(args)) => bench::run(*args),
        Some(Command::Serve(args)) => serve::run(args),
        Some(Command::Info(args)) => info(args),
        Some(Command::Completions { shell }) => {
            clap_complete::generate(shell, &mut Cli::command(), "kvring", &mut std::io::stdout());
            Ok(())
        }
        // Bare `kvring`: the help, as a first step, not an error.
        None => Cli::command().print_help().map_err(|e| format!("printing the help: {e}")),
    };
    if let Err(message) = result {
        eprintln!("kvring: {message}");
        std::process::exit(1);
    }
}

/// `kvring info`: the resolved configuration and what this host offers.
fn info(args: InfoArgs) -> Result<(), String> {
    let config = settings::load_layered(&args.settings)?;
    let json = args.json;
    let builder = config.builder();
    let engine = builder.settings();
    let advertised = builder.planned_advertise();
    let metadata = engine.metadata.to_string();
    let cores = builder.planned_lane_cores();
    let memlock = kvring::host::locked_memory_limit();
    let rdma = kvring::host::rdma_devices();
    let gpus = kvring::host::gpus();
    let gpu_nics = kvring::host::gpu_nics();
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
            "rdma": { "devices": rdma.as_ref().ok(), "reason": rdma.as_ref().err() },
            "gpus": { "devices": gpus.as_ref().ok(), "reason": gpus.as_ref().err() },
            "gpu_nics": { "choices": gpu_nics.as_ref().ok(), "reason": gpu_nics.as_ref().err() },
            "host": {
                "cores": core_affinity::get_core_ids().unwrap_or_default().len(),
                "memlock_bytes": memlock,
                "host_id": kvring::host::id(),
            },
            "transports": args::transports(),
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
    match &rdma {
        Ok(devices) => println!("rdma:             {}", devices.join("; ")),
        Err(reason) => println!("rdma:             {reason}"),
    }
    match &gpus {
        Ok(devices) => println!("gpus:             {}", devices.join("; ")),
        Err(reason) => println!("gpus:             none: {reason}"),
    }
    match &gpu_nics {
        Ok(choices) => println!("gpu nics:         {}", choices.join("; ")),
        Err(reason) => println!("gpu nics:         none: {reason}"),
    }
    println!("transports:       {}", args::transports().join(", "));
    println!("cores:            {}", core_affinity::get_core_ids().unwrap_or_default().len());
    match memlock {
        Some(u64::MAX) => println!("locked memory:    unlimited"),
        Some(bytes) => println!(
            "locked memory:    {} KiB (lanes lock none; RDMA registrations and pinned host regions count against it)",
            bytes / 1024
        ),
        None => println!("locked memory:    unknown"),
    }
    let shm = std::path::Path::new(kvring::host::SHM_DIR);
    println!("shared memory:    {} ({})", shm.display(), if shm.is_dir() { "present" } else { "missing" });
    println!("host id:          {}", kvring::host::id());
    Ok(())
}
