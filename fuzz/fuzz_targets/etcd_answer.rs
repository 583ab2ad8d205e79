//! Arbitrary bytes as etcd's answer (see kvring::testing::fuzz::etcd_answer).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::etcd_answer(data));
