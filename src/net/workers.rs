//! The threads an [`Acceptor`](super::Acceptor) serves its connections on:
//! still one thread per open connection (so a silent peer holds only its
//! own thread and never delays another's), but a thread whose connection
//! ended waits a while for the next one instead of exiting, and one waits
//! from the start. Spawning a thread and tearing it down was about a fifth
//! of a cold open's CPU time on the target (docs/FIGURES.md, "The cold
//! open's CPU").
//!
//! Nothing is shared between connections served in turn on one thread but
//! the thread: each runs the acceptor's `serve` from the start with its own
//! stream and admission entry. How many connections are served at once is
//! the acceptor's admission book's business (its bounds per source and in
//! total), not this pool's: a connection the book keeps always gets a
//! thread, an idle one or a new one.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Most threads kept waiting for a connection; a thread ending its
/// connection beyond these exits.
pub(crate) const MAX_IDLE_WORKERS: usize = 4;
/// How long a kept thread waits for a connection before it exits (the
/// first one, kept from the start, waits again instead, until `stop`).
pub(crate) const IDLE_KEEP: Duration = Duration::from_secs(60);

/// One connection to serve.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

#[derive(Default)]
struct State {
    /// Threads waiting for a job (not yet handed one).
    idle: usize,
    /// Jobs handed to waiting threads, not yet taken.
    queue: VecDeque<Job>,
    /// Threads alive (serving or waiting).
    alive: usize,
    stopping: bool,
}

/// A set of reusable connection threads.
pub(crate) struct Workers {
    name: &'static str,
    state: Mutex<State>,
    ready: Condvar,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("Workers").field("idle", &state.idle).field("alive", &state.alive).finish()
    }
}

/// Counts a pool's thread out of `alive` when the thread ends, by return
/// or by a job's panic.
struct CountedOut<'a>(&'a Workers);

impl Drop for CountedOut<'_> {
    fn drop(&mut self) {
        self.0.lock().alive -= 1;
    }
}

impl Workers {
    /// A pool naming its threads `name`, with one thread already waiting
    /// (spawned now, so the first peer's connection does not pay for it).
    pub(crate) fn start(name: &'static str) -> Arc<Self> {
        let workers = Arc::new(Self { name, state: Mutex::new(State::default()), ready: Condvar::new() });
        let mut state = workers.lock();
        if workers.spawn(&mut state, None) {
            state.idle += 1;
        }
        drop(state);
        workers
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section leaves the state consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `job` on a waiting thread, or on a new one. `Err` hands the
    /// job back when no thread could be started (the caller cleans up).
    pub(crate) fn run(self: &Arc<Self>, job: Job) -> Result<(), Job> {
        let mut state = self.lock();
        if state.idle > state.queue.len() {
            // A waiting thread not yet handed a job takes it.
            state.queue.push_back(job);
            drop(state);
            self.ready.notify_one();
            return Ok(());
        }
        let mut job = Some(job);
        if self.spawn_with(&mut state, &mut job) {
            Ok(())
        } else {
            Err(job.take().expect("a job not started is handed back"))
        }
    }

    fn spawn_with(self: &Arc<Self>, state: &mut State, job: &mut Option<Job>) -> bool {
        let taken = job.take();
        // The job moves into the thread only when it starts: a failed spawn
        // drops the closure unrun, so it goes in through a slot.
        let slot = Arc::new(Mutex::new(taken));
        let for_thread = slot.clone();
        let started = self.spawn(state, Some(for_thread));
        if !started {
            *job = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        }
        started
    }

    /// Spawns a thread (counted alive) that first runs the job in `first`,
    /// if any, then waits for more.
    fn spawn(self: &Arc<Self>, state: &mut State, first: Option<Arc<Mutex<Option<Job>>>>) -> bool {
        let pool = self.clone();
        let spawned = std::thread::Builder::new().name(self.name.into()).spawn(move || {
            let first = first.and_then(|slot| slot.lock().unwrap_or_else(|p| p.into_inner()).take());
            pool.work(first);
        });
        if spawned.is_ok() {
            state.alive += 1;
        }
        spawned.is_ok()
    }

    /// A thread's life: its job, then jobs handed to it while it waits
    /// (at most [`IDLE_KEEP`] each time), then exit. A thread started
    /// waiting (no job) is the kept one: it does not time out.
    fn work(&self, first: Option<Job>) {
        // Review 7: a job that panics unwinds out of here; the thread must
        // still be counted out of `alive` (its `idle` share is already
        // gone: a job runs only once taken). So the count is left by a
        // guard, whichever way the thread ends.
        let _counted_out = CountedOut(self);
        let kept = first.is_none();
        if let Some(job) = first {
            job();
        }
        let mut state = self.lock();
        if !kept {
            if state.stopping || state.idle >= MAX_IDLE_WORKERS {
                return;
            }
            state.idle += 1;
        }
        loop {
            if let Some(job) = state.queue.pop_front() {
                state.idle -= 1;
                drop(state);
                job();
                state = self.lock();
                if state.stopping || state.idle >= MAX_IDLE_WORKERS {
                    break;
                }
                state.idle += 1;
                continue;
            }
            if state.stopping {
                state.idle -= 1;
                break;
            }
            let (next, waited) = self.ready.wait_timeout(state, IDLE_KEEP).unwrap_or_else(|p| p.into_inner());
            state = next;
            if waited.timed_out() && state.queue.is_empty() && !kept {
                state.idle -= 1;
                break;
            }
        }
    }

    /// Wakes every waiting thread to exit; threads serving a connection
    /// exit when it ends. Jobs still queued are run first (they clean up).
    pub(crate) fn stop(&self) {
        self.lock().stopping = true;
        self.ready.notify_all();
    }

    /// Threads still alive.
    #[cfg(test)]
    pub(crate) fn alive(&self) -> usize {
        self.lock().alive
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    #[test]
    fn a_thread_is_reused_and_a_blocked_job_does_not_hold_up_the_next() {
        let workers = Workers::start("kvring-test-worker");
        let names = Arc::new(Mutex::new(Vec::new()));
        let (release, blocked) = mpsc::channel::<()>();
        let (done, finished) = mpsc::channel::<()>();
        // A job that waits until released (a silent peer).
        let held = done.clone();
        let (taken, running) = mpsc::channel::<()>();
        workers
            .run(Box::new(move || {
                let _ = taken.send(());
                let _ = blocked.recv_timeout(Duration::from_secs(30));
                let _ = held.send(());
            }))
            .unwrap_or_else(|_| panic!("spawned"));
        // Taken by a thread before the others are handed out: on a loaded
        // host the kept thread may start only after the next job's thread
        // has finished, which would then take the blocked job itself.
        running.recv_timeout(Duration::from_secs(30)).expect("the blocked job started");
        // Others still run, on other threads, while it waits.
        for _ in 0..3 {
            let (names, done) = (names.clone(), done.clone());
            workers
                .run(Box::new(move || {
                    names.lock().unwrap().push(std::thread::current().id());
                    let _ = done.send(());
                }))
                .unwrap_or_else(|_| panic!("spawned"));
            finished.recv_timeout(Duration::from_secs(30)).expect("a job ran beside the blocked one");
            // Let the thread go back to waiting before the next job.
            let waited = std::time::Instant::now();
            while workers.lock().idle == 0 && waited.elapsed() < Duration::from_secs(30) {
                std::thread::yield_now();
            }
        }
        let names = names.lock().unwrap().clone();
        assert!(names.windows(2).all(|w| w[0] == w[1]), "one thread served the jobs in turn: {names:?}");
        assert_eq!(workers.alive(), 2, "the blocked thread and the reused one");
        release.send(()).unwrap();
        finished.recv_timeout(Duration::from_secs(30)).unwrap();
        workers.stop();
        let waited = std::time::Instant::now();
        while workers.alive() > 0 && waited.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(workers.alive(), 0, "stop ends the waiting threads");
    }

    /// Waits (bounded) until `workers` has `alive` threads, and says how many.
    /// Runs `jobs` jobs that each count themselves, then wait to be
    /// released; returns how many ran (waiting up to 30 s for all) and the
    /// release of `n` of them.
    fn blocked_burst(workers: &Arc<Workers>, jobs: usize) -> (usize, impl Fn(usize)) {
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        let ran = Arc::new(AtomicUsize::new(0));
        for _ in 0..jobs {
            let (ran, release) = (ran.clone(), release_rx.clone());
            workers
                .run(Box::new(move || {
                    ran.fetch_add(1, Ordering::AcqRel);
                    let _ = release.lock().unwrap().recv_timeout(Duration::from_secs(30));
                }))
                .unwrap_or_else(|_| panic!("spawned"));
        }
        let waited = std::time::Instant::now();
        while ran.load(Ordering::Acquire) < jobs && waited.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let release = move |n| {
            for _ in 0..n {
                release_tx.send(()).unwrap();
            }
        };
        (ran.load(Ordering::Acquire), release)
    }

    fn settle(workers: &Workers, alive: usize) -> usize {
        let waited = std::time::Instant::now();
        while workers.alive() != alive && waited.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(1));
        }
        workers.alive()
    }

    // Review 7: a job that panics (the kept thread's, a first job, a job
    // handed to a waiting thread) must cost the pool neither capacity nor
    // its count, and `stop` must still end every thread. Before the fix a
    // panicking job's thread was never counted out of `alive`.
    #[test]
    fn a_panicking_job_costs_no_capacity_and_its_thread_is_counted_out() {
        let workers = Workers::start("kvring-test-worker");
        let (done, finished) = mpsc::channel::<()>();
        // The kept thread takes this one; then first jobs of new threads.
        for _ in 0..3 {
            let done = done.clone();
            workers
                .run(Box::new(move || {
                    let _done = done;
                    panic!("a job's panic (expected by this test)");
                }))
                .unwrap_or_else(|_| panic!("spawned"));
        }
        // Each panicking job's sender dropped with it: all three ended.
        drop(done);
        assert_eq!(finished.recv_timeout(Duration::from_secs(30)), Err(mpsc::RecvTimeoutError::Disconnected));
        assert_eq!(settle(&workers, 0), 0, "the panicked threads are counted out");
        // A burst after them still gets a thread per job at once.
        let (ran, release) = blocked_burst(&workers, MAX_IDLE_WORKERS * 2);
        assert_eq!(ran, MAX_IDLE_WORKERS * 2, "every job of the burst ran");
        release(MAX_IDLE_WORKERS * 2);
        workers.stop();
        assert_eq!(settle(&workers, 0), 0, "stop ends every thread, none lost to the panics");
    }

    #[test]
    fn stop_wakes_every_waiting_thread_and_a_job_after_stop_still_runs() {
        let workers = Workers::start("kvring-test-worker");
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        for _ in 0..MAX_IDLE_WORKERS + 2 {
            let release = release_rx.clone();
            workers
                .run(Box::new(move || {
                    let _ = release.lock().unwrap().recv_timeout(Duration::from_secs(30));
                }))
                .unwrap_or_else(|_| panic!("spawned"));
        }
        for _ in 0..MAX_IDLE_WORKERS + 2 {
            release_tx.send(()).unwrap();
        }
        assert_eq!(settle(&workers, MAX_IDLE_WORKERS), MAX_IDLE_WORKERS, "the kept ones wait");
        workers.stop();
        assert_eq!(settle(&workers, 0), 0, "stop woke every waiting thread");
        // A connection accepted while stopping still gets its clean-up run.
        let (done, finished) = mpsc::channel::<()>();
        workers.run(Box::new(move || done.send(()).unwrap())).unwrap_or_else(|_| panic!("spawned"));
        finished.recv_timeout(Duration::from_secs(30)).expect("a job after stop ran");
        assert_eq!(settle(&workers, 0), 0, "and its thread did not stay");
    }

    #[test]
    fn at_most_the_kept_threads_stay_after_a_burst() {
        let workers = Workers::start("kvring-test-worker");
        let burst = MAX_IDLE_WORKERS * 3;
        let (ran, release) = blocked_burst(&workers, burst);
        assert_eq!(ran, burst, "every job got a thread at once");
        release(burst);
        let waited = std::time::Instant::now();
        while workers.lock().idle < MAX_IDLE_WORKERS && waited.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(workers.alive(), MAX_IDLE_WORKERS, "the rest exited");
        workers.stop();
    }
}
