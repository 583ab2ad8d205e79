//! The GPU descriptor socket's server fed arbitrary bytes: with a token, no
//! descriptor ever leaves it without the session's proof; every message a
//! decoder accepts encodes back to the same bytes. The same bytes as a
//! server's answers to an opener: whatever it takes is of the kind it
//! asked for, and no more than it asked.

use crate::auth::{Authenticator, Token};
use crate::gpu::fd::recv_with_fds;
use crate::gpu::{Gpu, HandleKind, SimGpu};
use crate::mem::device::DeviceBacking;
use crate::mem::registry::Backing;
use crate::mem::{RegionInfo, Registry};
use crate::transport::gpu_fds::client::GpuFdClient;
use crate::transport::gpu_fds::{self, server, Answer, Challenge, Hello, Request};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};

/// A tokened engine's registry with one GPU region open to peers.
fn served() -> &'static (Arc<Registry>, Arc<Authenticator>) {
    static SERVED: OnceLock<(Arc<Registry>, Arc<Authenticator>)> = OnceLock::new();
    SERVED.get_or_init(|| {
        let gpu: Arc<dyn Gpu> = Arc::new(SimGpu::new(1, std::time::Duration::ZERO));
        let ptr = gpu.alloc_pieces(0, 4096, 4).expect("simulated memory");
        let device = Arc::new(DeviceBacking::caller(gpu, 0, ptr.0, 4 * 4096));
        let registry = Arc::new(Registry::new(4));
        let backing = Backing { shm: None, device: Some(device) };
        registry.register(ptr.0 as usize, 4 * 4096, RegionInfo::raw().on_gpu(0), backing).expect("registered");
        (registry, Arc::new(Authenticator::new(Token::new("fuzz-token"), 42)))
    })
}

/// Arbitrary bytes as a connection to a tokened GPU descriptor server, and
/// as each of its messages.
pub fn gpu_fds_connection(data: &[u8]) {
    if let Ok(bytes) = data.get(..gpu_fds::HELLO_BYTES).unwrap_or_default().try_into() {
        if let Ok(hello) = Hello::decode(bytes) {
            assert_eq!(&hello.encode(), bytes);
        }
    }
    if let Ok(bytes) = data.get(..gpu_fds::CHALLENGE_BYTES).unwrap_or_default().try_into() {
        if let Ok(challenge) = Challenge::decode(bytes) {
            assert_eq!(&challenge.encode(), bytes);
        }
    }
    if let Ok(bytes) = data.get(..gpu_fds::REQUEST_BYTES).unwrap_or_default().try_into() {
        if let Ok(request) = Request::decode(bytes) {
            assert_eq!(&request.encode(), bytes);
        }
    }
    if let Ok(bytes) = data.get(..gpu_fds::ANSWER_BYTES).unwrap_or_default().try_into() {
        if let Ok(answer) = Answer::decode(bytes) {
            assert_eq!(&answer.encode(), bytes);
        }
    }
    let (registry, auth) = served().clone();
    let (ours, theirs) = UnixStream::pair().expect("a socket pair");
    let server = std::thread::spawn(move || server::serve_connection(&theirs, registry, Some(auth), 42));
    let _ = (&ours).write_all(data);
    let _ = ours.shutdown(std::net::Shutdown::Write);
    let mut passed = 0;
    while let Ok(fds) = recv_with_fds(&ours, &mut [0u8; 1], gpu_fds::MAX_FDS_PER_MESSAGE) {
        passed += fds.len();
    }
    let _ = server.join();
    assert_eq!(passed, 0, "a descriptor left without the session's proof");
    answers_to_an_opener(data);
}

/// `data` as everything a server answers an opener (already proven) that
/// asks for a region's FABRIC handles, then for its descriptors; and again
/// after asking for its fence table page first, as cuda_ipc does.
fn answers_to_an_opener(data: &[u8]) {
    for fence_first in [false, true] {
        answers_to(data, fence_first);
    }
}

fn answers_to(data: &[u8], fence_first: bool) {
    // Within a socket's buffer: nobody reads while it is written.
    let data = &data[..data.len().min(64 << 10)];
    let (ours, theirs) = UnixStream::pair().expect("a socket pair");
    let _ = (&theirs).write_all(data);
    let _ = theirs.shutdown(std::net::Shutdown::Write);
    // Past its end, every read sees EOF at once: the deadline is a bound.
    let mut client = GpuFdClient::over(ours, std::time::Instant::now() + std::time::Duration::from_secs(5));
    let region = crate::region_id::RegionId::new(0, 1);
    if fence_first {
        // Taken or refused, the runs after it are of the kind asked only.
        let _ = client.fence_fd(region);
    }
    for (kind, handles) in [(HandleKind::Fabric, 100), (HandleKind::FileDescriptor, 3)] {
        for index in 0..handles {
            match client.handle(region, kind, handles, index) {
                Ok(shared) => assert_eq!(shared.kind(), kind, "an opener took another kind than it asked"),
                Err(_) => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn descriptor_seeds_naming_a_socket_decode_only_with_a_name_kvring_makes() {
        use prost::Message as _;
        let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/segment_descriptor");
        let decode = |name: &str| {
            let bytes = std::fs::read(seeds.join(name)).unwrap();
            crate::segment::SegmentDescriptor::from_proto(crate::proto::SegmentDescriptor::decode(&bytes[..]).unwrap())
        };
        let ours = decode("gpu_fds_socket").unwrap();
        assert_eq!(ours.gpu_fds.as_deref(), Some("kvring-gpu-fds-0000000000000007-0000000000000063"));
        assert_eq!(ours.instance, 7);
        assert!(decode("gpu_fds_not_ours").unwrap_err().to_string().contains("not a kvring socket name"));
        for name in ["gpu_fds_socket", "gpu_fds_not_ours"] {
            crate::testing::fuzz::segment_descriptor(&std::fs::read(seeds.join(name)).unwrap());
        }
    }

    #[test]
    fn the_committed_seeds_and_some_noise_pass_no_descriptor() {
        let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/gpu_fds_connection");
        for seed in std::fs::read_dir(seeds).unwrap() {
            super::gpu_fds_connection(&std::fs::read(seed.unwrap().path()).unwrap());
        }
        for n in 0..64u8 {
            let noise: Vec<u8> = (0..n as usize * 3).map(|i| (i as u8).wrapping_mul(n) ^ 0x5a).collect();
            super::gpu_fds_connection(&noise);
        }
    }

    /// A server's FABRIC answers as an opener takes them: a run it asked
    /// for is taken whole; too many handles, fewer bytes than stated, a
    /// count past the bound, or another kind than asked are refused.
    #[test]
    fn an_opener_takes_only_the_fabric_handles_it_asked_for() {
        use super::{GpuFdClient, HandleKind, UnixStream};
        use crate::gpu::{Shareable, FABRIC_HANDLE_BYTES};
        use crate::transport::gpu_fds::{Answer, MAX_FABRIC_PER_MESSAGE};
        use std::io::Write;
        let region = crate::region_id::RegionId::new(0, 1);
        let take_raw = |bytes: Vec<u8>, kind: HandleKind, handles: usize| {
            let (ours, theirs) = UnixStream::pair().unwrap();
            (&theirs).write_all(&bytes).unwrap();
            theirs.shutdown(std::net::Shutdown::Write).unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let mut client = GpuFdClient::over(ours, deadline);
            (0..handles).map(|i| client.handle(region, kind, handles, i)).collect::<Vec<_>>()
        };
        let take = |answer: Answer, payload: usize, kind: HandleKind, handles: usize| {
            let mut bytes = answer.encode().to_vec();
            bytes.extend((0..payload).map(|i| i as u8));
            take_raw(bytes, kind, handles)
        };
        let fabric = HandleKind::Fabric;
        let taken = take(Answer::Fabric { count: 2, handles: 2 }, 2 * FABRIC_HANDLE_BYTES, fabric, 2);
        let Ok(Shareable::Fabric(second)) = &taken[1] else { panic!("{taken:?}") };
        assert_eq!(second[0], FABRIC_HANDLE_BYTES as u8, "the second handle's bytes");
        let error = |answer, payload, kind, handles| {
            let taken = take(answer, payload, kind, handles);
            taken[0].as_ref().unwrap_err().to_string()
        };
        // More than asked (the run ends at the region's 2 handles).
        let more = error(Answer::Fabric { count: 3, handles: 2 }, 3 * FABRIC_HANDLE_BYTES, fabric, 2);
        assert!(more.contains("3 handles (said 3) of 2 handles, for 2 of 2"), "{more}");
        // ...after which the connection is shut: a well-formed answer left
        // behind it is never taken as the next one's.
        let mut bytes = Answer::Fabric { count: 3, handles: 2 }.encode().to_vec();
        bytes.extend_from_slice(&Answer::Fabric { count: 1, handles: 2 }.encode());
        bytes.extend_from_slice(&[7u8; FABRIC_HANDLE_BYTES]);
        let after = take_raw(bytes, fabric, 2);
        assert!(after.iter().all(Result::is_err), "{after:?}");
        // The region's handle count misstated.
        let count = error(Answer::Fabric { count: 1, handles: 9 }, FABRIC_HANDLE_BYTES, fabric, 2);
        assert!(count.contains("of 9 handles"), "{count}");
        // Fewer bytes than the handles stated: an error, not a short handle.
        let short = error(Answer::Fabric { count: 2, handles: 2 }, 2 * FABRIC_HANDLE_BYTES - 1, fabric, 2);
        assert!(short.contains("GPU descriptor socket"), "{short}");
        // Past the bound: refused from the header, nothing read after it.
        let past = MAX_FABRIC_PER_MESSAGE as u32 + 1;
        let bound = error(Answer::Fabric { count: past, handles: past }, 0, fabric, past as usize);
        assert!(bound.contains(&format!("an answer of {past} FABRIC handles")), "{bound}");
        // Another kind than the descriptor said.
        let kind = error(Answer::Fabric { count: 1, handles: 1 }, FABRIC_HANDLE_BYTES, HandleKind::FileDescriptor, 1);
        assert!(kind.contains("for FileDescriptor handles"), "{kind}");
        let kind = error(Answer::Descriptors { count: 0, handles: 1 }, 0, fabric, 1);
        assert!(kind.contains("for Fabric handles"), "{kind}");
    }
}
