//! An outside review of 64-bit region ids (issue 27, clause 3): every id a
//! peer or caller can name that a truncation to 32 or 16 bits would turn
//! into a live region's (its slot past 65,535, its generation moved by
//! 2^16, its generation zero, the old 32-bit layout `generation << 16 |
//! slot` read as 64 bits), and the edges (an index of 65,535, 65,536 and
//! `u32::MAX`, halves of zero and all ones), sent the ways a peer sends
//! them: raw tcp WRITE and READ frames, checksum requests on the control
//! connection, and batches over shm, cma and tcp. Each is refused with a
//! typed error, lands nothing, and leaves the target serving. Then the
//! frame length cut to 32 bits (lengths near 2^32, an offset whose end
//! wraps), old-version peers (data hello 3, frame version 2, control 3),
//! and the C types' layout against the Rust descriptor.

mod common;

use common::{raw, WAIT};
use kvring::testing::control::{preface, read_frame, request, response, write_frame, ChecksumRequest, Response};
use kvring::testing::tcp::{
    ClientHello, FrameHeader, FrameOp, ServerHello, FLAG_LAST, FRAME_HEADER_BYTES, MAX_FRAME_PAYLOAD_BYTES,
    SERVER_HELLO_BYTES,
};
use kvring::{Batch, BlockDesc, Engine, Error, ErrorCode, Outcome, RegionId, RegionInfo, TransportKind};
use std::io::{Read, Write};
use std::time::Instant;
use zerocopy::{FromBytes, IntoBytes};

const LEN: usize = 64 << 10;

/// Ids that name no region on a target whose one live region is `real`,
/// each one a truncation of some width would confuse with `real`, or an
/// edge of the id space.
fn aliases(real: RegionId) -> Vec<(RegionId, &'static str)> {
    let (index, generation) = (real.index(), real.generation());
    vec![
        (RegionId::new(index + (1 << 16), generation), "slot + 2^16 (a 16-bit slot)"),
        (RegionId::new(index, generation.wrapping_add(1 << 16)), "generation + 2^16 (a 16-bit generation)"),
        (RegionId::new(index, generation ^ (1 << 31)), "generation's top bit flipped"),
        (RegionId::new(index, 0), "generation zero (the id cut to its low 32 bits)"),
        (
            RegionId::from_raw((u64::from(generation) << 16) | u64::from(index)),
            "the old 32-bit layout, gen << 16 | slot",
        ),
        (RegionId::from_raw(real.raw() << 32), "the halves swapped's low half zero"),
        (RegionId::new(generation, index), "the halves swapped"),
        (RegionId::new(u16::MAX.into(), 1), "slot 65,535"),
        (RegionId::new(1 << 16, 1), "slot 65,536"),
        (RegionId::new(u32::MAX, generation), "slot u32::MAX"),
        (RegionId::new(u32::MAX, u32::MAX), "all ones"),
        (RegionId::new(index, u32::MAX), "generation u32::MAX"),
        (RegionId::from_raw(0), "zero"),
    ]
}

fn target_with_region(name: &str) -> (Engine, RegionId, Vec<u8>) {
    let target = common::engine(name);
    let mut memory = vec![0u8; LEN];
    // SAFETY: `memory`'s heap buffer does not move with the Vec, and every
    // caller drops the engine explicitly before `memory`.
    let id = unsafe { target.register(memory.as_mut_ptr(), memory.len(), RegionInfo::raw()) }.unwrap();
    (target, id, memory)
}

fn read_header(s: &mut std::net::TcpStream) -> FrameHeader {
    let mut bytes = [0u8; FRAME_HEADER_BYTES];
    s.read_exact(&mut bytes).unwrap();
    FrameHeader::read_from_bytes(&bytes).unwrap()
}

fn write_frame_raw(s: &mut std::net::TcpStream, epoch: u64, region: u64, offset: u64, payload: &[u8]) -> i32 {
    let mut header = FrameHeader::new(FrameOp::Write, epoch, 9, region, offset, payload.len() as u64);
    header.flags = FLAG_LAST;
    s.write_all(header.as_bytes()).unwrap();
    s.write_all(payload).unwrap();
    let ack = read_header(s);
    assert_eq!(ack.opcode, FrameOp::Ack as u8);
    ack.status
}

/// True once the target has closed `s` (EOF or reset), without a frame.
fn closed(s: &mut std::net::TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(s.read(&mut byte), Ok(0) | Err(_))
}

/// No refused frame left a lease behind: `real` unregisters once the
/// target has seen its connections close (bounded by [`WAIT`]).
fn unregisters_once_idle(target: &Engine, real: RegionId) {
    let deadline = Instant::now() + WAIT;
    loop {
        match target.unregister(real) {
            Ok(_) => return,
            Err(Error::RegionBusy { .. }) if Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(5))
            }
            Err(error) => panic!("{real} did not unregister: {error} (a lease leaked?)"),
        }
    }
}

#[test]
fn raw_tcp_frames_naming_truncated_or_edge_ids_are_refused_and_land_nothing() {
    let (target, real, memory) = target_with_region("review6-frames");
    let epoch = kvring::testing::descriptor(&target).epoch;
    let mut s = raw::data_connection(&target);
    let unknown = -(ErrorCode::UnknownRegion as i32);
    for (alias, what) in aliases(real) {
        let status = write_frame_raw(&mut s, epoch, alias.raw(), 0, &[0xa5; 16]);
        assert_eq!(status, unknown, "WRITE naming {alias} ({what}) must be refused UnknownRegion");
        let header = FrameHeader::new(FrameOp::Read, epoch, 10, alias.raw(), 0, 16);
        s.write_all(header.as_bytes()).unwrap();
        let answer = read_header(&mut s);
        assert_eq!(answer.opcode, FrameOp::ReadData as u8, "{what}");
        assert_eq!((answer.status, answer.len), (unknown, 0), "READ naming {alias} ({what}): refused, no payload");
    }
    assert!(memory.iter().all(|&b| b == 0), "no refused WRITE landed a byte");
    // The connection is still served, and the real id still works on it.
    assert_eq!(write_frame_raw(&mut s, epoch, real.raw(), 8, &[7; 16]), 0);
    drop(s);
    unregisters_once_idle(&target, real);
    drop(target);
    assert_eq!(&memory[8..24], &[7; 16]);
    assert!(memory[..8].iter().chain(&memory[24..]).all(|&b| b == 0));
}

#[test]
fn frame_lengths_near_two_to_the_32_and_wrapping_ends_are_refused() {
    let (target, real, memory) = target_with_region("review6-lengths");
    let epoch = kvring::testing::descriptor(&target).epoch;
    // The saturation in FrameHeader::new never yields a header that decodes
    // with a length other than the one asked for: past 32 bits it is refused.
    for asked in [1u64 << 32, (1 << 32) + 16, u64::MAX] {
        let header = FrameHeader::new(FrameOp::Write, epoch, 1, real.raw(), 0, asked);
        assert!(FrameHeader::decode(header.as_bytes()).is_err(), "a header asked for {asked} bytes decodes");
    }
    // Crafted headers: lengths past the frame limit (up to 2^32 - 1) and an
    // end past 2^64. Each is refused (the connection closed, or a failed
    // ack), nothing lands, and the target serves the next connection.
    let cases: [(u64, u32); 4] =
        [(0, u32::MAX), (0, MAX_FRAME_PAYLOAD_BYTES as u32 + 1), (u64::MAX - 7, 16), (LEN as u64 - 8, 16)];
    for (offset, len) in cases {
        let mut s = raw::data_connection(&target);
        let mut header = FrameHeader::new(FrameOp::Write, epoch, 3, real.raw(), offset, 0);
        header.len = len;
        header.flags = FLAG_LAST;
        s.write_all(header.as_bytes()).unwrap();
        let _ = s.write_all(&[0x5a; 16]);
        let mut bytes = [0u8; FRAME_HEADER_BYTES];
        // Closed at once (an error here) is a refusal too.
        if s.read_exact(&mut bytes).is_ok() {
            let ack = FrameHeader::read_from_bytes(&bytes).unwrap();
            assert!(ack.status < 0, "offset {offset} len {len}: acked {}", ack.status);
        }
    }
    let mut s = raw::data_connection(&target);
    assert_eq!(write_frame_raw(&mut s, epoch, real.raw(), 0, &[1; 8]), 0, "the target still serves");
    drop(s);
    unregisters_once_idle(&target, real);
    drop(target);
    assert!(memory[8..].iter().all(|&b| b == 0), "no refused frame landed a byte");
}

#[test]
fn old_version_peers_get_typed_refusals_not_misreads() {
    let (target, real, memory) = target_with_region("review6-versions");
    let descriptor = kvring::testing::descriptor(&target);
    let addr = descriptor.tcp_addr.clone().unwrap();
    // A data hello of version 3 (32-bit ids) or 2.
    for version in [3u8, 2] {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut hello = ClientHello::new(descriptor.epoch, [0; 16], [0; 16], [1; 16]);
        hello.version = version;
        s.write_all(hello.as_bytes()).unwrap();
        let mut answer = [0u8; SERVER_HELLO_BYTES];
        s.read_exact(&mut answer).unwrap();
        let answer = ServerHello::read_from_bytes(&answer).unwrap();
        assert_ne!(answer.status, 0, "a version {version} hello is refused");
        assert_eq!(
            answer.status,
            -(ErrorCode::VersionMismatch as i32),
            "a version {version} hello is refused by version, not another reason"
        );
        // Then a frame as that peer would send it: nothing lands.
        let mut header = FrameHeader::new(FrameOp::Write, descriptor.epoch, 1, real.raw(), 0, 8);
        header.flags = FLAG_LAST;
        let _ = s.write_all(header.as_bytes());
        let _ = s.write_all(&[9; 8]);
        assert!(closed(&mut s), "a refused hello's connection carries nothing");
    }
    // A frame of version 2 after a good hello: refused, nothing lands.
    let mut s = raw::data_connection(&target);
    let mut header = FrameHeader::new(FrameOp::Write, descriptor.epoch, 1, real.raw(), 0, 8);
    header.flags = FLAG_LAST;
    header.version = 2;
    s.write_all(header.as_bytes()).unwrap();
    let _ = s.write_all(&[9; 8]);
    let mut bytes = [0u8; FRAME_HEADER_BYTES];
    if s.read_exact(&mut bytes).is_ok() {
        assert!(FrameHeader::read_from_bytes(&bytes).unwrap().status < 0, "a version 2 frame is acked as done");
    }
    // A control connection of version 3: its request is not answered as
    // if its ids were read.
    let mut c = std::net::TcpStream::connect(target.control_addr().to_string()).unwrap();
    c.set_read_timeout(Some(WAIT)).unwrap();
    let mut old = preface();
    old[4..].copy_from_slice(&3u32.to_le_bytes());
    c.write_all(&old).unwrap();
    let mut theirs = [0u8; 8];
    let _ = c.read_exact(&mut theirs);
    let checksum = ChecksumRequest { region: real.raw(), offset: 0, len: 8 };
    let mut message = kvring::testing::control::Request { version: 3, body: Some(request::Body::Checksum(checksum)) };
    let _ = write_frame(&mut c, &message);
    // Closed (no frame, or an error) is a refusal too.
    if let Ok(Some(frame)) = read_frame(&mut c, kvring::testing::control::MAX_CONTROL_MESSAGE_BYTES) {
        use prost::Message;
        let reply = Response::decode(frame.as_slice()).unwrap();
        assert!(
            !matches!(reply.body, Some(response::Body::Checksum(_))),
            "a version 3 control peer's request was answered: {reply:?}"
        );
    }
    // The same request with the v3 version field on a v4 preface.
    let mut c = std::net::TcpStream::connect(target.control_addr().to_string()).unwrap();
    c.set_read_timeout(Some(WAIT)).unwrap();
    c.write_all(&preface()).unwrap();
    c.read_exact(&mut theirs).unwrap();
    message.version = 3;
    write_frame(&mut c, &message).unwrap();
    if let Ok(Some(frame)) = read_frame(&mut c, kvring::testing::control::MAX_CONTROL_MESSAGE_BYTES) {
        use prost::Message;
        let reply = Response::decode(frame.as_slice()).unwrap();
        match reply.body {
            Some(response::Body::Error(error)) => {
                assert_eq!(error.code, ErrorCode::VersionMismatch as i32, "{error:?}")
            }
            other => panic!("a version 3 request must be refused by version, got {other:?}"),
        }
    }
    drop(s);
    drop(c);
    drop(target);
    assert!(memory.iter().all(|&b| b == 0), "no old-version peer landed a byte");
}

#[test]
fn checksum_requests_naming_truncated_or_edge_ids_are_refused() {
    let (target, real, memory) = target_with_region("review6-checksum");
    let deadline = || Instant::now() + WAIT;
    let mut client =
        kvring::testing::control::ControlClient::connect(&target.control_addr().to_string(), deadline()).unwrap();
    for (alias, what) in aliases(real) {
        match client.checksum(alias.raw(), 0, 16, deadline()) {
            Err(Error::Remote { code: ErrorCode::UnknownRegion, .. }) | Err(Error::UnknownRegion { .. }) => {}
            other => panic!("a checksum of {alias} ({what}) must be refused UnknownRegion, got {other:?}"),
        }
    }
    assert_eq!(client.checksum(real.raw(), 0, 16, deadline()).unwrap(), kvring::testing::checksum(&memory[..16]));
    drop(target);
}

fn batches_naming_aliases_fail(transport: TransportKind) {
    let name = transport.name();
    let target = common::engine(&format!("review6-batch-target-{name}"));
    let initiator = common::engine(&format!("review6-batch-initiator-{name}"));
    // shm reaches only regions the target allocated; cma and tcp reach
    // caller memory too: use the target's own region for all three.
    let region = target.alloc_region(LEN, RegionInfo::raw()).unwrap();
    let real = region.id();
    let local = initiator.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches `local` while it is filled.
    unsafe { local.fill_pattern(3) };
    let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
    assert_eq!(segment.transport(), transport);
    let mut sub = initiator.submitter().unwrap();
    let mut submit = |local_id: RegionId, remote: RegionId| -> Outcome {
        let descs = [BlockDesc::new(local_id, 0, remote, 0, 4096)];
        match sub.submit(&Batch::write(&segment).descs(&descs).deadline(WAIT)) {
            Ok(id) => sub.wait(id, WAIT).unwrap(),
            Err(error) => Outcome::Failed(error),
        }
    };
    for (alias, what) in aliases(real) {
        match submit(local.id(), alias) {
            Outcome::Failed(Error::UnknownRegion { region, .. }) => assert_eq!(region, alias, "{name}: {what}"),
            Outcome::Failed(Error::Remote { code: ErrorCode::UnknownRegion, .. }) => {}
            other => panic!("{name}: a write to remote {alias} ({what}) must fail UnknownRegion, got {other:?}"),
        }
    }
    for (alias, what) in aliases(local.id()) {
        match submit(alias, real) {
            Outcome::Failed(Error::UnknownRegion { region, .. }) => assert_eq!(region, alias, "{name}: {what}"),
            other => panic!("{name}: a write from local {alias} ({what}) must fail UnknownRegion, got {other:?}"),
        }
    }
    assert!(common::read(&region, 0, LEN).iter().all(|&b| b == 0), "{name}: nothing landed");
    assert!(matches!(submit(local.id(), real), Outcome::Done { .. }), "{name}: the real ids still move");
}

#[test]
fn batches_naming_truncated_or_edge_ids_fail_over_shm() {
    batches_naming_aliases_fail(TransportKind::Shm);
}

#[test]
fn batches_naming_truncated_or_edge_ids_fail_over_cma() {
    batches_naming_aliases_fail(TransportKind::Cma);
}

#[test]
fn batches_naming_truncated_or_edge_ids_fail_over_tcp() {
    batches_naming_aliases_fail(TransportKind::Tcp);
}

/// The C header's `kvring_block` and `kvring_range` as the compiler lays
/// them out, against the Rust descriptor and the documented 24 bytes.
#[test]
fn c_block_and_range_layouts_match_the_rust_types() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("kvring-review6-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("layout.c");
    std::fs::write(
        &source,
        r#"#include <stddef.h>
#include <stdio.h>
#include "kvring.h"
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu\n", sizeof(kvring_block), offsetof(kvring_block, local_region),
         offsetof(kvring_block, remote_region), offsetof(kvring_block, local_offset),
         offsetof(kvring_block, remote_offset), offsetof(kvring_block, len));
  printf("%zu %zu %zu %zu %zu\n", sizeof(kvring_range), offsetof(kvring_range, region),
         offsetof(kvring_range, offset), offsetof(kvring_range, len), sizeof(((kvring_range *)0)->region));
  printf("%zu\n", sizeof(((kvring_block *)0)->remote_region));
  return 0;
}
"#,
    )
    .unwrap();
    let exe = dir.join("layout");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = std::process::Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Werror", "-I"])
        .arg(root.join("include"))
        .arg(&source)
        .arg("-o")
        .arg(&exe)
        .status()
        .expect("a C compiler");
    assert!(status.success(), "{cc} failed on the layout probe");
    let out = std::process::Command::new(&exe).output().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<Vec<usize>> =
        text.lines().map(|l| l.split_whitespace().map(|n| n.parse().unwrap()).collect()).collect();
    use std::mem::{offset_of, size_of};
    assert_eq!(
        lines[0],
        vec![
            size_of::<BlockDesc>(),
            offset_of!(BlockDesc, local_region),
            offset_of!(BlockDesc, remote_region),
            offset_of!(BlockDesc, local_offset),
            offset_of!(BlockDesc, remote_offset),
            offset_of!(BlockDesc, len),
        ],
        "kvring_block against BlockDesc"
    );
    assert_eq!(lines[0][0], 40);
    assert_eq!(lines[1], vec![24, 0, 8, 16, 8], "kvring_range: a 64-bit region at 0, offset at 8, len at 16");
    assert_eq!(lines[2], vec![8], "a remote region id is 64 bits in C");
}

/// Fences, GRANT frames and arrival tags naming what a truncation would
/// confuse: a fence of an alias id is refused, a GRANT frame whose grant
/// has bits past 32 (its low half an issued grant) is refused, and tagged
/// WRITEs naming alias ids count nothing under a tag granted the real id.
#[test]
fn fences_grants_and_tags_naming_truncated_ids_are_refused() {
    let (target, real, memory) = target_with_region("review6-fences");
    let epoch = kvring::testing::descriptor(&target).epoch;
    for (alias, what) in aliases(real) {
        match target.fence(alias, 0, 16) {
            Err(Error::UnknownRegion { region, .. }) => assert_eq!(region, alias, "{what}"),
            other => panic!("a fence of {alias} ({what}) must fail UnknownRegion, got {other:?}"),
        }
    }
    let issued = target.fence(real, 0, 16).unwrap();
    // A GRANT naming `issued` plus 2^32: its low 32 bits are a real grant.
    let mut s = raw::data_connection(&target);
    let header = FrameHeader::new(FrameOp::Grant, epoch, 1, 0, (1u64 << 32) | u64::from(issued), 0);
    s.write_all(header.as_bytes()).unwrap();
    let mut bytes = [0u8; FRAME_HEADER_BYTES];
    if s.read_exact(&mut bytes).is_ok() {
        assert!(FrameHeader::read_from_bytes(&bytes).unwrap().status < 0, "a grant past 32 bits is taken");
    }
    assert!(closed(&mut s), "a connection that sent a grant past 32 bits is closed");
    // Tags: granted 4 KiB of the real id past the fenced bytes.
    let tag = kvring::kv::arrival_tag(7, 1).unwrap();
    target.grant_arrival(tag, &[(real, 4096, 4096)]).unwrap();
    let mut s = raw::data_connection(&target);
    let unknown = -(ErrorCode::UnknownRegion as i32);
    for (alias, what) in aliases(real) {
        let status = raw::tagged_write(&mut s, epoch, alias, 4096, &[3; 64], tag);
        assert_eq!(status, unknown, "a tagged WRITE naming {alias} ({what})");
    }
    assert_eq!(target.landed(tag), 0, "no alias counted under the real id's grant");
    assert_eq!(raw::tagged_write(&mut s, epoch, real, 4096, &[3; 64], tag), 0);
    assert_eq!(target.landed(tag), 64, "the real id counts");
    drop(s);
    drop(target);
    assert_eq!(&memory[4096..4160], &[3; 64]);
    assert!(memory[..4096].iter().chain(&memory[4160..]).all(|&b| b == 0), "no alias landed a byte");
}

/// The RDMA work-request builder: its requests carry 32-bit lengths, so
/// whatever slice it is given, the lengths it posts add up to the bytes of
/// the blocks (a block past 4 GiB, a slice past 32 bits). Found by reading
/// `post.rs`'s `len as u32`: unreachable through the engine today (every
/// link posts with the default 1 MiB slice), reachable through
/// `PostConfig`, which `kvring::testing` exports.
#[test]
fn rdma_requests_never_truncate_a_length_to_32_bits() {
    use kvring::rdma::WrOp;
    use kvring::testing::rdma::{build, KeyedBlock, Keys, PostConfig};
    struct Flat;
    impl Keys for Flat {
        fn lkey(&self, _nic: usize, _region: u64) -> u32 {
            1
        }
        fn rkey(&self, _nic: usize, _region: u64) -> u32 {
            2
        }
    }
    let len = (5u64 << 30) + 4096;
    let block = KeyedBlock {
        local_addr: 1 << 40,
        remote_addr: 1 << 41,
        len,
        local_region: RegionId::new(1, 1).raw(),
        remote_region: RegionId::new(2, u32::MAX).raw(),
    };
    for slice in [1u64 << 20, u64::from(u32::MAX), 1 << 32, (1 << 32) + 4096, u64::MAX] {
        let mut out = vec![Vec::new()];
        let config = PostConfig { slice_bytes: slice, ..PostConfig::default() };
        build(WrOp::Write, &[block], &config, &Flat, |s| s, &mut out);
        let posted: u64 = out[0].iter().map(|wr| u64::from(wr.len)).sum();
        assert_eq!(posted, len, "slice {slice}: the requests' lengths add up to the block's");
        assert!(out[0].iter().all(|wr| wr.len > 0), "slice {slice}: a zero-length request");
    }
}

/// The GPU descriptor server (`gpu_fds`, request "KVF7"): requests naming
/// truncated or edge ids, or a first handle past 32 bits' worth, are
/// refused with a reason ("KVF4" answer, kind 1), never answered with a
/// descriptor; the real id is answered.
#[test]
fn gpu_fds_requests_naming_truncated_or_edge_ids_are_refused() {
    use kvring::gpu::{Gpu, SimGpu};
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixStream};
    let gpu = std::sync::Arc::new(SimGpu::new(1, std::time::Duration::from_micros(50)));
    let target = common::builder("review6-gpu-fds").gpu(gpu.clone() as std::sync::Arc<dyn Gpu>).build().unwrap();
    let region = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    let real = region.id();
    let name = kvring::testing::descriptor(&target).gpu_fds.expect("a GPU region's engine serves gpu_fds");
    let mut s = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut hello = b"KVF1".to_vec();
    hello.extend_from_slice(&[0u8; 48]);
    s.write_all(&hello).unwrap();
    let mut challenge = [0u8; 56];
    s.read_exact(&mut challenge).unwrap();
    assert_eq!(&challenge[..4], b"KVF2");
    let mut ask = |region: u64, first: u32| -> (u32, Vec<u8>) {
        let mut request = b"KVF7".to_vec();
        request.extend_from_slice(&region.to_le_bytes());
        request.extend_from_slice(&first.to_le_bytes());
        request.extend_from_slice(&1u32.to_le_bytes());
        s.write_all(&request).unwrap();
        let mut answer = [0u8; 16];
        s.read_exact(&mut answer).unwrap();
        assert_eq!(&answer[..4], b"KVF4");
        let word = |at: usize| u32::from_le_bytes(answer[at..at + 4].try_into().unwrap());
        let mut reason = vec![0u8; if word(4) == 1 { word(8) as usize } else { 0 }];
        s.read_exact(&mut reason).unwrap();
        (word(4), reason)
    };
    for (alias, what) in aliases(real) {
        let (kind, reason) = ask(alias.raw(), 0);
        assert_eq!(kind, 1, "a request for {alias} ({what}) must be refused");
        assert!(String::from_utf8_lossy(&reason).contains(&alias.to_string()), "{what}: the reason names the id");
    }
    // (u32::MAX is no handle: it asks for the region's fence table page,
    // `gpu_fds::FENCE_TABLE`, which a writable GPU region answers.)
    for first in [1, u32::MAX - 1] {
        assert_eq!(ask(real.raw(), first).0, 1, "handle {first} of a one-handle region");
    }
    assert_eq!(ask(real.raw(), 0).0, 0, "the real id is answered");
    drop(s);
    drop(region);
    drop(target);
}
