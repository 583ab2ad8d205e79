//! kvring moves KV-cache blocks between the prefill and decode instances of
//! disaggregated LLM inference.
//!
//! An inference engine registers its KV-cache memory with an [`Engine`],
//! opens a peer's [`Segment`], and submits [`Batch`]es of [`BlockDesc`]s
//! through a per-thread [`Submitter`] (an io_uring-style pair of rings per
//! lane). Pinned lanes drain the rings, validate every descriptor and move
//! the bytes over a transport; callers `wait` on a batch with a deadline or
//! `reap` completions.
//!
//! ```no_run
//! use kvring::{Batch, BlockDesc, Engine, RegionInfo};
//! use std::time::Duration;
//!
//! let engine = Engine::builder().name("prefill-0").build()?;
//! let kv = engine.alloc_region(1 << 20, RegionInfo::raw())?;
//! let decode = engine.open_segment("127.0.0.1:7100")?;
//! let mut sub = engine.submitter()?;
//! let descs = [BlockDesc::new(kv.id(), 0, decode.region(0)?, 0, 4096)];
//! let id = sub.submit(&Batch::write(&decode).descs(&descs).deadline(Duration::from_millis(50)))?;
//! match sub.wait(id, Duration::from_secs(1))? {
//!     kvring::Outcome::Done { bytes } => assert_eq!(bytes, 4096),
//!     other => panic!("{other:?}"),
//! }
//! # Ok::<(), kvring::Error>(())
//! ```
#![deny(missing_docs, missing_debug_implementations, unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod advertise;
mod arrival;
mod auth;
pub mod config;
mod control;
mod deadline;
mod delivered;
mod desc;
mod engine;
mod error;
mod ffi;
mod http;
pub mod kv;
mod log;
mod mem;
mod metadata;
mod net;
mod notify;
mod proto;
#[cfg(feature = "python")]
mod python;
mod region_id;
mod ring;
mod runtime;
mod seal;
mod segment;
mod sync;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing;
mod transport;

pub mod gpu;
pub mod host;
pub mod rdma;

pub use advertise::Advertised;
pub use auth::Token;
pub use desc::BlockDesc;
pub use engine::{
    Batch, Completion, Engine, EngineBuilder, EngineConfig, Event, HostPinStats, Outcome, Region, Segment,
    StatusReader, Submitter,
};
pub use error::{Error, Result, Side};
pub use mem::{Access, MemoryKind, RegionInfo, RegionKind};
pub use metadata::{EtcdUrl, HttpMetadataUrl, MetadataMode, RedisUrl};
pub use net::AdmissionLimits;
pub use notify::{Notification, NotifyQuota};
pub use proto::ErrorCode;
pub use region_id::RegionId;
pub use ring::Opcode;
pub use runtime::{BackoffPolicy, BatchId, BatchState, LaneStatsSnapshot};
pub use segment::{CacheStats, RemoteRegion};
pub use transport::shm::{MAX_PEER_SHM_REGIONS, MAX_SHM_REGIONS_MAPPED};
pub use transport::TransportKind;
