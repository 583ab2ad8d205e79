//! Arbitrary bytes as a peer's memory-info answer (see kvring::fuzzing::kv_layout).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzzing::kv_layout(data));
