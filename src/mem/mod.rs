//! Local memory: region descriptions, the registry, shared-memory backing,
//! and the checksum used to verify moved bytes.

pub mod checksum;
pub mod device;
pub mod fence;
pub mod fence_file;
pub(crate) mod lease;
pub mod region;
pub mod registry;
pub mod revoke;
pub mod shm;

pub use checksum::checksum_shared;
pub use device::DeviceBacking;
pub use region::{Access, MemoryKind, RegionInfo, RegionKind};
pub use registry::{Backing, Registry, DEFAULT_MAX_REGIONS};
pub use shm::ShmMapping;
