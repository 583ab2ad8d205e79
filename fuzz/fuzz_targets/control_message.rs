//! Arbitrary bytes as a framed control message or preface (see kvring::testing::fuzz::control_message).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::control_message(data));
