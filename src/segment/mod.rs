//! Segments: peers' descriptors and the handles this engine keeps for them.

pub mod cache;
pub mod descriptor;
pub mod gpu;
pub mod handle;

pub use cache::{CacheStats, SegmentCache, DEFAULT_SEGMENT_CACHE_CAPACITY};
pub use descriptor::{local_host_id, CmaReach, RdmaInfo, RemoteRegion, SegmentDescriptor};
pub use handle::PeerSegment;
