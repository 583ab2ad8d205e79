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
//! The handshake's answer also names the descriptor number the target
//! holds the connection at (`answering_fd`), and that one entry,
//! `/proc/<pid>/fd/<n>`, is read first: the kernel's link names the socket
//! inode the pid holds at `n`, so a match proves exactly what finding it
//! in the listing proves. The number itself proves nothing and needs no
//! seal: a wrong or missing one (a relay, an older kvring) only costs the
//! full listing, which a busy process makes long (hundreds of entries, a
//! `readlink` each: about a fifth of a cold open's CPU time). Nothing is
//! cached between checks: each is made afresh, with the connection open.
//! Not found (another process answered, a relay, another network namespace):
//! the descriptor is taken as another host's, so shm and cma are never tried
//! with it, and tcp (or rdma) carries the data.

use crate::segment::{CmaReach, SegmentDescriptor};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Makes `descriptor` a remote one (no shm, no cma) unless its pid holds
/// the other end of our control connection `ours` → `theirs` (see the
/// module docs), looking first at descriptor `hint` of that pid. Called by
/// the handshake with the connection still open.
pub(crate) fn bind_to_answering_process(
    descriptor: &mut SegmentDescriptor,
    ours: Option<SocketAddr>,
    theirs: Option<SocketAddr>,
    hint: Option<u32>,
) {
    if descriptor.host_id != crate::segment::local_host_id() {
        return;
    }
    let answered = ours.zip(theirs).is_some_and(|(ours, theirs)| socket_held_by(descriptor.pid, ours, theirs, hint));
    if answered {
        return;
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
}

/// True when process `pid` holds the TCP socket at the other end of our
/// connection from `ours` to `theirs` (both of this host and network
/// namespace); its descriptor `hint`, if given, is looked at first.
pub(crate) fn socket_held_by(pid: u32, ours: SocketAddr, theirs: SocketAddr, hint: Option<u32>) -> bool {
    // The exact lookup first; the table walk when it finds nothing.
    let found = super::sockdiag::socket_inode(theirs, ours).or_else(|| socket_inode(theirs, ours));
    let Some(inode) = found else { return false };
    let want = format!("socket:[{inode}]");
    let holds = |fd: u32| {
        std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).is_ok_and(|link| link.as_os_str() == want.as_str())
    };
    // The kernel's link of the one entry named: the same proof as finding
    // it in the listing below.
    if hint.is_some_and(holds) {
        return true;
    }
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    // Newest first: the socket that just answered is usually among the
    // highest-numbered descriptors, and a serving process holds hundreds.
    let mut fds: Vec<u32> = fds.flatten().filter_map(|fd| fd.file_name().to_str()?.parse().ok()).collect();
    fds.sort_unstable_by(|a, b| b.cmp(a));
    fds.into_iter().filter(|&fd| Some(fd) != hint).any(holds)
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

    #[test]
    fn only_the_process_holding_the_other_end_is_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        let me = std::process::id();
        assert!(socket_held_by(me, ours, theirs, None), "this process holds both ends");
        let mut other = std::process::Command::new("sleep").arg("10").spawn().unwrap();
        assert!(!socket_held_by(other.id(), ours, theirs, None), "another process does not");
        other.kill().unwrap();
        other.wait().unwrap();
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert!(!socket_held_by(me, ours, nobody, None), "no such connection");
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
        assert!(socket_held_by(me, ours, theirs, Some(at)), "the right hint");
        // Our own end, the listener, stdin, a number nothing is at: the
        // listing still finds the real one.
        for wrong in [client.as_raw_fd() as u32, listener.as_raw_fd() as u32, 0, 1 << 30] {
            assert!(socket_held_by(me, ours, theirs, Some(wrong)), "a wrong hint {wrong} falls back");
        }
        // Another process, even told where our socket is, does not hold it.
        let mut other = std::process::Command::new("sleep").arg("10").spawn().unwrap();
        for hint in [Some(at), Some(0), None] {
            assert!(!socket_held_by(other.id(), ours, theirs, hint), "another process with hint {hint:?}");
        }
        other.kill().unwrap();
        other.wait().unwrap();
    }
}
