//! Arbitrary bytes as a request to the /metrics server (see kvring::testing::fuzz::http_request_line).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::http_request_line(data));
