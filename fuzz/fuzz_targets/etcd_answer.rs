//! Arbitrary bytes as etcd's answer: the HTTP parser, the JSON and range
//! decoders and the stored-descriptor decoder refuse them or yield values
//! within bounds, and never panic.
#![no_main]

use kvring::http::{parse_response, MAX_MESSAGE_BYTES};
use kvring::metadata::etcd::{decode_json, decode_range, EtcdStore};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(response) = parse_response(data) {
        assert!(response.body.len() <= data.len().max(MAX_MESSAGE_BYTES));
        if let Ok(json) = decode_json(&response.body) {
            if let Ok(Some(value)) = decode_range(&json) {
                if let Ok(descriptor) = EtcdStore::decode_descriptor("decode-0", &value) {
                    assert_eq!(descriptor.name, "decode-0");
                }
            }
        }
    }
    // The stored value on its own, as a descriptor.
    let _ = EtcdStore::decode_descriptor("decode-0", data);
});
