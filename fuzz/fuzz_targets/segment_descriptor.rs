//! Arbitrary bytes as a handshake's segment descriptor: checked conversion
//! either refuses it or yields a descriptor whose region table looks up
//! every listed region, and only those.
#![no_main]

use kvring::proto::SegmentDescriptor as Wire;
use kvring::segment::{PeerSegment, SegmentDescriptor};
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(wire) = Wire::decode(data) else { return };
    let Ok(descriptor) = SegmentDescriptor::from_proto(wire) else { return };
    for region in &descriptor.regions {
        assert!(region.len > 0);
        if let Some(path) = &region.shm_path {
            assert!(path.starts_with("/dev/shm/"));
        }
    }
    let ids: Vec<_> = descriptor.regions.iter().map(|r| r.id).collect();
    let peer = PeerSegment::new(descriptor);
    for id in ids {
        assert_eq!(peer.region(id).expect("listed region resolves").id, id);
        let stale = kvring::RegionId::new(id.index(), id.generation().wrapping_add(1));
        assert!(peer.region(stale).is_err());
    }
});
