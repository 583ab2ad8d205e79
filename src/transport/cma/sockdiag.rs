//! One socket's inode and cookie by its exact 4-tuple, asked of the kernel over
//! `NETLINK_SOCK_DIAG` (sock_diag(7)): one hash lookup in the kernel, where
//! reading `/proc/net/tcp` walks every TCP socket of the namespace (about
//! 10 ms here with the ~5,000 TIME_WAIT sockets a test-heavy host keeps:
//! the whole of a cold handshake's cost). `None` when netlink is not
//! available or finds nothing: the caller then reads `/proc/net/tcp`, so a
//! socket this lookup misses (an IPv6 socket holding a v4-mapped
//! connection) is still found.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// `SOCK_DIAG_BY_FAMILY`, the request type (sock_diag(7), linux/sock_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `NLMSG_ERROR`, the reply type of a failed request (netlink(7)).
const NLMSG_ERROR: u16 = 2;
/// `sizeof(struct nlmsghdr)` (netlink(7)).
const NLMSG_HDR_BYTES: usize = 16;
/// `sizeof(struct inet_diag_req_v2)` (sock_diag(7)).
const REQ_BYTES: usize = 56;
/// `sizeof(struct inet_diag_msg)` (sock_diag(7)).
const MSG_BYTES: usize = 72;
/// Offset of `idiag_inode` in `struct inet_diag_msg`: family, state, timer,
/// retrans (4 bytes), the 48-byte `inet_diag_sockid`, then expires, rqueue,
/// wqueue and uid (4 bytes each) (sock_diag(7)).
const INODE_AT: usize = 68;
/// Offset of `idiag_cookie` in `struct inet_diag_msg`: the last 8 bytes of
/// the `inet_diag_sockid` (sock_diag(7)), two `__u32`, the low word first
/// (the kernel's `sock_diag_save_cookie`, net/core/sock_diag.c).
const COOKIE_AT: usize = 44;
/// Longest the kernel's answer is waited for: it answers at once, this
/// only bounds the wait.
const REPLY_WAIT: Duration = Duration::from_millis(200);

/// The inode and the cookie (`SO_COOKIE`'s value: 64 bits, never given to
/// two sockets) of this namespace's TCP socket bound to `local` and
/// connected to `remote`, by an exact netlink lookup.
pub(super) fn socket_identity(local: SocketAddr, remote: SocketAddr) -> Option<(u64, u64)> {
    let request = request(local, remote)?;
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, libc::NETLINK_SOCK_DIAG) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a descriptor just opened and owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let wait = libc::timeval { tv_sec: 0, tv_usec: REPLY_WAIT.as_micros() as libc::suseconds_t };
    // SAFETY: `wait` is a valid timeval of the size passed.
    let set = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&wait as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if set != 0 {
        return None;
    }
    // SAFETY: sockaddr_nl is plain data; all zero but the family addresses
    // the kernel (netlink(7)).
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `request` and `kernel` are valid for the lengths passed.
    let sent = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent != request.len() as isize {
        return None;
    }
    let mut reply = [0u8; 1024];
    // SAFETY: `reply` is valid for writes of its length.
    let got = unsafe { libc::recv(fd.as_raw_fd(), reply.as_mut_ptr().cast(), reply.len(), 0) };
    let got = usize::try_from(got).ok()?;
    identity_from_reply(&reply[..got.min(reply.len())], local, remote)
}

/// The request: an exact lookup (no `NLM_F_DUMP`) of the TCP socket bound
/// to `local`, connected to `remote`; `None` for a mixed v4/v6 pair.
fn request(local: SocketAddr, remote: SocketAddr) -> Option<Vec<u8>> {
    let family = match (local.ip(), remote.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => libc::AF_INET,
        (IpAddr::V6(_), IpAddr::V6(_)) => libc::AF_INET6,
        _ => return None,
    };
    let total = NLMSG_HDR_BYTES + REQ_BYTES;
    let mut m = Vec::with_capacity(total);
    m.extend_from_slice(&(total as u32).to_ne_bytes()); // nlmsg_len
    m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes()); // nlmsg_type
    m.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes()); // nlmsg_flags
    m.extend_from_slice(&1u32.to_ne_bytes()); // nlmsg_seq
    m.extend_from_slice(&0u32.to_ne_bytes()); // nlmsg_pid: the kernel
    m.extend_from_slice(&[family as u8, libc::IPPROTO_TCP as u8, 0, 0]); // family, protocol, ext, pad
    m.extend_from_slice(&u32::MAX.to_ne_bytes()); // idiag_states: any
    m.extend_from_slice(&sockid(local, remote));
    debug_assert_eq!(m.len(), total);
    Some(m)
}

/// `struct inet_diag_sockid`: ports and addresses in network byte order,
/// no interface, and `INET_DIAG_NOCOOKIE` (both words all ones), which an
/// exact lookup needs or it answers `ESTALE` (sock_diag(7)).
fn sockid(local: SocketAddr, remote: SocketAddr) -> [u8; 48] {
    let mut id = [0u8; 48];
    id[0..2].copy_from_slice(&local.port().to_be_bytes());
    id[2..4].copy_from_slice(&remote.port().to_be_bytes());
    for (at, ip) in [(4, local.ip()), (20, remote.ip())] {
        match ip {
            IpAddr::V4(v4) => id[at..at + 4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => id[at..at + 16].copy_from_slice(&v6.octets()),
        }
    }
    id[40..48].fill(0xff);
    id
}

/// The inode and cookie of the reply's socket, if the reply is one
/// `inet_diag_msg` naming the socket asked for (anything else, an
/// `NLMSG_ERROR` included: `None`). The kernel's bytes are still checked:
/// lengths, type, the id.
pub(crate) fn identity_from_reply(reply: &[u8], local: SocketAddr, remote: SocketAddr) -> Option<(u64, u64)> {
    let u32_at = |bytes: &[u8], at: usize| bytes.get(at..at + 4).map(|b| u32::from_ne_bytes(b.try_into().unwrap()));
    let len = u32_at(reply, 0)? as usize;
    let kind = u16::from_ne_bytes(reply.get(4..6)?.try_into().ok()?);
    if kind == NLMSG_ERROR || kind != SOCK_DIAG_BY_FAMILY || len < NLMSG_HDR_BYTES + MSG_BYTES || len > reply.len() {
        return None;
    }
    let msg = &reply[NLMSG_HDR_BYTES..len];
    // The id the kernel answers for is the one asked about (the cookie
    // words are the socket's own, so they are left out of the match).
    if msg.get(4..44)? != &sockid(local, remote)[..40] {
        return None;
    }
    let inode = u32_at(msg, INODE_AT).map(u64::from).filter(|&inode| inode != 0)?;
    let cookie = u64::from(u32_at(msg, COOKIE_AT)?) | u64::from(u32_at(msg, COOKIE_AT + 4)?) << 32;
    Some((inode, cookie))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn the_kernel_names_the_socket_it_has() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let (ours, theirs) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        let (inode, cookie) = socket_identity(theirs, ours).expect("netlink finds the accepted socket");
        let link = std::fs::read_link(format!("/proc/self/fd/{}", server.as_raw_fd())).unwrap();
        assert_eq!(link.to_str().unwrap(), format!("socket:[{inode}]"));
        // The cookie netlink gives is the one SO_COOKIE gives for that
        // socket, and not its other end's.
        assert_eq!(super::super::owner::cookie_of(server.as_fd()), Some(cookie));
        assert_ne!(super::super::owner::cookie_of(client.as_fd()), Some(cookie));
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(socket_identity(theirs, nobody), None, "no such connection");
    }

    #[test]
    fn short_wrong_or_mismatched_replies_are_refused() {
        let (local, remote): (SocketAddr, SocketAddr) =
            ("127.0.0.1:80".parse().unwrap(), "127.0.0.1:9".parse().unwrap());
        let mut good = vec![0u8; NLMSG_HDR_BYTES + MSG_BYTES];
        let total = good.len() as u32;
        good[0..4].copy_from_slice(&total.to_ne_bytes());
        good[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        good[NLMSG_HDR_BYTES + 4..NLMSG_HDR_BYTES + 52].copy_from_slice(&sockid(local, remote));
        good[NLMSG_HDR_BYTES + INODE_AT..NLMSG_HDR_BYTES + INODE_AT + 4].copy_from_slice(&77u32.to_ne_bytes());
        let cookie_at = NLMSG_HDR_BYTES + COOKIE_AT;
        good[cookie_at..cookie_at + 4].copy_from_slice(&5u32.to_ne_bytes());
        good[cookie_at + 4..cookie_at + 8].copy_from_slice(&1u32.to_ne_bytes());
        assert_eq!(identity_from_reply(&good, local, remote), Some((77, (1 << 32) | 5)), "the low word first");
        for cut in 0..good.len() {
            assert_eq!(identity_from_reply(&good[..cut], local, remote), None, "cut at {cut}");
        }
        let mut error = good.clone();
        error[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        assert_eq!(identity_from_reply(&error, local, remote), None);
        assert_eq!(identity_from_reply(&good, remote, local), None, "another socket's answer");
        let mut overlong = good.clone();
        overlong[0..4].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert_eq!(identity_from_reply(&overlong, local, remote), None);
    }
}
