//! The sums this engine runs for its peers (`Crc32cRequest`, the bench's
//! `ChecksumRequest`): how many at once, and none once it stops.
//!
//! A sum reads up to 1 GiB on the control connection's thread. The control
//! listener bounds its connections (`MAX_CONTROL_CONNECTIONS`, per source
//! and in all), but a request is served while its connection is still
//! pending, and a pending connection pushed out for a newcomer is closed
//! while its thread goes on summing: the connection bounds alone do not
//! bound the sums (hostile review 9, `review9_rdmasum::t6`). So each sum
//! enters this gate, under the same bounds, and a peer past them is
//! refused `Busy`.
//!
//! A sum also holds a lease on memory the caller may free once the engine
//! is dropped (`Engine::register`). The control server's stop waits only a
//! while for a request in progress, so the engine's drop closes the gate
//! and waits for the sums in it to end (each at most 1 GiB), after which
//! none reads the caller's memory (`review9_rdmasum::t7`).
//!
//! The gate itself, with its bounds as parameters and its refusals as a
//! plain enum, is `gate.rs`, which loom models; this file gives it the
//! control listener's bounds and kvring's errors.

mod gate;

use crate::control::server::{MAX_CONTROL_CONNECTIONS, MAX_CONTROL_CONNECTIONS_PER_SOURCE};
use crate::error::{Error, Result};
use gate::{Gate, Refused, Running};
use std::net::IpAddr;

/// Sums running at once, in all and from one source address.
#[derive(Debug)]
pub(crate) struct SumGate(Gate);

impl Default for SumGate {
    fn default() -> Self {
        Self(Gate::new(MAX_CONTROL_CONNECTIONS, MAX_CONTROL_CONNECTIONS_PER_SOURCE))
    }
}

impl SumGate {
    /// Lets a sum for `source` start, or says why not: `Busy` past the
    /// control listener's bounds, `Shutdown` once the engine stops.
    pub(crate) fn enter(&self, source: Option<IpAddr>) -> Result<Running<'_>> {
        self.0.enter(source).map_err(|refused| match refused {
            Refused::Closed => Error::Shutdown,
            Refused::Total => Error::Busy { queue: "sums in progress", capacity: MAX_CONTROL_CONNECTIONS },
            Refused::Source => {
                Error::Busy { queue: "sums in progress from one address", capacity: MAX_CONTROL_CONNECTIONS_PER_SOURCE }
            }
        })
    }

    /// Lets no sum start from now on, and waits for those running to end.
    pub(crate) fn close_and_wait(&self) {
        self.0.close_and_wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_bounded_per_source_and_in_all_and_none_starts_after_close() {
        let gate = SumGate::default();
        let one: Option<IpAddr> = Some("10.0.0.1".parse().unwrap());
        let held: Vec<_> = (0..MAX_CONTROL_CONNECTIONS_PER_SOURCE).map(|_| gate.enter(one).unwrap()).collect();
        assert!(matches!(gate.enter(one), Err(Error::Busy { .. })), "past the per-source bound");
        let others: Vec<_> = (0..MAX_CONTROL_CONNECTIONS - MAX_CONTROL_CONNECTIONS_PER_SOURCE)
            .map(|n| gate.enter(Some(IpAddr::from([10, 0, 1, n as u8]))).unwrap())
            .collect();
        assert!(matches!(gate.enter(Some("10.0.0.9".parse().unwrap())), Err(Error::Busy { .. })), "past the total");
        drop(others);
        drop(held);
        let running = gate.enter(one).unwrap();
        std::thread::scope(|scope| {
            let closer = scope.spawn(|| gate.close_and_wait());
            while !gate.0.is_closed() {
                std::thread::yield_now();
            }
            assert!(matches!(gate.enter(None), Err(Error::Shutdown)), "none starts once closed");
            assert!(!closer.is_finished(), "the close waits for the sum running");
            drop(running);
            closer.join().unwrap();
        });
    }
}
