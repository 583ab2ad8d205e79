//! File descriptors of device memory passed between processes, and who
//! "this process" is.
//!
//! Device memory of the virtual memory API is shared as one POSIX
//! descriptor per physical allocation. The exporter itself passes each
//! descriptor over a Unix-domain socket (`SCM_RIGHTS`, unix(7)), as NCCL's
//! cuMem path does, so an opener only ever holds what the exporting process
//! chose to hand it: a process can pass only descriptors it holds, and no
//! opener takes one out of another process (`pidfd_getfd`, which Docker's
//! default seccomp profile refuses, is not used). The handle bytes in a
//! descriptor name the allocation in the *exporter's* address space, for
//! the exporter's own look-up; the opener never acts on them.
//!
//! A random per-process instance id, not the pid, says "this process": two
//! containers can both run their engine as PID 1.

use super::IPC_HANDLE_BYTES;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::OnceLock;

/// Most descriptors one message carries: the kernel's `SCM_MAX_FD` is 253;
/// fewer keep an opener under a low descriptor limit.
pub const MAX_FDS_PER_MESSAGE: usize = 64;

/// Each GPU descriptor socket's name starts with this.
const SOCKET_PREFIX: &str = "kvring-gpu-fds-";

/// The abstract socket name of the engine of epoch `epoch` in process
/// `instance`, on which it passes its GPU regions' descriptors.
pub(crate) fn socket_name(instance: u64, epoch: u64) -> String {
    format!("{SOCKET_PREFIX}{instance:016x}-{epoch:016x}")
}

/// A peer's advertised socket name, if it is one kvring makes (nothing
/// else on this host is dialed because a descriptor said so).
pub(crate) fn check_socket_name(text: &str) -> Result<String, String> {
    let bad = || format!("{text:.64?} is not a kvring socket name");
    let rest = text.strip_prefix(SOCKET_PREFIX).ok_or_else(bad)?;
    let hex = |s: &str| s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit());
    match rest.split_once('-') {
        Some((a, b)) if hex(a) && hex(b) => Ok(text.to_string()),
        _ => Err(bad()),
    }
}

/// This process's instance id: random, drawn once, never 0.
pub fn instance() -> u64 {
    static ID: OnceLock<u64> = OnceLock::new();
    *ID.get_or_init(|| u64::from_le_bytes(crate::auth::random_bytes()) | 1)
}

/// The payload of a handle naming the allocation at `addr` on `device` in
/// the exporter's own address space, marked by `magic`.
pub(crate) fn encode(magic: [u8; 4], addr: u64, device: u32) -> [u8; IPC_HANDLE_BYTES] {
    let mut bytes = [0u8; IPC_HANDLE_BYTES];
    bytes[..4].copy_from_slice(&magic);
    bytes[4..12].copy_from_slice(&addr.to_le_bytes());
    bytes[12..16].copy_from_slice(&device.to_le_bytes());
    bytes
}

/// The (address, device) a payload marked by `magic` names, if it is one.
pub(crate) fn decode(magic: [u8; 4], bytes: &[u8; IPC_HANDLE_BYTES]) -> Option<(u64, u32)> {
    if bytes[..4] != magic {
        return None;
    }
    let addr = u64::from_le_bytes(bytes[4..12].try_into().expect("8 bytes"));
    Some((addr, u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"))))
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
    let mut entry = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one pollfd, owned by this frame; a zero timeout never blocks.
    let ready = unsafe { libc::poll(&mut entry, 1, 0) };
    ready > 0 && entry.revents & (libc::POLLIN | libc::POLLHUP) != 0
}

/// Connects to the abstract stream socket `name` by `deadline`. A plain
/// `connect` blocks without a bound while the listener's queue is full: a
/// socket that never accepts (a peer's, or a squatter's of a name its
/// engine left) would hang the opener past its own deadline.
pub(crate) fn connect_abstract(name: &[u8], deadline: std::time::Instant) -> std::io::Result<UnixStream> {
    // SAFETY: a zeroed sockaddr_un is valid; the name is copied in bounds.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() + 1 > addr.sun_path.len() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "socket name too long"));
    }
    for (i, b) in name.iter().enumerate() {
        addr.sun_path[i + 1] = *b as libc::c_char;
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
    let mut pause = std::time::Duration::from_millis(1);
    loop {
        // SAFETY: a new socket, owned at once.
        let fd =
            unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just made and is owned by nothing else.
        let stream = unsafe { UnixStream::from_raw_fd(fd) };
        // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
        let got = unsafe { libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len) };
        if got == 0 {
            stream.set_nonblocking(false)?;
            return Ok(stream);
        }
        let error = std::io::Error::last_os_error();
        // A full queue (EAGAIN) is waited out until the deadline.
        if error.raw_os_error() != Some(libc::EAGAIN) && error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the socket accepts no connection"));
        }
        std::thread::sleep(pause.min(left));
        pause = (pause * 2).min(std::time::Duration::from_millis(50));
    }
}

/// The pid of the process at the other end of `stream` when it connected
/// or listened (`SO_PEERCRED`, unix(7)), as this process's pid namespace
/// sees it (0 when that process is not visible here).
pub(crate) fn peer_pid(stream: &UnixStream) -> std::io::Result<u32> {
    peer_cred(stream).map(|(pid, _)| pid)
}

/// The process and user at the other end of `stream` (`SO_PEERCRED`,
/// unix(7): the credentials at `connect` or `listen` time); the pid as
/// this process's pid namespace sees it (0 when not visible here).
pub(crate) fn peer_cred(stream: &UnixStream) -> std::io::Result<(u32, u32)> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which is
    // that large, and the new length into `len`.
    let got = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if got != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cred.pid.max(0) as u32, cred.uid))
}

/// Space for the control message of `fds` descriptors, as u64 words (so
/// the header is aligned).
fn control_words(fds: usize) -> Vec<u64> {
    // SAFETY: CMSG_SPACE only computes a size.
    let bytes = unsafe { libc::CMSG_SPACE((fds * std::mem::size_of::<libc::c_int>()) as u32) } as usize;
    vec![0u64; bytes.div_ceil(8)]
}

/// Sends all of `bytes` with `fds` attached to its first byte
/// (`SCM_RIGHTS`); at most [`MAX_FDS_PER_MESSAGE`] descriptors.
pub(crate) fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    assert!(fds.len() <= MAX_FDS_PER_MESSAGE && !bytes.is_empty(), "a caller's bug: too many descriptors");
    let mut control = control_words(fds.len());
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut libc::c_void, iov_len: bytes.len() };
    // SAFETY: msghdr is plain data; every field that matters is set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() * 8;
        // SAFETY: the control buffer holds CMSG_SPACE(fds) bytes, so the
        // first header and its data fit; the data is written unaligned.
        unsafe {
            let header = libc::CMSG_FIRSTHDR(&msg);
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = libc::CMSG_LEN((fds.len() * std::mem::size_of::<libc::c_int>()) as u32) as _;
            let data = libc::CMSG_DATA(header).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    let mut sent = loop {
        // SAFETY: `msg` points at `iov` and `control`, both alive here.
        let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    };
    // The descriptors went with the first byte; the rest is plain data.
    while sent < bytes.len() {
        use std::io::Write;
        sent += (&*stream).write(&bytes[sent..])?;
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes, taking the descriptors that come with
/// them (at most `max_fds`; more, or a truncated control message, is an
/// error, and whatever arrived is closed).
pub(crate) fn recv_with_fds(stream: &UnixStream, buf: &mut [u8], max_fds: usize) -> std::io::Result<Vec<OwnedFd>> {
    let max_fds = max_fds.min(MAX_FDS_PER_MESSAGE);
    let mut fds = Vec::new();
    let mut got = 0;
    while got < buf.len() {
        let mut control = control_words(max_fds.max(1));
        let mut iov = libc::iovec { iov_base: buf[got..].as_mut_ptr().cast(), iov_len: buf.len() - got };
        // SAFETY: msghdr is plain data; every field that matters is set below.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() * 8;
        // SAFETY: `msg` points at `iov` (inside `buf`) and `control`, both
        // alive here; received descriptors are close-on-exec.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        // SAFETY: walks the control messages the kernel wrote into
        // `control`, within `msg_controllen`; each SCM_RIGHTS entry holds
        // fresh descriptors this process now owns.
        unsafe {
            let mut header = libc::CMSG_FIRSTHDR(&msg);
            while !header.is_null() {
                if (*header).cmsg_level == libc::SOL_SOCKET && (*header).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(header).cast::<libc::c_int>();
                    let count =
                        ((*header).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<libc::c_int>();
                    for i in 0..count {
                        fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    }
                }
                header = libc::CMSG_NXTHDR(&msg, header);
            }
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > max_fds {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "more descriptors than asked for"));
        }
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        got += n as usize;
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsFd;

    fn memfd(text: &[u8]) -> std::fs::File {
        // SAFETY: memfd_create with a NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"kvring-fd-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor nothing else owns.
        let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.write_all(text).unwrap();
        file
    }

    #[test]
    fn descriptors_cross_a_socket_with_their_bytes_and_extra_ones_are_refused() {
        let (a, b) = UnixStream::pair().unwrap();
        let files = [memfd(b"one"), memfd(b"two")];
        let borrowed: Vec<_> = files.iter().map(|f| f.as_fd()).collect();
        send_with_fds(&a, b"hello", &borrowed).unwrap();
        let mut buf = [0u8; 5];
        let got = recv_with_fds(&b, &mut buf, 2).unwrap();
        assert_eq!(&buf, b"hello");
        for (fd, want) in got.into_iter().zip(["one", "two"]) {
            let mut file = std::fs::File::from(fd);
            file.rewind().unwrap();
            let mut text = String::new();
            file.read_to_string(&mut text).unwrap();
            assert_eq!(text, want, "the same open file, passed");
        }
        send_with_fds(&a, b"x", &borrowed).unwrap();
        assert!(recv_with_fds(&b, &mut [0u8; 1], 1).is_err(), "two descriptors where one was asked for");
        assert_eq!(peer_pid(&a).unwrap(), std::process::id());
        drop(a);
        assert_eq!(recv_with_fds(&b, &mut [0u8; 1], 0).unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn handles_name_an_address_under_their_mark_and_the_instance_is_stable() {
        let bytes = encode(*b"KVFD", 0xdead_0000, 3);
        assert_eq!(decode(*b"KVFD", &bytes), Some((0xdead_0000, 3)));
        assert_eq!(decode(*b"KVSG", &bytes), None);
        assert_eq!(instance(), instance());
        assert_ne!(instance(), 0);
    }
}
