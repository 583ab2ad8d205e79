//! An outsider against a running `kvring serve --token`: every probe is
//! refused, the target keeps serving, and a legitimate tokened client's
//! bytes, moved before, during and after, are verified on the target.

mod common;

use common::child::{self, Target};
use common::WAIT;
use kvring::testing::control::{preface, read_frame, write_frame, MAX_CONTROL_MESSAGE_BYTES};
use kvring::testing::control::{request, response, ErrorCode, Request};
use kvring::testing::tcp::{ClientHello, ServerHello, FLAG_PROOF_REQUIRED, SERVER_HELLO_BYTES};
use kvring::testing::tcp::{End, FrameHeader, FrameOp, FrameSeal, FLAG_LAST, FRAME_HEADER_BYTES};
use kvring::{Batch, BlockDesc, Engine, Error, RegionInfo, Segment, TransportKind};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};
use zerocopy::{FromBytes, IntoBytes};

const TOKEN: &str = "hostile-suite-token";
const REGION: usize = 4 << 20;

/// A `kvring serve --token` in its own process.
fn start_target() -> Target {
    child::start_target(&[
        "--name",
        "decode-0",
        "--listen",
        "127.0.0.1:0",
        "--region-size",
        "4MiB",
        "--parent-watch",
        "--token",
        TOKEN,
    ])
}

/// The legitimate client: a tokened engine and its open segment.
struct Client {
    engine: Engine,
    local: kvring::Region,
    segment: Segment,
}

fn client(target: &Target) -> Client {
    let engine = common::builder("prefill-0").token(TOKEN).build().unwrap();
    let local = engine.alloc_region(REGION, RegionInfo::raw()).unwrap();
    let segment = engine.open_segment_with(&target.control, Some(TransportKind::Tcp), WAIT).unwrap();
    Client { engine, local, segment }
}

impl Client {
    /// Writes the whole region with a pattern for `seed` and checks it on
    /// the target.
    fn write_and_verify(&self, seed: u64) {
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { self.local.fill_pattern(seed) };
        let mut sub = self.engine.submitter().unwrap();
        let remote = self.segment.region(0).unwrap();
        let descs: Vec<_> = (0..(REGION / 65536) as u64)
            .map(|i| BlockDesc::new(self.local.id(), i * 65536, remote, i * 65536, 65536))
            .collect();
        let id = sub.submit(&Batch::write(&self.segment).descs(&descs)).unwrap();
        assert!(sub.wait(id, WAIT).unwrap().is_done());
        self.verify();
    }

    fn verify(&self) {
        let remote = self.segment.region(0).unwrap();
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        let expected = unsafe { self.local.checksum(0, REGION).unwrap() };
        assert_eq!(self.segment.remote_checksum(remote, 0, REGION as u64, WAIT).unwrap(), expected);
    }
}

fn connect(addr: impl std::net::ToSocketAddrs) -> TcpStream {
    let stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream
}

fn answer(stream: &mut TcpStream) -> ServerHello {
    let mut bytes = [0u8; SERVER_HELLO_BYTES];
    stream.read_exact(&mut bytes).unwrap();
    ServerHello::read_from_bytes(&bytes).unwrap()
}

fn status(hello: &ServerHello) -> ErrorCode {
    ErrorCode::try_from(-hello.status).unwrap_or(ErrorCode::Unspecified)
}

/// True once the peer closed the connection (within the read timeout).
fn closed(stream: &mut TcpStream) -> bool {
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).is_ok() || rest.is_empty()
}

fn write_frame_bytes(target: &Target, offset: u64, payload: &[u8]) -> Vec<u8> {
    sealed_write(target, offset, payload, None)
}

/// A WRITE frame, numbered and signed when `seal` is given (a connection
/// that proved a session).
fn sealed_write(target: &Target, offset: u64, payload: &[u8], seal: Option<&mut FrameSeal>) -> Vec<u8> {
    let mut header = FrameHeader::new(FrameOp::Write, target.epoch, 1, target.region, offset, payload.len() as u64);
    header.flags = FLAG_LAST;
    if let Some(seal) = seal {
        header.seal(seal);
    }
    let mut bytes = header.as_bytes().to_vec();
    bytes.extend_from_slice(payload);
    bytes
}

#[test]
fn data_frames_without_a_session_proof_are_refused_and_change_nothing() {
    let target = start_target();
    let legit = client(&target);
    legit.write_and_verify(1);

    // Frames straight away, no hello: refused as a malformed hello.
    let mut s = connect(target.tcp);
    s.write_all(&write_frame_bytes(&target, 0, &[0xee; 16])).unwrap();
    assert_eq!(status(&answer(&mut s)), ErrorCode::MalformedMessage);
    assert!(closed(&mut s));

    // A hello naming the right epoch (no secret) and no session the target
    // issued: refused at once, with no proof of anything.
    let mut s = connect(target.tcp);
    s.write_all(ClientHello::new(target.epoch, [0; 16], [0; 16], [0; 16]).as_bytes()).unwrap();
    let refusal = answer(&mut s);
    assert_eq!(status(&refusal), ErrorCode::Unauthorized);
    assert_eq!((refusal.flags, refusal.proof), (0, [0; 32]));
    assert!(closed(&mut s));

    // A hello for another epoch is told the target restarted.
    let mut s = connect(target.tcp);
    s.write_all(ClientHello::new(target.epoch ^ 1, [0; 16], [0; 16], [0; 16]).as_bytes()).unwrap();
    assert_eq!(status(&answer(&mut s)), ErrorCode::PeerRestarted);
    assert!(closed(&mut s));

    // Garbage, and a hello cut short (told it ran out of time).
    let mut s = connect(target.tcp);
    s.write_all(b"GET / HTTP/1.1\r\nHost: kvring.example\r\nAccept: */*\r\n\r\n").unwrap();
    assert_eq!(status(&answer(&mut s)), ErrorCode::MalformedMessage);
    let mut s = connect(target.tcp);
    s.write_all(&ClientHello::new(target.epoch, [0; 16], [0; 16], [0; 16]).as_bytes()[..20]).unwrap();
    assert_eq!(status(&answer(&mut s)), ErrorCode::Timeout);
    assert!(closed(&mut s));

    // Nothing of it landed, and the legitimate client goes on.
    legit.verify();
    legit.write_and_verify(2);
}

/// A session of a peer holding the token, from a real handshake.
fn tokened_session(target: &Target) -> kvring::testing::control::Session {
    let token = kvring::Token::new(TOKEN);
    let initiator = kvring::testing::control::Initiator { name: "tester".into(), epoch: 1, addr: String::new() };
    let deadline = Instant::now() + WAIT;
    let handshake = kvring::testing::control::ControlClient::connect(&target.control, deadline)
        .unwrap()
        .handshake(&initiator, Some(&token), deadline)
        .unwrap();
    handshake.session.unwrap()
}

/// A data connection of a peer holding the token (broken, not hostile),
/// and its frame seal.
fn sealed_data_connection(target: &Target) -> (TcpStream, FrameSeal) {
    let session = tokened_session(target);
    let mut s = connect(target.tcp);
    let nonce = [0x5a; 16];
    s.write_all(ClientHello::new(target.epoch, session.client_nonce, session.server_nonce, nonce).as_bytes()).unwrap();
    let challenge = answer(&mut s);
    assert_eq!((challenge.status, challenge.flags), (0, FLAG_PROOF_REQUIRED));
    let proof = kvring::testing::tcp::ClientProof::new(session.data_proof(&challenge.nonce, target.epoch));
    s.write_all(proof.as_bytes()).unwrap();
    assert_eq!(answer(&mut s).status, 0);
    let seal = FrameSeal::new(&session, &nonce, &challenge.nonce, target.epoch, End::Initiator);
    (s, seal)
}

fn tokened_data_connection(target: &Target) -> TcpStream {
    sealed_data_connection(target).0
}

#[test]
fn oversized_truncated_and_cut_frames_end_their_connection_only() {
    let target = start_target();
    let legit = client(&target);
    legit.write_and_verify(3);

    // An oversized frame: one refusal, then closed.
    let mut s = tokened_data_connection(&target);
    let huge = FrameHeader::new(FrameOp::Write, target.epoch, 1, target.region, 0, 1 << 30);
    s.write_all(huge.as_bytes()).unwrap();
    let mut reply = [0u8; FRAME_HEADER_BYTES];
    s.read_exact(&mut reply).unwrap();
    let reply = FrameHeader::read_from_bytes(&reply).unwrap();
    assert_eq!(ErrorCode::try_from(-reply.status).unwrap(), ErrorCode::MessageTooLarge);
    assert!(closed(&mut s));

    // A header cut short, and a payload cut short: the connection ends, no
    // ack claims the chunk.
    let mut s = tokened_data_connection(&target);
    s.write_all(&FrameHeader::new(FrameOp::Read, target.epoch, 1, target.region, 0, 8).as_bytes()[..30]).unwrap();
    drop(s);
    let mut s = tokened_data_connection(&target);
    let frame = write_frame_bytes(&target, 0, &[0x77; 4096]);
    s.write_all(&frame[..FRAME_HEADER_BYTES + 100]).unwrap();
    drop(s);

    // A block outside the region: refused, the connection stays framed.
    let (mut s, mut seal) = sealed_data_connection(&target);
    s.write_all(&sealed_write(&target, REGION as u64 - 4, &[0x66; 16], Some(&mut seal))).unwrap();
    let mut reply = [0u8; FRAME_HEADER_BYTES];
    s.read_exact(&mut reply).unwrap();
    let reply = FrameHeader::read_from_bytes(&reply).unwrap();
    assert_eq!(ErrorCode::try_from(-reply.status).unwrap(), ErrorCode::OutOfBounds);

    // The payload cut short landed its first 100 bytes (as documented);
    // rewrite and verify that everything else is as the client left it.
    legit.write_and_verify(4);
}

fn control_connection(target: &Target) -> TcpStream {
    let mut s = connect(&target.control);
    s.write_all(&preface()).unwrap();
    let mut theirs = [0u8; 8];
    s.read_exact(&mut theirs).unwrap();
    assert_eq!(theirs, preface());
    s
}

#[test]
fn control_plane_garbage_and_requests_without_a_handshake_are_refused() {
    let target = start_target();
    let legit = client(&target);
    // No preface: the server answers with its own and closes.
    let mut s = connect(&target.control);
    s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut theirs = [0u8; 8];
    s.read_exact(&mut theirs).unwrap();
    assert_eq!(theirs, preface());
    assert!(closed(&mut s));
    // Garbage inside a frame: an error, the connection kept.
    let mut s = control_connection(&target);
    s.write_all(&[4, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]).unwrap();
    let reply = read_frame(&mut s, MAX_CONTROL_MESSAGE_BYTES).unwrap().unwrap();
    assert!(matches!(
        kvring::testing::control::decode_response(&reply),
        Err(Error::Remote { code: ErrorCode::MalformedMessage, .. })
    ));
    // A checksum (reading the region) without a handshake: refused, closed.
    let ask = Request {
        version: kvring::testing::control::CONTROL_VERSION,
        body: Some(request::Body::Checksum(kvring::testing::control::ChecksumRequest {
            region: target.region,
            offset: 0,
            len: 16,
        })),
    };
    write_frame(&mut s, &ask).unwrap();
    let reply = read_frame(&mut s, MAX_CONTROL_MESSAGE_BYTES).unwrap().unwrap();
    assert!(matches!(
        kvring::testing::control::decode_response(&reply),
        Err(Error::Remote { code: ErrorCode::Unauthorized, .. })
    ));
    assert!(closed(&mut s));
    // A handshake whose second step carries a made-up proof.
    let mut s = control_connection(&target);
    let mut step = kvring::testing::control::HandshakeRequest {
        initiator: "hostile".into(),
        client_nonce: vec![1; 16],
        ..Default::default()
    };
    write_frame(
        &mut s,
        &Request {
            version: kvring::testing::control::CONTROL_VERSION,
            body: Some(request::Body::Handshake(step.clone())),
        },
    )
    .unwrap();
    let reply = read_frame(&mut s, MAX_CONTROL_MESSAGE_BYTES).unwrap().unwrap();
    let Ok(response::Body::Handshake(first)) = kvring::testing::control::decode_response(&reply) else {
        panic!("expected a challenge")
    };
    assert!(first.segment.is_none(), "no descriptor before the proof");
    step.server_nonce = first.challenge.unwrap().server_nonce;
    step.proof = vec![0; 32];
    write_frame(
        &mut s,
        &Request { version: kvring::testing::control::CONTROL_VERSION, body: Some(request::Body::Handshake(step)) },
    )
    .unwrap();
    let reply = read_frame(&mut s, MAX_CONTROL_MESSAGE_BYTES).unwrap().unwrap();
    assert!(matches!(
        kvring::testing::control::decode_response(&reply),
        Err(Error::Remote { code: ErrorCode::Unauthorized, .. })
    ));
    legit.write_and_verify(5);
}

#[test]
fn trickling_clients_are_cut_at_their_deadline_on_both_ports() {
    let target = start_target();
    let legit = client(&target);
    for addr in [target.tcp.to_string(), target.control.clone()] {
        let mut s = connect(addr.as_str());
        let started = Instant::now();
        // One byte every 200 ms: each read on the target succeeds, the
        // whole never arrives.
        let mut cut = false;
        for _ in 0..50 {
            if s.write_all(&[0]).is_err() {
                cut = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let took = started.elapsed();
        assert!(cut || closed(&mut s), "{addr}: never cut");
        assert!(took < Duration::from_secs(8), "{addr}: cut after {took:?}");
    }
    legit.write_and_verify(6);
}

#[test]
fn a_flood_of_idle_connections_does_not_keep_a_legitimate_client_out() {
    let target = start_target();
    // 1,000 connections to the data port and 100 to the control port that
    // never say a word, held open.
    let mut idle: Vec<TcpStream> = Vec::new();
    for _ in 0..1000 {
        idle.push(TcpStream::connect(target.tcp).unwrap());
    }
    for _ in 0..100 {
        idle.push(TcpStream::connect(&target.control).unwrap());
    }
    // A legitimate client arrives after them, opens, moves and verifies.
    let legit = client(&target);
    legit.write_and_verify(7);
    // Reopening (new connections while the flood is held) works too.
    legit.engine.close_segment(&legit.segment);
    let again = client(&target);
    again.write_and_verify(8);
    drop(idle);
}

#[test]
fn a_tokened_peer_that_floods_notifications_is_held_to_its_quota() {
    let target = start_target();
    let legit = client(&target);
    let flood = vec![0x42u8; 60 * 1024];
    let mut refused = 0;
    for _ in 0..2000 {
        match legit.engine.notify(&legit.segment, &flood, WAIT) {
            Ok(()) => {}
            Err(error) => {
                assert_eq!(error.code(), ErrorCode::Busy, "{error}");
                refused += 1;
            }
        }
    }
    // 60 KB each: the per-sender byte quota (4 MiB) holds ~68 of them.
    assert!(refused >= 1900, "{refused} of 2000 refused");
    legit.write_and_verify(9);
}

#[test]
fn a_peer_whose_descriptor_points_at_another_engines_shm_file_is_refused() {
    // The victim: a local engine with a region it owns.
    let victim = common::engine("victim");
    let region = victim.alloc_region(4096, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { region.write_at(0, b"untouched").unwrap() };
    // The hostile peer: a fake control server that claims this host and a
    // region whose file is the victim's.
    let mut lie = kvring::testing::descriptor(&victim);
    lie.name = "liar".into();
    lie.epoch ^= 0xdead; // its own epoch, not the victim's
                         // A pid nobody answers for: a child's, once it has exited and been
                         // reaped (pids are handed out in order, so it is not reused at once;
                         // our own pid + 1 may be one of this process's threads).
    let mut child = std::process::Command::new("true").spawn().unwrap();
    lie.pid = child.id();
    child.wait().unwrap();
    lie.tcp_addr = None;
    let (addr, server) = common::raw::lying_control_server(&lie, false);
    let initiator = common::engine("initiator");
    let error = initiator.open_segment_with(&addr, Some(TransportKind::Shm), WAIT).unwrap_err();
    // Refused before any file is opened: the pid it names did not answer.
    assert!(error.to_string().contains("another host"), "{error}");
    server.join().unwrap();
    let mut bytes = [0u8; 9];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { region.read_at(0, &mut bytes).unwrap() };
    assert_eq!(&bytes, b"untouched");
}
