//! Cluster metadata on a real etcd, started by each test on free loopback
//! ports with a temporary data directory (Debian's `etcd-server`; `.ci/run`
//! installs it). Without an `etcd` binary the tests print why and skip.

mod common;

use common::child::Reaped;
use common::{pattern, WAIT};
use kvring::testing::etcd::{Etcd, EtcdUrl};
use kvring::MetadataMode;
use kvring::{Batch, BlockDesc, Engine, Error, RegionInfo, TransportKind};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct EtcdServer {
    child: Child,
    url: String,
    addr: String,
    _dir: TempDir,
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn etcd_binary() -> Option<&'static str> {
    let found = Command::new("etcd").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    match found {
        Ok(status) if status.success() => Some("etcd"),
        _ => {
            eprintln!("skipped: no `etcd` on PATH (apt-get install etcd-server; .ci/run does)");
            None
        }
    }
}

impl EtcdServer {
    fn start() -> Option<Self> {
        let binary = etcd_binary()?;
        let (client, peer) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("kvring-etcd-{}-{client}", std::process::id()));
        let child = Command::new(binary)
            .args(["--name", "test", "--data-dir"])
            .arg(&dir)
            .args(["--listen-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--advertise-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &format!("test=http://127.0.0.1:{peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd starts");
        let addr = format!("127.0.0.1:{client}");
        let server = Self { child, url: format!("etcd://{addr}"), addr, _dir: TempDir(dir) };
        let etcd = server.client();
        let deadline = Instant::now() + WAIT;
        while etcd.get("/ready", Instant::now() + Duration::from_millis(500)).is_err() {
            assert!(Instant::now() < deadline, "etcd did not come up on {}", server.addr);
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(server)
    }

    fn client(&self) -> Etcd {
        Etcd::new(EtcdUrl::parse(&self.url).unwrap())
    }

    fn key_exists(&self, name: &str) -> bool {
        let etcd = self.client();
        etcd.get(&etcd.url().key(name), Instant::now() + WAIT).unwrap().is_some()
    }

    fn wait_for_key(&self, name: &str, present: bool, within: Duration) -> Duration {
        let started = Instant::now();
        while self.key_exists(name) != present {
            assert!(started.elapsed() < within, "{name}'s key still {}", if present { "absent" } else { "present" });
            std::thread::sleep(Duration::from_millis(50));
        }
        started.elapsed()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn engine_on(etcd: &EtcdServer, name: &str) -> Engine {
    common::builder(name)
        .metadata(etcd_mode(etcd.url.as_str()))
        .metadata_poll(Duration::from_millis(100))
        .build()
        .unwrap()
}

fn push(engine: &Engine, segment: &kvring::Segment, local: &kvring::Region, len: u64) -> kvring::Outcome {
    let mut sub = engine.submitter().unwrap();
    let remote = segment.region(0).unwrap();
    let id = sub.submit(&Batch::write(segment).block(BlockDesc::new(local.id(), 0, remote, 0, len))).unwrap();
    sub.wait(id, WAIT).unwrap()
}

#[test]
fn an_engine_published_in_etcd_is_opened_by_name_and_moves_blocks() {
    let Some(etcd) = EtcdServer::start() else { return };
    let target = engine_on(&etcd, "decode-0");
    let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    assert!(etcd.key_exists("decode-0"));
    assert_eq!(target.metadata_mode().to_string(), format!("etcd at {}, keys under /kvring/segments/", etcd.addr));

    let initiator = engine_on(&etcd, "prefill-0");
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(3) };
    let segment = initiator.open_segment_with("decode-0", Some(TransportKind::Tcp), WAIT).unwrap();
    assert_eq!((segment.name(), segment.epoch()), ("decode-0", target.epoch()));
    let after_open = initiator.metadata_calls();
    assert!(after_open >= 1);
    let mut sub = initiator.submitter().unwrap();
    for i in 0..20u64 {
        let descs = [BlockDesc::new(local.id(), i * 4096, remote.id(), i * 4096, 4096)];
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        assert!(sub.wait(id, WAIT).unwrap().is_done());
        // A cached name costs no metadata call either.
        initiator.open_segment("decode-0").unwrap();
    }
    assert_eq!(initiator.metadata_calls(), after_open, "no metadata call per batch or per cached open");
    let mut got = vec![0u8; 20 * 4096];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { remote.read_at(0, &mut got).unwrap() };
    assert_eq!(got, pattern(1 << 20, 3)[..20 * 4096]);

    let error = initiator.open_segment("decode-9").unwrap_err().to_string();
    assert!(error.contains("no key /kvring/segments/decode-9") && error.contains(&etcd.addr), "{error}");

    // A clean shutdown takes the entry away at once.
    target.shutdown();
    etcd.wait_for_key("decode-0", false, Duration::from_secs(2));
}

/// A `kvring serve` child, killed and reaped when dropped.
type Serve = Reaped;

fn serve_published(etcd: &EtcdServer, name: &str, ttl: &str) -> Serve {
    let (child, line) = common::child::serve_published(name, &etcd.url, ttl);
    assert!(line.contains(&format!("name={name}")) && line.contains("metadata=etcd://"), "{line}");
    child
}

#[test]
fn a_killed_engine_s_entry_goes_with_its_lease() {
    let Some(etcd) = EtcdServer::start() else { return };
    let mut serve = serve_published(&etcd, "decode-k", "2s");
    assert!(etcd.key_exists("decode-k"));
    serve.0.kill().unwrap(); // kill -9: nobody revokes the lease
    serve.0.wait().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(etcd.key_exists("decode-k"), "the key outlives the process until its lease expires");
    let gone_after = etcd.wait_for_key("decode-k", false, Duration::from_secs(10));
    eprintln!("entry gone {gone_after:?} after the check that followed the kill");
}

#[test]
fn a_restarted_peer_is_noticed_by_its_epoch_and_reopened_by_name() {
    let Some(etcd) = EtcdServer::start() else { return };
    let initiator = engine_on(&etcd, "prefill-0");
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let mut first = serve_published(&etcd, "decode-r", "5s");
    let segment = initiator.open_segment_with("decode-r", Some(TransportKind::Tcp), WAIT).unwrap();
    assert!(push(&initiator, &segment, &local, 4096).is_done());

    first.0.kill().unwrap();
    first.0.wait().unwrap();
    let _second = serve_published(&etcd, "decode-r", "5s");
    // The watcher reads the new epoch and marks the handle stale, before
    // any transfer has to fail on it.
    let started = Instant::now();
    while !segment.is_stale() {
        assert!(started.elapsed() < WAIT, "the restart was not noticed");
        std::thread::sleep(Duration::from_millis(10));
    }
    let reopened = initiator.open_segment_with("decode-r", Some(TransportKind::Tcp), WAIT).unwrap();
    assert_ne!(reopened.epoch(), segment.epoch());
    assert!(push(&initiator, &reopened, &local, 4096).is_done());
}

#[test]
fn with_etcd_down_opens_fail_naming_it_and_open_segments_keep_moving() {
    let Some(mut etcd) = EtcdServer::start() else { return };
    let target = engine_on(&etcd, "decode-0");
    let _remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let initiator = engine_on(&etcd, "prefill-0");
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let segment = initiator.open_segment_with("decode-0", Some(TransportKind::Tcp), WAIT).unwrap();

    etcd.child.kill().unwrap();
    etcd.child.wait().unwrap();
    let error = initiator.open_segment_with("decode-1", None, Duration::from_secs(2)).unwrap_err().to_string();
    assert!(error.contains(&format!("etcd at {}", etcd.addr)), "{error}");
    // The data path never touches metadata, and the watcher changes nothing
    // it cannot read.
    std::thread::sleep(Duration::from_millis(300));
    assert!(!segment.is_stale());
    assert!(push(&initiator, &segment, &local, 64 * 1024).is_done());
    // A new engine cannot publish, and says where it tried.
    let error = common::builder("decode-2").metadata(etcd_mode(etcd.url.as_str())).build().unwrap_err().to_string();
    assert!(error.contains(&etcd.addr), "{error}");
}

#[test]
fn bad_urls_prefixes_and_stored_descriptors_get_clear_errors() {
    common::assert_urls_refused(&[
        ("etcd://localhost", "needs host:port"),
        ("etcd//localhost:2379", "neither P2PHANDSHAKE nor etcd://"),
        ("etcd://localhost:2379/kvring", "start and end with '/'"),
        ("etcd://localhost:2379/a/../b/", "'..'"),
    ]);
    // 192.0.2.1 (TEST-NET-1) is no address of this host: publishing a
    // loopback address there would strand every peer.
    let error = common::builder("loop").metadata(etcd_mode("etcd://192.0.2.1:2379")).build().unwrap_err().to_string();
    assert!(error.contains("127.0.0.1") && error.contains("is not on this host"), "{error}");
    let Some(etcd) = EtcdServer::start() else { return };
    let client = etcd.client();
    let deadline = Instant::now() + WAIT;
    client.put(&client.url().key("decode-x"), b"\x0a\xff\xff not a descriptor", 0, deadline).unwrap();
    let initiator = engine_on(&etcd, "prefill-0");
    match initiator.open_segment("decode-x") {
        Err(Error::Malformed { .. }) => {}
        other => panic!("expected Malformed, got {other:?}"),
    }
    // Under a custom prefix, names resolve there and nowhere else.
    let url = format!("etcd://{}/cluster-b/", etcd.addr);
    let target = common::builder("decode-b").metadata(etcd_mode(url.as_str())).build().unwrap();
    let _region = target.alloc_region(4096, RegionInfo::raw()).unwrap();
    assert!(client.get("/cluster-b/decode-b", deadline).unwrap().is_some());
    assert!(initiator.open_segment("decode-b").is_err(), "not under the default prefix");
    let other = common::builder("prefill-b").metadata(etcd_mode(url.as_str())).build().unwrap();
    assert_eq!(other.open_segment("decode-b").unwrap().epoch(), target.epoch());
}

/// The metadata mode for an etcd URL the test knows to be well formed.
fn etcd_mode(url: &str) -> MetadataMode {
    MetadataMode::parse(url).unwrap()
}
