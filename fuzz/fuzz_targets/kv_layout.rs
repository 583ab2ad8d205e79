//! Arbitrary bytes as a peer's memory-info answer (see kvring::testing::fuzz::kv_layout).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::kv_layout(data));
