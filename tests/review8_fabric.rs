//! Hostile review 8: FABRIC-only GPU memory over cuda_ipc (GPU-REVIEW #16,
//! issue 28). Each test is one probe, played by a hostile exporter on the
//! opener's side of the GPU descriptor socket (`kvring::testing::gpu_fds`),
//! or on a simulated GPU, asserting what docs/SECURITY.md promises: an
//! answer that breaks the protocol is `MalformedMessage` and shuts the
//! connection, so nothing left behind it is ever taken as a later answer;
//! no descriptor that came with a refused answer stays open; a fabric
//! handle's bytes never show in `Debug`; every wait has a deadline.
//! The probes on the CUDA provider need the fake driver on the library
//! path (`.ci/stage-fakecuda.sh` runs this file so, with
//! `FAKECUDA_REQUIRED=1`); elsewhere they say so and pass.

mod common;

use common::fakecuda::Fake;
use kvring::gpu::{CudaGpu, IpcHandle};
use kvring::gpu::{Gpu, HandleKind, Shareable, SimGpu};
use kvring::testing::gpu_fds::{answer, Opener};
use kvring::{Error, RegionId};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// Bytes of a `CUmemFabricHandle`.
const FABRIC: usize = kvring::gpu::FABRIC_HANDLE_BYTES;
/// The fence table request's `handles` (`gpu_fds::FENCE_TABLE`).
const FENCE_TABLE: u32 = u32::MAX;
/// Long enough for any honest step here; the tests assert typed errors,
/// never a time.
const WAIT: Duration = Duration::from_secs(10);

const REGION: RegionId = RegionId::new(0, 1);

/// A memfd named `name` (so a leaked copy can be found in /proc/self/fd).
fn memfd(name: &std::ffi::CStr) -> OwnedFd {
    // SAFETY: memfd_create with a NUL-terminated name; owned at once.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh descriptor nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// How many descriptors of this process are memfds named `name`.
fn open_memfds(name: &str) -> usize {
    let wanted = format!("/memfd:{name} (deleted)");
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|link| link.to_string_lossy() == wanted)
        .count()
}

/// Sends `bytes` with `fds` attached (`SCM_RIGHTS`), as one message.
fn send_with_fds(stream: &UnixStream, bytes: &[u8], fds: &[RawFd]) {
    let mut control = vec![0u64; 64];
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut _, iov_len: bytes.len() };
    // SAFETY: an all-zero msghdr is valid; its pointers are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is arithmetic.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
    // SAFETY: `control` is large enough for one SCM_RIGHTS header of `fds`.
    unsafe {
        let header = libc::CMSG_FIRSTHDR(&msg);
        (*header).cmsg_level = libc::SOL_SOCKET;
        (*header).cmsg_type = libc::SCM_RIGHTS;
        (*header).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as usize;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(header).cast::<RawFd>(), fds.len());
    }
    // SAFETY: `msg` points at `bytes` and `control`, alive here.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, 0) };
    assert_eq!(sent, bytes.len() as isize, "{}", std::io::Error::last_os_error());
}

/// A fabric answer of `count` of `handles`, with `count` handles of `fill`.
fn fabric_answer(count: u32, handles: u32, fill: u8) -> Vec<u8> {
    let mut bytes = answer(2, count, handles);
    bytes.extend(std::iter::repeat_n(fill, count as usize * FABRIC));
    bytes
}

/// An opener over one end of a pair; the other end is the exporter's.
fn pair(deadline: Instant) -> (Opener, UnixStream) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    (Opener::over(ours, deadline), theirs)
}

/// Probe 1, the fence-table path: an answer carrying more descriptors than
/// the one asked for is `MalformedMessage`, the descriptors are closed,
/// and the connection is shut, so a FABRIC answer the exporter queued
/// behind it is never taken for the region's handles (cuda_ipc goes on
/// with the same connection after a region's fence page fails).
#[test]
fn probe1_a_fence_answer_with_extra_descriptors_is_malformed_and_shuts_the_connection() {
    let (mut opener, exporter) = pair(Instant::now() + WAIT);
    let (a, b) = (memfd(c"review8-fence"), memfd(c"review8-fence"));
    send_with_fds(&exporter, &answer(0, 1, FENCE_TABLE), &[a.as_raw_fd(), b.as_raw_fd()]);
    drop((a, b));
    // Queued before the opener asks: an answer out of step.
    (&exporter).write_all(&fabric_answer(1, 1, 0x5a)).unwrap();
    let error = opener.fence(REGION).unwrap_err();
    assert!(matches!(error, Error::Malformed { .. }), "a protocol break, typed as such: {error:?}");
    assert_eq!(open_memfds("review8-fence"), 0, "a descriptor of the refused answer stayed open");
    let next = opener.handle(REGION, HandleKind::Fabric, 1, 0);
    assert!(next.is_err(), "bytes left behind a broken answer were taken as the next one: {next:?}");
}

/// Probe 1: a FABRIC answer that comes with descriptors is refused before
/// its handles are read, and the descriptors are closed.
#[test]
fn probe1_descriptors_arriving_with_a_fabric_answer_are_refused_and_closed() {
    let (mut opener, exporter) = pair(Instant::now() + WAIT);
    let fd = memfd(c"review8-with-fabric");
    send_with_fds(&exporter, &fabric_answer(1, 1, 0x11), &[fd.as_raw_fd()]);
    drop(fd);
    let error = opener.handle(REGION, HandleKind::Fabric, 1, 0).unwrap_err();
    assert!(matches!(error, Error::Malformed { .. }), "{error:?}");
    assert_eq!(open_memfds("review8-with-fabric"), 0, "a descriptor of the refused answer stayed open");
}

/// Probe 1: descriptors attached to the handle bytes after a FABRIC
/// answer (where no descriptor is read) never stay open in the opener.
#[test]
fn probe1_descriptors_riding_on_fabric_handle_bytes_are_never_kept() {
    let (mut opener, exporter) = pair(Instant::now() + WAIT);
    (&exporter).write_all(&answer(2, 2, 2)).unwrap();
    let fd = memfd(c"review8-riding");
    send_with_fds(&exporter, &[0x22; 2 * FABRIC], &[fd.as_raw_fd()]);
    drop(fd);
    for index in 0..2 {
        match opener.handle(REGION, HandleKind::Fabric, 2, index) {
            Ok(Shareable::Fabric(bytes)) => assert_eq!(bytes, [0x22; FABRIC]),
            other => panic!("handle {index}: {other:?}"),
        }
    }
    assert_eq!(open_memfds("review8-riding"), 0, "a descriptor riding on handle bytes stayed open");
}

/// Probe 1, deadlines: an exporter that states two handles and sends one
/// leaves the opener a typed `Timeout` at its deadline, and the rest,
/// sent late with a well-formed answer after it, is never taken.
#[test]
fn probe1_a_stalled_fabric_run_times_out_and_nothing_sent_late_is_taken() {
    let (mut opener, exporter) = pair(Instant::now() + Duration::from_millis(300));
    let mut bytes = answer(2, 2, 2);
    bytes.extend_from_slice(&[1; FABRIC]);
    (&exporter).write_all(&bytes).unwrap();
    let error = opener.handle(REGION, HandleKind::Fabric, 2, 0).unwrap_err();
    assert!(matches!(error, Error::Timeout { .. }), "{error:?}");
    // The opener shut the connection: these may find it closed.
    let _ = (&exporter).write_all(&[1; FABRIC]);
    let _ = (&exporter).write_all(&fabric_answer(1, 2, 3));
    assert!(opener.handle(REGION, HandleKind::Fabric, 2, 1).is_err());
    assert!(opener.handle(REGION, HandleKind::Fabric, 2, 0).is_err());
}

/// Probe 3: a fabric handle is a capability in bytes; neither a handle nor
/// an opener holding fetched ones shows them in `Debug`.
#[test]
fn probe3_debug_never_shows_fabric_handle_bytes() {
    let (mut opener, exporter) = pair(Instant::now() + WAIT);
    // 0xa7 = 167: a run of it would show as "167, 167" or "a7a7".
    (&exporter).write_all(&fabric_answer(2, 2, 0xa7)).unwrap();
    let first = opener.handle(REGION, HandleKind::Fabric, 2, 0).unwrap();
    for shown in [format!("{first:?}"), format!("{opener:?}"), format!("{first:#?}"), format!("{opener:#?}")] {
        // A run of the byte, however `{:#?}` breaks its lines; not a lone
        // "167" (the opener's deadline, an `Instant`, may show one in its
        // nanoseconds).
        let packed: String = shown.chars().filter(|c| !c.is_whitespace()).collect::<String>().to_lowercase();
        assert!(!packed.contains("167,167") && !packed.contains("a7a7"), "{shown}");
    }
}

/// Probe 7: a KVF6 exporter refuses this opener's KVF7 request by name:
/// the opener returns that refusal, quoted, as a device error (not a
/// protocol break, and not a hang until the deadline).
#[test]
fn probe7_an_older_exporters_refusal_is_quoted_by_the_opener() {
    let (mut opener, exporter) = pair(Instant::now() + WAIT);
    let reason = "a KVF7 GPU descriptor request; this engine serves KVF6 only (update the opener's kvring)";
    let mut bytes = answer(1, reason.len() as u32, 0);
    bytes.extend_from_slice(reason.as_bytes());
    (&exporter).write_all(&bytes).unwrap();
    let error = opener.handle(REGION, HandleKind::Fabric, 1, 0).unwrap_err();
    assert!(matches!(error, Error::Gpu { .. }), "{error:?}");
    assert!(error.to_string().contains(reason), "{error}");
}

/// A simulated GPU's export of 2 pieces, its handles marked `kind`.
fn sim_handles(kinds: [HandleKind; 2]) -> Vec<kvring::gpu::IpcHandle> {
    let gpu = SimGpu::new(1, Duration::ZERO);
    let ptr = gpu.alloc_pieces(0, 4096, 2).unwrap();
    let mut handles = gpu.export(ptr.0, 2 * 4096).unwrap().handles().to_vec();
    for (handle, kind) in handles.iter_mut().zip(kinds) {
        handle.kind = kind;
    }
    handles
}

/// Probe 4: a simulated GPU can open no FABRIC handle, so it refuses an
/// export of them before it fetches any (each fetch is a capability the
/// exporter hands out), naming why.
#[test]
fn probe4_a_simulated_gpu_refuses_fabric_handles_before_fetching_one() {
    let handles = sim_handles([HandleKind::Fabric; 2]);
    let opener = SimGpu::new(1, Duration::ZERO);
    let mut asked = 0;
    let error = opener
        .open(&handles, &mut |_| {
            asked += 1;
            Ok(Shareable::Fabric([0; FABRIC]))
        })
        .unwrap_err();
    assert!(error.to_string().contains("FABRIC"), "{error}");
    assert_eq!(asked, 0, "a FABRIC handle fetched that the simulator can never open");
}

/// Probe 4: kinds mixed within one export are refused before anything is
/// fetched.
#[test]
fn probe4_mixed_kinds_in_one_export_are_refused_before_fetching() {
    let handles = sim_handles([HandleKind::Fabric, HandleKind::FileDescriptor]);
    let opener = SimGpu::new(1, Duration::ZERO);
    let mut asked = 0;
    let error = opener
        .open(&handles, &mut |_| {
            asked += 1;
            Err(Error::Unsupported { what: "nothing".into() })
        })
        .unwrap_err();
    assert!(error.to_string().contains("different kinds"), "{error}");
    assert_eq!(asked, 0);
}

/// Held by each probe on the fake: they count the fake's allocations, so
/// they run one at a time.
static ON_THE_FAKE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The CUDA provider on the fake driver (this probe alone on it), or
/// `None` (saying why) where the library is not the fake and nobody
/// required it.
fn fake_gpu() -> Option<(CudaGpu, Fake, std::sync::MutexGuard<'static, ()>)> {
    let alone = ON_THE_FAKE.lock().unwrap_or_else(|p| p.into_inner());
    match (CudaGpu::load(), Fake::find()) {
        (Ok(gpu), Some(fake)) => Some((gpu, fake, alone)),
        (loaded, _) => {
            let required = std::env::var("FAKECUDA_REQUIRED").is_ok_and(|v| v == "1");
            assert!(!required, "FAKECUDA_REQUIRED=1 but the fake driver is not loaded: {:?}", loaded.err());
            eprintln!("skipped: the fake CUDA driver is not on LD_LIBRARY_PATH (bash .ci/stage-fakecuda.sh runs this)");
            None
        }
    }
}

/// Two FABRIC handles of 2 MiB each, as a peer's descriptor states them
/// (their bytes name the allocations by address; no GPU UUID).
fn fabric_handles() -> Vec<IpcHandle> {
    let piece = IpcHandle { kind: HandleKind::Fabric, bytes: [0; 64], offset: 0, len: 2 << 20 };
    vec![piece; 2]
}

/// Probes 2 and 6 on the CUDA provider: what a hostile exporter passes
/// for FABRIC handles (bytes that are no fabric handle; a descriptor
/// instead of one) fails the open as a device error, not `Unauthorized`
/// (which says the IMEX channel is wrong, sending an operator to fix the
/// wrong thing), and never a panic; nothing imported stays held.
#[test]
fn probe2_probe6_a_hostile_exporters_fabric_bytes_fail_as_a_device_error() {
    let Some((gpu, fake, _alone)) = fake_gpu() else { return };
    let before = fake.stat("allocations");
    let handles = fabric_handles();
    let mut asked = Vec::new();
    let error = gpu
        .open(&handles, &mut |i| {
            asked.push(i);
            Ok(Shareable::Fabric([0xee; FABRIC]))
        })
        .unwrap_err();
    assert!(matches!(error, Error::Gpu { .. }), "garbage bytes are no channel problem: {error:?}");
    assert!(error.to_string().contains("FABRIC"), "{error}");
    assert_eq!(asked, [0], "nothing asked past the first failure");
    let fd = memfd(c"review8-fd-for-fabric");
    let mut once = Some(Shareable::Fd(fd));
    let error =
        gpu.open(&handles, &mut |_| once.take().ok_or(Error::Unsupported { what: "twice".into() })).unwrap_err();
    assert!(matches!(error, Error::Gpu { .. }), "{error:?}");
    assert!(error.to_string().contains("FileDescriptor handle for a Fabric one"), "{error}");
    assert_eq!(open_memfds("review8-fd-for-fabric"), 0, "the descriptor passed in place of a handle stayed open");
    assert_eq!(fake.stat("allocations"), before, "an allocation left imported");
}

/// Bytes of each FABRIC-only allocation the probes make (the fake's
/// granularity is 2 MiB).
const PIECE: usize = 2 << 20;

/// Probes 2 and 5 on the CUDA provider (with an IMEX channel): a FABRIC
/// handle opened as a larger allocation than it is fails, nothing mapped;
/// and the exporter makes a FABRIC handle only for memory still mapped as
/// it exported it.
#[test]
fn probe2_probe5_fabric_handles_open_only_at_their_size_and_are_made_only_for_memory_still_there() {
    let Some((gpu, fake, _alone)) = fake_gpu() else { return };
    if std::env::var("FAKECUDA_IMEX_CHANNEL").is_err() {
        let required = std::env::var("FAKECUDA_REQUIRED").is_ok_and(|v| v == "1");
        assert!(!required, "run with FAKECUDA_IMEX_CHANNEL set (.ci/stage-fakecuda.sh does)");
        return;
    }
    let at = fake.fabric_run(1, PIECE);
    let export = gpu.export(at, PIECE as u64).unwrap();
    let handle = export.handles()[0];
    assert_eq!((export.handles().len(), handle.kind), (1, HandleKind::Fabric));
    let Some(Shareable::Fabric(bytes)) = gpu.share(&handle).unwrap() else { panic!("a FABRIC handle") };
    let before = fake.stat("allocations");
    // The descriptor says twice the allocation the handle names.
    let larger = IpcHandle { len: 2 * PIECE as u64, ..handle };
    let error = gpu.open(&[larger], &mut |_| Ok(Shareable::Fabric(bytes))).unwrap_err();
    assert!(matches!(error, Error::Gpu { .. }), "{error:?}");
    assert_eq!(fake.stat("allocations"), before, "an import left held");
    // The application unmaps it: nothing more is shared from it.
    type Unmap = unsafe extern "C" fn(u64, usize) -> u32;
    let unmap: Unmap = fake.function(c"cuMemUnmap");
    // SAFETY: the whole mapping made above, which nothing else uses.
    assert_eq!(unsafe { unmap(at, PIECE) }, 0);
    let error = gpu.share(&handle).unwrap_err();
    assert!(error.to_string().contains("is no longer the device memory this process exported"), "{error}");
}
