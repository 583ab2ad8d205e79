//! Arbitrary bytes as a target's replies to the initiator's chunks in flight: never a byte outside the READ blocks (see kvring::testing::fuzz::initiator_replies).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::initiator_replies(data));
