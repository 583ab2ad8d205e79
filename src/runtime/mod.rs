//! The runtime: lanes (pinned glommio executors running the poll loop),
//! the status table, the doorbell that wakes parked lanes, bounded backoff
//! for waiters, and the notification-CQE handshake.

pub mod backoff;
pub mod doorbell;
pub mod lane;
pub mod metrics;
pub mod placement;
pub mod status;
pub mod watch;

pub use status::{BatchId, BatchState};
