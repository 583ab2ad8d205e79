//! The TCP transport: fixed zerocopy frame headers, a hello that proves the
//! initiator's session before any frame is served, a target-side server
//! that validates every block against its own registry, and an
//! initiator-side link with one non-blocking connection per lane, polled by
//! its lane.

pub mod conn;
pub mod frame;
pub mod hello;
pub mod link;
pub(crate) mod served;
pub mod server;
pub(crate) mod staged;
pub(crate) mod target;

pub(crate) use link::{TcpLink, DEFAULT_IO_TIMEOUT};
pub(crate) use served::Served;
pub use server::TcpDataServer;
pub(crate) use target::TargetContext;
