//! Who answered the handshake: a descriptor's pid bound to the process at
//! the other end of the control connection, before any same-host transport
//! (shm, cma) trusts it.
//!
//! A same-host descriptor names a pid, an epoch and files or a page of that
//! process, and each proves itself as *that engine's*. Nothing in that proof
//! says the engine is the one that answered: a peer (proven or not) could
//! hand out another engine of this host as itself, and our writes would land
//! in that third engine. So, while the control connection is still open, the
//! initiator looks for its other end, a TCP socket of this host and network
//! namespace (found by its 4-tuple over netlink's sock_diag, else in
//! `/proc/net/tcp`, `/proc/net/tcp6`), among the descriptors of the claimed
//! pid (`/proc/<pid>/fd`). Found: the claimed process answered.
//!
//! An entry of `/proc/<pid>/fd` names a socket only by its inode number,
//! and a socket's inode number is 32 bits (`get_next_ino`, fs/inode.c),
//! shared with pipes and every other pseudo-file: it wraps, so two live
//! sockets can carry the same number, and a liar that churns numbers until
//! a third engine's socket gets its own connection's cannot be told apart
//! by the number. The link is therefore only a filter. An entry whose link
//! names the inode is taken out of the pid (`pidfd_getfd(2)`, which needs
//! the same rights over that pid as `process_vm_writev`; a process whose
//! socket cannot be taken is not proven), and the socket itself is
//! compared: its `SO_COOKIE` (64 bits, never given to two sockets: kernel
//! commit 5daab9db7b65, "a unique non-decreasing cookie for each socket")
//! against the cookie netlink reports for the answering end, and its own
//! address, peer address and protocol against the connection's, so even
//! the `/proc/net/tcp` fallback, which gives no cookie, names one socket.
//! The copy is closed at once, in a thread with a descriptor table of its
//! own (`cma/taker.rs`): only an entry already linked to the inode is
//! taken, but the peer may swap another file in at that number between the
//! `readlink` and the take, and closing a file here would drop this
//! process's POSIX locks on it.
//!
//! The handshake's answer also names the descriptor number the target
//! holds the connection at (`answering_fd`), and that one entry,
//! `/proc/<pid>/fd/<n>`, is looked at first: a match proves exactly what
//! finding it in the listing proves. The number itself proves nothing and
//! needs no seal: a wrong or missing one (a relay, an older kvring) only
//! costs the full listing, which a busy process makes long (hundreds of
//! entries, a `readlink` each: about a fifth of a cold open's CPU time).
//! Nothing is cached between checks: each is made afresh, with the
//! connection open.
//! Not found (another process answered, a relay, another network namespace):
//! the descriptor is taken as another host's, so shm and cma are never tried
//! with it, and tcp (or rdma) carries the data.

use crate::error::{Error, Result};
use crate::segment::{CmaReach, SegmentDescriptor};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Instant;

/// The most entries of the claimed pid's `/proc/<pid>/fd` listed: a
/// serving engine holds hundreds; a liar naming a process that holds a
/// million would cost seconds of `readlink`s per handshake. Past it the
/// pid is taken as not proven (tcp carries the data).
pub(crate) const MAX_OWNER_FDS_LISTED: usize = 1 << 16;

/// How many entries are listed or read between looks at the deadline.
const DEADLINE_EVERY: usize = 256;

/// Makes `descriptor` a remote one (no shm, no cma) unless its pid holds
/// the other end of our control connection `ours` → `theirs` (see the
/// module docs), looking first at descriptor `hint` of that pid. Called by
/// the handshake with the connection still open; `Timeout` when the check
/// runs past the handshake's `deadline`.
pub(crate) fn bind_to_answering_process(
    descriptor: &mut SegmentDescriptor,
    ours: Option<SocketAddr>,
    theirs: Option<SocketAddr>,
    hint: Option<u32>,
    deadline: Instant,
) -> Result<()> {
    if descriptor.host_id != crate::segment::local_host_id() {
        return Ok(());
    }
    let answered = match ours.zip(theirs) {
        Some((ours, theirs)) => socket_held_by(descriptor.pid, ours, theirs, hint, deadline)?,
        None => false,
    };
    if answered {
        return Ok(());
    }
    let at = theirs.map_or_else(|| "an unknown address".to_string(), |a| a.to_string());
    tracing::warn!(
        peer = %descriptor.name,
        pid = descriptor.pid,
        %at,
        "the process that answered the handshake is not the pid its descriptor names: no shm or cma to it"
    );
    descriptor.host_id = format!("{} (not proven: pid {} did not answer)", descriptor.host_id, descriptor.pid);
    for region in &mut descriptor.regions {
        region.shm_path = None;
    }
    descriptor.cma = Some(CmaReach::Refused(format!(
        "pid {} is not the process that answered the handshake at {at}",
        descriptor.pid
    )));
    Ok(())
}

/// True when process `pid` holds the TCP socket at the other end of our
/// connection from `ours` to `theirs` (both of this host and network
/// namespace); its descriptor `hint`, if given, is looked at first.
/// `Timeout` once `deadline` passes while its descriptors are listed.
pub(crate) fn socket_held_by(
    pid: u32,
    ours: SocketAddr,
    theirs: SocketAddr,
    hint: Option<u32>,
    deadline: Instant,
) -> Result<bool> {
    held_by(pid, ours, theirs, hint, deadline, MAX_OWNER_FDS_LISTED)
}

/// The far end of our connection, as the kernel names it: its inode (a
/// filter only, see the module docs), and its cookie where netlink gave one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Far {
    inode: u64,
    cookie: Option<u64>,
    /// Its own address (the peer's) and the one it is connected to (ours).
    local: SocketAddr,
    remote: SocketAddr,
}

#[cfg(test)]
impl Far {
    /// The far end of our connection from `ours` to `theirs`, as the
    /// kernel names it (netlink).
    pub(super) fn of_connection(ours: SocketAddr, theirs: SocketAddr) -> Self {
        let (inode, cookie) = super::sockdiag::socket_identity(theirs, ours).expect("netlink here");
        Far { inode, cookie: Some(cookie), local: theirs, remote: ours }
    }
}

fn held_by(
    pid: u32,
    ours: SocketAddr,
    theirs: SocketAddr,
    hint: Option<u32>,
    deadline: Instant,
    max_listed: usize,
) -> Result<bool> {
    // The exact lookup first; the table walk when it finds nothing.
    let found = super::sockdiag::socket_identity(theirs, ours)
        .map(|(inode, cookie)| (inode, Some(cookie)))
        .or_else(|| socket_inode(theirs, ours).map(|inode| (inode, None)));
    let Some((inode, cookie)) = found else { return Ok(false) };
    held_by_far(pid, Far { inode, cookie, local: theirs, remote: ours }, hint, deadline, max_listed)
}

fn held_by_far(pid: u32, far: Far, hint: Option<u32>, deadline: Instant, max_listed: usize) -> Result<bool> {
    // Opened before anything of the pid is read, so every entry taken is
    // that process's, whatever comes to reuse its number. A kernel without
    // pidfds (before 5.3) leaves the link as the only proof, as below.
    let process = crate::gpu::fd::pidfd_open(pid).ok();
    let want = format!("socket:[{}]", far.inode);
    let holds = |fd: u32| {
        std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).is_ok_and(|link| link.as_os_str() == want.as_str())
            && match process.as_ref().map_or(Taken::Refused, |process| super::taker::take(process, fd, &far, deadline))
            {
                Taken::Same => true,
                Taken::Other | Taken::Unavailable => false,
                Taken::Refused => {
                    link_only_proof(pid);
                    true
                }
            }
    };
    if hint.is_some_and(holds) {
        return Ok(true);
    }
    let Ok(listing) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return Ok(false) };
    let mut fds = Vec::new();
    for (n, entry) in listing.flatten().enumerate() {
        if n % DEADLINE_EVERY == 0 {
            past(deadline, pid)?;
        }
        if n >= max_listed {
            tracing::warn!(pid, max_listed, "the claimed pid holds more descriptors than the owner check lists");
            return Ok(false);
        }
        if let Some(fd) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) {
            fds.push(fd);
        }
    }
    // Newest first: the socket that just answered is usually among the
    // highest-numbered descriptors, and a serving process holds hundreds.
    fds.sort_unstable_by(|a, b| b.cmp(a));
    for (n, fd) in fds.into_iter().filter(|&fd| Some(fd) != hint).enumerate() {
        if n % DEADLINE_EVERY == 0 {
            past(deadline, pid)?;
        }
        if holds(fd) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// What taking a candidate descriptor out of the claimed process showed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Taken {
    /// The answering socket itself (cookie and addresses).
    Same,
    /// Another socket that only shares the inode number.
    Other,
    /// It could not be taken: a sandbox's seccomp (Docker's and
    /// Kubernetes' default profiles allow `pidfd_getfd` only with
    /// `CAP_SYS_PTRACE`), Yama's ptrace scope, or a kernel before 5.6.
    Refused,
    /// The taker (`cma/taker.rs`) has no table of its own: take it here.
    Unavailable,
}

/// Whether descriptor `fd` of `process` is the socket `far`: the same
/// cookie where one is known, and always a TCP socket bound to `far.local`
/// and connected to `far.remote`, which in one network namespace no two
/// live sockets are. Called only for an entry whose link already names
/// `far.inode`, but the peer may have put another file at that number
/// since: so it is called in the taker's table (`cma/taker.rs`), whose
/// close of a raced file drops none of this process's locks.
pub(super) fn is_the_socket(process: &OwnedFd, fd: u32, far: &Far) -> Taken {
    // SAFETY: pidfd_getfd(2) takes a pidfd, a descriptor number and flags
    // (0) and returns a new descriptor or -1; no memory is passed.
    let taken = unsafe { libc::syscall(libc::SYS_pidfd_getfd, process.as_raw_fd(), fd as libc::c_int, 0) };
    if taken < 0 {
        // Only a refusal of the call (seccomp, Yama, no such syscall) falls
        // back to the link; a descriptor gone or not a file of that pid
        // (EBADF, ESRCH) proves nothing.
        return match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EPERM | libc::EACCES | libc::ENOSYS) => Taken::Refused,
            _ => Taken::Other,
        };
    }
    // SAFETY: a fresh descriptor nothing else in this process owns; it is
    // closed when this function returns.
    let socket = unsafe { OwnedFd::from_raw_fd(taken as RawFd) };
    let same_cookie = far.cookie.is_none_or(|want| cookie_of(socket.as_fd()) == Some(want));
    let tcp = int_option(socket.as_fd(), libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP);
    let (local, remote) = match (address_of(socket.as_fd(), false), address_of(socket.as_fd(), true)) {
        (Some(local), Some(remote)) => (unmapped(local), unmapped(remote)),
        _ => return Taken::Other,
    };
    match same_cookie && tcp && local == unmapped(far.local) && remote == unmapped(far.remote) {
        true => Taken::Same,
        false => Taken::Other,
    }
}

/// The claimed pid's socket could not be taken, so the kernel's link (the
/// inode number) is the proof, as it was before the cookie: shm and cma
/// keep working in a container whose seccomp refuses `pidfd_getfd`. Said
/// once per process, since it weakens the check (docs/SECURITY.md).
fn link_only_proof(pid: u32) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        tracing::warn!(
            pid,
            "cannot take a peer's socket to compare its cookie (pidfd_getfd refused: seccomp, Yama or an old kernel): \
             same-host peers are proven by their socket's 32-bit inode number only"
        );
    });
}

/// `SO_COOKIE`: a socket's 64-bit cookie, since Linux 4.12 (commit
/// 5daab9db7b65). 57 in asm-generic/socket.h and mips's; sparc's own
/// header gives 0x003b (libc 0.2 keeps it out of its public names).
#[cfg(not(target_arch = "sparc64"))]
const SO_COOKIE: libc::c_int = 57;
#[cfg(target_arch = "sparc64")]
const SO_COOKIE: libc::c_int = 0x003b;

/// A socket's cookie (`getsockopt(SO_COOKIE)`), `None` where the kernel
/// gives none.
pub(super) fn cookie_of(socket: BorrowedFd<'_>) -> Option<u64> {
    let mut cookie = 0u64;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` are valid for writes of the sizes given.
    let got = unsafe {
        libc::getsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, SO_COOKIE, (&raw mut cookie).cast(), &mut len)
    };
    (got == 0 && len as usize == std::mem::size_of::<u64>()).then_some(cookie)
}

/// An `int` socket option of level `SOL_SOCKET`.
fn int_option(socket: BorrowedFd<'_>, name: libc::c_int) -> Option<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` and `len` are valid for writes of the sizes given.
    let got =
        unsafe { libc::getsockopt(socket.as_raw_fd(), libc::SOL_SOCKET, name, (&raw mut value).cast(), &mut len) };
    (got == 0).then_some(value)
}

/// A socket's own address, or with `peer` the one it is connected to
/// (`getsockname(2)`, `getpeername(2)`); `None` for another family or an
/// unconnected socket.
fn address_of(socket: BorrowedFd<'_>, peer: bool) -> Option<SocketAddr> {
    // SAFETY: sockaddr_storage is plain data, valid all zero.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let at = (&raw mut storage).cast::<libc::sockaddr>();
    // SAFETY: `storage` and `len` are valid for writes of the sizes given.
    let got = unsafe {
        match peer {
            true => libc::getpeername(socket.as_raw_fd(), at, &mut len),
            false => libc::getsockname(socket.as_raw_fd(), at, &mut len),
        }
    };
    if got != 0 {
        return None;
    }
    match storage.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the kernel wrote a sockaddr_in (its family says so),
            // which fits in the storage.
            let v4 = unsafe { *(&raw const storage).cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
            Some(SocketAddr::new(IpAddr::V4(ip), u16::from_be(v4.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, a sockaddr_in6.
            let v6 = unsafe { *(&raw const storage).cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr)), u16::from_be(v6.sin6_port)))
        }
        _ => None,
    }
}

/// `Timeout` once the handshake's deadline has passed: the owner check
/// costs a `readlink` per descriptor of a pid the peer names.
fn past(deadline: Instant, pid: u32) -> Result<()> {
    let now = Instant::now();
    if now < deadline {
        return Ok(());
    }
    tracing::warn!(pid, "the same-host owner check ran past the handshake's deadline listing /proc/{pid}/fd");
    Err(Error::Timeout { what: "the same-host owner check", waited: now.saturating_duration_since(deadline) })
}

/// The inode of this namespace's TCP socket bound to `local` and connected
/// to `remote`, if there is one.
fn socket_inode(local: SocketAddr, remote: SocketAddr) -> Option<u64> {
    let (local, remote) = (unmapped(local), unmapped(remote));
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().find_map(|table| {
        let text = std::fs::read_to_string(table).ok()?;
        text.lines().skip(1).find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (l, r, inode) = (fields.get(1)?, fields.get(2)?, fields.get(9)?);
            let matches = proc_addr(l).map(unmapped) == Some(local) && proc_addr(r).map(unmapped) == Some(remote);
            matches.then(|| inode.parse().ok()).flatten().filter(|&inode| inode != 0)
        })
    })
}

/// An IPv4 address an IPv6 socket shows as `::ffff:a.b.c.d`, as IPv4.
fn unmapped(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, |v4| SocketAddr::new(IpAddr::V4(v4), addr.port())),
        IpAddr::V4(_) => addr,
    }
}

/// One `ADDR:PORT` of `/proc/net/tcp{,6}`: the address as the kernel's
/// 32-bit words printed in hex (each in this host's byte order), the port
/// in hex.
fn proc_addr(field: &str) -> Option<SocketAddr> {
    let (addr, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Option<Vec<[u8; 4]>> = (0..addr.len() / 8)
        .map(|i| addr.get(i * 8..i * 8 + 8).and_then(|w| u32::from_str_radix(w, 16).ok()).map(u32::to_ne_bytes))
        .collect();
    let bytes: Vec<u8> = words?.concat();
    let ip = match bytes.len() {
        4 => IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3])),
        16 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?)),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_addresses_parse_as_the_kernel_prints_them() {
        assert_eq!(proc_addr("0100007F:1F90"), Some("127.0.0.1:8080".parse().unwrap()));
        assert_eq!(proc_addr("00000000000000000000000001000000:0050"), Some("[::1]:80".parse().unwrap()));
        assert_eq!(
            proc_addr("0000000000000000FFFF00000100007F:0050").map(unmapped),
            Some("127.0.0.1:80".parse().unwrap())
        );
        assert_eq!(proc_addr("zz:1"), None);
        assert_eq!(proc_addr("0100007F"), None);
    }

    fn later() -> Instant {
        Instant::now() + std::time::Duration::from_secs(60)
    }

    /// A liar's pid that holds many descriptors costs the handshake no more
    /// than its deadline: the listing stops with the typed `Timeout`.
    #[test]
    fn listing_a_pid_with_many_descriptors_stops_at_the_deadline() {
        use std::io::BufRead;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        // A child holding 600 descriptors (bash's `exec N<` keeps each).
        let script = "for i in $(seq 10 610); do eval \"exec $i</dev/null\"; done; echo ready; exec sleep 30";
        let mut child = std::process::Command::new("bash")
            .args(["-c", script])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        let listed = std::fs::read_dir(format!("/proc/{}/fd", child.id())).unwrap().count();
        assert!(listed > 600, "the child holds {listed} descriptors");
        let passed = Instant::now();
        let result = socket_held_by(child.id(), ours, theirs, None, passed);
        assert!(matches!(result, Err(Error::Timeout { .. })), "{result:?}");
        assert!(!socket_held_by(child.id(), ours, theirs, None, later()).unwrap(), "with time, it is simply not held");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Past `max_listed` entries the pid is not proven, even one that holds
    /// the socket: no listing is read to its end.
    #[test]
    fn a_listing_longer_than_the_cap_proves_nothing() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        let me = std::process::id();
        assert!(held_by(me, ours, theirs, None, later(), MAX_OWNER_FDS_LISTED).unwrap());
        assert!(!held_by(me, ours, theirs, None, later(), 2).unwrap(), "this process holds more than 2 descriptors");
    }

    #[test]
    fn only_the_process_holding_the_other_end_is_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        let me = std::process::id();
        assert!(socket_held_by(me, ours, theirs, None, later()).unwrap(), "this process holds both ends");
        let mut other = std::process::Command::new("sleep").arg("10").spawn().unwrap();
        assert!(!socket_held_by(other.id(), ours, theirs, None, later()).unwrap(), "another process does not");
        other.kill().unwrap();
        other.wait().unwrap();
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert!(!socket_held_by(me, ours, nobody, None, later()).unwrap(), "no such connection");
    }

    /// A socket whose inode number is the answering connection's (after
    /// the 32-bit numbers wrapped, or a liar churned them) is not that
    /// connection: the socket taken from the pid must carry its cookie and
    /// its addresses. Here this process holds a socket at the inode asked
    /// for, but the far end named is another socket.
    /// A descriptor the pid does not hold (closed since its link was read:
    /// EBADF) is not the socket; only a refusal of the call itself (EPERM,
    /// EACCES, ENOSYS) leaves the link as the proof.
    #[test]
    fn a_descriptor_gone_before_it_is_taken_proves_nothing() {
        let me = crate::gpu::fd::pidfd_open(std::process::id()).unwrap();
        let any = "127.0.0.1:1".parse().unwrap();
        let far = Far { inode: 1, cookie: None, local: any, remote: any };
        assert_eq!(is_the_socket(&me, 1 << 20, &far), Taken::Other);
    }

    #[test]
    fn a_socket_that_only_shares_the_inode_number_is_not_the_answering_one() {
        use std::os::fd::AsFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let other_client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (other_server, _) = listener.accept().unwrap();
        let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        let (inode, cookie) = super::super::sockdiag::socket_identity(theirs, ours).expect("netlink here");
        let me = std::process::id();
        let at = Some(server.as_raw_fd() as u32);
        let real = Far { inode, cookie: Some(cookie), local: theirs, remote: ours };
        assert!(held_by_far(me, real, at, later(), MAX_OWNER_FDS_LISTED).unwrap(), "the real far end");
        // The inode is held here, but the answering socket named by netlink
        // is another one (another cookie, other addresses).
        let elsewhere = cookie_of(other_server.as_fd()).unwrap();
        let (o_ours, o_theirs) = (other_client.local_addr().unwrap(), other_client.peer_addr().unwrap());
        let wrapped = [
            Far { cookie: Some(elsewhere), ..real },
            Far { cookie: Some(elsewhere), local: o_theirs, remote: o_ours, ..real },
            // The `/proc/net/tcp` fallback gives no cookie: the addresses
            // alone still tell the sockets apart.
            Far { cookie: None, local: o_theirs, remote: o_ours, ..real },
        ];
        for far in wrapped {
            for hint in [at, None] {
                assert!(!held_by_far(me, far, hint, later(), MAX_OWNER_FDS_LISTED).unwrap(), "{far:?}, hint {hint:?}");
            }
        }
        assert!(held_by_far(me, Far { cookie: None, ..real }, None, later(), MAX_OWNER_FDS_LISTED).unwrap());
    }

    /// An `open_many` of a TP group runs its handshakes' checks at once,
    /// more of them than the taker's queue holds: every one is still
    /// proven (a full queue is waited on, not taken as "not held").
    #[test]
    fn many_checks_at_once_each_prove_their_socket() {
        const CHECKS: usize = 48;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let pairs: Vec<_> = (0..CHECKS)
            .map(|_| {
                let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
                let (server, _) = listener.accept().unwrap();
                (client, server)
            })
            .collect();
        let start = std::sync::Barrier::new(CHECKS);
        let me = std::process::id();
        std::thread::scope(|scope| {
            let checks: Vec<_> = pairs
                .iter()
                .map(|(client, _)| {
                    let start = &start;
                    scope.spawn(move || {
                        let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
                        start.wait();
                        socket_held_by(me, ours, theirs, None, later())
                    })
                })
                .collect();
            for (n, check) in checks.into_iter().enumerate() {
                assert!(check.join().unwrap().unwrap(), "check {n} of {CHECKS} at once was not proven");
            }
        });
    }

    #[test]
    fn a_hint_finds_the_socket_at_once_and_a_wrong_one_proves_nothing() {
        use std::os::fd::AsRawFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        let me = std::process::id();
        let at = server.as_raw_fd() as u32;
        assert!(socket_held_by(me, ours, theirs, Some(at), later()).unwrap(), "the right hint");
        // Our own end, the listener, stdin, a number nothing is at: the
        // listing still finds the real one.
        for wrong in [client.as_raw_fd() as u32, listener.as_raw_fd() as u32, 0, 1 << 30] {
            assert!(socket_held_by(me, ours, theirs, Some(wrong), later()).unwrap(), "a wrong hint {wrong} falls back");
        }
        // Another process, even told where our socket is, does not hold it.
        let mut other = std::process::Command::new("sleep").arg("10").spawn().unwrap();
        for hint in [Some(at), Some(0), None] {
            assert!(
                !socket_held_by(other.id(), ours, theirs, hint, later()).unwrap(),
                "another process with hint {hint:?}"
            );
        }
        other.kill().unwrap();
        other.wait().unwrap();
    }
}
