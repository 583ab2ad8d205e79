//! A hostile review's probes of arrival grants, the staging send deadline,
//! cma unregister and cancellation in flight, kept as regression tests.
//!
//! Tests named `was_*` broke the property on the tree they were written
//! against (a layer counted whole from one rewritten block, a stranger's
//! byte denying the owner's grant, plain READ answers shielding staged
//! pages from their deadline) and hold since the fixes; tests named
//! `held_*` assert a property the probe tried to break and could not. (The
//! review's fourth finding, a cma user slot claimed in two steps whose pid
//! and start time could disagree, is a unit test of the claim in
//! `transport::cma::page`: the state it left can no longer arise.)

mod common;

use common::raw::{data_connection, shrink_receive_buffer, tagged_write};
use common::WAIT;
use kvring::testing::tcp::{FrameHeader, FrameOp, FLAG_LAST};
use kvring::{Batch, BlockDesc, Error, Outcome, RegionInfo, TransportKind};
use std::io::Write;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;
use zerocopy::IntoBytes;

const BLOCK: u64 = 64 << 10;

// ---- arrival grants (src/arrival.rs) -------------------------------------

/// A granted tag counts *bytes landed inside its ranges*, not *which* bytes
/// of its ranges landed: one block written again and again inside the
/// grant reaches the request's whole length, and `wait_landed` says the
/// layer is in place while three quarters of it never arrived.
/// src/arrival.rs:146-160 (`add`: `bytes_of(word) + bytes` once
/// `granted_covers`).
#[test]
fn was_one_block_rewritten_inside_a_grant_counts_as_the_whole_layer() {
    let target = common::engine("r1-tag-target");
    let kv = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { kv.write_at(0, &vec![0u8; 1 << 20]).unwrap() };
    let epoch = kvring::testing::descriptor(&target).epoch;
    let tag = kvring::kv::arrival_tag(7, 1).unwrap();
    target.grant_arrival(tag, &[(kv.id(), 4 * BLOCK, 4 * BLOCK)]).unwrap();

    let mut peer = data_connection(&target);
    let junk = vec![0x5a; BLOCK as usize];
    for _ in 0..4 {
        assert_eq!(tagged_write(&mut peer, epoch, kv.id(), 4 * BLOCK, &junk, tag), 0);
    }
    let landed = target.landed(tag);
    let mut last = vec![0u8; BLOCK as usize];
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { kv.read_at(7 * BLOCK, &mut last).unwrap() };
    assert!(last.iter().all(|&b| b == 0), "block 7 was never written");
    assert!(
        landed < 4 * BLOCK && target.wait_landed(tag, 4 * BLOCK, Duration::from_millis(50)).is_err(),
        "the grant reports {landed} of {} bytes in place, yet only block 4 was ever written",
        4 * BLOCK
    );
}

/// Tags are predictable (`slot << 12 | layer`), and a tag that counted a
/// single ungranted byte can no longer be granted (`InUse`): any peer that
/// may write one byte of any region denies the owner every grant it will
/// ever make. src/arrival.rs:197-199 (`grant`: `self.landed(tag) > 0`).
#[test]
fn was_a_peer_landing_one_byte_first_denies_the_owners_grant() {
    let target = common::engine("r1-pre-target");
    let scratch = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let kv = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let epoch = kvring::testing::descriptor(&target).epoch;
    let mut peer = data_connection(&target);
    // The peer pre-claims the next requests' tags with one byte each.
    for slot in 1..5 {
        let tag = kvring::kv::arrival_tag(slot, 0).unwrap();
        assert_eq!(tagged_write(&mut peer, epoch, scratch.id(), 0, &[1], tag), 0);
    }
    let tag = kvring::kv::arrival_tag(2, 0).unwrap();
    let granted = target.grant_arrival(tag, &[(kv.id(), 0, BLOCK)]);
    assert!(granted.is_ok(), "the owner's grant for request 2 was refused by a stranger's byte: {granted:?}");
}

/// Ranges that overflow or wrap are refused, never granted as a huge
/// range; a landing whose end wraps never counts.
#[test]
fn held_overflowing_grant_ranges_are_refused() {
    let target = common::engine("r1-ovf-target");
    let kv = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let tag = kvring::kv::arrival_tag(9, 9).unwrap();
    assert!(matches!(target.grant_arrival(tag, &[(kv.id(), u64::MAX - 10, 4096)]), Err(Error::InvalidArgument { .. })));
    assert!(matches!(target.grant_arrival(tag, &[(kv.id(), 10, 0)]), Err(Error::InvalidArgument { .. })));
    assert!(matches!(target.grant_arrival(tag, &[(kv.id(), 0, u64::MAX)]), Ok(())));
    // Granted the whole address space: a wrapping frame still never counts
    // (the target refuses its place before any count).
    let epoch = kvring::testing::descriptor(&target).epoch;
    let mut peer = data_connection(&target);
    let status = tagged_write(&mut peer, epoch, kv.id(), u64::MAX - 10, &[0u8; 64], tag);
    assert_ne!(status, 0, "a write past the region is refused");
    assert_eq!(target.landed(tag), 0);
}

// ---- cancel in flight (src/runtime/lane/poll.rs, tcp/conn.rs) -------------

/// Cancels a tcp batch `round` after submitting it (from at once to about
/// when it completes), over two lanes; once the batch reports ended, the
/// memory it was moving must not change again. `read`: a GET into our
/// region; else a PUT into the target's.
fn cancel_race(read: bool) {
    let lanes = |name| common::builder(name).lanes(2).split_threshold(1 << 20).build().unwrap();
    let (initiator, target) = (lanes("r1-cancel-init"), lanes("r1-cancel-target"));
    const LEN: u64 = 32 << 20;
    let local = initiator.alloc_region(LEN as usize, RegionInfo::raw()).unwrap();
    let remote = target.alloc_region(LEN as usize, RegionInfo::raw()).unwrap();
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let descs: Vec<_> =
        (0..LEN / BLOCK).map(|i| BlockDesc::new(local.id(), i * BLOCK, remote.id(), i * BLOCK, BLOCK)).collect();
    let mut sub = initiator.submitter().unwrap();
    let (mut cancelled, mut snapshot, mut later) = (0, vec![0u8; LEN as usize], vec![0u8; LEN as usize]);
    for round in 0..12u64 {
        let (source, sink) = if read { (&remote, &local) } else { (&local, &remote) };
        // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
        unsafe { source.fill_pattern(round + 1) };
        // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
        unsafe { sink.write_at(0, &vec![0u8; LEN as usize]).unwrap() };
        let batch = if read { Batch::read(&segment) } else { Batch::write(&segment) };
        let id = sub.submit(&batch.descs(&descs).deadline(WAIT)).unwrap();
        std::thread::sleep(Duration::from_micros(round * round * 150));
        let _ = sub.cancel(id);
        let outcome = sub.wait(id, WAIT).unwrap();
        assert!(matches!(outcome, Outcome::Done { .. } | Outcome::Cancelled { .. }), "round {round}: {outcome:?}");
        cancelled += usize::from(matches!(outcome, Outcome::Cancelled { .. }));
        // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
        unsafe { sink.read_at(0, &mut snapshot).unwrap() };
        // Whatever a withdrawn chunk would still put there lands within a
        // round trip; give it many.
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
        unsafe { sink.read_at(0, &mut later).unwrap() };
        let changed = snapshot.iter().zip(&later).position(|(a, b)| a != b);
        assert_eq!(changed, None, "round {round} ({outcome:?}): a byte landed after the batch ended");
        if let Outcome::Done { bytes } = outcome {
            assert_eq!(bytes, LEN);
        }
    }
    assert!(cancelled > 0, "no round was cancelled in flight: the probe raced nothing");
}

#[test]
fn held_a_cancelled_put_over_two_lanes_never_lands_after_it_ended() {
    cancel_race(false);
}

#[test]
fn held_a_cancelled_get_over_two_lanes_never_writes_our_memory_after_it_ended() {
    cancel_race(true);
}

/// A cancel of a batch already ended, and one of another submitter's id
/// (another status table), never reaches the other submitter's batches.
#[test]
fn held_a_cancel_on_another_submitters_table_touches_none_of_its_batches() {
    let initiator = common::builder("r1-tables").lanes(1).build().unwrap();
    let target = common::engine("r1-tables-target");
    let local = initiator.alloc_region(8 << 20, RegionInfo::raw()).unwrap();
    let remote = target.alloc_region(8 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(3) };
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let descs: Vec<_> =
        (0..(8 << 20) / BLOCK).map(|i| BlockDesc::new(local.id(), i * BLOCK, remote.id(), i * BLOCK, BLOCK)).collect();
    let (mut a, mut b) = (initiator.submitter().unwrap(), initiator.submitter().unwrap());
    for _ in 0..20 {
        let victim = b.submit(&Batch::write(&segment).descs(&descs).deadline(WAIT)).unwrap();
        let mine = a.submit(&Batch::write(&segment).descs(&descs[..1]).deadline(WAIT)).unwrap();
        // `a` cancels `b`'s id (same slot number, other table), then its own.
        assert!(a.cancel(victim).is_err(), "another table's id is not ours");
        let _ = a.cancel(mine);
        let _ = a.wait(mine, WAIT).unwrap();
        assert!(b.wait(victim, WAIT).unwrap().is_done(), "b's batch was cancelled by a");
    }
}

// ---- staging: the send deadline (src/transport/tcp/target/sending.rs) ----

/// The staged-READ send deadline runs only while a *staged* answer is at
/// the front of the connection's replies (sending.rs:33-38 resets it for
/// any other front). A tokenless peer puts plain host-memory READ answers
/// first, never reads, and its staged READs behind them keep their pages
/// until the 300 s idle timeout: four such connections hold the lane's
/// whole pool, and another peer's GPU push is refused `Busy`.
#[test]
fn was_plain_read_answers_in_front_shield_staged_pages_from_the_send_deadline() {
    hold_staged_pages(true);
}

/// The control: the same four connections without the plain answers in
/// front lose their pages at the send deadline, and the push completes.
#[test]
fn held_staged_pages_alone_go_back_at_the_send_deadline() {
    hold_staged_pages(false);
}

fn hold_staged_pages(shield: bool) {
    use kvring::gpu::{Gpu, SimGpu};
    let gpu = Arc::new(SimGpu::new(1, Duration::from_micros(200)));
    let build = |name: &str| common::builder(name).gpu(gpu.clone() as Arc<dyn Gpu>).build().unwrap();
    let target = build("r1-shield-target");
    let device = target.alloc_region(32 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let host = target.alloc_region(16 << 20, RegionInfo::raw()).unwrap();
    let epoch = kvring::testing::descriptor(&target).epoch;
    let initiator = build("r1-shield-initiator");
    let local = initiator.alloc_region(8 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(5) };
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let push = |sub: &mut kvring::Submitter| {
        let descs: Vec<_> = (0..(8 << 20) / BLOCK)
            .map(|i| BlockDesc::new(local.id(), i * BLOCK, device.id(), i * BLOCK, BLOCK))
            .collect();
        let id = sub.submit(&Batch::write(&segment).descs(&descs).deadline(WAIT)).unwrap();
        sub.wait(id, WAIT).unwrap()
    };
    let mut sub = initiator.submitter().unwrap();
    assert!(push(&mut sub).is_done(), "warm: the push alone completes");

    let hostile: Vec<_> = (0..4)
        .map(|_| {
            let mut s = data_connection(&target);
            shrink_receive_buffer(&s);
            // Sixteen plain 1 MiB READs of host memory first (more than the
            // socket buffers hold), then sixteen staged 1 MiB READs of GPU
            // memory; nothing is ever read back.
            for i in if shield { 0..32u64 } else { 16..32 } {
                let (region, offset) = if i < 16 { (host.id(), i << 20) } else { (device.id(), (i - 16) << 20) };
                let mut read = FrameHeader::new(FrameOp::Read, epoch, i, region.raw(), offset, 1 << 20);
                read.flags = FLAG_LAST;
                s.write_all(read.as_bytes()).unwrap();
            }
            s
        })
        .collect();
    // Well past the 1 s send deadline.
    std::thread::sleep(Duration::from_millis(2500));
    let outcome = push(&mut sub);
    assert!(outcome.is_done(), "another peer's GPU push while the shielded pages are held: {outcome:?}");
    drop(hostile);
}

// ---- cma: the drain's user slots (src/transport/cma/page.rs) --------------

/// Unregisters a region during a stream of cma copies into it, twenty
/// times; returns in how many rounds bytes changed after `unregister`
/// returned Ok (the owner reuses the memory at once).
fn unregister_during_copies() -> usize {
    let initiator = common::engine("r1-drain-initiator");
    let local = initiator.alloc_region(8 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(5) };
    let mut landed_after = 0;
    for _round in 0..20 {
        let target = common::engine("r1-drain-target");
        let mut memory = vec![0u8; 8 << 20];
        // SAFETY: unregistered below before `memory` drops (or the test fails).
        let id = unsafe { target.register(memory.as_mut_ptr(), memory.len(), RegionInfo::raw()) }.unwrap();
        let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
        assert_eq!(segment.transport(), TransportKind::Cma);
        let descs: Vec<_> =
            (0..(8 << 20) / BLOCK).map(|i| BlockDesc::new(local.id(), i * BLOCK, id, i * BLOCK, BLOCK)).collect();
        let mut sub = initiator.submitter().unwrap();
        let first = sub.submit(&Batch::write(&segment).descs(&descs).deadline(WAIT)).unwrap();
        assert!(sub.wait(first, WAIT).unwrap().is_done());
        let stop = Arc::new(AtomicBool::new(false));
        let copying = {
            let (initiator, segment, stop, descs) = (initiator.clone(), segment.clone(), stop.clone(), descs.clone());
            std::thread::spawn(move || {
                let mut sub = initiator.submitter().unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let id = sub.submit(&Batch::write(&segment).descs(&descs).deadline(WAIT)).unwrap();
                    let _ = sub.wait(id, WAIT);
                }
            })
        };
        std::thread::sleep(Duration::from_millis(20));
        let unregistered = target.unregister(id);
        if unregistered.is_ok() {
            // Told it is gone: the owner reuses the memory at once.
            memory.fill(0xee);
        }
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        copying.join().unwrap();
        if unregistered.is_ok() {
            landed_after += usize::from(memory.iter().any(|&b| b != 0xee));
        } else {
            assert!(matches!(unregistered, Err(Error::RegionBusy { .. })), "{unregistered:?}");
            target.unregister(id).unwrap();
        }
    }
    landed_after
}

#[test]
fn held_an_unregister_waits_out_a_copy_in_an_honest_slot() {
    assert_eq!(unregister_during_copies(), 0);
}
