//! One target, thousands of peers: a `kvring serve --lanes 2` holds 4,096
//! data connections from 64 source addresses, every one of them completes
//! its WRITE and its READ within a bound (no connection starves), the bytes
//! are verified, and the target's threads do not grow with its connections:
//! its lanes serve them all.

mod common;

use common::child::{self, Target};
use common::WAIT;
use kvring::testing::tcp::{ClientHello, ServerHello, SERVER_HELLO_BYTES};
use kvring::testing::tcp::{FrameHeader, FrameOp, FLAG_LAST, FRAME_HEADER_BYTES};
use kvring::{BlockDesc, Engine, RegionInfo, TransportKind};
use socket2::{Domain, Socket, Type};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};
use zerocopy::{FromBytes, IntoBytes};

/// Source addresses (127.0.0.2 and up), as if from as many peer hosts.
const PEERS: usize = 64;
/// Connections each peer holds: 64 × 64 = 4,096.
const PER_PEER: usize = 64;
const BLOCK: usize = 4096;
const LANES: usize = 2;
/// Every connection's round of requests must be answered within this.
const ROUND_BOUND: Duration = Duration::from_secs(60);

fn start_target(region_bytes: usize) -> Target {
    child::start_lanes_target("scale-target", LANES, &region_bytes.to_string())
}

/// The names of the engine's threads in process `pid` (not `kvring
/// serve`'s own: its main thread, its raw baseline sink, its stdin watch).
fn engine_threads(pid: u32) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
        .map(|task| std::fs::read_to_string(task.path().join("comm")).unwrap_or_default().trim().to_string())
        .filter(|name| ["kvring-lane", "kvring-tcp", "kvring-control"].iter().any(|p| name.starts_with(p)))
        .collect();
    names.sort();
    names
}

/// A data connection from `source`, past its hello (no token).
fn data_connection(target: &Target, source: Ipv4Addr) -> TcpStream {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    socket.bind(&SocketAddr::new(source.into(), 0).into()).unwrap();
    socket.connect_timeout(&target.tcp.into(), WAIT).unwrap();
    let mut stream: TcpStream = socket.into();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream.set_nodelay(true).unwrap();
    stream.write_all(ClientHello::new(target.epoch, [0; 16], [0; 16], [0; 16]).as_bytes()).unwrap();
    let mut answer = [0u8; SERVER_HELLO_BYTES];
    stream.read_exact(&mut answer).unwrap();
    let answer = ServerHello::read_from_bytes(&answer).unwrap();
    assert_eq!((answer.status, answer.flags), (0, 0), "a tokenless target admits the hello");
    stream
}

/// The block connection `i` writes: its own pattern.
fn block_of(i: usize) -> Vec<u8> {
    common::pattern(BLOCK, i as u64 + 1)
}

fn reply_header(stream: &mut TcpStream) -> FrameHeader {
    let mut bytes = [0u8; FRAME_HEADER_BYTES];
    stream.read_exact(&mut bytes).unwrap();
    FrameHeader::read_from_bytes(&bytes).unwrap()
}

/// Sends one request on every connection, then reads every answer with
/// `answer`; returns the slowest connection's time from the round's start.
fn round(
    conns: &mut [TcpStream],
    request: impl Fn(usize) -> Vec<u8>,
    answer: impl Fn(usize, &mut TcpStream),
) -> Duration {
    let started = Instant::now();
    for (i, stream) in conns.iter_mut().enumerate() {
        stream.write_all(&request(i)).unwrap();
    }
    let mut slowest = Duration::ZERO;
    for (i, stream) in conns.iter_mut().enumerate() {
        answer(i, stream);
        slowest = slowest.max(started.elapsed());
    }
    slowest
}

#[test]
fn four_thousand_connections_each_write_and_read_within_a_bound_and_the_threads_stay_the_lanes() {
    let connections = PEERS * PER_PEER;
    let target = start_target(connections * BLOCK);
    let pid = target.child.id();
    let before = engine_threads(pid);

    let mut conns = Vec::with_capacity(connections);
    for peer in 0..PEERS {
        let source = Ipv4Addr::new(127, 0, 0, 2 + peer as u8);
        for _ in 0..PER_PEER {
            conns.push(data_connection(&target, source));
        }
    }

    // Every connection writes its own block, all at once; every one is
    // acknowledged within the bound.
    let (epoch, region) = (target.epoch, target.region);
    let slowest_write = round(
        &mut conns,
        |i| {
            let mut header =
                FrameHeader::new(FrameOp::Write, epoch, i as u64, region, (i * BLOCK) as u64, BLOCK as u64);
            header.flags = FLAG_LAST;
            let mut frame = header.as_bytes().to_vec();
            frame.extend_from_slice(&block_of(i));
            frame
        },
        |i, stream| {
            let ack = reply_header(stream);
            assert_eq!((ack.opcode, ack.batch_id, ack.status), (FrameOp::Ack as u8, i as u64, 0), "connection {i}");
        },
    );
    assert!(slowest_write < ROUND_BOUND, "the slowest WRITE took {slowest_write:?}");

    // The threads did not grow with the connections: the lanes, the
    // acceptor, the control server.
    let during = engine_threads(pid);
    assert_eq!(during, before, "the engine's threads with {connections} connections, and before");
    assert!(during.len() <= LANES + 4, "engine threads {during:?}");

    // Every connection reads its block back, all at once.
    let slowest_read = round(
        &mut conns,
        |i| {
            let mut header = FrameHeader::new(FrameOp::Read, epoch, i as u64, region, (i * BLOCK) as u64, BLOCK as u64);
            header.flags = FLAG_LAST;
            header.as_bytes().to_vec()
        },
        |i, stream| {
            let reply = reply_header(stream);
            assert_eq!((reply.opcode, reply.status, reply.len), (FrameOp::ReadData as u8, 0, BLOCK as u32));
            let mut data = vec![0u8; BLOCK];
            stream.read_exact(&mut data).unwrap();
            assert!(data == block_of(i), "connection {i} read back what it wrote");
        },
    );
    assert!(slowest_read < ROUND_BOUND, "the slowest READ took {slowest_read:?}");

    // An engine arriving now still opens, moves and verifies.
    let engine: Engine = common::engine("late-peer");
    let segment = engine.open_segment_with(&target.control, Some(TransportKind::Tcp), WAIT).unwrap();
    let local = engine.alloc_region(connections * BLOCK, RegionInfo::raw()).unwrap();
    for i in 0..connections {
        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
        unsafe { local.write_at((i * BLOCK) as u64, &block_of(i)).unwrap() };
    }
    let remote = segment.region(0).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    let expected = unsafe { local.checksum(0, connections * BLOCK).unwrap() };
    assert_eq!(segment.remote_checksum(remote, 0, (connections * BLOCK) as u64, WAIT).unwrap(), expected);
    let mut sub = engine.submitter().unwrap();
    let desc = [BlockDesc::new(local.id(), 0, remote, 0, BLOCK as u64)];
    let id = sub.submit(&kvring::Batch::write(&segment).descs(&desc)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    drop(conns);
}
