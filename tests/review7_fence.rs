//! Hostile review 7: fenced destinations after the GPU region's fence
//! table page (`mem::fence_file`), its FENCE_TABLE request on the GPU
//! descriptor socket, the cuda_ipc lane's held passes and the staged tcp
//! re-check. Each test is one probe of the review (docs/SECURITY.md: a
//! grant nobody was given passes no fence; bad input is a typed refusal,
//! never a panic or `SIGBUS`; a fence never returns while a stale copy may
//! still land; every wait has a deadline).

mod common;

use common::{fenced, pattern, WAIT};
use kvring::gpu::{Gpu, SimGpu};
use kvring::testing::fence::{FenceFailed, SharedFences, Span};
use kvring::{Access, Batch, BlockDesc, Engine, Error, Outcome, Region, RegionId, RegionInfo, Segment, TransportKind};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

const MIB: usize = 1 << 20;
const BLOCK: u64 = 64 * 1024;
/// The fence table request's `first` (`gpu_fds::FENCE_TABLE`).
const FENCE_TABLE: u32 = u32::MAX;

/// An initiator pushing a MiB into the first MiB of a 2 MiB target region
/// over `transport` (GPU memory at the target for cuda_ipc).
struct Pair {
    sim: Arc<SimGpu>,
    initiator: Engine,
    local: Region,
    segment: Segment,
    target: Engine,
    remote: Region,
}

impl Pair {
    fn new(transport: TransportKind, remote_on_gpu: bool) -> Self {
        let sim = Arc::new(SimGpu::new(1, Duration::from_micros(100)));
        let gpu = sim.clone() as Arc<dyn Gpu>;
        let target = common::builder("review7-target").gpu(gpu.clone()).build().unwrap();
        let info = if remote_on_gpu { RegionInfo::raw().on_gpu(0) } else { RegionInfo::raw() };
        let remote = target.alloc_region(2 * MIB, info).unwrap();
        let initiator = common::builder("review7-initiator").gpu(gpu).build().unwrap();
        let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
        // SAFETY: no batch touches these bytes yet.
        unsafe { local.write_at(0, &pattern(MIB, 7)).unwrap() };
        let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
        assert_eq!(segment.transport(), transport);
        Self { sim, initiator, local, segment, target, remote }
    }

    fn blocks(&self) -> Vec<BlockDesc> {
        let remote = self.segment.region(0).unwrap();
        (0..MIB as u64 / BLOCK).map(|i| BlockDesc::new(self.local.id(), i * BLOCK, remote, i * BLOCK, BLOCK)).collect()
    }

    fn push(&self, grant: u32) -> Outcome {
        let mut sub = self.initiator.submitter().unwrap();
        let id = sub.submit(&Batch::write(&self.segment).descs(&self.blocks()).grant(grant)).unwrap();
        sub.wait(id, WAIT).unwrap()
    }

    fn owned_by(&self, byte: u8) {
        // SAFETY: fenced: no write under an older grant is in the range.
        unsafe { self.remote.write_at(0, &vec![byte; MIB]).unwrap() };
    }

    fn read(&self) -> Vec<u8> {
        common::read(&self.remote, 0, MIB)
    }
}

/// Probe 1: a sender naming a grant nobody was given (`u32::MAX`, or the
/// one after the last entered) is refused on every path, as tcp refused
/// it before; one-sided writers checked only the entries, and a made-up
/// grant above them all passed every fence (fails before the `issued`
/// word on shm, cma and cuda_ipc).
fn made_up_grants_are_refused(transport: TransportKind, remote_on_gpu: bool) {
    let p = Pair::new(transport, remote_on_gpu);
    let given = p.target.fence(p.remote.id(), 0, MIB as u64).unwrap();
    p.owned_by(0xEE);
    for made_up in [u32::MAX, given + 1] {
        let outcome = p.push(made_up);
        // tcp's target refuses the writes after a GRANT naming a grant its
        // process never issued, and keeps the connection (the grant given
        // below goes over the same one); one its process issued for
        // another table is above this table's `issued` word: `Fenced`, as
        // on every path.
        assert!(fenced(&outcome), "{transport:?}: grant {made_up} was never given, got {outcome:?}");
        assert_eq!(p.read(), vec![0xEE; MIB], "{transport:?}: nothing under grant {made_up} landed");
    }
    p.push(given).into_result().unwrap_or_else(|e| panic!("{transport:?}: the grant given: {e}"));
    assert_eq!(p.read(), pattern(MIB, 7), "{transport:?}: the grant given lands");
}

#[test]
fn probe1_shm_refuses_a_grant_never_given() {
    made_up_grants_are_refused(TransportKind::Shm, false);
}

#[test]
fn probe1_cma_refuses_a_grant_never_given() {
    // cma reaches caller memory too; an engine-allocated region is enough
    // for its page's table, which is the one checked here.
    made_up_grants_are_refused(TransportKind::Cma, false);
}

#[test]
fn probe1_tcp_refuses_a_grant_never_given() {
    made_up_grants_are_refused(TransportKind::Tcp, false);
    made_up_grants_are_refused(TransportKind::Tcp, true);
}

#[test]
fn probe1_cuda_ipc_refuses_a_grant_never_given() {
    made_up_grants_are_refused(TransportKind::CudaIpc, true);
}

/// Reads until EOF, `limit` bytes, or the socket's timeout.
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

/// One FENCE_TABLE request for `region` to an untokened engine's GPU
/// descriptor socket `name`: the answer's 16 bytes (and a refusal's reason
/// after them) and the descriptors that came with it.
fn ask_fence_table(name: &str, region: u64) -> (Vec<u8>, Vec<OwnedFd>) {
    let mut stream = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    let mut hello = b"KVF1".to_vec();
    hello.extend_from_slice(&[0u8; 16 * 3]);
    stream.write_all(&hello).unwrap();
    assert_eq!(&read_some(&mut stream, 56)[..4], b"KVF2", "a challenge");
    stream.write_all(&kvring::testing::gpu_fds::request(region, FENCE_TABLE, 1)).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let mut answer = vec![0u8; 16 + 4096];
    let mut space = [0u8; 64];
    let mut iov = libc::iovec { iov_base: answer.as_mut_ptr().cast(), iov_len: answer.len() };
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = space.len();
    // SAFETY: recvmsg into the buffers `msg` points at, all alive here.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    assert!(n >= 16, "an answer, got {n}");
    let mut fds = Vec::new();
    // SAFETY: walking the control messages recvmsg filled in.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                let data = libc::CMSG_DATA(cmsg).cast::<i32>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    answer.truncate(n as usize);
    (answer, fds)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Probes 2 and 5, the socket side: a FENCE_TABLE request for a region
/// peers may only read, one not registered, a host region, gets a typed
/// refusal with its reason and no descriptor; a writable GPU region's page
/// comes sealed against shrinking, growing and new seals; asking for it
/// again and again makes the target create no memfd and keep no
/// descriptor (one page per region, made at registration).
#[test]
fn probe2_fence_table_requests_are_refused_or_answered_sealed_and_cost_no_descriptors() {
    let sim = Arc::new(SimGpu::new(1, Duration::from_micros(50)));
    let target = common::builder("review7-fds").gpu(sim as Arc<dyn Gpu>).build().unwrap();
    let writable = target.alloc_region(MIB, RegionInfo::raw().on_gpu(0)).unwrap();
    let read_only = Access::LOCAL_READ | Access::LOCAL_WRITE | Access::REMOTE_READ;
    let readable = target.alloc_region(MIB, RegionInfo::raw().on_gpu(0).with_access(read_only)).unwrap();
    let host = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let name = kvring::testing::descriptor(&target).gpu_fds.expect("a GPU region's engine serves gpu_fds");

    let unknown = RegionId::new(900, 3).raw();
    for (region, why) in [
        (readable.id().raw(), "no write"),
        (unknown, "not registered"),
        (host.id().raw(), "not GPU memory"),
        (writable.id().raw() ^ (1 << 40), "not registered"),
    ] {
        let (answer, fds) = ask_fence_table(&name, region);
        assert_eq!(&answer[..8], b"KVF4\x01\0\0\0", "a refusal for {region:#x}");
        let reason = String::from_utf8_lossy(&answer[16..]);
        assert!(reason.contains(why), "{region:#x}: {reason}");
        assert!(fds.is_empty(), "{region:#x}: no descriptor with a refusal");
    }

    let (answer, fds) = ask_fence_table(&name, writable.id().raw());
    assert_eq!(&answer[..8], b"KVF4\0\0\0\0", "the writable region's page");
    assert_eq!(fds.len(), 1);
    // SAFETY: fcntl(F_GET_SEALS) on a descriptor we own.
    let seals = unsafe { libc::fcntl(fds[0].as_raw_fd(), libc::F_GET_SEALS) };
    let want = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    assert_eq!(seals & want, want, "sealed before it is passed");
    // SAFETY: ftruncate on a descriptor we own: refused by the seals.
    assert_ne!(unsafe { libc::ftruncate(fds[0].as_raw_fd(), 0) }, 0, "a peer cannot shrink it under the owner");
    drop(fds);

    let before = open_fds();
    for _ in 0..64 {
        let (_, fds) = ask_fence_table(&name, writable.id().raw());
        assert_eq!(fds.len(), 1);
    }
    // The server's threads close their copies once sent; give them a moment.
    let deadline = std::time::Instant::now() + WAIT;
    while open_fds() > before && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(open_fds() <= before, "64 requests left {} descriptors open", open_fds() - before);
}

/// A memfd of `len` bytes with `seals` added.
fn memfd(len: i64, seals: i32) -> OwnedFd {
    // SAFETY: memfd_create with a NUL-terminated name; owned at once.
    let fd = unsafe { libc::memfd_create(c"review7".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain calls on a descriptor we own.
    unsafe {
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), len), 0);
        if seals != 0 {
            assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
        }
    }
    fd
}

/// Probe 2, the page side: pages a hostile target could pass are refused
/// with a reason (unsealed, short, write-sealed, not a file), or mapped
/// without risk (sealed against shrinking: growing it later, or a huge
/// sparse size, cannot fault the reader), never a `SIGBUS` or a panic.
#[test]
fn probe2_hostile_pages_are_refused_or_harmless() {
    let refused = |fd: OwnedFd, why: &str| {
        let reason = SharedFences::open_peer(fd).unwrap_err();
        assert!(reason.contains(why), "{why}: {reason}");
    };
    refused(memfd(4096, 0), "not sealed");
    refused(memfd(64, libc::F_SEAL_SHRINK), "bytes");
    refused(memfd(0, libc::F_SEAL_SHRINK | libc::F_SEAL_GROW), "bytes");
    // Sealed against writes: a shared writable mapping is refused (EPERM).
    refused(memfd(4096, libc::F_SEAL_SHRINK | libc::F_SEAL_WRITE), "mapping");
    let (read, _write) = std::io::pipe().unwrap();
    refused(OwnedFd::from(read), "not sealed");

    // Growable, then grown under the mapping: the mapped page stays.
    let growable = memfd(4096 * 4, libc::F_SEAL_SHRINK);
    let grower = growable.try_clone().unwrap();
    let page = SharedFences::open_peer(growable).unwrap();
    // SAFETY: ftruncate on a descriptor we own.
    assert_eq!(unsafe { libc::ftruncate(grower.as_raw_fd(), 1 << 30) }, 0);
    // SAFETY: as above; the shrink seal refuses it.
    assert_ne!(unsafe { libc::ftruncate(grower.as_raw_fd(), 100) }, 0, "no shrinking under a mapping");
    let view = page.view();
    view.fence(&[Span::range(0, 8)], 3, || true).unwrap();
    assert!(!view.enter().unwrap().admits(0, 8, 2));

    // A huge sparse page: only the table's bytes are mapped.
    let huge = SharedFences::open_peer(memfd(1 << 40, libc::F_SEAL_SHRINK)).unwrap();
    assert!(huge.view().enter().unwrap().admits(0, 8, 0));
}

/// Probe 3: a peer that maps the page scribbles every word: the owner's
/// fence ends at its deadline (`Busy`), never hangs or panics; no span
/// arithmetic overflows (count * stride past 2^64, len 0, start + len
/// wrapping); a made-up grant stays refused where the scribbled entries
/// still fence.
#[test]
fn probe3_a_scribbled_table_costs_refusals_and_busy_fences_only() {
    let owner = SharedFences::create().unwrap();
    let peer = SharedFences::open_peer(owner.share().unwrap()).unwrap();
    let words = peer.view().words();
    // busy words at the top: the owner's fence waits, then gives up.
    words[1].store(u64::MAX, Ordering::SeqCst);
    words[2].store(u64::MAX, Ordering::SeqCst);
    let mut looks = 0;
    let waited = owner.view().fence(&[Span::range(0, 64)], 5, || {
        looks += 1;
        looks < 100
    });
    assert!(matches!(waited, Err(FenceFailed::Busy(_))), "{waited:?}");
    // Entering wraps the word, never panics; the fence still ends.
    drop(owner.view().enter());
    // Every word noise, in patterns that stress the span arithmetic.
    let noise: [u64; 8] = [0, 1, u64::MAX, u64::MAX - 1, 1 << 63, 4096, u64::MAX / 3, 7];
    for round in 0..64usize {
        for (i, word) in words.iter().enumerate() {
            word.store(noise[(i * 7 + round * 3) % noise.len()].wrapping_add((i / 5) as u64), Ordering::SeqCst);
        }
        let view = owner.view();
        if let Some(pass) = view.enter() {
            for (start, end) in [(0, 0), (0, 1), (u64::MAX - 1, u64::MAX), (5, 3), (1 << 63, u64::MAX)] {
                let _ = pass.admits(start, end, round as u32);
                let _ = pass.admits(start, end, u32::MAX);
            }
        }
        let spans = [
            Span { start: u64::MAX - 3, len: 8, stride: u64::MAX, count: u64::MAX },
            Span { start: 0, len: 0, stride: 0, count: 0 },
            Span::range(u64::MAX, u64::MAX),
        ];
        let _ = view.fence(&spans, round as u32 + 10, || false);
    }
    // A peer may raise `issued` too (it writes the page, as it may write
    // the region's bytes itself); untouched, the word keeps a made-up
    // grant out, and the owner's tcp adds its process's own check.
    let clean = SharedFences::create().unwrap();
    clean.view().fence(&[Span::range(0, 64)], 9, || true).unwrap();
    assert!(!clean.view().enter().unwrap().admits(0, 8, u32::MAX));
}

/// Probe 4: a chunk whose completion query fails may still have a copy
/// running (the driver says nothing about it): its fence count must not be
/// released as if it ended. Before, the lane dropped the count and the
/// owner's next `fence` returned its grant at once; now the count stays in
/// the table (poisoned) and every later fence of the region fails
/// `RegionBusy` after its wait (fail safe: the owner learns that the range
/// is not known clean).
fn a_failed_copy_keeps_the_fence_busy(transport: TransportKind) {
    let p = Pair::new(transport, true);
    let given = p.target.fence(p.remote.id(), 0, MIB as u64).unwrap();
    p.sim.fail_next_copy();
    let outcome = p.push(given);
    assert!(matches!(outcome, Outcome::Failed(_)), "{transport:?}: the copy failed: {outcome:?}");
    for attempt in 0..2 {
        match p.target.fence(p.remote.id(), 0, MIB as u64) {
            Err(Error::RegionBusy { .. }) => {}
            other => panic!("{transport:?} fence {attempt}: a copy of unknown end is in the range: {other:?}"),
        }
    }
}

#[test]
fn probe4_cuda_ipc_a_copy_whose_query_failed_keeps_the_range_busy() {
    a_failed_copy_keeps_the_fence_busy(TransportKind::CudaIpc);
}

#[test]
fn probe4_staged_tcp_a_copy_whose_query_failed_keeps_the_range_busy() {
    a_failed_copy_keeps_the_fence_busy(TransportKind::Tcp);
}
