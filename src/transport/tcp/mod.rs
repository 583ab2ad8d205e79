//! The TCP transport: fixed zerocopy frame headers, a target-side server
//! that validates every block against its own registry, and an
//! initiator-side link with one non-blocking connection per lane, polled by
//! its lane.

pub mod conn;
pub mod frame;
pub mod link;
pub mod server;

pub use link::{TcpLink, DEFAULT_IO_TIMEOUT};
pub use server::TcpDataServer;
