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
