//! Arbitrary bytes as data frames past a real session proof: unsealed, nothing served; sealed, served within the region, every reply sealed in order (see kvring::testing::fuzz::sealed_frames).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::sealed_frames(data));
