//! `Engine::open_many`: a TP group's peers opened in one call, each with its
//! own result, a dead peer's typed error beside the others' handles.

mod common;

use common::{engine, read, run, WAIT};
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, Region, RegionInfo, TransportKind};
use std::net::TcpListener;
use std::time::Duration;

const BLOCK: usize = 4096;
const TARGETS: usize = 8;

/// `count` real target engines on loopback, each with one region.
fn targets(count: usize) -> Vec<(Engine, Region)> {
    (0..count)
        .map(|i| {
            let target = engine(&format!("rank-{i}"));
            let region = target.alloc_region(BLOCK, RegionInfo::raw()).unwrap();
            (target, region)
        })
        .collect()
}

/// Writes a distinct block to every opened peer and checks it landed.
fn write_to_each(initiator: &Engine, opened: &[kvring::Segment], targets: &[(Engine, Region)]) {
    let local = initiator.alloc_region(BLOCK * opened.len(), RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches this region yet.
    unsafe { local.fill_pattern(7) };
    let mut sub = initiator.submitter().unwrap();
    for (i, (segment, (_, remote))) in opened.iter().zip(targets).enumerate() {
        let desc = BlockDesc::new(local.id(), (i * BLOCK) as u64, remote.id(), 0, BLOCK as u64);
        assert!(matches!(run(&mut sub, &Batch::write(segment).descs(&[desc])), Outcome::Done { .. }));
        assert_eq!(read(remote, 0, BLOCK), read(&local, (i * BLOCK) as u64, BLOCK), "rank {i}'s block");
    }
}

#[test]
fn eight_targets_open_in_one_call_over_tcp_and_shm() {
    let targets = targets(TARGETS);
    let addrs: Vec<String> = targets.iter().map(|(t, _)| t.control_addr().to_string()).collect();
    for transport in [Some(TransportKind::Tcp), None] {
        let initiator = engine("initiator");
        let opened: Vec<_> = initiator.open_many(&addrs, transport, WAIT).into_iter().map(Result::unwrap).collect();
        for (segment, (target, _)) in opened.iter().zip(&targets) {
            assert_eq!(segment.epoch(), target.epoch(), "each result is its own name's peer, in order");
            assert_eq!(segment.transport(), transport.unwrap_or(TransportKind::Shm));
        }
        write_to_each(&initiator, &opened, &targets);
    }
}

#[test]
fn a_dead_peer_gets_its_typed_error_while_the_others_open() {
    let targets = targets(TARGETS - 1);
    // A listener that accepts (the kernel's backlog does) but never
    // answers: the handshake can only end at the deadline.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut addrs: Vec<String> = targets.iter().map(|(t, _)| t.control_addr().to_string()).collect();
    let dead = 3;
    addrs.insert(dead, silent.local_addr().unwrap().to_string());
    let initiator = engine("initiator");
    let mut results = initiator.open_many(&addrs, Some(TransportKind::Tcp), Duration::from_millis(500));
    let error = results.remove(dead).unwrap_err();
    assert!(matches!(error, Error::Timeout { .. }), "the silent peer's error is a timeout: {error}");
    let opened: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    write_to_each(&initiator, &opened, &targets);
}

#[test]
fn a_refused_address_and_a_repeated_name_each_get_their_own_result() {
    let targets = targets(2);
    // Bound then dropped: nothing listens there, so connect is refused.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let first = targets[0].0.control_addr().to_string();
    let second = targets[1].0.control_addr().to_string();
    let names = [first.as_str(), closed.as_str(), second.as_str(), first.as_str()];
    let initiator = engine("initiator");
    let results = initiator.open_many(&names, Some(TransportKind::Tcp), WAIT);
    assert_eq!(results.len(), names.len());
    assert!(matches!(results[1], Err(Error::Io { .. })), "refused connect: {:?}", results[1]);
    let (a, b, again) = (results[0].as_ref().unwrap(), results[2].as_ref().unwrap(), results[3].as_ref().unwrap());
    assert_eq!((a.epoch(), b.epoch()), (targets[0].0.epoch(), targets[1].0.epoch()));
    assert_eq!(again.epoch(), a.epoch(), "a repeated name is the same peer's handle");
    assert_eq!(initiator.segment_cache_stats().hits, 1, "and it came from the cache");
}

#[test]
fn a_silent_peer_listed_twice_is_a_timeout_in_both_places_under_the_one_deadline() {
    let targets = targets(2);
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent = silent.local_addr().unwrap().to_string();
    let (first, second) = (targets[0].0.control_addr().to_string(), targets[1].0.control_addr().to_string());
    let names = [first.as_str(), silent.as_str(), second.as_str(), silent.as_str()];
    let initiator = engine("initiator");
    let timeout = Duration::from_millis(300);
    let mut results = initiator.open_many(&names, Some(TransportKind::Tcp), timeout);
    // Its second place is tried again with what is left of the shared
    // deadline: nothing, so it is the same typed error, which reports the
    // time the call has waited (the whole timeout, not `0ns`).
    let again = results.remove(3).unwrap_err();
    let Error::Timeout { waited, what } = again else { panic!("place 3: {again}") };
    assert!(waited >= timeout, "place 3 reported {waited:?}, under the {timeout:?} the call waited");
    assert_eq!(what, "the segment's open", "place 3 names the wait that ran out");
    let error = results.remove(1).unwrap_err();
    // The silent peer's kernel accepted: its preface is what never came.
    assert!(matches!(error, Error::Timeout { what: "the peer's control preface", .. }), "place 1: {error}");
    let opened: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    write_to_each(&initiator, &opened, &targets);
}

/// `kvring bench --cold` with two pairs per transport: a smoke run that
/// proves every measurement completes and verifies (the figures are the
/// bench's business, not this test's).
#[test]
fn bench_cold_runs_and_reports_each_transport() {
    let lines = common::bench_json(
        &["--cold", "--cold-pairs", "2"],
        2,
        &[
            "\"case\":\"cold\"",
            "first_p50_us",
            "first_p99_us",
            "open_many_p50_us",
            "one_open_p50_us",
            "open_many_ratio",
        ],
    );
    assert!(lines[0].contains("\"transport\":\"tcp\"") && lines[1].contains("\"transport\":\"shm\""), "{lines:?}");
}

/// Silent control connections: accepted, each holding a thread of its
/// target (half sent nothing, half a cut preface), more than the threads
/// a target keeps waiting for connections.
const SILENT_PER_TARGET: usize = 16;

#[test]
fn silent_control_connections_holding_the_targets_threads_do_not_starve_an_open() {
    // Their admission deadline outlasts the test, so they hold their
    // threads throughout (checked at the end) however slow the host.
    let patient = kvring::AdmissionLimits { timeout: Duration::from_secs(120), ..Default::default() };
    let targets: Vec<(Engine, Region)> = (0..TARGETS)
        .map(|i| {
            let target = common::builder(&format!("rank-{i}")).admission(patient).build().unwrap();
            let region = target.alloc_region(BLOCK, RegionInfo::raw()).unwrap();
            (target, region)
        })
        .collect();
    let addrs: Vec<String> = targets.iter().map(|(t, _)| t.control_addr().to_string()).collect();
    let mut silent = Vec::new();
    for addr in &addrs {
        for i in 0..SILENT_PER_TARGET {
            let mut stream = std::net::TcpStream::connect(addr).unwrap();
            if i % 2 == 1 {
                std::io::Write::write_all(&mut stream, b"KVR").unwrap();
            }
            silent.push(stream);
        }
    }
    for transport in [Some(TransportKind::Tcp), None] {
        let initiator = engine("initiator");
        let opened: Vec<_> = initiator.open_many(&addrs, transport, WAIT).into_iter().map(Result::unwrap).collect();
        for segment in &opened {
            assert_eq!(segment.transport(), transport.unwrap_or(TransportKind::Shm));
        }
        write_to_each(&initiator, &opened, &targets);
    }
    // They were still held (none answered, none cut) while the peer opened.
    for stream in &mut silent {
        stream.set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        match std::io::Read::read(stream, &mut byte) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("a silent connection was answered or cut before its deadline: {other:?}"),
        }
    }
}
