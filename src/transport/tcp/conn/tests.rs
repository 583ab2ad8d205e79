//! Tests of `conn.rs`.
use super::*;
use crate::desc::{BlockDesc, RegionId};
use std::net::TcpListener;

fn pair() -> (Connection, TcpStream, Peer) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let client = TcpStream::connect(addr).unwrap();
    let (server, _) = listener.accept().unwrap();
    (Connection::new(client).unwrap(), server, Peer { name: "decode-0".into(), addr, epoch: 5 })
}

fn block(memory: &mut [u8], offset: u64) -> Block {
    let region = RegionId::from_raw(1 << 16);
    Block {
        local: memory.as_mut_ptr().wrapping_add(offset as usize),
        memory: crate::mem::MemoryKind::Host,
        desc: BlockDesc::new(region, offset, region, offset, 4),
        desc_index: 0,
        tag: 0,
        checksum: false,
        grant: 0,
    }
}

#[test]
fn a_refused_chunk_drops_its_batchs_unsent_chunks_but_not_the_next_batchs() {
    let (mut connection, mut server, peer) = pair();
    let mut memory = vec![1u8; 64];
    for ticket in 1..=3 {
        let blocks = [block(&mut memory, ticket * 4)];
        // SAFETY: `memory` outlives the connection and nothing else touches it.
        unsafe { connection.queue_chunk(&peer, Opcode::Write, 7, ticket, &blocks) };
    }
    let next_batch = [block(&mut memory, 32)];
    // SAFETY: `memory` outlives the connection and nothing else touches it.
    unsafe { connection.queue_chunk(&peer, Opcode::Write, 8, 4, &next_batch) };

    // Chunk 1 leaves (as if the socket took exactly its frame); the target
    // refuses it before the rest of batch 7 is sent.
    let first = connection.out.front().unwrap().total();
    connection.advance_sent(first);
    let mut refusal = FrameHeader::new(FrameOp::Ack, 5, 7, 1 << 16, 4, 0);
    refusal.status = -(ErrorCode::OutOfBounds as i32);
    server.write_all(refusal.as_bytes()).unwrap();
    let mut finished = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while finished.len() < 3 {
        connection.receive(&peer, &mut finished).unwrap();
        assert!(Instant::now() < deadline, "no reply read: {finished:?}");
    }
    let tickets: Vec<u64> = finished.iter().map(|(ticket, _)| *ticket).collect();
    assert_eq!(tickets, [1, 2, 3]);
    assert!(matches!(&finished[0].1, Err((Error::Remote { code: ErrorCode::OutOfBounds, .. }, 0))));
    for (_, result) in &finished[1..] {
        let (error, _) = result.as_ref().unwrap_err();
        assert!(error.to_string().contains("not sent: an earlier chunk of its batch failed"), "{error}");
    }
    // Batch 8 is all that is left to send.
    let queued: Vec<u64> = connection.out.iter().map(|f| f.chunk).collect();
    assert_eq!(queued, [3], "batch 8's chunk, the fourth queued");
    assert_eq!(connection.awaiting.len(), 1);
}

/// A part's chunks share its ticket: after a refusal, only the chunks none
/// of whose frames left are dropped, one by one, and the order their ends
/// are reported in is told by their ids (a chunk whose replies are still to
/// come ends after a later one that was dropped).
#[test]
fn unsent_chunks_of_a_refused_part_are_dropped_by_chunk_not_by_ticket() {
    let (mut connection, mut server, peer) = pair();
    connection.track_chunks();
    let mut memory = vec![1u8; 64];
    let ids: Vec<u64> = (0..3u64)
        .map(|i| {
            let blocks = [block(&mut memory, i * 8)];
            // SAFETY: `memory` outlives the connection and nothing else touches it.
            unsafe { connection.queue_chunk(&peer, Opcode::Read, 7, 1, &blocks) }
        })
        .collect();
    // The first two chunks' requests leave; the third's does not.
    let sent = connection.out.iter().take(2).map(OutFrame::total).sum();
    connection.advance_sent(sent);
    // The first is refused: the third (unsent) is dropped, the second
    // (sent, its reply still to come) stays.
    let mut refusal = FrameHeader::new(FrameOp::ReadData, 5, 7, 1 << 16, 0, 0);
    refusal.status = -(ErrorCode::OutOfBounds as i32);
    server.write_all(refusal.as_bytes()).unwrap();
    let mut finished = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while finished.len() < 2 {
        connection.receive(&peer, &mut finished).unwrap();
        assert!(Instant::now() < deadline, "no reply read: {finished:?}");
    }
    assert_eq!(connection.ended_chunks().collect::<Vec<_>>(), [ids[0], ids[2]]);
    assert!(connection.out.is_empty(), "nothing of the dropped chunk is left to send");
    assert_eq!(connection.awaiting.iter().map(|a| a.chunk).collect::<Vec<_>>(), [ids[1]]);
}

#[test]
fn an_ack_for_a_chunk_or_notification_not_yet_sent_kills_the_connection() {
    // A peer out of step acks what it cannot have read: the chunk must not
    // end while its payload is still queued (its memory would be released,
    // or the notification's buffer freed, before the frame goes out).
    for notify in [false, true] {
        let (mut connection, mut server, peer) = pair();
        let mut memory = vec![1u8; 64];
        if notify {
            connection.queue_notification(&peer, 1, b"request 42 in place".to_vec());
        } else {
            // SAFETY: `memory` outlives the connection and nothing else touches it.
            unsafe { connection.queue_chunk(&peer, Opcode::Write, 7, 1, &[block(&mut memory, 0)]) };
        }
        let batch = if notify { 0 } else { 7 };
        server.write_all(FrameHeader::new(FrameOp::Ack, 5, batch, 0, 0, 0).as_bytes()).unwrap();
        let mut finished = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        let error = loop {
            match connection.receive(&peer, &mut finished) {
                Err(error) => break error.to_string(),
                Ok(_) => assert!(Instant::now() < deadline, "the early ack was not read"),
            }
        };
        assert!(error.contains("acknowledged a chunk before it was sent"), "{error}");
        assert!(finished.is_empty(), "nothing ended on the early ack: {finished:?}");
        connection.fail_all(&peer, &error, &mut finished);
        assert!(connection.out.is_empty(), "the frames went with the chunk");
        assert!(matches!(&finished[..], [(1, Err((Error::PeerRestarted { .. }, 0)))]), "{finished:?}");
    }
}

#[test]
fn replies_out_of_step_or_a_closed_peer_kill_the_connection() {
    let (mut connection, mut server, peer) = pair();
    let mut memory = vec![1u8; 64];
    // SAFETY: `memory` outlives the connection and nothing else touches it.
    unsafe { connection.queue_chunk(&peer, Opcode::Write, 7, 1, &[block(&mut memory, 0)]) };
    // An ack for a batch nobody sent.
    server.write_all(FrameHeader::new(FrameOp::Ack, 5, 99, 0, 0, 0).as_bytes()).unwrap();
    let mut finished = Vec::new();
    let error = loop {
        match connection.progress(&peer, Duration::from_secs(5), &mut finished) {
            Err(reason) => break reason.to_string(),
            Ok(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    assert!(error.contains("out of order"), "{error}");
    connection.fail_all(&peer, &error, &mut finished);
    assert!(matches!(&finished[..], [(1, Err((Error::PeerRestarted { .. }, 0)))]), "{finished:?}");

    let (mut connection, server, peer) = pair();
    // SAFETY: `memory` outlives the connection and nothing else touches it.
    unsafe { connection.queue_chunk(&peer, Opcode::Read, 7, 1, &[block(&mut memory, 0)]) };
    drop(server);
    let error = loop {
        match connection.progress(&peer, Duration::from_secs(5), &mut finished) {
            Err(reason) => break reason.to_string(),
            Ok(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    assert!(error.contains("closed the connection") || error.contains("reset"), "{error}");
}

#[test]
fn a_silent_peer_is_declared_dead_after_the_io_timeout() {
    let (mut connection, _server, peer) = pair();
    let mut memory = vec![1u8; 64];
    // SAFETY: `memory` outlives the connection and nothing else touches it.
    unsafe { connection.queue_chunk(&peer, Opcode::Read, 7, 1, &[block(&mut memory, 0)]) };
    let mut finished = Vec::new();
    let started = Instant::now();
    let error = loop {
        match connection.progress(&peer, Duration::from_millis(50), &mut finished) {
            Err(reason) => break reason.to_string(),
            Ok(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    assert!(error.contains("no reply"), "{error}");
    assert!(started.elapsed() >= Duration::from_millis(50));
}

/// The send window: of four 1 MiB WRITE chunks, only as many as
/// `MAX_UNACKED_BYTES` covers leave before an ack; a chunk held back is
/// never sealed or started, so a cancel withdraws it; each ack lets the
/// next one go.
#[test]
fn only_a_window_of_chunks_leaves_before_their_acks_and_the_rest_can_be_withdrawn() {
    const MIB: u64 = 1 << 20;
    let (mut connection, server, peer) = pair();
    let mut memory = vec![7u8; 4 * MIB as usize];
    let region = RegionId::from_raw(1 << 16);
    for ticket in 0..4u64 {
        let block = Block {
            local: memory.as_mut_ptr().wrapping_add((ticket * MIB) as usize),
            memory: crate::mem::MemoryKind::Host,
            desc: BlockDesc::new(region, ticket * MIB, region, ticket * MIB, MIB),
            desc_index: 0,
            tag: 0,
            checksum: false,
            grant: 0,
        };
        // SAFETY: `memory` outlives the connection and nothing else touches it.
        unsafe { connection.queue_chunk(&peer, Opcode::Write, 7, ticket, &[block]) };
    }
    // The target reads everything that arrives, counting it.
    let mut reader = server.try_clone().unwrap();
    let counted = std::thread::spawn(move || {
        let (mut total, mut buffer) = (0u64, vec![0u8; 1 << 16]);
        while let Ok(n @ 1..) = reader.read(&mut buffer) {
            total += n as u64;
        }
        total
    });
    let windowed = window::MAX_UNACKED_BYTES / MIB;
    assert!((1..4).contains(&windowed), "the test needs a window of 1-3 chunks");
    let frame = |n: u64| n * (MIB + FRAME_HEADER_BYTES as u64);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut finished = Vec::new();
    while connection.out.len() as u64 > 4 - windowed {
        connection.progress(&peer, Duration::from_secs(5), &mut finished).unwrap();
        assert!(Instant::now() < deadline, "the window's chunks did not leave");
    }
    for _ in 0..20 {
        connection.progress(&peer, Duration::from_secs(5), &mut finished).unwrap();
    }
    assert_eq!(connection.out.len() as u64, 4 - windowed, "nothing past the window left");
    assert_eq!(connection.unacked_bytes(), windowed * MIB);
    assert!(connection.out.iter().all(|f| !f.sealed && f.chunk >= windowed));
    // Cancelling the last chunk's batch part withdraws it at once.
    assert_eq!(connection.withdraw_unsent(3, &mut finished), 1);
    assert!(matches!(&finished[..], [(3, Err((Error::Cancelled { bytes: 0 }, 0)))]), "{finished:?}");
    finished.clear();
    // The first chunk's ack lets the next one (if any is left) go.
    (&server).write_all(FrameHeader::new(FrameOp::Ack, 5, 7, 1 << 16, 0, 0).as_bytes()).unwrap();
    let left = (3 - windowed) as usize;
    while finished.is_empty() || connection.out.len() > left.saturating_sub(1) {
        connection.progress(&peer, Duration::from_secs(5), &mut finished).unwrap();
        assert!(Instant::now() < deadline, "the ack did not open the window: {finished:?}");
    }
    assert!(matches!(&finished[..], [(0, Ok(n))] if *n == MIB), "{finished:?}");
    let sent = windowed + u64::from(left > 0);
    assert_eq!(connection.unacked_bytes(), (sent - 1) * MIB);
    connection.shutdown();
    assert_eq!(counted.join().unwrap(), frame(sent));
}

/// Reads three checksummed blocks of 4 bytes as a target would answer
/// them: `replies` gives each block's payload and the CRC32C its READ_DATA
/// header carries (`FLAG_CHECKSUM`, in `status`). Returns how the chunk
/// ended and the local memory.
fn checksummed_read(replies: [(&[u8; 4], u32); 3]) -> (ChunkEnd, Vec<u8>) {
    let (mut connection, mut server, peer) = pair();
    let mut memory = vec![0u8; 12];
    let blocks: Vec<Block> =
        (0..3).map(|i| Block { desc_index: i, checksum: true, ..block(&mut memory, u64::from(i) * 4) }).collect();
    // SAFETY: `memory` outlives the connection and nothing else touches it.
    unsafe { connection.queue_chunk(&peer, Opcode::Read, 7, 1, &blocks) };
    connection.send(&peer).unwrap();
    let mut requests = [0u8; 3 * FRAME_HEADER_BYTES];
    server.read_exact(&mut requests).unwrap();
    for (index, request) in requests.chunks(FRAME_HEADER_BYTES).enumerate() {
        let (request, op) = FrameHeader::decode(request).unwrap();
        assert_eq!(op, FrameOp::Read);
        assert_eq!((request.flags & FLAG_CHECKSUM, request.status), (FLAG_CHECKSUM, 0), "READ {index} asks for it");
        let (payload, sum) = replies[index];
        let mut data = FrameHeader::new(FrameOp::ReadData, 5, 7, request.region, request.offset, 4);
        (data.flags, data.status) = (FLAG_CHECKSUM, sum as i32);
        server.write_all(data.as_bytes()).unwrap();
        server.write_all(payload).unwrap();
    }
    let mut finished = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while finished.is_empty() {
        connection.receive(&peer, &mut finished).unwrap();
        assert!(Instant::now() < deadline, "no reply read");
    }
    assert_eq!(finished.len(), 1);
    (finished.pop().unwrap(), memory)
}

fn crc(bytes: &[u8]) -> u32 {
    // SAFETY: a live slice.
    unsafe { crate::transport::checksum::crc32c_host(bytes.as_ptr(), bytes.len()) }
}

/// A checksummed READ asks for each block's CRC32C and checks the bytes
/// that landed against the one its reply carries: all three agree, the
/// chunk is done; block 1's bytes differ from what its CRC32C says (wrong
/// bytes, or a wrong CRC32C), the chunk fails `Corrupt` naming block 1,
/// and only block 0 counts as moved.
#[test]
fn a_checksummed_read_fails_corrupt_naming_the_block_whose_bytes_do_not_match_the_crc_sent() {
    let blocks = [b"abcd", b"efgh", b"ijkl"];
    let (end, memory) = checksummed_read(blocks.map(|b| (b, crc(b))));
    assert!(matches!(end, (1, Ok(12))), "{end:?}");
    assert_eq!(&memory, b"abcdefghijkl");

    for wrong in [(b"efgX", crc(b"efgh")), (b"efgh", crc(b"efgh") ^ 1)] {
        let (end, _) = checksummed_read([(blocks[0], crc(blocks[0])), wrong, (blocks[2], crc(blocks[2]))]);
        let (ticket, Err((Error::Corrupt { desc_index, detail }, moved))) = end else { panic!("{end:?}") };
        assert_eq!((ticket, desc_index, moved), (1, 1, 4), "{detail}");
        assert!(detail.contains("once read over tcp"), "{detail}");
    }
    // A CRC32C that reads as the session's refusal code is a CRC32C.
    let unauthorized = -(ErrorCode::Unauthorized as i32) as u32;
    let (end, _) =
        checksummed_read([(blocks[0], unauthorized), (blocks[1], crc(blocks[1])), (blocks[2], crc(blocks[2]))]);
    assert!(matches!(end, (1, Err((Error::Corrupt { desc_index: 0, .. }, 0)))), "{end:?}");
}

/// The target must answer a checksummed READ with a CRC32C and an
/// unchecked one without: otherwise it is out of step and the connection
/// goes; a checksummed READ it cannot checksum (GPU memory) is refused
/// `Unsupported`, naming why.
#[test]
fn a_read_answered_against_its_checksum_flag_kills_the_connection_and_a_refusal_is_named() {
    for (checksum, flags, status, expected) in [
        (true, 0, 0, "without its CRC32C"),
        (false, FLAG_CHECKSUM, 7, "asked for none"),
        (true, 0, -(ErrorCode::Unsupported as i32), "cannot checksum"),
    ] {
        let (mut connection, mut server, peer) = pair();
        let mut memory = vec![0u8; 4];
        let blocks = [Block { checksum, ..block(&mut memory, 0) }];
        // SAFETY: `memory` outlives the connection and nothing else touches it.
        unsafe { connection.queue_chunk(&peer, Opcode::Read, 7, 1, &blocks) };
        let len = if status < 0 { 0 } else { 4 };
        let mut data = FrameHeader::new(FrameOp::ReadData, 5, 7, 1 << 16, 0, len);
        (data.flags, data.status) = (flags, status);
        server.write_all(data.as_bytes()).unwrap();
        server.write_all(&b"abcd"[..len as usize]).unwrap();
        let mut finished = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        let error = loop {
            match connection.progress(&peer, Duration::from_secs(5), &mut finished) {
                Err(reason) => break reason.to_string(),
                Ok(_) if !finished.is_empty() => {
                    let (_, Err((error @ Error::Unsupported { .. }, 0))) = &finished[0] else { panic!("{finished:?}") };
                    break error.to_string();
                }
                Ok(_) => assert!(Instant::now() < deadline, "no reply read"),
            }
        };
        assert!(error.contains(expected), "{error}");
        assert_eq!(memory, [0; 4], "nothing landed");
    }
}

/// A READ_DATA failure is its span's only when it names the span's region
/// and offset, as a payload must: one naming another block kills the
/// connection (the target is out of step), and one that echoes it fails
/// the chunk with the target's code.
#[test]
fn a_read_failure_naming_another_block_kills_the_connection() {
    for (region, offset, elsewhere) in [(1 << 16, 0, false), (1 << 16, 8, true), (2 << 16, 0, true)] {
        let (mut connection, mut server, peer) = pair();
        let mut memory = vec![0u8; 4];
        // SAFETY: `memory` outlives the connection and nothing else touches it.
        unsafe { connection.queue_chunk(&peer, Opcode::Read, 7, 1, &[block(&mut memory, 0)]) };
        let mut data = FrameHeader::new(FrameOp::ReadData, 5, 7, region, offset, 0);
        data.status = -(ErrorCode::OutOfBounds as i32);
        server.write_all(data.as_bytes()).unwrap();
        let mut finished = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        let outcome = loop {
            match connection.progress(&peer, Duration::from_secs(5), &mut finished) {
                Err(reason) => break Err(reason.to_string()),
                Ok(_) if !finished.is_empty() => break Ok(finished.remove(0)),
                Ok(_) => assert!(Instant::now() < deadline, "no reply read"),
            }
        };
        match (elsewhere, outcome) {
            (true, Err(reason)) => assert!(reason.contains("for a read of region"), "{reason}"),
            (false, Ok((1, Err((Error::Remote { code: ErrorCode::OutOfBounds, .. }, 0))))) => {}
            (elsewhere, outcome) => panic!("naming another block: {elsewhere}; got {outcome:?}"),
        }
    }
}
