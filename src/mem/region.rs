//! What a region is: its kind, layer, block size and access rights.

use crate::proto;
use std::fmt;

/// What a region holds, as the KV-cache layer labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RegionKind {
    /// Untyped bytes.
    #[default]
    Raw,
    /// Key cache (or MLA latent cache).
    Key,
    /// Value cache.
    Value,
    /// Index buffer (e.g. DeepSeek sparse-attention indexer cache).
    Index,
}

impl RegionKind {
    /// The wire form.
    pub fn to_proto(self) -> proto::RegionKind {
        match self {
            RegionKind::Raw => proto::RegionKind::Raw,
            RegionKind::Key => proto::RegionKind::Key,
            RegionKind::Value => proto::RegionKind::Value,
            RegionKind::Index => proto::RegionKind::Index,
        }
    }

    /// From the wire form.
    pub fn from_proto(kind: proto::RegionKind) -> Self {
        match kind {
            proto::RegionKind::Raw => RegionKind::Raw,
            proto::RegionKind::Key => RegionKind::Key,
            proto::RegionKind::Value => RegionKind::Value,
            proto::RegionKind::Index => RegionKind::Index,
        }
    }
}

/// Access rights of a region, as a small bit set.
///
/// ```
/// use kvring::Access;
/// let a = Access::LOCAL_READ | Access::REMOTE_WRITE;
/// assert!(a.contains(Access::REMOTE_WRITE));
/// assert!(!a.contains(Access::REMOTE_READ));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Access(u8);

impl Access {
    /// This engine may read it (source of a WRITE).
    pub const LOCAL_READ: Access = Access(1);
    /// This engine may write it (destination of a READ).
    pub const LOCAL_WRITE: Access = Access(2);
    /// Peers may read it (source of their READ).
    pub const REMOTE_READ: Access = Access(4);
    /// Peers may write it (destination of their WRITE).
    pub const REMOTE_WRITE: Access = Access(8);
    /// Every right.
    pub const ALL: Access = Access(15);
    /// No right.
    pub const NONE: Access = Access(0);

    /// True when every right in `other` is present.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// True when any right in `other` is present.
    pub const fn intersects(self, other: Access) -> bool {
        self.0 & other.0 != 0
    }

    /// The raw bits (as sent on the wire).
    pub const fn bits(self) -> u32 {
        self.0 as u32
    }

    /// From raw bits; unknown bits are dropped.
    pub const fn from_bits(bits: u32) -> Self {
        Access((bits & 15) as u8)
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Self::LOCAL_READ, "lr"),
            (Self::LOCAL_WRITE, "lw"),
            (Self::REMOTE_READ, "rr"),
            (Self::REMOTE_WRITE, "rw"),
        ];
        let set: Vec<_> = names.iter().filter(|(a, _)| self.contains(*a)).map(|(_, n)| *n).collect();
        write!(f, "Access({})", set.join("|"))
    }
}

/// Everything about a region besides where it is.
///
/// ```
/// use kvring::{RegionInfo, RegionKind};
/// let info = RegionInfo::raw().with_kind(RegionKind::Key).with_layer(3).with_block_bytes(4096);
/// assert_eq!(info.layer, 3);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegionInfo {
    /// What it holds.
    pub kind: RegionKind,
    /// Model layer, for KV regions.
    pub layer: u32,
    /// Bytes per KV block; 0 when not a KV region.
    pub block_bytes: u64,
    /// Who may read or write it.
    pub access: Access,
    /// Where its bytes live: host memory, or a GPU's.
    pub memory: MemoryKind,
}

/// Where a region's bytes live. Registering a range checks it against the
/// engine's GPU provider: a device pointer said to be host memory, or host
/// memory said to be a GPU's, is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MemoryKind {
    /// Host memory: the lanes copy it, NICs and sockets read it.
    #[default]
    Host,
    /// Memory of GPU `n`: never touched by a lane (only by the GPU's copy
    /// engines and NICs that can reach it).
    Gpu(u32),
}

impl RegionInfo {
    /// Untyped host bytes, every access right.
    pub const fn raw() -> Self {
        Self { kind: RegionKind::Raw, layer: 0, block_bytes: 0, access: Access::ALL, memory: MemoryKind::Host }
    }

    /// In the memory of GPU `device`.
    pub const fn on_gpu(mut self, device: u32) -> Self {
        self.memory = MemoryKind::Gpu(device);
        self
    }

    /// With another kind.
    pub const fn with_kind(mut self, kind: RegionKind) -> Self {
        self.kind = kind;
        self
    }

    /// With a layer number.
    pub const fn with_layer(mut self, layer: u32) -> Self {
        self.layer = layer;
        self
    }

    /// With bytes per block.
    pub const fn with_block_bytes(mut self, block_bytes: u64) -> Self {
        self.block_bytes = block_bytes;
        self
    }

    /// With other access rights.
    pub const fn with_access(mut self, access: Access) -> Self {
        self.access = access;
        self
    }
}

impl Default for RegionInfo {
    fn default() -> Self {
        Self::raw()
    }
}
