//! The runtime: lanes (pinned glommio executors running the poll loop),
//! the status table, the doorbell that wakes parked lanes, and bounded
//! backoff for waiters.

pub mod backoff;
pub mod doorbell;
pub mod lane;
pub mod status;

pub use status::{BatchId, BatchState};
