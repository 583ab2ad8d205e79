//! Hostile review 10: the tcp redial after `dialling()` / `park()` took
//! the place of `park_while_dialling` (commit 21f88e8). A proxy of the
//! test's own stands between a real initiator and a real target's data
//! port (`common::fake_peer`, as in review9_redial), so the test
//! decides what each dial meets. Probed: a chunk withdrawn (deadline,
//! cancel) while parked is never sent once the slow dial answers; a
//! cancel in the middle of parked chunks leaves the others, in order,
//! landing once; a notification parked behind a peer that closes every
//! dial after its hello ends typed with a bounded number of dials, and
//! once the peer serves again nothing is delivered twice.

mod common;

use common::fake_peer::{pair, Mode, ProxiedPair as Pair};
use common::WAIT;
use kvring::{Batch, BlockDesc, Outcome};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);

/// Fills `len` local bytes at `offset` with `byte`: the block writing
/// them to the same place of the target's region.
fn part(p: &Pair, offset: u64, len: u64, byte: u8) -> [BlockDesc; 1] {
    // SAFETY: no batch in flight touches these bytes while the test writes them.
    unsafe { p.local.write_at(offset, &vec![byte; len as usize]).unwrap() };
    [BlockDesc::new(p.local.id(), offset, p.region.id(), offset, len)]
}

// Holds: chunks parked behind a slow dial and withdrawn meanwhile (one by
// its deadline, one cancelled) are never sent once the dial answers: a
// chunk submitted after them lands on the new connection, and their bytes
// never reach the target.
#[test]
fn chunks_withdrawn_while_parked_are_never_sent_once_the_dial_answers() {
    let p =
        pair(
            "r10-withdrawn",
            LONG,
            |n| if n == 0 { Mode::Relay } else { Mode::RelayAfter(Duration::from_millis(600)) },
        );
    p.proxy.close(0);
    let mut sub = p.initiator.submitter().unwrap();
    let late = sub
        .submit(&Batch::write(&p.segment).descs(&part(&p, 0, 2048, 9)).deadline(Duration::from_millis(100)))
        .unwrap();
    p.until_dials(2);
    let cancelled = sub.submit(&Batch::write(&p.segment).descs(&part(&p, 2048, 2048, 8))).unwrap();
    sub.cancel(cancelled).unwrap();
    assert!(matches!(sub.wait(late, WAIT), Ok(Outcome::TimedOut { bytes: 0 })));
    assert!(matches!(sub.wait(cancelled, WAIT), Ok(Outcome::Cancelled { bytes: 0 })));
    let after = common::run(&mut sub, &Batch::write(&p.segment).descs(&part(&p, 4096, 4096, 7)));
    assert!(after.is_done(), "{after:?}");
    assert_eq!(common::read(&p.region, 4096, 4096), vec![7; 4096]);
    assert_eq!(common::read(&p.region, 0, 4096), vec![0; 4096], "a withdrawn chunk was sent after all");
    // The dial both withdrawn chunks waited on was abandoned with them
    // (dropped, review 9's fix), so the next chunk dialled once more.
    assert_eq!(p.proxy.dials(), 3, "one dial per batch that needed one");
}

// Holds: three chunks parked behind a slow dial, the middle one
// cancelled: the first and the last land, once, in order; the middle one
// never; one dial.
#[test]
fn a_cancel_among_parked_chunks_leaves_the_others_landing_once() {
    let p =
        pair("r10-middle", LONG, |n| if n == 0 { Mode::Relay } else { Mode::RelayAfter(Duration::from_millis(400)) });
    p.proxy.close(0);
    let mut sub = p.initiator.submitter().unwrap();
    let first = sub.submit(&Batch::write(&p.segment).descs(&part(&p, 0, 2048, 1))).unwrap();
    p.until_dials(2);
    // Parked too: the lane answers once it is kept for the dial.
    p.initiator.notify(&p.segment, b"between", WAIT).unwrap();
    let middle = sub.submit(&Batch::write(&p.segment).descs(&part(&p, 2048, 2048, 2))).unwrap();
    let last = sub.submit(&Batch::write(&p.segment).descs(&part(&p, 4096, 2048, 3))).unwrap();
    sub.cancel(middle).unwrap();
    assert!(matches!(sub.wait(first, WAIT), Ok(Outcome::Done { bytes: 2048 })));
    assert!(matches!(sub.wait(middle, WAIT), Ok(Outcome::Cancelled { bytes: 0 })));
    assert!(matches!(sub.wait(last, WAIT), Ok(Outcome::Done { bytes: 2048 })));
    assert_eq!(common::read(&p.region, 0, 2048), vec![1; 2048]);
    assert_eq!(common::read(&p.region, 2048, 2048), vec![0; 2048], "the cancelled chunk was sent");
    assert_eq!(common::read(&p.region, 4096, 2048), vec![3; 2048]);
    // A round trip after them: a notification sent twice would be in.
    assert!(common::run(&mut sub, &Batch::write(&p.segment).descs(&part(&p, 6144, 2048, 4))).is_done());
    let mut got = Vec::new();
    while let Some(n) = p.target.poll_notification() {
        got.push(n.message);
    }
    assert_eq!(got, vec![b"between".to_vec()], "the parked notification, once");
    assert_eq!(p.proxy.dials(), 2);
}

// Holds: a notification and a chunk posted while the peer closes every
// dial after its hello: `notify` returns (never a hang), the chunk fails
// typed (the handle stale: the dialled peer is taken as gone, review 9's
// `copy_of`), the dials stay few, and nothing reaches the target.
#[test]
fn a_notification_and_a_chunk_behind_a_flapping_peer_end_typed_with_few_dials() {
    let p = pair("r10-flap", LONG, |n| if n == 0 { Mode::Relay } else { Mode::CloseAfterHello });
    p.proxy.close(0);
    let first = p.initiator.notify(&p.segment, b"first", WAIT);
    assert!(!matches!(first, Err(kvring::Error::Timeout { .. })), "notify hung: {first:?}");
    // The notification's failed dial may already have staled the handle
    // (refused at submit), or the chunk dials and fails itself.
    let mut sub = p.initiator.submitter().unwrap();
    match sub.submit(&Batch::write(&p.segment).descs(&part(&p, 0, 4096, 5))) {
        Err(error) => assert!(matches!(error, kvring::Error::PeerRestarted { .. }), "{error}"),
        Ok(id) => {
            let flapped = sub.wait(id, WAIT);
            assert!(matches!(flapped, Ok(Outcome::Failed(_))), "a write to a peer closing every dial: {flapped:?}");
        }
    }
    assert!(p.segment.is_stale(), "the dialled peer is taken as gone");
    let dials = p.proxy.dials();
    assert!(dials <= 8, "a bounded number of dials for one notification and one batch, not {dials}");
    assert!(p.target.poll_notification().is_none(), "nothing was relayed");
    assert_eq!(common::read(&p.region, 0, 4096), vec![0; 4096], "the failed write landed");
}
