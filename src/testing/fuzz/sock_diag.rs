//! The netlink (`NETLINK_SOCK_DIAG`) reply parser of the cold path's owner
//! check (`transport/cma/sockdiag.rs`): the kernel's bytes, checked as if
//! they came from outside.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// `SOCK_DIAG_BY_FAMILY` (sock_diag(7)).
const SOCK_DIAG_BY_FAMILY: u16 = 20;

/// Input: one byte (bit 0: IPv6), the local then the remote address (4 or
/// 16 bytes, then a 2-byte port, big-endian), then the reply. Whatever the
/// reply, parsing never panics, and an inode comes back only from a reply
/// that is one `SOCK_DIAG_BY_FAMILY` message, within the bytes received,
/// naming the socket asked about, with a nonzero inode; its cookie is the
/// one that message carries.
pub fn sock_diag_reply(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else { return };
    let ip_len = if kind & 1 == 1 { 16 } else { 4 };
    let Some((local, rest)) = address(rest, ip_len) else { return };
    let Some((remote, reply)) = address(rest, ip_len) else { return };
    let Some((inode, cookie)) = crate::transport::cma::sockdiag_identity_from_reply(reply, local, remote) else {
        return;
    };
    // The cookie is the id's last two words, the low one first.
    let word = |at: usize| u64::from(u32::from_ne_bytes(reply[at..at + 4].try_into().unwrap()));
    assert_eq!(cookie, word(16 + 44) | word(16 + 48) << 32);
    assert_ne!(inode, 0);
    let len = u32::from_ne_bytes(reply[0..4].try_into().unwrap()) as usize;
    assert!(len <= reply.len() && len >= 16 + 72, "an inode from a message of {len} bytes of {}", reply.len());
    assert_eq!(u16::from_ne_bytes(reply[4..6].try_into().unwrap()), SOCK_DIAG_BY_FAMILY);
    // The id answered for is the one asked about: ports, then addresses.
    assert_eq!(&reply[20..22], &local.port().to_be_bytes());
    assert_eq!(&reply[22..24], &remote.port().to_be_bytes());
}

/// An address of `ip_len` bytes and its port off the front of `bytes`.
fn address(bytes: &[u8], ip_len: usize) -> Option<(SocketAddr, &[u8])> {
    let ip = bytes.get(..ip_len)?;
    let port = u16::from_be_bytes(bytes.get(ip_len..ip_len + 2)?.try_into().ok()?);
    let ip = match ip_len {
        4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(ip).ok()?)),
        _ => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(ip).ok()?)),
    };
    Some((SocketAddr::new(ip, port), &bytes[ip_len + 2..]))
}
