//! A lane: one pinned poller thread (a plain std thread running its poll
//! loop), and the rings, links and counters it owns.
//!
//! The loop (`poll.rs`): take control commands (new submitters, opened and
//! closed segments with this lane's own link to each), drain each
//! submitter's submission ring in chunks, validate and execute every
//! descriptor (`execute.rs`), publish status and completions
//! (`complete.rs`); on a target, one lane also polls the RDMA receives that
//! count arrivals (`receive.rs`). With no work for `busy_poll` it parks on its doorbell;
//! a submitter's next push wakes it. Nothing in the loop allocates, locks
//! or formats a string on the success path: links arrive connected, and
//! per-lane tables are preallocated when the lane starts (`start.rs`).

mod checksum;
mod complete;
mod death;
mod execute;
mod links;
mod poll;
mod receive;
mod shared;
mod start;

pub(crate) use shared::{LaneCommand, LaneConfig, LaneShared, SubmitterRings};
pub(crate) use start::LaneHandle;

use std::time::Duration;

/// Default busy-poll window before an idle lane parks.
pub(crate) const DEFAULT_BUSY_POLL: Duration = Duration::from_millis(2);
/// Default longest a parked lane sleeps before looking again on its own
/// (a safety net: the doorbell wakes it as soon as work arrives).
pub(crate) const DEFAULT_PARK_TIMEOUT: Duration = Duration::from_millis(50);
pub(crate) use crate::transport::MAX_CHUNK_BLOCKS;
/// Parts (and notifications) a lane executes at once; SQEs wait in their
/// ring while all are taken.
pub(crate) const MAX_TICKETS: usize = 512;
