//! Arbitrary bytes as an encoded batch: a checked batch or a clear error,
//! never a panic. A decoded batch re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(batch) = kvring::desc::decode_batch(data) {
        let again = kvring::desc::encode_batch(batch.opcode, batch.user_data, batch.deadline_us, &batch.descs);
        assert_eq!(kvring::desc::decode_batch(&again).expect("re-encoded batch decodes"), batch);
        for (i, d) in batch.descs.iter().enumerate() {
            assert!(d.len > 0);
            assert!(d.range(kvring::Side::Local, i as u32).is_ok());
            assert!(d.range(kvring::Side::Remote, i as u32).is_ok());
        }
    }
});
