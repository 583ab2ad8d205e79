//! Arbitrary bytes as a handshake's segment descriptor; a seed lists the most regions a descriptor may, which a check quadratic in them would time out on (see kvring::testing::fuzz::segment_descriptor).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::segment_descriptor(data));
