//! Tests of `target.rs`.
use super::super::frame::FLAG_LAST;
use super::super::hello::SERVER_HELLO_BYTES;
use super::*;
use crate::auth::Token;
use crate::mem::RegionInfo;
use crate::notify::NotifyQuota;
use crate::notify::MAX_NOTIFY_FRAME_BYTES;
use crate::proto::ErrorCode;
use crate::transport::tcp::hello::{ClientHello, ClientProof, ServerHello, FLAG_PROOF_REQUIRED};
use std::io::Write;
use zerocopy::FromBytes;
use zerocopy::IntoBytes;

/// A socket stand-in: bytes in, bytes out, `WouldBlock` when empty.
#[derive(Default)]
struct Pipe {
    input: VecDeque<u8>,
    output: Vec<u8>,
    closed: bool,
}

impl Read for Pipe {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.input.is_empty() {
            return if self.closed { Ok(0) } else { Err(std::io::ErrorKind::WouldBlock.into()) };
        }
        let n = buf.len().min(self.input.len());
        for (slot, byte) in buf.iter_mut().zip(self.input.drain(..n)) {
            *slot = byte;
        }
        Ok(n)
    }
}

impl Write for Pipe {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

struct Target {
    ctx: TargetContext,
    memory: Vec<u8>,
    region: RegionId,
}

fn target(token: Option<&str>) -> Target {
    let registry = Arc::new(Registry::new(4));
    let mut memory = vec![0u8; 64 * 1024];
    let region =
        registry.register(memory.as_mut_ptr() as usize, memory.len(), RegionInfo::raw(), Default::default()).unwrap();
    let ctx = TargetContext {
        registry,
        notifications: Arc::new(NotificationQueue::new(NotifyQuota::default())),
        arrivals: Arc::new(crate::arrival::Arrivals::new()),
        epoch: 42,
        auth: token.map(|t| Arc::new(Authenticator::new(Token::new(t), 42))),
    };
    Target { ctx, memory, region }
}

fn step(conn: &mut TargetConn, pipe: &mut Pipe, target: &Target, now: Instant) -> std::result::Result<(), Close> {
    let mut admit = || Ok(());
    conn.on_readable(pipe, &target.ctx, &mut admit, now, &mut Default::default())?;
    conn.on_writable(pipe, &target.ctx, &mut Default::default())?;
    Ok(())
}

fn answer(pipe: &mut Pipe) -> ServerHello {
    let hello = ServerHello::read_from_bytes(&pipe.output[..SERVER_HELLO_BYTES]).unwrap();
    pipe.output.drain(..SERVER_HELLO_BYTES);
    hello
}

fn reply(pipe: &mut Pipe) -> FrameHeader {
    let header = FrameHeader::read_from_bytes(&pipe.output[..FRAME_HEADER_BYTES]).unwrap();
    pipe.output.drain(..FRAME_HEADER_BYTES);
    header
}

fn open(target: &Target) -> (TargetConn, Pipe, Instant) {
    let now = Instant::now();
    let mut conn = TargetConn::new(now, Duration::from_secs(2));
    let mut pipe = Pipe::default();
    pipe.input.extend(ClientHello::new(42, [0; 16], [0; 16], [0; 16]).as_bytes());
    step(&mut conn, &mut pipe, target, now).unwrap();
    assert_eq!(answer(&mut pipe).status, 0);
    (conn, pipe, now)
}

#[test]
fn writes_land_in_the_region_and_reads_come_back_from_it() {
    let target = target(None);
    let (mut conn, mut pipe, now) = open(&target);
    let mut write = FrameHeader::new(FrameOp::Write, 42, 7, target.region.raw(), 100, 5);
    write.flags = FLAG_LAST;
    pipe.input.extend(write.as_bytes());
    pipe.input.extend(b"hello");
    pipe.input.extend(FrameHeader::new(FrameOp::Read, 42, 8, target.region.raw(), 100, 5).as_bytes());
    step(&mut conn, &mut pipe, &target, now).unwrap();
    assert_eq!(&target.memory[100..105], b"hello");
    let ack = reply(&mut pipe);
    assert_eq!((ack.opcode, ack.status, ack.batch_id), (FrameOp::Ack as u8, 0, 7));
    let data = reply(&mut pipe);
    assert_eq!((data.opcode, data.len), (FrameOp::ReadData as u8, 5));
    assert_eq!(pipe.output, b"hello");
    // Every lease went back: the region can be unregistered.
    target.ctx.registry.unregister(target.region).unwrap();
}

#[test]
fn refused_blocks_fail_their_chunk_without_touching_memory() {
    let target = target(None);
    let (mut conn, mut pipe, now) = open(&target);
    // Past the end, then a good frame in the same chunk: the whole chunk
    // is refused with the first failure and nothing is written.
    pipe.input.extend(FrameHeader::new(FrameOp::Write, 42, 7, target.region.raw(), 64 * 1024 - 2, 4).as_bytes());
    pipe.input.extend(b"XXXX");
    let mut last = FrameHeader::new(FrameOp::Write, 42, 7, target.region.raw(), 0, 4);
    last.flags = FLAG_LAST;
    pipe.input.extend(last.as_bytes());
    pipe.input.extend(b"YYYY");
    step(&mut conn, &mut pipe, &target, now).unwrap();
    let ack = reply(&mut pipe);
    assert_eq!(ErrorCode::try_from(-ack.status).unwrap(), ErrorCode::OutOfBounds);
    assert!(target.memory.iter().all(|&b| b == 0));
    // The connection stays framed: another chunk goes through.
    pipe.input.extend(last.as_bytes());
    pipe.input.extend(b"ZZZZ");
    step(&mut conn, &mut pipe, &target, now).unwrap();
    assert_eq!(reply(&mut pipe).status, 0);
    assert_eq!(&target.memory[..4], b"ZZZZ");
}

/// A GRANT naming a grant this process never issued: the writes under it
/// fail `FENCED` and land nothing, and the connection stays framed (the
/// next grant, an issued one, lands).
#[test]
fn writes_under_a_made_up_grant_are_fenced_and_the_stream_stays_in_step() {
    let target = target(None);
    let (mut conn, mut pipe, now) = open(&target);
    let made_up = u32::MAX;
    assert!(!crate::mem::fence::issued(made_up));
    pipe.input.extend(FrameHeader::new(FrameOp::Grant, 42, 7, 0, u64::from(made_up), 0).as_bytes());
    let mut first = FrameHeader::new(FrameOp::Write, 42, 7, target.region.raw(), 0, 4);
    pipe.input.extend(first.as_bytes());
    pipe.input.extend(b"XXXX");
    first.offset = 8;
    first.flags = FLAG_LAST;
    pipe.input.extend(first.as_bytes());
    pipe.input.extend(b"YYYY");
    step(&mut conn, &mut pipe, &target, now).unwrap();
    let ack = reply(&mut pipe);
    assert_eq!((ack.opcode, ack.batch_id), (FrameOp::Ack as u8, 7));
    assert_eq!(ErrorCode::try_from(-ack.status).unwrap(), ErrorCode::Fenced);
    assert!(target.memory.iter().all(|&b| b == 0), "a write under a made-up grant landed");
    // An issued grant (0: none) on the same connection lands.
    pipe.input.extend(FrameHeader::new(FrameOp::Grant, 42, 8, 0, 0, 0).as_bytes());
    let mut next = FrameHeader::new(FrameOp::Write, 42, 8, target.region.raw(), 0, 4);
    next.flags = FLAG_LAST;
    pipe.input.extend(next.as_bytes());
    pipe.input.extend(b"ZZZZ");
    step(&mut conn, &mut pipe, &target, now).unwrap();
    assert_eq!(reply(&mut pipe).status, 0);
    assert_eq!(&target.memory[..4], b"ZZZZ");
    target.ctx.registry.unregister(target.region).unwrap();
}

#[test]
fn nothing_is_served_before_the_hello_and_a_wrong_epoch_is_a_restart() {
    let target = target(None);
    let now = Instant::now();
    // A frame where the hello should be.
    let mut conn = TargetConn::new(now, Duration::from_secs(2));
    let mut pipe = Pipe::default();
    let mut frame = FrameHeader::new(FrameOp::Write, 42, 7, target.region.raw(), 0, 0).as_bytes().to_vec();
    frame.extend_from_slice(&[0; 8]);
    pipe.input.extend(frame);
    step(&mut conn, &mut pipe, &target, now).unwrap();
    assert_eq!(ErrorCode::try_from(-answer(&mut pipe).status).unwrap(), ErrorCode::MalformedMessage);
    assert!(conn.finished());
    // A hello for another epoch.
    let mut conn = TargetConn::new(now, Duration::from_secs(2));
    let mut pipe = Pipe::default();
    pipe.input.extend(ClientHello::new(41, [0; 16], [0; 16], [0; 16]).as_bytes());
    step(&mut conn, &mut pipe, &target, now).unwrap();
    assert_eq!(ErrorCode::try_from(-answer(&mut pipe).status).unwrap(), ErrorCode::PeerRestarted);
    assert!(conn.finished());
    // A version-2 peer's hello (48 bytes): told the versions differ at
    // once, not left to time out waiting for the 64 bytes of a version 3.
    let mut conn = TargetConn::new(now, Duration::from_secs(2));
    let mut pipe = Pipe::default();
    let mut old = ClientHello::new(42, [0; 16], [0; 16], [0; 16]).as_bytes()[..48].to_vec();
    old[4] = 2;
    pipe.input.extend(old);
    step(&mut conn, &mut pipe, &target, now).unwrap();
    assert_eq!(ErrorCode::try_from(-answer(&mut pipe).status).unwrap(), ErrorCode::VersionMismatch);
    assert!(conn.finished());
}

#[test]
fn with_a_token_only_a_session_proof_opens_the_connection() {
    let target = target(Some("s3cret"));
    let token = Token::new("s3cret");
    let cn = [1u8; 16];
    let auth = target.ctx.auth.clone().unwrap();
    let (sn, _) = auth.challenge(&cn);
    let session = token.session(cn, sn, 42);
    for (proof_of, expect_open) in [(None, false), (Some(&session), true)] {
        let now = Instant::now();
        let mut conn = TargetConn::new(now, Duration::from_secs(2));
        let mut pipe = Pipe::default();
        pipe.input.extend(ClientHello::new(42, cn, sn, [9; 16]).as_bytes());
        step(&mut conn, &mut pipe, &target, now).unwrap();
        let challenge = answer(&mut pipe);
        assert_eq!((challenge.status, challenge.flags), (0, FLAG_PROOF_REQUIRED));
        // The listener proves the session first, over both nonces.
        assert!(crate::seal::check_listener_proof(&session, &[9; 16], &challenge.nonce, 42, &challenge.proof));
        assert!(!crate::seal::check_listener_proof(&session, &[8; 16], &challenge.nonce, 42, &challenge.proof));
        // Frames sent before the proof are not served: they are read
        // as the proof, which fails.
        let mac = match proof_of {
            Some(session) => session.data_proof(&challenge.nonce, 42),
            None => Token::new("guess").session(cn, sn, 42).data_proof(&challenge.nonce, 42),
        };
        pipe.input.extend(ClientProof::new(mac).as_bytes());
        step(&mut conn, &mut pipe, &target, now).unwrap();
        let verdict = answer(&mut pipe);
        if expect_open {
            assert_eq!(verdict.status, 0);
            assert!(!conn.finished());
        } else {
            assert_eq!(ErrorCode::try_from(-verdict.status).unwrap(), ErrorCode::Unauthorized);
            assert!(conn.finished());
        }
    }
    // A session this start never issued is refused at the hello: the
    // listener proves nothing for it.
    let now = Instant::now();
    let mut conn = TargetConn::new(now, Duration::from_secs(2));
    let mut pipe = Pipe::default();
    let mut forged = sn;
    forged[15] ^= 1;
    pipe.input.extend(ClientHello::new(42, cn, forged, [9; 16]).as_bytes());
    step(&mut conn, &mut pipe, &target, now).unwrap();
    let refusal = answer(&mut pipe);
    assert_eq!(ErrorCode::try_from(-refusal.status).unwrap(), ErrorCode::Unauthorized);
    assert_eq!(refusal.proof, [0; 32]);
    assert!(conn.finished());
}

#[test]
fn deadlines_close_unproven_slow_and_idle_connections_and_idle_buffers_are_freed() {
    let target = target(None);
    let t0 = Instant::now();
    let conn = TargetConn::new(t0, Duration::from_secs(2));
    assert!(conn.expired(t0 + Duration::from_millis(1999)).is_none());
    assert_eq!(conn.expired(t0 + Duration::from_secs(2)), Some(Close::Ended("did not prove itself in time")));

    let (mut conn, mut pipe, now) = open(&target);
    // Half a header, then silence: the frame deadline counts from its
    // first byte, whatever else trickles in.
    pipe.input.extend(&FrameHeader::new(FrameOp::Read, 42, 8, target.region.raw(), 0, 5).as_bytes()[..10]);
    step(&mut conn, &mut pipe, &target, now).unwrap();
    assert!(conn.expired(now + FRAME_TIMEOUT - Duration::from_millis(1)).is_none());
    assert_eq!(conn.expired(now + FRAME_TIMEOUT), Some(Close::Ended("a frame took too long to arrive")));

    // A connection that proved itself and sent no frame holds a few hundred
    // bytes; its first frame gets the full read buffer, freed when idle.
    let (mut conn, mut pipe, now) = open(&target);
    assert!(
        conn.buffered_bytes() < 1024,
        "{} bytes held by a connection that sent only its hello",
        conn.buffered_bytes()
    );
    pipe.input.extend(FrameHeader::new(FrameOp::Read, 42, 8, target.region.raw(), 0, 5).as_bytes());
    step(&mut conn, &mut pipe, &target, now).unwrap();
    assert!(conn.buffered_bytes() >= READ_BUFFER_BYTES);
    let _ = reply(&mut pipe);
    conn.shrink_if_idle(now + BUFFER_IDLE_FREE);
    assert!(conn.buffered_bytes() < 1024, "{} bytes held while idle", conn.buffered_bytes());
    assert_eq!(conn.expired(now + IDLE_TIMEOUT), Some(Close::Ended("idle")));
}

#[test]
fn a_closed_peer_and_oversized_notifications_end_the_connection() {
    let target = target(None);
    let (mut conn, mut pipe, now) = open(&target);
    let huge = FrameHeader::new(FrameOp::Notify, 42, 0, 0, 0, (MAX_NOTIFY_FRAME_BYTES + 1) as u64);
    pipe.input.extend(huge.as_bytes());
    step(&mut conn, &mut pipe, &target, now).unwrap();
    assert_eq!(ErrorCode::try_from(-reply(&mut pipe).status).unwrap(), ErrorCode::MessageTooLarge);
    assert!(conn.finished());
    let (mut conn, mut pipe, now) = open(&target);
    pipe.closed = true;
    assert_eq!(step(&mut conn, &mut pipe, &target, now), Err(Close::PeerGone));
}

/// An endless stream of 4 KiB WRITE frames (none LAST, so no replies queue
/// up to stop the reading): the socket of a peer that keeps it full.
struct Endless {
    frame: Vec<u8>,
    at: usize,
    given: usize,
}

impl Read for Endless {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        assert!(self.given < 64 << 20, "the connection read 64 MiB without letting go of the lane");
        for byte in buf.iter_mut() {
            *byte = self.frame[self.at];
            self.at = (self.at + 1) % self.frame.len();
        }
        self.given += buf.len();
        Ok(buf.len())
    }
}

#[test]
fn a_peer_that_keeps_its_socket_full_gets_a_budget_then_lets_the_lane_go() {
    let target = target(None);
    let (mut conn, _pipe, now) = open(&target);
    let header = FrameHeader::new(FrameOp::Write, 42, 1, target.region.raw(), 0, 4096);
    let mut frame = header.as_bytes().to_vec();
    frame.extend([0x5a; 4096]);
    let mut endless = Endless { frame, at: 0, given: 0 };
    let mut admit = || Ok(());
    assert!(conn.on_readable(&mut endless, &target.ctx, &mut admit, now, &mut Default::default()).unwrap());
    assert!(conn.unread(), "it stopped at its budget, not because the socket was empty");
    assert!(endless.given <= READ_BUDGET_BYTES + READ_BUFFER_BYTES, "read {} bytes in one go", endless.given);
    assert_eq!(&target.memory[..4096], &[0x5a; 4096][..], "what it read landed");
    // Driven again, it goes on from where it stopped.
    let before = endless.given;
    assert!(conn.on_readable(&mut endless, &target.ctx, &mut admit, now, &mut Default::default()).unwrap());
    assert!(endless.given > before && conn.unread());
}

/// A socket stand-in that records how many bytes each read asked for.
struct Counted {
    pipe: Pipe,
    asked: Vec<usize>,
}

impl Read for Counted {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.asked.push(buf.len());
        self.pipe.read(buf)
    }
}

#[test]
fn after_a_large_write_the_next_header_is_read_alone_and_its_payload_straight_into_the_region() {
    let mut target = target(None);
    let mut memory = vec![0u8; 256 * 1024];
    target.region = target
        .ctx
        .registry
        .register(memory.as_mut_ptr() as usize, memory.len(), RegionInfo::raw(), Default::default())
        .unwrap();
    let (mut conn, pipe, now) = open(&target);
    let mut counted = Counted { pipe, asked: Vec::new() };
    // 48 KiB frames: more than one buffer-sized read (64 KiB) holds.
    let len = 48 * 1024;
    let frames: [(usize, u8); 4] = [(0, 0x11), (len, 0x22), (2 * len, 0x33), (3 * len, 0x44)];
    for (offset, byte) in frames {
        let mut write = FrameHeader::new(FrameOp::Write, 42, 7, target.region.raw(), offset as u64, len as u64);
        write.flags = if byte == 0x44 { FLAG_LAST } else { 0 };
        counted.pipe.input.extend(write.as_bytes());
        counted.pipe.input.extend(std::iter::repeat_n(byte, len));
    }
    let mut admit = || Ok(());
    conn.on_readable(&mut counted, &target.ctx, &mut admit, now, &mut Default::default()).unwrap();
    for (offset, byte) in frames {
        assert!(memory[offset..offset + len].iter().all(|&b| b == byte), "the frame at {offset} did not land");
    }
    // The first read fills the buffer (two frames' start); from then on
    // each header is asked for alone and each payload read whole, straight
    // into the region: no read takes a payload's bytes into the buffer.
    let asked = &counted.asked;
    assert_eq!(asked[0], READ_BUFFER_BYTES, "{asked:?}");
    assert!(asked[1..].iter().all(|&n| n <= len), "a later read asked for a buffer's worth: {asked:?}");
    assert!(asked.iter().filter(|&&n| n == FRAME_HEADER_BYTES).count() >= 2, "headers read alone: {asked:?}");
    assert!(asked.iter().filter(|&&n| n == len).count() >= 2, "payloads read whole: {asked:?}");
}

/// A READ that asks for a checksum (`FLAG_CHECKSUM`) is answered with the
/// CRC32C of the bytes its READ_DATA carries, in the header's `status`
/// (with the flag: not a failure); one that does not ask gets neither.
#[test]
fn a_checksummed_read_is_answered_with_the_crc32c_of_the_bytes_sent() {
    use super::super::frame::FLAG_CHECKSUM;
    let mut target = target(None);
    target.memory[200..209].copy_from_slice(b"123456789");
    let (mut conn, mut pipe, now) = open(&target);
    let mut read = FrameHeader::new(FrameOp::Read, 42, 8, target.region.raw(), 200, 9);
    read.flags = FLAG_CHECKSUM;
    pipe.input.extend(read.as_bytes());
    pipe.input.extend(FrameHeader::new(FrameOp::Read, 42, 9, target.region.raw(), 200, 9).as_bytes());
    step(&mut conn, &mut pipe, &target, now).unwrap();
    let data = reply(&mut pipe);
    assert_eq!((data.opcode, data.len, data.flags), (FrameOp::ReadData as u8, 9, FLAG_CHECKSUM));
    // RFC 3720 B.4's check value of CRC32C over "123456789".
    assert_eq!((data.checksum(), data.failure()), (Some(0xe306_9283), None));
    assert_eq!(&pipe.output[..9], b"123456789");
    pipe.output.drain(..9);
    let plain = reply(&mut pipe);
    assert_eq!((plain.flags, plain.status, plain.checksum()), (0, 0, None));
    assert_eq!(pipe.output, b"123456789");
    target.ctx.registry.unregister(target.region).unwrap();
}
