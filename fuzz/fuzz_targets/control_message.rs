//! Arbitrary bytes as a framed control message or preface (see kvring::fuzzing::control_message).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzzing::control_message(data));
