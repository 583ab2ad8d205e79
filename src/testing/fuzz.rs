//! Entry points for kvring's fuzz targets (`fuzz/`, cargo feature
//! `testing`): each takes arbitrary bytes, drives one decoder of outside
//! bytes (or a whole connection state machine) with them, and asserts what
//! must hold whatever the bytes are: no panic, no byte written outside a
//! registered region, no request served before its connection proved
//! itself. Not part of kvring's API.

use crate::auth::{Authenticator, Initiator, Token};
use crate::control::frame::{decode_request, decode_response, read_frame};
use crate::control::server::{handle, ConnectionAuth, ControlHandler};
use crate::desc::{BlockDesc, RegionId};
use crate::error::{Error, Result};
use crate::mem::{RegionInfo, Registry};
use crate::notify::{NotificationQueue, NotifyQuota};
use crate::proto::{request, response};
use crate::segment::{PeerSegment, SegmentDescriptor};
use crate::transport::tcp::conn::{Connection, Peer};
use crate::transport::tcp::hello::ClientHello;
use crate::transport::tcp::target::{TargetConn, TargetContext};
use crate::transport::Block;
use prost::Message;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use zerocopy::IntoBytes;

mod gpu_fds;
mod rdma_fence;
mod sealed;
mod sock_diag;
pub use gpu_fds::gpu_fds_connection;
pub use rdma_fence::rdma_fence;
pub use sealed::{sealed_control, sealed_frames};
pub use sock_diag::sock_diag_reply;

/// A TCP data frame header.
pub fn frame_header(data: &[u8]) {
    use crate::transport::tcp::frame::{FrameHeader, MAX_FRAME_PAYLOAD_BYTES};
    if let Ok((header, _op)) = FrameHeader::decode(data) {
        assert!(u64::from(header.len) <= MAX_FRAME_PAYLOAD_BYTES);
        assert!(header.offset.checked_add(header.len.into()).is_some());
        // A reply's status is a CRC32C (with FLAG_CHECKSUM) or a failure,
        // never both: a CRC is never read as an error code.
        assert!(header.checksum().is_none() || header.failure().is_none());
    }
}

/// A framed control message (what the control server and client read from
/// a socket); an RDMA connect's endpoints are checked or refused; a
/// preface is checked.
pub fn control_message(data: &[u8]) {
    let _ = crate::control::frame::check_preface(data, "fuzz");
    let mut reader = data;
    if let Ok(Some(body)) = read_frame(&mut reader, 1 << 16) {
        let _ = decode_request(&body);
        let _ = decode_response(&body);
    }
    if let Ok(request::Body::RdmaConnect(connect)) = decode_request(data) {
        for endpoint in &connect.endpoints {
            if let Ok(checked) = crate::transport::rdma::verbs::QpEndpoint::from_proto(endpoint) {
                assert!(checked.qpn <= 0x00ff_ffff && (256..=4096).contains(&checked.mtu));
            }
        }
    }
    if let Ok(request::Body::Crc32c(asked)) = decode_request(data) {
        // The target's checks before it reads a byte: never a panic, and
        // what passes is within the limits.
        if crate::engine::check_crc32c_request(&asked).is_ok() {
            assert!(asked.ranges.len() <= crate::transport::rdma::verify::MAX_CRC32C_RANGES);
        }
    }
    if let Ok(response::Body::RdmaConnect(reply)) = decode_response(data) {
        for endpoint in &reply.endpoints {
            let _ = crate::transport::rdma::verbs::QpEndpoint::from_proto(endpoint);
        }
    }
}

/// etcd's answer: the HTTP parser, the JSON and range decoders and the
/// stored-descriptor decoder.
pub fn etcd_answer(data: &[u8]) {
    use crate::http::{parse_response, MAX_MESSAGE_BYTES};
    use crate::metadata::directory::DirectoryStore;
    use crate::metadata::etcd::{decode_json, decode_range};
    if let Ok(response) = parse_response(data) {
        assert!(response.body.len() <= data.len().max(MAX_MESSAGE_BYTES));
        if let Ok(json) = decode_json(&response.body) {
            if let Ok(Some(value)) = decode_range(&json) {
                if let Ok(descriptor) = DirectoryStore::decode_descriptor("etcd", "decode-0", &value) {
                    assert_eq!(descriptor.name, "decode-0");
                }
            }
        }
    }
    let _ = DirectoryStore::decode_descriptor("etcd", "decode-0", data);
}

/// redis's replies: the RESP parser, fed whole and in two pieces (a reply
/// split across reads), and the stored-descriptor decoder on what a GET
/// would return.
pub fn redis_reply(data: &[u8]) {
    use crate::metadata::directory::DirectoryStore;
    use crate::metadata::redis::{parse_reply, Reply};
    let whole = parse_reply(data);
    if let Ok(Some((reply, used))) = &whole {
        assert!(*used <= data.len());
        // A prefix of a complete reply is incomplete, never another reply.
        if *used > 0 {
            assert!(matches!(parse_reply(&data[..used - 1]), Ok(None) | Err(_)));
        }
        if let Reply::Bulk(Some(value)) = reply {
            let _ = DirectoryStore::decode_descriptor("redis", "decode-0", value);
        }
    }
}

/// Mooncake's HTTP metadata server's answers: the HTTP parser, the GET
/// decoder and the stored-descriptor decoder.
pub fn http_metadata_answer(data: &[u8]) {
    use crate::http::parse_response;
    use crate::metadata::directory::DirectoryStore;
    use crate::metadata::mooncake_http::decode_get;
    if let Ok(response) = parse_response(data) {
        if let Ok(Some(value)) = decode_get("127.0.0.1:8080", &response) {
            if let Ok(descriptor) = DirectoryStore::decode_descriptor("http", "decode-0", &value) {
                assert_eq!(descriptor.name, "decode-0");
            }
        }
    }
}

/// A peer's memory-info answer: a checked layout plans without overflow.
pub fn kv_layout(data: &[u8]) {
    use crate::kv::{plan_blocks, KvLayout};
    let Ok(info) = crate::proto::KvLayoutInfo::decode(data) else { return };
    let Ok(layout) = KvLayout::from_proto(info) else { return };
    assert_eq!(KvLayout::from_proto(layout.to_proto()).expect("a checked layout re-encodes"), layout);
    let last = layout.blocks() - 1;
    let _ = plan_blocks(&layout, &layout, crate::ring::Opcode::Write, &[0, last], &[last, 0]);
}

/// A handshake's segment descriptor: refused, or a descriptor whose region
/// table looks up every listed region and only those. The check is linear
/// in the input (a corpus seed lists the most regions a descriptor may).
pub fn segment_descriptor(data: &[u8]) {
    let expanded;
    let data = if data == b"MAXIMAL" {
        expanded = maximal_descriptor();
        &expanded[..]
    } else {
        data
    };
    let Ok(wire) = crate::proto::SegmentDescriptor::decode(data) else { return };
    let Ok(descriptor) = SegmentDescriptor::from_proto(wire) else { return };
    if let Some(name) = &descriptor.gpu_fds {
        // Only a socket name kvring makes is ever dialed.
        assert!(name.starts_with("kvring-gpu-fds-") && name.len() == 48, "{name:?}");
    }
    for region in &descriptor.regions {
        assert!(region.len > 0);
        if let Some(path) = &region.shm_path {
            assert!(path.starts_with("/dev/shm/"));
        }
    }
    let ids: Vec<_> = descriptor.regions.iter().map(|r| r.id).collect();
    let peer = PeerSegment::new(descriptor);
    for id in ids {
        assert_eq!(peer.region(id).expect("listed region resolves").id, id);
        let stale = RegionId::new(id.index(), id.generation().wrapping_add(1));
        assert!(peer.region(stale).is_err());
    }
}

/// The largest descriptor a peer may send: every region listed, and RDMA
/// keys for each on the most NICs. (A check that scanned the regions per key
/// took minutes over this; the seed `MAXIMAL` stands for it.)
fn maximal_descriptor() -> Vec<u8> {
    use crate::segment::descriptor::{MAX_DESCRIPTOR_REGIONS, MAX_RDMA_NICS};
    let count = MAX_DESCRIPTOR_REGIONS as u32 - 1;
    let regions = (0..count)
        .map(|i| crate::proto::RegionDescriptor {
            id: RegionId::new(i, 1).raw(),
            len: 4096,
            access: 15,
            addr: u64::from(i) << 20,
            ..Default::default()
        })
        .collect();
    let keys = (0..count)
        .map(|i| crate::proto::RdmaRegion {
            id: RegionId::new(i, 1).raw(),
            addr: u64::from(i) << 20,
            rkeys: vec![i; MAX_RDMA_NICS as usize],
        })
        .collect();
    crate::proto::SegmentDescriptor {
        name: "maximal".into(),
        epoch: 1,
        regions,
        rdma: Some(crate::proto::RdmaInfo {
            nics: MAX_RDMA_NICS,
            regions: keys,
            unreachable: Vec::new(),
            arrivals: true,
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// The metrics server's request line.
pub fn http_request_line(data: &[u8]) {
    if let Ok((method, path)) = crate::http::parse_request_line(data) {
        assert!(!method.is_empty() && method.bytes().all(|b| b.is_ascii_uppercase()));
        assert!(path.len() <= data.len());
    }
    let _ = crate::http::read_request_line(&mut &data[..]);
}

/// A socket stand-in for the target's connection loop: bytes in, replies
/// out, reads and writes cut into pieces the input chooses.
struct Wire<'a> {
    input: &'a [u8],
    piece: usize,
    written: usize,
}

impl Read for Wire<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.input.is_empty() {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        let n = buf.len().min(self.input.len()).min(self.piece);
        buf[..n].copy_from_slice(&self.input[..n]);
        self.input = &self.input[n..];
        Ok(n)
    }
}

impl Write for Wire<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.piece * 7);
        self.written += n;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Guard bytes around the region a fuzzed target serves.
const GUARD: u8 = 0xab;
const GUARD_BYTES: usize = 4096;
const SERVED_BYTES: usize = 64 * 1024;

struct Served {
    ctx: TargetContext,
    memory: Vec<u8>,
    region: RegionId,
}

fn served(token: Option<&str>) -> Served {
    let registry = Arc::new(Registry::new(4));
    let mut memory = vec![GUARD; GUARD_BYTES + SERVED_BYTES + GUARD_BYTES];
    memory[GUARD_BYTES..GUARD_BYTES + SERVED_BYTES].fill(0);
    let start = memory.as_mut_ptr() as usize + GUARD_BYTES;
    let region = registry.register(start, SERVED_BYTES, RegionInfo::raw(), Default::default()).expect("registers");
    // The first 4 KiB are fenced under grant 5: a WRITE there naming less
    // (after a GRANT frame, or none) is refused and its lease given back.
    let entry = registry.get(region).expect("registered");
    entry.fence_view().fence(&[crate::mem::fence::Span::range(0, 4096)], 5, || true).expect("nothing writes yet");
    // Grant 7 is entered in this table too (its last byte, which no seed
    // names), as another request's fence would: a grant above every one a
    // table holds is refused on its fenced bytes (`mem::fence`, `issued`).
    let last = SERVED_BYTES as u64 - 1;
    entry.fence_view().fence(&[crate::mem::fence::Span::range(last, 1)], 7, || true).expect("nothing writes yet");
    // The seeds name grants up to 7: a target fences every write under a
    // grant its process never issued, so this process issues them, as a
    // target's fences would.
    while !crate::mem::fence::issued(7) {
        crate::mem::fence::next_grant();
    }
    let quota = NotifyQuota { total: 8, total_bytes: 4096, per_sender: 4, per_sender_bytes: 2048 };
    let ctx = TargetContext {
        registry,
        notifications: Arc::new(NotificationQueue::new(quota)),
        arrivals: Arc::new(crate::arrival::Arrivals::new()),
        epoch: 42,
        auth: token.map(|t| Arc::new(Authenticator::new(Token::new(t), 42))),
    };
    Served { ctx, memory, region }
}

/// Feeds `bytes` to a fresh target connection, `piece` bytes at a time.
fn drive(served: &Served, bytes: &[u8], piece: usize) -> TargetConn {
    let now = Instant::now();
    let mut conn = TargetConn::new(now, Duration::from_secs(2));
    let mut wire = Wire { input: bytes, piece: piece.max(1), written: 0 };
    let mut admit = || Ok(());
    for _ in 0..bytes.len() + 8 {
        let read = conn.on_readable(&mut wire, &served.ctx, &mut admit, now, &mut Default::default());
        let written = conn.on_writable(&mut wire, &served.ctx, &mut Default::default());
        if read.is_err() || written.is_err() || conn.finished() || (wire.input.is_empty() && !conn.wants_write()) {
            break;
        }
    }
    conn.release(&served.ctx, &mut Default::default());
    conn
}

fn guards_intact(served: &Served) {
    assert!(served.memory[..GUARD_BYTES].iter().all(|&b| b == GUARD), "a write landed before the region");
    assert!(served.memory[GUARD_BYTES + SERVED_BYTES..].iter().all(|&b| b == GUARD), "a write landed past the region");
    // Every lease went back with the connection.
    served.ctx.registry.unregister(served.region).expect("no lease left behind");
}

/// The data server's opening with a token: nothing is served unless the
/// bytes carry a valid session proof (they cannot, without the token).
pub fn data_hello(data: &[u8]) {
    let served = served(Some("fuzz-token"));
    let piece = data.first().map_or(1, |b| usize::from(*b % 61) + 1);
    let _ = drive(&served, data, piece);
    assert!(served.memory[GUARD_BYTES..GUARD_BYTES + SERVED_BYTES].iter().all(|&b| b == 0), "served without proof");
    assert!(served.ctx.notifications.poll().is_none(), "a notification got in without proof");
    guards_intact(&served);
}

/// The data server's frame loop (WRITE, READ, NOTIFY, garbage), past a
/// hello: never a byte outside the region, every lease given back.
pub fn target_connection(data: &[u8]) {
    let served = served(None);
    let piece = data.first().map_or(1, |b| usize::from(*b % 61) + 1);
    let mut bytes = ClientHello::new(42, [0; 16], [0; 16], [0; 16]).as_bytes().to_vec();
    // Frame headers in the input name region 1 (the index the registry
    // gives the served region) and epoch 42 often enough to reach memory.
    bytes.extend_from_slice(data.get(1..).unwrap_or_default());
    let _ = drive(&served, &bytes, piece);
    guards_intact(&served);
}

/// The initiator's reply parser: a connection with a WRITE chunk, a READ
/// chunk and a checksummed READ chunk in flight reads the input as the
/// target's replies (each READ_DATA, a failure too, counts for its span
/// only when it names the span's region and offset: seeds that answer a
/// READ name its block); it never writes outside the READ blocks' memory, and
/// the checksummed chunk is done only with bytes that match the CRC32Cs
/// its replies carried.
pub fn initiator_replies(data: &[u8]) {
    let _ = replies_end(data);
}

/// `initiator_replies`, returning how each chunk ended before the rest
/// were failed: (ticket, the wire code of its failure, if it failed).
fn replies_end(data: &[u8]) -> Vec<(u64, Option<crate::proto::ErrorCode>)> {
    static LISTENER: OnceLock<TcpListener> = OnceLock::new();
    let listener = LISTENER.get_or_init(|| TcpListener::bind("127.0.0.1:0").expect("binds loopback"));
    let addr = listener.local_addr().expect("has an address");
    let Ok(client) = TcpStream::connect(addr) else { return Vec::new() };
    let Ok((mut server, _)) = listener.accept() else { return Vec::new() };
    let Ok(mut connection) = Connection::new(client) else { return Vec::new() };
    let peer = Peer { name: "fuzz".into(), addr, epoch: 42 };
    let mut memory = vec![GUARD; GUARD_BYTES + 3 * SERVED_BYTES + GUARD_BYTES];
    let base = GUARD_BYTES;
    let region = RegionId::new(1, 1);
    let start = memory.as_mut_ptr();
    let block = |offset: usize, len: u64| Block {
        local: start.wrapping_add(base + offset),
        memory: crate::mem::MemoryKind::Host,
        desc: BlockDesc::new(region, offset as u64, region, offset as u64, len),
        desc_index: 0,
        tag: 0,
        checksum: false,
        grant: 0,
    };
    let writes = [block(0, 4096), block(4096, 4096)];
    let reads = [block(0, 16), block(SERVED_BYTES, 32 * 1024), block(2 * SERVED_BYTES, 100)];
    let summed = |offset: usize, len: u64, desc_index: u32| Block { checksum: true, desc_index, ..block(offset, len) };
    let checked = [summed(2 * SERVED_BYTES + 4096, 64, 0), summed(2 * SERVED_BYTES + 8192, 4096, 1)];
    // SAFETY: every block lies inside `memory`, which lives to the end of
    // this function: the connection is driven only before that, and
    // dropping it touches none of the queued pointers.
    unsafe {
        connection.queue_chunk(&peer, crate::ring::Opcode::Write, 7, 1, &writes);
        connection.queue_chunk(&peer, crate::ring::Opcode::Read, 8, 2, &reads);
        connection.queue_chunk(&peer, crate::ring::Opcode::Read, 9, 3, &checked);
    }
    let _ = server.write_all(data);
    let _ = server.shutdown(std::net::Shutdown::Write);
    let mut finished = Vec::new();
    for _ in 0..data.len() / 16 + 64 {
        match connection.progress(&peer, Duration::from_secs(5), &mut finished) {
            Ok(true) => {}
            Ok(false) => std::thread::sleep(Duration::from_micros(10)),
            Err(_) => break,
        }
    }
    // The checksummed chunk was done only if the CRC32Cs it was sent (the
    // input's READ_DATA headers for batch 9, in order) match what landed.
    if let Some((_, Ok(moved))) = finished.iter().find(|(ticket, _)| *ticket == 3) {
        assert_eq!(*moved, 64 + 4096);
        let sums: Vec<(u32, u64, u64)> = replies_of_batch(data, 9).collect();
        for (block, &(sum, region, offset)) in checked.iter().zip(&sums) {
            // Each verified reply named the block it answered (review 7: a
            // block's true bytes and CRC32C in another block's place).
            assert_eq!((region, offset), (block.desc.remote_region.raw(), block.desc.remote_offset));
            let landed = &memory[base + block.desc.local_offset as usize..][..block.desc.len as usize];
            // SAFETY: a live slice.
            let crc = unsafe { crate::transport::checksum::crc32c_host(landed.as_ptr(), landed.len()) };
            assert_eq!(crc, sum, "a checksummed READ was done with bytes that do not match its CRC32C");
        }
    }
    let ends = finished.iter().map(|(ticket, end)| (*ticket, end.as_ref().err().map(|(e, _)| e.code()))).collect();
    connection.fail_all(&peer, "fuzz", &mut finished);
    drop(server);
    let spans = [
        (0, 16),
        (SERVED_BYTES, 32 * 1024),
        (2 * SERVED_BYTES, 100),
        (2 * SERVED_BYTES + 4096, 64),
        (2 * SERVED_BYTES + 8192, 4096),
    ];
    for (index, byte) in memory[base..base + 3 * SERVED_BYTES].iter().enumerate() {
        let inside = spans.iter().any(|&(start, len)| index >= start && index < start + len);
        assert!(inside || *byte == GUARD, "a reply wrote local byte {index}, outside every READ block");
    }
    assert!(memory[..base].iter().chain(&memory[base + 3 * SERVED_BYTES..]).all(|&b| b == GUARD));
    ends
}

/// The CRC32Cs of the well-formed READ_DATA headers for `batch` in a run
/// of replies (each followed by its payload), in order, each with the
/// region and offset its header names.
fn replies_of_batch(mut data: &[u8], batch: u64) -> impl Iterator<Item = (u32, u64, u64)> + '_ {
    use crate::transport::tcp::frame::{FrameHeader, FrameOp, FRAME_HEADER_BYTES};
    std::iter::from_fn(move || loop {
        let (header, op) = FrameHeader::decode(data.get(..FRAME_HEADER_BYTES)?).ok()?;
        let payload = if op == FrameOp::ReadData && header.failure().is_none() { header.len as usize } else { 0 };
        data = data.get(FRAME_HEADER_BYTES + payload..)?;
        if header.batch_id == batch {
            if let Some(sum) = header.checksum() {
                return Some((sum, header.region, header.offset));
            }
        }
    })
}

/// A control handler with a token, for the control server's request
/// handling.
#[derive(Debug)]
struct Handler {
    auth: Authenticator,
}

impl ControlHandler for Handler {
    fn authenticator(&self) -> Option<&Authenticator> {
        Some(&self.auth)
    }
    fn epoch(&self) -> u64 {
        42
    }
    fn describe(&self) -> SegmentDescriptor {
        SegmentDescriptor {
            name: "fuzz".into(),
            epoch: 42,
            host_id: String::new(),
            pid: 1,
            instance: 0,
            gpu_fds: None,
            regions: Vec::new(),
            control_addr: String::new(),
            tcp_addr: None,
            rdma: None,
            cma: None,
        }
    }
    fn name(&self) -> &str {
        "fuzz"
    }
    fn checksum(&self, _request: &crate::proto::ChecksumRequest, _source: Option<std::net::IpAddr>) -> Result<u64> {
        Ok(0)
    }
    fn crc32c(&self, request: &crate::proto::Crc32cRequest, _source: Option<std::net::IpAddr>) -> Result<Vec<u32>> {
        Ok(vec![0; request.ranges.len()])
    }
    fn notify(&self, _sender: &str, _message: Vec<u8>) -> Result<()> {
        Ok(())
    }
    fn memory_info(&self) -> Result<crate::proto::KvLayoutInfo> {
        Err(Error::Unsupported { what: "fuzz".into() })
    }
    fn rdma_connect(
        &self,
        _initiator: &Initiator,
        _request: &crate::proto::RdmaConnectRequest,
    ) -> Result<crate::proto::RdmaConnectResponse> {
        Ok(Default::default())
    }
    fn rdma_fence(&self, _target: &Initiator, _request: &crate::proto::RdmaFenceRequest) -> Result<()> {
        Ok(())
    }
}

/// The control server's request handling with its authentication state: a
/// sequence of framed requests from a client without the token never gets
/// a descriptor, a checksum, a notification in, or QPs.
pub fn control_requests(data: &[u8]) {
    static HANDLER: OnceLock<Handler> = OnceLock::new();
    let handler = HANDLER.get_or_init(|| Handler { auth: Authenticator::new(Token::new("fuzz-token"), 42) });
    let mut auth = ConnectionAuth::default();
    let mut reader = data;
    while let Ok(Some(body)) = read_frame(&mut reader, 1 << 16) {
        let Ok(request) = decode_request(&body) else { continue };
        let probe = matches!(request, request::Body::Probe(_));
        match handle(handler, request, &mut auth) {
            Ok(response::Body::Handshake(reply)) => {
                assert!(reply.segment.is_none(), "a descriptor without the token's proof");
                assert!(reply.sealed_segment.is_empty(), "a sealed descriptor without the token's proof");
            }
            Ok(_) => assert!(probe, "a request served before the handshake"),
            Err(_) => {}
        }
        assert!(!auth.is_proven(), "proven without the token");
    }
}

#[cfg(test)]
mod reply_seeds {
    use crate::proto::ErrorCode;

    /// The committed seeds of the initiator's reply parser run through it;
    /// a READ failure is its span's only when it names the span's region
    /// and offset: `refused` (echoing them) fails the READ chunk with the
    /// target's code, `refused_elsewhere` (naming another region) is a
    /// target out of step, its chunk failed as a peer gone.
    #[test]
    fn the_initiator_reply_seeds_pass_and_a_failure_must_name_its_span() {
        let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/initiator_replies");
        let seed = |name: &str| std::fs::read(seeds.join(name)).expect("a seed");
        for entry in std::fs::read_dir(&seeds).expect("seeds") {
            super::initiator_replies(&std::fs::read(entry.expect("a seed").path()).expect("readable"));
        }
        let ends = super::replies_end(&seed("refused"));
        assert_eq!(ends, [(1, Some(ErrorCode::OutOfBounds)), (2, Some(ErrorCode::UnknownRegion))]);
        let ends = super::replies_end(&seed("refused_elsewhere"));
        assert_eq!(ends, [(1, Some(ErrorCode::OutOfBounds))], "the READ chunk ended only when the connection died");
    }
}

#[cfg(test)]
mod fence_seeds {
    /// The committed seeds of the target's connection loop (GRANT frames
    /// among them) run through it: no byte outside the region, every lease
    /// back; a stale grant's write lands nothing in the fenced page.
    #[test]
    fn the_target_connection_seeds_pass_and_a_stale_grant_lands_nothing() {
        let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/target_connection");
        for seed in std::fs::read_dir(seeds).expect("seeds") {
            let bytes = std::fs::read(seed.expect("a seed").path()).expect("readable");
            super::target_connection(&bytes);
        }
        let bytes =
            std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/target_connection/grants"))
                .expect("the grants seed");
        let served = super::served(None);
        let piece = usize::from(bytes[0] % 61) + 1;
        let hello = super::ClientHello::new(42, [0; 16], [0; 16], [0; 16]);
        let mut input = zerocopy::IntoBytes::as_bytes(&hello).to_vec();
        input.extend_from_slice(&bytes[1..]);
        let _ = super::drive(&served, &input, piece);
        let region = &served.memory[super::GUARD_BYTES..];
        assert_eq!(&region[100..105], b"hello", "grant 7 lands in the page fenced under 5");
        assert_eq!(&region[200..208], &[0; 8], "grant 3 lands nothing there");
        assert_eq!(&region[8192..8196], b"free", "past the fenced page no grant is needed");
        super::guards_intact(&served);
    }
}
