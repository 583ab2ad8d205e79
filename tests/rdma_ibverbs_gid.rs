//! A RoCE port's GID table changes under the real provider over the fake
//! libibverbs (see tests/rdma_ibverbs.rs for how it is loaded): the
//! netdev's IPv4 address goes away, the fake empties those GID entries and
//! raises IBV_EVENT_GID_CHANGE, and kvring chooses the GID index again (the
//! link-local RoCE v2 one), so the next connection works instead of being
//! refused for an empty GID (VERBS-REVIEW finding 12). One test in its own
//! binary, because the change is process-wide (a file the fake watches).

mod common;

use common::WAIT;
use kvring::{Batch, BlockDesc};

#[test]
fn after_the_ipv4_gid_goes_away_the_next_connection_uses_the_gid_that_is_left() {
    // The fake reads `FAKE_IBVERBS_NO_IPV4_FILE` at each call: set before any verb runs.
    let Some(common::verbs::FakePair { switch: gone, target, remote, initiator, local }) =
        common::verbs::fake_pair("FAKE_IBVERBS_NO_IPV4_FILE", "gid")
    else {
        return;
    };
    let addr = target.control_addr().to_string();
    let desc = BlockDesc::new(local.id(), 0, remote.id(), 0, 65536);
    let mut sub = initiator.submitter().unwrap();
    let segment = initiator.open_segment(&addr).unwrap();
    let id = sub.submit(&Batch::write(&segment).block(desc)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done(), "over the IPv4-mapped RoCE v2 GID");
    initiator.close_segment(&segment);

    std::fs::write(&gone, b"gone").unwrap();
    // The event reaches both engines' event threads on its own; until it
    // has, a connection may still be refused for the empty GID.
    let deadline = std::time::Instant::now() + WAIT;
    let segment = loop {
        match initiator.open_segment(&addr) {
            Ok(segment) => break segment,
            Err(error) => {
                assert!(std::time::Instant::now() < deadline, "never reconnected after the GID change: {error}");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    };
    let id = sub.submit(&Batch::write(&segment).block(desc)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    std::fs::remove_file(&gone).unwrap();
    assert!(outcome.is_done(), "over the link-local RoCE v2 GID: {outcome:?}");
}
