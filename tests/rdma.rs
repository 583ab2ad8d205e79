//! The RDMA transport end to end: two engines on one fabric, QPs exchanged
//! through the control plane, lanes posting and polling, the restart path,
//! and no leaked QP, MR or CQ. On the simulated verbs provider, and with
//! `RDMA_TEST_PROVIDER=ibverbs` on the real one over the fake libibverbs
//! (.ci/stage-fakeverbs.sh); what only the simulator can do is skipped there
//! with the reason (see tests/common/verbs.rs).

mod common;

use common::verbs::Provider;
use common::{pattern, WAIT};
use kvring::rdma::{Verbs, WcStatus};
use kvring::{Access, Batch, BlockDesc, Engine, Error, Outcome, RegionInfo, TransportKind};
use std::sync::Arc;
use std::time::Duration;

fn rdma_engine(name: &str, provider: &Provider) -> Engine {
    provider.apply(common::builder(name)).build().unwrap()
}

fn run(sub: &mut kvring::Submitter, batch: &Batch) -> Outcome {
    let id = sub.submit(batch).unwrap();
    sub.wait(id, WAIT).unwrap()
}

fn contents(region: &kvring::Region, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { region.read_at(offset, &mut out).unwrap() };
    out
}

#[test]
fn blocks_move_both_ways_over_rdma_and_rdma_comes_first() {
    let provider = Provider::new();
    let target = rdma_engine("decode-0", &provider);
    let remote = target.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    let initiator = rdma_engine("prefill-0", &provider);
    let local = initiator.alloc_region(4 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(5) };
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    assert_eq!(segment.transport(), TransportKind::Rdma, "both serve rdma: it comes first");

    // 64 scattered 4 KiB blocks, a 3 MiB one (sliced), and adjacent ones (coalesced).
    let mut descs: Vec<BlockDesc> =
        (0..64).map(|i| BlockDesc::new(local.id(), i * 8192, remote.id(), i * 8192, 4096)).collect();
    descs.push(BlockDesc::new(local.id(), 1 << 20, remote.id(), 1 << 20, 3 << 20));
    let mut sub = initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&descs)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(matches!(outcome, Outcome::Done { bytes } if bytes == 64 * 4096 + (3 << 20)), "{outcome:?}");
    let source = pattern(4 << 20, 5);
    for i in 0..64usize {
        assert_eq!(contents(&remote, i as u64 * 8192, 4096), source[i * 8192..i * 8192 + 4096]);
    }
    assert_eq!(contents(&remote, 1 << 20, 3 << 20), source[1 << 20..]);

    // READ back into a fresh region.
    let back = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let reads: Vec<BlockDesc> =
        (0..16).map(|i| BlockDesc::new(back.id(), i * 4096, remote.id(), (1 << 20) + i * 4096, 4096)).collect();
    let id = sub.submit(&Batch::read(&segment).descs(&reads)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    assert_eq!(contents(&back, 0, 65536), source[1 << 20..(1 << 20) + 65536]);

    // A batch of many chunks (the lane hands the link 256 blocks at a time),
    // more requests than the send queue holds.
    let many: Vec<BlockDesc> =
        (0..2000).map(|i| BlockDesc::new(local.id(), i * 2048, remote.id(), i * 2048, 1024)).collect();
    let id = sub.submit(&Batch::write(&segment).descs(&many)).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    assert!(matches!(outcome, Outcome::Done { bytes } if bytes == 2000 * 1024), "{outcome:?}");
    assert_eq!(contents(&remote, 1999 * 2048, 1024), source[1999 * 2048..1999 * 2048 + 1024]);

    // A block past the peer's region is refused before any verb is posted.
    let past = BlockDesc::new(local.id(), 0, remote.id(), (4 << 20) - 100, 4096);
    let id = sub.submit(&Batch::write(&segment).block(past)).unwrap();
    assert!(matches!(sub.wait(id, WAIT).unwrap(), Outcome::Failed(Error::OutOfBounds { .. })));
}

#[test]
fn a_peer_that_restarts_fails_in_flight_work_and_is_reached_again_with_no_leak() {
    let provider = Provider::new();
    let initiator = rdma_engine("prefill-0", &provider);
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let mut created_in_first_round = 0;
    for round in 0..20 {
        let target = rdma_engine("decode-0", &provider);
        let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
        let name = target.control_addr().to_string();
        let segment = initiator.open_segment_with(&name, Some(TransportKind::Rdma), WAIT).unwrap();
        let desc = BlockDesc::new(local.id(), 0, remote.id(), 0, 65536);
        let id = sub.submit(&Batch::write(&segment).block(desc)).unwrap();
        assert!(sub.wait(id, WAIT).unwrap().is_done(), "round {round}");
        // The peer goes away: its QPs and MRs with it.
        drop(remote);
        drop(target);
        let id = sub.submit(&Batch::write(&segment).block(desc)).unwrap();
        let outcome = sub.wait(id, WAIT).unwrap();
        assert!(matches!(outcome, Outcome::Failed(Error::PeerRestarted { .. })), "{outcome:?}");
        assert!(segment.is_stale());
        initiator.close_segment(&segment);
        if round == 0 {
            created_in_first_round = provider.verbs().counts().qps.0;
        }
    }
    // Round 0 created the initiator's QPs and the first target's (as many);
    // every later round only the new target's: the initiator's failed QPs
    // were reset and re-handshaked, never recreated.
    let created = provider.verbs().counts().qps.0;
    assert_eq!(created * 2, created_in_first_round * 21, "{created} QPs created, {created_in_first_round} in round 0");
    drop(sub);
    drop(local);
    drop(initiator);
    let counts = provider.verbs().counts();
    assert!(counts.balanced(), "{counts:?}");
}

#[test]
fn an_engine_without_rdma_is_reached_over_the_usual_transports_and_refuses_rdma_clearly() {
    let provider = Provider::new();
    let plain = common::engine("decode-plain");
    let _remote = plain.alloc_region(4096, RegionInfo::raw()).unwrap();
    let initiator = rdma_engine("prefill-0", &provider);
    let name = plain.control_addr().to_string();
    assert_eq!(initiator.open_segment(&name).unwrap().transport(), TransportKind::Shm);
    let error = initiator.open_segment_with(&name, Some(TransportKind::Rdma), WAIT).unwrap_err();
    assert!(error.to_string().contains("serves no RDMA"), "{error}");
    // A fabric with no device: the simulator made so, or (the fake's device
    // list being read once per process) a child of this test binary whose
    // fake libibverbs lists none.
    match provider {
        Provider::Sim(_) => no_device_refused(Arc::new(kvring::rdma::SimVerbs::with_devices(vec![]))),
        Provider::Real(..) if std::env::var_os("RDMA_TEST_DEVICES").is_some() => {
            eprintln!("skipped on the host's own NICs: a fabric with no device (the fake's device list)");
        }
        Provider::Real(..) => {
            let env = [("FAKE_IBVERBS_DEVICES", ""), (NO_DEVICE_CHILD, "1")];
            common::verbs::run_child("a_fabric_with_no_device_is_refused_in_a_child", &env);
        }
    }
}

/// Set in the child that runs [`a_fabric_with_no_device_is_refused_in_a_child`].
const NO_DEVICE_CHILD: &str = "RDMA_NO_DEVICE_CHILD";

fn no_device_refused(verbs: Arc<dyn Verbs>) {
    let error = common::builder("x").rdma(verbs).build().unwrap_err().to_string();
    assert!(error.contains("no RDMA device with an active port"), "{error}");
}

/// The fake libibverbs' half of the test above: run by it in a child
/// process with `FAKE_IBVERBS_DEVICES` empty (ignored otherwise, since
/// the fake reads its device list once per process).
#[test]
#[ignore = "run by an_engine_without_rdma_... in a child with no device"]
fn a_fabric_with_no_device_is_refused_in_a_child() {
    assert!(std::env::var_os(NO_DEVICE_CHILD).is_some(), "run in a child by its parent test");
    let verbs = kvring::rdma::IbVerbs::new();
    assert_eq!(verbs.devices().map(|d| d.len()).unwrap_or(0), 0, "the fake lists no device");
    no_device_refused(Arc::new(verbs));
}

#[test]
fn a_failed_queue_pair_is_reset_and_handshaked_again_not_recreated() {
    let provider = Provider::new();
    let Some(referee) = provider.referee() else { return };
    let target = rdma_engine("decode-0", &provider);
    let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let initiator = rdma_engine("prefill-0", &provider);
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(9) };
    let name = target.control_addr().to_string();
    let mut sub = initiator.submitter().unwrap();
    let desc = BlockDesc::new(local.id(), 0, remote.id(), 0, 65536);
    let segment = initiator.open_segment(&name).unwrap();
    assert!(run(&mut sub, &Batch::write(&segment).block(desc)).is_done());
    drop(segment);
    let before = provider.verbs().counts();

    for (round, status) in [WcStatus::RetryExceeded, WcStatus::Flushed, WcStatus::RetryExceeded].into_iter().enumerate()
    {
        // The fabric drops the next request: the NIC gives up on the QP.
        referee.fail_next(remote.as_ptr() as u64, status);
        let segment = initiator.open_segment(&name).unwrap();
        let outcome = run(&mut sub, &Batch::write(&segment).block(desc));
        assert!(matches!(outcome, Outcome::Failed(Error::PeerRestarted { .. })), "round {round}: {outcome:?}");
        assert!(segment.is_stale());
        drop(segment);
        // The next open by name reconnects over the same QPs, on both sides.
        let segment = initiator.open_segment(&name).unwrap();
        assert_eq!(segment.transport(), TransportKind::Rdma);
        let read_back = BlockDesc::new(local.id(), 65536, remote.id(), 0, 65536);
        assert!(run(&mut sub, &Batch::write(&segment).block(desc)).is_done());
        assert!(run(&mut sub, &Batch::read(&segment).block(read_back)).is_done());
        assert_eq!(contents(&local, 65536, 65536), pattern(65536, 9), "round {round}");
        let now = provider.verbs().counts();
        assert_eq!(now.qps, before.qps, "round {round}: no QP created or destroyed by the reconnect");
        assert_eq!(now.cqs, before.cqs, "round {round}");
    }
    drop(sub);
    drop((local, remote, initiator, target));
    let counts = provider.verbs().counts();
    assert!(counts.balanced(), "{counts:?}");
}

#[test]
fn with_two_nics_each_large_blocks_are_striped_over_both_and_land_whole() {
    let Some(provider) = Provider::try_with_nics(2) else { return };
    let target = rdma_engine("decode-0", &provider);
    let remote = target.alloc_region(8 << 20, RegionInfo::raw()).unwrap();
    let initiator = rdma_engine("prefill-0", &provider);
    let local = initiator.alloc_region(8 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(3) };
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    assert_eq!(segment.transport(), TransportKind::Rdma);

    // One 6 MiB block (sliced) and 256 small ones, then all of it read back.
    let mut descs = vec![BlockDesc::new(local.id(), 0, remote.id(), 0, 6 << 20)];
    descs.extend(
        (0..256).map(|i| BlockDesc::new(local.id(), (6 << 20) + i * 8192, remote.id(), (6 << 20) + i * 8192, 4096)),
    );
    let mut sub = initiator.submitter().unwrap();
    assert!(run(&mut sub, &Batch::write(&segment).descs(&descs)).is_done());
    let source = pattern(8 << 20, 3);
    assert_eq!(contents(&remote, 0, 6 << 20), source[..6 << 20]);
    for i in 0..256usize {
        let at = (6 << 20) + i * 8192;
        assert_eq!(contents(&remote, at as u64, 4096), source[at..at + 4096]);
    }
    let written = (6 << 20) + 256 * 4096;
    let referee = provider.referee();
    let at = remote.as_ptr() as u64;
    if let Some(referee) = &referee {
        let (first, second) = (referee.bytes_moved(0, at), referee.bytes_moved(1, at));
        assert_eq!(first + second, written, "every byte over one NIC or the other");
        assert!(first >= written / 4 && second >= written / 4, "striped: {first} and {second} bytes");
    }

    let back = initiator.alloc_region(6 << 20, RegionInfo::raw()).unwrap();
    let read = BlockDesc::new(back.id(), 0, remote.id(), 0, 6 << 20);
    assert!(run(&mut sub, &Batch::read(&segment).block(read)).is_done());
    assert_eq!(contents(&back, 0, 6 << 20), source[..6 << 20]);
    if let Some(referee) = &referee {
        assert_eq!(referee.bytes_moved(0, at) + referee.bytes_moved(1, at), written + (6 << 20));
    }
}

/// `submit`'s refusal or the batch's failure, whichever the engine gives.
fn refusal(sub: &mut kvring::Submitter, batch: &Batch) -> Error {
    match sub.submit(batch) {
        Err(error) => error,
        Ok(id) => match sub.wait(id, WAIT).unwrap() {
            Outcome::Failed(error) => error,
            other => panic!("expected a failure, got {other:?}"),
        },
    }
}

#[test]
fn bad_keys_regions_batches_and_a_vanished_device_are_clear_errors_that_write_nothing() {
    let provider = Provider::new();
    let target = rdma_engine("decode-0", &provider);
    let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let dropped = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let initiator = rdma_engine("prefill-0", &provider);
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(4) };
    let name = target.control_addr().to_string();
    let segment = initiator.open_segment(&name).unwrap();
    let mut sub = initiator.submitter().unwrap();

    // A region the peer never registered.
    let unknown = BlockDesc::new(local.id(), 0, kvring::RegionId::from_raw(9_999), 0, 4096);
    let error = refusal(&mut sub, &Batch::write(&segment).block(unknown));
    assert!(matches!(error, Error::UnknownRegion { .. }), "{error}");

    // An oversized batch is refused whole at submit.
    let many: Vec<BlockDesc> =
        (0..1_000_000).map(|i| BlockDesc::new(local.id(), i % 256 * 4096, remote.id(), 0, 16)).collect();
    let error = sub.submit(&Batch::write(&segment).descs(&many)).unwrap_err();
    assert!(matches!(error, Error::InvalidArgument { .. }) && error.to_string().contains("exceed"), "{error}");

    // A remote key the peer no longer honours: it unregistered the region
    // after this initiator learned its key. The NIC refuses it; not a byte lands.
    target.unregister(dropped.id()).unwrap();
    let stale_key = BlockDesc::new(local.id(), 0, dropped.id(), 0, 65536);
    let error = refusal(&mut sub, &Batch::write(&segment).block(stale_key));
    assert!(error.to_string().contains("refused a remote key"), "{error}");
    assert!(contents(&dropped, 0, 1 << 20).iter().all(|&b| b == 0), "nothing written outside registered memory");
    assert!(segment.is_stale(), "the failed QP makes the handle stale");
    // Reopened, the peer's table no longer lists the region.
    let segment = initiator.open_segment(&name).unwrap();
    let error = refusal(&mut sub, &Batch::write(&segment).block(stale_key));
    assert!(matches!(error, Error::UnknownRegion { .. }), "{error}");
    let fine = BlockDesc::new(local.id(), 0, remote.id(), 0, 65536);
    assert!(run(&mut sub, &Batch::write(&segment).block(fine)).is_done());

    // The NIC disappears (hot-unplug, driver reset). The fake fails it for
    // the whole process, so there this part runs in a child of its own.
    let test = "bad_keys_regions_batches_and_a_vanished_device_are_clear_errors_that_write_nothing";
    if matches!(provider, Provider::Real(..)) && std::env::var_os(DEVICE_GONE_CHILD).is_none() {
        if std::env::var_os("RDMA_TEST_DEVICES").is_some() {
            eprintln!("skipped on the host's own NICs: a device that disappears (a fake's knob)");
        } else {
            common::verbs::run_child(test, &[(DEVICE_GONE_CHILD, "1")]);
        }
        return;
    }
    let Some(referee) = provider.referee() else { return };
    let (in_flight, reopened) = referee.remove_device(0);
    let nic = &referee.nics()[0];
    let error = refusal(&mut sub, &Batch::write(&segment).block(fine));
    assert!(matches!(&error, Error::Device { device, .. } if device == nic), "{error:?}");
    assert!(error.to_string().contains(in_flight), "{error}");
    drop(segment);
    let error = initiator.open_segment_with(&name, Some(TransportKind::Rdma), WAIT).unwrap_err();
    assert!(matches!(&error, Error::Device { device, .. } if device == nic), "{error:?}");
    assert!(error.to_string().contains(reopened), "{error}");
}

/// Set in the child that runs the vanished device's part of the test above.
const DEVICE_GONE_CHILD: &str = "RDMA_DEVICE_GONE_CHILD";

#[test]
fn qps_held_for_initiators_that_went_away_are_released_and_a_reused_name_resets_nothing() {
    let provider = Provider::new();
    let target =
        provider.apply(common::builder("decode-0")).rdma_probe_interval(Duration::from_millis(50)).build().unwrap();
    let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let addr = target.control_addr().to_string();
    let write = |initiator: &Engine| {
        let local = initiator.alloc_region(65536, RegionInfo::raw()).unwrap();
        let segment = initiator.open_segment_with(&addr, Some(TransportKind::Rdma), WAIT).unwrap();
        let mut sub = initiator.submitter().unwrap();
        let desc = BlockDesc::new(local.id(), 0, remote.id(), 0, 65536);
        assert!(run(&mut sub, &Batch::write(&segment).block(desc)).is_done());
        segment
    };
    // Twenty initiators, each with its own name (as processes with the
    // default pid-based names are), come and go without saying goodbye.
    let survivor = rdma_engine("prefill-survivor", &provider);
    let kept = write(&survivor);
    let per_initiator = target.rdma_accepted_qps();
    assert!(per_initiator > 0);
    for round in 0..20 {
        let initiator = rdma_engine(&format!("prefill-{round}"), &provider);
        write(&initiator);
        drop(initiator);
        assert!(target.rdma_accepted_qps() <= per_initiator * 22, "bounded while the reaper catches up");
    }
    // The reaper probes each initiator's control address: refused, so gone.
    let deadline = std::time::Instant::now() + WAIT;
    while target.rdma_accepted_qps() > per_initiator && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(target.rdma_accepted_qps(), per_initiator, "only the live initiator's QPs are held");

    // Another engine under the survivor's name connects: the survivor's
    // QPs are untouched and it keeps transferring.
    let impostor = rdma_engine("prefill-survivor", &provider);
    write(&impostor);
    let local = survivor.alloc_region(4096, RegionInfo::raw()).unwrap();
    let mut sub = survivor.submitter().unwrap();
    let desc = BlockDesc::new(local.id(), 0, remote.id(), 0, 4096);
    assert!(run(&mut sub, &Batch::write(&kept).block(desc)).is_done());
    assert_eq!(target.rdma_accepted_qps(), 2 * per_initiator);
}

#[test]
fn regions_are_registered_with_their_own_rights_and_private_ones_get_no_keys() {
    let provider = Provider::new();
    let target = rdma_engine("decode-0", &provider);
    let read_only =
        target.alloc_region(4096, RegionInfo::raw().with_access(Access::LOCAL_READ | Access::REMOTE_READ)).unwrap();
    let private =
        target.alloc_region(4096, RegionInfo::raw().with_access(Access::LOCAL_READ | Access::LOCAL_WRITE)).unwrap();
    let open = target.alloc_region(4096, RegionInfo::raw()).unwrap();
    let rdma = kvring::testing::descriptor(&target).rdma.unwrap();
    let keyed: Vec<_> = rdma.regions.iter().map(|(id, _, _)| *id).collect();
    assert!(keyed.contains(&read_only.id()) && keyed.contains(&open.id()));
    assert!(!keyed.contains(&private.id()), "a region peers may not use has no key");

    // The initiator refuses the write before posting, and behind it the
    // NIC holds the region's own rights (the simulator, like a NIC, refuses
    // a remote write to a registration without that right).
    let initiator = rdma_engine("prefill-0", &provider);
    let local = initiator.alloc_region(4096, RegionInfo::raw()).unwrap();
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { local.fill_pattern(3) };
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Rdma), WAIT).unwrap();
    let mut sub = initiator.submitter().unwrap();
    // The initiator refuses before posting...
    let denied = BlockDesc::new(local.id(), 0, read_only.id(), 0, 4096);
    assert!(matches!(
        run(&mut sub, &Batch::write(&segment).block(denied)),
        Outcome::Failed(Error::AccessDenied { .. })
    ));
    // ...and reading it works.
    let read = BlockDesc::new(local.id(), 0, read_only.id(), 0, 4096);
    assert!(run(&mut sub, &Batch::read(&segment).block(read)).is_done());
    // The registrations' own rights (what the NIC refuses with is
    // tests/rdma_ibverbs.rs's access test on the fake).
    let Some(referee) = provider.referee() else { return };
    let rights = |region: &kvring::Region| referee.mr_rights(region.as_ptr() as u64);
    assert!(rights(&read_only).is_some_and(|rights| rights.remote_read && !rights.remote_write));
    assert!(rights(&private).is_some_and(|rights| !rights.remote_read && !rights.remote_write));
    assert!(rights(&open).is_some_and(|rights| rights.remote_read && rights.remote_write));
}
