//! The few syscalls cross-memory attach needs, wrapped once: a pidfd of
//! the target and whether its process has exited, `process_vm_readv` /
//! `process_vm_writev`, and what the kernel's ptrace policy (Yama) lets a
//! target allow.

use crate::ring::Opcode;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Most iovec entries one `process_vm_*` call takes on each side (the
/// kernel's `UIO_MAXIOV`, what `sysconf(_SC_IOV_MAX)` reports on Linux).
pub const IOV_MAX: usize = 1024;

/// One iovec entry. The same layout as `libc::iovec`, held as integers so
/// a link that keeps a preallocated list of them is `Send`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct IoVec {
    /// First byte.
    pub base: usize,
    /// Length in bytes.
    pub len: usize,
}

const _: () = assert!(std::mem::size_of::<IoVec>() == std::mem::size_of::<libc::iovec>());
const _: () = assert!(std::mem::align_of::<IoVec>() == std::mem::align_of::<libc::iovec>());

/// A process, held by a pidfd: unlike its pid, a pidfd never comes to name
/// another process, so "has it exited?" asked of it cannot be fooled by a
/// pid the kernel handed out again.
#[derive(Debug)]
pub struct Pidfd {
    fd: OwnedFd,
    pid: u32,
}

impl Pidfd {
    /// Opens a pidfd of `pid` (Linux 5.3 and later).
    pub fn open(pid: u32) -> std::io::Result<Self> {
        let raw_pid = libc::pid_t::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
        if raw_pid <= 0 {
            return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        }
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw_pid, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this fd to us; nobody else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(Self { fd, pid })
    }

    /// The pid it was opened for.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// True once the process has exited (a pidfd polls readable from the
    /// moment its process exits, zombie or reaped). One `poll` with a zero
    /// timeout: about a third of a microsecond.
    #[inline]
    pub fn exited(&self) -> bool {
        let mut entry = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        loop {
            // SAFETY: one valid pollfd, a zero timeout.
            let ready = unsafe { libc::poll(&mut entry, 1, 0) };
            match ready {
                0 => return false,
                1.. => return entry.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0,
                _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => continue,
                // poll on a valid fd does not otherwise fail; if it did, the
                // safe answer is "gone": nothing is written.
                _ => return true,
            }
        }
    }
}

/// Moves bytes between this process and `pid` in one call: WRITE copies
/// `local` into `remote`, READ the reverse. Returns the bytes moved, which
/// may be fewer than asked (the kernel stops at the first fault).
///
/// # Safety
///
/// Every `local` entry must be valid for reads (WRITE) or writes (READ) for
/// its length and not otherwise accessed during the call; `local.len()` and
/// `remote.len()` must each be at most [`IOV_MAX`]. The remote entries are
/// checked by the kernel against `pid`'s mappings, never dereferenced here.
pub unsafe fn vm_copy(op: Opcode, pid: u32, local: &[IoVec], remote: &[IoVec]) -> std::io::Result<usize> {
    debug_assert!(local.len() <= IOV_MAX && remote.len() <= IOV_MAX);
    let (lp, ln) = (local.as_ptr().cast::<libc::iovec>(), local.len() as libc::c_ulong);
    let (rp, rn) = (remote.as_ptr().cast::<libc::iovec>(), remote.len() as libc::c_ulong);
    let pid = pid as libc::pid_t;
    // SAFETY: `IoVec` has `iovec`'s layout (asserted above); the local
    // entries are valid per our contract; the kernel checks the remote ones.
    let moved = unsafe {
        match op {
            Opcode::Write => libc::process_vm_writev(pid, lp, ln, rp, rn, 0),
            Opcode::Read => libc::process_vm_readv(pid, lp, ln, rp, rn, 0),
        }
    };
    if moved < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(moved as usize)
    }
}

/// What the kernel's Yama module lets a process of the same user do to
/// this one with `process_vm_*` (`kernel.yama.ptrace_scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Yama {
    /// No Yama, or scope 0: every process of the same user may.
    Open,
    /// Scope 1: only a process this one names (`PR_SET_PTRACER`), or an
    /// ancestor; the target opts in.
    OptIn,
    /// Scope 2: only processes with `CAP_SYS_PTRACE`.
    CapOnly,
    /// Scope 3: none.
    Never,
}

/// Where the kernel publishes Yama's scope.
pub const YAMA_SCOPE_PATH: &str = "/proc/sys/kernel/yama/ptrace_scope";

impl Yama {
    /// Reads the policy from [`YAMA_SCOPE_PATH`] (missing: no Yama).
    pub fn current() -> Self {
        Self::from_scope(std::fs::read_to_string(YAMA_SCOPE_PATH).ok().as_deref())
    }

    /// The policy for the file's contents (`None`: no such file). An
    /// unknown value is taken as the strictest.
    pub fn from_scope(scope: Option<&str>) -> Self {
        match scope.map(str::trim) {
            None | Some("0") => Yama::Open,
            Some("1") => Yama::OptIn,
            Some("2") => Yama::CapOnly,
            Some(_) => Yama::Never,
        }
    }

    /// Why an initiator may be refused under this policy, for errors.
    pub fn explain(self) -> &'static str {
        match self {
            Yama::Open => "kernel.yama.ptrace_scope allows it (0, or no Yama)",
            Yama::OptIn => "kernel.yama.ptrace_scope is 1: the target must opt in with PR_SET_PTRACER",
            Yama::CapOnly => "kernel.yama.ptrace_scope is 2: only processes with CAP_SYS_PTRACE may attach",
            Yama::Never => "kernel.yama.ptrace_scope is 3: no process may attach",
        }
    }
}

/// Lets processes of this user reach this process's memory where Yama
/// restricts it to declared tracers (`PR_SET_PTRACER_ANY`: one tracer per
/// process can be named, and a target serves many initiators). Returns
/// whether it had to.
pub fn opt_in_to_ptrace(yama: Yama) -> std::io::Result<bool> {
    if yama != Yama::OptIn {
        return Ok(false);
    }
    // SAFETY: prctl with PR_SET_PTRACER and a plain integer argument.
    let rc = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(true)
}

/// True when this process is dumpable: a process that is not can be
/// reached only by processes with `CAP_SYS_PTRACE`.
pub fn dumpable() -> bool {
    // SAFETY: PR_GET_DUMPABLE takes no pointer and returns 0, 1 or 2.
    unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) == 1 }
}

/// True when `pid` names a live process (or one we may not signal, which
/// still exists).
pub fn pid_alive(pid: u32) -> bool {
    let Ok(raw) = libc::pid_t::try_from(pid) else { return false };
    if raw <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks whether the pid exists.
    let rc = unsafe { libc::kill(raw, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// When process `pid` started (clock ticks after boot, `/proc/<pid>/stat`
/// field 22): with the pid, it names one process for good, so a pid the
/// kernel handed to another process is not taken for the first.
pub fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold anything.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(22 - 3).and_then(|field| field.parse().ok())
}

/// True while process `pid` that started at `start` (0: not known) is
/// alive: its pid names a process, and that process started then.
pub fn same_process(pid: u32, start: u64) -> bool {
    if !pid_alive(pid) {
        return false;
    }
    match process_start(pid) {
        Some(now) => start == 0 || now == start,
        // /proc unreadable: only the pid can tell; take it as alive.
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_named_by_its_pid_and_its_start() {
        let me = std::process::id();
        let start = process_start(me).expect("this process's start");
        assert!(same_process(me, start));
        assert!(same_process(me, 0), "an unknown start is taken as alive");
        assert!(!same_process(me, start + 1), "another process at this pid is not this one");
    }

    #[test]
    fn yama_scopes_map_to_policies_and_unknown_ones_to_the_strictest() {
        assert_eq!(Yama::from_scope(None), Yama::Open);
        assert_eq!(Yama::from_scope(Some("0\n")), Yama::Open);
        assert_eq!(Yama::from_scope(Some("1\n")), Yama::OptIn);
        assert_eq!(Yama::from_scope(Some("2")), Yama::CapOnly);
        assert_eq!(Yama::from_scope(Some("3")), Yama::Never);
        assert_eq!(Yama::from_scope(Some("banana")), Yama::Never);
        assert!(Yama::OptIn.explain().contains("PR_SET_PTRACER"));
        // Opting in is needed only under scope 1.
        assert!(!opt_in_to_ptrace(Yama::Open).unwrap());
        assert!(!opt_in_to_ptrace(Yama::Never).unwrap());
    }

    #[test]
    fn a_pidfd_sees_its_process_exit_even_after_it_was_reaped() {
        let mut child = std::process::Command::new("sleep").arg("10").spawn().unwrap();
        let pidfd = Pidfd::open(child.id()).unwrap();
        assert!(!pidfd.exited());
        assert!(pid_alive(child.id()));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(pidfd.exited(), "a reaped process's pidfd stays readable");
        assert!(Pidfd::open(0).is_err());
        assert!(Pidfd::open(u32::MAX).is_err());
    }

    #[test]
    fn vm_copy_moves_bytes_within_this_process_and_stops_at_a_fault() {
        let source = vec![7u8; 8192];
        let mut target = vec![0u8; 8192];
        let local = [IoVec { base: source.as_ptr() as usize, len: 8192 }];
        let remote = [IoVec { base: target.as_mut_ptr() as usize, len: 8192 }];
        // SAFETY: `source` is valid for reads; `target` is ours and unused during the call.
        let moved = unsafe { vm_copy(Opcode::Write, std::process::id(), &local, &remote) }.unwrap();
        assert_eq!(moved, 8192);
        assert_eq!(target, source);
        // A remote entry at an unmapped page after a good one: a short count.
        let halves = [
            IoVec { base: source.as_ptr() as usize, len: 4096 },
            IoVec { base: source.as_ptr() as usize + 4096, len: 4096 },
        ];
        let remote = [IoVec { base: target.as_mut_ptr() as usize, len: 4096 }, IoVec { base: 4096, len: 4096 }];
        // SAFETY: as above; the second remote entry is checked by the kernel.
        let moved = unsafe { vm_copy(Opcode::Write, std::process::id(), &halves, &remote) }.unwrap();
        assert_eq!(moved, 4096, "the kernel reports what moved before the fault");
    }
}
