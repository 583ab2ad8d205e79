//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod raw;
pub mod verbs;

use kvring::{Engine, EngineBuilder};
use std::time::{Duration, Instant};

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
    kvring::testing::fill_pattern(&mut bytes, seed);
    bytes
}

/// The `kvring` binary built for these tests.
pub fn kvring_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kvring")
}

/// Waits until every thread of process `pid` is stopped (a group stop
/// reaches the threads one by one, asynchronously).
pub fn wait_until_stopped(pid: u32) {
    let deadline = Instant::now() + WAIT;
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the target runs");
        let all_stopped = tasks.flatten().all(|task| {
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            // The state follows the command name, which is in parentheses.
            stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()) == Some("T")
        });
        if all_stopped {
            return;
        }
        assert!(Instant::now() < deadline, "process {pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}
