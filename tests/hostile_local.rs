//! The second hostile round, same-host and target-side rows (issue 27:
//! 3-8), each written as an outsider would: a cma target that execs, a
//! registry slot churned past its generation, two racing unregisters during
//! a same-host copy, a forged arrival tag and a zero-length one, a peer
//! holding the staged READ pages while another peer pushes GPU memory, and
//! a peer handing out another engine's region files as its own.

mod common;

use common::raw::{data_connection, shrink_receive_buffer, tagged_write};
use common::WAIT;
use kvring::gpu::{Gpu, SimGpu};
use kvring::testing::tcp::{
    ClientHello, End, FrameHeader, FrameOp, FrameSeal, ServerHello, FLAG_LAST, SERVER_HELLO_BYTES,
};
use kvring::{Access, Batch, BlockDesc, Engine, Error, Outcome, RegionId, RegionInfo, Segment, TransportKind};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zerocopy::{FromBytes, IntoBytes};

const LEN: usize = 4 << 20;
const BLOCK: u64 = 64 << 10;

fn write_all(engine: &Engine, segment: &Segment, local: RegionId, remote: RegionId, len: u64) -> Outcome {
    let descs: Vec<_> = (0..len / BLOCK).map(|i| BlockDesc::new(local, i * BLOCK, remote, i * BLOCK, BLOCK)).collect();
    let mut sub = engine.submitter().unwrap();
    let id = sub.submit(&Batch::write(segment).descs(&descs).deadline(WAIT)).unwrap();
    sub.wait(id, WAIT).unwrap()
}

/// Reads lines from a child until one holds `marker`; returns what follows it.
fn line_after(out: &mut impl BufRead, marker: &str) -> String {
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "the child ended before saying {marker:?}");
        // libtest prints the test's name before it on the same line.
        if let Some((_, rest)) = line.split_once(marker) {
            return rest.trim().to_string();
        }
    }
}

// ---- Row 3: a cma target that execs ------------------------------------

/// The exec'ing target, run as this test binary's child: an engine serving
/// caller memory over cma, which on "exec" replaces its image (same pid)
/// with a program that maps fresh memory at the old region's address and
/// reports, on "check", how many bytes of it are not zero.
#[test]
#[ignore = "the child of a_cma_target_that_execs_gets_nothing_in_its_new_image"]
fn cma_exec_child() {
    let mut stdin = std::io::stdin().lock();
    let mut line = String::new();
    match std::env::var("KVRING_EXEC_STAGE").expect("run by its parent test").as_str() {
        "engine" => {
            let memory = map_at(0, LEN).expect("memory for the region");
            let engine = common::builder("exec-target").build().unwrap();
            // SAFETY: the mapping lives until the process image is replaced.
            unsafe { engine.register(memory as *mut u8, LEN, RegionInfo::raw()) }.unwrap();
            println!("ready {} {memory}", engine.control_addr());
            std::io::stdout().flush().unwrap();
            stdin.read_line(&mut line).unwrap();
            let error = Command::new(std::env::current_exe().unwrap())
                .args(["--ignored", "--exact", "cma_exec_child", "--nocapture", "--test-threads=1"])
                .env("KVRING_EXEC_STAGE", "image")
                .env("KVRING_EXEC_ADDR", memory.to_string())
                .exec();
            panic!("exec failed: {error}");
        }
        "image" => {
            let addr: usize = std::env::var("KVRING_EXEC_ADDR").unwrap().parse().unwrap();
            // The old image's page files stay behind (nobody dropped it).
            let prefix = format!("kvring-{}-", std::process::id());
            for entry in std::fs::read_dir("/dev/shm").unwrap().flatten() {
                if entry.file_name().to_string_lossy().starts_with(&prefix) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
            let mapped = map_at(addr, LEN).is_some();
            println!("execd {}", u8::from(mapped));
            std::io::stdout().flush().unwrap();
            stdin.read_line(&mut line).unwrap();
            let nonzero = if mapped {
                // SAFETY: mapped above, LEN bytes, read only here.
                unsafe { std::slice::from_raw_parts(addr as *const u8, LEN) }.iter().filter(|&&b| b != 0).count()
            } else {
                0
            };
            println!("nonzero {nonzero}");
            std::io::stdout().flush().unwrap();
        }
        other => panic!("unknown stage {other}"),
    }
}

/// Maps `len` zeroed bytes, at `addr` exactly (never over a mapping) or
/// anywhere when `addr` is 0.
fn map_at(addr: usize, len: usize) -> Option<usize> {
    let fixed = if addr == 0 { 0 } else { libc::MAP_FIXED_NOREPLACE };
    // SAFETY: an anonymous private mapping; MAP_FIXED_NOREPLACE never
    // replaces an existing one.
    let at = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
            -1,
            0,
        )
    };
    (at != libc::MAP_FAILED && (addr == 0 || at as usize == addr)).then_some(at as usize)
}

#[test]
fn a_cma_target_that_execs_gets_nothing_in_its_new_image() {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "cma_exec_child", "--nocapture", "--test-threads=1"])
        .env("KVRING_EXEC_STAGE", "engine")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut input = child.stdin.take().unwrap();
    let ready = line_after(&mut out, "ready ");
    let addr = ready.split_whitespace().next().unwrap().to_string();
    let engine = common::engine("exec-initiator");
    let local = engine.alloc_region(LEN, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(3) };
    let segment = engine.open_segment(&addr).unwrap();
    assert_eq!(segment.transport(), TransportKind::Cma, "caller memory of a same-host peer");
    let remote = segment.region(0).unwrap();
    write_all(&engine, &segment, local.id(), remote, LEN as u64).into_result().unwrap();

    input.write_all(b"exec\n").unwrap();
    let mapped = line_after(&mut out, "execd ");
    assert_eq!(mapped, "1", "the new image mapped memory where the region was");
    match write_all(&engine, &segment, local.id(), remote, LEN as u64) {
        Outcome::Failed(Error::PeerRestarted { detail, .. }) => {
            assert!(detail.contains("no longer maps its cma page"), "{detail}")
        }
        other => panic!("a write after the target's exec must fail PeerRestarted, got {other:?}"),
    }
    input.write_all(b"check\n").unwrap();
    assert_eq!(line_after(&mut out, "nonzero "), "0", "no byte landed in the new program");
    drop(input);
    child.wait().unwrap();
}

// ---- Row 4: a registry slot churned past its generation -----------------

#[test]
fn a_slot_churned_past_its_generation_never_names_the_old_region_again() {
    let target = common::engine("churn-target");
    let mut old = vec![0u8; 1 << 16];
    let mut new = vec![0u8; 1 << 16];
    // SAFETY: both buffers outlive their registrations (unregistered, or
    // the engine dropped, before they are).
    let first = unsafe { target.register(old.as_mut_ptr(), old.len(), RegionInfo::raw()) }.unwrap();
    let initiator = common::engine("churn-initiator");
    let local = initiator.alloc_region(1 << 16, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(8) };
    let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
    assert_eq!(segment.transport(), TransportKind::Cma);
    target.unregister(first).unwrap();
    // 65,536 re-registrations: a 16-bit generation would come back to
    // `first` here; the 32-bit one goes on, in the same slot.
    let mut ids = std::collections::HashSet::new();
    let mut aliased_under_16_bits = 0;
    for _ in 0..=u16::MAX as usize {
        // SAFETY: as above.
        let id = unsafe { target.register(new.as_mut_ptr(), new.len(), RegionInfo::raw()) }.unwrap();
        assert_ne!(id, first, "the old id was handed out again");
        assert!(ids.insert(id), "id {id} handed out twice");
        if id.index() == first.index() && id.generation() as u16 == first.generation() as u16 {
            aliased_under_16_bits += 1;
        }
        target.unregister(id).unwrap();
    }
    assert_eq!(aliased_under_16_bits, 1, "the churn reached the generation a 16-bit id wrapped to");
    // The initiator still holds the old id: nothing lands anywhere.
    // SAFETY: as above.
    let again = unsafe { target.register(new.as_mut_ptr(), new.len(), RegionInfo::raw()) }.unwrap();
    assert_ne!(again, first);
    let outcome = write_all(&initiator, &segment, local.id(), first, 1 << 16);
    assert!(!outcome.is_done(), "{outcome:?}");
    assert!(old.iter().all(|&b| b == 0), "nothing at the address captured at open");
    assert!(new.iter().all(|&b| b == 0), "nothing in the new buffer");
    target.unregister(again).unwrap();
}

// ---- Row 5: two racing unregisters during a same-host copy --------------

#[test]
fn two_racing_unregisters_never_list_the_region_again() {
    let initiator = common::engine("race-initiator");
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(5) };
    for round in 0..10 {
        let target = Arc::new(common::engine("race-target"));
        let mut memory = vec![0u8; 1 << 20];
        // SAFETY: unregistered below (by one of the racers) before `memory` drops.
        let id = unsafe { target.register(memory.as_mut_ptr(), memory.len(), RegionInfo::raw()) }.unwrap();
        let segment = initiator.open_segment(&target.control_addr().to_string()).unwrap();
        assert_eq!(segment.transport(), TransportKind::Cma);
        // A copy stream into the region while two threads unregister it.
        let stop = Arc::new(AtomicBool::new(false));
        let copying = {
            let (initiator, segment, stop, local) = (initiator.clone(), segment.clone(), stop.clone(), local.id());
            std::thread::spawn(move || {
                let descs: Vec<_> = (0..16).map(|i| BlockDesc::new(local, i * BLOCK, id, i * BLOCK, BLOCK)).collect();
                let mut sub = initiator.submitter().unwrap();
                // Refusals and failures are expected once a racer has
                // unregistered the region; only the racers are checked.
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(batch) = sub.submit(&Batch::write(&segment).descs(&descs).deadline(WAIT)) {
                        let _ = sub.wait(batch, WAIT);
                    }
                }
            })
        };
        let racers: Vec<_> = (0..2)
            .map(|_| {
                let target = target.clone();
                std::thread::spawn(move || target.unregister(id))
            })
            .collect();
        let results: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
        stop.store(true, Ordering::Relaxed);
        copying.join().unwrap();
        let ok = results.iter().filter(|r| r.is_ok()).count();
        if ok == 0 {
            // Both timed out on a busy copy: the region is still ours to unregister.
            assert!(results.iter().all(|r| matches!(r, Err(Error::RegionBusy { .. }))), "{results:?}");
            target.unregister(id).unwrap();
        } else {
            assert_eq!(ok, 1, "round {round}: {results:?}");
            let lost = results.iter().find(|r| r.is_err()).unwrap();
            assert!(matches!(lost, Err(Error::UnknownRegion { .. })), "round {round}: {lost:?}");
        }
        // The owner was told it is unregistered: it reuses the memory.
        memory.fill(0xee);
        let outcome = write_all(&initiator, &segment, local.id(), id, 1 << 20);
        assert!(!outcome.is_done(), "round {round}: a write after unregister landed: {outcome:?}");
        assert!(memory.iter().all(|&b| b == 0xee), "round {round}: bytes landed after unregister");
    }
}

// ---- Row 6: a forged arrival tag, and a zero-length one ------------------

#[test]
fn a_forged_arrival_tag_from_another_sender_counts_nothing() {
    let target = common::engine("tag-target");
    let kv = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let epoch = kvring::testing::descriptor(&target).epoch;
    // Request 42's layer 3 was given blocks 4..8 of the KV region.
    let tag = kvring::kv::arrival_tag(42, 3).unwrap();
    let granted = (kv.id(), 4 * BLOCK, 4 * BLOCK);
    target.grant_arrival(tag, &[granted]).unwrap();
    // Another request that picked the same tag (another prefill engine's
    // slot 42) is told, not summed.
    assert!(target.grant_arrival(tag, &[(kv.id(), 0, BLOCK)]).is_err());

    // A hostile peer allowed to write the region tags its own writes, and
    // a zero-length one, with request 42's tag.
    let mut hostile = data_connection(&target);
    let junk = vec![0x5a; BLOCK as usize];
    for block in [0u64, 1, 2, 9, 12] {
        assert_eq!(tagged_write(&mut hostile, epoch, kv.id(), block * BLOCK, &junk, tag), 0);
    }
    assert_eq!(tagged_write(&mut hostile, epoch, kv.id(), 4 * BLOCK, &[], tag), 0);
    // Straddling the granted range's end.
    assert_eq!(tagged_write(&mut hostile, epoch, kv.id(), 8 * BLOCK - 10, &junk, tag), 0);
    assert_eq!(target.landed(tag), 0, "nothing of request 42's blocks has landed");
    assert!(matches!(target.wait_landed(tag, 4 * BLOCK, Duration::from_millis(50)), Err(Error::Timeout { .. })));
    assert_eq!(target.arrivals_refused(), 6);

    // The real push of request 42's blocks counts, and only it.
    let initiator = common::engine("tag-initiator");
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(42) };
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    let descs: Vec<_> = (4..8u64).map(|i| BlockDesc::new(local.id(), i * BLOCK, kv.id(), i * BLOCK, BLOCK)).collect();
    let mut sub = initiator.submitter().unwrap();
    let id = sub.submit(&Batch::write(&segment).descs(&descs).arrival_tag(tag)).unwrap();
    target.wait_landed(tag, 4 * BLOCK, WAIT).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    assert_eq!(target.landed(tag), 4 * BLOCK);
    let (mut here, mut there) = (vec![0u8; 4 * BLOCK as usize], vec![0u8; 4 * BLOCK as usize]);
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.read_at(4 * BLOCK, &mut here).unwrap() };
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { kv.read_at(4 * BLOCK, &mut there).unwrap() };
    assert!(here == there, "what was counted is request 42's bytes");
    assert_eq!(target.forget_arrival(tag), 4 * BLOCK);
}

// ---- Row 7: a peer holding the staged READ pages -------------------------

/// Pushes `len` bytes of GPU memory from `local` into `remote`; the time it took.
fn gpu_push(engine: &Engine, segment: &Segment, local: RegionId, remote: RegionId, len: u64) -> (Outcome, Duration) {
    let started = Instant::now();
    (write_all(engine, segment, local, remote, len), started.elapsed())
}

const TOKEN: &str = "hostile-local-token";

/// A proven peer's session (its handshake's), as a proven peer holds it.
type Proven = kvring::testing::control::Session;

/// A data connection of a peer that proved the token in `session`'s
/// handshake, and the seal its frame headers must carry.
fn tokened_data_connection(target: &Engine, session: &Proven) -> (std::net::TcpStream, FrameSeal) {
    let descriptor = kvring::testing::descriptor(target);
    let mut s = std::net::TcpStream::connect(descriptor.tcp_addr.as_deref().unwrap()).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let nonce = [0x4b; 16];
    let hello = ClientHello::new(descriptor.epoch, session.client_nonce, session.server_nonce, nonce);
    s.write_all(hello.as_bytes()).unwrap();
    let mut answer = [0u8; SERVER_HELLO_BYTES];
    s.read_exact(&mut answer).unwrap();
    let challenge = ServerHello::read_from_bytes(&answer).unwrap();
    let proof = kvring::testing::tcp::ClientProof::new(session.data_proof(&challenge.nonce, descriptor.epoch));
    s.write_all(proof.as_bytes()).unwrap();
    s.read_exact(&mut answer).unwrap();
    assert_eq!(ServerHello::read_from_bytes(&answer).unwrap().status, 0);
    let seal = FrameSeal::new(session, &nonce, &challenge.nonce, descriptor.epoch, End::Initiator);
    (s, seal)
}

/// A target serving a GPU region (simulated GPU), an initiator pushing 8
/// MiB of its GPU memory into it alone, then again while a hostile peer's
/// four connections hold staged READ answers they never read. Returns the
/// two times (the figure).
fn staged_push_against_a_pool_holder(token: Option<&str>) -> (Duration, Duration) {
    let gpu = Arc::new(SimGpu::new(1, Duration::from_micros(200)));
    let tokened = |name: &str| {
        let builder = common::builder(name).gpu(gpu.clone() as Arc<dyn Gpu>);
        match token {
            Some(token) => builder.token(token),
            None => builder,
        }
        .build()
        .unwrap()
    };
    let target = tokened("staging-target");
    let device = target.alloc_region(32 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    let epoch = kvring::testing::descriptor(&target).epoch;
    let initiator = tokened("staging-initiator");
    let local = initiator.alloc_region(8 << 20, RegionInfo::raw().on_gpu(0)).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.fill_pattern(77) };
    let segment =
        initiator.open_segment_with(&target.control_addr().to_string(), Some(TransportKind::Tcp), WAIT).unwrap();
    // Warm (connections, staging pools), then the push alone: the median of three.
    let mut alone: Vec<_> = (0..4)
        .map(|_| {
            let (outcome, took) = gpu_push(&initiator, &segment, local.id(), device.id(), 8 << 20);
            outcome.into_result().unwrap();
            took
        })
        .skip(1)
        .collect();
    alone.sort();
    let alone_took = alone[1];

    // The hostile peer: one identity (with a token, one proven handshake),
    // four connections, each asking for sixteen staged 1 MiB READs of the
    // GPU region, with a 4 KiB receive buffer, reading nothing back.
    let session: Option<Proven> = token.map(|token| {
        let initiator = kvring::testing::control::Initiator { name: "hog".into(), epoch: 1, addr: String::new() };
        let deadline = Instant::now() + WAIT;
        kvring::testing::control::ControlClient::connect(&target.control_addr().to_string(), deadline)
            .unwrap()
            .handshake(&initiator, Some(&kvring::Token::new(token)), deadline)
            .unwrap()
            .session
            .unwrap()
    });
    let hostile: Vec<_> = (0..4)
        .map(|_| {
            let (mut s, mut seal) = match &session {
                Some(session) => {
                    let (s, seal) = tokened_data_connection(&target, session);
                    (s, Some(seal))
                }
                None => (data_connection(&target), None),
            };
            shrink_receive_buffer(&s);
            for i in 0..16u64 {
                let mut read = FrameHeader::new(FrameOp::Read, epoch, i, device.id().raw(), i << 20, 1 << 20);
                read.flags = FLAG_LAST;
                if let Some(seal) = seal.as_mut() {
                    read.seal(seal);
                }
                // The target may already have cut this connection (it
                // answers nothing it cannot send): what matters is that
                // the other peer's push below completes.
                if s.write_all(read.as_bytes()).is_err() {
                    break;
                }
            }
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200)); // their READs are staged
    let (with_hostile, took) = gpu_push(&initiator, &segment, local.id(), device.id(), 8 << 20);
    match with_hostile {
        Outcome::Done { bytes } => assert_eq!(bytes, 8 << 20),
        other => panic!("the second peer's push must complete: {other:?}"),
    }
    let mut landed = vec![0u8; 8 << 20];
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { device.read_at(0, &mut landed).unwrap() };
    assert!(landed == common::pattern(8 << 20, 77), "the push landed");
    drop(hostile);
    (alone_took, took)
}

/// The figure (not a pass/fail budget): the same push alone and with the
/// hostile peer, same run.
fn figure(what: &str, (alone, with): (Duration, Duration)) {
    eprintln!(
        "FIGURE staging ({what}): 8 MiB GPU push alone {:.1} ms, with a peer holding staged READs {:.1} ms ({:.2}x)",
        alone.as_secs_f64() * 1e3,
        with.as_secs_f64() * 1e3,
        with.as_secs_f64() / alone.as_secs_f64()
    );
}

#[test]
fn a_proven_peer_holding_staged_read_pages_does_not_stop_another_peers_gpu_push() {
    // Its four connections share one session: one quota of 8 pages.
    figure("token, quota per session", staged_push_against_a_pool_holder(Some(TOKEN)));
}

#[test]
fn a_tokenless_peer_holding_every_staged_page_holds_them_only_until_the_send_deadline() {
    // Without a token each connection is an identity: four hold the whole
    // pool, and the send deadline gives the pages back.
    figure("no token, send deadline", staged_push_against_a_pool_holder(None));
}

// ---- Row 8: another engine's region files handed out as one's own --------

#[test]
fn another_engines_region_files_handed_out_with_every_right_keep_their_owners_rights() {
    // The victim: a local engine with a region it allows no peer to write.
    let victim = common::engine("victim");
    let local_only = RegionInfo::raw().with_access(Access::LOCAL_READ | Access::LOCAL_WRITE);
    let region = victim.alloc_region(4096, local_only).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { region.write_at(0, b"untouched").unwrap() };
    // The hostile peer answers the handshake with the victim's descriptor
    // (its pid, epoch, files), claiming every right.
    let mut lie = kvring::testing::descriptor(&victim);
    lie.name = "liar".into();
    lie.tcp_addr = None;
    lie.cma = None;
    for r in &mut lie.regions {
        r.access = Access::ALL;
    }
    let (addr, server) = common::raw::lying_control_server(&lie, true);
    let initiator = common::engine("initiator");
    let local = initiator.alloc_region(4096, RegionInfo::raw()).unwrap();
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { local.write_at(0, b"OVERWRITE").unwrap() };
    let segment = initiator.open_segment_with(&addr, Some(TransportKind::Shm), WAIT).unwrap();
    server.join().unwrap();
    let outcome = write_all_small(&initiator, &segment, local.id(), region.id());
    match outcome {
        Outcome::Failed(Error::AccessDenied { needs, .. }) => assert_eq!(needs, "remote write"),
        other => panic!("the owner's rights decide, not the descriptor's: {other:?}"),
    }
    let mut bytes = [0u8; 9];
    // SAFETY: no batch in flight touches these bytes while the test reads or writes them.
    unsafe { region.read_at(0, &mut bytes).unwrap() };
    assert_eq!(&bytes, b"untouched");
}

fn write_all_small(engine: &Engine, segment: &Segment, local: RegionId, remote: RegionId) -> Outcome {
    let mut sub = engine.submitter().unwrap();
    let id = sub.submit(&Batch::write(segment).descs(&[BlockDesc::new(local, 0, remote, 0, 4096)])).unwrap();
    sub.wait(id, WAIT).unwrap()
}

#[test]
fn another_engines_files_and_cma_page_handed_out_as_ones_own_are_refused() {
    for (extra, transport) in [(&[][..], TransportKind::Shm), (&["--caller-memory"][..], TransportKind::Cma)] {
        let (mut third, _, descriptor) = common::child::third_engine(extra);
        assert_eq!(descriptor.pid, third.id());
        assert_eq!(
            descriptor.host_id,
            kvring::testing::descriptor(&common::engine("here")).host_id,
            "it answered itself"
        );
        // The liar answers with the third engine's descriptor as its own:
        // its pid, epoch, files and page, every right.
        let mut lie = descriptor.clone();
        lie.name = "liar".into();
        lie.tcp_addr = None;
        for r in &mut lie.regions {
            r.access = Access::ALL;
        }
        let (addr, server) = common::raw::lying_control_server(&lie, true);
        let initiator = common::engine("initiator");
        let error = initiator.open_segment_with(&addr, Some(transport), WAIT).unwrap_err();
        server.join().unwrap();
        assert!(
            error.to_string().contains("another host"),
            "{transport:?}: the pid its descriptor names did not answer: {error}"
        );
        let _ = third.kill();
        let _ = third.wait();
    }
}
