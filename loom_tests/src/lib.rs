//! kvring's lock-free structures, compiled unchanged from `../src` against
//! loom's checked atomics (`crate::sync` resolves to loom under `cfg(loom)`).
//! Run: `RUSTFLAGS="--cfg loom" cargo test --release` in this directory.
#![allow(dead_code, unused_imports)]

#[path = "../../src/sync.rs"]
pub(crate) mod sync;

/// The model of a lane's poller and its waker (an eventfd), for the
/// doorbell's production form.
pub use sync::poller;

// Public here only so the models reach it; in kvring it is crate-private,
// where clippy asks for no `is_empty` beside `len`.
#[allow(clippy::len_without_is_empty)]
#[path = "../../src/ring/spsc.rs"]
pub mod spsc;

#[path = "../../src/runtime/status.rs"]
pub mod status;

#[path = "../../src/runtime/doorbell.rs"]
pub mod doorbell;

#[path = "../../src/runtime/watch.rs"]
pub mod watch;

/// The notification delivery count lane 0 reads.
#[path = "../../src/delivered.rs"]
pub mod delivered;

#[path = "../../src/arrival.rs"]
pub mod arrival;

/// The registry's slot: leases, exclusive reads and unregister.
#[path = "../../src/mem/lease.rs"]
pub mod lease;

/// The cma page's revocation handshake.
#[path = "../../src/transport/cma/revoke.rs"]
pub mod revoke;

/// The shm region file's revocation handshake (live and busy words).
#[path = "../../src/mem/revoke.rs"]
pub mod shm_revoke;

/// Fenced destinations: grants, the writers' two phase counters, fences.
#[path = "../../src/mem/fence.rs"]
pub mod fence;

/// A data connection's idleness: its lane marks it busy and idle, the
/// admission book claims an idle one for a newcomer.
#[path = "../../src/net/idle_cell.rs"]
pub mod idle_cell;

/// The rdma verifier's gate: a chunk's memory summed in steps, and the
/// lane's withdrawal after which no step reads it.
#[path = "../../src/transport/rdma/verify/gate.rs"]
pub mod verify_gate;

/// The engine's sum gate: bounds on the sums run for peers, and the close
/// (the engine's drop) that waits for those running.
#[path = "../../src/engine/sums/gate.rs"]
pub mod sum_gate;
