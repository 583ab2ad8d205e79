//! Helpers shared by the integration tests.
#![allow(dead_code)]

use kvring::{Engine, EngineBuilder};
use std::time::Duration;

/// Every wait in the tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(10);

/// An engine sized for tests: small rings, unpinned (tests run in parallel
/// on two cores), a short busy-poll window.
pub fn builder(name: &str) -> EngineBuilder {
    Engine::builder()
        .name(name)
        .pin(false)
        .busy_poll(Duration::from_micros(200))
        .max_batches_in_flight(64)
        .arena_descs(4096)
}

pub fn engine(name: &str) -> Engine {
    builder(name).build().expect("test engine starts")
}

/// Bytes of a pattern for `seed`, as `Region::fill_pattern` writes them.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    kvring::engine::fill_pattern(&mut bytes, seed);
    bytes
}

/// The `kvring` binary built for these tests.
pub fn kvring_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kvring")
}
