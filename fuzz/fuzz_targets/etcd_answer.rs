//! Arbitrary bytes as etcd's answer (see kvring::fuzzing::etcd_answer).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzzing::etcd_answer(data));
