//! Segments: peers' descriptors and the handles this engine keeps for them.

pub mod descriptor;
pub mod handle;

pub use descriptor::{local_host_id, RemoteRegion, SegmentDescriptor, TransportKind};
pub use handle::PeerSegment;
