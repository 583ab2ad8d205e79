//! Arbitrary bytes as a framed control message (what the control server and
//! client read from a socket): an error or a decoded message, never a panic.
#![no_main]

use kvring::control::frame::{decode_request, decode_response, read_frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut reader = data;
    if let Ok(Some(body)) = read_frame(&mut reader, 1 << 16) {
        let _ = decode_request(&body);
        let _ = decode_response(&body);
    }
    let _ = decode_request(data);
    let _ = decode_response(data);
});
