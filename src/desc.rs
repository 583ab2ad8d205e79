//! Block descriptors.
//!
//! A [`BlockDesc`] says "copy `len` bytes between local region + offset and
//! remote region + offset". It is a fixed 40-byte `#[repr(C)]` struct with
//! no padding (zerocopy's derives check it), so the submitter's descriptor
//! arena holds it as it is and the tcp frames carry it as its bytes.

use crate::error::{Error, Result, Side};
pub use crate::region_id::RegionId;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

// The wire form is the in-memory form; refuse to build where they differ.
#[cfg(not(target_endian = "little"))]
compile_error!("kvring's wire structs assume a little-endian host");

/// One block copy: `len` bytes between a local and a remote range.
///
/// ```
/// use kvring::{BlockDesc, RegionId};
/// let d = BlockDesc::new(RegionId::new(0, 1), 0, RegionId::new(3, 1), 4096, 4096);
/// assert_eq!(d.len, 4096);
/// assert_eq!(std::mem::size_of::<BlockDesc>(), 40);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct BlockDesc {
    /// The initiator's region.
    pub local_region: RegionId,
    /// The peer's region, as the peer numbers it.
    pub remote_region: RegionId,
    /// Offset in the local region.
    pub local_offset: u64,
    /// Offset in the remote region.
    pub remote_offset: u64,
    /// Bytes to move.
    pub len: u64,
}

const _: () = assert!(std::mem::size_of::<BlockDesc>() == 40);

impl BlockDesc {
    /// A descriptor for `len` bytes at `local_offset` of `local_region` and
    /// `remote_offset` of `remote_region`.
    pub const fn new(
        local_region: RegionId,
        local_offset: u64,
        remote_region: RegionId,
        remote_offset: u64,
        len: u64,
    ) -> Self {
        Self { local_region, remote_region, local_offset, remote_offset, len }
    }

    /// The `[start, end)` of one side, or `LengthOverflow` if the end does
    /// not fit in 64 bits.
    pub fn range(&self, side: Side, desc_index: u32) -> Result<(u64, u64)> {
        let offset = match side {
            Side::Local => self.local_offset,
            Side::Remote => self.remote_offset,
        };
        match offset.checked_add(self.len) {
            Some(end) => Ok((offset, end)),
            None => Err(Error::LengthOverflow { desc_index, side, offset, len: self.len }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_id_packs_index_and_generation() {
        let id = RegionId::new(0xbeef, 0x1234_5678);
        assert_eq!(id.index(), 0xbeef);
        assert_eq!(id.generation(), 0x1234_5678);
        assert_eq!(id.raw(), 0x1234_5678_0000_beef);
        assert_eq!(RegionId::from_raw(id.raw()), id);
        assert_eq!(id.to_string(), "48879:305419896");
        // Every generation bit survives the round trip: none aliases.
        let top = RegionId::new(u32::MAX, u32::MAX);
        assert_eq!((top.index(), top.generation()), (u32::MAX, u32::MAX));
    }
}
