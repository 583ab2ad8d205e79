//! Real processes: `kvring serve` as the target, the initiator here or in
//! `kvring bench`; real sockets for the control plane's bad-input cases.

mod common;

use common::{kvring_bin, pattern, WAIT};
use kvring::testing::control::{decode_response, read_frame, write_frame, CONTROL_VERSION, MAX_CONTROL_MESSAGE_BYTES};
use kvring::testing::control::{request, response, HandshakeRequest, Request};
use kvring::{Batch, BlockDesc, Error, ErrorCode, RegionInfo};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Serve {
    child: Child,
    addr: String,
    stdout: BufReader<std::process::ChildStdout>,
}

fn serve(region: &str) -> Serve {
    let mut child = Command::new(kvring_bin())
        .args(["serve", "--name", "decode-0", "--listen", "127.0.0.1:0", "--region-size", region, "--parent-watch"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvring serve starts");
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let addr = line
        .split_whitespace()
        .find_map(|f| f.strip_prefix("listen="))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    assert!(line.contains("name=decode-0"), "{line}");
    Serve { child, addr, stdout }
}

impl Serve {
    /// SIGTERM, then wait (bounded) for a clean exit; returns stderr.
    fn terminate(mut self) -> String {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "serve exited with {status}");
                break;
            }
            assert!(Instant::now() < deadline, "serve ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut stderr = String::new();
        self.child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
        let mut rest = String::new();
        self.stdout.read_to_string(&mut rest).unwrap();
        stderr
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn push_and_pull_across_two_processes_verified_on_the_target() {
    let target = serve("4MiB");
    let engine = common::engine("prefill-0");
    let local = engine.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(21) };
    let segment = engine.open_segment(&target.addr).unwrap();
    assert_eq!(segment.name(), "decode-0");
    let remote = segment.region(0).unwrap();
    let mut sub = engine.submitter().unwrap();
    let descs: Vec<_> = (0..64u64).map(|i| BlockDesc::new(local.id(), i * 65536, remote, i * 65536, 65536)).collect();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    assert_eq!(sub.wait(id, WAIT).unwrap().into_result().unwrap(), 4 << 20);
    let on_target = segment.remote_checksum(remote, 0, 4 << 20, WAIT).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    assert_eq!(on_target, unsafe { local.checksum(0, 4 << 20).unwrap() }, "the target holds exactly what was pushed");

    // Pull back into a cleared region.
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.write_at(0, &vec![0u8; 4 << 20]).unwrap() };
    let id = sub.submit(&Batch::read(&segment).descs(&descs)).unwrap();
    sub.wait(id, WAIT).unwrap().into_result().unwrap();
    let mut pulled = vec![0u8; 4 << 20];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.read_at(0, &mut pulled).unwrap() };
    assert_eq!(pulled, pattern(4 << 20, 21));

    // A checksum past the region's end is refused by the target.
    assert!(segment.remote_checksum(remote, 1, 4 << 20, WAIT).unwrap_err().to_string().contains("exceeds region"));
    let stderr = target.terminate();
    assert!(stderr.contains("decode-0 stopped"), "{stderr}");
}

#[test]
fn the_bench_runs_every_case_verified_with_its_json_fields() {
    let output = Command::new(kvring_bin())
        .args(["bench", "--total", "8MiB", "--region-size", "8MiB", "--latency-samples", "20", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 6, "{stdout}");
    let mut cases = Vec::new();
    for line in lines {
        for field in [
            "\"op\":",
            "\"transport\":\"shm\"",
            "\"block_bytes\":",
            "\"batch\":64",
            "\"gbps\":",
            "\"p50_us\":",
            "\"p99_us\":",
            "\"baseline_gbps\":",
            "\"verified\":true",
        ] {
            assert!(line.contains(field), "{field} missing in {line}");
        }
        let op = if line.contains("\"op\":\"write\"") { "write" } else { "read" };
        let block = line.split("\"block_bytes\":").nth(1).unwrap().split(',').next().unwrap().to_string();
        cases.push(format!("{op}/{block}"));
    }
    assert_eq!(cases, ["write/4096", "write/65536", "write/1048576", "read/4096", "read/65536", "read/1048576"]);
}

#[test]
fn the_tcp_bench_verifies_against_a_raw_socket_baseline() {
    let lines = common::bench_json(
        &["--transport", "tcp", "--block-size", "4KiB,1MiB"],
        4,
        &["\"transport\":\"tcp\"", "\"baseline\":\"raw-tcp\"", "\"verified\":true"],
    );
    for line in &lines {
        let baseline: f64 =
            line.split("\"baseline_gbps\":").nth(1).unwrap().split(',').next().unwrap().parse().unwrap();
        assert!(baseline > 0.0, "the raw baseline ran: {line}");
    }
}

#[test]
fn bad_bench_flags_are_named() {
    for (args, expected) in [
        (vec!["bench", "--op", "sideways"], "invalid value 'sideways' for '--op <OP>'"),
        (vec!["bench", "--block-size", "4XB"], "unknown size unit"),
        (vec!["bench", "--transport", "carrier-pigeon"], "[possible values: shm, cuda_ipc, cma, tcp, null"),
        (vec!["bench", "--frobnicate"], "unexpected argument '--frobnicate'"),
        (vec!["serve", "--listen", "nowhere"], "--listen: listen: \"nowhere\" is not an ip:port address"),
    ] {
        let output = Command::new(kvring_bin()).args(&args).output().unwrap();
        assert!(!output.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

#[test]
fn lanes_need_no_locked_memory() {
    // Lanes were once glommio executors, each refusing to start under a
    // 512 KiB locked-memory limit; plain lane threads lock nothing, so
    // both engines of a bench start and move verified data with none.
    let mut command = Command::new(kvring_bin());
    command.args(["bench", "--total", "4MiB", "--region-size", "4MiB", "--latency-samples", "10", "--lanes", "2"]);
    command.arg("--json");
    // SAFETY: setrlimit is async-signal-safe and only touches the child.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let output = command.output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
    assert!(!stdout.is_empty() && stdout.lines().all(|line| line.contains("\"verified\":true")), "{stdout}");
}

/// A raw control connection: the preface each way, then `bytes`.
fn send_raw(addr: &str, bytes: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream.write_all(&kvring::testing::control::preface()).unwrap();
    let mut preface = [0u8; 8];
    stream.read_exact(&mut preface).unwrap();
    assert_eq!(preface, kvring::testing::control::preface());
    stream.write_all(bytes).unwrap();
    stream
}

fn reply_of(stream: &mut TcpStream) -> kvring::Result<response::Body> {
    let frame = read_frame(stream, MAX_CONTROL_MESSAGE_BYTES).unwrap().expect("a reply");
    decode_response(&frame)
}

fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = (body.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

#[test]
fn malformed_and_wrong_version_control_messages_get_clear_errors_and_the_server_keeps_serving() {
    let target = serve("1MiB");
    // Garbage inside a well-formed frame: an error reply, connection kept.
    let mut stream = send_raw(&target.addr, &framed(&[0xff, 0xff, 0xff, 0xff]));
    match reply_of(&mut stream) {
        Err(Error::Remote { code: ErrorCode::MalformedMessage, message }) => {
            assert!(message.contains("malformed control request"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // Same connection, wrong version.
    let wrong = Request {
        version: 99,
        body: Some(request::Body::Handshake(HandshakeRequest { initiator: "x".into(), ..Default::default() })),
    };
    write_frame(&mut stream, &wrong).unwrap();
    match reply_of(&mut stream) {
        Err(Error::Remote { code: ErrorCode::VersionMismatch, message }) => {
            assert!(message.contains("version 99 is not supported"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    // An empty request.
    write_frame(&mut stream, &Request { version: CONTROL_VERSION, body: None }).unwrap();
    assert!(matches!(reply_of(&mut stream), Err(Error::Remote { code: ErrorCode::MalformedMessage, .. })));

    // An oversized length: an error reply, then the connection is closed.
    let mut stream = send_raw(&target.addr, &(MAX_CONTROL_MESSAGE_BYTES + 1).to_le_bytes());
    assert!(matches!(reply_of(&mut stream), Err(Error::Remote { code: ErrorCode::MessageTooLarge, .. })));
    let mut rest = Vec::new();
    assert_eq!(stream.read_to_end(&mut rest).unwrap_or(0), 0, "closed after losing the framing");

    // A peer that disconnects mid-frame.
    let stream = send_raw(&target.addr, &[100, 0, 0, 0, 1, 2, 3]);
    drop(stream);

    // The server still answers a proper handshake.
    let engine = common::engine("initiator");
    let segment = engine.open_segment(&target.addr).unwrap();
    assert_eq!(segment.name(), "decode-0");
    assert_eq!(segment.regions().len(), 1);
    target.terminate();
}

#[test]
fn opening_a_segment_where_nobody_listens_fails_within_its_deadline() {
    let engine = common::engine("initiator");
    // Bind then drop, so the port is (almost certainly) closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let started = Instant::now();
    let error = engine.open_segment_with(&format!("127.0.0.1:{port}"), None, Duration::from_secs(2)).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(error.to_string().contains("connecting to control server"), "{error}");
}

fn serve_on(port: u16) -> Serve {
    let listen = format!("127.0.0.1:{port}");
    let mut child = Command::new(kvring_bin())
        .args(["serve", "--name", "decode-0", "--listen", &listen, "--region-size", "1MiB", "--parent-watch"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvring serve starts");
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert!(line.contains(&listen), "{line}");
    Serve { child, addr: listen, stdout }
}

#[test]
fn a_soak_rides_out_a_peer_restart_and_verifies_what_it_reported_done() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut target = serve_on(port);
    let addr = target.addr.clone();
    let soak = Command::new(kvring_bin())
        .args(["bench", "--peer", &addr, "--transport", "tcp", "--duration", "3s", "--json"])
        .args(["--batch", "8", "--block-size", "4KiB", "--region-size", "1MiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    let _ = target.child.kill(); // kill -9 mid-stream
    let _ = target.child.wait();
    std::thread::sleep(Duration::from_millis(300));
    let restarted = serve_on(port);
    let output = soak.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "soak failed: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
    let failures = stdout.lines().filter(|l| l.contains("\"event\":\"failure\"")).count();
    assert!(failures >= 1, "the restart was seen: {stdout}");
    assert!(stdout.lines().any(|l| l.contains("\"event\":\"recovered\"")), "{stdout}");
    let summary = stdout.lines().last().unwrap();
    assert!(summary.contains("\"event\":\"summary\""), "{summary}");
    assert!(summary.contains("\"verified\":true"), "{summary}");
    assert!(!summary.contains("\"batches_done\":0,"), "{summary}");
    drop(restarted);
}

/// Eight `kill -9`s of the target in 40 s, each restarted on the same port
/// (a restarted target's control port is up a moment before its region is
/// registered): the soak rides out every one, reports each failure and
/// recovery, and verifies on the target what it reported done.
#[test]
fn a_soak_survives_eight_kill_9_restarts_of_its_target_in_40_seconds() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut target = serve_on(port);
    let addr = target.addr.clone();
    let soak = Command::new(kvring_bin())
        .args(["bench", "--peer", &addr, "--transport", "tcp", "--duration", "40s", "--json"])
        .args(["--batch", "8", "--block-size", "4KiB", "--region-size", "1MiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(3500));
        let _ = target.child.kill();
        let _ = target.child.wait();
        // Restart at once: the soak meets a half-started target at times.
        target = serve_on(port);
    }
    let output = soak.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "soak failed: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
    let recoveries = stdout.lines().filter(|l| l.contains("\"event\":\"recovered\"")).count();
    assert!(recoveries >= 8, "{recoveries} recoveries for 8 restarts: {stdout}");
    let summary = stdout.lines().last().unwrap();
    assert!(summary.contains("\"verified\":true"), "{summary}");
    assert!(!summary.contains("\"verified_bytes\":0,"), "something was verified: {summary}");
    drop(target);
}

#[test]
fn the_kv_bench_moves_a_request_planned_from_block_ids() {
    for (model, transport, after) in [("deepseek-v3", "shm", 61), ("llama3-8b", "tcp", 64)] {
        let output = Command::new(kvring_bin())
            .args(["bench", "--kv", model, "--tokens", "256", "--transport", transport, "--json"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{model}: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
        let line = stdout.lines().next().unwrap();
        for field in [
            format!("\"model\":\"{model}\""),
            format!("\"transport\":\"{transport}\""),
            format!("\"descs_after\":{after}"),
            "\"verified\":true".to_string(),
            "\"ms_per_request\":".to_string(),
            "\"baseline_gbps\":".to_string(),
            // The baseline alternates with the pushes, round by round.
            "\"rounds\":5".to_string(),
            "\"ratio_low\":".to_string(),
            "\"ratio_high\":".to_string(),
        ] {
            assert!(line.contains(&field), "{field} missing in {line}");
        }
    }
    let output = Command::new(kvring_bin()).args(["bench", "--kv", "gpt-9"]).output().unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("'gpt-9' for '--kv <MODEL>'") && stderr.contains("deepseek-v3, llama3-8b"), "{stderr}");
}

/// Pushes `count` 64 KiB blocks from `local` to `remote` region 0 as one batch.
fn push_64k(
    sub: &mut kvring::Submitter,
    segment: &kvring::Segment,
    local: &kvring::Region,
    count: u64,
    deadline: Option<Duration>,
) -> kvring::BatchId {
    let remote = segment.region(0).unwrap();
    let descs: Vec<BlockDesc> =
        (0..count).map(|i| BlockDesc::new(local.id(), i * 65536, remote, i * 65536, 65536)).collect();
    let mut batch = Batch::write(segment).descs(&descs);
    if let Some(deadline) = deadline {
        batch = batch.deadline(deadline);
    }
    sub.submit(&batch).unwrap()
}

#[test]
fn a_frozen_peer_does_not_hold_up_a_healthy_one_on_the_same_lane() {
    let frozen = serve("8MiB");
    let healthy = serve("8MiB");
    // One lane serves both peers; a long io timeout, so only the batch
    // deadline ends the frozen peer's batch.
    let engine = common::builder("prefill-0").lanes(1).io_timeout(Duration::from_secs(60)).build().unwrap();
    let local = engine.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(7) };
    let to_frozen = engine.open_segment_with(&frozen.addr, Some(kvring::TransportKind::Tcp), WAIT).unwrap();
    let to_healthy = engine.open_segment_with(&healthy.addr, Some(kvring::TransportKind::Tcp), WAIT).unwrap();
    let mut sub = engine.submitter().unwrap();

    // SAFETY: signalling our own child.
    unsafe { libc::kill(frozen.child.id() as i32, libc::SIGSTOP) };
    common::wait_until_stopped(frozen.child.id());
    // 4 MiB to a peer that reads nothing: more than the socket buffers
    // hold, so the lane has frames it cannot send.
    // Long enough that the healthy peer's 21 MiB end first even on a
    // loaded debug run; short of the io timeout and of WAIT.
    let deadline = Duration::from_secs(8);
    let stuck = push_64k(&mut sub, &to_frozen, &local, 64, Some(deadline));

    // Meanwhile the healthy peer gets batch after batch, and several at once.
    for _ in 0..10 {
        let id = push_64k(&mut sub, &to_healthy, &local, 8, None);
        assert!(sub.wait(id, WAIT).unwrap().is_done());
    }
    let ids: Vec<_> = (0..16).map(|_| push_64k(&mut sub, &to_healthy, &local, 16, None)).collect();
    for id in ids {
        assert!(sub.wait(id, WAIT).unwrap().is_done());
    }
    assert_eq!(
        sub.state(stuck).unwrap(),
        kvring::BatchState::Pending,
        "the healthy peer's batches ended while the frozen peer's was still in flight"
    );
    assert!(engine.lane_stats()[0].peak_in_flight >= 2, "{:?}", engine.lane_stats());

    // The frozen peer's batch ends at its deadline (TimedOut), not at the
    // 60 s io timeout, which would end it with the link's error instead.
    let outcome = sub.wait(stuck, WAIT + deadline).unwrap();
    assert!(matches!(outcome, kvring::Outcome::TimedOut { .. }), "{outcome:?}");

    // Its connection was closed (bytes of the timed-out batch could still
    // be on the wire), so the handle is stale; reopening by name works.
    // SAFETY: as above.
    unsafe { libc::kill(frozen.child.id() as i32, libc::SIGCONT) };
    let remote = to_frozen.region(0).unwrap();
    let refused = sub.submit(&Batch::write(&to_frozen).block(BlockDesc::new(local.id(), 0, remote, 0, 4096)));
    assert!(matches!(refused, Err(Error::PeerRestarted { .. })), "{refused:?}");
    let reopened = engine.open_segment_with(&frozen.addr, Some(kvring::TransportKind::Tcp), WAIT).unwrap();
    let id = push_64k(&mut sub, &reopened, &local, 16, None);
    assert!(sub.wait(id, WAIT).unwrap().is_done());

    // What the healthy peer acknowledged is there: read it back.
    let back = engine.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let remote = to_healthy.region(0).unwrap();
    let descs = [BlockDesc::new(back.id(), 0, remote, 0, 1 << 20)];
    let id = sub.submit(&Batch::read(&to_healthy).descs(&descs)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    let mut got = vec![0u8; 1 << 20];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { back.read_at(0, &mut got).unwrap() };
    assert!(got == pattern(4 << 20, 7)[..1 << 20], "the healthy peer holds the pushed bytes");
}

#[test]
fn info_shows_each_value_and_where_it_came_from() {
    let dir = std::env::temp_dir().join(format!("kvring-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("kvring.toml");
    std::fs::write(&file, "version = 1\nname = \"decode-7\"\nlanes = 2\nio_timeout = \"3s\"\ntoken = \"s3cret\"\n")
        .unwrap();
    let output = Command::new(kvring_bin())
        .args(["info", "--json", "--config"])
        .arg(&file)
        .args(["--io-timeout", "9s"])
        .env("KVRING_LANES", "3")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let info: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let setting = |key: &str| {
        let entry = info["config"].as_array().unwrap().iter().find(|e| e["key"] == key).unwrap().clone();
        (entry["value"].as_str().map(str::to_string), entry["source"].as_str().unwrap().to_string())
    };
    assert_eq!(setting("name"), (Some("decode-7".into()), file.display().to_string()));
    assert_eq!(setting("lanes"), (Some("3".into()), "$KVRING_LANES".into()));
    assert_eq!(setting("io_timeout"), (Some("9s".into()), "--io-timeout".into()));
    assert_eq!(setting("listen"), (Some("127.0.0.1:0".into()), "default".into()));
    assert_eq!(setting("token").0.as_deref(), Some("(set)"), "secrets are not printed");
    assert_eq!(info["advertised"]["source"], "listen address");
    assert_eq!(info["lanes"].as_array().unwrap().len(), 3);
    assert!(info["metadata"].as_str().unwrap().starts_with("peer handshake"));
    assert!(info["rdma"]["reason"].is_string() || info["rdma"]["devices"].is_array());

    // A wrong version or an unknown key stops every command, naming it.
    std::fs::write(&file, "version = 2\n").unwrap();
    let output = Command::new(kvring_bin()).args(["serve", "--config"]).arg(&file).output().unwrap();
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown version 2"), "{output:?}");
    std::fs::write(&file, "version = 1\nlanez = 1\n").unwrap();
    let output = Command::new(kvring_bin()).args(["bench", "--config"]).arg(&file).output().unwrap();
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown key \"lanez\""), "{output:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_wildcard_listener_advertises_a_concrete_address() {
    let mut child = Command::new(kvring_bin())
        .args(["serve", "--name", "decode-w", "--listen", "0.0.0.0:0", "--region-size", "1MiB", "--parent-watch"])
        .env("KVRING_HOST_IP", "127.0.0.1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.split_whitespace().find_map(|f| f.strip_prefix("listen=")).unwrap().to_string();
    assert!(addr.starts_with("127.0.0.1:"), "peers are told the concrete address: {line}");
    // And a peer reaches it there, data connection included.
    let engine = common::engine("prefill-w");
    let segment = engine.open_segment_with(&addr, Some(kvring::TransportKind::Tcp), WAIT).unwrap();
    assert_eq!(segment.name(), "decode-w");
    let _ = child.kill();
    let _ = child.wait();
    // Without any rule that yields one, it refuses to start rather than
    // advertise 0.0.0.0 or a loopback address by accident.
    let output = Command::new(kvring_bin())
        .args(["serve", "--listen", "0.0.0.0:0", "--region-size", "1MiB"])
        .env("HOST_IP", "not-an-address")
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("$HOST_IP=\"not-an-address\" is not an IP address"));
}
