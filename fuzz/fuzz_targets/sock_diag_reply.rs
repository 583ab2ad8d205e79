//! Arbitrary bytes as the kernel's NETLINK_SOCK_DIAG answer to the cold
//! path's owner check (see kvring::testing::fuzz::sock_diag_reply).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::sock_diag_reply(data));
