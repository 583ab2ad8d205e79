//! Arbitrary bytes as a TCP data frame header: a checked header or a clear
//! error, never a panic; an accepted header's payload fits the frame limit.
#![no_main]

use kvring::transport::tcp::frame::{FrameHeader, MAX_FRAME_PAYLOAD_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((header, _op)) = FrameHeader::decode(data) {
        assert!(header.len <= MAX_FRAME_PAYLOAD_BYTES);
        assert!(header.offset.checked_add(header.len).is_some());
    }
});
