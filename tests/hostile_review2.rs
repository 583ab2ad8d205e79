//! The second outside review of the surface that landed with the GPU
//! descriptor socket, attacked as an outsider would: a stranger on the host
//! that trickles its hello to the socket, and a peer (or a squatter of an
//! abstract name) whose socket never accepts.

mod common;

use common::WAIT;
use kvring::gpu::{Gpu, SimGpu};
use kvring::testing::control::{GpuHandle, RegionDescriptor, SegmentDescriptor as WireDescriptor};
use kvring::{Access, Batch, BlockDesc, Engine, RegionId, RegionInfo, TransportKind};
use std::io::{BufRead, BufReader, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LEN: u64 = 1 << 20;
const TOKEN: &str = "review2-token";

fn gpu_engine(name: &str, token: Option<&str>) -> (Engine, Arc<SimGpu>) {
    let gpu = Arc::new(SimGpu::new(1, Duration::from_micros(50)));
    let mut builder = common::builder(name).gpu(gpu.clone() as Arc<dyn Gpu>);
    if let Some(token) = token {
        builder = builder.token(token);
    }
    (builder.build().unwrap(), gpu)
}

fn any_write_done(engine: &Engine, segment: &kvring::Segment, source: RegionId) -> bool {
    let mut sub = engine.submitter().unwrap();
    segment.regions().iter().any(|remote| {
        let descs = [BlockDesc::new(source, 0, remote.id, 0, 4096)];
        let id = sub.submit(&Batch::write(segment).descs(&descs)).unwrap();
        sub.wait(id, WAIT).unwrap().is_done()
    })
}

/// A real engine serving one GPU region, in a child of this test binary.
struct Third {
    child: Child,
    words: Vec<String>,
}

impl Third {
    fn start(token: Option<&str>) -> Self {
        Self::start_with(token, None)
    }

    fn start_with(token: Option<&str>, flood: Option<&str>) -> Self {
        let mut command = Command::new(std::env::current_exe().unwrap());
        if let Some(name) = flood {
            command.env("KVRING_REVIEW2_FLOOD", name);
        }
        command
            .args(["--ignored", "--exact", "third_process", "--nocapture", "--test-threads=1"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(token) = token {
            command.env("KVRING_REVIEW2_TOKEN", token);
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
        Third { child, words }
    }
}

impl Drop for Third {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
#[ignore = "the third process of the review2 tests"]
fn third_process() {
    if let Ok(name) = std::env::var("KVRING_REVIEW2_FLOOD") {
        // A stranger: keeps opening connections to socket `name`, sending
        // nothing, until its stdin closes.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flooding = stop.clone();
        let flood = std::thread::spawn(move || {
            let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            let mut held = std::collections::VecDeque::new();
            while !flooding.load(std::sync::atomic::Ordering::Relaxed) {
                for _ in 0..16 {
                    if let Ok(s) = UnixStream::connect_addr(&addr) {
                        held.push_back(s);
                    }
                }
                while held.len() > 256 {
                    held.pop_front();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        println!("ready flooding");
        std::io::stdout().flush().unwrap();
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        flood.join().unwrap();
        return;
    }
    let token = std::env::var("KVRING_REVIEW2_TOKEN").ok();
    let (engine, _gpu) = gpu_engine("review2-third", token.as_deref());
    let region = engine.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
    let described = kvring::testing::descriptor(&engine);
    let name = described.gpu_fds.expect("a GPU engine serves its descriptor socket");
    println!("ready {} {name} {}", engine.control_addr(), region.id().raw());
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// Finding 1: the 2 s for a hello and proof was per read, not per
/// connection. A stranger (no token) that sends one byte of its hello every
/// 1.5 s held each of the server's 16 places for ~80 s; the token holder's
/// open then failed while the stranger trickled.
#[test]
fn a_stranger_trickling_its_hello_does_not_hold_the_socket_past_its_proof_deadline() {
    let third = Third::start(Some(TOKEN));
    let name = third.words[1].clone();
    let socket = || UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let mut held: Vec<UnixStream> = (0..16).map(|_| socket()).collect();
    // One byte of "KVF1" per connection every 1.5 s, for 6 s: under the
    // per-read timeout (2 s), over the per-connection one.
    let started = Instant::now();
    let mut sent = 0;
    while started.elapsed() < Duration::from_secs(6) {
        for stream in &mut held {
            let _ = stream.write_all(&b"KVF1"[sent % 4..sent % 4 + 1]);
        }
        sent += 1;
        std::thread::sleep(Duration::from_millis(1500));
    }
    // Still trickling (the stranger is not done), the token holder opens.
    let (initiator, _gpu) = gpu_engine("review2-token-holder", Some(TOKEN));
    let source = initiator.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
    let opened = initiator.open_segment_with(&third.words[0], Some(TransportKind::CudaIpc), WAIT);
    let segment = opened.expect("the token holder opens the GPU segment while a stranger trickles");
    assert!(any_write_done(&initiator, &segment, source.id()));
    drop(held);
}

/// An abstract stream socket listening with a backlog of 0 that nobody
/// accepts, its one queue place taken: a connect to it blocks.
fn full_socket(name: &str) -> (std::os::fd::OwnedFd, Vec<UnixStream>) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor made here.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let owned = std::os::fd::OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_un = std::mem::zeroed();
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (i, b) in name.bytes().enumerate() {
            addr.sun_path[i + 1] = b as libc::c_char;
        }
        let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
        assert_eq!(libc::bind(fd, (&addr as *const libc::sockaddr_un).cast(), len), 0);
        assert_eq!(libc::listen(fd, 0), 0);
        // Fill the queue with connections of our own (non-blocking, so the
        // one that finds it full fails rather than waits).
        let mut fillers = Vec::new();
        for _ in 0..4 {
            let s = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0);
            if libc::connect(s, (&addr as *const libc::sockaddr_un).cast(), len) == 0 {
                fillers.push(UnixStream::from_raw_fd(s));
            } else {
                libc::close(s);
            }
        }
        assert!(!fillers.is_empty());
        (owned, fillers)
    }
}

/// Finding 2: the opener's connect to the socket a descriptor names had no
/// deadline. A peer (here one without a token; with one, any token holder,
/// or a squatter that binds the name of an engine that just exited) whose
/// socket never accepts hung `open_segment` past its own deadline, for
/// ever.
#[test]
fn a_socket_that_never_accepts_does_not_hang_the_opener_past_its_deadline() {
    let (initiator, _gpu) = gpu_engine("review2-opener", None);
    let name = format!("kvring-gpu-fds-{:016x}-{:016x}", 0x0bad_5eed_u64, 0x6666_u64);
    let _held = full_socket(&name);
    let ours = kvring::testing::descriptor(&initiator);
    let descriptor = WireDescriptor {
        name: "squatter".into(),
        epoch: 0x6666,
        host_id: ours.host_id,
        pid: std::process::id(),
        instance: 0x1234_5678,
        gpu_fds: name,
        regions: vec![RegionDescriptor {
            id: RegionId::new(0, 1).raw(),
            len: LEN,
            access: Access::ALL.bits(),
            addr: 0x7000_0000,
            gpu: 1,
            gpu_handles: vec![GpuHandle { kind: 1, handle: vec![0; 64], offset: 0, len: LEN }],
            ..Default::default()
        }],
        ..Default::default()
    };
    let addr = common::raw::fake_peer(descriptor);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let started = Instant::now();
        let result = initiator.open_segment_with(&addr, Some(TransportKind::CudaIpc), Duration::from_secs(2));
        let _ = tx.send((started.elapsed(), result.map(|_| ()).map_err(|e| e.to_string())));
        // The engine is leaked with the thread if the open never returns.
    });
    let (took, result) =
        rx.recv_timeout(Duration::from_secs(20)).expect("open_segment hung on a connect past its deadline");
    assert!(result.is_err(), "opened a segment through a socket that never answered");
    assert!(took < Duration::from_secs(8), "took {took:?} for a 2 s deadline");
}

/// Finding 3: a peer's checksum reads its region alone, and while it reads
/// the owner's own submits naming the region failed `RegionBusy`. A peer
/// (no token here; with one, any token holder) asking for checksums back
/// to back from three threads denied the owner's batches for as long as it
/// kept asking.
#[test]
fn a_peer_asking_checksums_back_to_back_does_not_deny_the_owner_its_region() {
    const BIG: usize = 64 << 20;
    let owner = common::engine("review2-owner");
    let kv = owner.alloc_region(BIG, RegionInfo::raw()).unwrap();
    let peer = common::engine("review2-checksummer");
    let landing = peer.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let asked = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let owner_addr = owner.control_addr().to_string();
    let mut askers = Vec::new();
    for _ in 0..3 {
        let segment = peer.open_segment_with(&owner_addr, Some(TransportKind::Tcp), WAIT).unwrap();
        let (stop, asked, id) = (stop.clone(), asked.clone(), kv.id());
        askers.push(std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if segment.remote_checksum(id, 0, BIG as u64, WAIT).is_ok() {
                    asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }));
    }
    let to_peer = owner.open_segment_with(&peer.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let mut sub = owner.submitter().unwrap();
    let (mut done, mut refused) = (0, Vec::new());
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(3) {
        let descs = [BlockDesc::new(kv.id(), 0, landing.id(), 0, 4096)];
        match sub.submit(&Batch::write(&to_peer).descs(&descs)) {
            Ok(id) => done += usize::from(sub.wait(id, WAIT).unwrap().is_done()),
            Err(error) => refused.push(error.to_string()),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for asker in askers {
        asker.join().unwrap();
    }
    let checksums = asked.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("owner: {done} batches done, {} refused; peer: {checksums} checksums", refused.len());
    assert!(checksums > 0, "the peer's checksums ran");
    assert!(refused.is_empty(), "{} of the owner's submits refused, e.g. {:?}", refused.len(), refused.first());
}

/// Finding 4: an engine whose transports are [shm] that asks for shm by
/// name to a same-host peer with GPU memory opened that peer's GPU memory
/// (cuda_ipc's path: the peer's descriptor socket, or this process's
/// registry) and moved bytes into it, reported as shm: the peer's
/// descriptor took the engine onto a transport outside its list.
#[test]
fn an_engine_allowed_only_shm_does_not_reach_a_peers_gpu_memory() {
    let gpu = Arc::new(SimGpu::new(1, Duration::from_micros(50)));
    let shm_only = common::builder("review2-shm-only")
        .gpu(gpu.clone() as Arc<dyn Gpu>)
        .transports([TransportKind::Shm])
        .build()
        .unwrap();
    let source = shm_only.alloc_region(LEN as usize, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { source.fill_pattern(5) };
    let peer = common::builder("review2-gpu-peer").gpu(gpu.clone() as Arc<dyn Gpu>).build().unwrap();
    let host = peer.alloc_region(LEN as usize, RegionInfo::raw()).unwrap();
    let device = peer.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { device.fill_pattern(9) };
    let segment = shm_only.open_segment_with(&peer.control_addr().to_string(), Some(TransportKind::Shm), WAIT).unwrap();
    let mut sub = shm_only.submitter().unwrap();
    let write = |sub: &mut kvring::Submitter, to: RegionId| {
        let descs = [BlockDesc::new(source.id(), 0, to, 0, 4096)];
        sub.submit(&Batch::write(&segment).descs(&descs)).and_then(|id| sub.wait(id, WAIT)).map(|c| c.is_done())
    };
    assert!(matches!(write(&mut sub, host.id()), Ok(true)), "shm reaches the host region");
    let to_gpu = write(&mut sub, device.id());
    assert!(!matches!(to_gpu, Ok(true)), "a write into the peer's GPU memory over an shm-only engine: {to_gpu:?}");
    let mut now = vec![0u8; LEN as usize];
    // SAFETY: no batch names the region any more.
    unsafe { device.read_at(0, &mut now).unwrap() };
    assert!(now == common::pattern(LEN as usize, 9), "the peer's GPU memory kept its bytes");
}

/// Finding 5: a stranger (no token) that keeps opening connections to the
/// GPU descriptor socket, sending nothing, held its 16 places without end
/// (each for 2 s, then taken again): 3 of 3 of the token holder's cuda_ipc
/// opens failed. One process now holds at most 4 unproven places (still
/// not covered: a stranger with 4 or more processes).
#[test]
fn a_stranger_reconnecting_does_not_deny_the_token_holder_the_gpu_socket() {
    let third = Third::start(Some(TOKEN));
    // The stranger is a process of its own, as it would be.
    let stranger = Third::start_with(None, Some(&third.words[1]));
    std::thread::sleep(Duration::from_millis(500));
    let (initiator, _gpu) = gpu_engine("review2-token-holder-2", Some(TOKEN));
    let _source = initiator.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
    let mut failed = Vec::new();
    for _ in 0..3 {
        if let Err(error) = initiator.open_segment_with(&third.words[0], Some(TransportKind::CudaIpc), WAIT) {
            failed.push(error.to_string());
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    drop(stranger);
    assert!(failed.is_empty(), "{} of 3 opens failed while a stranger reconnected: {:?}", failed.len(), failed.first());
}

/// Documented, not fixed: the shm region file's `busy` word is shared with
/// every process that can open the file, i.e. any process of the owner's
/// user, token or not. One that adds 1 to it (no kvring, no token) makes
/// every `unregister` of the region wait 2 s and fail `RegionBusy`, for as
/// long as it likes; the region stays registered. (The same process can
/// write the region's bytes through the file anyway: SECURITY.md puts
/// processes of the same user outside what the token separates.)
#[test]
#[ignore = "documented, not fixed: a same-user process holds an shm region's busy word"]
fn a_same_user_process_without_the_token_cannot_hold_unregister_forever() {
    use std::os::unix::fs::FileExt;
    let owner = common::builder("review2-shm-owner").token(TOKEN).build().unwrap();
    let region = owner.alloc_region(LEN as usize, RegionInfo::raw()).unwrap();
    let path = region.shm_path().expect("alloc_region is shm-backed").to_path_buf();
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    file.write_all_at(&1u64.to_le_bytes(), 56).unwrap(); // busy (header version 5)
    let id = region.id();
    std::mem::forget(region);
    let first = owner.unregister(id);
    std::thread::sleep(Duration::from_secs(1));
    let second = owner.unregister(id);
    assert!(first.is_ok() || second.is_ok(), "unregister refused while a stranger holds busy: {first:?}, {second:?}");
}

/// A process of user `nobody` forked from this test (so it needs no file
/// access), reconnecting to an abstract socket without end and sending
/// nothing, as `third_process`'s flood does; killed on drop.
struct Stranger {
    pid: libc::pid_t,
}

impl Stranger {
    fn fork(name: &str) -> Self {
        // Built before the fork: the child allocates nothing and calls only
        // async-signal-safe functions (signal-safety(7)), as a child forked
        // from a threaded process must.
        // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        assert!(name.len() < addr.sun_path.len() - 1);
        for (to, &from) in addr.sun_path[1..].iter_mut().zip(name.as_bytes()) {
            *to = from as libc::c_char;
        }
        let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
        // SAFETY: fork has no preconditions; the child runs `flood` only.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: in the child, with `addr` and `len` built above.
            unsafe { flood(&addr, len) }
        }
        Self { pid }
    }
}

impl Drop for Stranger {
    fn drop(&mut self) {
        // SAFETY: our own child, killed and reaped once.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// The stranger's body, in the forked child: becomes `nobody`, then keeps
/// 64 connections, 16 new ones every 20 ms, until killed or orphaned.
///
/// # Safety
///
/// Only in a child just forked; `addr` and `len` name an abstract socket.
unsafe fn flood(addr: &libc::sockaddr_un, len: libc::socklen_t) -> ! {
    const NOBODY: libc::uid_t = 65534;
    if libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(NOBODY) != 0 || libc::setuid(NOBODY) != 0 {
        libc::_exit(3);
    }
    // After setuid, which clears it (credentials(7)).
    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
    let (mut held, mut next) = ([-1i32; 64], 0usize);
    loop {
        for _ in 0..16 {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            if fd < 0 {
                continue;
            }
            if libc::connect(fd, (addr as *const libc::sockaddr_un).cast(), len) != 0 {
                libc::close(fd);
                continue;
            }
            if held[next] >= 0 {
                libc::close(held[next]);
            }
            held[next] = fd;
            next = (next + 1) % held.len();
        }
        let pause = libc::timespec { tv_sec: 0, tv_nsec: 20_000_000 };
        libc::nanosleep(&pause, std::ptr::null_mut());
        if libc::getppid() == 1 {
            libc::_exit(0);
        }
    }
}

/// The rest of finding 5: a stranger of another user with six processes,
/// each holding its 4 unproven places (24, over the 16 the server has),
/// denied the token holder every place. All the processes of one user
/// other than the engine's own now hold at most 4 unproven places, and all
/// other users together at most 8: the token holder's opens go through.
/// (Processes of the engine's own user are bounded per process only:
/// docs/SECURITY.md puts them outside what the token separates.) A
/// different uid needs root to set up: CI runs as root; elsewhere the test
/// fails, saying so, rather than skipping.
#[test]
fn a_stranger_with_many_processes_does_not_deny_the_token_holder_the_gpu_socket() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "this test forks strangers of user nobody (65534): run it as root, as CI does");
    let third = Third::start(Some(TOKEN));
    let strangers: Vec<Stranger> = (0..6).map(|_| Stranger::fork(&third.words[1])).collect();
    // Long enough for every stranger to have connected many times over.
    std::thread::sleep(Duration::from_millis(500));
    let (initiator, _gpu) = gpu_engine("review2-token-holder-3", Some(TOKEN));
    let source = initiator.alloc_region(LEN as usize, RegionInfo::raw().on_gpu(0)).unwrap();
    let mut failed = Vec::new();
    for _ in 0..3 {
        match initiator.open_segment_with(&third.words[0], Some(TransportKind::CudaIpc), WAIT) {
            Ok(segment) => assert!(any_write_done(&initiator, &segment, source.id())),
            Err(error) => failed.push(error.to_string()),
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    for stranger in &strangers {
        // SAFETY: a non-blocking wait on our own child: 0 while it runs.
        let alive = unsafe { libc::waitpid(stranger.pid, std::ptr::null_mut(), libc::WNOHANG) } == 0;
        assert!(alive, "a stranger stopped (setuid to nobody failed?), so it proved nothing");
    }
    drop(strangers);
    assert!(
        failed.is_empty(),
        "{} of 3 opens failed while six processes of another user reconnected: {:?}",
        failed.len(),
        failed.first()
    );
}

/// A peer naming more shm-backed regions than the initiator maps from one
/// peer is refused by the cap's name before any file is opened: each would
/// cost a mapping here (65,536 of them would take the process past
/// `vm.max_map_count`), and a peer of this user can make files that prove
/// themselves as its own. At the cap, the open goes on to the files (these
/// do not exist, so it fails on them, not on the cap).
#[test]
fn a_descriptor_with_more_shm_regions_than_the_cap_is_refused_by_name() {
    let initiator = common::builder("review2-shm-cap").build().unwrap();
    let ours = kvring::testing::descriptor(&initiator);
    let me = std::process::id();
    let epoch = 0x6666u64;
    let descriptor = |count: usize| WireDescriptor {
        name: "hostile-shm".into(),
        epoch,
        host_id: ours.host_id.clone(),
        pid: me,
        instance: 0x1234_5678,
        regions: (0..count as u32)
            .map(|i| RegionDescriptor {
                id: RegionId::new(i, 1).raw(),
                len: 4096,
                access: Access::ALL.bits(),
                addr: 0x7000_0000 + u64::from(i) * 4096,
                shm_path: format!("/dev/shm/kvring-{me}-{epoch:016x}-{i}"),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let over = kvring::MAX_PEER_SHM_REGIONS + 1;
    let addr = common::raw::fake_peer(descriptor(over));
    let error = initiator.open_segment_with(&addr, Some(TransportKind::Shm), WAIT).unwrap_err();
    assert_eq!(error.code(), kvring::ErrorCode::ResourceLimit, "{error}");
    assert!(
        matches!(error, kvring::Error::PeerLimit { count, limit, .. } if count == over && limit == over - 1),
        "{error}"
    );
    assert!(error.to_string().contains("MAX_PEER_SHM_REGIONS"), "{error}");
    let addr = common::raw::fake_peer(descriptor(over - 1));
    let error = initiator.open_segment_with(&addr, Some(TransportKind::Shm), WAIT).unwrap_err();
    assert!(!matches!(error, kvring::Error::PeerLimit { .. }), "at the cap the files are tried: {error}");
}
