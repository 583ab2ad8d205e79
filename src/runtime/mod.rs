//! The runtime: lanes (pinned threads running the poll loop),
//! the status table, the doorbell that wakes parked lanes, bounded backoff
//! for waiters, the notification-CQE handshake, and the engine's clock.

pub(crate) mod backoff;
pub(crate) mod clock;
pub(crate) mod doorbell;
pub(crate) mod lane;
pub(crate) mod metrics;
pub(crate) mod placement;
pub(crate) mod status;
pub(crate) mod watch;

pub use backoff::BackoffPolicy;
pub use metrics::LaneStatsSnapshot;
pub use status::{BatchId, BatchState};
