//! `kvring serve`: a target engine that exposes one shm-backed region and
//! serves until SIGINT or SIGTERM (or, with `--parent-watch`, until its
//! standard input closes, so a crashed parent never leaves it behind).

use crate::args::{format_size, Args};
use kvring::RegionInfo;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Default size of the served region.
pub const DEFAULT_REGION_BYTES: u64 = 256 << 20;

static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_signal: libc::c_int) {
    SIGNALLED.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is
        // async-signal-safe.
        unsafe { libc::signal(signal, on_signal as *const () as libc::sighandler_t) };
    }
}

pub fn run(mut args: Args) -> Result<(), String> {
    // Every engine key (see `kvring info`) comes from the config file, then
    // KVRING_* variables, then these flags.
    let config = crate::settings::load(&mut args, None)?;
    let parent_watch = args.switch("--parent-watch");
    let kv_model = args.value("--kv")?;
    let kv_blocks = args.number("--kv-blocks")?.unwrap_or(1024) as u64;
    args.finish()?;

    let name = config.get("name").map_or_else(|| format!("kvring-serve-{}", std::process::id()), str::to_string);
    let region_bytes = config.size("region_size").unwrap_or(DEFAULT_REGION_BYTES);
    let metadata = config.get("metadata").unwrap_or("P2PHANDSHAKE").to_string();
    install_signal_handlers();
    let engine = config.builder().name(&name).build().map_err(|e| e.to_string())?;
    let listen = engine.control_addr();
    // With --kv, the one region is a KV cache of that model, published as
    // the engine's layout for peers' memory-info requests.
    let (region_bytes, shape) = match &kv_model {
        Some(name) => {
            let shape = crate::models::find(name)?.shape(kv_blocks)?;
            (shape.bytes().map_err(|e| e.to_string())?, Some(shape))
        }
        None => (region_bytes, None),
    };
    let region = engine.alloc_region(region_bytes as usize, RegionInfo::raw()).map_err(|e| e.to_string())?;
    if let Some(shape) = shape {
        let layout = kvring::kv::KvLayout::contiguous(shape, region.id(), 0).map_err(|e| e.to_string())?;
        engine.set_kv_layout(layout).map_err(|e| e.to_string())?;
    }
    // The raw-TCP baseline sink, so `kvring bench --transport tcp` can
    // measure a plain socket over the same path, even to a remote target.
    // It binds the listen IP (possibly 0.0.0.0) and is announced, like the
    // engine, at the advertised one.
    let bind_ip =
        config.get("listen").and_then(|v| v.parse::<std::net::SocketAddr>().ok()).map_or(listen.ip(), |a| a.ip());
    let raw = crate::raw::RawSink::start(bind_ip, config.get("token").map(kvring::Token::new))
        .map_err(|e| format!("starting the raw baseline sink: {e}"))?;
    let raw_addr = std::net::SocketAddr::new(listen.ip(), raw.addr().port());
    println!(
        "kvring serve: name={name} listen={} tcp={} raw={} epoch={:#018x} region={} size={} metadata={}",
        engine.control_addr(),
        engine.tcp_addr().unwrap_or("-"),
        raw_addr,
        engine.epoch(),
        region.id(),
        format_size(region_bytes),
        metadata
    );
    let _ = std::io::stdout().flush();

    let stdin_closed = Arc::new(AtomicBool::new(false));
    if parent_watch {
        let flag = stdin_closed.clone();
        std::thread::spawn(move || {
            let mut sink = [0u8; 64];
            while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
            flag.store(true, Ordering::SeqCst);
        });
    }
    while !SIGNALLED.load(Ordering::SeqCst) && !stdin_closed.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(20));
    }
    engine.shutdown();
    drop(region);
    eprintln!("kvring serve: {name} stopped");
    Ok(())
}
