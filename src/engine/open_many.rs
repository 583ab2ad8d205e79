//! Opening a group of peers in one call (a TP group's ranks): the
//! handshakes and transport connects of distinct peers run at once, each on
//! a thread of its own (the caller's, and threads of a small process-wide
//! pool kept between calls), under one deadline, so a group whose
//! opens wait on the network costs about one open, not one per peer. On
//! one host the opens' CPU time is the floor instead (the handshakes, the
//! same-host owner check, the connects of both ends): `kvring bench
//! --cold` prints it beside the wall times (docs/FIGURES.md).

use super::{Engine, Segment};
use crate::error::{Error, Result};
use crate::net::{Job, Workers};
use crate::transport::TransportKind;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// How long after the deadline the caller waits for a helper's last step
/// (its open has ended in `Timeout` by then; this only bounds the wait).
const GRACE: Duration = Duration::from_secs(1);

/// The process's opener pool, tagged with the fork generation that made
/// it. Entries are leaked, never freed: one per process that made a pool
/// (a forked child replaces its parent's, whose threads it does not have).
struct Pool {
    generation: u64,
    workers: Arc<Workers>,
}

static POOL: AtomicPtr<Pool> = AtomicPtr::new(std::ptr::null_mut());

/// Forks this process went through (counted in the child, by the handler
/// `fork_generation` registers).
static FORKS: AtomicU64 = AtomicU64::new(0);
static FORK_HANDLER: AtomicBool = AtomicBool::new(false);

extern "C" fn forked_child() {
    // Only an atomic add: a child of a multithreaded fork may call only
    // async-signal-safe functions until it execs (pthread_atfork(3), fork(2)).
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// This process's fork generation: it changes in the child of every fork
/// after the first call (a pid does not: a descendant may get its
/// creator's pid back). No lock is taken, so a fork while another thread
/// is here leaves the child nothing held.
pub(crate) fn fork_generation() -> u64 {
    // Not `Once`: a fork while another thread ran its closure would leave
    // the child waiting on it forever. Threads that race here each
    // register a handler; a second one only counts a fork twice.
    if !FORK_HANDLER.load(Ordering::Acquire) {
        // SAFETY: `forked_child` is an `extern "C" fn()` with static
        // lifetime that only adds to an atomic.
        let registered = unsafe { libc::pthread_atfork(None, None, Some(forked_child)) } == 0;
        // Unregistered (ENOMEM), the pid still changes in a child: better
        // than nothing, and the next call tries again.
        if registered {
            FORK_HANDLER.store(true, Ordering::Release);
        } else {
            return u64::from(std::process::id()) << 32 | 1 << 63;
        }
    }
    // Acquire: pairs with nothing across threads (the child's add happens
    // before any of its threads exist); Relaxed would do, Acquire is free.
    FORKS.load(Ordering::Acquire)
}

/// The process's threads for group opens (kept a while between calls, as
/// a target keeps its control threads: `net::workers`). A child forked
/// after its parent made the pool has none of its threads, only its
/// counts: it makes its own, told apart by its fork generation. The pool
/// is started with no lock held (its first thread spawns in
/// `Workers::start`); of two threads that race, the one published second
/// stops its own.
fn openers() -> Arc<Workers> {
    let generation = fork_generation();
    loop {
        let current = POOL.load(Ordering::Acquire);
        // SAFETY: a non-null entry was leaked by `Box::into_raw` below and
        // is never freed.
        if let Some(pool) = unsafe { current.as_ref() } {
            if pool.generation == generation {
                return pool.workers.clone();
            }
        }
        let workers = Workers::start("kvring-open");
        let made = Box::into_raw(Box::new(Pool { generation, workers: workers.clone() }));
        // AcqRel: publishes the entry to the Acquire loads above; the
        // entry it replaces (another process generation's) is leaked.
        match POOL.compare_exchange(current, made, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return workers,
            Err(_) => {
                // SAFETY: `made` was never published: ours alone.
                drop(unsafe { Box::from_raw(made) });
                workers.stop();
            }
        }
    }
}

/// One `open_many` call's shared state: the distinct names, their
/// results, the next name to take.
struct Group {
    engine: Engine,
    names: Vec<String>,
    results: Vec<Mutex<Option<Result<Segment>>>>,
    next: AtomicUsize,
    transport: Option<TransportKind>,
    timeout: Duration,
    deadline: Instant,
}

impl Group {
    /// Opens names in turn until none is left.
    fn open_next(&self) {
        loop {
            // Relaxed: the counter only hands out indices; the results
            // travel through their mutexes and the channel.
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(name) = self.names.get(n) else { return };
            let opened = self.engine.open_segment_by(name, self.transport, self.timeout, Some(self.deadline));
            *self.results[n].lock().unwrap_or_else(|p| p.into_inner()) = Some(opened);
        }
    }
}

/// Most peers `open_many` opens at once: a bound on the threads one call
/// starts. A TP group (8, 16 ranks) fits; a larger list is worked through
/// by this many threads in turn.
pub(crate) const MAX_CONCURRENT_OPENS: usize = 32;

impl Engine {
    /// Opens every peer in `names` (names or control addresses), their
    /// handshakes and connects running concurrently, and returns each
    /// peer's own result, in the order of `names`. One dead or refusing
    /// peer is its own typed error and holds up none of the others. Every
    /// open shares the one deadline, `timeout` from the call, however many
    /// peers it opens and however many threads that takes: a peer not
    /// reached by then is `Timeout`.
    ///
    /// A name listed twice is opened once; its later places get the cached
    /// handle (or, if the open failed, the error of a second try within
    /// what is left of the deadline).
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// let ranks = ["127.0.0.1:7100", "127.0.0.1:7101"];
    /// for (rank, opened) in engine.open_many(&ranks, None, std::time::Duration::from_secs(5)).iter().enumerate() {
    ///     match opened {
    ///         Ok(segment) => println!("rank {rank}: {}", segment.transport().name()),
    ///         Err(error) => println!("rank {rank}: {error}"),
    ///     }
    /// }
    /// ```
    pub fn open_many<S: AsRef<str> + Sync>(
        &self,
        names: &[S],
        transport: Option<TransportKind>,
        timeout: Duration,
    ) -> Vec<Result<Segment>> {
        // The first place of each distinct name is opened concurrently.
        // A set, not a scan of `first`: thousands of names stay linear.
        let mut seen = std::collections::HashSet::with_capacity(names.len());
        let first: Vec<usize> = (0..names.len()).filter(|&i| seen.insert(names[i].as_ref())).collect();
        let deadline = crate::deadline::deadline_after(timeout);
        let group = Arc::new(Group {
            engine: self.clone(),
            names: first.iter().map(|&i| names[i].as_ref().to_string()).collect(),
            results: first.iter().map(|_| Mutex::new(None)).collect(),
            next: AtomicUsize::new(0),
            transport,
            timeout,
            deadline,
        });
        let helpers = first.len().min(MAX_CONCURRENT_OPENS).saturating_sub(1);
        let (done, finished) = mpsc::channel::<()>();
        let mut started = 0;
        let pool = if helpers > 0 { Some(openers()) } else { None };
        for _ in 0..helpers {
            let (group, done) = (group.clone(), done.clone());
            // Threads of the process's pool: spawning 7 threads per call
            // was a fifth of a group open's CPU on one host.
            let job: Job = Box::new(move || {
                group.open_next();
                let _ = done.send(());
            });
            if pool.as_ref().is_some_and(|pool| pool.run(job).is_ok()) {
                started += 1;
            }
        }
        // Only the helpers hold senders now: one that ends without sending
        // (a panic) ends the wait early instead of at the grace.
        drop(done);
        // This thread is one of the workers: one peer costs no thread.
        group.open_next();
        // Every open ends at the deadline; the grace covers a thread's
        // last step after it. A result still missing then is `Timeout`.
        for _ in 0..started {
            let left = deadline.saturating_duration_since(Instant::now()) + GRACE;
            if finished.recv_timeout(left).is_err() {
                break;
            }
        }
        let mut opened: Vec<Option<Result<Segment>>> = Vec::with_capacity(names.len());
        opened.resize_with(names.len(), || None);
        for (slot, &i) in group.results.iter().zip(&first) {
            let result = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
            opened[i] =
                Some(result.unwrap_or(Err(Error::Timeout { what: "a peer's open in open_many", waited: timeout })));
        }
        opened
            .into_iter()
            .zip(names)
            .map(|(slot, name)| match slot {
                Some(opened) => opened,
                // A repeated name: its first place has opened by now, so
                // this is a cache hit (or a second try of a failed open).
                None => self.open_segment_by(name.as_ref(), transport, timeout, Some(deadline)),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A forked child makes a pool of its own, with a thread that runs its
    /// jobs, told apart by its fork generation (never its pid, which a
    /// descendant may get back), while threads of the parent keep taking
    /// the pool as it forks. `openers` takes no lock, so a fork in the
    /// middle of another thread's call leaves the child nothing held; the
    /// old code's window (its mutex held while the pool's first thread
    /// spawned) could only be hit by chance, so this test does not claim
    /// to force it: it fails if a child hangs or shares its parent's pool.
    #[test]
    fn a_forked_child_makes_a_pool_of_its_own_while_the_parent_is_busy() {
        let parent = openers();
        let generation = fork_generation();
        let stop = Arc::new(AtomicBool::new(false));
        let busy: Vec<_> = (0..2)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        drop(openers());
                    }
                })
            })
            .collect();
        for _ in 0..8 {
            // SAFETY: the child only takes its pool, runs one job on it,
            // waits for it with a deadline and leaves with `_exit`.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork");
            if pid == 0 {
                let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let pool = openers();
                    let (ran, told) = mpsc::channel();
                    let job: Job = Box::new(move || {
                        let _ = ran.send(());
                    });
                    fork_generation() != generation
                        && !Arc::ptr_eq(&pool, &parent)
                        && pool.run(job).is_ok()
                        && told.recv_timeout(Duration::from_secs(10)).is_ok()
                }))
                .unwrap_or(false);
                // SAFETY: ends the forked child at once, running no
                // destructor of state it shares with its parent.
                unsafe { libc::_exit(if ok { 0 } else { 3 }) };
            }
            let mut status = 0;
            let started = Instant::now();
            loop {
                // SAFETY: waits for our own child, without blocking.
                if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                    break;
                }
                if started.elapsed() > Duration::from_secs(20) {
                    // SAFETY: our own child.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                    panic!("a forked child's pool hung");
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "forked child: status {status:#x}");
        }
        stop.store(true, Ordering::Relaxed);
        for thread in busy {
            thread.join().unwrap();
        }
        assert!(Arc::ptr_eq(&openers(), &parent), "the parent keeps its pool");
        assert_eq!(fork_generation(), generation, "a fork changes the child's generation only");
    }
}
