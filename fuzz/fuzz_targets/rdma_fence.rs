//! Arbitrary bytes as a target's rdma fence tables and pushed fences, decoded by an initiator (see kvring::testing::fuzz::rdma_fence).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::testing::fuzz::rdma_fence(data));
