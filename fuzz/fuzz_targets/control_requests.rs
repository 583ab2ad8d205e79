//! Arbitrary framed requests to a tokened control server, with its authentication state: nothing served without the token's proof (see kvring::testing::fuzz::control_requests).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::control_requests(data));
