//! Several hosts on one machine: network namespaces joined by a veth pair.
//! Needs root and iproute2 (CI has both); otherwise each test says why it
//! skips and passes. The target runs as `kvring serve` inside one
//! namespace; the initiator runs in this process on a thread moved into the
//! other (threads the engine starts from it stay in that namespace).

mod common;

use common::{kvring_bin, WAIT};
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, RegionInfo, TransportKind};
use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

static NEXT_NET: AtomicU32 = AtomicU32::new(0);

/// Two namespaces `a` and `b` joined by a veth pair, removed on drop.
struct Net {
    a: String,
    b: String,
    a_ip: String,
    b_ip: String,
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

impl Net {
    fn setup(test: &str) -> Option<Net> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipping {test}: network namespaces need root");
            return None;
        }
        if !ip(&["netns", "list"]) {
            println!("skipping {test}: iproute2 (`ip`) is not installed");
            return None;
        }
        let n = NEXT_NET.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}{}", std::process::id() % 100_000, n);
        let subnet = 100 + (std::process::id() % 50) * 3 + n;
        let net = Net {
            a: format!("kvra{tag}"),
            b: format!("kvrb{tag}"),
            a_ip: format!("10.213.{subnet}.1"),
            b_ip: format!("10.213.{subnet}.2"),
        };
        let (va, vb) = (format!("kva{tag}"), format!("kvb{tag}"));
        let steps: Vec<Vec<&str>> = vec![
            vec!["netns", "add", &net.a],
            vec!["netns", "add", &net.b],
            vec!["link", "add", &va, "type", "veth", "peer", "name", &vb],
            vec!["link", "set", &va, "netns", &net.a],
            vec!["link", "set", &vb, "netns", &net.b],
        ];
        let a_cidr = format!("{}/24", net.a_ip);
        let b_cidr = format!("{}/24", net.b_ip);
        let more: Vec<Vec<&str>> = vec![
            vec!["-n", &net.a, "addr", "add", &a_cidr, "dev", &va],
            vec!["-n", &net.b, "addr", "add", &b_cidr, "dev", &vb],
            vec!["-n", &net.a, "link", "set", &va, "up"],
            vec!["-n", &net.b, "link", "set", &vb, "up"],
            vec!["-n", &net.a, "link", "set", "lo", "up"],
            vec!["-n", &net.b, "link", "set", "lo", "up"],
        ];
        for step in steps.iter().chain(&more) {
            if !ip(step) {
                println!("skipping {test}: `ip {}` failed (no permission for namespaces here?)", step.join(" "));
                drop(net);
                return None;
            }
        }
        Some(net)
    }

    /// Runs `f` on a thread inside namespace `ns`.
    fn run_in<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let file = std::fs::File::open(format!("/var/run/netns/{ns}")).expect("namespace exists");
                    // SAFETY: setns on this thread only, with a namespace fd we own.
                    let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
                    assert_eq!(rc, 0, "setns into {ns}: {}", std::io::Error::last_os_error());
                    f()
                })
                .join()
                .expect("namespace thread")
        })
    }

    /// Starts `kvring serve` in namespace `b` on `port` (0: any).
    fn serve(&self, port: u16) -> Served {
        self.serve_with(port, &["--region-size", "4MiB"])
    }

    /// Starts `kvring serve` in namespace `b` on `port` with `extra` flags.
    fn serve_with(&self, port: u16, extra: &[&str]) -> Served {
        let listen = format!("{}:{port}", self.b_ip);
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.b, kvring_bin(), "serve", "--name", "decode-b", "--listen", &listen])
            .args(extra)
            .arg("--parent-watch")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("kvring serve starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.split_whitespace().find_map(|f| f.strip_prefix("listen=")).expect("serve prints its address");
        Served { addr: addr.to_string(), child }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        ip(&["netns", "del", &self.a]);
        ip(&["netns", "del", &self.b]);
    }
}

struct Served {
    addr: String,
    child: Child,
}

impl Served {
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits (bounded) until every thread of `pid` is stopped.
fn initiator(net: &Net, io_timeout: Duration) -> Engine {
    common::builder("prefill-a")
        .listen(format!("{}:0", net.a_ip).parse().unwrap())
        .io_timeout(io_timeout)
        .control_timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

#[test]
fn push_and_pull_across_hosts_over_tcp() {
    let Some(net) = Net::setup("push_and_pull_across_hosts_over_tcp") else { return };
    let target = net.serve(0);
    Net::run_in(&net.a, || {
        let engine = initiator(&net, WAIT);
        let local = engine.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.fill_pattern(77) };
        let segment = engine.open_segment_with(&target.addr, Some(TransportKind::Tcp), WAIT).unwrap();
        let remote = segment.region(0).unwrap();
        let mut sub = engine.submitter().unwrap();
        let descs: Vec<_> =
            (0..64u64).map(|i| BlockDesc::new(local.id(), i * 65536, remote, i * 65536, 65536)).collect();
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        assert_eq!(sub.wait(id, WAIT).unwrap().into_result().unwrap(), 4 << 20);
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        assert_eq!(segment.remote_checksum(remote, 0, 4 << 20, WAIT).unwrap(), unsafe {
            local.checksum(0, 4 << 20).unwrap()
        });
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        let expected = unsafe { local.checksum(0, 4 << 20).unwrap() };
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.write_at(0, &vec![0u8; 4 << 20]).unwrap() };
        let id = sub.submit(&Batch::read(&segment).descs(&descs)).unwrap();
        sub.wait(id, WAIT).unwrap().into_result().unwrap();
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        assert_eq!(unsafe { local.checksum(0, 4 << 20).unwrap() }, expected);
    });
}

#[test]
fn a_peer_killed_mid_stream_fails_its_batches_and_is_reached_again_after_restart() {
    let Some(net) = Net::setup("a_peer_killed_mid_stream_fails_its_batches_and_is_reached_again_after_restart") else {
        return;
    };
    let mut target = net.serve(0);
    let port: u16 = target.addr.rsplit(':').next().unwrap().parse().unwrap();
    Net::run_in(&net.a, || {
        let engine = initiator(&net, WAIT);
        let local = engine.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.fill_pattern(5) };
        let segment = engine.open_segment_with(&target.addr, Some(TransportKind::Tcp), WAIT).unwrap();
        let remote = segment.region(0).unwrap();
        let mut sub = engine.submitter().unwrap();
        let descs: Vec<_> =
            (0..16u64).map(|i| BlockDesc::new(local.id(), i * 65536, remote, i * 65536, 65536)).collect();
        let mut done = 0;
        for _ in 0..20 {
            let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
            assert!(sub.wait(id, WAIT).unwrap().is_done());
            done += 1;
        }
        assert_eq!(done, 20);
        target.kill(); // kill -9: no goodbye
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        match sub.wait(id, WAIT).unwrap() {
            Outcome::Failed(Error::PeerRestarted { .. }) => {}
            other => panic!("a batch to a killed peer must fail with PeerRestarted, got {other:?}"),
        }
        // Same address and port, new process, new epoch.
        let restarted = net.serve(port);
        let listening = Instant::now();
        let reopened = engine.open_segment_with(&restarted.addr, Some(TransportKind::Tcp), WAIT).unwrap();
        let id = sub.submit(&Batch::write(&reopened).descs(&descs)).unwrap();
        assert!(sub.wait(id, WAIT).unwrap().is_done());
        println!("first success {:?} after the restarted target printed its address", listening.elapsed());
        let remote = reopened.region(0).unwrap();
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        assert_eq!(reopened.remote_checksum(remote, 0, 1 << 20, WAIT).unwrap(), unsafe {
            local.checksum(0, 1 << 20).unwrap()
        });
        drop(restarted);
    });
}

#[test]
fn a_peer_that_never_answers_fails_within_the_deadline() {
    let Some(net) = Net::setup("a_peer_that_never_answers_fails_within_the_deadline") else { return };
    // A listener in namespace b that accepts and never says a word.
    let listener = Net::run_in(&net.b, || std::net::TcpListener::bind(format!("{}:0", net.b_ip)).unwrap());
    let silent = listener.local_addr().unwrap().to_string();
    let finished = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let holder_finished = finished.clone();
    let holder = std::thread::spawn(move || {
        let mut held = Vec::new();
        listener.set_nonblocking(true).unwrap();
        let started = Instant::now();
        while !holder_finished.load(Ordering::Acquire) && started.elapsed() < Duration::from_secs(30) {
            if let Ok((stream, _)) = listener.accept() {
                held.push(stream);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    // And a real target that we freeze (SIGSTOP) mid-stream.
    let target = net.serve(0);
    Net::run_in(&net.a, || {
        let engine = initiator(&net, Duration::from_millis(500));
        let started = Instant::now();
        let error = engine.open_segment_with(&silent, None, Duration::from_millis(300)).unwrap_err();
        assert!(matches!(error, Error::Timeout { .. }), "{error}");
        assert!(started.elapsed() < Duration::from_secs(3), "the handshake deadline held: {:?}", started.elapsed());

        let local = engine.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        let segment = engine.open_segment_with(&target.addr, Some(TransportKind::Tcp), WAIT).unwrap();
        let remote = segment.region(0).unwrap();
        let mut sub = engine.submitter().unwrap();
        // SAFETY: signalling the `ip netns exec` child, which execs kvring.
        unsafe { libc::kill(target.child.id() as i32, libc::SIGSTOP) };
        // A group stop reaches every thread only once one of them handles
        // the signal; until then a connection thread could still answer.
        common::wait_until_stopped(target.child.id());
        let started = Instant::now();
        let descs = [BlockDesc::new(local.id(), 0, remote, 0, 4096)];
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        let outcome = sub.wait(id, WAIT).unwrap();
        // SAFETY: as above.
        unsafe { libc::kill(target.child.id() as i32, libc::SIGCONT) };
        // Stalled, not restarted (its bytes may still land if it resumes).
        assert!(matches!(outcome, Outcome::Failed(Error::PeerStalled { .. })), "{outcome:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "bounded by the io timeout: {:?}", started.elapsed());
    });
    drop(target);
    finished.store(true, Ordering::Release);
    holder.join().unwrap();
}

/// KV caches in GPU memory on both hosts (the simulated GPU): a prefill
/// engine pushes blocks, pulls them back and pushes layer by layer across
/// the veth pair over tcp, staged through pinned pages on both ends; and
/// MLA's heterogeneous tp routing (one prefill rank to two decode ranks)
/// with device caches.
#[test]
fn kv_caches_in_gpu_memory_move_across_hosts_over_tcp() {
    use kvring::kv::{check_pd_topo, push_targets, Attention, KvLayout, Mode, Rank, TopoCheck};
    let Some(net) = Net::setup("kv_caches_in_gpu_memory_move_across_hosts_over_tcp") else { return };
    let flags = ["--kv", "deepseek-v3", "--kv-blocks", "8", "--memory", "gpu", "--gpu", "sim"];
    let decodes = [net.serve_with(0, &flags), net.serve_with(0, &flags)];
    Net::run_in(&net.a, || {
        let gpu: std::sync::Arc<dyn kvring::gpu::Gpu> =
            std::sync::Arc::new(kvring::gpu::SimGpu::new(1, Duration::from_micros(50)));
        let engine =
            common::builder("prefill-a").listen(format!("{}:0", net.a_ip).parse().unwrap()).gpu(gpu).build().unwrap();
        let first = engine.open_segment_with(&decodes[0].addr, Some(TransportKind::Tcp), WAIT).unwrap();
        let remote = first.kv_layout(WAIT).unwrap();
        let shape = *remote.shape();
        let cache = engine.alloc_region(shape.bytes().unwrap() as usize, RegionInfo::raw().on_gpu(0)).unwrap();
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { cache.fill_pattern(31) };
        let local = KvLayout::contiguous(shape, cache.id(), 0).unwrap();
        let mut sub = engine.submitter().unwrap();
        // What block `id` of `layer` holds here, by checksum.
        let here = |layer: u32, id: u64| {
            let buffer = local.layer(layer).unwrap()[0];
            // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
            unsafe { cache.checksum(buffer.offset + id * buffer.block_bytes, buffer.block_bytes as usize).unwrap() }
        };
        let there = |segment: &kvring::Segment, layout: &KvLayout, layer: u32, id: u64| {
            let buffer = layout.layer(layer).unwrap()[0];
            segment.remote_checksum(buffer.region, buffer.offset + id * buffer.block_bytes, buffer.block_bytes, WAIT)
        };

        // tp 1 -> tp 2 (MLA, push): every decode rank gets the blocks.
        let me = Rank { dp_size: 1, tp_size: 1, dp_rank: 0, tp_rank: 0 };
        let them = Rank { dp_size: 1, tp_size: 2, dp_rank: 0, tp_rank: 0 };
        assert_eq!(check_pd_topo(me, them, Mode::Push, Attention::Mla), TopoCheck::Heterogeneous);
        for target in push_targets(0, 1, 2) {
            let segment =
                engine.open_segment_with(&decodes[target as usize].addr, Some(TransportKind::Tcp), WAIT).unwrap();
            let layout = segment.kv_layout(WAIT).unwrap();
            let id = sub.push_blocks(&segment, &local, &layout, &[1, 2, 3], &[5, 6, 7]).unwrap();
            assert!(sub.wait(id, WAIT).unwrap().is_done());
            for layer in [0, 30, 60] {
                for (s, d) in [(1, 5), (2, 6), (3, 7)] {
                    assert_eq!(there(&segment, &layout, layer, d).unwrap(), here(layer, s), "decode {target}");
                }
            }
        }
        // Pulled back into other blocks of this GPU cache.
        let id = sub.pull_blocks(&first, &local, &remote, &[5, 6], &[0, 4]).unwrap();
        assert!(sub.wait(id, WAIT).unwrap().is_done());
        assert_eq!((here(10, 0), here(10, 4)), (here(10, 1), here(10, 2)));
        // Layer by layer, tagged for per-layer arrival.
        for layer in 0..shape.layers {
            let id = sub.push_layer_tagged(&first, &local, &remote, layer, 9, &[3], &[0]).unwrap();
            assert!(sub.wait(id, WAIT).unwrap().is_done());
        }
        assert_eq!(there(&first, &remote, 60, 0).unwrap(), here(60, 3));
    });
}
