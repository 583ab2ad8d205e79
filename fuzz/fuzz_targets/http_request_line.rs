//! Arbitrary bytes as a request to the /metrics server (see kvring::fuzzing::http_request_line).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzzing::http_request_line(data));
