//! What the cases print: a line each (or JSON), and the report.

use super::case::CaseResult;
use super::Options;
use crate::args::format_size;
use kvring::TransportKind;

/// What the case is measured against; `None` when nothing is (tcp to a
/// target whose raw sink is not known).
pub(super) fn baseline_name(options: &Options) -> Option<&'static str> {
    if options.metrics_overhead {
        return Some("metrics-off");
    }
    if options.idle_connections > 0 {
        return Some("no-flood");
    }
    match (options.transport, &options.raw_peer) {
        (TransportKind::Tcp, Some(_)) => Some("raw-tcp"),
        (TransportKind::Tcp, None) => None,
        _ => Some("memcpy"),
    }
}

pub(super) fn print_result(r: &CaseResult, options: &Options) {
    let ratio = r.ratio.map(|spread| spread.median);
    let batches = r.bytes.div_ceil(r.block * options.batch as u64).max(1);
    if options.json {
        let line = serde_json::json!({
            "op": r.op.name(),
            "transport": options.transport.name(),
            "block_bytes": r.block,
            "batch": options.batch,
            "lanes": options.lanes,
            "total_bytes": r.bytes,
            "seconds": r.seconds,
            "gbps": r.gbps,
            "p50_us": r.p50_us,
            "p99_us": r.p99_us,
            "floor_p50_us": r.floor_p50_us,
            "p50_to_floor": r.floor_p50_us.filter(|&f| f > 0.0).map(|f| r.p50_us / f),
            "baseline": baseline_name(options).unwrap_or("none"),
            "baseline_gbps": r.baseline_gbps,
            "ratio": ratio,
            "ratio_low": r.ratio.map(|spread| spread.low),
            "ratio_high": r.ratio.map(|spread| spread.high),
            // Beside the median of the paired ratios: the medians' ratio.
            "ratio_of_medians": r.baseline_gbps.filter(|&b| b > 0.0).map(|b| r.gbps / b),
            "verified": r.verified,
            "metadata_calls": r.metadata_calls,
            "metadata_calls_per_batch": r.metadata_calls as f64 / batches as f64,
        });
        println!("{line}");
    } else {
        // The median of the paired rounds' ratios; `--json` adds their
        // spread (`ratio_low`, `ratio_high`).
        let against = match (baseline_name(options), r.baseline_gbps, ratio) {
            (Some(name), Some(gbps), Some(ratio)) => {
                format!("{name} {gbps:7.2} GB/s  ({:5.1}% of it)", ratio * 100.0)
            }
            _ => format!("{:34}", "no baseline"),
        };
        println!(
            "{:5} {:>6}  {:7.2} GB/s  p50 {:7.2} us  p99 {:7.2} us  {against}  {}",
            r.op.name(),
            format_size(r.block),
            r.gbps,
            r.p50_us,
            r.p99_us,
            if r.verified { "verified" } else { "VERIFY FAILED" }
        );
        if let Some(floor) = r.floor_p50_us.filter(|&f| f > 0.0) {
            println!(
                "      floor: busy-polled raw ping-pong p50 {floor:.2} us; kvring's p50 is {:.2}x it",
                r.p50_us / floor
            );
        }
        if options.metadata.is_some() {
            println!("      metadata: {} requests over {batches} batches (resolved once, at open)", r.metadata_calls);
        }
    }
}

/// `--report DIR`: the cases as the report plots them; prints the paths
/// written (on stderr with `--json`, whose stdout is one line per case).
pub(super) fn write_report(dir: &std::path::Path, results: &[CaseResult], options: &Options) -> Result<(), String> {
    let baseline = baseline_name(options);
    let rows: Vec<crate::report::Row> = results
        .iter()
        .map(|r| crate::report::Row {
            transport: options.transport.name().to_string(),
            op: r.op.name().to_string(),
            block_bytes: r.block,
            gbps: r.gbps,
            p50_us: r.p50_us,
            p99_us: r.p99_us,
            baseline: baseline.zip(r.baseline_gbps).map(|(name, gbps)| (name.to_string(), gbps)),
        })
        .collect();
    let paths = crate::report::write(dir, &rows).map_err(|e| format!("--report {}: {e}", dir.display()))?;
    for path in paths {
        if options.json {
            eprintln!("kvring bench: report: {}", path.display());
        } else {
            println!("report: {}", path.display());
        }
    }
    Ok(())
}
