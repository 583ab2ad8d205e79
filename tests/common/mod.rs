//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod c;
pub mod child;
pub mod fake_peer;
pub mod fakecuda;
pub mod raw;
pub mod verbs;

use kvring::{Engine, EngineBuilder};
use std::time::{Duration, Instant};

/// Every wait in the tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(10);

/// An engine sized for tests: small rings, unpinned (tests run in parallel
/// on two cores), a short busy-poll window.
pub fn builder(name: &str) -> EngineBuilder {
    Engine::builder()
        .name(name)
        .pin(false)
        .busy_poll(Duration::from_micros(200))
        .max_batches_in_flight(64)
        .arena_descs(4096)
}

pub fn engine(name: &str) -> Engine {
    builder(name).build().expect("test engine starts")
}

/// Bytes of a pattern for `seed`, as `Region::fill_pattern` writes them.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    kvring::testing::fill_pattern(&mut bytes, seed);
    bytes
}

/// The `kvring` binary built for these tests.
pub fn kvring_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kvring")
}

/// Waits until every thread of process `pid` is stopped (a group stop
/// reaches the threads one by one, asynchronously).
pub fn wait_until_stopped(pid: u32) {
    let deadline = Instant::now() + WAIT;
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the target runs");
        let all_stopped = tasks.flatten().all(|task| {
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            // The state follows the command name, which is in parentheses.
            stat.rsplit(')').next().and_then(|rest| rest.split_whitespace().next()) == Some("T")
        });
        if all_stopped {
            return;
        }
        assert!(Instant::now() < deadline, "process {pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Submits one batch and waits for its outcome.
pub fn run(sub: &mut kvring::Submitter, batch: &kvring::Batch) -> kvring::Outcome {
    let id = sub.submit(batch).unwrap();
    sub.wait(id, WAIT).unwrap()
}

/// Writes `descs` over `segment` from a fresh submitter, naming `grant`
/// where given, and waits for the outcome.
pub fn push_granted(
    initiator: &Engine,
    segment: &kvring::Segment,
    descs: &[kvring::BlockDesc],
    grant: Option<u32>,
) -> kvring::Outcome {
    let batch = kvring::Batch::write(segment).descs(descs);
    run(&mut initiator.submitter().unwrap(), &grant.map_or(batch.clone(), |g| batch.grant(g)))
}

/// A fence's refusal.
pub fn fenced(outcome: &kvring::Outcome) -> bool {
    matches!(outcome, kvring::Outcome::Failed(kvring::Error::Fenced { .. }))
}

/// A copy of `len` bytes of `region` at `offset`.
pub fn read(region: &kvring::Region, offset: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    unsafe { region.read_at(offset, &mut out).unwrap() };
    out
}

/// Asserts that each metadata URL is refused with an error that says why.
pub fn assert_urls_refused(cases: &[(&str, &str)]) {
    for (url, why) in cases {
        let error = kvring::MetadataMode::parse(url).unwrap_err().to_string();
        assert!(error.contains(why), "{url}: {error}");
    }
}

/// Submits each batch of `parts` in turn under arrival `tag` to `segment`,
/// waits until the target's own count reaches every byte sent so far (no
/// more), then for the batch; returns each batch's outcome.
pub fn land_in_turn(
    sub: &mut kvring::Submitter,
    segment: &kvring::Segment,
    target: &Engine,
    tag: u32,
    parts: &[&[kvring::BlockDesc]],
) -> Vec<kvring::Outcome> {
    let mut expected = 0;
    let mut outcomes = Vec::new();
    for descs in parts {
        let id = sub.submit(&kvring::Batch::write(segment).descs(descs).arrival_tag(tag)).unwrap();
        expected += descs.iter().map(|d| d.len).sum::<u64>();
        target.wait_landed(tag, expected, WAIT).unwrap();
        outcomes.push(sub.wait(id, WAIT).unwrap());
        assert_eq!(target.landed(tag), expected, "bytes counted twice");
    }
    outcomes
}

/// Runs `kvring bench --json` with `args` (4 MiB regions and 10 latency
/// samples unless `args` says otherwise); asserts that it succeeded and
/// printed `cases` lines, each with every one of `fields`; returns them.
pub fn bench_json(args: &[&str], cases: usize, fields: &[&str]) -> Vec<String> {
    let output = std::process::Command::new(kvring_bin())
        .args(["bench", "--total", "4MiB", "--region-size", "4MiB", "--latency-samples", "10", "--json"])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "bench failed: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
    let lines: Vec<String> = stdout.lines().map(str::to_string).collect();
    assert_eq!(lines.len(), cases, "{stdout}");
    for line in &lines {
        for field in fields {
            assert!(line.contains(field), "{field} missing in {line}");
        }
    }
    lines
}

/// A vLLM-style KV cache in GPU 0's memory: one region per layer and kind
/// (K and V, or MLA's one latent), each filled with a pattern from `seed`,
/// published as `engine`'s layout.
pub fn gpu_kv_cache(
    engine: &Engine,
    shape: kvring::kv::CacheShape,
    seed: u64,
) -> (Vec<kvring::Region>, kvring::kv::KvLayout) {
    use kvring::kv::{KvBuffer, KvLayout};
    let mut regions = Vec::new();
    let mut layers = Vec::new();
    for layer in 0..shape.layers {
        let mut buffers = Vec::new();
        for (kind, block_bytes) in shape.kinds() {
            let info = kvring::RegionInfo::raw().on_gpu(0).with_kind(kind).with_layer(layer);
            let region = engine.alloc_region((block_bytes * shape.blocks) as usize, info).unwrap();
            // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
            unsafe { region.fill_pattern(seed + regions.len() as u64) };
            buffers.push(KvBuffer { kind, region: region.id(), offset: 0, block_bytes });
            regions.push(region);
        }
        layers.push(buffers);
    }
    let layout = KvLayout::from_buffers(shape, layers).unwrap();
    engine.set_kv_layout(layout.clone()).unwrap();
    (regions, layout)
}

/// Makes `pidfd_getfd` fail with EPERM in this process from now on, as
/// Docker's default seccomp profile does without CAP_SYS_PTRACE: a seccomp
/// filter (seccomp(2), `SECCOMP_MODE_FILTER`) that answers syscall 438
/// (`pidfd_getfd` in the generic table, x86_64's and aarch64's) so and
/// allows every other.
pub fn refuse_pidfd_getfd() {
    const PIDFD_GETFD: u32 = 438;
    let program = [
        libc::sock_filter { code: 0x20, jt: 0, jf: 0, k: 0 }, // ld [nr]
        libc::sock_filter { code: 0x15, jt: 0, jf: 1, k: PIDFD_GETFD }, // jeq 438
        libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x0005_0000 | libc::EPERM as u32 }, // ret ERRNO
        libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x7fff_0000 }, // ret ALLOW
    ];
    let filter = libc::sock_fprog { len: program.len() as u16, filter: program.as_ptr() as *mut libc::sock_filter };
    // SAFETY: prctl with plain integers, then with a filter program that
    // outlives the call (the kernel copies it).
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &filter as *const libc::sock_fprog), 0);
    }
    // SAFETY: a syscall with integer arguments only.
    let taken = unsafe { libc::syscall(PIDFD_GETFD as libc::c_long, -1, 0, 0) };
    let error = std::io::Error::last_os_error().raw_os_error();
    assert_eq!((taken, error), (-1, Some(libc::EPERM)), "pidfd_getfd is refused here, as in a container");
}
