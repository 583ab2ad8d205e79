//! The TCP transport: fixed zerocopy frame headers, a hello that proves the
//! initiator's session before any frame is served, a target-side server
//! that validates every block against its own registry, and an
//! initiator-side link with one non-blocking connection per lane, polled by
//! its lane.

pub mod conn;
pub mod frame;
pub mod hello;
pub mod link;
pub(crate) mod redial;
pub(crate) mod served;
pub mod server;
pub(crate) mod staged;
pub(crate) mod target;

pub(crate) use link::{TcpLink, DEFAULT_IO_TIMEOUT};
pub(crate) use served::Served;
pub use server::TcpDataServer;
pub(crate) use target::TargetContext;

/// Where the rest of a payload that is being received lands: the next
/// byte's address and how many bytes are still to come. Both ends of a
/// connection read payloads in pieces (a READ reply into the initiator's
/// region, a WRITE into the target's) and step it the same way.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Landing {
    /// Where the next byte goes (inside a leased range that still has
    /// `left` bytes).
    pub dest: *mut u8,
    /// Bytes still to come.
    pub left: usize,
}

impl Landing {
    /// The landing after `n` more bytes arrived; `n <= left`.
    pub fn advanced(self, n: usize) -> Self {
        debug_assert!(n <= self.left, "{n} bytes landed where {} were left", self.left);
        Self { dest: self.dest.wrapping_add(n), left: self.left - n }
    }
}

/// Makes room at the tail of a connection's read buffer, whose unread bytes
/// are `buffer[*start..*end]`: an empty buffer starts over at 0, and unread
/// bytes move to the front once less than a frame header fits behind them
/// (so a header never straddles the end). Both ends read frames this way.
pub(crate) fn compact(buffer: &mut [u8], start: &mut usize, end: &mut usize) {
    if *start == *end {
        *start = 0;
        *end = 0;
    } else if *start > 0 && buffer.len() - *end < frame::FRAME_HEADER_BYTES {
        buffer.copy_within(*start..*end, 0);
        *end -= *start;
        *start = 0;
    }
}
