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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// How long after the deadline the caller waits for a helper's last step
/// (its open has ended in `Timeout` by then; this only bounds the wait).
const GRACE: Duration = Duration::from_secs(1);

/// The process's threads for group opens (kept a while between calls, as
/// a target keeps its control threads: `net::workers`). A child forked
/// after its parent made the pool has none of its threads, only its
/// counts: it makes its own.
fn openers() -> Arc<Workers> {
    static OPENERS: Mutex<Option<(u32, Arc<Workers>)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut pool = OPENERS.lock().unwrap_or_else(|p| p.into_inner());
    match &*pool {
        Some((made_by, workers)) if *made_by == pid => workers.clone(),
        _ => {
            let workers = Workers::start("kvring-open");
            *pool = Some((pid, workers.clone()));
            workers
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
            opened[i] = Some(result.unwrap_or(Err(Error::Timeout { waited: timeout })));
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
