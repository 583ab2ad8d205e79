//! Starting a lane: its thread, its pinning, its glommio executor, and the
//! locked memory glommio needs for it.

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

/// Default io_uring buffer memory per lane executor: kvring does no storage
/// I/O through glommio, so the minimum glommio accepts.
pub(crate) const DEFAULT_IO_MEMORY_BYTES: usize = 64 * 1024;
/// io_uring submission depth per lane executor.
const IO_RING_DEPTH: usize = 64;
/// glommio refuses to start below this locked-memory limit.
const MIN_MEMLOCK_BYTES: u64 = 512 * 1024;

/// A running lane: its shared part and its thread.
#[derive(Debug)]
pub(crate) struct LaneHandle {
    /// Shared with submitters.
    pub shared: Arc<LaneShared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LaneHandle {
    /// Starts a lane thread, pins it, builds its glommio executor and waits
    /// until it runs (or reports why it could not).
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
    let executor = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .name(&format!("kvring-lane-{index}"))
        .io_memory(config.io_memory_bytes)
        .ring_depth(IO_RING_DEPTH)
        .make();
    let executor = match executor {
        Ok(executor) => executor,
        Err(e) => {
            let _ = ready.send(Err(glommio_error(index, e)));
            return;
        }
    };
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
    // The loop catches its own panics (`death.rs`); this catches one in the
    // executor around it, so the lane is at least marked dead and refuses
    // new work (what it held then waits for its deadlines).
    if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| executor.run(lane.run()))) {
        let reason = super::death::panic_message(&*payload);
        tracing::error!(lane = index, panic = %reason, "lane executor panicked; the lane is dead");
        if shared.death.set(reason).is_ok() {
            shared.metrics.panicked();
        }
    }
}

/// Names why glommio would not build a lane's executor, by its kind: a
/// locked-memory limit too low says how much is needed.
fn glommio_error(lane: usize, error: glommio::GlommioError<()>) -> Error {
    use glommio::{GlommioError, ReactorErrorKind};
    match error {
        GlommioError::ReactorError(ReactorErrorKind::MemLockLimit(have, need)) => {
            Error::LockedMemoryLimit { have_bytes: have, need_bytes: need }
        }
        other => Error::LaneStart { lane, reason: other.to_string() },
    }
}

/// The soft RLIMIT_MEMLOCK in bytes (`u64::MAX` when unlimited).
pub(crate) fn memlock_limit_bytes() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    (rc == 0).then_some(if limit.rlim_cur == libc::RLIM_INFINITY { u64::MAX } else { limit.rlim_cur })
}

/// Locked memory `lanes` lanes need: glommio's floor, or each lane's
/// io_uring buffers and rings, whichever is larger.
pub(crate) fn memlock_needed_bytes(lanes: usize, io_memory_bytes: usize) -> u64 {
    let per_lane = io_memory_bytes.max(64 * 1024) as u64 + 3 * (IO_RING_DEPTH as u64) * 128;
    (lanes as u64 * per_lane).max(MIN_MEMLOCK_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_locked_memory_limit_too_low_is_named_with_both_figures() {
        let error = glommio::GlommioError::ReactorError(glommio::ReactorErrorKind::MemLockLimit(65536, 524288));
        match glommio_error(3, error) {
            Error::LockedMemoryLimit { have_bytes, need_bytes } => {
                assert_eq!((have_bytes, need_bytes), (65536, 524288))
            }
            other => panic!("{other:?}"),
        }
        let other = glommio::GlommioError::<()>::IoError(std::io::Error::from_raw_os_error(libc::ENOSYS));
        assert!(matches!(glommio_error(3, other), Error::LaneStart { lane: 3, .. }));
    }

    #[test]
    fn locked_memory_needed_never_drops_below_glommios_floor() {
        assert_eq!(memlock_needed_bytes(1, 0), MIN_MEMLOCK_BYTES);
        assert!(memlock_needed_bytes(64, 1 << 20) > 64 << 20);
    }
}
