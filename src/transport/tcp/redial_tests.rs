//! Tests of a quiet data connection dialled again (`redial.rs`), driving a
//! `TcpLink` against a listener that speaks only the hello.
use super::super::frame::{FrameHeader, FrameOp, FRAME_HEADER_BYTES};
use super::*;
use crate::desc::{BlockDesc, RegionId};
use crate::proto::ErrorCode;
use std::net::TcpListener;
use std::sync::mpsc::{channel, Receiver, Sender};

const EPOCH: u64 = 0x5eed;

/// A listener answering each connection's hello with the status the test
/// sends for it (0: accepted), and handing the test the accepted stream.
struct Listener {
    addr: SocketAddr,
    answers: Sender<i32>,
    accepted: Receiver<TcpStream>,
}

fn listener() -> Listener {
    let socket = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = socket.local_addr().unwrap();
    let (answers, answer) = channel::<i32>();
    let (accept, accepted) = channel();
    std::thread::spawn(move || {
        for stream in socket.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut hello = [0u8; super::super::hello::CLIENT_HELLO_BYTES];
            if stream.read_exact(&mut hello).is_err() {
                return;
            }
            let Ok(status) = answer.recv() else { return };
            let _ = stream.write_all(ServerHello::new(status, 0, EPOCH, [0; 16]).as_bytes());
            if accept.send(stream).is_err() {
                return;
            }
        }
    });
    Listener { addr, answers, accepted }
}

/// A link to `at`, and the target's end of its connection (dropped: the
/// target closed it).
fn link(at: &Listener) -> (TcpLink, TcpStream) {
    at.answers.send(0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut made =
        TcpLink::connect("decode-0", &at.addr.to_string(), EPOCH, None, vec![None], deadline, DEFAULT_IO_TIMEOUT)
            .unwrap();
    let theirs = at.accepted.recv_timeout(Duration::from_secs(5)).unwrap();
    let lane = made.lanes.pop().unwrap();
    // SAFETY: `connect` makes only `TcpLink`s, so the box holds one; the
    // test takes it back as what it is to reach its fields.
    (*unsafe { Box::from_raw(Box::into_raw(lane).cast::<TcpLink>()) }, theirs)
}

/// Until `link` sees its connection closed by the target.
fn until_closed(link: &TcpLink) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !link.connection.as_ref().is_ok_and(|c| c.peer_closed()) {
        assert!(Instant::now() < deadline, "the close never arrived");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The first frame header `stream` carries.
fn first_frame(stream: &mut TcpStream) -> (FrameHeader, FrameOp) {
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut header = [0u8; FRAME_HEADER_BYTES];
    stream.read_exact(&mut header).unwrap();
    FrameHeader::decode(&header).unwrap()
}

fn block(memory: &mut [u8]) -> Block {
    let region = RegionId::from_raw(1 << 16);
    Block {
        local: memory.as_mut_ptr(),
        memory: crate::mem::MemoryKind::Host,
        desc: BlockDesc::new(region, 0, region, 0, memory.len() as u64),
        desc_index: 0,
        tag: 0,
        checksum: false,
        grant: 0,
    }
}

/// Polls until the dial's answer was taken.
fn until_dialled(link: &mut TcpLink, ended: &mut Vec<ChunkEnd>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while link.redial.is_some() {
        link.poll(ended);
        assert!(Instant::now() < deadline, "the dial never ended");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Quiet for longer than half the target's idle close: the next chunk is
/// sent on a connection dialled again, not on the old one, and the lane's
/// wake descriptor is handed over.
#[test]
fn a_chunk_after_a_long_quiet_goes_on_a_new_connection() {
    let at = listener();
    let (mut link, _open) = link(&at);
    link.last_used = Instant::now() - QUIET_REDIAL_AFTER - Duration::from_secs(1);
    let mut memory = vec![7u8; 16];
    // SAFETY: `memory` outlives the link's chunk (it ends below).
    let posted = unsafe { link.transfer(Opcode::Write, 1, 9, &[block(&mut memory)]) };
    assert!(matches!(posted, Posted::InFlight));
    assert!(link.redial.is_some() && link.waiting_on_copies(), "dialling, and the lane told to look again soon");
    at.answers.send(0).unwrap();
    let mut ended = Vec::new();
    until_dialled(&mut link, &mut ended);
    assert!(ended.is_empty(), "{ended:?}");
    assert!(link.rewoken(), "the lane registers the new socket");
    assert!(!link.rewoken(), "once");
    // The parked chunk's frame is on the new connection.
    let mut fresh = at.accepted.recv_timeout(Duration::from_secs(5)).unwrap();
    let (header, op) = first_frame(&mut fresh);
    assert_eq!((op, header.batch_id, header.len), (FrameOp::Write, 1, 16));
}

/// A part cancelled while its chunk waits for the dial ends at once,
/// `Cancelled`; the dial, which nothing waits for any more, is dropped
/// unread, nothing is sent on it, and the next chunk dials afresh.
#[test]
fn a_chunk_withdrawn_while_dialling_ends_cancelled_and_is_never_sent() {
    let at = listener();
    let (mut link, closed) = link(&at);
    drop(closed);
    until_closed(&link);
    let mut memory = vec![7u8; 16];
    // SAFETY: `memory` outlives the link's chunk (it ends below).
    assert!(matches!(unsafe { link.transfer(Opcode::Write, 1, 9, &[block(&mut memory)]) }, Posted::InFlight));
    let mut ended = Vec::new();
    assert_eq!(link.withdraw(9, &mut ended), 1);
    assert!(matches!(ended.as_slice(), [(9, Err((Error::Cancelled { .. }, 0)))]), "{ended:?}");
    assert!(link.redial.is_none(), "nothing waits for the dial: its answer is dropped unread");
    // SAFETY: `memory` outlives the link's chunk (it ends below).
    assert!(matches!(unsafe { link.transfer(Opcode::Write, 2, 10, &[block(&mut memory)]) }, Posted::InFlight));
    at.answers.send(0).unwrap(); // the abandoned dial's
    at.answers.send(0).unwrap(); // the next one's
    ended.clear();
    until_dialled(&mut link, &mut ended);
    assert!(ended.is_empty(), "{ended:?}");
    // The two dials reach the listener in either order: one carries the
    // next batch's chunk, the abandoned one nothing.
    let mut frames = Vec::new();
    for _ in 0..2 {
        let mut stream = at.accepted.recv_timeout(Duration::from_secs(5)).unwrap();
        stream.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        let mut header = [0u8; FRAME_HEADER_BYTES];
        if stream.read_exact(&mut header).is_ok() {
            frames.push(FrameHeader::decode(&header).unwrap().0.batch_id);
        }
    }
    assert_eq!(frames, [2], "the next batch's chunk, on one connection; nothing on the abandoned dial");
}

/// A peer that restarted while the connection was quiet refuses the dial
/// (another epoch): the parked chunk fails `PeerRestarted`, and the link is
/// broken so its handle goes stale; a full target's `Busy` fails the chunk
/// but leaves the link to dial again.
#[test]
fn a_refused_dial_fails_what_was_parked_with_its_reason() {
    let at = listener();
    let (mut link, closed) = link(&at);
    drop(closed);
    until_closed(&link);
    let mut memory = vec![7u8; 16];
    for (status, broken) in [(-(ErrorCode::Busy as i32), false), (-(ErrorCode::PeerRestarted as i32), true)] {
        // SAFETY: `memory` outlives the link's chunk (it ends below).
        assert!(matches!(unsafe { link.transfer(Opcode::Write, 1, 9, &[block(&mut memory)]) }, Posted::InFlight));
        at.answers.send(status).unwrap();
        let mut ended = Vec::new();
        until_dialled(&mut link, &mut ended);
        let code = ended.first().and_then(|(_, r)| r.as_ref().err()).map(|(e, _)| e.code());
        let want = if broken { ErrorCode::PeerRestarted } else { ErrorCode::Busy };
        assert_eq!((ended.len(), code), (1, Some(want)), "{ended:?}");
        assert_eq!(link.state.is_broken(), broken);
    }
}

/// Dialled only because it was quiet (still open): a dial refused `Busy`
/// says nothing of the peer, so the parked chunk goes on the quiet
/// connection, as it would have.
#[test]
fn a_quiet_open_connection_carries_on_when_its_early_dial_is_refused_busy() {
    let at = listener();
    let (mut link, mut open) = link(&at);
    link.last_used = Instant::now() - QUIET_REDIAL_AFTER - Duration::from_secs(1);
    let mut memory = vec![7u8; 16];
    // SAFETY: `memory` outlives the link's chunk.
    assert!(matches!(unsafe { link.transfer(Opcode::Write, 3, 9, &[block(&mut memory)]) }, Posted::InFlight));
    at.answers.send(-(ErrorCode::Busy as i32)).unwrap();
    let mut ended = Vec::new();
    until_dialled(&mut link, &mut ended);
    assert!(ended.is_empty(), "not failed: {ended:?}");
    assert!(!link.state.is_broken());
    assert_eq!(first_frame(&mut open).0.batch_id, 3, "sent on the quiet connection");
    assert!(link.last_used.elapsed() < QUIET_REDIAL_AFTER, "not dialled again at the next chunk");
}
