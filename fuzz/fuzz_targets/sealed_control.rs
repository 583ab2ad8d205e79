//! Arbitrary bytes as control messages on a sealed (tokened) connection and as a step-2 answer: never opened without the session key; sealed, opened in order (see kvring::testing::fuzz::sealed_control).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::sealed_control(data));
