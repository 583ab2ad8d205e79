//! Each NIC's asynchronous events (ibv_get_async_event(3)), read by one
//! thread per node: a port that goes down, a device or queue that fails,
//! raise no completion on the CQs lanes poll, so without this a lane's
//! batches would wait for the NIC's retries or their deadlines (VERBS-REVIEW
//! finding 11). The thread counts the fault on the NIC; every link on that
//! NIC sees the count change at its next poll and fails what it has in
//! flight with the reason, and the segment is opened again for the next
//! batch (which fails at connect while the port is down).

use super::RdmaNode;
use crate::error::Result;
use crate::transport::rdma::verbs::{AsyncEvent, Qp};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How long the thread waits for an event before it checks that its node
/// still exists.
const EVENT_WAIT: Duration = Duration::from_millis(100);

impl RdmaNode {
    /// Starts the node's event thread (once; a provider without async
    /// descriptors, like the simulator, needs none).
    pub(crate) fn start_events(self: &Arc<Self>) -> Result<()> {
        let fds: Vec<i32> = self.nics.iter().filter_map(|nic| self.verbs.async_fd(nic.context)).collect();
        if fds.is_empty() {
            return Ok(());
        }
        self.last_wqe.events.store(true, Ordering::Release);
        let node = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("kvring-rdma-events".into())
            .spawn(move || watch(node, fds))
            .map_err(|e| crate::error::Error::Device { device: "rdma".into(), reason: format!("event thread: {e}") })?;
        Ok(())
    }

    /// How many faults NIC `nic` has had; a link compares it with the count
    /// when it was made.
    pub(crate) fn faults(&self, nic: usize) -> u64 {
        self.nics.get(nic).map_or(0, |n| n.faults.load(Ordering::Acquire))
    }

    /// NIC `nic`'s name and why it failed (its last fault).
    pub(crate) fn fault(&self, nic: usize) -> (String, String) {
        let Some(n) = self.nics.get(nic) else { return ("verbs".into(), "no such NIC".into()) };
        let why = n.fault.lock().unwrap_or_else(|p| p.into_inner()).clone();
        (n.name.clone(), why.unwrap_or_else(|| "it reported a fault, since cleared".into()))
    }

    /// Takes every NIC's pending events and acts on them.
    fn take_events(&self, events: &mut Vec<AsyncEvent>) {
        for nic in &self.nics {
            events.clear();
            if let Err(error) = self.verbs.take_async_events(nic.context, events) {
                tracing::warn!(device = %nic.name, %error, "reading async events failed");
                continue;
            }
            for &event in events.iter() {
                let fault = match event {
                    AsyncEvent::PortError { port } => {
                        Some(format!("{} port {port} went down (IBV_EVENT_PORT_ERR)", nic.name))
                    }
                    AsyncEvent::DeviceFatal => Some(format!("{} failed (IBV_EVENT_DEVICE_FATAL)", nic.name)),
                    AsyncEvent::QueueFatal => {
                        Some(format!("a queue of {} failed (IBV_EVENT_CQ_ERR / QP_FATAL)", nic.name))
                    }
                    AsyncEvent::PortActive { port } => {
                        tracing::info!(device = %nic.name, port, "port active again");
                        *nic.fault.lock().unwrap_or_else(|p| p.into_inner()) = None;
                        None
                    }
                    AsyncEvent::GidChange { port } => {
                        self.choose_gid_again(nic);
                        tracing::info!(device = %nic.name, port, "GID table changed");
                        None
                    }
                    AsyncEvent::LastWqeReached { qp } => {
                        self.last_wqe_reached(qp);
                        None
                    }
                    AsyncEvent::Other(kind) => {
                        tracing::debug!(device = %nic.name, kind, "async event");
                        None
                    }
                };
                if let Some(why) = fault {
                    tracing::warn!(device = %nic.name, %why, "failing the links on this NIC");
                    *nic.fault.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
                    // Release pairs with the Acquire in `faults`: a link that
                    // sees the new count reads the reason written before.
                    nic.faults.fetch_add(1, Ordering::Release);
                }
            }
        }
    }
}

/// How long a released accepted QP's drain waits for its
/// IBV_EVENT_QP_LAST_WQE_REACHED (then drains anyway).
const LAST_WQE_WAIT: Duration = Duration::from_millis(100);
/// Most QPs whose LAST_WQE_REACHED is kept unclaimed (events for QPs
/// nobody drains, e.g. failed by the NIC, are dropped past it).
const MAX_LAST_WQE: usize = 4096;

/// QPs whose last receive completion is on the CQ
/// (IBV_EVENT_QP_LAST_WQE_REACHED), for the drain that waits on them.
#[derive(Debug, Default)]
pub(super) struct LastWqe {
    /// Whether events are read at all (the node's event thread runs).
    events: std::sync::atomic::AtomicBool,
    reached: std::sync::Mutex<std::collections::HashSet<Qp>>,
    changed: std::sync::Condvar,
}

impl RdmaNode {
    fn last_wqe_reached(&self, qp: Qp) {
        let mut reached = self.last_wqe.reached.lock().unwrap_or_else(|p| p.into_inner());
        if reached.len() >= MAX_LAST_WQE {
            reached.clear();
        }
        reached.insert(qp);
        self.last_wqe.changed.notify_all();
    }

    /// Waits (at most [`LAST_WQE_WAIT`]) until `qp`, moved to ERR, has had
    /// its IBV_EVENT_QP_LAST_WQE_REACHED: after it no receive of the SRQ
    /// completes on the QP, so a drain then misses none (IBTA §10.3.1 as
    /// quoted in Linux commit 844bc12e6da3). Without an event thread (the
    /// simulator, or a node outside an engine) it returns at once.
    pub(super) fn wait_last_wqe(&self, qp: Qp) {
        if !self.last_wqe.events.load(Ordering::Acquire) {
            return;
        }
        let deadline = std::time::Instant::now() + LAST_WQE_WAIT;
        let mut reached = self.last_wqe.reached.lock().unwrap_or_else(|p| p.into_inner());
        while !reached.remove(&qp) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                tracing::debug!(?qp, "no IBV_EVENT_QP_LAST_WQE_REACHED in time; draining anyway");
                return;
            }
            reached = self.last_wqe.changed.wait_timeout(reached, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

impl RdmaNode {
    /// The port's GID table changed (an address came or went): the GID index
    /// is chosen again as at open (the configured one, if it is still
    /// there), and the spare QPs, whose endpoints carry the old GID, are
    /// destroyed; links already made keep theirs until they fail
    /// (VERBS-REVIEW finding 12).
    fn choose_gid_again(&self, nic: &super::Nic) {
        let port = self.verbs.devices().ok().and_then(|devices| {
            devices.into_iter().find(|d| d.name == nic.name)?.ports.into_iter().find(|p| p.port == nic.port)
        });
        let Some(port) = port else { return };
        match crate::transport::rdma::devices::gid_index(&nic.name, &port, self.gid_configured) {
            Ok(index) => {
                let gid = port.gids.iter().find(|(i, ..)| *i == index).map(|(_, gid, _)| *gid);
                *nic.gid_now.lock().unwrap_or_else(|p| p.into_inner()) = gid;
                let old = nic.gid_index.swap(index, Ordering::Relaxed);
                if old != index {
                    tracing::info!(device = %nic.name, old, new = index, "GID index chosen again");
                }
                let spares = std::mem::take(&mut *nic.spares.lock().unwrap_or_else(|p| p.into_inner()));
                for spare in spares.active {
                    self.destroy(spare, false);
                }
                for spare in spares.passive {
                    self.destroy(spare, true);
                }
            }
            Err(error) => tracing::warn!(device = %nic.name, %error, "no usable GID after a GID change"),
        }
    }
}

/// The thread: waits on the NICs' async descriptors (bounded, so it ends
/// soon after its node), then takes their events.
fn watch(node: Weak<RdmaNode>, fds: Vec<i32>) {
    let mut events = Vec::new();
    let mut polled: Vec<libc::pollfd> =
        fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    loop {
        for p in &mut polled {
            p.revents = 0;
        }
        // A descriptor closed since (the node dropped) reads as POLLNVAL and
        // the upgrade below ends the thread.
        let timeout = EVENT_WAIT.as_millis() as i32;
        // SAFETY: `polled` is our own array of pollfds, `polled.len()` long.
        let ready = unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, timeout) };
        let Some(node) = node.upgrade() else { return };
        if ready > 0 {
            node.take_events(&mut events);
        }
    }
}
