//! A relay between a tokened initiator and a real tokened `kvring serve`
//! (security review row 1), written as an outsider would: it forwards both
//! proofs, which it cannot make, and tries to turn the proven session to
//! its own use. It sits at an address of its own (an entry in a metadata
//! store pointing at it), or on the path (the target advertises the address
//! the relay holds, as an engine behind a proxy does). Every attempt is
//! refused with a typed error, and nothing it sent lands.

mod common;

use common::child::{field, region, serve, Reaped};
use common::WAIT;
use kvring::testing::control::{read_frame, request, response, write_frame, Request, Response};
use kvring::testing::control::{ControlClient, MAX_CONTROL_MESSAGE_BYTES};
use kvring::testing::tcp::{FrameHeader, FrameOp, ServerHello, FLAG_PROOF_REQUIRED, FRAME_HEADER_BYTES};
use kvring::{Batch, BlockDesc, Engine, ErrorCode, Outcome, RegionInfo, TransportKind};
use prost::Message;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::Instant;
use zerocopy::{FromBytes, IntoBytes};

const TOKEN: &str = "relay-suite-token";
const REGION: usize = 1 << 20;
/// Where the relay aims what it forges: nothing legitimate writes there.
const MARK: u64 = 768 * 1024;
const BLOCK: u64 = 64 * 1024;
/// The address the on-path relay holds (and the target advertises).
const ON_PATH_IP: &str = "127.0.0.3";

/// Set once the relay injected its own control request, and whether the
/// target answered it.
static INJECTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static INJECTED_ANSWERED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A `kvring serve --token` in its own process: where it really listens,
/// and what it advertises.
struct Target {
    /// Killed when the target drops.
    _child: Reaped,
    control: String,
    tcp: String,
    advertised_control: String,
    advertised_tcp: String,
    region: u64,
}

fn start_target(advertise: Option<&str>) -> Target {
    let mut args = vec![
        "--name",
        "decode-0",
        "--listen",
        "127.0.0.1:0",
        "--region-size",
        "1MiB",
        "--parent-watch",
        "--token",
        TOKEN,
    ];
    if let Some(ip) = advertise {
        args.extend(["--advertise", ip]);
    }
    let (child, line) = serve(&args);
    let region = region(&line);
    let advertised_control = field(&line, "listen=").to_string();
    let advertised_tcp = field(&line, "tcp=").to_string();
    let real = |addr: &str| format!("127.0.0.1:{}", addr.rsplit_once(':').unwrap().1);
    Target {
        control: real(&advertised_control),
        tcp: real(&advertised_tcp),
        advertised_control,
        advertised_tcp,
        region,
        _child: child,
    }
}

/// What the relay does to what it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tamper {
    /// Nothing: forwards every byte both ways.
    Nothing,
    /// Puts the target's own address in the step-2 request's `dialed`.
    Dialed,
    /// Points the step-2 descriptor's tcp endpoint at another address.
    Descriptor,
    /// Rewrites a byte of every control answer after the handshake.
    ControlAnswer,
    /// Sends a control request of its own after the handshake.
    ControlInject,
    /// Answers data hellos itself, asking no proof (its tap).
    TapAsksNoProof,
    /// Answers data hellos itself with a proof it made up.
    TapFakesProof,
    /// Sends a WRITE of its own after the initiator's first frame.
    Inject,
    /// Sends the initiator's first frame twice.
    Replay,
    /// Sends the initiator's first two frames swapped.
    Reorder,
    /// Points the initiator's first frame at another offset.
    Rewrite,
}

/// Serves `listener` from a thread: every connection accepted goes to
/// `upstream` through `carry`.
fn relay(listener: TcpListener, upstream: String, carry: fn(TcpStream, TcpStream, Tamper), tamper: Tamper) {
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let Ok(server) = TcpStream::connect(&upstream) else { return };
            std::thread::spawn(move || carry(client, server, tamper));
        }
    });
}

/// Copies one direction until either end closes.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let mut buffer = [0u8; 16 * 1024];
    while let Ok(n) = from.read(&mut buffer) {
        if n == 0 || to.write_all(&buffer[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

fn both_ways(client: TcpStream, server: TcpStream) {
    let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
    std::thread::spawn(move || pipe(s2, c2));
    pipe(client, server);
}

/// The control connection: prefaces, then framed messages; the step-2
/// request or answer rewritten as `tamper` says.
fn carry_control(mut client: TcpStream, mut server: TcpStream, tamper: Tamper) {
    let mut preface = [0u8; 8];
    if client.read_exact(&mut preface).is_err() || server.write_all(&preface).is_err() {
        return;
    }
    if server.read_exact(&mut preface).is_err() || client.write_all(&preface).is_err() {
        return;
    }
    let mut answers = 0;
    while let Ok(Some(body)) = read_frame(&mut client, MAX_CONTROL_MESSAGE_BYTES) {
        if tamper == Tamper::ControlInject && answers >= 2 {
            // Its own request (a probe: harmless, were it served) on the
            // proven connection, ahead of the initiator's.
            let own = Request {
                version: kvring::testing::control::CONTROL_VERSION,
                body: Some(request::Body::Probe(Default::default())),
            };
            let _ = write_frame(&mut server, &own);
            let answered = matches!(read_frame(&mut server, MAX_CONTROL_MESSAGE_BYTES), Ok(Some(_)));
            INJECTED_ANSWERED.store(answered, std::sync::atomic::Ordering::SeqCst);
            INJECTED.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let mut message = Request::decode(body.as_slice()).ok();
        if let Some(request::Body::Handshake(step)) = message.as_mut().and_then(|m| m.body.as_mut()) {
            if tamper == Tamper::Dialed && !step.dialed.is_empty() {
                step.dialed = server.peer_addr().unwrap().to_string();
            }
        }
        let forwarded = match (&message, tamper) {
            (Some(message), Tamper::Dialed) => message.encode_to_vec(),
            _ => body,
        };
        if server
            .write_all(&(forwarded.len() as u32).to_le_bytes())
            .and_then(|()| server.write_all(&forwarded))
            .is_err()
        {
            return;
        }
        let Ok(Some(mut answer)) = read_frame(&mut server, MAX_CONTROL_MESSAGE_BYTES) else { return };
        answers += 1;
        if tamper == Tamper::ControlAnswer && answers > 2 {
            answer[0] ^= 0x01;
        }
        let mut reply = Response::decode(answer.as_slice()).ok();
        let rewritten = match reply.as_mut().and_then(|r| r.body.as_mut()) {
            Some(response::Body::Handshake(step))
                if tamper == Tamper::Descriptor && !step.sealed_segment.is_empty() =>
            {
                let mut descriptor =
                    kvring::testing::control::SegmentDescriptor::decode(step.sealed_segment.as_slice())
                        .expect("the target's own descriptor decodes");
                for endpoint in &mut descriptor.endpoints {
                    endpoint.address = "127.0.0.9:9".into();
                }
                step.sealed_segment = descriptor.encode_to_vec();
                true
            }
            _ => false,
        };
        let result = match (rewritten, reply) {
            (true, Some(reply)) => write_frame(&mut client, &reply).map_err(|_| ()),
            _ => client
                .write_all(&(answer.len() as u32).to_le_bytes())
                .and_then(|()| client.write_all(&answer))
                .map_err(|_| ()),
        };
        if result.is_err() {
            return;
        }
    }
}

/// One data frame off the initiator's stream: its header and payload.
fn next_frame(client: &mut TcpStream) -> Option<(FrameHeader, Vec<u8>)> {
    let mut head = [0u8; FRAME_HEADER_BYTES];
    client.read_exact(&mut head).ok()?;
    let header = FrameHeader::read_from_bytes(&head).ok()?;
    let carries = header.opcode == FrameOp::Write as u8 || header.opcode == FrameOp::Notify as u8;
    let mut payload = vec![0u8; if carries { header.len as usize } else { 0 }];
    client.read_exact(&mut payload).ok()?;
    Some((header, payload))
}

fn send(server: &mut TcpStream, (header, payload): &(FrameHeader, Vec<u8>)) {
    let _ = server.write_all(header.as_bytes()).and_then(|()| server.write_all(payload));
}

/// A data connection: the hellos and proof pass (the relay can make none
/// of them), then the frames, tampered with as `tamper` says; or the relay
/// answers the hello itself.
fn carry_data(mut client: TcpStream, mut server: TcpStream, tamper: Tamper) {
    let mut hello = [0u8; 64];
    if client.read_exact(&mut hello).is_err() {
        return;
    }
    let epoch = u64::from_le_bytes(hello[8..16].try_into().unwrap());
    match tamper {
        Tamper::TapAsksNoProof | Tamper::TapFakesProof => {
            let mut answer = ServerHello::new(0, 0, epoch, [0x11; 16]);
            if tamper == Tamper::TapFakesProof {
                answer.flags = FLAG_PROOF_REQUIRED;
                answer.proof = [0x22; 32];
            }
            // The initiator refuses it and closes: nothing more comes.
            let _ = client.write_all(answer.as_bytes());
            let _ = client.read_to_end(&mut Vec::new());
            return;
        }
        Tamper::Inject | Tamper::Replay | Tamper::Reorder | Tamper::Rewrite => {}
        _ => {
            let _ = server.write_all(&hello);
            return both_ways(client, server);
        }
    }
    let back = (server.try_clone().unwrap(), client.try_clone().unwrap());
    std::thread::spawn(move || pipe(back.0, back.1));
    let mut proof = [0u8; 40];
    if server.write_all(&hello).is_err() || client.read_exact(&mut proof).is_err() || server.write_all(&proof).is_err()
    {
        return;
    }
    let Some(first) = next_frame(&mut client) else { return };
    match tamper {
        Tamper::Inject => {
            send(&mut server, &first);
            let mut forged = first.0;
            forged.seq += 1;
            forged.offset = MARK;
            forged.len = 16;
            send(&mut server, &(forged, vec![0xee; 16]));
        }
        Tamper::Replay => {
            send(&mut server, &first);
            send(&mut server, &first);
        }
        Tamper::Reorder => {
            let Some(second) = next_frame(&mut client) else { return };
            send(&mut server, &second);
            send(&mut server, &first);
        }
        _ => {
            let (mut header, payload) = first;
            header.offset = MARK;
            send(&mut server, &(header, payload));
        }
    }
    pipe(client, server);
}

fn tokened_engine(name: &str) -> Engine {
    // One lane: the batch's frames share one connection, which the relay
    // tampers with.
    common::builder(name).lanes(1).token(TOKEN).build().unwrap()
}

/// The target's region as a legitimate peer reads it (dialing the target
/// itself, over the control plane only), by checksum of `len` bytes at
/// `offset`.
fn remote_sum(target: &Target, offset: u64, len: u64) -> u64 {
    let token = kvring::Token::new(TOKEN);
    let initiator = kvring::testing::control::Initiator { name: "checker".into(), epoch: 1, addr: String::new() };
    let deadline = Instant::now() + WAIT;
    let mut client = ControlClient::connect(&target.control, deadline).unwrap();
    client.handshake(&initiator, Some(&token), deadline).unwrap();
    client.checksum(target.region, offset, len, deadline).unwrap()
}

fn zeros_sum(len: u64) -> u64 {
    kvring::testing::checksum(&vec![0u8; len as usize])
}

/// A listener at `ip` and the port of `port_of`, or `None` where that port
/// is taken at `ip`. The kernel gave the target its port on 127.0.0.1 only,
/// so its twin at `ip` may still be held: by a connection of an earlier
/// relay lingering in TIME_WAIT (`SO_REUSEADDR` lets a listener in, as
/// servers do), or by a relay of a test running beside this one.
fn listener_at(ip: &str, port_of: &str) -> Option<TcpListener> {
    let port = port_of.rsplit_once(':').unwrap().1;
    let addr: std::net::SocketAddr = format!("{ip}:{port}").parse().unwrap();
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket.set_reuse_address(true).unwrap();
    socket.bind(&addr.into()).ok()?;
    socket.listen(128).ok()?;
    Some(socket.into())
}

/// The error a refused open or batch carries, by its code.
fn code(error: &kvring::Error) -> ErrorCode {
    match error {
        kvring::Error::Remote { code, .. } => *code,
        other => other.code(),
    }
}

#[test]
fn a_relay_at_an_address_of_its_own_gets_no_descriptor() {
    let target = start_target(None);
    for tamper in [Tamper::Nothing, Tamper::Dialed] {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let relayed = listener.local_addr().unwrap().to_string();
        relay(listener, target.control.clone(), carry_control, tamper);
        let engine = tokened_engine("prefill-0");
        let error = engine.open_segment_with(&relayed, Some(TransportKind::Tcp), WAIT).unwrap_err();
        // Forwarded as is, the target sees it was dialed elsewhere; with
        // `dialed` rewritten, the initiator's proof no longer holds.
        assert_eq!(code(&error), ErrorCode::Unauthorized, "{tamper:?}: {error}");
    }
    // The legitimate peer, dialing the target itself, still gets in.
    assert_eq!(remote_sum(&target, 0, REGION as u64), zeros_sum(REGION as u64));
}

/// A target behind the relay's address (it advertises it), so the relay is
/// on the path of every connection, control and data.
fn on_path(tamper: Tamper) -> (Target, Engine, kvring::Result<kvring::Segment>) {
    // A target whose two ports are free at the relay's address too (a few
    // tries: see `listener_at`).
    let (target, control, data) = (0..8)
        .find_map(|_| {
            let target = start_target(Some(ON_PATH_IP));
            assert!(target.advertised_control.starts_with(ON_PATH_IP), "{}", target.advertised_control);
            let control = listener_at(ON_PATH_IP, &target.advertised_control)?;
            let data = listener_at(ON_PATH_IP, &target.advertised_tcp)?;
            Some((target, control, data))
        })
        .expect("a target whose ports are free at the relay's address within 8 tries");
    relay(control, target.control.clone(), carry_control, tamper);
    relay(data, target.tcp.clone(), carry_data, tamper);
    let engine = tokened_engine("prefill-0");
    let opened = engine.open_segment_with(&target.advertised_control, Some(TransportKind::Tcp), WAIT);
    (target, engine, opened)
}

#[test]
fn an_on_path_relay_that_forwards_every_byte_changes_nothing() {
    let (target, engine, opened) = on_path(Tamper::Nothing);
    let segment = opened.unwrap();
    let local = engine.alloc_region(REGION, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(5) };
    let mut sub = engine.submitter().unwrap();
    let remote = segment.region(0).unwrap();
    let id = sub.submit(&Batch::write(&segment).block(BlockDesc::new(local.id(), 0, remote, 0, 4 * BLOCK))).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { assert_eq!(remote_sum(&target, 0, 4 * BLOCK), local.checksum(0, 4 * BLOCK as usize).unwrap()) };
}

#[test]
fn an_on_path_relay_cannot_rewrite_the_descriptor_or_answer_for_the_data_listener() {
    for tamper in [Tamper::Descriptor, Tamper::TapAsksNoProof, Tamper::TapFakesProof] {
        let (target, _engine, opened) = on_path(tamper);
        let error = opened.unwrap_err();
        assert_eq!(code(&error), ErrorCode::Unauthorized, "{tamper:?}: {error}");
        assert!(matches!(error, kvring::Error::Unauthorized { .. }), "{tamper:?}: refused here, not remotely: {error}");
        assert_eq!(remote_sum(&target, 0, REGION as u64), zeros_sum(REGION as u64), "{tamper:?}");
    }
}

#[test]
fn frames_an_on_path_relay_injects_replays_reorders_or_rewrites_are_refused_and_land_nothing() {
    for tamper in [Tamper::Inject, Tamper::Replay, Tamper::Reorder, Tamper::Rewrite] {
        let (target, engine, opened) = on_path(tamper);
        let segment = opened.unwrap();
        let local = engine.alloc_region(REGION, RegionInfo::raw()).unwrap();
        // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
        unsafe { local.fill_pattern(9) };
        let mut sub = engine.submitter().unwrap();
        let remote = segment.region(0).unwrap();
        let descs: Vec<_> = (0..4).map(|i| BlockDesc::new(local.id(), i * BLOCK, remote, i * BLOCK, BLOCK)).collect();
        let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
        match sub.wait(id, WAIT).unwrap() {
            Outcome::Failed(error) => {
                assert!(matches!(error, kvring::Error::Unauthorized { .. }), "{tamper:?}: {error}")
            }
            other => panic!("{tamper:?}: the batch ended {other:?}"),
        }
        // Nothing the relay aimed anywhere landed.
        assert_eq!(remote_sum(&target, MARK, BLOCK), zeros_sum(BLOCK), "{tamper:?}");
        if matches!(tamper, Tamper::Reorder | Tamper::Rewrite) {
            // The first header the target saw was refused: nothing landed.
            assert_eq!(remote_sum(&target, 0, 4 * BLOCK), zeros_sum(4 * BLOCK), "{tamper:?}");
        }
    }
}

#[test]
fn control_messages_an_on_path_relay_rewrites_or_injects_after_the_handshake_are_refused() {
    // A rewritten answer (a checksum here; an RDMA connect's QPs alike).
    let checked = |segment: kvring::Segment| segment.remote_checksum(segment.region(0)?, 0, 4096, WAIT);
    let (target, _engine, opened) = on_path(Tamper::ControlAnswer);
    let error = opened.and_then(checked).unwrap_err();
    assert!(matches!(error, kvring::Error::Unauthorized { .. }), "{error}");
    drop(target);
    // A request of the relay's own, on a connection the initiator proved:
    // never answered, and the connection ends.
    let (_target, _engine, opened) = on_path(Tamper::ControlInject);
    assert!(opened.and_then(checked).is_err());
    assert!(INJECTED.load(std::sync::atomic::Ordering::SeqCst), "the relay injected nothing");
    assert!(!INJECTED_ANSWERED.load(std::sync::atomic::Ordering::SeqCst), "the target answered the relay");
}
