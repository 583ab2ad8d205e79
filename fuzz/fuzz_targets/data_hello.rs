//! Arbitrary bytes as a data connection's opening to a tokened target: nothing is served without a session proof (see kvring::testing::fuzz::data_hello).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::data_hello(data));
