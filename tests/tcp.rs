//! The TCP transport over real sockets: transfers, chunking, every refusal
//! the target makes, hostile frames, and a peer that restarts.

mod common;

use common::{engine, pattern, WAIT};
use kvring::testing::tcp::{ClientHello, ServerHello, SERVER_HELLO_BYTES};
use kvring::testing::tcp::{FrameHeader, FrameOp, FLAG_LAST, FRAME_HEADER_BYTES, MAX_FRAME_PAYLOAD_BYTES};
use kvring::ErrorCode;
use kvring::{Access, Batch, BlockDesc, Engine, Error, Outcome, RegionInfo, TransportKind};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;
use zerocopy::{FromBytes, IntoBytes};

const MIB: usize = 1 << 20;

fn tcp_pair(len: usize) -> (Engine, kvring::Region, Engine, kvring::Region, kvring::Segment) {
    let target = engine("target");
    let remote = target.alloc_region(len, RegionInfo::raw()).unwrap();
    let initiator = engine("initiator");
    let local = initiator.alloc_region(len, RegionInfo::raw()).unwrap();
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    assert_eq!(segment.transport(), TransportKind::Tcp);
    (target, remote, initiator, local, segment)
}

fn contents(region: &kvring::Region, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { region.read_at(offset, &mut out).unwrap() };
    out
}

#[test]
fn push_and_pull_small_and_chunked_blocks_over_tcp() {
    let (_target, remote, initiator, local, segment) = tcp_pair(8 * MIB);
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(31) };
    let mut sub = initiator.submitter().unwrap();
    // 64 blocks of 4 KiB, then one 3 MiB block (three 1 MiB frames).
    let small: Vec<_> = (0..64u64).map(|i| BlockDesc::new(local.id(), i * 4096, remote.id(), i * 4096, 4096)).collect();
    let big = [BlockDesc::new(local.id(), MIB as u64, remote.id(), 4 * MIB as u64, 3 * MIB as u64)];
    for descs in [&small[..], &big[..]] {
        let id = sub.submit(&Batch::write(&segment).descs(descs)).unwrap();
        let bytes: u64 = descs.iter().map(|d| d.len).sum();
        assert_eq!(sub.wait(id, WAIT).unwrap().into_result().unwrap(), bytes);
    }
    let source = pattern(8 * MIB, 31);
    assert_eq!(contents(&remote, 0, 64 * 4096), source[..64 * 4096]);
    assert_eq!(contents(&remote, 4 * MIB as u64, 3 * MIB), source[MIB..4 * MIB]);

    // Pull both back into a cleared region.
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.write_at(0, &vec![0u8; 8 * MIB]).unwrap() };
    for descs in [&small[..], &big[..]] {
        let id = sub.submit(&Batch::read(&segment).descs(descs)).unwrap();
        sub.wait(id, WAIT).unwrap().into_result().unwrap();
    }
    assert_eq!(contents(&local, 0, 64 * 4096), source[..64 * 4096]);
    assert_eq!(contents(&local, MIB as u64, 3 * MIB), source[MIB..4 * MIB]);
}

#[test]
fn a_lane_parked_on_a_full_send_buffer_wakes_when_it_drains() {
    // No busy-poll window and a park timeout far beyond the wait deadline:
    // the lane parks whenever a round moved nothing, often with its send
    // buffer full mid-chunk (64 blocks of 1 MiB are one chunk, whose only
    // reply is the ack after its last byte). Only the socket turning
    // writable can wake it then; were that edge not asked for, the wait
    // would end in Timeout (the safety net is an hour away).
    let target = engine("target");
    let remote = target.alloc_region(64 * MIB, RegionInfo::raw()).unwrap();
    let initiator = common::builder("initiator")
        .busy_poll(std::time::Duration::ZERO)
        .park_timeout(std::time::Duration::from_secs(3600))
        .build()
        .unwrap();
    let local = initiator.alloc_region(64 * MIB, RegionInfo::raw()).unwrap();
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let descs: Vec<_> = (0..64u64)
        .map(|i| BlockDesc::new(local.id(), i * MIB as u64, remote.id(), i * MIB as u64, MIB as u64))
        .collect();
    for round in 0..4u64 {
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.fill_pattern(round) };
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        let outcome = sub.wait(id, WAIT);
        assert!(
            matches!(outcome, Ok(Outcome::Done { bytes }) if bytes == 64 * MIB as u64),
            "round {round}: {outcome:?}"
        );
        assert!(contents(&remote, 0, 64 * MIB) == pattern(64 * MIB, round), "round {round}: the target's bytes differ");
    }
    let parks: u64 = initiator.lane_stats().iter().map(|s| s.parks).sum();
    assert!(parks > 0, "the lane never parked");
}

#[test]
fn the_target_refuses_bad_blocks_and_the_connection_keeps_working() {
    let target = engine("target");
    let remote = target.alloc_region(64 * 1024, RegionInfo::raw()).unwrap();
    let read_only =
        target.alloc_region(4096, RegionInfo::raw().with_access(Access::REMOTE_READ | Access::LOCAL_READ)).unwrap();
    let initiator = engine("initiator");
    let local = initiator.alloc_region(64 * 1024, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(2) };
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let good = BlockDesc::new(local.id(), 0, remote.id(), 0, 4096);
    // The initiator checks the peer's descriptor first: these never leave.
    let oob = BlockDesc::new(local.id(), 0, remote.id(), 62 * 1024, 4096);
    let denied = BlockDesc::new(local.id(), 0, read_only.id(), 0, 4096);
    for (bad, expected) in [(oob, "exceeds region"), (denied, "does not allow remote write")] {
        let descs = [good, bad, BlockDesc::new(local.id(), 4096, remote.id(), 4096, 4096)];
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { remote.write_at(0, &vec![0u8; 64 * 1024]).unwrap() };
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        match sub.wait(id, WAIT).unwrap() {
            Outcome::Failed(error) => assert!(error.to_string().contains(expected), "{error}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(contents(&remote, 0, 4096), pattern(64 * 1024, 2)[..4096], "the block before the bad one moved");
        assert!(contents(&remote, 4096, 60 * 1024).iter().all(|&b| b == 0), "nothing after it");
    }
    // Reads too, and the connection stays framed afterwards.
    let id = sub.submit(&Batch::read(&segment).descs(&[good, oob, good])).unwrap();
    assert!(matches!(sub.wait(id, WAIT).unwrap(), Outcome::Failed(Error::OutOfBounds { .. })));
    let id = sub.submit(&Batch::write(&segment).descs(&[good])).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
}

/// A raw data connection past its hello (the target has no token).
fn raw(target: &Engine) -> TcpStream {
    let mut stream = TcpStream::connect(target.tcp_addr().unwrap()).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream.write_all(ClientHello::new(target.epoch(), [0; 16], [0; 16], [0; 16]).as_bytes()).unwrap();
    let mut answer = [0u8; SERVER_HELLO_BYTES];
    stream.read_exact(&mut answer).unwrap();
    assert_eq!(ServerHello::read_from_bytes(&answer).unwrap().status, 0);
    stream
}

fn reply(stream: &mut TcpStream) -> Option<FrameHeader> {
    let mut bytes = [0u8; FRAME_HEADER_BYTES];
    stream.read_exact(&mut bytes).ok()?;
    Some(FrameHeader::read_from_bytes(&bytes).unwrap())
}

fn closed(stream: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).map(|n| n == 0).unwrap_or(true)
}

#[test]
fn hostile_frames_get_clear_refusals_and_the_target_keeps_serving_others() {
    let target = engine("target");
    let region = target.alloc_region(64 * 1024, RegionInfo::raw()).unwrap();
    let epoch = target.epoch();
    let code = |header: &FrameHeader| ErrorCode::try_from(-header.status).unwrap();
    let write = |region_raw: u64, offset: u64, len: u64, epoch: u64| {
        let mut h = FrameHeader::new(FrameOp::Write, epoch, 7, region_raw, offset, len);
        h.flags = FLAG_LAST;
        h
    };

    // Malformed: bad magic. One refusal, then the connection closes.
    let mut s = raw(&target);
    let mut bad = write(region.id().raw(), 0, 0, epoch);
    bad.magic = 0xdead_beef;
    s.write_all(bad.as_bytes()).unwrap();
    assert_eq!(code(&reply(&mut s).unwrap()), ErrorCode::MalformedMessage);
    assert!(closed(&mut s));

    // Unknown opcode, and an oversized frame.
    for (mutate, expected) in [
        (Box::new(|h: &mut FrameHeader| h.opcode = 42) as Box<dyn Fn(&mut FrameHeader)>, ErrorCode::UnknownOpcode),
        (Box::new(|h: &mut FrameHeader| h.len = MAX_FRAME_PAYLOAD_BYTES as u32 + 1), ErrorCode::MessageTooLarge),
    ] {
        let mut s = raw(&target);
        let mut h = write(region.id().raw(), 0, 16, epoch);
        mutate(&mut h);
        s.write_all(h.as_bytes()).unwrap();
        assert_eq!(code(&reply(&mut s).unwrap()), expected);
        assert!(closed(&mut s));
    }

    // Well-framed but refused: wrong epoch, unknown region, out of bounds.
    // The payload is drained, the ack names the problem, and the same
    // connection goes on to a good write.
    let mut s = raw(&target);
    for (header, expected) in [
        (write(region.id().raw(), 0, 16, epoch ^ 1), ErrorCode::PeerRestarted),
        (write(region.id().raw() ^ 0x7, 0, 16, epoch), ErrorCode::UnknownRegion),
        (write(region.id().raw(), 64 * 1024 - 8, 16, epoch), ErrorCode::OutOfBounds),
    ] {
        s.write_all(header.as_bytes()).unwrap();
        s.write_all(&[0xAA; 16]).unwrap();
        let ack = reply(&mut s).unwrap();
        assert_eq!(ack.opcode, FrameOp::Ack as u8);
        assert_eq!(code(&ack), expected);
    }
    let good = write(region.id().raw(), 100, 4, epoch);
    s.write_all(good.as_bytes()).unwrap();
    s.write_all(b"good").unwrap();
    assert_eq!(reply(&mut s).unwrap().status, 0);
    assert_eq!(contents(&region, 100, 4), b"good");
    assert!(contents(&region, 64 * 1024 - 8, 8).iter().all(|&b| b == 0), "refused bytes never landed");

    // A peer that disconnects mid-frame: bytes it sent may land, no ack.
    let mut s = raw(&target);
    s.write_all(write(region.id().raw(), 0, 4096, epoch).as_bytes()).unwrap();
    s.write_all(&[1u8; 100]).unwrap();
    drop(s);
    // A truncated header.
    let mut s = raw(&target);
    s.write_all(&good.as_bytes()[..20]).unwrap();
    drop(s);

    // Through all of that, a real initiator is served.
    let initiator = engine("initiator");
    let local = initiator.alloc_region(4096, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(8) };
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let id =
        sub.submit(&Batch::write(&segment).descs(&[BlockDesc::new(local.id(), 0, region.id(), 8192, 4096)])).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    assert_eq!(contents(&region, 8192, 4096), pattern(4096, 8));
}

#[test]
fn the_default_transport_is_shm_on_this_host_then_cma_for_caller_memory_then_tcp() {
    let target = engine("target");
    let _shm = target.alloc_region(4096, RegionInfo::raw()).unwrap();
    let initiator = engine("initiator");
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    assert_eq!(segment.transport(), TransportKind::Shm);

    // Targets whose only region is their own memory, which no peer can map:
    // cma where the target allows it, tcp where it does not.
    for (cma, expected) in [(true, TransportKind::Cma), (false, TransportKind::Tcp)] {
        let other = common::builder("other").cma(cma).build().unwrap();
        let mut memory = vec![0u8; 8192];
        // SAFETY: `memory` outlives the engine's use of it (the engines drop first).
        let id = unsafe { other.register(memory.as_mut_ptr(), memory.len(), RegionInfo::raw()) }.unwrap();
        let segment = initiator.open_segment(&other.control_addr().to_string()).unwrap();
        assert_eq!(segment.transport(), expected);
        let local = initiator.alloc_region(8192, RegionInfo::raw()).unwrap();
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.fill_pattern(4) };
        let mut sub = initiator.submitter().unwrap();
        let id_batch =
            sub.submit(&Batch::write(&segment).descs(&[BlockDesc::new(local.id(), 0, id, 0, 8192)])).unwrap();
        assert!(sub.wait(id_batch, WAIT).unwrap().is_done());
        drop(sub);
        initiator.close_segment(&segment);
        drop(other);
        assert_eq!(memory, pattern(8192, 4));
    }
}

#[test]
fn a_restarted_peer_fails_in_flight_work_then_is_reached_again_on_the_same_port() {
    let (target, remote, initiator, local, segment) = tcp_pair(MIB);
    let addr = target.control_addr();
    let name = addr.to_string();
    let mut sub = initiator.submitter().unwrap();
    let descs = [BlockDesc::new(local.id(), 0, remote.id(), 0, 4096)];
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    let old_epoch = target.epoch();
    drop(remote);
    drop(target);

    // The connection is gone: the next batch fails with PeerRestarted, at
    // once, and is not reported done.
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    match sub.wait(id, WAIT).unwrap() {
        Outcome::Failed(Error::PeerRestarted { .. }) => {}
        other => panic!("expected PeerRestarted, got {other:?}"),
    }
    assert!(matches!(sub.submit(&Batch::write(&segment).descs(&descs)), Err(Error::PeerRestarted { .. })));

    // The target comes back on the same control port (the OS lets it rebind
    // at once) with a new epoch; opening the name again reaches it.
    let target = common::builder("target").listen(addr).build().unwrap();
    let remote = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    assert_ne!(target.epoch(), old_epoch);
    let reopened = initiator.open_segment(&name).unwrap();
    assert_eq!(reopened.epoch(), target.epoch());
    let descs = [BlockDesc::new(local.id(), 0, remote.id(), 0, 4096)];
    let id = sub.submit(&Batch::write(&reopened).descs(&descs)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    let stats = initiator.segment_cache_stats();
    assert_eq!(stats.stale_evictions, 1, "{stats:?}");
}

#[test]
fn notifications_arrive_after_the_data_over_tcp_and_shm() {
    let target = common::builder("decode-0").notify_queue(2).build().unwrap();
    let remote = target.alloc_region(64 * 1024, RegionInfo::raw()).unwrap();
    let initiator = engine("prefill-0");
    let local = initiator.alloc_region(64 * 1024, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(12) };
    let mut sub = initiator.submitter().unwrap();
    for (transport, offset) in [(TransportKind::Tcp, 0u64), (TransportKind::Shm, 32 * 1024)] {
        let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
        let descs = [BlockDesc::new(local.id(), offset, remote.id(), offset, 32 * 1024)];
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        let outcome = sub.wait(id, WAIT).unwrap();
        assert!(outcome.is_done(), "{transport:?}: {outcome:?}");
        let message = format!("request 42 via {}", transport.name());
        initiator.notify(&segment, message.as_bytes(), WAIT).unwrap();
        // When the target reads the notification, the blocks are in place.
        let notification = target.poll_notification().expect("queued before notify returned");
        assert_eq!(notification.from, "prefill-0");
        assert_eq!(notification.message, message.as_bytes());
        assert_eq!(contents(&remote, offset, 32 * 1024), pattern(64 * 1024, 12)[offset as usize..][..32 * 1024]);
    }
    assert!(target.poll_notification().is_none());

    // A full queue refuses, and the sender hears it; so does an oversized one.
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    initiator.notify(&segment, b"one", WAIT).unwrap();
    initiator.notify(&segment, b"two", WAIT).unwrap();
    match initiator.notify(&segment, b"three", WAIT) {
        Err(Error::Remote { code: ErrorCode::Busy, .. }) => {}
        other => panic!("expected Busy from a full queue, got {other:?}"),
    }
    assert!(matches!(initiator.notify(&segment, &vec![0u8; 65 * 1024], WAIT), Err(Error::MessageTooLarge { .. })));
    assert_eq!(target.poll_notification().unwrap().message, b"one");
    assert_eq!(target.poll_notification().unwrap().message, b"two");
    // The data connection is still good after the refusals.
    let id = sub.submit(&Batch::write(&segment).descs(&[BlockDesc::new(local.id(), 0, remote.id(), 0, 4096)])).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
}

#[test]
fn a_watching_submitter_reaps_notifications_and_batches_from_one_loop() {
    let target = engine("decode-0");
    let remote = target.alloc_region(64 * 1024, RegionInfo::raw()).unwrap();
    let initiator = engine("prefill-0");
    let local = initiator.alloc_region(64 * 1024, RegionInfo::raw()).unwrap();
    let mut watcher = target.submitter().unwrap();
    watcher.watch_notifications(true);
    let mut sub = initiator.submitter().unwrap();
    let mut sent = Vec::new();
    for transport in [TransportKind::Tcp, TransportKind::Shm] {
        let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
        let id =
            sub.submit(&Batch::write(&segment).block(BlockDesc::new(local.id(), 0, remote.id(), 0, 4096))).unwrap();
        let outcome = sub.wait(id, WAIT).unwrap();
        assert!(outcome.is_done(), "{transport:?}: {outcome:?}");
        for n in 0..3 {
            let message = format!("request {n} via {}", transport.name());
            initiator.notify(&segment, message.as_bytes(), WAIT).unwrap();
            sent.push(message.into_bytes());
        }
    }
    // The target's own batch (to the initiator) completes through the same loop.
    let back = target.open_segment_with(&initiator.control_addr().to_string(), None, WAIT).unwrap();
    let id = watcher
        .submit(&Batch::read(&back).user_data(77).block(BlockDesc::new(remote.id(), 0, local.id(), 0, 4096)))
        .unwrap();

    let mut notifications = Vec::new();
    let mut batches = Vec::new();
    let deadline = Instant::now() + WAIT;
    while notifications.len() < sent.len() || batches.is_empty() {
        match watcher.reap_event() {
            Some(kvring::Event::Notification(n)) => {
                assert_eq!(n.from, "prefill-0");
                notifications.push(n.message);
            }
            Some(kvring::Event::Batch(done)) => batches.push((done.id, done.user_data, done.outcome.is_done())),
            None => std::thread::yield_now(),
        }
        assert!(Instant::now() < deadline, "got {notifications:?} and {batches:?}");
    }
    assert_eq!(notifications, sent, "every notification, in order");
    assert_eq!(batches, [(id, 77, true)]);
    assert!(watcher.reap_event().is_none());

    // A submitter that does not watch sees no notification CQE. It is on
    // lane 0 (its batch ended there) before the notification arrives, and
    // lane 0 posts to every watching ring in one pass: once the watcher
    // holds its CQE, one for `other` would be there too.
    let mut other = target.submitter().unwrap();
    let id = other.submit(&Batch::read(&back).block(BlockDesc::new(remote.id(), 0, local.id(), 0, 4096))).unwrap();
    assert!(other.wait(id, WAIT).unwrap().is_done());
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    initiator.notify(&segment, b"late", WAIT).unwrap();
    let deadline = Instant::now() + WAIT;
    let late = loop {
        match watcher.reap_event() {
            Some(kvring::Event::Notification(n)) => break n,
            Some(kvring::Event::Batch(done)) => panic!("no batch was left: {done:?}"),
            None => std::thread::yield_now(),
        }
        assert!(Instant::now() < deadline, "the watcher never got the late notification");
    };
    assert_eq!(late.message, b"late");
    assert!(other.reap_event().is_none(), "a submitter that does not watch got an event");
}

#[test]
fn notifying_after_shutdown_fails_at_once_with_shutdown() {
    let (_target, _remote, initiator, _local, segment) = tcp_pair(4096);
    initiator.shutdown();
    // Shutdown, not the Timeout that waiting out WAIT would give.
    assert!(matches!(initiator.notify(&segment, b"late", WAIT), Err(Error::Shutdown)));
}
