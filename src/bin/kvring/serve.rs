//! `kvring serve`: a target engine that exposes one region (shared memory,
//! or with `--memory gpu` a GPU's memory) and serves until SIGINT or
//! SIGTERM (or, with `--parent-watch`, until its standard input closes, so
//! a crashed parent never leaves it behind).

use crate::args::{format_size, ServeArgs};
use kvring::RegionInfo;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// Runs the target until a signal (or, with `--parent-watch`, until its
/// standard input closes).
pub fn run(args: ServeArgs) -> Result<(), String> {
    // Every engine key (see `kvring info`) comes from the config file, then
    // KVRING_* variables, then these flags.
    let config = crate::settings::load_layered(&args.settings)?;
    let (parent_watch, kv_model, kv_blocks) = (args.parent_watch, args.kv, args.kv_blocks);
    let memory = args.memory;

    let name = config.get("name").map_or_else(|| format!("kvring-serve-{}", std::process::id()), str::to_string);
    let region_bytes = config.size("region_size").unwrap_or(DEFAULT_REGION_BYTES);
    let metadata = config.get("metadata").unwrap_or("P2PHANDSHAKE").to_string();
    install_signal_handlers();
    let mut builder = config.builder().name(&name);
    if args.gpu.gpu == crate::args::GpuChoice::Sim {
        builder = builder.gpu(crate::gpubench::provider(&args.gpu)?);
    }
    let engine = builder.build().map_err(|e| e.to_string())?;
    let listen = engine.control_addr();
    // With --kv, the one region is a KV cache of that model, published as
    // the engine's layout for peers' memory-info requests.
    let (region_bytes, shape) = match &kv_model {
        Some(model) => {
            let shape = model.shape(kv_blocks)?;
            (shape.bytes().map_err(|e| e.to_string())?, Some(shape))
        }
        None => (region_bytes, None),
    };
    let info = match memory {
        kvring::MemoryKind::Gpu(n) => RegionInfo::raw().on_gpu(n),
        kvring::MemoryKind::Host => RegionInfo::raw(),
    };
    let region = match args.caller_memory {
        true => Served::Caller(CallerMemory::register(&engine, region_bytes as usize)?),
        false => Served::Engine(engine.alloc_region(region_bytes as usize, info).map_err(|e| match memory {
            kvring::MemoryKind::Gpu(_) => format!("{e} (`--gpu sim` serves a simulated GPU's memory)"),
            kvring::MemoryKind::Host => e.to_string(),
        })?),
    };
    // Beside a GPU region, a host one of the same size: `kvring bench
    // --memory gpu --transport tcp` measures host-memory tcp of the same
    // blocks against it in the same run (what staging costs).
    let _beside = match memory {
        kvring::MemoryKind::Gpu(_) if !args.caller_memory => {
            Some(engine.alloc_region(region_bytes as usize, RegionInfo::raw()).map_err(|e| e.to_string())?)
        }
        _ => None,
    };
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
    // On the cores of the lanes that serve the bench's connections: the
    // same path as kvring's (see `raw::sink_cores`).
    let sink_cores = crate::raw::sink_cores(&engine.lane_cores());
    let (_raw, raw_addr) =
        raw_sink(args.raw_sink, bind_ip, config.get("token").map(kvring::Token::new), sink_cores, listen.ip())?;
    println!(
        "kvring serve: name={name} listen={} tcp={} raw={} epoch={:#018x} region={} size={} memory={} metadata={}",
        engine.control_addr(),
        engine.tcp_addr().unwrap_or("-"),
        raw_addr,
        engine.epoch(),
        region.id(),
        format_size(region_bytes),
        if args.caller_memory { "caller".to_string() } else { crate::args::format_memory(memory) },
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

/// The raw-TCP baseline sink and the address it is announced at (`-`
/// when none runs). Only when asked (`--raw-sink`): it is a bench's
/// baseline, not a service, and answers anyone who passes its token check.
fn raw_sink(
    asked: bool,
    bind_ip: std::net::IpAddr,
    token: Option<kvring::Token>,
    cores: Vec<usize>,
    announced: std::net::IpAddr,
) -> Result<(Option<crate::raw::RawSink>, String), String> {
    if !asked {
        return Ok((None, "-".to_string()));
    }
    let raw = crate::raw::RawSink::start(bind_ip, token, cores)
        .map_err(|e| format!("starting the raw baseline sink: {e}"))?;
    let addr = std::net::SocketAddr::new(announced, raw.addr().port()).to_string();
    Ok((Some(raw), addr))
}

/// The served region: kvring's own memory, or the process's own.
enum Served {
    Engine(kvring::Region),
    Caller(CallerMemory),
}

impl Served {
    fn id(&self) -> kvring::RegionId {
        match self {
            Served::Engine(region) => region.id(),
            Served::Caller(memory) => memory.id,
        }
    }
}

/// Anonymous memory this process maps and registers, as an inference
/// engine registers its own tensors; unmapped on drop, after the engine
/// stopped.
struct CallerMemory {
    addr: *mut libc::c_void,
    len: usize,
    id: kvring::RegionId,
}

impl CallerMemory {
    /// Maps `len` bytes as numpy does for a large array (anonymous memory,
    /// huge pages asked for: numpy madvises `MADV_HUGEPAGE` on Linux),
    /// faults them in, and registers them.
    fn register(engine: &kvring::Engine, len: usize) -> Result<Self, String> {
        let (prot, flags) = (libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS);
        // SAFETY: a new anonymous private mapping; no pointer of ours is involved.
        let addr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
        if addr == libc::MAP_FAILED {
            return Err(format!(
                "mapping {} of caller memory: {}",
                format_size(len as u64),
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: advice on our own new mapping; a kernel without THP
        // refuses it, which changes nothing.
        unsafe { libc::madvise(addr, len, libc::MADV_HUGEPAGE) };
        // Every page faulted in now, not on the first transfer.
        // SAFETY: our own mapping, `len` bytes, written before anyone reads it.
        unsafe { std::ptr::write_bytes(addr.cast::<u8>(), 0, len) };
        // SAFETY: the mapping stays until this value drops, which `run`
        // does only after the engine stopped.
        match unsafe { engine.register(addr.cast(), len, RegionInfo::raw()) } {
            Ok(id) => Ok(Self { addr, len, id }),
            Err(error) => {
                // SAFETY: our own mapping, registered nowhere.
                unsafe { libc::munmap(addr, len) };
                Err(error.to_string())
            }
        }
    }
}

impl Drop for CallerMemory {
    fn drop(&mut self) {
        // SAFETY: our own mapping; the engine that had it registered stopped.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// A `kvring serve` child, as `kvring bench` starts it when given no
/// `--peer`: its addresses read from the first line it prints; killed and
/// reaped on drop.
pub struct Target {
    child: Child,
    /// Its control address (`listen=` on its first line).
    pub addr: String,
    /// Its raw-TCP baseline sink (`raw=`), for the tcp baseline.
    pub raw_addr: Option<String>,
}

impl Target {
    /// Starts `kvring serve` with a region of `region_bytes` and `extra`
    /// flags, and waits for its first line.
    pub fn spawn(region_bytes: u64, extra: &[String]) -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("locating the kvring binary: {e}"))?;
        let mut child = Command::new(exe)
            .args(["serve", "--name", "bench-target", "--listen", "127.0.0.1:0", "--parent-watch", "--raw-sink"])
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
        let (addr, raw_addr) = (field("listen="), field("raw=").filter(|raw| raw != "-"));
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
