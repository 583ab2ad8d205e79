//! Arbitrary bytes as a data connection's frames, served by the target's connection loop: never a byte outside the region, every lease given back (see kvring::testing::fuzz::target_connection).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::target_connection(data));
