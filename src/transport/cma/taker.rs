//! Where the owner check takes a claimed pid's descriptor and closes it: a
//! thread whose descriptor table is its own (`unshare(CLONE_FILES)`).
//!
//! Only an entry whose `/proc` link named the answering socket is taken,
//! but the peer may put another file at that number between the `readlink`
//! and the `pidfd_getfd`, and what is taken is closed. Closing a descriptor
//! runs its file's `flush` and drops every POSIX lock the *descriptor
//! table's owner* holds on that file (`filp_close`, fs/open.c; fcntl(2):
//! "If a process closes any file descriptor referring to a file, then all
//! of the process's locks on that file are released"): taken in the
//! engine's own table, a raced file (a SQLite database the peer can open)
//! would cost this process its locks. The taker's table holds no lock, so
//! nothing of this process's is dropped; a close that blocks (a FUSE
//! daemon that never answers FLUSH) blocks the taker alone, and the check
//! waits for it no longer than its deadline, then proves nothing. A taker
//! found busy on one job for longer than [`STUCK_AFTER`] is replaced by a
//! new one for the checks that follow (at most [`MAX_REPLACED`] times in a
//! process's life, since each stuck one keeps its thread): one peer's
//! blocked close does not leave every later same-host peer unproven (and so
//! taken as remote, refused shm and cma).
//!
//! The taker's table starts as a copy of the process's; it closes the
//! copies once (from descriptor 3: the files stay open in the process's
//! table). Where `unshare` is refused (a container's seccomp), the
//! descriptor is taken in the caller's table, as before.

use super::owner::{is_the_socket, Far, Taken};
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Jobs queued for the taker. A stuck taker (a close that blocks) leaves
/// each queued job's pidfd copy open, so the queue is bounded; a caller
/// finding it full waits (to its deadline), it is not refused.
const QUEUE_DEPTH: usize = 16;

/// How long a caller finding the queue full sleeps before trying again.
const QUEUE_FULL_RETRY: Duration = Duration::from_micros(200);

/// A job takes microseconds (a `pidfd_getfd`, an `fstat`, a close): a
/// taker on one job this long is taken as stuck in a close that blocks.
const STUCK_AFTER: Duration = Duration::from_secs(1);

/// Stuck takers replaced in a process's life, at most.
const MAX_REPLACED: usize = 8;

/// Longest a check waits for the taker's answer (within its deadline).
const TAKER_WAIT: Duration = Duration::from_secs(2);

struct Job {
    /// A copy of the caller's pidfd, by its number in the process's table
    /// (the caller closes it once answered; the taker never does, since
    /// that number means something else in its own table).
    process: RawFd,
    fd: u32,
    far: Far,
    answer: SyncSender<Taken>,
    /// Set once the taker no longer reads `process` (its own copy made, or
    /// none to make): the number may then be closed in the process's table.
    released: Arc<AtomicBool>,
}

/// Copies of pidfds whose checks gave up before the taker was done with
/// them, each with its job's `released`: closed by a later check once set
/// (a thread of the process's table; the taker cannot close them from its
/// own). At most one per job queued.
static ORPHANS: Mutex<Vec<(RawFd, Arc<AtomicBool>)>> = Mutex::new(Vec::new());

/// Closes the orphaned copies the taker is done with.
fn close_released_orphans() {
    let Some(mut orphans) = lock_soon(&ORPHANS) else { return };
    orphans.retain(|(raw, released)| {
        if !released.load(Ordering::Acquire) {
            return true;
        }
        // SAFETY: a copy this process made for a job, handed to no one
        // else and closed only here, once: the taker released it.
        drop(unsafe { OwnedFd::from_raw_fd(*raw) });
        false
    });
}

/// Gives up on a queued job's copy: closed now if the taker is done with
/// it, else orphaned until it is.
fn give_up_copy(raw: RawFd, released: Arc<AtomicBool>) {
    if released.load(Ordering::Acquire) {
        // SAFETY: the taker released it; this check made it and closes it once.
        drop(unsafe { OwnedFd::from_raw_fd(raw) });
    } else {
        // Not taken in time (see `lock_soon`): the copy stays open.
        if let Some(mut orphans) = lock_soon(&ORPHANS) {
            orphans.push((raw, released));
        }
    }
}

/// The takers of this process: the one serving now, and how many were
/// replaced.
struct Takers {
    state: Mutex<State>,
}

struct State {
    current: Option<Taker>,
    replaced: usize,
    /// Jobs the next taker started holds until this answers (tests: a
    /// close that blocks).
    #[cfg(test)]
    hold: Option<Receiver<()>>,
}

/// One taker thread: its queue, the process it was started in (a forked
/// child starts its own), and since when it is on its current job.
#[derive(Clone)]
struct Taker {
    started_in: u32,
    queue: SyncSender<Job>,
    busy_since: Arc<Mutex<Option<Instant>>>,
}

static TAKERS: Takers = Takers::new();

impl Takers {
    const fn new() -> Self {
        Self {
            state: Mutex::new(State {
                current: None,
                replaced: 0,
                #[cfg(test)]
                hold: None,
            }),
        }
    }

    /// The taker serving now, started on first use in this process (and
    /// anew after one was found stuck).
    fn get(&self) -> Option<Taker> {
        let mut state = lock_soon(&self.state)?;
        let pid = std::process::id();
        if let Some(taker) = state.current.as_ref().filter(|t| t.started_in == pid) {
            return Some(taker.clone());
        }
        let (queue, jobs) = sync_channel(QUEUE_DEPTH);
        let busy_since = Arc::new(Mutex::new(None));
        let busy = busy_since.clone();
        #[cfg(test)]
        let hold = state.hold.take();
        #[cfg(not(test))]
        let hold: Option<Receiver<()>> = None;
        std::thread::Builder::new().name("kvring-owner-take".into()).spawn(move || serve(&jobs, &busy, hold)).ok()?;
        let taker = Taker { started_in: pid, queue, busy_since };
        state.current = Some(taker.clone());
        Some(taker)
    }

    /// A check gave up on `taker`: replaced when it has been on one job
    /// past [`STUCK_AFTER`] (not merely slow under load), within
    /// [`MAX_REPLACED`].
    fn gave_up_on(&self, taker: &Taker) {
        let stuck = lock_busy(&taker.busy_since).is_some_and(|since| since.elapsed() >= STUCK_AFTER);
        let Some(mut state) = lock_soon(&self.state) else { return };
        let current = state.current.as_ref().is_some_and(|t| Arc::ptr_eq(&t.busy_since, &taker.busy_since));
        if stuck && current && state.replaced < MAX_REPLACED {
            state.replaced += 1;
            state.current = None;
            tracing::warn!(
                replaced = state.replaced,
                "the owner check's taker is stuck on one descriptor (a close that blocks): a new one takes the next checks"
            );
        }
    }
}

/// How long a check tries for one of the taker's locks.
const LOCK_WAIT: Duration = Duration::from_millis(50);

/// `mutex`, taken within [`LOCK_WAIT`] (its holders hold it for
/// microseconds), or `None`: in a child forked while another thread of the
/// parent held it, it is held for ever (only the forking thread lives on),
/// and a check must not hang on it. The caller then goes without: the
/// descriptor is taken in the caller's own table, as where `unshare` is
/// refused.
fn lock_soon<T>(mutex: &Mutex<T>) -> Option<std::sync::MutexGuard<'_, T>> {
    let until = Instant::now() + LOCK_WAIT;
    loop {
        match mutex.try_lock() {
            Ok(guard) => return Some(guard),
            Err(std::sync::TryLockError::Poisoned(poisoned)) => return Some(poisoned.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => {
                std::thread::sleep(Duration::from_micros(100));
            }
            Err(std::sync::TryLockError::WouldBlock) => return None,
        }
    }
}

fn lock_busy(busy: &Mutex<Option<Instant>>) -> std::sync::MutexGuard<'_, Option<Instant>> {
    busy.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether descriptor `fd` of `process` is the socket `far`, taken and
/// closed in the taker's table; `Other` (not proven) when the taker does
/// not answer by `deadline`.
pub(super) fn take(process: &OwnedFd, fd: u32, far: &Far, deadline: Instant) -> Taken {
    take_with(&TAKERS, process, fd, far, deadline)
}

fn take_with(takers: &Takers, process: &OwnedFd, fd: u32, far: &Far, deadline: Instant) -> Taken {
    close_released_orphans();
    // A check already out of time queues nothing (its copy would be
    // orphaned at once).
    if Instant::now() >= deadline {
        return Taken::Other;
    }
    let Some(taker) = takers.get() else { return is_the_socket(process, fd, far) };
    // The taker is waited for a slice of the deadline only: one stuck for
    // good (past the replacements) costs each check that slice, and the
    // check goes on, unproven by it, within its deadline.
    let wait_until = deadline.min(Instant::now() + TAKER_WAIT);
    let queue = &taker.queue;
    let Ok(copy) = process.try_clone() else { return Taken::Other };
    let raw = copy.into_raw_fd();
    let (answer, answered) = sync_channel(1);
    let released = Arc::new(AtomicBool::new(false));
    let mut job = Job { process: raw, fd, far: *far, answer, released: released.clone() };
    // Concurrent handshakes (an `open_many` of a TP group) queue more jobs
    // than the queue holds: a full queue is waited on, to the wait's end.
    loop {
        match queue.try_send(job) {
            Ok(()) => break,
            Err(TrySendError::Full(back)) if Instant::now() < wait_until => {
                job = back;
                std::thread::sleep(QUEUE_FULL_RETRY);
            }
            Err(_) => {
                // SAFETY: the copy made above, never queued: closed here, once.
                drop(unsafe { OwnedFd::from_raw_fd(raw) });
                takers.gave_up_on(&taker);
                return Taken::Other;
            }
        }
    }
    match answered.recv_timeout(wait_until.saturating_duration_since(Instant::now())) {
        Ok(Taken::Unavailable) => {
            // SAFETY: the taker answered, so it is done with the copy.
            drop(unsafe { OwnedFd::from_raw_fd(raw) });
            is_the_socket(process, fd, far)
        }
        Ok(taken) => {
            // SAFETY: as above.
            drop(unsafe { OwnedFd::from_raw_fd(raw) });
            taken
        }
        // Late, or stuck (a close that blocks): the copy is closed once the
        // taker no longer reads it (`ORPHANS`).
        Err(_) => {
            give_up_copy(raw, released);
            takers.gave_up_on(&taker);
            Taken::Other
        }
    }
}

/// The taker's loop, until its queue's last sender goes; `busy` says since
/// when it is on a job; `hold` (tests) makes each job wait for it.
fn serve(jobs: &Receiver<Job>, busy: &Mutex<Option<Instant>>, hold: Option<Receiver<()>>) {
    // SAFETY: unshare with a flag only; it gives this thread a copy of the
    // process's descriptor table.
    if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "the owner check cannot take descriptors in a table of its own: it takes them in the engine's"
        );
        while let Ok(job) = jobs.recv() {
            job.released.store(true, Ordering::Release);
            let _ = job.answer.send(Taken::Unavailable);
        }
        return;
    }
    // SAFETY: close_range on this thread's own table, from 3 up: the
    // copies of the process's descriptors (their files stay open there).
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    let me = crate::gpu::fd::pidfd_open(std::process::id()).ok();
    while let Ok(job) = jobs.recv() {
        *lock_busy(busy) = Some(Instant::now());
        if let Some(hold) = hold.as_ref() {
            let _ = hold.recv();
        }
        let process = me.as_ref().and_then(|me| take_fd(me, job.process));
        // Its own copy made (or none to make): the caller's may be closed.
        job.released.store(true, Ordering::Release);
        let taken = match process {
            Some(process) => is_the_socket(&process, job.fd, &job.far),
            None => Taken::Refused,
        };
        *lock_busy(busy) = None;
        let _ = job.answer.send(taken);
    }
}

/// Descriptor `fd` of the process `me` names, copied into this thread's table.
fn take_fd(me: &OwnedFd, fd: RawFd) -> Option<OwnedFd> {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_getfd(2) with integers only; a new descriptor or -1.
    let taken = unsafe { libc::syscall(libc::SYS_pidfd_getfd, me.as_raw_fd(), fd, 0) };
    // SAFETY: a fresh descriptor of this table nothing else owns.
    (taken >= 0).then(|| unsafe { OwnedFd::from_raw_fd(taken as RawFd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;
    use std::os::fd::AsRawFd;

    /// A loopback connection whose both ends this process holds: its two
    /// ends (kept open by the caller), the far end as the kernel names it,
    /// the descriptor of the accepted end, and this process's pidfd.
    fn a_connection_of_this_process() -> ((TcpStream, TcpStream), Far, u32, OwnedFd) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let far = Far::of_connection(client.local_addr().unwrap(), client.peer_addr().unwrap());
        let fd = server.as_raw_fd() as u32;
        let me = crate::gpu::fd::pidfd_open(std::process::id()).unwrap();
        ((client, server), far, fd, me)
    }

    /// A child forked while another thread held the takers' lock finds
    /// it held for ever: a check there must not hang on it. Here another
    /// thread holds it; the check goes on in its own table and proves the
    /// socket.
    #[test]
    fn a_check_whose_taker_lock_stays_held_takes_the_descriptor_itself() {
        let (_ends, far, fd, me) = a_connection_of_this_process();
        let takers = Takers::new();
        let held = takers.state.lock().unwrap();
        let (answer, answered) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let deadline = Instant::now() + Duration::from_secs(30);
                let _ = answer.send(take_with(&takers, &me, fd, &far, deadline));
            });
            let got = answered.recv_timeout(Duration::from_secs(10));
            drop(held);
            assert_eq!(got, Ok(Taken::Same), "a check waited on the takers' held lock");
        });
    }

    /// A taker held on its first job (a close that blocks): a check whose
    /// deadline is shorter than [`STUCK_AFTER`] gives up and replaces
    /// nothing (a slow taker is not a stuck one); one that gives up after
    /// it replaces the taker; the next check is proven by the new one,
    /// not queued behind the stuck one.
    #[test]
    fn a_taker_stuck_on_one_descriptor_is_replaced_for_the_next_checks() {
        let (_ends, far, fd, me) = a_connection_of_this_process();
        let takers = Takers::new();
        let (release, hold) = sync_channel::<()>(0);
        takers.state.lock().unwrap().hold = Some(hold);
        let replaced = || takers.state.lock().unwrap().replaced;

        let short = take_with(&takers, &me, fd, &far, Instant::now() + STUCK_AFTER / 5);
        assert_eq!((short, replaced()), (Taken::Other, 0), "a check that gave up early replaces nothing");
        let long = take_with(&takers, &me, fd, &far, Instant::now() + STUCK_AFTER + STUCK_AFTER / 2);
        assert_eq!((long, replaced()), (Taken::Other, 1), "a taker on one job past STUCK_AFTER is replaced");
        let next = take_with(&takers, &me, fd, &far, Instant::now() + Duration::from_secs(30));
        assert_eq!(next, Taken::Same, "the check after a stuck taker is proven by a new one");
        assert_eq!(replaced(), 1);
        drop(release);
    }
}
