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
//! waits for it no longer than its deadline, then proves nothing.
//!
//! The taker's table starts as a copy of the process's; it closes the
//! copies once (from descriptor 3: the files stay open in the process's
//! table). Where `unshare` is refused (a container's seccomp), the
//! descriptor is taken in the caller's table, as before.

use super::owner::{is_the_socket, Far, Taken};
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

/// Jobs queued for the taker. A stuck taker (a close that blocks) leaves
/// each queued job's pidfd copy open, so the queue is bounded; a caller
/// finding it full waits (to its deadline), it is not refused.
const QUEUE_DEPTH: usize = 16;

/// How long a caller finding the queue full sleeps before trying again.
const QUEUE_FULL_RETRY: std::time::Duration = std::time::Duration::from_micros(200);

struct Job {
    /// A copy of the caller's pidfd, by its number in the process's table
    /// (the caller closes it once answered; the taker never does, since
    /// that number means something else in its own table).
    process: RawFd,
    fd: u32,
    far: Far,
    answer: SyncSender<Taken>,
}

/// The taker: its queue, and the process it was started in (a forked child
/// starts its own).
static TAKER: Mutex<Option<(u32, SyncSender<Job>)>> = Mutex::new(None);

/// Whether descriptor `fd` of `process` is the socket `far`, taken and
/// closed in the taker's table; `Other` (not proven) when the taker does
/// not answer by `deadline`.
pub(super) fn take(process: &OwnedFd, fd: u32, far: &Far, deadline: Instant) -> Taken {
    let Some(queue) = taker() else { return is_the_socket(process, fd, far) };
    let Ok(copy) = process.try_clone() else { return Taken::Other };
    let raw = copy.into_raw_fd();
    let (answer, answered) = sync_channel(1);
    let mut job = Job { process: raw, fd, far: *far, answer };
    // Concurrent handshakes (an `open_many` of a TP group) queue more jobs
    // than the queue holds: a full queue is waited on, to the deadline.
    loop {
        match queue.try_send(job) {
            Ok(()) => break,
            Err(TrySendError::Full(back)) if Instant::now() < deadline => {
                job = back;
                std::thread::sleep(QUEUE_FULL_RETRY);
            }
            Err(_) => {
                // SAFETY: the copy made above, never queued: closed here, once.
                drop(unsafe { OwnedFd::from_raw_fd(raw) });
                return Taken::Other;
            }
        }
    }
    match answered.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
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
        // The taker is stuck (a close that blocks): the copy is left open,
        // since it may still read it (one per queued job at most).
        Err(_) => Taken::Other,
    }
}

/// The taker's queue, started on first use in this process.
fn taker() -> Option<SyncSender<Job>> {
    let mut taker = TAKER.lock().unwrap_or_else(PoisonError::into_inner);
    let pid = std::process::id();
    if let Some((started_in, queue)) = taker.as_ref() {
        if *started_in == pid {
            return Some(queue.clone());
        }
    }
    let (queue, jobs) = sync_channel(QUEUE_DEPTH);
    std::thread::Builder::new().name("kvring-owner-take".into()).spawn(move || serve(&jobs)).ok()?;
    *taker = Some((pid, queue.clone()));
    Some(queue)
}

fn serve(jobs: &Receiver<Job>) {
    // SAFETY: unshare with a flag only; it gives this thread a copy of the
    // process's descriptor table.
    if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "the owner check cannot take descriptors in a table of its own: it takes them in the engine's"
        );
        while let Ok(job) = jobs.recv() {
            let _ = job.answer.send(Taken::Unavailable);
        }
        return;
    }
    // SAFETY: close_range on this thread's own table, from 3 up: the
    // copies of the process's descriptors (their files stay open there).
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    let me = crate::gpu::fd::pidfd_open(std::process::id()).ok();
    while let Ok(job) = jobs.recv() {
        let taken = match me.as_ref().and_then(|me| take_fd(me, job.process)) {
            Some(process) => is_the_socket(&process, job.fd, &job.far),
            None => Taken::Refused,
        };
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
