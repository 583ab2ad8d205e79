//! A raw peer on a target's tcp data listener, as an outsider speaks it:
//! the hello and single frames, byte for byte (for the hostile tests).

use super::WAIT;
use kvring::testing::tcp::{
    ClientHello, FrameHeader, FrameOp, ServerHello, FLAG_LAST, FRAME_HEADER_BYTES, SERVER_HELLO_BYTES,
};
use kvring::{Engine, RegionId};
use std::io::{Read, Write};
use zerocopy::{FromBytes, IntoBytes};

/// A raw, tokenless data connection to `target`'s tcp listener (a peer the
/// target lets write its regions: it has no token).
pub fn data_connection(target: &Engine) -> std::net::TcpStream {
    let descriptor = kvring::testing::descriptor(target);
    let mut s = std::net::TcpStream::connect(descriptor.tcp_addr.as_deref().unwrap()).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(ClientHello::new(descriptor.epoch, [0; 16], [0; 16], [0x2d; 16]).as_bytes()).unwrap();
    let mut hello = [0u8; SERVER_HELLO_BYTES];
    s.read_exact(&mut hello).unwrap();
    assert_eq!(ServerHello::read_from_bytes(&hello).unwrap().status, 0);
    s
}

/// One tagged WRITE frame (a chunk of its own) and its ack's status.
pub fn tagged_write(
    s: &mut std::net::TcpStream,
    epoch: u64,
    region: RegionId,
    offset: u64,
    payload: &[u8],
    tag: u32,
) -> i32 {
    let mut header = FrameHeader::new(FrameOp::Write, epoch, 1, region.raw(), offset, payload.len() as u64);
    // FLAG_TAGGED (0x2) with the tag in the status field, as the wire says.
    header.flags = FLAG_LAST | 0x2;
    header.status = tag as i32;
    s.write_all(header.as_bytes()).unwrap();
    s.write_all(payload).unwrap();
    let mut ack = [0u8; FRAME_HEADER_BYTES];
    s.read_exact(&mut ack).unwrap();
    FrameHeader::read_from_bytes(&ack).unwrap().status
}

/// As a peer that reads nothing would: a 4 KiB receive buffer.
pub fn shrink_receive_buffer(s: &std::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let size: libc::c_int = 4096;
    // SAFETY: a valid socket fd and an int option of its size.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
}

/// A control server that lies: it answers one handshake with `lie` (any
/// descriptor, another engine's files and pid included). With `hold_open`
/// it keeps the connection until the initiator is done with it, as a real
/// server would. Returns its address and its thread.
pub fn lying_control_server(
    lie: &kvring::testing::SegmentDescriptor,
    hold_open: bool,
) -> (String, std::thread::JoinHandle<()>) {
    use kvring::testing::control::{preface, read_frame, response, write_frame, HandshakeResponse};
    let answer = kvring::testing::control::response(response::Body::Handshake(HandshakeResponse {
        segment: Some(Box::new(lie.to_proto())),
        challenge: None,
        ..Default::default()
    }));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut theirs = [0u8; 8];
        s.read_exact(&mut theirs).unwrap();
        s.write_all(&preface()).unwrap();
        let _ = read_frame(&mut s, kvring::testing::control::MAX_CONTROL_MESSAGE_BYTES);
        write_frame(&mut s, &answer).unwrap();
        if hold_open {
            let _ = s.read_to_end(&mut Vec::new());
        }
    });
    (addr, server)
}

/// A fake engine in this process: answers every untokened handshake with
/// `descriptor` (its control address filled in), and nothing else.
pub fn fake_peer(mut descriptor: kvring::testing::control::SegmentDescriptor) -> String {
    use kvring::testing::control::MAX_CONTROL_MESSAGE_BYTES;
    use kvring::testing::control::{preface, read_frame, request, response, write_frame, HandshakeResponse, Request};
    use prost::Message;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    descriptor.control_addr = addr.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(8) {
            let Ok(mut stream) = stream else { return };
            stream.set_read_timeout(Some(WAIT)).unwrap();
            let _ = stream.write_all(&preface());
            let mut theirs = [0u8; 8];
            if stream.read_exact(&mut theirs).is_err() || theirs != preface() {
                continue;
            }
            while let Ok(Some(frame)) = read_frame(&mut stream, MAX_CONTROL_MESSAGE_BYTES) {
                let Ok(Request { body: Some(request::Body::Handshake(_)), .. }) = Request::decode(frame.as_slice())
                else {
                    break;
                };
                let answer = HandshakeResponse { segment: Some(Box::new(descriptor.clone())), ..Default::default() };
                if write_frame(&mut stream, &response(response::Body::Handshake(answer))).is_err() {
                    break;
                }
            }
        }
    });
    addr
}
