//! Starting a lane: its thread, its pinning and its poller.
//!
//! A lane is a plain pinned std thread running its poll loop (`poll.rs`).
//! It once ran inside a glommio `LocalExecutor`, but the loop never awaited
//! anything glommio drives (its sockets go through epoll, chosen by
//! measurement: docs/ARCHITECTURE.md); the executor only cost each lane an
//! io_uring, a 512 KiB locked-memory floor and an idle blocking-pool thread.

use super::super::doorbell::Doorbell;
use super::super::metrics::LaneMetrics;
use super::poll::Lane;
use super::shared::{LaneConfig, LaneShared};
use crate::error::{Error, Result};
use crate::mem::Registry;
use crossbeam_queue::SegQueue;
use crossbeam_utils::CachePadded;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, OnceLock};

/// A running lane: its shared part and its thread.
#[derive(Debug)]
pub(crate) struct LaneHandle {
    /// Shared with submitters.
    pub shared: Arc<LaneShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LaneHandle {
    /// Starts a lane thread, pins it, builds its poller and waits until it
    /// runs (or reports why it could not).
    pub fn start(config: LaneConfig, registry: Arc<Registry>) -> Result<Self> {
        let (ready_tx, ready_rx) = mpsc::channel::<Result<Arc<LaneShared>>>();
        let index = config.index;
        let thread = std::thread::Builder::new()
            .name(format!("kvring-lane-{index}"))
            .spawn(move || lane_thread(config, registry, ready_tx))
            .map_err(|e| Error::io(format!("spawning lane {index}"), e))?;
        match ready_rx.recv() {
            Ok(Ok(shared)) => Ok(Self { shared, thread: Some(thread) }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(Error::LaneStart { lane: index, reason: "lane thread exited during start".into() })
            }
        }
    }

    /// Stops the lane after it drains its rings, and joins its thread.
    pub fn stop_and_join(&mut self) {
        self.shared.stop();
        if let Some(thread) = self.thread.take() {
            if let Err(payload) = thread.join() {
                tracing::error!(
                    lane = self.shared.index,
                    panic = %super::death::panic_message(&*payload),
                    "lane thread ended in a panic"
                );
            }
        }
    }
}

impl Drop for LaneHandle {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

fn lane_thread(config: LaneConfig, registry: Arc<Registry>, ready: mpsc::Sender<Result<Arc<LaneShared>>>) {
    let index = config.index;
    let core = config.core.filter(|&core| core_affinity::set_for_current(core_affinity::CoreId { id: core }));
    // The lane sleeps in its poller: its doorbell, the target connections it
    // serves and its links' sockets all wake it there.
    let poller =
        mio::Poll::new().and_then(|poll| Ok((mio::Waker::new(poll.registry(), crate::transport::WAKER_KEY)?, poll)));
    let (waker, poller) = match poller {
        Ok(both) => both,
        Err(e) => {
            let _ = ready.send(Err(Error::io(format!("creating lane {index}'s poller"), e)));
            return;
        }
    };
    let shared = Arc::new(LaneShared {
        index,
        core,
        doorbell: Doorbell::for_poller(waker),
        commands: SegQueue::new(),
        metrics: CachePadded::new(LaneMetrics::new()),
        stop: AtomicBool::new(false),
        death: OnceLock::new(),
        #[cfg(feature = "testing")]
        panic_next_part: AtomicBool::new(false),
    });
    let lane = Lane::new(config, shared.clone(), registry, poller);
    if ready.send(Ok(shared.clone())).is_err() {
        return;
    }
    // The loop catches its own panics (`death.rs`); this catches one while
    // it ends its work after such a panic, so the lane is at least marked
    // dead and refuses new work (what it held then waits for its deadlines).
    if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lane.run())) {
        let reason = super::death::panic_message(&*payload);
        tracing::error!(lane = index, panic = %reason, "lane panicked outside its loop; the lane is dead");
        if shared.death.set(reason).is_ok() {
            shared.metrics.panicked();
        }
    }
}
