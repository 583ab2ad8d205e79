//! Faults on the real provider over the fake libibverbs (see
//! tests/rdma_ibverbs.rs for how it is loaded): a QP that goes to error
//! mid-batch fails that batch with the reason, and the link is rebuilt when
//! the segment is opened again. One test in its own binary, because the fault is
//! process-wide (a file the fake checks at every post).

mod common;

use common::{pattern, WAIT};
use kvring::{Batch, BlockDesc, Outcome};

#[test]
fn a_qp_error_mid_batch_fails_the_batch_with_the_reason_and_the_next_batch_reconnects() {
    // The fake reads `FAKE_IBVERBS_QP_ERROR_FILE` at each call: set before any verb runs.
    let Some(common::verbs::FakePair { switch: fault, target, remote, initiator, local }) =
        common::verbs::fake_pair("FAKE_IBVERBS_QP_ERROR_FILE", "fault")
    else {
        return;
    };
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(2) };
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    let descs: Vec<BlockDesc> =
        (0..64).map(|i| BlockDesc::new(local.id(), i * 16384, remote.id(), i * 16384, 8192)).collect();
    let mut sub = initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());

    std::fs::write(&fault, b"on").unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    std::fs::remove_file(&fault).unwrap();
    let Outcome::Failed(error) = outcome else { panic!("a QP in error fails its batch: {outcome:?}") };
    assert!(error.to_string().contains("RetryExceeded"), "the reason is named: {error}");

    // The segment says the peer must be opened again (kvring's contract
    // after a failed link); reopened, the link is rebuilt and lands whole.
    let stale = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap_err();
    assert!(stale.to_string().contains("open it again"), "{stale}");
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(outcome.is_done(), "{outcome:?}");
    let source = pattern(1 << 20, 2);
    let mut got = vec![0u8; 1 << 20];
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { remote.read_at(0, &mut got).unwrap() };
    for i in 0..64usize {
        assert_eq!(got[i * 16384..i * 16384 + 8192], source[i * 16384..i * 16384 + 8192]);
    }
}
