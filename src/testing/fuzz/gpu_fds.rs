//! The GPU descriptor socket's server fed arbitrary bytes: with a token, no
//! descriptor ever leaves it without the session's proof; every message a
//! decoder accepts encodes back to the same bytes.

use crate::auth::{Authenticator, Token};
use crate::gpu::fd::recv_with_fds;
use crate::gpu::{Gpu, SimGpu};
use crate::mem::device::DeviceBacking;
use crate::mem::registry::Backing;
use crate::mem::{RegionInfo, Registry};
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
}
