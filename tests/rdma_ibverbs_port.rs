//! A port that goes down under the real provider over the fake libibverbs
//! (see tests/rdma_ibverbs.rs for how it is loaded): the fake raises
//! IBV_EVENT_PORT_ERR on the context's async descriptor and leaves WRs
//! posted meanwhile unanswered (until the QP's retries run out); kvring's
//! event thread fails the lane's in-flight batch with the port's reason
//! instead of waiting for the retries, and once the port is back
//! (IBV_EVENT_PORT_ACTIVE) the reopened segment moves bytes again. One test
//! in its own binary, because the fault is process-wide (a file the fake
//! checks at every call).

mod common;

use common::{pattern, WAIT};
use kvring::{Batch, BlockDesc, Outcome};

#[test]
fn a_port_that_goes_down_fails_in_flight_batches_with_the_reason_and_serves_again_once_up() {
    // The fake reads `FAKE_IBVERBS_PORT_DOWN_FILE` at each call: set before any verb runs.
    let Some(common::verbs::FakePair { switch: down, target, remote, initiator, local }) =
        common::verbs::fake_pair("FAKE_IBVERBS_PORT_DOWN_FILE", "port")
    else {
        return;
    };
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(6) };
    let addr = target.control_addr().to_string();
    let segment = initiator.open_segment(&addr).unwrap();
    let descs: Vec<BlockDesc> =
        (0..32).map(|i| BlockDesc::new(local.id(), i * 32768, remote.id(), i * 32768, 16384)).collect();
    let mut sub = initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());

    std::fs::write(&down, b"down").unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    let Outcome::Failed(error) = outcome else { panic!("a port that went down fails the batch: {outcome:?}") };
    let text = error.to_string();
    assert!(text.contains("fakeroce0 port 1 went down (IBV_EVENT_PORT_ERR)"), "the port's event is the reason: {text}");
    // While it is down, reopening fails at connect (the QP cannot reach RTS).
    assert!(initiator.open_segment(&addr).is_err(), "no link over a port that is down");

    std::fs::remove_file(&down).unwrap();
    let segment = initiator.open_segment(&addr).unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(outcome.is_done(), "{outcome:?}");
    let source = pattern(1 << 20, 6);
    let mut got = vec![0u8; 1 << 20];
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { remote.read_at(0, &mut got).unwrap() };
    for i in 0..32usize {
        assert_eq!(got[i * 32768..i * 32768 + 16384], source[i * 32768..i * 32768 + 16384]);
    }
}
