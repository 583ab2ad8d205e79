//! Arbitrary bytes as a TCP data frame header (see kvring::testing::fuzz::frame_header).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::frame_header(data));
