//! Arbitrary bytes as a connection to a tokened GPU descriptor server: no descriptor leaves it without the session's proof (see kvring::testing::fuzz::gpu_fds_connection).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::gpu_fds_connection(data));
