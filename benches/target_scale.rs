//! What a target's connections cost: a `kvring serve` whose lanes serve
//! every data connection, measured with none and with thousands of proven,
//! idle peer connections open (from 64 loopback source addresses, as from
//! as many hosts). Prints, each against its same-run baseline:
//!
//! - CPU of the idle engine per lane (lane threads' own CPU time, from
//!   `/proc/<pid>/task/<tid>/schedstat`), without and with the connections;
//! - memory per idle connection: the target's RSS, and the kernel's slab
//!   (both ends of each loopback connection), after the connections' read
//!   buffers were freed;
//! - the engine's threads, without and with the connections;
//! - one active peer's 4 KiB WRITE round trip p50, without and with the
//!   connections, in alternating rounds.
//!
//! `cargo bench --bench target_scale` runs it in full (4,096 connections);
//! `-- --test` (CI) runs a short pass with 256.

#[path = "../tests/common/child.rs"]
mod child;

use child::Target;
use kvring::testing::tcp::{ClientHello, ServerHello, SERVER_HELLO_BYTES};
use kvring::{Batch, BlockDesc, Engine, RegionInfo, TransportKind};
use socket2::{Domain, Socket, Type};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use zerocopy::{FromBytes, IntoBytes};

const LANES: usize = 2;
const WAIT: Duration = Duration::from_secs(10);

struct Plan {
    connections: usize,
    idle_window: Duration,
    samples: usize,
    rounds: usize,
}

fn start_target() -> Target {
    child::start_lanes_target("scale-bench", LANES, "16MiB")
}

/// `count` proven, idle data connections (tokenless hellos), spread over 64
/// source addresses.
fn idle_connections(target: &Target, count: usize) -> Vec<TcpStream> {
    (0..count)
        .map(|i| {
            let source = Ipv4Addr::new(127, 0, 0, 2 + (i % 64) as u8);
            let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
            socket.bind(&SocketAddr::new(source.into(), 0).into()).expect("bind");
            socket.connect_timeout(&target.tcp.into(), WAIT).expect("connect");
            let mut stream: TcpStream = socket.into();
            stream.set_read_timeout(Some(WAIT)).expect("timeout");
            stream.write_all(ClientHello::new(target.epoch, [0; 16], [0; 16], [0; 16]).as_bytes()).expect("hello");
            let mut answer = [0u8; SERVER_HELLO_BYTES];
            stream.read_exact(&mut answer).expect("the target's hello");
            assert_eq!(ServerHello::read_from_bytes(&answer).expect("hello").status, 0, "admitted");
            stream
        })
        .collect()
}

/// (thread name, CPU nanoseconds so far) of each of `pid`'s threads.
fn thread_cpu(pid: u32) -> Vec<(String, u64)> {
    let mut threads = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the target runs").flatten() {
        let name = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default().trim().to_string();
        let schedstat = std::fs::read_to_string(task.path().join("schedstat")).unwrap_or_default();
        let ns = schedstat.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0);
        threads.push((name, ns));
    }
    threads
}

fn is_engine_thread(name: &str) -> bool {
    ["kvring-lane", "kvring-tcp", "kvring-control"].iter().any(|p| name.starts_with(p))
}

/// Percent of one core the lanes used over `window`, per lane.
fn lane_cpu_percent(pid: u32, window: Duration) -> f64 {
    let lanes = |threads: &[(String, u64)]| -> u64 {
        threads.iter().filter(|(name, _)| name.starts_with("kvring-lane")).map(|(_, ns)| ns).sum()
    };
    let before = lanes(&thread_cpu(pid));
    std::thread::sleep(window);
    let after = lanes(&thread_cpu(pid));
    (after - before) as f64 / window.as_nanos() as f64 * 100.0 / LANES as f64
}

/// A field of `/proc/<pid>/status` or `/proc/meminfo`, in kB.
fn kb(path: &str, key: &str) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let line = text.lines().find(|l| l.starts_with(key)).unwrap_or_default();
    line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// p50 of `samples` single-block 4 KiB WRITE round trips, in µs.
fn p50_us(sub: &mut kvring::Submitter, batch: &Batch, samples: usize) -> f64 {
    let mut times: Vec<Duration> = (0..samples + 200)
        .map(|_| {
            let started = Instant::now();
            let id = sub.submit(batch).expect("submit");
            assert!(sub.wait(id, WAIT).expect("wait").is_done(), "the round trip completes");
            started.elapsed()
        })
        .skip(200)
        .collect();
    times.sort_unstable();
    times[times.len() / 2].as_secs_f64() * 1e6
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let test_mode = std::env::args().any(|a| a == "--test");
    let plan = match test_mode {
        true => Plan { connections: 256, idle_window: Duration::from_millis(500), samples: 200, rounds: 1 },
        false => Plan { connections: 4096, idle_window: Duration::from_secs(10), samples: 3000, rounds: 3 },
    };
    let target = start_target();
    let pid = target.child.id();
    // Let the target settle (its lanes park after their busy-poll window).
    std::thread::sleep(Duration::from_millis(500));
    let idle_cpu = lane_cpu_percent(pid, plan.idle_window);
    let threads_idle = thread_cpu(pid).iter().filter(|(n, _)| is_engine_thread(n)).count();

    let rss_before = kb(&format!("/proc/{pid}/status"), "VmRSS:");
    let slab_before = kb("/proc/meminfo", "Slab:");
    let held = idle_connections(&target, plan.connections);
    // Read buffers are freed after a second of quiet.
    std::thread::sleep(Duration::from_millis(2500));
    let rss_per_conn = (kb(&format!("/proc/{pid}/status"), "VmRSS:").saturating_sub(rss_before)) as f64 * 1024.0
        / plan.connections as f64;
    let slab_per_conn =
        (kb("/proc/meminfo", "Slab:").saturating_sub(slab_before)) as f64 * 1024.0 / plan.connections as f64;
    let held_cpu = lane_cpu_percent(pid, plan.idle_window);
    let threads_held = thread_cpu(pid).iter().filter(|(n, _)| is_engine_thread(n)).count();
    drop(held);

    // One active peer, with and without the idle connections, alternating.
    let engine = Engine::builder().name("scale-bench-peer").build().expect("engine");
    let segment = engine.open_segment_with(&target.control, Some(TransportKind::Tcp), WAIT).expect("open");
    let local = engine.alloc_region(1 << 20, RegionInfo::raw()).expect("region");
    let mut sub = engine.submitter().expect("submitter");
    let desc = [BlockDesc::new(local.id(), 0, segment.region(0).expect("region 0"), 0, 4096)];
    let batch = Batch::write(&segment).descs(&desc);
    let (mut quiet, mut crowded) = (Vec::new(), Vec::new());
    for _ in 0..plan.rounds {
        quiet.push(p50_us(&mut sub, &batch, plan.samples));
        let held = idle_connections(&target, plan.connections);
        crowded.push(p50_us(&mut sub, &batch, plan.samples));
        drop(held);
    }
    let (quiet, crowded) = (median(&mut quiet), median(&mut crowded));

    let n = plan.connections;
    println!("target_scale: kvring serve, {LANES} lanes, {n} proven idle data connections from 64 source addresses");
    println!("  idle engine CPU per lane        {idle_cpu:6.3}% of a core (no connection)");
    println!("  with {n} idle connections    {held_cpu:6.3}% of a core per lane");
    println!("  memory per idle connection      {rss_per_conn:6.0} B of the target's RSS; {slab_per_conn:6.0} B of kernel slab (both ends)");
    println!(
        "  engine threads                  {threads_idle} with no connection, {threads_held} with {n} (lanes: {LANES})"
    );
    println!(
        "  one peer's 4 KiB WRITE p50      {quiet:6.2} us alone, {crowded:6.2} us beside {n} idle ({:.2}x)",
        crowded / quiet
    );
    assert_eq!(threads_idle, threads_held, "the engine's threads do not grow with its connections");
}
