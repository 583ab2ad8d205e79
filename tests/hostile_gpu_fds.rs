//! cuda_ipc's GPU memory handles (security review row 2), attacked as an
//! outsider would: a peer that answers the handshake itself (a fake control
//! server, or a real engine) and lies in its descriptor, a third process
//! whose descriptor or socket it names, and a stranger on the host without
//! the token. GPU memory reaches an initiator only as descriptors the
//! exporting process passes itself, over a socket held by the process that
//! answered the handshake, after the session is proven; a peer claiming to
//! be this very process reaches only what this process's engines grant
//! peers.

mod common;

use common::WAIT;
use kvring::gpu::{Gpu, SimGpu};
use kvring::testing::control::response;
use kvring::testing::control::{request, ControlClient, HandshakeRequest};
use kvring::testing::control::{GpuHandle, RegionDescriptor, SegmentDescriptor as WireDescriptor};
use kvring::{Access, Batch, BlockDesc, Engine, RegionId, RegionInfo, TransportKind};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LEN: u64 = 1 << 20;
const TOKEN: &str = "gpu-fds-suite-token";

/// A descriptor as an engine of this host would send it, with one GPU
/// region of `LEN` bytes whose single handle is `handle`.
fn hostile_descriptor(engine: &Engine, region: RegionId, addr: u64, handle: GpuHandle) -> WireDescriptor {
    let ours = kvring::testing::descriptor(engine);
    WireDescriptor {
        name: "hostile".into(),
        epoch: 0x6666,
        host_id: ours.host_id,
        pid: std::process::id(),
        instance: 0x1234_5678,
        regions: vec![RegionDescriptor {
            id: region.raw(),
            len: LEN,
            access: Access::ALL.bits(),
            addr,
            gpu: 1,
            gpu_handles: vec![handle],
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// The handle payload the review's probe used: (pid, fd) of another
/// process, behind a mark kvring once read it by.
fn naming(mark: &[u8; 4], pid: u32, fd: i32) -> Vec<u8> {
    let mut bytes = vec![0u8; 64];
    bytes[..4].copy_from_slice(mark);
    bytes[4..8].copy_from_slice(&pid.to_le_bytes());
    bytes[8..12].copy_from_slice(&fd.to_le_bytes());
    bytes
}

fn gpu_engine(name: &str, token: Option<&str>) -> (Engine, Arc<SimGpu>) {
    let gpu = Arc::new(SimGpu::new(1, Duration::from_micros(50)));
    let mut builder = common::builder(name).gpu(gpu.clone() as Arc<dyn Gpu>);
    if let Some(token) = token {
        builder = builder.token(token);
    }
    (builder.build().unwrap(), gpu)
}

/// Writes the initiator's `source` over every region of `segment`; true
/// when any batch said it was done.
fn any_write_done(engine: &Engine, segment: &kvring::Segment, source: RegionId) -> bool {
    let mut sub = engine.submitter().unwrap();
    segment.regions().iter().any(|remote| {
        let descs = [BlockDesc::new(source, 0, remote.id, 0, 4096)];
        let id = sub.submit(&Batch::write(segment).descs(&descs)).unwrap();
        sub.wait(id, WAIT).unwrap().is_done()
    })
}

/// A child of this test binary: `memfd` holds a megabyte of zeros and
/// reports, when its stdin closes, whether anyone wrote it; `engine` serves
/// a GPU region (with `KVRING_HOSTILE_TOKEN`, tokened) and reports whether
/// its bytes are still its own.
struct Third {
    child: Child,
    words: Vec<String>,
    out: BufReader<std::process::ChildStdout>,
}

impl Third {
    fn start(role: &str, token: Option<&str>) -> Self {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["--ignored", "--exact", "third_process", "--nocapture", "--test-threads=1"])
            .env("KVRING_HOSTILE_ROLE", role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(token) = token {
            command.env("KVRING_HOSTILE_TOKEN", token);
        }
        let mut child = command.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let words = loop {
            let mut line = String::new();
            assert!(out.read_line(&mut line).unwrap() > 0, "the third process exited before it was ready");
            if let Some((_, rest)) = line.split_once("ready ") {
                break rest.split_whitespace().map(str::to_string).collect();
            }
        };
        Third { child, words, out }
    }

    /// Its last word, once its stdin is closed.
    fn verdict(mut self) -> String {
        drop(self.child.stdin.take());
        let mut rest = String::new();
        self.out.read_to_string(&mut rest).unwrap();
        self.child.wait().unwrap();
        rest
    }
}

#[test]
#[ignore = "the third process of the hostile GPU descriptor tests"]
fn third_process() {
    let role = std::env::var("KVRING_HOSTILE_ROLE").expect("run by Third::start");
    let wait_for_eof = || {
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
    };
    match role.as_str() {
        "memfd" => {
            // SAFETY: memfd_create with a NUL-terminated name.
            let fd = unsafe { libc::memfd_create(c"not-kvring".as_ptr(), 0) };
            assert!(fd >= 0);
            // SAFETY: ftruncate on the descriptor just made.
            assert_eq!(unsafe { libc::ftruncate(fd, LEN as i64) }, 0);
            println!("ready {} {fd}", std::process::id());
            std::io::stdout().flush().unwrap();
            wait_for_eof();
            let mut bytes = vec![0u8; LEN as usize];
            // SAFETY: pread into a buffer of that length.
            let n = unsafe { libc::pread(fd, bytes.as_mut_ptr().cast(), bytes.len(), 0) };
            assert_eq!(n, LEN as isize);
            let written = bytes.iter().filter(|&&b| b != 0).count();
            println!("verdict {}", if written == 0 { "untouched".to_string() } else { format!("written {written}") });
        }
        "engine" => {
            let token = std::env::var("KVRING_HOSTILE_TOKEN").ok();
            let (engine, _gpu) = gpu_engine("third", token.as_deref());
            let region = engine.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
            // SAFETY: no batch or peer touches these bytes yet.
            unsafe { region.fill_pattern(9) };
            let described = kvring::testing::descriptor(&engine);
            let name = described.gpu_fds.expect("a GPU engine serves its descriptor socket");
            println!("ready {} {name} {}", engine.control_addr(), region.id().raw());
            std::io::stdout().flush().unwrap();
            wait_for_eof();
            let mut now = vec![0u8; LEN as usize];
            // SAFETY: nothing else touches the region any more.
            unsafe { region.read_at(0, &mut now).unwrap() };
            let mine = now == common::pattern(LEN as usize, 9);
            println!("verdict {}", if mine { "untouched" } else { "changed" });
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn a_descriptor_naming_a_third_processs_descriptor_opens_nothing_there() {
    let (initiator, _gpu) = gpu_engine("gpu-fds-victim", None);
    let source = initiator.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { source.fill_pattern(5) };
    for (kind, mark) in [(2, b"KVFD"), (1, b"KVSG"), (2, b"KVSP")] {
        let third = Third::start("memfd", None);
        let (pid, fd): (u32, i32) = (third.words[0].parse().unwrap(), third.words[1].parse().unwrap());
        let handle = GpuHandle { kind, handle: naming(mark, pid, fd), offset: 0, len: LEN };
        let addr = common::raw::fake_peer(hostile_descriptor(&initiator, RegionId::new(0, 1), 0x7000_0000, handle));
        match initiator.open_segment_with(&addr, Some(TransportKind::CudaIpc), WAIT) {
            Err(error) => {
                let text = error.to_string();
                assert!(text.contains("serves no socket"), "kind {kind}: {text}");
            }
            Ok(segment) => assert!(!any_write_done(&initiator, &segment, source.id()), "kind {kind}: a write landed"),
        }
        assert!(third.verdict().contains("verdict untouched"), "kind {kind}: the third process's memory was written");
    }
}

#[test]
fn a_process_that_did_not_answer_the_handshake_cannot_hand_us_descriptors() {
    let (initiator, _gpu) = gpu_engine("gpu-fds-victim-2", None);
    let source = initiator.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { source.fill_pattern(5) };
    // A real engine in a third process, whose socket serves anyone (no
    // token): the peer that answers the handshake names that socket and
    // that engine's region as its own.
    let third = Third::start("engine", None);
    let (name, region) = (third.words[1].clone(), RegionId::from_raw(third.words[2].parse().unwrap()));
    let handle = GpuHandle { kind: 1, handle: vec![0; 64], offset: 0, len: LEN };
    let mut descriptor = hostile_descriptor(&initiator, region, 0x7000_0000, handle);
    descriptor.gpu_fds = name;
    let addr = common::raw::fake_peer(descriptor);
    let error = initiator.open_segment_with(&addr, Some(TransportKind::CudaIpc), WAIT).unwrap_err().to_string();
    assert!(error.contains("not by pid") && error.contains("answered the handshake"), "{error}");
    // The third engine itself, asked directly, is opened and written: the
    // refusal above is the socket's holder, not a broken path.
    let direct = initiator.open_segment_with(&third.words[0], Some(TransportKind::CudaIpc), WAIT).unwrap();
    assert!(any_write_done(&initiator, &direct, source.id()));
    assert!(third.verdict().contains("verdict changed"), "the direct write landed");
}

#[test]
fn a_descriptor_claiming_this_process_reaches_only_what_its_engines_grant_peers() {
    let (initiator, _gpu) = gpu_engine("gpu-fds-self", None);
    let source = initiator.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { source.fill_pattern(5) };
    let local_only = RegionInfo::raw().on_gpu(0).with_access(Access::LOCAL_READ | Access::LOCAL_WRITE);
    let secret = initiator.alloc_region(LEN as usize, local_only).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { secret.fill_pattern(77) };
    let read_only = Access::LOCAL_READ | Access::LOCAL_WRITE | Access::REMOTE_READ;
    let readable = initiator.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0).with_access(read_only)).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { readable.fill_pattern(78) };
    let ours = kvring::testing::descriptor(&initiator);
    let addr_of = |id: RegionId| ours.regions.iter().find(|r| r.id == id).unwrap().addr;
    // Our own instance id, pid and socket, every right claimed: the
    // secret under its own id (no right for peers), the read-only region
    // (peers may read it, not write), and the secret's address under an id
    // this process never registered.
    let cases = [(secret.id(), addr_of(secret.id())), (readable.id(), addr_of(readable.id()))];
    for (id, at) in cases.into_iter().chain([(RegionId::new(60, 1), addr_of(secret.id()))]) {
        let handle = GpuHandle { kind: 1, handle: vec![0; 64], offset: 0, len: LEN };
        let mut descriptor = hostile_descriptor(&initiator, id, at, handle);
        descriptor.instance = ours.instance;
        descriptor.gpu_fds = ours.gpu_fds.clone().unwrap();
        let addr = common::raw::fake_peer(descriptor);
        // The link opens (the region is recorded as unreachable, with why);
        // every write to it fails.
        let segment = initiator.open_segment_with(&addr, Some(TransportKind::CudaIpc), WAIT).unwrap();
        assert!(!any_write_done(&initiator, &segment, source.id()), "{id}: a write landed");
    }
    let mut now = vec![0u8; LEN as usize];
    // SAFETY: no batch names the secret region.
    unsafe { secret.read_at(0, &mut now).unwrap() };
    assert!(now == common::pattern(LEN as usize, 77), "the local-only region kept its bytes");
    // SAFETY: no batch names the read-only region.
    unsafe { readable.read_at(0, &mut now).unwrap() };
    assert!(now == common::pattern(LEN as usize, 78), "the read-only region kept its bytes");
}

/// Reads until EOF or `limit` bytes; what came.
fn read_some(stream: &mut UnixStream, limit: usize) -> Vec<u8> {
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 256];
    while got.len() < limit {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    got
}

fn hello(cn: &[u8], sn: &[u8]) -> Vec<u8> {
    let mut bytes = b"KVF1".to_vec();
    bytes.extend_from_slice(cn);
    bytes.extend_from_slice(sn);
    bytes.extend_from_slice(&[3u8; 16]);
    bytes
}

#[test]
fn a_stranger_without_the_token_fetches_no_descriptor() {
    let third = Third::start("engine", Some(TOKEN));
    let (control, name) = (third.words[0].clone(), third.words[1].clone());
    let region = RegionId::from_raw(third.words[2].parse().unwrap());
    // The client's own encoder: a request the server would answer, were
    // the proof checked away (the test fails then; it has been tried).
    let request = |stream: &mut UnixStream| {
        let _ = stream.write_all(&kvring::testing::gpu_fds::request(region.raw(), 0, 1));
    };
    let socket = || UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();

    // Made-up session nonces: closed before a byte is answered.
    let mut stranger = socket();
    stranger.write_all(&hello(&[1; 16], &[2; 16])).unwrap();
    request(&mut stranger);
    assert!(read_some(&mut stranger, 1024).is_empty(), "a session it never issued got an answer");

    // Nonces it did issue (anyone gets a challenge at the control port),
    // but no proof: the server proves itself, then closes on the bad proof
    // before any descriptor is passed.
    let mut control = ControlClient::connect(&control, Instant::now() + WAIT).unwrap();
    let cn = [7u8; 16];
    let step = HandshakeRequest {
        initiator: "stranger".into(),
        initiator_epoch: 1,
        client_nonce: cn.to_vec(),
        ..Default::default()
    };
    let answer = control.call(request::Body::Handshake(step), Instant::now() + WAIT).unwrap();
    let response::Body::Handshake(answer) = answer else { panic!("not a handshake answer: {answer:?}") };
    let sn = answer.challenge.expect("a tokened engine challenges").server_nonce;
    let mut stranger = socket();
    stranger.write_all(&hello(&cn, &sn)).unwrap();
    let challenge = read_some(&mut stranger, 56);
    assert_eq!(&challenge[..8], b"KVF2\x01\0\0\0", "the server asks a proof");
    stranger.write_all(&[0u8; 32]).unwrap();
    request(&mut stranger);
    assert!(read_some(&mut stranger, 1024).is_empty(), "an answer without the proof");

    // A token holder (this process, as a tokened engine) opens it and writes.
    let (initiator, _gpu) = gpu_engine("gpu-fds-token-holder", Some(TOKEN));
    let source = initiator.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { source.fill_pattern(5) };
    let segment = initiator.open_segment_with(&third.words[0], Some(TransportKind::CudaIpc), WAIT).unwrap();
    assert!(any_write_done(&initiator, &segment, source.id()));
    assert!(third.verdict().contains("verdict changed"), "the token holder's write landed");
}

/// An opener speaking an older request form ("KVF3", before region ids
/// took 64 bits; "KVF5", whose fence pages lacked the `issued` word) is
/// refused with a reason naming its version and the ones served, at once:
/// not misread, nor left to the server's read timeout. "KVF6" (the current
/// layout from an opener that takes no FABRIC answers) is served, so a
/// fleet upgraded one engine at a time keeps opening GPU regions.
#[test]
fn an_older_request_version_is_refused_by_name_and_the_one_before_fabric_is_served() {
    let (target, _gpu) = gpu_engine("gpu-fds-old-request", None);
    let region = target.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
    let name = kvring::testing::descriptor(&target).gpu_fds.expect("a GPU region's engine serves gpu_fds");
    // "KVF3": 28 bytes, as the test always sent them; "KVF5" and "KVF6":
    // the current layout under an older magic.
    let kvf3: Vec<u8> = [region.id().raw(), 0u64, 1].iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut current = (region.id().raw()).to_le_bytes().to_vec();
    current.extend([0u32, 1].iter().flat_map(|w| w.to_le_bytes()));
    for (magic, body) in [(b"KVF3", kvf3), (b"KVF5", current.clone()), (b"KVF6", current)] {
        let mut stream = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        stream.write_all(&hello(&[0; 16], &[0; 16])).unwrap();
        let challenge = read_some(&mut stream, 56);
        assert_eq!(&challenge[..8], b"KVF2\0\0\0\0", "no token: no proof asked");
        let mut old = magic.to_vec();
        old.extend_from_slice(&body);
        stream.write_all(&old).unwrap();
        let answer = read_some(&mut stream, if magic == b"KVF6" { 16 } else { 4096 });
        if magic == b"KVF6" {
            assert_eq!(&answer[..16], b"KVF4\0\0\0\0\x01\0\0\0\x01\0\0\0", "one descriptor of one handle");
            continue;
        }
        assert!(answer.len() > 16, "a refusal with its reason, got {answer:?}");
        assert_eq!(&answer[..8], b"KVF4\x01\0\0\0", "a refusal");
        let reason = String::from_utf8_lossy(&answer[16..]);
        let said = String::from_utf8_lossy(magic);
        assert!(reason.contains(&*said) && reason.contains("KVF6 and KVF7"), "the reason names the versions: {reason}");
    }
}

/// A peer advertising more GPU regions than the initiator takes from one
/// peer is refused by the cap's name before any is opened: each would cost
/// an IPC open and a fence table page mapped here, and 65,536 of them would
/// take the process near `vm.max_map_count`.
#[test]
fn a_descriptor_with_more_gpu_regions_than_the_cap_is_refused_by_name() {
    let (initiator, gpu) = gpu_engine("gpu-fds-victim-cap", None);
    let over = kvring::gpu::MAX_PEER_GPU_REGIONS + 1;
    let handle = GpuHandle { kind: 1, handle: vec![0; 64], offset: 0, len: LEN };
    let mut descriptor = hostile_descriptor(&initiator, RegionId::new(0, 1), 0x7000_0000, handle);
    let first = descriptor.regions[0].clone();
    descriptor.regions = (0..over as u32)
        .map(|i| RegionDescriptor {
            id: RegionId::new(i, 1).raw(),
            addr: 0x7000_0000 + u64::from(i) * LEN,
            ..first.clone()
        })
        .collect();
    // A socket name, so that without the cap the open goes on to fetch.
    descriptor.gpu_fds = "kvring-gpu-fds-00000000deadbeef-0000000000006666".into();
    let addr = common::raw::fake_peer(descriptor);
    let error = initiator.open_segment_with(&addr, Some(TransportKind::CudaIpc), WAIT).unwrap_err();
    assert_eq!(error.code(), kvring::ErrorCode::ResourceLimit, "{error}");
    assert!(
        matches!(error, kvring::Error::PeerLimit { count, limit, .. } if count == over && limit == over - 1),
        "{error}"
    );
    assert!(error.to_string().contains("MAX_PEER_GPU_REGIONS"), "{error}");
    assert_eq!(gpu.open_counts().0, 0, "a region was opened before the cap refused the peer");
}
