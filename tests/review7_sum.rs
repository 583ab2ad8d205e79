//! Review 7, hostile: checksummed tcp READs (and WRITEs) against a target
//! whose data path lies, and the KV layout cached per segment handle.
//!
//! The lying target is a tap between the initiator and a real target: it
//! forwards the hellos and every frame, and rewrites the target's READ_DATA
//! replies (or the initiator's WRITE payloads) as each probe says. It holds
//! no token, so it can rewrite anything a proven peer could send. What must
//! hold: a checksummed READ is reported done only with every byte verified
//! where it landed; an out-of-step reply is a failure, never a success.

mod common;

use common::{builder, WAIT};
use kvring::kv::{CacheShape, KvLayout};
use kvring::testing::tcp::{ClientHello, FrameHeader, FrameOp, ServerHello, FRAME_HEADER_BYTES, SERVER_HELLO_BYTES};
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, Region, RegionInfo, Segment, TransportKind};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use zerocopy::{FromBytes, IntoBytes};

/// `FLAG_CHECKSUM` as the wire defines it (src/transport/tcp/frame.rs).
const FLAG_CHECKSUM: u8 = 4;
const BLOCK: u64 = 64 << 10;
const BLOCKS: u64 = 2;
const LEN: usize = (BLOCK * BLOCKS) as usize;

/// What the tap does to the traffic.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// Forward everything unchanged.
    Pass,
    /// A checksummed READ_DATA's status replaced by this failure code, its
    /// flag kept: a value that is both a failure code and a CRC.
    FailureCodeAsCrc(i32),
    /// The flag and a CRC put on an unchecked READ's answers.
    AddCrc,
    /// The flag and CRC taken off a checksummed READ's answers.
    DropCrc,
    /// Block 1's answer (its own bytes and CRC, true to each other) sent
    /// before block 0's: each reply names its region and offset.
    SwapReplies,
    /// Each READ_DATA 4 bytes longer (header and payload).
    Longer,
    /// Each READ_DATA 4 bytes shorter.
    Shorter,
    /// Each READ_DATA's payload trickled in 1000-byte writes.
    Trickle,
    /// As `Trickle`, with one payload byte flipped (the CRC kept).
    TrickleFlipped,
    /// The target's hello rewritten to say data version 4 (before
    /// checksummed READs).
    OldVersion,
    /// One byte of the first WRITE's payload flipped on its way.
    FlipWrite,
    /// The first payload byte of the n-th READ_DATA (from 0) flipped, its
    /// CRC kept.
    FlipReadFrame(usize),
}

fn read_header(s: &mut TcpStream) -> Option<FrameHeader> {
    let mut head = [0u8; FRAME_HEADER_BYTES];
    s.read_exact(&mut head).ok()?;
    FrameHeader::read_from_bytes(&head).ok()
}

fn send(s: &mut TcpStream, header: &FrameHeader, payload: &[u8]) {
    let _ = s.write_all(header.as_bytes()).and_then(|()| s.write_all(payload));
}

fn trickle(s: &mut TcpStream, header: &FrameHeader, payload: &[u8]) {
    let _ = s.write_all(header.as_bytes());
    for piece in payload.chunks(1000) {
        let _ = s.write_all(piece).and_then(|()| s.flush());
        std::thread::sleep(std::time::Duration::from_micros(300));
    }
}

/// The initiator's frames to the target: forwarded, the first WRITE's
/// payload flipped under `FlipWrite`.
fn forward_requests(mut client: TcpStream, mut server: TcpStream, mode: Mode) {
    let mut flipped = false;
    while let Some(header) = read_header(&mut client) {
        let carries = header.opcode == FrameOp::Write as u8 || header.opcode == FrameOp::Notify as u8;
        let mut payload = vec![0u8; if carries { header.len as usize } else { 0 }];
        if client.read_exact(&mut payload).is_err() {
            break;
        }
        if mode == Mode::FlipWrite && header.opcode == FrameOp::Write as u8 && !payload.is_empty() && !flipped {
            payload[0] ^= 0x5a;
            flipped = true;
        }
        send(&mut server, &header, &payload);
    }
    let _ = server.shutdown(std::net::Shutdown::Both);
}

/// The target's replies to the initiator, rewritten as `mode` says.
fn forward_replies(mut server: TcpStream, mut client: TcpStream, mode: Mode) {
    let mut held: Option<(FrameHeader, Vec<u8>)> = None;
    let mut answers = 0;
    while let Some(mut header) = read_header(&mut server) {
        let data = header.opcode == FrameOp::ReadData as u8;
        let carries = data && (header.status == 0 || header.flags & FLAG_CHECKSUM != 0);
        let mut payload = vec![0u8; if carries { header.len as usize } else { 0 }];
        if server.read_exact(&mut payload).is_err() {
            break;
        }
        if !data {
            send(&mut client, &header, &payload);
            continue;
        }
        answers += 1;
        match mode {
            Mode::FlipReadFrame(n) if n + 1 == answers && !payload.is_empty() => payload[0] ^= 1,
            Mode::FailureCodeAsCrc(code) => header.status = code,
            Mode::AddCrc => (header.flags, header.status) = (header.flags | FLAG_CHECKSUM, 0x1234_5678),
            Mode::DropCrc => (header.flags, header.status) = (header.flags & !FLAG_CHECKSUM, 0),
            Mode::Longer => {
                header.len += 4;
                payload.extend_from_slice(&[0xab; 4]);
            }
            Mode::Shorter => {
                header.len -= 4;
                payload.truncate(payload.len() - 4);
            }
            Mode::TrickleFlipped => {
                let middle = payload.len() / 2;
                payload[middle] ^= 1;
            }
            Mode::SwapReplies if held.is_none() => {
                held = Some((header, payload));
                continue;
            }
            _ => {}
        }
        if matches!(mode, Mode::Trickle | Mode::TrickleFlipped) {
            trickle(&mut client, &header, &payload);
        } else {
            send(&mut client, &header, &payload);
        }
        if let Some((first, bytes)) = held.take() {
            send(&mut client, &first, &bytes);
        }
    }
    let _ = client.shutdown(std::net::Shutdown::Both);
}

/// One data connection through the tap: the hellos (no token: no proof),
/// then both directions.
fn carry(mut client: TcpStream, real: &str, mode: Mode) {
    let Ok(mut server) = TcpStream::connect(real) else { return };
    let mut hello = vec![0u8; std::mem::size_of::<ClientHello>()];
    if client.read_exact(&mut hello).is_err() || server.write_all(&hello).is_err() {
        return;
    }
    let mut answer = [0u8; SERVER_HELLO_BYTES];
    if server.read_exact(&mut answer).is_err() {
        return;
    }
    if mode == Mode::OldVersion {
        let mut old = ServerHello::read_from_bytes(&answer).unwrap();
        old.version = 4;
        answer.copy_from_slice(old.as_bytes());
    }
    if client.write_all(&answer).is_err() {
        return;
    }
    let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
    std::thread::spawn(move || forward_requests(c2, s2, mode));
    forward_replies(server, client, mode);
}

/// A tap in front of `target`'s tcp data listener; returns its address.
fn tap(target: &Engine, mode: Mode) -> String {
    let real = kvring::testing::descriptor(target).tcp_addr.unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for client in listener.incoming().take(16) {
            let Ok(client) = client else { return };
            let real = real.clone();
            std::thread::spawn(move || carry(client, &real, mode));
        }
    });
    addr
}

struct Tapped {
    initiator: Engine,
    local: Region,
    segment: Segment,
    remote: Region,
    _target: Engine,
}

/// An initiator whose segment names `target`'s descriptor with the tap as
/// its tcp endpoint (as a metadata entry or a relay would hand it over).
fn tapped(name: &str, mode: Mode) -> Tapped {
    tapped_len(name, mode, LEN)
}

fn tapped_len(name: &str, mode: Mode, len: usize) -> Tapped {
    let target = common::engine(&format!("{name}-target"));
    let remote = target.alloc_region(len, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { remote.fill_pattern(41) };
    let mut descriptor = kvring::testing::descriptor(&target);
    descriptor.tcp_addr = Some(tap(&target, mode));
    let addr = common::raw::fake_peer(descriptor.to_proto());
    let initiator = builder(&format!("{name}-init")).lanes(1).build().unwrap();
    let local = initiator.alloc_region(len, RegionInfo::raw()).unwrap();
    let segment = initiator.open_segment_with(&addr, Some(TransportKind::Tcp), WAIT).unwrap();
    Tapped { initiator, local, segment, remote, _target: target }
}

impl Tapped {
    fn descs(&self) -> Vec<BlockDesc> {
        (0..BLOCKS).map(|i| BlockDesc::new(self.local.id(), i * BLOCK, self.remote.id(), i * BLOCK, BLOCK)).collect()
    }

    fn run(&self, write: bool, checksum: bool) -> Outcome {
        self.run_descs(&self.descs(), write, checksum)
    }

    fn run_descs(&self, descs: &[BlockDesc], write: bool, checksum: bool) -> Outcome {
        let batch = if write { Batch::write(&self.segment) } else { Batch::read(&self.segment) };
        let mut sub = self.initiator.submitter().unwrap();
        let id = sub.submit(&batch.descs(descs).checksum(checksum).deadline(WAIT)).unwrap();
        sub.wait(id, WAIT).unwrap()
    }

    fn landed(&self) -> Vec<u8> {
        common::read(&self.local, 0, LEN)
    }
}

fn failed(outcome: Outcome) -> Error {
    match outcome {
        Outcome::Failed(error) => error,
        other => panic!("a lying target's READ was reported {other:?}"),
    }
}

#[test]
fn through_an_honest_tap_a_checksummed_read_is_done_with_the_target_s_bytes() {
    let t = tapped("r7-pass", Mode::Pass);
    assert!(t.run(false, true).is_done());
    assert!(t.landed() == common::pattern(LEN, 41));
}

/// A checksummed READ_DATA whose status is a failure code with the flag
/// kept: it is a CRC (the flag says so), which the bytes do not have.
#[test]
fn a_status_that_is_both_a_failure_code_and_a_crc_fails_corrupt_never_done() {
    for code in [-(kvring::ErrorCode::OutOfBounds as i32), -(kvring::ErrorCode::Unauthorized as i32)] {
        let t = tapped("r7-both", Mode::FailureCodeAsCrc(code));
        let error = failed(t.run(false, true));
        assert!(matches!(error, Error::Corrupt { desc_index: 0, .. }), "code {code}: {error:?}");
    }
}

#[test]
fn a_crc_on_an_unchecked_read_is_out_of_step_and_never_done() {
    let t = tapped("r7-add", Mode::AddCrc);
    let error = failed(t.run(false, false));
    assert!(error.to_string().contains("CRC32C for a read that asked for none"), "{error}");
}

#[test]
fn a_checksummed_read_answered_without_its_crc_is_never_done_unverified() {
    let t = tapped("r7-drop", Mode::DropCrc);
    let error = failed(t.run(false, true));
    assert!(error.to_string().contains("without its CRC32C"), "{error}");
}

/// Each block's bytes arrive with their own, true CRC, but in the other
/// block's place: verified bytes in the wrong place are not done.
#[test]
fn replies_for_the_wrong_block_are_out_of_step_even_with_true_crcs() {
    for checksum in [true, false] {
        let t = tapped("r7-swap", Mode::SwapReplies);
        let outcome = t.run(false, checksum);
        let landed = t.landed();
        assert!(
            !outcome.is_done(),
            "checksum {checksum}: done with blocks swapped (block 0 right: {})",
            landed[..BLOCK as usize] == common::pattern(LEN, 41)[..BLOCK as usize]
        );
        let error = failed(outcome);
        assert!(error.to_string().contains("for a read of region"), "{error}");
    }
}

#[test]
fn a_read_data_longer_or_shorter_than_asked_is_never_done() {
    for mode in [Mode::Longer, Mode::Shorter] {
        let t = tapped("r7-len", mode);
        let error = failed(t.run(false, true));
        assert!(error.to_string().contains("-byte read"), "{mode:?}: {error}");
    }
}

/// The CRC covers the frame's payload however the socket splits it.
#[test]
fn a_payload_split_across_many_reads_is_verified_whole() {
    let t = tapped("r7-trickle", Mode::Trickle);
    assert!(t.run(false, true).is_done());
    assert!(t.landed() == common::pattern(LEN, 41));
    let t = tapped("r7-trickle-bad", Mode::TrickleFlipped);
    let error = failed(t.run(false, true));
    assert!(matches!(error, Error::Corrupt { desc_index: 0, .. }), "{error:?}");
}

/// A block larger than a frame is read in several READ_DATA frames, each
/// with its own CRC32C: a flipped byte in any of them fails that block,
/// and an honest read of it is done with every byte.
#[test]
fn a_block_split_across_frames_is_verified_frame_by_frame() {
    const BIG: u64 = (5 << 20) / 2; // 2.5 MiB: three frames of at most 1 MiB
    let len = (BLOCK + BIG) as usize;
    let descs = |t: &Tapped| {
        [
            BlockDesc::new(t.local.id(), 0, t.remote.id(), 0, BLOCK),
            BlockDesc::new(t.local.id(), BLOCK, t.remote.id(), BLOCK, BIG),
        ]
    };
    let t = tapped_len("r7-big", Mode::Pass, len);
    assert!(t.run_descs(&descs(&t), false, true).is_done());
    assert!(common::read(&t.local, 0, len) == common::pattern(len, 41));
    // Answers: block 0, then block 1's three frames; flip its last one.
    let t = tapped_len("r7-big-bad", Mode::FlipReadFrame(3), len);
    let error = failed(t.run_descs(&descs(&t), false, true));
    assert!(matches!(error, Error::Corrupt { desc_index: 1, .. }), "{error:?}");
}

/// A peer of data version 4 (which would have ignored the flag) is refused
/// by version before any frame.
#[test]
fn an_older_version_peer_is_refused_before_any_frame() {
    let target = common::engine("r7-old-target");
    let mut descriptor = kvring::testing::descriptor(&target);
    descriptor.tcp_addr = Some(tap(&target, Mode::OldVersion));
    let addr = common::raw::fake_peer(descriptor.to_proto());
    let initiator = builder("r7-old-init").lanes(1).build().unwrap();
    let outcome = initiator.open_segment_with(&addr, Some(TransportKind::Tcp), WAIT).map(|segment| {
        let remote = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
        let local = initiator.alloc_region(LEN, RegionInfo::raw()).unwrap();
        let descs = [BlockDesc::new(local.id(), 0, remote.id(), 0, BLOCK)];
        let mut sub = initiator.submitter().unwrap();
        let id = sub.submit(&Batch::read(&segment).descs(&descs).checksum(true).deadline(WAIT)).unwrap();
        sub.wait(id, WAIT).unwrap()
    });
    let error = match outcome {
        Err(error) | Ok(Outcome::Failed(error)) => error,
        Ok(other) => panic!("an old peer's READ was reported {other:?}"),
    };
    assert!(error.to_string().contains("version"), "{error}");
}

/// WRITE checksums still hold: a payload changed on the path fails the
/// block it belongs to, and an unchecked WRITE's change goes unnoticed (so
/// the probe does change the bytes).
#[test]
fn a_checksummed_write_changed_on_the_path_fails_corrupt() {
    let t = tapped("r7-write", Mode::FlipWrite);
    let error = failed(t.run(true, true));
    assert!(matches!(error, Error::Corrupt { desc_index: 0, .. }), "{error:?}");
    let t = tapped("r7-write-plain", Mode::FlipWrite);
    assert!(t.run(true, false).is_done(), "without the checksum the flip is not seen");
}

// --- B: the KV layout cached per segment handle ---

fn shape(blocks: u64) -> CacheShape {
    CacheShape::mha(4, blocks, 2, 64, 2, 4, 1).unwrap()
}

/// Two threads publish different layouts at once: exactly one wins, the
/// other is `LayoutFixed`, and the winner is what is served.
#[test]
fn racing_publishers_publish_exactly_one_layout() {
    for round in 0..8 {
        let engine = std::sync::Arc::new(builder(&format!("r7-race-{round}")).build().unwrap());
        let region = engine.alloc_region(shape(16).bytes().unwrap() as usize, RegionInfo::raw()).unwrap();
        let layouts = [shape(8), shape(16)].map(|s| KvLayout::contiguous(s, region.id(), 0).unwrap());
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let results: Vec<_> = layouts
            .iter()
            .cloned()
            .map(|layout| {
                let (engine, barrier) = (engine.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    engine.set_kv_layout(layout)
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        let wins: Vec<usize> = (0..2).filter(|&i| results[i].is_ok()).collect();
        assert_eq!(wins.len(), 1, "{results:?}");
        let lost = &results[1 - wins[0]];
        assert!(matches!(lost, Err(Error::LayoutFixed { .. })), "{lost:?}");
        assert_eq!(engine.kv_layout().as_ref(), Some(&layouts[wins[0]]));
    }
}

/// The target tries to unregister the region its published layout names
/// (to register another under the same shape): the layout is fixed for the
/// engine's life and peers compute pushes from their cached copy, so the
/// unregister is refused with an error saying why, and a push from a
/// handle's cached layout still lands where that layout says. (Before the
/// refusal, the layout outlived its region and every peer's push failed
/// `UnknownRegion` until the engine restarted: safe, but a trap.)
#[test]
fn unregistering_a_region_the_published_layout_names_is_refused_and_cached_pushes_still_land() {
    for transport in [TransportKind::Tcp, TransportKind::Shm, TransportKind::Cma] {
        let prefill = builder(&format!("r7-pf-{}", transport.name())).build().unwrap();
        let decode = builder(&format!("r7-dc-{}", transport.name())).build().unwrap();
        let bytes = shape(8).bytes().unwrap() as usize;
        let p_region = prefill.alloc_region(bytes, RegionInfo::raw()).unwrap();
        // SAFETY: nothing touches these bytes during the fill.
        unsafe { p_region.fill_pattern(3) };
        let p_layout = KvLayout::contiguous(shape(8), p_region.id(), 0).unwrap();
        prefill.set_kv_layout(p_layout.clone()).unwrap();
        let held = decode.alloc_region(bytes, RegionInfo::raw()).unwrap();
        let d_layout = KvLayout::contiguous(shape(8), held.id(), 0).unwrap();
        decode.set_kv_layout(d_layout.clone()).unwrap();
        let spare = decode.alloc_region(4096, RegionInfo::raw()).unwrap();
        let segment = prefill.open_segment_with(&decode.control_addr().to_string(), Some(transport), WAIT).unwrap();
        let cached = segment.kv_layout(WAIT).unwrap();
        let refused = decode.unregister(held.id()).unwrap_err();
        assert!(
            matches!(refused, Error::InvalidArgument { .. }) && refused.to_string().contains("KV layout"),
            "{}: {refused:?}",
            transport.name()
        );
        decode.unregister(spare.id()).expect("a region the layout does not name unregisters");
        let mut sub = prefill.submitter().unwrap();
        let id = sub.push_layer(&segment, &p_layout, &cached, 0, &[1, 2], &[3, 4]).unwrap();
        sub.wait(id, WAIT).unwrap().into_result().unwrap();
        let src = p_layout.layer(0).unwrap()[0];
        let dst = d_layout.layer(0).unwrap()[0];
        let source = common::pattern(bytes, 3);
        let at = (src.offset + src.block_bytes) as usize;
        let got = common::read(&held, dst.offset + 3 * dst.block_bytes, src.block_bytes as usize);
        assert_eq!(got, source[at..at + src.block_bytes as usize], "{}: the cached layout's push", transport.name());
    }
}

/// A peer restarted on the same address: a handle whose cached layout is
/// still served (the restart not yet seen) cannot push with it into the new
/// peer: the data path's epoch refuses it.
#[test]
fn a_cached_layout_is_never_pushed_into_a_restarted_peer() {
    let prefill = builder("r7-rs-pf").build().unwrap();
    let bytes = shape(8).bytes().unwrap() as usize;
    let p_region = prefill.alloc_region(bytes, RegionInfo::raw()).unwrap();
    let p_layout = KvLayout::contiguous(shape(8), p_region.id(), 0).unwrap();
    prefill.set_kv_layout(p_layout.clone()).unwrap();
    let decode = builder("r7-rs-dc").build().unwrap();
    let region = decode.alloc_region(bytes, RegionInfo::raw()).unwrap();
    decode.set_kv_layout(KvLayout::contiguous(shape(8), region.id(), 0).unwrap()).unwrap();
    let addr = decode.control_addr();
    let segment = prefill.open_segment_with(&addr.to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let cached = segment.kv_layout(WAIT).unwrap();
    drop(region);
    drop(decode);
    // Same address, same first region id (a fresh registry), same layout.
    let decode = builder("r7-rs-dc").listen(addr).build().unwrap();
    let region = decode.alloc_region(bytes, RegionInfo::raw()).unwrap();
    decode.set_kv_layout(KvLayout::contiguous(shape(8), region.id(), 0).unwrap()).unwrap();
    let mut sub = prefill.submitter().unwrap();
    let id = sub.push_layer(&segment, &p_layout, &cached, 0, &[1], &[1]).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(!outcome.is_done(), "a push by the old handle landed in the restarted peer");
    assert!(common::read(&region, 0, bytes).iter().all(|&b| b == 0), "nothing landed in the new peer");
    assert!(matches!(segment.kv_layout(WAIT), Err(Error::PeerRestarted { .. })));
}

/// On a tokened session the CRC32C rides in the sealed header: the honest
/// checksummed READ is done, with the target's bytes.
#[test]
fn a_tokened_checksummed_read_is_done_with_the_target_s_bytes() {
    const TOKEN: &[u8] = b"review7-sum-token";
    let target = builder("r7-tok-target").token(TOKEN).build().unwrap();
    let remote = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { remote.fill_pattern(43) };
    let initiator = builder("r7-tok-init").token(TOKEN).build().unwrap();
    let local = initiator.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let descs: Vec<BlockDesc> =
        (0..BLOCKS).map(|i| BlockDesc::new(local.id(), i * BLOCK, remote.id(), i * BLOCK, BLOCK)).collect();
    let mut sub = initiator.submitter().unwrap();
    let id = sub.submit(&Batch::read(&segment).descs(&descs).checksum(true).deadline(WAIT)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    assert!(common::read(&local, 0, LEN) == common::pattern(LEN, 43));
}

/// A tokened handle opened before its peer published a layout: the first
/// fetch is refused and not kept; once published it is fetched (through
/// the token's handshake) and kept.
#[test]
fn a_tokened_handle_opened_before_the_layout_fetches_it_once_published() {
    const TOKEN: &[u8] = b"review7-layout-token";
    let target = builder("r7-late-target").token(TOKEN).build().unwrap();
    let region = target.alloc_region(shape(8).bytes().unwrap() as usize, RegionInfo::raw()).unwrap();
    let initiator = builder("r7-late-init").token(TOKEN).build().unwrap();
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    assert!(segment.kv_layout(WAIT).is_err(), "no layout yet");
    let layout = KvLayout::contiguous(shape(8), region.id(), 0).unwrap();
    target.set_kv_layout(layout.clone()).unwrap();
    assert_eq!(segment.kv_layout(WAIT).unwrap(), layout);
    assert_eq!(segment.kv_layout(WAIT).unwrap(), layout);
    assert_eq!(target.memory_info_served(), 1, "fetched once, then kept");
}
