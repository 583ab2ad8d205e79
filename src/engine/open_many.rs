//! Opening a group of peers in one call (a TP group's ranks): the
//! handshakes and transport connects of distinct peers run at once, each on
//! a short-lived thread of its own, under one deadline, so a group whose
//! opens wait on the network costs about one open, not one per peer. On
//! one host the opens' CPU time is the floor instead (the handshakes, the
//! same-host owner check, the connects of both ends): `kvring bench
//! --cold` prints it beside the wall times (docs/FIGURES.md).

use super::{Engine, Segment};
use crate::error::Result;
use crate::transport::TransportKind;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

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
        let results: Vec<Mutex<Option<Result<Segment>>>> = names.iter().map(|_| Mutex::new(None)).collect();
        let next = AtomicUsize::new(0);
        let open_next = || loop {
            // Relaxed: the counter only hands out indices; the results
            // travel through their mutexes and the scope's join.
            let n = next.fetch_add(1, Ordering::Relaxed);
            let Some(&i) = first.get(n) else { return };
            let opened = self.open_segment_by(names[i].as_ref(), transport, timeout, Some(deadline));
            *results[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(opened);
        };
        let workers = first.len().min(MAX_CONCURRENT_OPENS);
        std::thread::scope(|scope| {
            // This thread is one of the workers: one peer costs no thread.
            for _ in 1..workers {
                scope.spawn(open_next);
            }
            open_next();
        });
        results
            .into_iter()
            .zip(names)
            .map(|(slot, name)| match slot.into_inner().unwrap_or_else(|p| p.into_inner()) {
                Some(opened) => opened,
                // A repeated name: its first place has opened by now, so
                // this is a cache hit (or a second try of a failed open).
                None => self.open_segment_by(name.as_ref(), transport, timeout, Some(deadline)),
            })
            .collect()
    }
}
