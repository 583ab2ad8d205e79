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

fn link(at: &Listener) -> TcpLink {
    at.answers.send(0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut made =
        TcpLink::connect("decode-0", &at.addr.to_string(), EPOCH, None, vec![None], deadline, DEFAULT_IO_TIMEOUT)
            .unwrap();
    at.accepted.recv_timeout(Duration::from_secs(5)).unwrap();
    let lane = made.lanes.pop().unwrap();
    // SAFETY: `connect` makes only `TcpLink`s, so the box holds one; the
    // test takes it back as what it is to reach its fields.
    *unsafe { Box::from_raw(Box::into_raw(lane).cast::<TcpLink>()) }
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
    let mut link = link(&at);
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
    let mut header = [0u8; FRAME_HEADER_BYTES];
    fresh.read_exact(&mut header).unwrap();
    let (header, op) = FrameHeader::decode(&header).unwrap();
    assert_eq!((op, header.batch_id, header.len), (FrameOp::Write, 1, 16));
}

/// A part cancelled while its chunk waits for the dial ends at once,
/// `Cancelled`, and nothing of it is sent on the new connection.
#[test]
fn a_chunk_withdrawn_while_dialling_ends_cancelled_and_is_never_sent() {
    let at = listener();
    let mut link = link(&at);
    link.last_used = Instant::now() - QUIET_REDIAL_AFTER - Duration::from_secs(1);
    let mut memory = vec![7u8; 16];
    // SAFETY: `memory` outlives the link's chunk (it ends below).
    assert!(matches!(unsafe { link.transfer(Opcode::Write, 1, 9, &[block(&mut memory)]) }, Posted::InFlight));
    let mut ended = Vec::new();
    assert_eq!(link.withdraw(9, &mut ended), 1);
    assert!(matches!(ended.as_slice(), [(9, Err((Error::Cancelled { .. }, 0)))]), "{ended:?}");
    at.answers.send(0).unwrap();
    ended.clear();
    until_dialled(&mut link, &mut ended);
    assert!(ended.is_empty());
    let fresh = at.accepted.recv_timeout(Duration::from_secs(5)).unwrap();
    fresh.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let got = (&fresh).read(&mut [0u8; 1]);
    assert!(got.is_err(), "nothing was sent: {got:?}");
}

/// A peer that restarted while the connection was quiet refuses the dial
/// (another epoch): the parked chunk fails `PeerRestarted`, and the link is
/// broken so its handle goes stale; a full target's `Busy` fails the chunk
/// but leaves the link to dial again.
#[test]
fn a_refused_dial_fails_what_was_parked_with_its_reason() {
    let at = listener();
    let mut link = link(&at);
    let mut memory = vec![7u8; 16];
    for (status, broken) in [(-(ErrorCode::Busy as i32), false), (-(ErrorCode::PeerRestarted as i32), true)] {
        link.last_used = Instant::now() - QUIET_REDIAL_AFTER - Duration::from_secs(1);
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
