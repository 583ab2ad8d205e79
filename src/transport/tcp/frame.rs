//! TCP data frames: a fixed 72-byte zerocopy header, then (for WRITE and
//! READ_DATA) the payload. Every header a target or initiator reads comes
//! from outside and goes through [`FrameHeader::decode`] (fuzzed).
//!
//! On a connection that proved a tokened session, every header carries its
//! number in its direction and a MAC under the connection's own key
//! ([`FrameSeal`]), checked before the header is acted on: no header can be
//! injected, replayed, reordered or altered on the path. Payload bytes are
//! not covered. Without a token both fields are zero and nothing is
//! computed.

use crate::error::{Error, Result};
use crate::seal::{FrameSeal, FRAME_MAC_BYTES};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// "KVTF".
pub const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"KVTF");
/// Version of the frame format (2: numbered and MAC'd headers; 3: a 64-bit
/// region id, the length in 32 bits; 4: [`FLAG_CHECKSUM`] on READ and
/// READ_DATA, and on WRITE a target that checks it, so an older peer is
/// refused by version rather than ignoring the flag).
pub const FRAME_VERSION: u8 = 4;
/// Size of the header.
pub const FRAME_HEADER_BYTES: usize = std::mem::size_of::<FrameHeader>();
/// Largest payload one frame carries; larger blocks are chunked.
pub const MAX_FRAME_PAYLOAD_BYTES: u64 = 1 << 20;

/// Frame opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameOp {
    /// Initiator → target: write the payload at (region, offset).
    Write = 1,
    /// Initiator → target: send back `len` bytes at (region, offset).
    Read = 2,
    /// Target → initiator: the chunk ending with the LAST frame is done
    /// (`status` 0) or failed (`status` = −code).
    Ack = 3,
    /// Target → initiator: answer to one READ: the payload, or a failure
    /// (`status` ≠ 0, no payload).
    ReadData = 4,
    /// Initiator → target: a notification (protobuf `Notification` as the
    /// payload), answered with an ACK once queued.
    Notify = 5,
    /// Initiator → target: the WRITE frames after this one on the
    /// connection name grant `offset` (`mem::fence`), until the next GRANT;
    /// no payload, no reply. A connection starts at grant 0.
    Grant = 6,
}

impl FrameOp {
    fn from_u8(value: u8) -> Option<Self> {
        match value {
            1 => Some(Self::Write),
            2 => Some(Self::Read),
            3 => Some(Self::Ack),
            4 => Some(Self::ReadData),
            5 => Some(Self::Notify),
            6 => Some(Self::Grant),
            _ => None,
        }
    }
}

/// Flag: the last WRITE frame of a chunk; the target acks after it.
pub const FLAG_LAST: u8 = 1;
/// Flag: a WRITE frame whose `status` field carries an arrival tag; the
/// target counts the frame's bytes under it once they are in place.
pub const FLAG_TAGGED: u8 = 2;

/// Flag: a WRITE frame whose `status` field carries the CRC32C of its
/// payload (never with [`FLAG_TAGGED`]); the target checks the landed bytes
/// against it before it acks, and fails the chunk `CORRUPT` naming the
/// frame's region and offset when they differ. On a READ (`status` 0) it
/// asks for the CRC32C of the bytes sent back; on the READ_DATA that
/// answers it, `status` carries that CRC32C (so it is covered by the
/// header's MAC) and the reply is not a failure. A READ_DATA failure never
/// carries the flag.
pub const FLAG_CHECKSUM: u8 = 4;

/// The fixed frame header (little-endian on the wire).
#[derive(Debug, Clone, Copy, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct FrameHeader {
    /// [`FRAME_MAGIC`].
    pub magic: u32,
    /// [`FRAME_VERSION`].
    pub version: u8,
    /// [`FrameOp`] as a byte.
    pub opcode: u8,
    /// [`FLAG_LAST`] or 0.
    pub flags: u8,
    /// Reserved, zero.
    pub reserved: u8,
    /// In replies: 0 or the negated wire error code.
    pub status: i32,
    /// Payload length (WRITE, READ_DATA) or requested length (READ): at
    /// most [`MAX_FRAME_PAYLOAD_BYTES`], so 32 bits hold it.
    pub len: u32,
    /// The target's epoch as the initiator knows it.
    pub epoch: u64,
    /// The initiator's batch id, echoed in replies.
    pub batch_id: u64,
    /// Raw [`RegionId`](crate::RegionId) on the target (64 bits: a 32-bit
    /// generation).
    pub region: u64,
    /// Offset in the region.
    pub offset: u64,
    /// On a sealed connection: this header's number in its direction,
    /// from 0; zero otherwise.
    pub seq: u64,
    /// On a sealed connection: the MAC over every byte before it; zero
    /// otherwise.
    pub mac: [u8; FRAME_MAC_BYTES],
}

const _: () = assert!(std::mem::size_of::<FrameHeader>() == 72);
/// The bytes of a header its MAC covers: everything after the magic (a
/// constant `decode` checks) and before the MAC, its number included; 52
/// bytes, so that with the direction byte one SHA-256 block holds them.
pub const FRAME_COVERED: std::ops::Range<usize> = 4..FRAME_HEADER_BYTES - FRAME_MAC_BYTES;

impl FrameHeader {
    /// A header with magic and version filled in. A `len` past 32 bits
    /// saturates, which every decoder refuses (it is past
    /// [`MAX_FRAME_PAYLOAD_BYTES`]): callers chunk below that.
    pub fn new(op: FrameOp, epoch: u64, batch_id: u64, region: u64, offset: u64, len: u64) -> Self {
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        Self {
            magic: FRAME_MAGIC,
            version: FRAME_VERSION,
            opcode: op as u8,
            flags: 0,
            reserved: 0,
            epoch,
            batch_id,
            region,
            status: 0,
            offset,
            len,
            seq: 0,
            mac: [0; FRAME_MAC_BYTES],
        }
    }

    /// Numbers and signs a header this end sends (once, in send order).
    pub fn seal(&mut self, seal: &mut FrameSeal) {
        self.seq = seal.next_sent();
        self.reseal(seal);
    }

    /// Signs again, under the number it has, a header rewritten before it
    /// was sent.
    pub fn reseal(&mut self, seal: &FrameSeal) {
        self.mac = seal.sign(&self.as_bytes()[FRAME_COVERED]);
    }

    /// Checks a header from the other end of a sealed connection: the next
    /// number and a MAC that holds, else `Unauthorized`.
    pub fn check_seal(&self, seal: &mut FrameSeal) -> Result<()> {
        seal.check(self.seq, &self.as_bytes()[FRAME_COVERED], &self.mac)
    }

    /// Decodes and checks a header from outside: magic, version, opcode,
    /// and a payload length within [`MAX_FRAME_PAYLOAD_BYTES`].
    pub fn decode(bytes: &[u8]) -> Result<(FrameHeader, FrameOp)> {
        let header = FrameHeader::read_from_bytes(bytes).map_err(|_| {
            Error::malformed("frame", format!("header needs {FRAME_HEADER_BYTES} bytes, got {}", bytes.len()))
        })?;
        if header.magic != FRAME_MAGIC {
            return Err(Error::malformed("frame", format!("bad magic {:#010x}", header.magic)));
        }
        if header.version != FRAME_VERSION {
            return Err(Error::VersionMismatch { got: header.version.into(), supported: FRAME_VERSION.into() });
        }
        let op = FrameOp::from_u8(header.opcode).ok_or(Error::UnknownOpcode { opcode: header.opcode })?;
        if u64::from(header.len) > MAX_FRAME_PAYLOAD_BYTES {
            return Err(Error::MessageTooLarge { len: header.len.into(), max: MAX_FRAME_PAYLOAD_BYTES });
        }
        if header.offset.checked_add(header.len.into()).is_none() {
            return Err(Error::malformed("frame", format!("offset {} + len {} overflows", header.offset, header.len)));
        }
        Ok((header, op))
    }

    /// True for the last frame of a chunk.
    pub fn is_last(&self) -> bool {
        self.flags & FLAG_LAST != 0
    }

    /// The CRC32C a WRITE or READ_DATA frame's payload must have, if it
    /// carries one.
    pub fn checksum(&self) -> Option<u32> {
        (self.flags & FLAG_CHECKSUM != 0 && self.flags & FLAG_TAGGED == 0).then_some(self.status as u32)
    }

    /// The failure a reply reports (its `status`, a negated wire code), if
    /// it reports one: a READ_DATA that carries a CRC32C in `status` does
    /// not.
    pub fn failure(&self) -> Option<i32> {
        (self.status != 0 && self.checksum().is_none()).then_some(self.status)
    }

    /// The arrival tag a WRITE frame carries, if any.
    pub fn arrival_tag(&self) -> Option<u32> {
        (self.flags & FLAG_TAGGED != 0 && self.status != 0).then_some(self.status as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_are_named() {
        let mut header = FrameHeader::new(FrameOp::Write, 7, 9, 3, 4096, 512);
        header.flags = FLAG_LAST;
        let (decoded, op) = FrameHeader::decode(header.as_bytes()).unwrap();
        assert_eq!((decoded, op), (header, FrameOp::Write));
        assert!(decoded.is_last());

        assert!(FrameHeader::decode(&header.as_bytes()[..47]).unwrap_err().to_string().contains("needs 72 bytes"));
        let mut bad = header;
        bad.magic = 0;
        assert!(FrameHeader::decode(bad.as_bytes()).unwrap_err().to_string().contains("bad magic"));
        let mut bad = header;
        bad.version = 9;
        assert!(matches!(FrameHeader::decode(bad.as_bytes()), Err(Error::VersionMismatch { got: 9, .. })));
        let mut bad = header;
        bad.opcode = 99;
        assert!(matches!(FrameHeader::decode(bad.as_bytes()), Err(Error::UnknownOpcode { opcode: 99 })));
        let mut bad = header;
        bad.len = MAX_FRAME_PAYLOAD_BYTES as u32 + 1;
        assert!(matches!(FrameHeader::decode(bad.as_bytes()), Err(Error::MessageTooLarge { .. })));
        let mut bad = header;
        bad.offset = u64::MAX;
        assert!(FrameHeader::decode(bad.as_bytes()).unwrap_err().to_string().contains("overflows"));
    }

    #[test]
    fn a_checksum_rides_in_the_status_field_of_untagged_writes_only() {
        let mut header = FrameHeader::new(FrameOp::Write, 7, 9, 3, 0, 512);
        assert_eq!(header.checksum(), None);
        header.flags = FLAG_CHECKSUM;
        header.status = 0x9abc_def0_u32 as i32;
        assert_eq!(header.checksum(), Some(0x9abc_def0));
        assert_eq!(header.arrival_tag(), None);
        let mut reply = FrameHeader::new(FrameOp::ReadData, 7, 9, 3, 0, 512);
        reply.status = header.status;
        assert_eq!(reply.failure(), Some(header.status), "without the flag, status is a failure");
        reply.flags = FLAG_CHECKSUM;
        assert_eq!((reply.checksum(), reply.failure()), (Some(0x9abc_def0), None), "with it, a CRC32C");
        header.flags |= FLAG_TAGGED;
        assert_eq!(header.checksum(), None, "a tagged frame's field is its tag");
        assert_eq!(header.arrival_tag(), Some(0x9abc_def0));
    }

    #[test]
    fn sealed_headers_check_once_in_order_and_not_when_altered() {
        use crate::seal::End;
        let session = crate::auth::Token::new("t").session([1; 16], [2; 16], 7);
        let mut sender = FrameSeal::new(&session, &[3; 16], &[4; 16], 7, End::Initiator);
        let mut receiver = FrameSeal::new(&session, &[3; 16], &[4; 16], 7, End::Target);
        let mut first = FrameHeader::new(FrameOp::Write, 7, 9, 3, 0, 512);
        first.seal(&mut sender);
        let mut second = FrameHeader::new(FrameOp::Write, 7, 9, 3, 512, 512);
        second.seal(&mut sender);
        assert_eq!((first.seq, second.seq), (0, 1));
        assert!(matches!(second.check_seal(&mut receiver.clone()), Err(Error::Unauthorized { .. })));
        let mut moved = first;
        moved.offset = 4096;
        assert!(moved.check_seal(&mut receiver.clone()).is_err());
        first.check_seal(&mut receiver).unwrap();
        assert!(first.check_seal(&mut receiver.clone()).is_err(), "a replay");
        second.check_seal(&mut receiver).unwrap();
        // A header rewritten before it went is signed again under its number.
        let mut third = FrameHeader::new(FrameOp::Ack, 7, 9, 0, 0, 0);
        third.seal(&mut sender);
        third.status = -3;
        assert!(third.check_seal(&mut receiver.clone()).is_err());
        third.reseal(&sender);
        third.check_seal(&mut receiver).unwrap();
    }
}
