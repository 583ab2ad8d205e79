//! Region ids: the one name a registered region has, locally, on the
//! wire, and in errors. Its own module, so that descriptors and errors both
//! use it without depending on each other.

use bytemuck::{Pod, Zeroable};
use std::fmt;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// A registered region's id: a generational index, so an id that outlives
/// its region (or was forged) is recognised rather than aliased.
///
/// The low 32 bits are the slot, the high 32 bits the slot's generation.
/// A slot whose generation reaches `u32::MAX` is retired, never reused, so
/// an id is never issued twice: each slot serves 2^32 - 1 registrations
/// (the 4,096 slots of the default registry, churned at a million a
/// second, last about 200 days; then `register` fails, it never aliases).
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(transparent)]
pub struct RegionId(u64);

impl RegionId {
    /// Builds an id from a slot index and its generation.
    pub const fn new(index: u32, generation: u32) -> Self {
        Self(((generation as u64) << 32) | index as u64)
    }

    /// Rebuilds an id from its raw form (as sent on the wire).
    pub const fn from_raw(raw: u64) -> Self {
        Self(raw)
    }

    /// The raw form.
    pub const fn raw(self) -> u64 {
        self.0
    }

    /// The slot index.
    pub const fn index(self) -> u32 {
        self.0 as u32
    }

    /// The slot's generation.
    pub const fn generation(self) -> u32 {
        (self.0 >> 32) as u32
    }
}

impl fmt::Debug for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RegionId({}:{})", self.index(), self.generation())
    }
}

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.index(), self.generation())
    }
}
