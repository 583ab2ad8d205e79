//! `kvring bench --duration 60s`: a soak. It keeps submitting batches until
//! the time is up; peer errors do not stop it. Each failure is an event
//! (with `--json`, one line each), so is the first success after failures,
//! and at the end it verifies, on the target, every batch it reported done
//! since the target's last start (a restarted target starts empty).

use kvring::{Batch, BlockDesc, Engine, Outcome, Region, RegionInfo, Segment, TransportKind};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// First pause between attempts while the peer is unreachable; it doubles
/// with each failure in a row, up to [`MAX_RETRY_PAUSE`].
const RETRY_PAUSE: Duration = Duration::from_millis(10);
/// Longest pause between attempts: it bounds how late the soak notices a
/// restarted target (issue 32: within 100 ms of its listening, worst
/// case), while a refused connect costs the target nothing.
const MAX_RETRY_PAUSE: Duration = Duration::from_millis(40);
/// Deadline of one open (handshake and connects) during the soak.
const OPEN_TIMEOUT: Duration = Duration::from_millis(500);
/// Deadline of one batch's wait.
const WAIT_TIMEOUT: Duration = Duration::from_secs(5);

/// What the soak moves.
pub struct SoakPlan<'a> {
    /// Peer name or control address.
    pub peer: &'a str,
    /// Transport to use.
    pub transport: TransportKind,
    /// Bytes per block.
    pub block: u64,
    /// Blocks per batch.
    pub batch: usize,
    /// Largest region to use.
    pub region_bytes: u64,
    /// How long to keep going.
    pub duration: Duration,
    /// JSON event lines instead of text.
    pub json: bool,
}

struct Tally {
    started: Instant,
    json: bool,
    failures: BTreeMap<&'static str, u64>,
    recoveries: u64,
    outage_since: Option<Instant>,
    /// Failures in a row, for the backoff.
    in_a_row: u32,
}

impl Tally {
    /// Records a failure (an event line) and waits before the next attempt:
    /// nothing a peer does ends the soak early.
    fn failure(&mut self, stage: &str, error: &kvring::Error) {
        self.event(stage, error.code().as_str_name(), &error.to_string());
    }

    fn event(&mut self, stage: &str, kind: &'static str, detail: &str) {
        *self.failures.entry(kind).or_default() += 1;
        self.outage_since.get_or_insert_with(Instant::now);
        let t_ms = self.started.elapsed().as_millis();
        if self.json {
            let unix_ms = unix_ms();
            println!(
                "{{\"event\":\"failure\",\"stage\":\"{stage}\",\"kind\":\"{kind}\",\"t_ms\":{t_ms},\"unix_ms\":{unix_ms}}}"
            );
        } else {
            println!("{t_ms:>8} ms  {stage} failed: {detail}");
        }
        let pause = RETRY_PAUSE.saturating_mul(1 << self.in_a_row.min(4)).min(MAX_RETRY_PAUSE);
        self.in_a_row += 1;
        std::thread::sleep(pause);
    }

    fn success(&mut self) {
        self.in_a_row = 0;
        if let Some(since) = self.outage_since.take() {
            self.recoveries += 1;
            let t_ms = self.started.elapsed().as_millis();
            let outage_ms = since.elapsed().as_millis();
            if self.json {
                let unix_ms = unix_ms();
                println!("{{\"event\":\"recovered\",\"t_ms\":{t_ms},\"outage_ms\":{outage_ms},\"unix_ms\":{unix_ms}}}");
            } else {
                println!("{t_ms:>8} ms  recovered after {outage_ms} ms");
            }
        }
    }
}

/// Wall-clock milliseconds since the Unix epoch, so that a harness in
/// another process (benches/soak_recovery.py) can put an event beside the
/// moment it saw a restarted target listen.
fn unix_ms() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

/// Runs the soak; fails only when the final verification does.
pub fn run(engine: &Engine, plan: &SoakPlan<'_>) -> Result<(), String> {
    let mut tally = Tally {
        started: Instant::now(),
        json: plan.json,
        failures: BTreeMap::new(),
        recoveries: 0,
        outage_since: None,
        in_a_row: 0,
    };
    let mut sub = engine.submitter().map_err(|e| e.to_string())?;
    let mut segment: Option<Segment> = None;
    let mut local: Option<Region> = None;
    let mut region_blocks = 0u64;
    let mut epoch = 0u64;
    let mut written_since_start = 0u64;
    let mut batches_done = 0u64;
    let mut descs = Vec::with_capacity(plan.batch);
    while tally.started.elapsed() < plan.duration {
        let current = match &segment {
            Some(s) if !s.is_closed() => s.clone(),
            _ => match engine.open_segment_with(plan.peer, Some(plan.transport), OPEN_TIMEOUT) {
                Ok(opened) => {
                    let remote_len = opened.regions().first().map_or(0, |r| r.len);
                    let bytes = plan.region_bytes.min(remote_len);
                    if local.as_ref().is_none_or(|l| (l.len() as u64) < bytes) {
                        let region = engine
                            .alloc_region(bytes.max(plan.block) as usize, RegionInfo::raw())
                            .map_err(|e| e.to_string())?;
                        // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
                        unsafe { region.fill_pattern(0x50a6) };
                        local = Some(region);
                    }
                    region_blocks = (bytes / plan.block).max(1);
                    if opened.epoch() != epoch {
                        // A new start of the target: its memory is new.
                        epoch = opened.epoch();
                        written_since_start = 0;
                    }
                    segment = Some(opened.clone());
                    opened
                }
                Err(error) => {
                    tally.failure("open", &error);
                    continue;
                }
            },
        };
        let Some(remote) = current.regions().first().map(|r| r.id) else {
            // A restarted target whose control port is up before its region
            // is registered: a passing state. The next open asks it again.
            segment = None;
            tally.event("open", "HALF_STARTED", &format!("{} exposes no region yet", current.name()));
            continue;
        };
        let local_region = local.as_ref().expect("allocated at the first open");
        descs.clear();
        for i in 0..plan.batch as u64 {
            let offset = ((written_since_start + i) % region_blocks) * plan.block;
            descs.push(BlockDesc::new(local_region.id(), offset, remote, offset, plan.block));
        }
        let outcome = sub.submit(&Batch::write(&current).descs(&descs)).and_then(|id| sub.wait(id, WAIT_TIMEOUT));
        match outcome {
            Ok(Outcome::Done { .. }) => {
                batches_done += 1;
                written_since_start += plan.batch as u64;
                tally.success();
            }
            Ok(Outcome::Failed(error)) | Err(error) => {
                if matches!(error, kvring::Error::PeerRestarted { .. }) || current.is_stale() {
                    segment = None;
                }
                tally.failure("batch", &error);
            }
            Ok(other) => {
                if current.is_stale() {
                    segment = None;
                }
                let kind = if matches!(other, Outcome::Cancelled { .. }) { "CANCELLED" } else { "TIMEOUT" };
                tally.event("batch", kind, &format!("ended {other:?}"));
            }
        }
    }
    // Verify, on the target, what was reported done since its last start.
    let covered_blocks = written_since_start.min(region_blocks);
    let (covered, verified) =
        verify_on_target(engine, plan, segment, local.as_ref(), epoch, covered_blocks * plan.block);
    if let Err(reason) = &verified {
        eprintln!("kvring bench: soak verification: {reason}");
    }
    let verified = verified.is_ok();
    print_summary(plan, &tally, batches_done, covered, verified);
    if verified {
        Ok(())
    } else {
        Err("soak verification failed: a batch reported done is not on the target".into())
    }
}

/// Checks on the target that the `covered` bytes written since its last
/// start are there (reopening it if the last batch failed): the bytes
/// actually checked (0 when the target restarted since), and the verdict.
fn verify_on_target(
    engine: &Engine,
    plan: &SoakPlan<'_>,
    mut segment: Option<Segment>,
    local: Option<&Region>,
    epoch: u64,
    covered: u64,
) -> (u64, Result<(), String>) {
    let mut covered = covered;
    let mut reopen_error = None;
    if segment.is_none() && covered > 0 {
        // The last batch failed: reopen to check what was done before it.
        match engine.open_segment_with(plan.peer, Some(plan.transport), OPEN_TIMEOUT) {
            Ok(opened) if opened.epoch() == epoch => segment = Some(opened),
            // Restarted again since: what it held is gone with it.
            Ok(_) => covered = 0,
            Err(error) => reopen_error = Some(error),
        }
    }
    let verified = match (&segment, local) {
        _ if covered == 0 => Ok(()),
        (None, _) if reopen_error.is_some() => {
            Err(format!("reopening the target to verify: {}", reopen_error.take().expect("checked")))
        }
        (Some(segment), Some(local)) => compare(segment, local, covered),
        _ => Err("no segment or local region to verify with".to_string()),
    };
    (covered, verified)
}

/// The target's checksum of its first region's first `covered` bytes
/// against this side's.
fn compare(segment: &Segment, local: &Region, covered: u64) -> Result<(), String> {
    let remote = segment.regions().first().map(|r| r.id).ok_or("the target exposes no region to verify")?;
    // SAFETY: no batch or peer touches these bytes during the copy (none naming them is in flight).
    let expected = unsafe { local.checksum(0, covered as usize) }.map_err(|e| e.to_string())?;
    match segment.remote_checksum(remote, 0, covered, Duration::from_secs(10)) {
        Ok(actual) if actual == expected => Ok(()),
        Ok(_) => Err("a batch reported done is not on the target".to_string()),
        Err(error) => Err(format!("reading the target's checksum: {error}")),
    }
}

/// The soak's last line (JSON with `--json`).
fn print_summary(plan: &SoakPlan<'_>, tally: &Tally, batches_done: u64, covered: u64, verified: bool) {
    let failures: Vec<String> = tally.failures.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
    let seconds = tally.started.elapsed().as_secs_f64();
    if plan.json {
        println!(
            "{{\"event\":\"summary\",\"seconds\":{seconds:.3},\"batches_done\":{batches_done},\"failures\":{{{}}},\"recoveries\":{},\"verified_bytes\":{covered},\"verified\":{verified}}}",
            failures.join(","),
            tally.recoveries
        );
    } else {
        println!(
            "soak: {seconds:.1} s, {batches_done} batches done, failures {{{}}}, {} recoveries, {} verified on the target: {}",
            failures.join(", "),
            tally.recoveries,
            crate::args::format_size(covered),
            if verified { "ok" } else { "MISMATCH" }
        );
    }
}
