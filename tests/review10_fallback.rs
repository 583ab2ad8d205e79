//! Hostile review 10: shm chosen by default that does not open gives way
//! to the next allowed transport (`engine::segments`, `falls_back`,
//! `choose_excluding`). The peer is a control server in this process
//! answering the handshake with a lie: a real engine's descriptor whose
//! shm region names a file that is not there (the open fails `Io`, a
//! failure that falls back), or a file kvring never named (a refusal,
//! which must not), and whose cma page may be missing too. Each probe
//! asserts where the initiator may and may not go: only to allowed
//! transports, never when shm was asked for, the failed open named in a
//! refusal and in the log, the peer's epoch kept.

mod common;

use common::fake_peer::{answering, answering_wire};
use common::WAIT;
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, RegionInfo, TransportKind};
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

/// Held by every test here: the fallback's log line is rate limited per
/// process (one a second), and the log probe must see its own.
static ALONE: Mutex<()> = Mutex::new(());

/// The owner's descriptor with its one region's shm file renamed to one
/// kvring would give it (the owner's prefix, another number) that is not
/// there: opening it fails with `Io`.
fn missing_file(owner: &Engine) -> kvring::testing::SegmentDescriptor {
    let mut lie = kvring::testing::descriptor(owner);
    assert_eq!(lie.regions.len(), 1, "one region");
    let path = lie.regions[0].shm_path.clone().expect("shm-backed");
    let text = path.to_str().unwrap();
    let prefix = text.trim_end_matches(|c: char| c.is_ascii_digit());
    lie.regions[0].shm_path = Some(PathBuf::from(format!("{prefix}987654321")));
    lie
}

/// An owner with one shm-backed region of 4 KiB.
fn owner(name: &str) -> (Engine, kvring::Region) {
    let owner = common::engine(name);
    let region = owner.alloc_region(4096, RegionInfo::raw()).unwrap();
    (owner, region)
}

/// Writes `bytes` from a fresh region of `initiator` to the start of
/// `remote` over `segment`, and waits.
fn write_over(initiator: &Engine, segment: &kvring::Segment, remote: &kvring::Region, bytes: &[u8]) {
    let local = initiator.alloc_region(4096, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test writes them.
    unsafe { local.write_at(0, bytes).unwrap() };
    let descs = [BlockDesc::new(local.id(), 0, remote.id(), 0, bytes.len() as u64)];
    let outcome = common::run(&mut initiator.submitter().unwrap(), &Batch::write(segment).descs(&descs));
    assert!(matches!(outcome, Outcome::Done { .. }), "{outcome:?}");
    assert_eq!(common::read(remote, 0, bytes.len()), bytes);
}

// Holds: a shm that fails to open (`Io`) falls back within the allow-list
// only. With shm and tcp allowed, tcp is taken, the peer's epoch kept
// (the handshake's, not another), and the bytes land; with shm and rdma
// allowed (no rdma device here), the open is refused naming shm's failed
// open, and tcp, though the peer serves it, is never dialled.
#[test]
fn shm_that_does_not_open_falls_back_only_within_the_allow_list_and_keeps_the_epoch() {
    let _alone = ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    let (owner, remote) = owner("r10-fb-owner");
    let lie = missing_file(&owner);

    let both = common::builder("r10-fb-shm-tcp").transports([TransportKind::Shm, TransportKind::Tcp]).build().unwrap();
    let (addr, server) = answering(&lie);
    let segment = both.open_segment_with(&addr, None, WAIT).expect("tcp, the next allowed");
    assert_eq!(segment.transport(), TransportKind::Tcp);
    assert_eq!(segment.epoch(), owner.epoch(), "the handshake's peer, kept");
    write_over(&both, &segment, &remote, b"fell back to tcp");
    both.close_segment(&segment);
    server.join().unwrap();

    let no_tcp =
        common::builder("r10-fb-shm-rdma").transports([TransportKind::Shm, TransportKind::Rdma]).build().unwrap();
    let (addr, server) = answering(&lie);
    match no_tcp.open_segment_with(&addr, None, WAIT) {
        Err(Error::TransportRefused { reasons, offered, .. }) => {
            assert!(!offered.contains(&"tcp") || !reasons.iter().any(|(k, _)| *k == "tcp"), "{offered:?}");
            let shm = reasons.iter().find(|(kind, _)| *kind == "shm").map(|(_, why)| why.as_str()).unwrap_or("");
            assert!(shm.contains("did not open") && shm.contains("opening peer region"), "{reasons:?}");
        }
        other => panic!("refused, naming shm's failed open, not {other:?}"),
    }
    server.join().unwrap();
}

// Holds: an engine that requires shm (`require_transport`, an allow-list
// of one) does not fall back from a shm that did not open, though the
// peer serves tcp and cma: refused, shm's reason its failed open.
#[test]
fn an_engine_requiring_shm_never_falls_back() {
    let _alone = ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    let (owner, _remote) = owner("r10-fb-required-owner");
    let initiator = common::builder("r10-fb-required").require_transport(TransportKind::Shm).build().unwrap();
    let (addr, server) = answering(&missing_file(&owner));
    match initiator.open_segment_with(&addr, None, WAIT) {
        Err(Error::TransportRefused { allowed, reasons, .. }) => {
            assert_eq!(allowed, ["shm"]);
            let shm = reasons.iter().find(|(kind, _)| *kind == "shm").map(|(_, why)| why.as_str()).unwrap_or("");
            assert!(shm.contains("did not open") && shm.contains("opening peer region"), "{reasons:?}");
        }
        other => panic!("refused, naming shm's failed open, not {other:?}"),
    }
    server.join().unwrap();
}

// Holds: with a token, the fallback keeps the proven session. A real
// tokened owner past the cap of shm regions one peer may map (4,097 of
// them: `PeerLimit`) is reached over tcp by a tokened initiator (cma off,
// so tcp is next): its data connection proves the handshake's session
// (a tokened target refuses one that does not), the epoch is the owner's,
// and the bytes land in the region past the cap.
#[test]
fn a_tokened_fallback_keeps_the_proven_session() {
    let _alone = ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    let cap = kvring::MAX_PEER_SHM_REGIONS;
    let mut config = common::builder("r10-fb-tokened-owner").token("fallback-token").settings().clone();
    config.max_regions = cap + 1;
    let owner = Engine::builder().config(config).build().unwrap();
    let regions: Vec<_> = (0..=cap).map(|_| owner.alloc_region(4096, RegionInfo::raw()).unwrap()).collect();
    let initiator = common::builder("r10-fb-tokened").token("fallback-token").cma(false).build().unwrap();
    let addr = owner.control_addr().to_string();
    // Past any line another test here let through this second.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let mut opened = None;
    let log = logged(|| opened = Some(initiator.open_segment_with(&addr, None, WAIT)));
    let segment = opened.unwrap().expect("tcp, after shm past its cap");
    assert_eq!(segment.transport(), TransportKind::Tcp);
    assert!(log.contains("did not open") && log.contains("MAX_PEER_SHM_REGIONS"), "shm was tried first: {log}");
    assert_eq!(segment.epoch(), owner.epoch());
    write_over(&initiator, &segment, regions.last().unwrap(), b"proven over tcp");
    initiator.close_segment(&segment);
}

// Holds: shm asked for by name does not fall back: the caller gets the
// open's own error (`Io`, naming the file), not a link over another
// transport, even with every transport allowed.
#[test]
fn shm_asked_for_by_name_never_falls_back() {
    let _alone = ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    let (owner, _remote) = owner("r10-fb-asked-owner");
    let initiator = common::engine("r10-fb-asked");
    let (addr, server) = answering(&missing_file(&owner));
    match initiator.open_segment_with(&addr, Some(TransportKind::Shm), WAIT) {
        Err(error @ Error::Io { .. }) => assert!(error.to_string().contains("opening peer region"), "{error}"),
        other => panic!("the shm open's own error, not {other:?}"),
    }
    server.join().unwrap();
}

// Holds: a shm file that does not prove itself the peer's (a name kvring
// never gives that owner) is a refusal, not a failed open: no fallback,
// though tcp is allowed and served.
#[test]
fn a_shm_file_that_fails_its_proof_is_refused_not_fallen_back_from() {
    let _alone = ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    let (owner, _remote) = owner("r10-fb-proof-owner");
    let mut lie = kvring::testing::descriptor(&owner);
    lie.regions[0].shm_path = Some(PathBuf::from("/dev/shm/not-kvrings-name-1"));
    let initiator = common::engine("r10-fb-proof");
    let (addr, server) = answering(&lie);
    match initiator.open_segment_with(&addr, None, WAIT) {
        Err(error @ Error::Unsupported { .. }) => assert!(error.to_string().contains("not the name kvring"), "{error}"),
        other => panic!("the proof's refusal, not {other:?}"),
    }
    server.join().unwrap();
}

// HOLE. With no allow-list (every transport allowed) and nothing reaching
// the peer after shm (cma off, no tcp listener, no rdma), the fallback's
// second choice fails with the order's generic `Unsupported` ("no
// transport reaches ...: not on this host with shm regions ...", computed
// on the descriptor with shm struck out), and `choose_excluding` passes it
// on (`Err(other) => Err(other)`): the failed open's error is lost, and
// the caller is told, wrongly, that the peer has no shm regions. Only the
// allow-list's `TransportRefused` gets the failed open named.
// Fix: in `choose_excluding`, map any `Err` of the second choice to the
// last failed open's error (`failed.pop()`), as the "same link again" arm
// does.
#[test]
fn with_nothing_after_shm_the_caller_gets_the_failed_open_not_a_wrong_reason() {
    let _alone = ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    let (owner, _remote) = owner("r10-fb-nothing-owner");
    let mut lie = missing_file(&owner);
    lie.tcp_addr = None;
    let initiator = common::builder("r10-fb-nothing").cma(false).build().unwrap();
    let (addr, server) = answering(&lie);
    let result = initiator.open_segment_with(&addr, None, WAIT);
    server.join().unwrap();
    match result {
        Err(error) => assert!(
            error.to_string().contains("opening peer region"),
            "the caller is told the open that failed: {error}"
        ),
        Ok(segment) => panic!("nothing reaches it, yet it opened over {:?}", segment.transport()),
    }
}

/// The log lines written by `f` on this thread, as text.
fn logged(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap_or_else(PoisonError::into_inner).extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let bytes = sink.0.lock().unwrap_or_else(PoisonError::into_inner).clone();
    String::from_utf8_lossy(&bytes).to_string()
}

// HOLE (minor). shm, then cma, fail to open (the region file and the cma
// page both missing), and tcp is taken: two fallbacks in one open, each
// promised a warning naming its transport and why. Both go through the
// one `static LIMIT` of `choose_and_open`'s loop (one line a second), so
// the second, microseconds after the first, is held back: the log says
// shm gave way to cma, and never that cma failed, nor why, nor that the
// link is tcp. Fix: one warning per open, after the loop, naming every
// failed transport with its error and the one taken (or a limiter per
// transport).
#[test]
fn each_fallback_of_one_open_is_logged_with_its_reason() {
    let _alone = ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    // Past any line another test here let through this second.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let (owner, remote) = owner("r10-fb-log-owner");
    let mut lie = missing_file(&owner).to_proto();
    let cma = lie.cma.as_mut().expect("the owner offers cma");
    assert!(!cma.page.is_empty(), "the owner offers cma: {cma:?}");
    cma.page = format!("{}9", cma.page);
    let initiator = common::engine("r10-fb-log");
    let (addr, server) = answering_wire(lie);
    let mut opened = None;
    let log = logged(|| opened = Some(initiator.open_segment_with(&addr, None, WAIT)));
    let segment = opened.unwrap().expect("tcp, after shm and cma");
    assert_eq!(segment.transport(), TransportKind::Tcp);
    write_over(&initiator, &segment, &remote, b"two fallbacks");
    initiator.close_segment(&segment);
    server.join().unwrap();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("did not open")).collect();
    assert!(lines.iter().any(|l| l.contains("shm") && l.contains("opening peer region")), "{log}");
    assert!(lines.iter().any(|l| l.contains("cma") && l.contains("tcp")), "cma's failure and tcp taken: {log}");
}
