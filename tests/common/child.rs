//! A process a test or bench starts (`kvring serve`, mostly): killed and
//! reaped when dropped, so a failing test leaves no server behind; and the
//! fields of the status line it prints.
#![allow(dead_code)]

use std::process::Child;

/// A child process, killed and reaped when dropped.
#[derive(Debug)]
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for Reaped {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

/// The value after `name` (`"epoch="`, `"tcp="`) in a `kvring serve`
/// status line; panics, naming both, when the line has none.
pub fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace().find_map(|f| f.strip_prefix(name)).unwrap_or_else(|| panic!("no {name} in {line:?}"))
}

/// Starts `kvring serve` with `args` (stdin piped, so that with
/// `--parent-watch` it stops when this process does; stderr dropped) and
/// reads the status line it prints once it serves.
pub fn serve(args: &[&str]) -> (Reaped, String) {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvring"))
        .arg("serve")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kvring serve starts");
    let stdout = child.stdout.take().expect("its stdout is piped");
    let child = Reaped(child);
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line).expect("kvring serve prints its status line");
    (child, line)
}

/// The engine's epoch in a `kvring serve` status line (`epoch=0x…`).
pub fn epoch(line: &str) -> u64 {
    u64::from_str_radix(field(line, "epoch=").trim_start_matches("0x"), 16).expect("a hex epoch")
}

/// The raw id of the served region in a status line (`region=index:generation`).
pub fn region(line: &str) -> u64 {
    let (index, generation) = field(line, "region=").split_once(':').expect("index:generation");
    kvring::RegionId::new(index.parse().expect("an index"), generation.parse().expect("a generation")).raw()
}

/// A `kvring serve` child and what its status line names.
#[derive(Debug)]
pub struct Target {
    /// The process (killed when the target drops).
    pub child: Reaped,
    /// Its control address.
    pub control: String,
    /// Its tcp data listener.
    pub tcp: std::net::SocketAddr,
    /// Its engine's epoch.
    pub epoch: u64,
    /// The raw id of the region it serves.
    pub region: u64,
}

/// Starts `kvring serve` with `args` (a `--region-size` among them) and
/// reads where it serves.
pub fn start_target(args: &[&str]) -> Target {
    let (child, line) = serve(args);
    Target {
        control: field(&line, "listen=").into(),
        tcp: field(&line, "tcp=").parse().expect("a tcp address"),
        epoch: epoch(&line),
        region: region(&line),
        child,
    }
}

/// `kvring serve` named `name`, publishing itself at metadata store `url`
/// with a `ttl` (1 MiB region).
pub fn serve_published(name: &str, url: &str, ttl: &str) -> (Reaped, String) {
    serve(&[
        "--name",
        name,
        "--listen",
        "127.0.0.1:0",
        "--region-size",
        "1MiB",
        "--parent-watch",
        "--metadata",
        url,
        "--metadata-ttl",
        ttl,
    ])
}

/// `kvring serve` named `name` with `lanes` lanes and a region of `size`.
pub fn start_lanes_target(name: &str, lanes: usize, size: &str) -> Target {
    let lanes = lanes.to_string();
    start_target(&[
        "--name",
        name,
        "--listen",
        "127.0.0.1:0",
        "--parent-watch",
        "--lanes",
        &lanes,
        "--region-size",
        size,
    ])
}

/// A `kvring serve` named "third" (its region files, or with
/// `--caller-memory` its cma page), its control address, and its descriptor
/// as any peer that opens it gets it (the handshake's, checked to name the
/// child's pid).
pub fn third_engine(extra: &[&str]) -> (Reaped, String, kvring::testing::SegmentDescriptor) {
    let mut args = vec!["--name", "third", "--listen", "127.0.0.1:0", "--region-size", "1MiB", "--parent-watch"];
    args.extend(extra);
    let (child, line) = serve(&args);
    let addr = field(&line, "listen=").to_string();
    let initiator = kvring::testing::control::Initiator { name: "curious".into(), epoch: 1, addr: String::new() };
    // `common::WAIT`: this file is also included alone (`#[path]`).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let handshake = kvring::testing::control::ControlClient::connect(&addr, deadline)
        .unwrap()
        .handshake(&initiator, None, deadline)
        .unwrap();
    assert_eq!(handshake.descriptor.pid, child.id());
    (child, addr, handshake.descriptor)
}
