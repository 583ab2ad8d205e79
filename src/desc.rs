//! Block descriptors and their wire form.
//!
//! A [`BlockDesc`] says "copy `len` bytes between local region + offset and
//! remote region + offset". It is a fixed 32-byte `#[repr(C)]` struct that is
//! both `bytemuck::Pod` (for the in-process arena) and zerocopy
//! `FromBytes`/`IntoBytes` (for the wire), so nothing shuffles bytes by hand.
//!
//! The wire form of a batch is a 32-byte [`BatchHeader`] followed by
//! `desc_count` descriptors, all little-endian. [`decode_batch`] accepts any
//! bytes from a peer and either returns a checked batch or a clear error.

use crate::error::{Error, Result, Side};
use crate::ring::Opcode;
use bytemuck::{Pod, Zeroable};
use std::fmt;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

// The wire form is the in-memory form; refuse to build where they differ.
#[cfg(not(target_endian = "little"))]
compile_error!("kvring's wire structs assume a little-endian host");

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

/// One block copy: `len` bytes between a local and a remote range.
///
/// ```
/// use kvring::{BlockDesc, RegionId};
/// let d = BlockDesc::new(RegionId::new(0, 1), 0, RegionId::new(3, 1), 4096, 4096);
/// assert_eq!(d.len, 4096);
/// assert_eq!(std::mem::size_of::<BlockDesc>(), 32);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable, FromBytes, IntoBytes, KnownLayout, Immutable)]
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

const _: () = assert!(std::mem::size_of::<BlockDesc>() == 32);

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

/// Magic at the start of an encoded batch: "KVBT".
pub const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"KVBT");
/// Version of the batch encoding.
pub const BATCH_VERSION: u16 = 1;
/// Most descriptors one encoded batch may carry.
pub const MAX_BATCH_DESCS: u32 = 1 << 16;

/// Header of an encoded batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Pod, Zeroable, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct BatchHeader {
    /// [`BATCH_MAGIC`].
    pub magic: u32,
    /// [`BATCH_VERSION`].
    pub version: u16,
    /// [`Opcode`] as a byte.
    pub opcode: u8,
    /// Reserved, zero.
    pub flags: u8,
    /// Number of descriptors that follow.
    pub desc_count: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// Caller's tag.
    pub user_data: u64,
    /// Deadline budget in microseconds from receipt; 0 = none.
    pub deadline_us: u64,
}

const _: () = assert!(std::mem::size_of::<BatchHeader>() == 32);

/// A decoded, structurally checked batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedBatch {
    /// Direction.
    pub opcode: Opcode,
    /// Caller's tag.
    pub user_data: u64,
    /// Deadline budget in microseconds; 0 = none.
    pub deadline_us: u64,
    /// The descriptors, each with non-zero length and non-overflowing ranges.
    pub descs: Vec<BlockDesc>,
}

/// Encodes a batch: header, then descriptors.
///
/// ```
/// use kvring::{desc, BlockDesc, RegionId, Opcode};
/// let d = [BlockDesc::new(RegionId::new(0, 1), 0, RegionId::new(0, 1), 0, 64)];
/// let bytes = desc::encode_batch(Opcode::Write, 7, 0, &d);
/// let batch = desc::decode_batch(&bytes).unwrap();
/// assert_eq!(batch.descs, d);
/// ```
pub fn encode_batch(opcode: Opcode, user_data: u64, deadline_us: u64, descs: &[BlockDesc]) -> Vec<u8> {
    let header = BatchHeader {
        magic: BATCH_MAGIC,
        version: BATCH_VERSION,
        opcode: opcode as u8,
        flags: 0,
        desc_count: descs.len() as u32,
        reserved: 0,
        user_data,
        deadline_us,
    };
    let mut out = Vec::with_capacity(32 + descs.len() * 32);
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(descs.as_bytes());
    out
}

/// Decodes bytes from outside into a batch, checking magic, version,
/// opcode, count, exact length and every descriptor's arithmetic.
pub fn decode_batch(bytes: &[u8]) -> Result<DecodedBatch> {
    let (header, rest) = BatchHeader::read_from_prefix(bytes)
        .map_err(|_| Error::malformed("batch", format!("{} bytes is shorter than the 32-byte header", bytes.len())))?;
    if header.magic != BATCH_MAGIC {
        return Err(Error::malformed("batch", format!("bad magic {:#010x}", header.magic)));
    }
    if header.version != BATCH_VERSION {
        return Err(Error::VersionMismatch { got: header.version.into(), supported: BATCH_VERSION.into() });
    }
    let opcode = Opcode::from_u8(header.opcode).ok_or(Error::UnknownOpcode { opcode: header.opcode })?;
    if header.desc_count == 0 {
        return Err(Error::malformed("batch", "no descriptors"));
    }
    if header.desc_count > MAX_BATCH_DESCS {
        return Err(Error::MessageTooLarge { len: header.desc_count.into(), max: MAX_BATCH_DESCS.into() });
    }
    let expected = header.desc_count as usize * std::mem::size_of::<BlockDesc>();
    if rest.len() != expected {
        return Err(Error::malformed(
            "batch",
            format!("{} descriptors need {expected} bytes, got {}", header.desc_count, rest.len()),
        ));
    }
    let mut descs = Vec::with_capacity(header.desc_count as usize);
    for (index, raw) in rest.chunks_exact(std::mem::size_of::<BlockDesc>()).enumerate() {
        let desc =
            BlockDesc::read_from_bytes(raw).map_err(|_| Error::malformed("batch", "descriptor size mismatch"))?;
        let index = index as u32;
        if desc.len == 0 {
            return Err(Error::malformed("batch", format!("descriptor {index} has zero length")));
        }
        desc.range(Side::Local, index)?;
        desc.range(Side::Remote, index)?;
        descs.push(desc);
    }
    Ok(DecodedBatch { opcode, user_data: header.user_data, deadline_us: header.deadline_us, descs })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<BlockDesc> {
        (0..4).map(|i| BlockDesc::new(RegionId::new(1, 2), i * 4096, RegionId::new(3, 4), i * 8192, 4096)).collect()
    }

    #[test]
    fn batch_round_trips() {
        let bytes = encode_batch(Opcode::Read, 42, 500, &sample());
        assert_eq!(bytes.len(), 32 + 4 * 32);
        let batch = decode_batch(&bytes).unwrap();
        assert_eq!(batch.opcode, Opcode::Read);
        assert_eq!(batch.user_data, 42);
        assert_eq!(batch.deadline_us, 500);
        assert_eq!(batch.descs, sample());
    }

    #[test]
    fn bad_batches_get_distinct_errors() {
        let good = encode_batch(Opcode::Write, 1, 0, &sample());
        let err = decode_batch(&good[..10]).unwrap_err();
        assert!(err.to_string().contains("shorter than the 32-byte header"), "{err}");

        let mut bad_magic = good.clone();
        bad_magic[0] ^= 0xff;
        assert!(decode_batch(&bad_magic).unwrap_err().to_string().contains("bad magic"));

        let mut bad_version = good.clone();
        bad_version[4] = 9;
        assert!(matches!(decode_batch(&bad_version), Err(Error::VersionMismatch { got: 9, supported: 1 })));

        let mut bad_opcode = good.clone();
        bad_opcode[6] = 77;
        assert!(matches!(decode_batch(&bad_opcode), Err(Error::UnknownOpcode { opcode: 77 })));

        assert!(decode_batch(&good[..good.len() - 1]).unwrap_err().to_string().contains("need 128 bytes, got 127"));

        let mut too_many = good.clone();
        too_many[8..12].copy_from_slice(&(MAX_BATCH_DESCS + 1).to_le_bytes());
        assert!(matches!(decode_batch(&too_many), Err(Error::MessageTooLarge { .. })));

        let empty = encode_batch(Opcode::Write, 1, 0, &[]);
        assert!(decode_batch(&empty).unwrap_err().to_string().contains("no descriptors"));

        let overflow = [BlockDesc::new(RegionId::new(0, 0), u64::MAX - 1, RegionId::new(0, 0), 0, 4)];
        let bytes = encode_batch(Opcode::Write, 1, 0, &overflow);
        assert!(matches!(decode_batch(&bytes), Err(Error::LengthOverflow { side: Side::Local, .. })));

        let zero = [BlockDesc::new(RegionId::new(0, 0), 0, RegionId::new(0, 0), 0, 0)];
        let bytes = encode_batch(Opcode::Write, 1, 0, &zero);
        assert!(decode_batch(&bytes).unwrap_err().to_string().contains("zero length"));
    }

    #[test]
    fn region_id_packs_index_and_generation() {
        let id = RegionId::new(0xbeef, 0x1234);
        assert_eq!(id.index(), 0xbeef);
        assert_eq!(id.generation(), 0x1234);
        assert_eq!(RegionId::from_raw(id.raw()), id);
        assert_eq!(id.to_string(), "48879:4660");
    }
}
