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

pub mod advertise;
pub mod auth;
pub mod config;
pub mod control;
pub mod desc;
pub mod engine;
pub mod error;
pub mod ffi;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod kv;
pub mod mem;
pub mod metadata;
mod net;
#[cfg(feature = "python")]
pub mod python;
pub mod ring;
pub mod runtime;
pub mod segment;
mod sync;
pub mod transport;

/// Control-plane messages generated from `proto/kvring/control.proto`.
#[allow(missing_docs, clippy::doc_lazy_continuation)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/kvring.control.v1.rs"));
}

pub use auth::Token;
pub use desc::{BlockDesc, RegionId};
pub use engine::{
    Batch, Completion, Engine, EngineBuilder, EngineConfig, Event, LaneStatsSnapshot, Outcome, Region, Segment,
    StatusReader, Submitter,
};
pub use error::{Error, Result, Side};
pub use mem::{Access, RegionInfo, RegionKind};
pub use proto::ErrorCode;
pub use ring::Opcode;
pub use runtime::{BatchId, BatchState};
pub use segment::TransportKind;
