//! Arbitrary framed requests to a tokened control server, with its authentication state: nothing served without the token's proof (see kvring::fuzzing::control_requests).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzzing::control_requests(data));
