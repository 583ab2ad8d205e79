//! Region ids: the one name a registered region has, locally, on the
//! wire, and in errors. Its own module, so that descriptors and errors both
//! use it without depending on each other.

use bytemuck::{Pod, Zeroable};
use std::fmt;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// A registered region's id: a generational index, so an id that outlives
/// its region (or was forged) is recognised rather than aliased.
///
/// The low 16 bits are the slot, the high 16 bits the slot's generation.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Pod, Zeroable, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(transparent)]
pub struct RegionId(u32);

impl RegionId {
    /// Builds an id from a slot index and its generation.
    pub const fn new(index: u16, generation: u16) -> Self {
        Self(((generation as u32) << 16) | index as u32)
    }

    /// Rebuilds an id from its raw form (as sent on the wire).
    pub const fn from_raw(raw: u32) -> Self {
        Self(raw)
    }

    /// The raw form.
    pub const fn raw(self) -> u32 {
        self.0
    }

    /// The slot index.
    pub const fn index(self) -> u16 {
        self.0 as u16
    }

    /// The slot's generation.
    pub const fn generation(self) -> u16 {
        (self.0 >> 16) as u16
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
