//! Releases RDMA QPs held for initiators that went away.
//!
//! One-sided RDMA gives the target no sign that an initiator died: its QPs
//! would sit forever (default engine names carry the pid, so a restarted
//! initiator is a new name, not a reconnect). So a thread probes, every
//! `rdma_probe_interval`, the control address each initiator holding QPs
//! gave in its handshake: an answer from another engine or another start,
//! a refused connection, or [`MISSES_BEFORE_RELEASE`] probes in a row
//! without an answer, and its QPs are released.

use super::EngineInner;
use crate::auth::Initiator;
use crate::control::ControlClient;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::Weak;
use std::time::{Duration, Instant};

/// Probes in a row that must go unanswered before a silent initiator's QPs
/// are released (a refused connection or another epoch releases at once).
pub(crate) const MISSES_BEFORE_RELEASE: u32 = 3;
/// Deadline of one probe.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// What a probe found.
#[derive(Debug, PartialEq, Eq)]
enum Probe {
    Alive,
    Gone,
    Silent,
}

fn probe(initiator: &Initiator) -> Probe {
    let deadline = Instant::now() + PROBE_TIMEOUT;
    match ControlClient::connect(&initiator.addr, deadline).and_then(|mut client| client.probe(deadline)) {
        Ok((name, epoch)) if name == initiator.name && epoch == initiator.epoch => Probe::Alive,
        // Another engine, or another start of it, answers there now.
        Ok(_) => Probe::Gone,
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::ConnectionRefused => Probe::Gone,
        Err(Error::NotKvring { .. }) => Probe::Gone,
        Err(_) => Probe::Silent,
    }
}

/// Starts the reaper thread; it ends with the engine.
pub(crate) fn start(engine: Weak<EngineInner>, every: Duration) -> Result<()> {
    std::thread::Builder::new()
        .name("kvring-rdma-reaper".into())
        .spawn(move || {
            let mut misses: HashMap<(String, u64), u32> = HashMap::new();
            let mut next = crate::deadline::deadline_after(every);
            let weak = engine;
            loop {
                std::thread::sleep(Duration::from_millis(20).min(every));
                let Some(engine) = weak.upgrade() else { return };
                if engine.is_stopped() {
                    return;
                }
                if Instant::now() < next {
                    continue;
                }
                next = crate::deadline::deadline_after(every);
                let Some(node) = engine.context.rdma.clone() else { return };
                // Probe without holding the engine: a slow probe must not
                // keep a dropped engine alive.
                drop(engine);
                let initiators = node.initiators();
                misses.retain(|key, _| initiators.iter().any(|i| (&i.name, i.epoch) == (&key.0, key.1)));
                for initiator in initiators.iter().filter(|i| !i.addr.is_empty()) {
                    let key = (initiator.name.clone(), initiator.epoch);
                    let release = match probe(initiator) {
                        Probe::Alive => {
                            misses.remove(&key);
                            false
                        }
                        Probe::Gone => true,
                        Probe::Silent => {
                            let count = misses.entry(key.clone()).or_default();
                            *count += 1;
                            *count >= MISSES_BEFORE_RELEASE
                        }
                    };
                    if release {
                        misses.remove(&key);
                        let released = node.release_initiator(initiator);
                        tracing::info!(
                            initiator = %initiator.name,
                            epoch = format_args!("{:#x}", initiator.epoch),
                            qps = released,
                            "released the RDMA QPs of an initiator that went away"
                        );
                    }
                }
                // The fence connections of writers released go with them.
                if let Some(engine) = weak.upgrade() {
                    let writers = node.writers();
                    engine.context.fence_pushers.prune(writers.iter().map(|(w, _)| w));
                }
            }
        })
        .map(drop)
        .map_err(|e| Error::io("spawning the rdma reaper", e))
}
