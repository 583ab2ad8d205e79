//! For kvring's own tests, benches and fuzz targets only (cargo feature
//! `testing`): the wire formats, for tests that speak the protocols as an
//! outsider would (a hostile client, a peer that answers out of step), the
//! pieces a bench measures on their own, and the fuzz entry points. Not
//! part of kvring's API: nothing here is covered by semver, and `cargo doc`
//! does not show it.

pub mod fuzz;

/// End-to-end checksums: corrupting a landed block on purpose.
pub mod checksum {
    pub use crate::transport::checksum::{
        corrupt_landing_at, corrupt_rdma_landings_with, RemoteCorrupter, VERIFIED_PIECE_BYTES,
    };
}

/// The control protocol: preface, frames, the client, the version.
pub mod control {
    pub use crate::auth::{Initiator, Session};
    pub use crate::control::frame::CONTROL_VERSION;
    pub use crate::control::frame::{
        decode_response, preface, read_frame, response, write_frame, MAX_CONTROL_MESSAGE_BYTES,
    };
    pub use crate::control::ControlClient;
    pub use crate::proto::*;
}

/// The tcp data protocol: frame headers, the hello, and a tokened
/// connection's frame seal.
pub mod tcp {
    pub use crate::seal::{End, FrameSeal};
    pub use crate::transport::tcp::frame::{
        FrameHeader, FrameOp, FLAG_LAST, FRAME_HEADER_BYTES, MAX_FRAME_PAYLOAD_BYTES,
    };
    pub use crate::transport::tcp::hello::{
        ClientHello, ClientProof, ServerHello, FLAG_PROOF_REQUIRED, SERVER_HELLO_BYTES,
    };
    #[cfg(feature = "testing")]
    pub use crate::transport::tcp::redial::set_quiet_redial_after;
}

/// Work-request building, measured on its own by `benches/rdma_post.rs`.
pub mod rdma {
    pub use crate::transport::rdma::post::{build, KeyedBlock, Keys, PostConfig};
}

/// The submission rings, measured against rtrb and crossbeam.
/// The GPU descriptor server's (`gpu_fds`) wire forms, through the
/// encoders its client uses, so a hostile test cannot drift from them.
pub mod gpu_fds {
    /// A descriptor request for handles `first..first + count` of region
    /// `region` (its raw id), byte for byte as the client sends it.
    pub fn request(region: u64, first: u32, count: u32) -> Vec<u8> {
        crate::transport::gpu_fds::Request { region, first, count, takes_fabric: true }.encode().to_vec()
    }

    /// An answer to a request, byte for byte as the server encodes it:
    /// `kind` 0 descriptors, 1 a refusal (`count` its length), 2 FABRIC
    /// handles.
    pub fn answer(kind: u8, count: u32, handles: u32) -> Vec<u8> {
        use crate::transport::gpu_fds::Answer;
        let answer = match kind {
            0 => Answer::Descriptors { count, handles },
            1 => Answer::Refused { len: count },
            _ => Answer::Fabric { count, handles },
        };
        answer.encode().to_vec()
    }

    /// The opener's side of a connection taken as proven, driven as
    /// `cuda_ipc` drives it: for tests that play a hostile exporter.
    #[derive(Debug)]
    pub struct Opener(crate::transport::gpu_fds::client::GpuFdClient);

    impl Opener {
        /// An opener over `stream` whose every wait ends by `deadline`.
        pub fn over(stream: std::os::unix::net::UnixStream, deadline: std::time::Instant) -> Self {
            Opener(crate::transport::gpu_fds::client::GpuFdClient::over(stream, deadline))
        }

        /// Region `region`'s fence table page descriptor.
        pub fn fence(&mut self, region: crate::RegionId) -> crate::Result<std::os::fd::OwnedFd> {
            self.0.fence_fd(region)
        }

        /// What opens handle `index` of `region`'s `handles`, all `kind`.
        pub fn handle(
            &mut self,
            region: crate::RegionId,
            kind: crate::gpu::HandleKind,
            handles: usize,
            index: usize,
        ) -> crate::Result<crate::gpu::Shareable> {
            self.0.handle(region, kind, handles, index)
        }
    }
}

/// Fence tables (`mem::fence`) and a GPU region's table page
/// (`mem::fence_file`), for tests that play a hostile peer mapping one.
pub mod fence {
    pub use crate::mem::fence::{FenceFailed, FenceView, Pass, Span};
    pub use crate::mem::fence_file::SharedFences;
}

pub mod ring {
    pub use crate::ring::{channel, Full};
}

/// The etcd client, for tests that check what an engine published.
pub mod etcd {
    pub use crate::metadata::etcd::{Etcd, EtcdUrl};
}

/// The redis and HTTP metadata clients, for tests that check what an
/// engine published; the key prefix.
pub mod metadata {
    pub use crate::metadata::directory::DEFAULT_PREFIX;
    pub use crate::metadata::mooncake_http::{HttpMetadata, HttpMetadataUrl};
    pub use crate::metadata::redis::{Redis, RedisUrl};
}

/// The HTTP response parser, for tests that scrape `/metrics`.
pub mod http {
    pub use crate::http::{parse_response, Response};
}

pub use crate::engine::fill_pattern;

pub use crate::mem::checksum::checksum;
pub use crate::segment::gpu::FABRIC_FOR_OLDER_PEERS;
pub use crate::segment::{RdmaInfo, SegmentDescriptor};

/// What `engine` tells peers in a handshake: for tests that check it or
/// forge a lie from it.
pub fn descriptor(engine: &crate::Engine) -> SegmentDescriptor {
    engine.descriptor()
}

/// The peer's KV layout fetched over a fresh control connection (a
/// handshake with a token), past the segment handle's cached copy: the
/// per-call cost `Segment::kv_layout` had before it kept the layout, as
/// `benches/kv_layout.rs`'s baseline.
pub fn kv_layout_uncached(
    segment: &crate::Segment,
    timeout: std::time::Duration,
) -> crate::Result<crate::kv::KvLayout> {
    segment.kv_layout_uncached(timeout)
}

/// Starts the next generation of every free region slot of `engine` at
/// `generation` (at least 1), so a test reaches a slot's last generations
/// (where it is retired) without 2^32 registrations. Returns how many
/// slots it set.
pub fn start_free_region_slots_at(engine: &crate::Engine, generation: u32) -> usize {
    engine.registry().start_free_slots_at(generation)
}

/// Makes `engine`'s lane `lane` panic while it executes the next batch part
/// it takes, for tests of what a panicking lane does to the batches it
/// holds. Returns false when the engine has no such lane.
pub fn panic_lane_on_next_part(engine: &crate::Engine, lane: usize) -> bool {
    engine.lane_shared(lane).map(|shared| shared.panic_on_next_part()).is_some()
}

/// Stops `engine`'s control server alone, its lanes and QPs kept: a peer
/// that no longer answers (for the rdma fence's cut-off).
pub fn stop_control_server(engine: &crate::Engine) {
    engine.stop_control();
}

/// Makes every target of this process stop answering rdma's CRC32C
/// requests (as a stalled peer would) until the guard drops.
pub fn stall_crc32c_answers() -> StalledAnswers {
    StalledAnswers(crate::engine::crc32c_stall::hold())
}

/// Held CRC32C answers ([`stall_crc32c_answers`]), released when dropped.
#[derive(Debug)]
pub struct StalledAnswers(crate::engine::crc32c_stall::Stalled);

impl StalledAnswers {
    /// How many requests reached a target and wait for their answer now.
    pub fn waiting(&self) -> usize {
        self.0.waiting()
    }
}

/// Holds off this process's fences, as a fence in progress does (an rdma
/// connect's handler waits for it), until the guard drops.
pub fn hold_fences() -> std::sync::MutexGuard<'static, ()> {
    crate::Engine::hold_fences()
}

/// The cma check before every call, measured by `benches/cma_check.rs`.
pub mod cma {
    pub use crate::transport::cma::cost::{check_cost, CheckCost};
}
