//! The wire code of each error (proto/'s `ErrorCode`), which Python's
//! exception classes and C's `kvring_status` values follow: one table, so
//! a variant's message can change without its code moving.

use super::Error;
use crate::proto::ErrorCode;

/// The code a peer's negative wire status names. A status the peer made up
/// (zero, positive, unknown, or `i32::MIN`, whose negation overflows) reads
/// as `Internal` rather than panicking: the status is outside bytes.
pub(crate) fn code_of_status(status: i32) -> ErrorCode {
    match status.checked_neg().map(ErrorCode::try_from) {
        Some(Ok(code)) if code != ErrorCode::Unspecified => code,
        _ => ErrorCode::Internal,
    }
}

impl Error {
    /// The wire code of this error, as proto/ defines it.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::InvalidArgument { .. } => ErrorCode::InvalidArgument,
            Error::RegionOverlap { .. } => ErrorCode::RegionOverlap,
            Error::RegionInfoMismatch { .. } => ErrorCode::RegionOverlap,
            Error::RegionBusy { .. } => ErrorCode::RegionBusy,
            Error::Fenced { .. } => ErrorCode::Fenced,
            Error::UnknownRegion { .. } => ErrorCode::UnknownRegion,
            Error::RegionTableFull { .. } | Error::PeerLimit { .. } => ErrorCode::ResourceLimit,
            Error::OutOfBounds { .. } => ErrorCode::OutOfBounds,
            Error::LengthOverflow { .. } => ErrorCode::LengthOverflow,
            Error::AccessDenied { .. } => ErrorCode::AccessDenied,
            Error::Busy { .. } => ErrorCode::Busy,
            Error::Timeout { .. } | Error::DeadlinePassed { .. } => ErrorCode::Timeout,
            Error::Cancelled { .. } => ErrorCode::Cancelled,
            Error::UnknownBatch { .. } => ErrorCode::UnknownBatch,
            Error::StaleBatch { .. } => ErrorCode::StaleBatch,
            Error::UnknownSegment { .. } => ErrorCode::UnknownSegment,
            // On the wire and in Python, as a peer gone: the link is closed
            // and the segment must be opened again, as after a restart.
            Error::PeerRestarted { .. } | Error::PeerStalled { .. } => ErrorCode::PeerRestarted,
            Error::VersionMismatch { .. } => ErrorCode::VersionMismatch,
            Error::Malformed { .. } => ErrorCode::MalformedMessage,
            Error::MessageTooLarge { .. } => ErrorCode::MessageTooLarge,
            Error::UnknownOpcode { .. } => ErrorCode::UnknownOpcode,
            Error::Remote { code, .. } => *code,
            Error::Io { .. } => ErrorCode::Io,
            Error::LaneStart { .. } | Error::LaneDied { .. } => ErrorCode::Internal,
            Error::Unsupported { .. } | Error::TransportRefused { .. } => ErrorCode::Unsupported,
            Error::Device { .. } | Error::Gpu { .. } => ErrorCode::Io,
            Error::Shutdown => ErrorCode::Shutdown,
            Error::NotKvring { .. } => ErrorCode::MalformedMessage,
            Error::Unauthorized { .. } => ErrorCode::Unauthorized,
            // As a mismatch on the wire and in Python (`LayoutMismatchError`):
            // the two layouts cannot both hold.
            Error::LayoutMismatch { .. } | Error::LayoutFixed { .. } => ErrorCode::LayoutMismatch,
            Error::BlockCountMismatch { .. }
            | Error::BlockOutOfRange { .. }
            | Error::DuplicateBlock { .. }
            | Error::LayerOutOfRange { .. } => ErrorCode::InvalidArgument,
            Error::Corrupt { .. } => ErrorCode::Corrupt,
        }
    }
}
