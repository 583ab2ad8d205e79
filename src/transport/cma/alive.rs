//! The cma page's *liveness word*: a word of the page that the kernel
//! itself changes the moment the target's image goes away, by exit or by
//! exec, so that an initiator checks it with one load of its own mapping
//! instead of a `process_vm_readv` through the target before every call.
//!
//! The mechanism is the kernel's robust futex list (`set_robust_list(2)`,
//! `get_robust_list(2)`; the kernel's `Documentation/locking/robust-futexes.rst`
//! and `robust-futex-ABI.rst`): a thread registers a list of futex words
//! it owns (each holding its TID); when the thread exits, for whatever
//! reason, the kernel walks the list and sets `FUTEX_OWNER_DIED` in every
//! word that still holds its TID (`handle_futex_death`). An `execve` of any
//! thread of the process first kills every other thread (each walks its
//! list on the way out: `exit_mm_release` → `futex_exit_release`), and the
//! exec'ing thread's own list is walked by `exec_mm_release`, all before
//! the new image's address space is installed (`de_thread` then
//! `exec_mmap`). So a thread of kvring's own that owns the word and does
//! nothing else (it parks) marks it, through the kernel, before the
//! process exits, and before an exec'd image exists.
//!
//! `set_robust_list` replaces the list glibc registered for the thread at
//! its start (one list per thread): glibc's own list serves robust
//! `pthread_mutex`es, which this thread never takes (it parks, and Rust's
//! `std` locks are not robust mutexes), so nothing of glibc's is lost.
//! A seccomp filter that refuses the call makes the page fail to be
//! created, and same-host peers take the next transport (the engine says
//! why in its descriptor).
//!
//! The word is the head's last 8 bytes (its low 4 bytes the futex word,
//! on a little-endian machine; the high 4 stay 0); the list's head and its
//! one entry live in the heap of the [`Sentinel`], which outlives the
//! thread (joined before they are freed).

use crate::sync::{AtomicU64, Ordering};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;

/// The kernel's `struct robust_list` (linux/futex.h).
#[derive(Debug)]
#[repr(C)]
struct RobustList {
    next: *mut RobustList,
}

/// The kernel's `struct robust_list_head` (linux/futex.h).
#[derive(Debug)]
#[repr(C)]
struct RobustListHead {
    list: RobustList,
    futex_offset: libc::c_long,
    list_op_pending: *mut RobustList,
}

/// `FUTEX_TID_MASK` (linux/futex.h): the owner's TID in a futex word.
const TID_MASK: u64 = 0x3fff_ffff;

/// True while `word` (as read from the page) names a live owner `tid`.
#[inline]
pub fn holds(word: u64, tid: u64) -> bool {
    word == tid && tid != 0 && tid & !TID_MASK == 0
}

/// The thread owning the liveness word, parked for the target's life.
#[derive(Debug)]
pub(crate) struct Sentinel {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The robust list the kernel reads when the thread exits; freed only
    /// after the thread was joined.
    list: Box<(RobustListHead, RobustList)>,
}

// SAFETY: the raw pointers inside `list` point into `list` itself and are
// only read by the kernel on the sentinel thread's exit.
unsafe impl Send for Sentinel {}
// SAFETY: as above; no method reads or writes `list` through `&self`.
unsafe impl Sync for Sentinel {}

impl Sentinel {
    /// Starts the thread that owns `word` (the page's liveness word, which
    /// must stay mapped until this is dropped); returns once the word holds
    /// its TID and the kernel holds its list.
    pub fn start(word: &AtomicU64) -> std::io::Result<Self> {
        let mut list = Box::new((
            RobustListHead {
                list: RobustList { next: std::ptr::null_mut() },
                futex_offset: 0,
                list_op_pending: std::ptr::null_mut(),
            },
            RobustList { next: std::ptr::null_mut() },
        ));
        let (head, entry) = (&raw mut list.0, &raw mut list.1);
        // SAFETY: both pointers point into `list`, which is alive and ours.
        unsafe {
            // A circular list of one entry: the kernel stops when it comes
            // back to the head; the futex word lies `futex_offset` bytes
            // after the entry.
            (*head).list.next = entry;
            (*entry).next = &raw mut (*head).list;
            (*head).futex_offset = (word as *const AtomicU64 as isize - entry as isize) as libc::c_long;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (head_at, word_at) = (head as usize, word as *const AtomicU64 as usize);
        let (ready, registered) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new().name("kvring-cma-alive".into()).spawn({
            let stop = stop.clone();
            move || {
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::gettid() } as u64;
                // SAFETY: the page (and so the word) stays mapped until the
                // Sentinel, which joins this thread first, is dropped.
                let word = unsafe { &*(word_at as *const AtomicU64) };
                word.store(tid, Ordering::SeqCst);
                // SAFETY: `head_at` is a valid robust_list_head that lives
                // until this thread was joined; the kernel only reads it.
                let rc =
                    unsafe { libc::syscall(libc::SYS_set_robust_list, head_at, std::mem::size_of::<RobustListHead>()) };
                let _ = ready.send(if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) });
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    std::thread::park();
                }
                // Returning exits the thread: the kernel marks the word.
            }
        })?;
        let sentinel = Self { stop, thread: Some(thread), list };
        match registered.recv() {
            Ok(Ok(())) => Ok(sentinel),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(std::io::Error::other("the cma liveness thread ended before it started")),
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
        // Only now may `list` go: the kernel read it when the thread exited.
        let _ = &self.list;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `FUTEX_OWNER_DIED` (linux/futex.h).
    const OWNER_DIED: u64 = 0x4000_0000;

    #[test]
    fn the_kernel_marks_the_word_when_its_thread_exits() {
        let word = Box::new(AtomicU64::new(0));
        let sentinel = Sentinel::start(&word).unwrap();
        let tid = word.load(Ordering::SeqCst);
        assert!(holds(tid, tid), "the owning thread wrote its TID: {tid:#x}");
        // SAFETY: gettid has no preconditions.
        assert_ne!(tid, unsafe { libc::gettid() } as u64, "owned by a thread of its own");
        drop(sentinel);
        assert_eq!(word.load(Ordering::SeqCst), OWNER_DIED, "the kernel released it");
        assert!(!holds(word.load(Ordering::SeqCst), tid));
        assert!(!holds(0, 0), "an unwritten word names nobody");
    }
}
