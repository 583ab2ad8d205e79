//! Hostile review 10: "KVF6" GPU descriptor requests, served again (an
//! opener from before FABRIC handles), a FABRIC region refused by name
//! (`transport::gpu_fds::server`). Each probe speaks the descriptor
//! socket's bytes as an outsider would, with the old magic: a session the
//! engine never issued, a region not registered, a stale generation, a
//! region that grants peers nothing, a range past the handles, the fence
//! table of a region peers may only read; the server answers each with a
//! refusal naming why, keeps serving the connection, passes no descriptor
//! it should not, and holds no descriptor of its own afterwards.

mod common;

use common::WAIT;
use kvring::gpu::{Gpu, SimGpu};
use kvring::{Access, Engine, RegionInfo};
use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

const LEN: usize = 1 << 20;

/// Held by every test here: one counts this process's descriptors.
static ALONE: Mutex<()> = Mutex::new(());

fn gpu_engine(name: &str, token: Option<&str>) -> Engine {
    let gpu = Arc::new(SimGpu::new(1, Duration::from_micros(50)));
    let mut builder = common::builder(name).gpu(gpu as Arc<dyn Gpu>);
    if let Some(token) = token {
        builder = builder.token(token);
    }
    builder.build().unwrap()
}

/// The opener's hello with session nonces `cn`, `sn` ("KVF1").
fn hello(cn: &[u8], sn: &[u8]) -> Vec<u8> {
    let mut bytes = b"KVF1".to_vec();
    bytes.extend_from_slice(cn);
    bytes.extend_from_slice(sn);
    bytes.extend_from_slice(&[3u8; 16]);
    bytes
}

/// A "KVF6" request: the current layout under the older magic.
fn kvf6(region: u64, first: u32, count: u32) -> Vec<u8> {
    let mut bytes = kvring::testing::gpu_fds::request(region, first, count);
    assert_eq!(&bytes[..4], b"KVF7");
    bytes[..4].copy_from_slice(b"KVF6");
    bytes
}

/// A connection to `engine`'s descriptor socket past an untokened hello.
fn connected(engine: &Engine) -> UnixStream {
    let name = kvring::testing::descriptor(engine).gpu_fds.expect("a GPU region's engine serves gpu_fds");
    let mut stream = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream.write_all(&hello(&[0; 16], &[0; 16])).unwrap();
    let mut challenge = [0u8; 56];
    stream.read_exact(&mut challenge).unwrap();
    assert_eq!(&challenge[..8], b"KVF2\0\0\0\0", "no token: no proof asked");
    stream
}

/// An answer: its kind (0 descriptors, 1 a refusal, 2 FABRIC), count (or
/// the refusal's length), handles, and a refusal's reason. Descriptors
/// passed with it are not taken (the kernel closes them).
fn answer(stream: &mut UnixStream) -> (u32, u32, u32, String) {
    let mut head = [0u8; 16];
    stream.read_exact(&mut head).unwrap();
    assert_eq!(&head[..4], b"KVF4", "an answer");
    let word = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().unwrap());
    let (kind, count, handles) = (word(4), word(8), word(12));
    let mut reason = vec![0u8; if kind == 1 { count as usize } else { 0 }];
    stream.read_exact(&mut reason).unwrap();
    (kind, count, handles, String::from_utf8_lossy(&reason).to_string())
}

fn refused(stream: &mut UnixStream, request: &[u8]) -> String {
    stream.write_all(request).unwrap();
    let (kind, _, _, reason) = answer(stream);
    assert_eq!(kind, 1, "a refusal, got kind {kind}");
    reason
}

/// This process's open descriptors.
fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

// Holds: every bad "KVF6" request is refused with its reason, on one
// connection that keeps being served (a good request after each is
// answered with one descriptor); a region's old generation reaches
// nothing of the region now in its slot.
#[test]
fn each_bad_kvf6_request_is_refused_by_name_and_the_connection_kept() {
    let _alone = ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    let target = gpu_engine("r10-kvf6-target", None);
    let good = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    let stale = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    let stale_id = stale.id();
    target.unregister(stale_id).unwrap();
    drop(stale);
    let reused = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    let private = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0).with_access(Access::LOCAL_READ)).unwrap();
    let read_only = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0).with_access(Access::REMOTE_READ)).unwrap();
    let mut stream = connected(&target);
    let served = |stream: &mut UnixStream| {
        stream.write_all(&kvf6(good.id().raw(), 0, 1)).unwrap();
        let (kind, count, handles, _) = answer(stream);
        assert_eq!((kind, count, handles), (0, 1, 1), "one descriptor of one handle");
    };
    served(&mut stream);

    let unknown = kvring::RegionId::new(4000, 1).raw();
    assert!(refused(&mut stream, &kvf6(unknown, 0, 1)).contains("not registered"));
    served(&mut stream);
    if reused.id().index() == stale_id.index() {
        assert_ne!(reused.id(), stale_id, "a new generation");
    }
    let reason = refused(&mut stream, &kvf6(stale_id.raw(), 0, 1));
    assert!(reason.contains("not registered"), "{reason}");
    served(&mut stream);
    let reason = refused(&mut stream, &kvf6(private.id().raw(), 0, 1));
    assert!(reason.contains("grants peers no right"), "{reason}");
    // A range past the handles, none asked, and first + count past u32.
    for (first, count) in [(1, 1), (0, 0), (u32::MAX - 1, u32::MAX), (7, u32::MAX)] {
        let reason = refused(&mut stream, &kvf6(good.id().raw(), first, count));
        assert!(reason.contains("handles; asked for"), "{first}+{count}: {reason}");
    }
    served(&mut stream);
    // The fence table of a region peers may only read: there is none.
    let reason = refused(&mut stream, &kvf6(read_only.id().raw(), u32::MAX, 1));
    assert!(reason.contains("no write"), "{reason}");
    served(&mut stream);
}

// Holds: a "KVF6" opener on a tokened engine proves its session as a
// "KVF7" one does. A session the engine never issued is closed before a
// byte is answered; no descriptor is passed.
#[test]
fn a_kvf6_opener_without_a_session_gets_nothing_from_a_tokened_engine() {
    let _alone = ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    let target = gpu_engine("r10-kvf6-tokened", Some("kvf6-token"));
    let region = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    let name = kvring::testing::descriptor(&target).gpu_fds.expect("served");
    let mut stream = UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    stream.write_all(&hello(&[1; 16], &[2; 16])).unwrap();
    let _ = stream.write_all(&kvf6(region.id().raw(), 0, 1));
    let mut got = Vec::new();
    let _ = stream.read_to_end(&mut got);
    assert!(got.is_empty(), "a session it never issued got {} bytes", got.len());
}

// Holds: the server keeps no descriptor of its own per answer: 200
// "KVF6" answers (each passing one descriptor, closed unread here) and
// 200 refusals leave this process (server and opener both) with the
// descriptors it had, give or take the engine's own few.
#[test]
fn kvf6_answers_and_refusals_leak_no_descriptor() {
    let _alone = ALONE.lock().unwrap_or_else(PoisonError::into_inner);
    let target = gpu_engine("r10-kvf6-fds", None);
    let region = target.alloc_region(LEN, RegionInfo::raw().on_gpu(0)).unwrap();
    let mut stream = connected(&target);
    // One exchange first: whatever the server opens once is open now.
    stream.write_all(&kvf6(region.id().raw(), 0, 1)).unwrap();
    answer(&mut stream);
    let before = fds();
    for _ in 0..200 {
        stream.write_all(&kvf6(region.id().raw(), 0, 1)).unwrap();
        assert_eq!(answer(&mut stream).0, 0, "one descriptor");
        assert!(refused(&mut stream, &kvf6(region.id().raw(), 5, 1)).contains("handles"));
    }
    let after = fds();
    assert!(after < before + 20, "{before} descriptors before 400 answers, {after} after");
}
