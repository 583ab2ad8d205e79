//! Arbitrary bytes as redis's replies (see kvring::testing::fuzz::redis_reply).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::redis_reply(data));
