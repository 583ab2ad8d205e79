//! Cross-memory attach with real processes: `kvring serve --caller-memory`
//! as the target (memory it maps itself, as an inference engine's tensors),
//! the initiator here. WRITE and READ verified on the target; a target that
//! exited (never a write into a recycled pid); a target that forbids cma
//! (the reason, and the next transport); a restarted target reached again.

mod common;

use common::{kvring_bin, pattern, WAIT};
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, Region, RegionInfo, Segment, TransportKind};
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Serve {
    child: Child,
    addr: String,
}

impl Serve {
    fn start(listen: &str, extra: &[&str], uid: Option<u32>) -> Self {
        let mut command = Command::new(kvring_bin());
        command
            .args(["serve", "--name", "decode-cma", "--listen", listen, "--region-size", "4MiB", "--parent-watch"])
            .arg("--caller-memory")
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(uid) = uid {
            command.uid(uid).gid(uid);
        }
        let mut child = command.spawn().expect("kvring serve starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.split_whitespace().find_map(|f| f.strip_prefix("listen=")).map(str::to_string);
        let addr = addr.unwrap_or_else(|| panic!("no address in {line:?}"));
        assert!(line.contains("memory=caller"), "{line}");
        Serve { child, addr }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `kill -9`, reaped.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const BLOCK: u64 = 64 << 10;

fn move_blocks(engine: &Engine, segment: &Segment, local: &Region, write: bool) -> kvring::Result<Outcome> {
    let remote = segment.region(0)?;
    let descs: Vec<_> = (0..64u64).map(|i| BlockDesc::new(local.id(), i * BLOCK, remote, i * BLOCK, BLOCK)).collect();
    let batch = if write { Batch::write(segment) } else { Batch::read(segment) };
    let mut sub = engine.submitter()?;
    let id = sub.submit(&batch.descs(&descs).deadline(WAIT))?;
    sub.wait(id, WAIT)
}

#[test]
fn caller_memory_on_this_host_moves_over_cma_verified_on_the_target() {
    let target = Serve::start("127.0.0.1:0", &[], None);
    let engine = common::engine("prefill-cma");
    let local = engine.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(11) };
    let segment = engine.open_segment(&target.addr).unwrap();
    assert_eq!(segment.transport(), TransportKind::Cma, "caller memory of a same-host peer");
    assert_eq!(move_blocks(&engine, &segment, &local, true).unwrap().into_result().unwrap(), 4 << 20);
    let remote = segment.region(0).unwrap();
    let on_target = segment.remote_checksum(remote, 0, 4 << 20, WAIT).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    assert_eq!(on_target, unsafe { local.checksum(0, 4 << 20).unwrap() }, "the target holds exactly what was pushed");
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.write_at(0, &vec![0u8; 4 << 20]).unwrap() };
    move_blocks(&engine, &segment, &local, false).unwrap().into_result().unwrap();
    let mut pulled = vec![0u8; 4 << 20];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.read_at(0, &mut pulled).unwrap() };
    assert_eq!(pulled, pattern(4 << 20, 11));
}

/// The first batch after the target died fails `PeerRestarted` (never a
/// timeout, never `Done`); reopening reaches the restarted target's new pid.
#[test]
fn a_target_that_exited_is_peer_restarted_and_its_restart_is_reached_again() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let target = Serve::start(&listen, &[], None);
    let engine = common::engine("prefill-cma");
    let local = engine.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    let segment = engine.open_segment(&listen).unwrap();
    assert_eq!(segment.transport(), TransportKind::Cma);
    move_blocks(&engine, &segment, &local, true).unwrap().into_result().unwrap();
    let (old_pid, old_epoch) = (target.pid(), segment.epoch());
    target.kill();
    match move_blocks(&engine, &segment, &local, true).unwrap() {
        Outcome::Failed(Error::PeerRestarted { detail, .. }) => {
            assert!(detail.contains(&format!("process {old_pid} exited")), "{detail}")
        }
        other => panic!("expected PeerRestarted, got {other:?}"),
    }
    let restarted = Serve::start(&listen, &[], None);
    let deadline = Instant::now() + WAIT;
    let segment = loop {
        match engine.open_segment(&listen) {
            Ok(segment) => break segment,
            Err(error) => assert!(Instant::now() < deadline, "never reopened: {error}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_ne!(segment.epoch(), old_epoch);
    assert_eq!(segment.transport(), TransportKind::Cma);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(12) };
    move_blocks(&engine, &segment, &local, true).unwrap().into_result().unwrap();
    let remote = segment.region(0).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    assert_eq!(segment.remote_checksum(remote, 0, 4 << 20, WAIT).unwrap(), unsafe {
        local.checksum(0, 4 << 20).unwrap()
    });
    drop(restarted);
}

/// As root, the dead target's pid is handed to a new process on purpose
/// (`ns_last_pid`, as CRIU restores pids): the batch still fails
/// `PeerRestarted`, since the pidfd is checked before any call.
#[test]
fn a_recycled_pid_is_never_written() {
    let Ok(()) = std::fs::OpenOptions::new().write(true).open("/proc/sys/kernel/ns_last_pid").map(drop) else {
        eprintln!("skipped: /proc/sys/kernel/ns_last_pid is not writable here (needs root)");
        return;
    };
    let target = Serve::start("127.0.0.1:0", &[], None);
    let engine = common::engine("prefill-cma");
    let local = engine.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    let segment = engine.open_segment(&target.addr).unwrap();
    assert_eq!(segment.transport(), TransportKind::Cma);
    move_blocks(&engine, &segment, &local, true).unwrap().into_result().unwrap();
    let pid = target.pid();
    target.kill();
    // Other processes may take the pid first: a few tries.
    let mut impostor = None;
    for _ in 0..50 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).unwrap();
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        if child.id() == pid {
            impostor = Some(child);
            break;
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    let Some(mut impostor) = impostor else {
        eprintln!("skipped: pid {pid} was taken by another process first");
        return;
    };
    let outcome = move_blocks(&engine, &segment, &local, true).unwrap();
    let alive = impostor.try_wait().unwrap().is_none();
    let _ = impostor.kill();
    let _ = impostor.wait();
    match outcome {
        Outcome::Failed(Error::PeerRestarted { detail, .. }) => assert!(detail.contains("exited"), "{detail}"),
        other => panic!("expected PeerRestarted with pid {pid} reused, got {other:?}"),
    }
    assert!(alive, "the process now at pid {pid} was untouched");
}

/// A target with `cma = off`, and one of another user: the default open
/// takes tcp; asking for cma names the reason.
#[test]
fn a_target_that_forbids_cma_is_reached_over_tcp_and_says_why() {
    let engine = common::engine("prefill-cma");
    let local = engine.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    let off = Serve::start("127.0.0.1:0", &["--cma", "off"], None);
    let error = engine.open_segment_with(&off.addr, Some(TransportKind::Cma), WAIT).unwrap_err().to_string();
    assert!(error.contains("cross-memory attach is turned off on that engine (cma = off)"), "{error}");
    let segment = engine.open_segment(&off.addr).unwrap();
    assert_eq!(segment.transport(), TransportKind::Tcp);
    move_blocks(&engine, &segment, &local, true).unwrap().into_result().unwrap();

    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped the other-user half: it starts the target as nobody, which needs root");
        return;
    }
    let theirs = Serve::start("127.0.0.1:0", &[], Some(65534));
    let error = engine.open_segment_with(&theirs.addr, Some(TransportKind::Cma), WAIT).unwrap_err().to_string();
    assert!(error.contains("owned by uid 65534, not this user"), "{error}");
    let segment = engine.open_segment(&theirs.addr).unwrap();
    assert_eq!(segment.transport(), TransportKind::Tcp, "the next transport in the order");
    move_blocks(&engine, &segment, &local, true).unwrap().into_result().unwrap();
}

#[test]
fn the_bench_runs_its_cma_cases_against_caller_memory_verified() {
    common::bench_json(
        &["--transport", "cma", "--block-size", "4KiB,64KiB"],
        4,
        &["\"transport\":\"cma\"", "\"baseline\":\"memcpy\"", "\"verified\":true"],
    );
}
