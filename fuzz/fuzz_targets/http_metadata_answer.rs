//! Arbitrary bytes as the HTTP metadata server's answers (see kvring::testing::fuzz::http_metadata_answer).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::http_metadata_answer(data));
