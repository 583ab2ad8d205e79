//! File descriptors passed between processes, as device memory of the
//! virtual memory API is shared: the exporter keeps a shareable descriptor
//! open and names it by (pid, number); the opener duplicates it with
//! `pidfd_open` and `pidfd_getfd` (Linux 5.6), as PyTorch shares its
//! expandable segments. The kernel allows that only to a process that may
//! ptrace the exporter: the same user, and where Yama's `ptrace_scope` is 1,
//! a descendant or a process the exporter named with `PR_SET_PTRACER`.

use super::IPC_HANDLE_BYTES;
use std::os::fd::{FromRawFd, OwnedFd};

/// Marks a descriptor handle's payload.
const MAGIC: [u8; 4] = *b"KVFD";

/// The payload naming descriptor `fd` of process `pid`.
pub(crate) fn encode(pid: u32, fd: i32) -> [u8; IPC_HANDLE_BYTES] {
    let mut bytes = [0u8; IPC_HANDLE_BYTES];
    bytes[..4].copy_from_slice(&MAGIC);
    bytes[4..8].copy_from_slice(&pid.to_le_bytes());
    bytes[8..12].copy_from_slice(&fd.to_le_bytes());
    bytes
}

/// The (pid, fd) a payload names, or why it names none.
pub(crate) fn decode(bytes: &[u8; IPC_HANDLE_BYTES]) -> Result<(u32, i32), String> {
    if bytes[..4] != MAGIC {
        return Err("not a file descriptor handle".into());
    }
    let word = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let (pid, fd) = (word(4), word(8) as i32);
    if pid == 0 || fd < 0 {
        return Err(format!("names no descriptor (pid {pid}, fd {fd})"));
    }
    Ok((pid, fd))
}

/// Duplicates descriptor `fd` of process `pid` into this one; the error
/// says what to do about it.
pub(crate) fn take(pid: u32, fd: i32) -> Result<OwnedFd, String> {
    let pidfd = pidfd_open(pid).map_err(|error| match error.raw_os_error() {
        Some(libc::ESRCH) => format!("the exporting process {pid} is gone"),
        _ => format!("pidfd_open({pid}): {error} (Linux 5.3 or newer is needed)"),
    })?;
    let raw = {
        use std::os::fd::AsRawFd;
        // SAFETY: pidfd_getfd takes two descriptor numbers and flags and
        // returns a new descriptor or -1; no memory is passed.
        unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) }
    };
    if raw < 0 {
        let error = std::io::Error::last_os_error();
        return Err(match error.raw_os_error() {
            Some(libc::ESRCH) => format!("the exporting process {pid} is gone"),
            Some(libc::EBADF) => format!("process {pid} no longer exports that memory (descriptor {fd} is closed)"),
            Some(libc::EPERM) => format!(
                "not allowed to take descriptor {fd} from process {pid} ({error}): both must run as the same user, \
                 and where /proc/sys/kernel/yama/ptrace_scope is 1 the exporter must allow it (PR_SET_PTRACER)"
            ),
            _ => format!("pidfd_getfd({pid}, {fd}): {error} (Linux 5.6 or newer is needed)"),
        });
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw as i32) })
}

/// A descriptor for process `pid` (`pidfd_open`): it names that process
/// and no other, even once its pid is reused.
pub(crate) fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // or -1; no memory is passed.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(pidfd as i32) })
}

/// True once the process behind `pidfd` has exited (its descriptor turns
/// readable then); one `poll` that does not wait.
pub(crate) fn exited(pidfd: &OwnedFd) -> bool {
    use std::os::fd::AsRawFd;
    let mut entry = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd, owned by this frame; a zero timeout never blocks.
    let ready = unsafe { libc::poll(&mut entry, 1, 0) };
    ready > 0 && entry.revents & (libc::POLLIN | libc::POLLHUP) != 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsRawFd;

    #[test]
    fn a_descriptor_is_named_and_taken_back_and_bad_names_are_refused() {
        let mut file = tempfile();
        file.write_all(b"shared").unwrap();
        let bytes = encode(std::process::id(), file.as_raw_fd());
        let (pid, fd) = decode(&bytes).unwrap();
        let mut taken = std::fs::File::from(take(pid, fd).unwrap());
        taken.rewind().unwrap();
        let mut text = String::new();
        taken.read_to_string(&mut text).unwrap();
        assert_eq!(text, "shared", "the same open file, duplicated");

        assert!(decode(&[0; IPC_HANDLE_BYTES]).unwrap_err().contains("not a file descriptor handle"));
        assert!(decode(&encode(0, 3)).unwrap_err().contains("names no descriptor"));
        assert!(take(std::process::id(), 1 << 20).unwrap_err().contains("no longer exports"));
        assert!(take(u32::MAX >> 1, 3).unwrap_err().contains("is gone"));
    }

    fn tempfile() -> std::fs::File {
        // SAFETY: memfd_create with a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"kvring-fd-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nothing else owns.
        unsafe { std::fs::File::from_raw_fd(fd) }
    }
}
