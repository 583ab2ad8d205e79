//! Hostile review 4: probes of fenced destinations (`mem::fence`, the
//! tables in a region file's header page and in the cma page), of
//! checksums, and of the cma per-region marks. A fence table that lives
//! in shared memory is written by every process that maps it (same-user
//! peers, by design): whatever they leave there, the target that owns it
//! gets a typed error from `Engine::fence`, never a panic, and a failed
//! fence leaves its range fenced on every transport, as it says.

mod common;

use common::{engine, WAIT};
use kvring::{Batch, BlockDesc, Error, Outcome, RegionInfo, TransportKind};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// Where the fence table sits in a region file (`mem::shm::FENCE_OFFSET`)
/// and its words' indices (`mem::fence`): phase, busy[0], busy[1], floor,
/// used.
const FENCE_OFFSET: u64 = 1024;
const BUSY0: u64 = 1;
const USED: u64 = 4;
const HEADER: u64 = 4096;

/// This process's region file of `len` bytes (each probe picks a length no
/// other test of this binary uses, so it finds its own file).
fn region_file(len: usize) -> PathBuf {
    let prefix = format!("kvring-{}-", std::process::id());
    std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|entry| entry.ok())
        .find(|entry| {
            entry.file_name().to_string_lossy().starts_with(&prefix)
                && entry.metadata().is_ok_and(|m| m.len() == HEADER + len as u64)
        })
        .map(|entry| entry.path())
        .expect("the region's file")
}

/// What a peer that maps the file does: writes one word of the table.
fn poke(path: &PathBuf, word: u64, value: u64) {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    file.write_all_at(&value.to_ne_bytes(), FENCE_OFFSET + 8 * word).unwrap();
}

/// Finding 1: `FenceView::fence` (and `free_slot`) scanned `used` slots as
/// the shared word says, unclamped (only a writer's `admits` clamped it).
/// A peer that maps the region file and writes `used = u64::MAX` made the
/// owner's next `Engine::fence` index past its table and panic, in the
/// caller's thread (a decode engine giving a request its blocks).
#[test]
fn a_peer_that_corrupts_the_shared_used_word_cannot_make_fence_panic() {
    let len = 3 * 65536 + 4096;
    let target = engine("target");
    let region = target.alloc_region(len, RegionInfo::raw()).unwrap();
    let file = region_file(len);
    for used in [u64::MAX, 73, 1 << 40] {
        poke(&file, USED, used);
        let fenced = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| target.fence(region.id(), 0, 4096)));
        let fenced = fenced.unwrap_or_else(|_| panic!("used = {used}: Engine::fence panicked"));
        // A grant or a typed error; either way the target goes on.
        if let Err(error) = &fenced {
            assert!(matches!(error, Error::RegionBusy { .. } | Error::InvalidArgument { .. }), "{error:?}");
        }
    }
    // Writes still get a verdict (a typed one) and the engine still fences.
    poke(&file, USED, 0);
    target.fence(region.id(), 0, 4096).unwrap();
}

/// Finding 2: `Engine::fence_ranges` fenced a region's own table, and on
/// `RegionBusy` returned before it entered the grant in the cma page's
/// table. Its doc says the range "then stays fenced under a grant nobody
/// holds"; for same-host cma writers it was not fenced at all: a cma push
/// with no grant (or an old one) landed in the range after `fence` said
/// `RegionBusy`. Here a peer that maps the region file holds its `busy`
/// word (as a writer stopped inside its copy does).
#[test]
fn a_fence_that_fails_busy_still_fences_the_range_for_cma_writers() {
    let len = 3 * 65536 + 8192;
    let target = engine("target");
    let region = target.alloc_region(len, RegionInfo::raw()).unwrap();
    let file = region_file(len);
    let initiator = engine("initiator");
    let local = initiator.alloc_region(65536, RegionInfo::raw()).unwrap();
    // SAFETY: no batch touches these bytes yet.
    unsafe { local.write_at(0, &[0xAB; 65536]).unwrap() };
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Cma), WAIT).unwrap();
    assert_eq!(segment.transport(), TransportKind::Cma);

    // A writer counted in the parity the first fence waits for, that never ends.
    poke(&file, BUSY0, 1);
    let busy = target.fence(region.id(), 0, 65536);
    assert!(matches!(busy, Err(Error::RegionBusy { .. })), "{busy:?}");
    poke(&file, BUSY0, 0);

    let remote = segment.region(0).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&[BlockDesc::new(local.id(), 0, remote, 0, 65536)])).unwrap();
    let outcome = sub.wait(id, WAIT).unwrap();
    let mut landed = vec![0u8; 16];
    // SAFETY: the push ended (waited for above).
    unsafe { region.read_at(0, &mut landed).unwrap() };
    assert!(
        matches!(outcome, Outcome::Failed(Error::Fenced { .. })),
        "a push with no grant into a range whose fence failed Busy: {outcome:?}, bytes {landed:x?}"
    );
    assert_eq!(landed, vec![0u8; 16], "nothing of the refused push landed");
}

/// Finding 3: a WRITE over tcp into a target's GPU region is checked
/// against the region's fences once, at its header; its payload is staged
/// in host pages and copied to the device later, with no pass of the fence
/// table held (`target/fenced.rs`: "a staged payload is checked only
/// here"). A fence that comes between the header and the device copy sees
/// no writer, returns at once, and the stale copy then lands over the new
/// owner's bytes: "once `fence` returned, no write under an older grant is
/// in the range" does not hold for GPU destinations over tcp. Shown on the
/// simulated GPU, whose copies land only when their events say (here
/// 200 ms after they are issued).
#[test]
fn a_staged_gpu_write_admitted_before_a_fence_does_not_land_after_it() {
    use kvring::gpu::{Gpu, SimGpu};
    use std::sync::Arc;
    use std::time::Duration;
    const MIB: usize = 1 << 20;
    let gpu = Arc::new(SimGpu::new(1, Duration::from_millis(200)));
    let target = common::builder("fence-gpu-target").gpu(gpu.clone() as Arc<dyn Gpu>).build().unwrap();
    let initiator = common::builder("fence-gpu-initiator").gpu(gpu.clone() as Arc<dyn Gpu>).build().unwrap();
    let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
    let remote = target.alloc_region(MIB, RegionInfo::raw().on_gpu(0)).unwrap();
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    assert_eq!(segment.transport(), TransportKind::Tcp);
    // SAFETY: no batch touches these bytes yet.
    unsafe { local.write_at(0, &[0xAB; 65536]).unwrap() };
    let mut sub = initiator.submitter().unwrap();
    let old = target.fence(remote.id(), 0, 65536).unwrap();
    let desc = [BlockDesc::new(local.id(), 0, segment.region(0).unwrap(), 0, 65536)];
    let tag = kvring::kv::arrival_tag(7, 0).unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&desc).grant(old).arrival_tag(tag)).unwrap();
    // The frames arrive and their device copy is issued long before it lands.
    std::thread::sleep(Duration::from_millis(50));
    target.fence(remote.id(), 0, 65536).unwrap();
    // `fence` returned: the push's bytes landed before it (counted under
    // its tag by then), or never will.
    let before_fence = target.landed(tag);
    let outcome = sub.wait(id, WAIT).unwrap();
    let mut now = vec![0u8; 65536];
    // SAFETY: the push ended (waited for above).
    unsafe { remote.read_at(0, &mut now).unwrap() };
    let stale = now.iter().filter(|&&b| b == 0xAB).count();
    let fenced = stale == 0 && matches!(outcome, Outcome::Failed(Error::Fenced { .. }));
    let landed_before = before_fence == 65536 && stale == 65536;
    assert!(
        fenced || landed_before,
        "{stale} stale bytes are there, {before_fence} had landed when fence returned (push: {outcome:?})"
    );
}

/// Finding 4: a GRANT frame's value was taken as it came: a sender naming
/// `u32::MAX` (a grant this target never issued) passed every fence of
/// every region, so a stale or confused sender (or one that guessed) wrote
/// into ranges handed to another. Grants are a counter of the target's
/// process: one above the last it issued is refused, and the connection
/// (whose grants are no longer known) closes; nothing lands.
#[test]
fn a_grant_the_target_never_issued_is_refused_and_nothing_lands() {
    use kvring::testing::tcp::{FrameHeader, FrameOp, FLAG_LAST, FRAME_HEADER_BYTES};
    use std::io::{Read, Write};
    use zerocopy::{FromBytes, IntoBytes};
    let len = 3 * 65536 + 12288;
    let target = engine("grant-target");
    let region = target.alloc_region(len, RegionInfo::raw()).unwrap();
    target.fence(region.id(), 0, 4096).unwrap();
    let mut s = common::raw::data_connection(&target);
    s.write_all(FrameHeader::new(FrameOp::Grant, target.epoch(), 9, 0, u64::from(u32::MAX), 0).as_bytes()).unwrap();
    let mut write = FrameHeader::new(FrameOp::Write, target.epoch(), 9, region.id().raw(), 0, 4096);
    write.flags = FLAG_LAST;
    // The target may have closed already: what it does with the WRITE is
    // what the region shows.
    let _ = s.write_all(write.as_bytes()).and_then(|()| s.write_all(&[0xAB; 4096]));
    let mut reply = [0u8; FRAME_HEADER_BYTES];
    let answered = s.read_exact(&mut reply).map(|()| FrameHeader::read_from_bytes(&reply).unwrap());
    if let Ok(reply) = answered {
        assert_ne!(reply.status, 0, "a write under a grant never issued was acked");
    }
    let mut landed = vec![0u8; 4096];
    // SAFETY: the connection's frames were answered (or it was closed).
    unsafe { region.read_at(0, &mut landed).unwrap() };
    assert_eq!(landed, vec![0u8; 4096], "a write under grant u32::MAX landed in a fenced range");
}
