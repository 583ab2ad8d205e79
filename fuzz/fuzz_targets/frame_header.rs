//! Arbitrary bytes as a TCP data frame header (see kvring::fuzzing::frame_header).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzzing::frame_header(data));
