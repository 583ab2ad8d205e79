//! Arbitrary bytes as a peer's memory-info answer: a checked KV layout or a
//! clear error, never a panic; an accepted layout plans without overflow.
#![no_main]

use kvring::kv::{plan_blocks, KvLayout};
use kvring::proto::KvLayoutInfo;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(info) = KvLayoutInfo::decode(data) else { return };
    let Ok(layout) = KvLayout::from_proto(info) else { return };
    assert_eq!(KvLayout::from_proto(layout.to_proto()).expect("a checked layout re-encodes"), layout);
    let last = layout.blocks() - 1;
    // Planning against itself either works or reports an error: no panic.
    let _ = plan_blocks(&layout, &layout, kvring::Opcode::Write, &[0, last], &[last, 0]);
});
