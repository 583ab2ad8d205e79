//! `kvring bench --report DIR`: the measured rows as `bench.json` plus one chart
//! per transport (`bench-<transport>.svg`).
//!
//! The charts are hand-written SVG rather than the output of a plotting crate:
//! they are two small line plots, plain SVG text keeps the dependency tree as it
//! is, and it renders the same in a browser and on GitHub.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// One measured case, as the report plots it.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Transport under test (e.g. `tcp`, `shm`); each gets its own chart.
    pub transport: String,
    /// Operation (e.g. `write`, `read`); each gets its own line and colour.
    pub op: String,
    /// Block size in bytes: the x axis.
    pub block_bytes: u64,
    /// Measured throughput in GB/s.
    pub gbps: f64,
    /// Median latency in microseconds.
    pub p50_us: f64,
    /// 99th-percentile latency in microseconds.
    pub p99_us: f64,
    /// Same-run baseline: (baseline name, its GB/s in the same run).
    pub baseline: Option<(String, f64)>,
}

/// Writes DIR/bench.json and one SVG per transport (DIR/bench-<transport>.svg); returns the paths written.
///
/// DIR is created if missing. Zero, negative and non-finite measurements are
/// left out of the charts (they would break a log scale or draw a false dip)
/// but kept in the JSON, where non-finite numbers become `null`.
pub fn write(dir: &Path, rows: &[Row]) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating report directory {}: {e}", dir.display()))?;
    let json_path = dir.join("bench.json");
    let json = serde_json::to_string_pretty(&rows_json(rows))
        .map_err(|e| format!("serializing {}: {e}", json_path.display()))?;
    write_file(&json_path, &(json + "\n"))?;
    let mut written = vec![json_path];
    let mut used_names = Vec::new();
    for (transport, group) in group_by_transport(rows) {
        let path = dir.join(svg_file_name(transport, &mut used_names));
        write_file(&path, &render_chart(transport, &group))?;
        written.push(path);
    }
    Ok(written)
}

fn write_file(path: &Path, contents: &str) -> Result<(), String> {
    std::fs::write(path, contents).map_err(|e| format!("writing {}: {e}", path.display()))
}

fn rows_json(rows: &[Row]) -> Value {
    // `json!` turns NaN and infinities into null, so the file stays valid JSON.
    let items = rows.iter().map(|r| {
        let (name, gbps) = match &r.baseline {
            Some((name, gbps)) => (Some(name.as_str()), Some(*gbps)),
            None => (None, None),
        };
        json!({
            "transport": r.transport,
            "op": r.op,
            "block_bytes": r.block_bytes,
            "gbps": r.gbps,
            "p50_us": r.p50_us,
            "p99_us": r.p99_us,
            "baseline": name,
            "baseline_gbps": gbps,
        })
    });
    Value::Array(items.collect())
}

/// Rows grouped by transport, in order of first appearance (the order they were run).
fn group_by_transport(rows: &[Row]) -> Vec<(&str, Vec<&Row>)> {
    let mut groups: Vec<(&str, Vec<&Row>)> = Vec::new();
    for row in rows {
        match groups.iter_mut().find(|(t, _)| *t == row.transport) {
            Some((_, group)) => group.push(row),
            None => groups.push((&row.transport, vec![row])),
        }
    }
    groups
}

/// `bench-<transport>.svg`, with characters unsafe in a file name replaced, and a
/// numeric suffix if two transports end up with the same name.
fn svg_file_name(transport: &str, used: &mut Vec<String>) -> String {
    let safe: String =
        transport.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    let mut name = format!("bench-{safe}.svg");
    let mut n = 2;
    while used.contains(&name) {
        name = format!("bench-{safe}-{n}.svg");
        n += 1;
    }
    used.push(name.clone());
    name
}

// ---------------------------------------------------------------------------
// Layout, in SVG user units.

const MARGIN_LEFT: f64 = 80.0;
const PANEL_W: f64 = 440.0;
const PANEL_H: f64 = 300.0;
const PANEL_GAP: f64 = 110.0;
const TOP: f64 = 80.0;
const WIDTH: f64 = MARGIN_LEFT + PANEL_W + PANEL_GAP + PANEL_W + 30.0;
/// From the plot bottom to the first legend row: tick labels and the axis title.
const LEGEND_OFFSET: f64 = 66.0;
const LEGEND_ROW: f64 = 18.0;
const FOOTNOTE: &str = "same-run baseline; higher is better (left), lower is better (right)";

/// Fixed colours, so an op looks the same in every chart and every run.
fn op_color(op: &str) -> &'static str {
    const OTHERS: [&str; 6] = ["#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f"];
    match op {
        "write" => "#1f77b4",
        "read" => "#d62728",
        // FNV-1a: stable across runs and Rust versions, unlike the std hasher.
        _ => {
            let hash =
                op.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
            OTHERS[(hash % OTHERS.len() as u64) as usize]
        }
    }
}

/// The whole chart for one transport.
fn render_chart(transport: &str, rows: &[&Row]) -> String {
    let mut ops: Vec<&str> = Vec::new();
    for row in rows {
        if !ops.contains(&row.op.as_str()) {
            ops.push(&row.op);
        }
    }
    let x = block_axis(rows);
    let throughput = throughput_series(rows, &ops);
    let latency = latency_series(rows, &ops);
    let y_left = linear_axis(all_y(&throughput), "throughput (GB/s)");
    let y_right = latency_axis(all_y(&latency));
    let left = Panel { x0: MARGIN_LEFT, title: "Throughput", x: &x, y: &y_left, series: &throughput };
    let right = Panel { x0: MARGIN_LEFT + PANEL_W + PANEL_GAP, title: "Latency", x: &x, y: &y_right, series: &latency };
    let legend_rows = throughput.len().max(latency.len()).div_ceil(2) as f64;
    let height = TOP + PANEL_H + LEGEND_OFFSET + legend_rows * LEGEND_ROW + 30.0;

    let mut svg = Svg::new(WIDTH, height);
    svg.text(
        WIDTH / 2.0,
        32.0,
        &format!("kvring bench — {transport}"),
        r#"text-anchor="middle" font-size="20" font-weight="bold""#,
    );
    left.draw(&mut svg);
    right.draw(&mut svg);
    svg.text(WIDTH / 2.0, height - 12.0, FOOTNOTE, r##"text-anchor="middle" font-size="11" fill="#555""##);
    svg.finish()
}

/// A value that can be drawn: finite and positive (zero has no place on a log
/// scale and would read as a real measurement of nothing).
fn plottable(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

fn all_y(series: &[Series]) -> Vec<f64> {
    series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).collect()
}

/// (block size, value) points, plottable ones only, sorted by block size.
fn points<'a>(rows: impl Iterator<Item = &'a &'a Row>, value: impl Fn(&Row) -> Option<f64>) -> Vec<(f64, f64)> {
    let mut pts: Vec<(f64, f64)> = rows
        .filter_map(|r| value(r).map(|v| (r.block_bytes as f64, v)))
        .filter(|&(x, y)| plottable(x) && plottable(y))
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts
}

/// Per op: the measured line, then one dashed line per baseline it was compared with.
fn throughput_series(rows: &[&Row], ops: &[&str]) -> Vec<Series> {
    let mut out = Vec::new();
    for &op in ops {
        let color = op_color(op);
        let of_op = || rows.iter().filter(move |r| r.op == op);
        out.push(Series::new(op.to_string(), color, None, Marker::Dot, points(of_op(), |r| Some(r.gbps))));
        let mut names: Vec<&str> = Vec::new();
        for (name, _) in of_op().filter_map(|r| r.baseline.as_ref()) {
            if !names.contains(&name.as_str()) {
                names.push(name);
            }
        }
        for name in names {
            let pts = points(of_op(), |r| r.baseline.as_ref().filter(|b| b.0 == name).map(|b| b.1));
            let mut series = Series::new(format!("{op} baseline: {name}"), color, Some("6,4"), Marker::Ring, pts);
            series.end_label = Some(name.to_string());
            out.push(series);
        }
    }
    out.retain(|s| !s.points.is_empty());
    out
}

/// Per op: p50 solid with dots, p99 dotted with squares.
fn latency_series(rows: &[&Row], ops: &[&str]) -> Vec<Series> {
    let mut out = Vec::new();
    for &op in ops {
        let color = op_color(op);
        let of_op = || rows.iter().filter(move |r| r.op == op);
        out.push(Series::new(format!("{op} p50"), color, None, Marker::Dot, points(of_op(), |r| Some(r.p50_us))));
        out.push(Series::new(
            format!("{op} p99"),
            color,
            Some("2,3"),
            Marker::Square,
            points(of_op(), |r| Some(r.p99_us)),
        ));
    }
    out.retain(|s| !s.points.is_empty());
    out
}

// ---------------------------------------------------------------------------
// Axes.

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Linear,
    Log2,
    Log10,
}

/// One axis: its scale (bounds in transformed space), ticks and title.
struct Axis {
    kind: Kind,
    lo: f64,
    hi: f64,
    ticks: Vec<(f64, String)>,
    title: String,
}

impl Axis {
    /// Position of `v` along the axis, 0.0 at `lo` and 1.0 at `hi`.
    fn frac(&self, v: f64) -> f64 {
        let t = match self.kind {
            Kind::Linear => v,
            Kind::Log2 => v.log2(),
            Kind::Log10 => v.log10(),
        };
        (t - self.lo) / (self.hi - self.lo)
    }
}

/// At most about this many labelled ticks per axis, so labels never collide.
const MAX_TICKS: i64 = 8;

/// Block size on a log2 scale, ticks at powers of two.
fn block_axis(rows: &[&Row]) -> Axis {
    let exps: Vec<f64> = rows.iter().filter(|r| r.block_bytes > 0).map(|r| (r.block_bytes as f64).log2()).collect();
    let (mut lo, mut hi) = min_max(&exps).unwrap_or((10.0, 20.0));
    // One block size: widen around it so the lone point sits mid-panel.
    if hi - lo < 1e-9 {
        lo -= 1.0;
        hi += 1.0;
    }
    // A little padding keeps the end markers off the frame.
    let pad = (hi - lo) * 0.04;
    lo -= pad;
    hi += pad;
    let first = (lo.ceil() as i64).max(0);
    let last = hi.floor() as i64;
    let step = ((last - first + 1) + MAX_TICKS - 1) / MAX_TICKS;
    let ticks =
        (first..=last).filter(|e| e % step.max(1) == 0).map(|e| (2f64.powi(e as i32), format_bytes(e))).collect();
    Axis { kind: Kind::Log2, lo, hi, ticks, title: "block size (bytes, log2 scale)".to_string() }
}

/// A linear axis from zero to a round number above the largest value.
fn linear_axis(values: Vec<f64>, title: &str) -> Axis {
    let max = min_max(&values).map_or(1.0, |(_, hi)| hi);
    let step = nice_step(max * 1.05 / 5.0);
    let hi = (max * 1.05 / step).ceil() * step;
    let decimals = decimals_for(step);
    let count = (hi / step).round() as i64;
    let ticks = (0..=count).map(|i| i as f64 * step).map(|v| (v, format!("{v:.decimals$}"))).collect();
    Axis { kind: Kind::Linear, lo: 0.0, hi, ticks, title: title.to_string() }
}

/// Latency: log10 when the values span more than 10×, else linear from zero.
fn latency_axis(values: Vec<f64>) -> Axis {
    match min_max(&values) {
        Some((lo, hi)) if hi / lo > 10.0 => {
            let (first, last) = (lo.log10().floor() as i64, hi.log10().ceil() as i64);
            let step = ((last - first + 1) + MAX_TICKS - 1) / MAX_TICKS;
            let ticks = (first..=last)
                .filter(|e| (e - first) % step.max(1) == 0)
                .map(|e| {
                    let decimals = (-e).max(0) as usize;
                    let v = 10f64.powi(e as i32);
                    (v, format!("{v:.decimals$}"))
                })
                .collect();
            let title = "latency (µs, log10 scale)".to_string();
            Axis { kind: Kind::Log10, lo: first as f64, hi: last as f64, ticks, title }
        }
        _ => linear_axis(values, "latency (µs)"),
    }
}

fn min_max(values: &[f64]) -> Option<(f64, f64)> {
    let finite = values.iter().copied().filter(|v| v.is_finite());
    finite.fold(None, |acc, v| Some(acc.map_or((v, v), |(lo, hi): (f64, f64)| (lo.min(v), hi.max(v)))))
}

/// A tick spacing of 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if !plottable(raw) {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let f = raw / magnitude;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// Decimals needed to tell ticks `step` apart (0.5 → 1, 0.02 → 2, 5 → 0).
fn decimals_for(step: f64) -> usize {
    // The epsilon absorbs log10(0.1) landing a hair below -1.
    (-(step.log10() + 1e-9).floor()).max(0.0) as usize
}

/// 2^exp bytes as a short label: 512B, 4KiB, 64KiB, 1MiB, 2GiB.
fn format_bytes(exp: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let unit = (exp / 10).clamp(0, UNITS.len() as i64 - 1);
    let value = 2f64.powi((exp - unit * 10) as i32);
    format!("{value}{}", UNITS[unit as usize])
}

// ---------------------------------------------------------------------------
// Panels and series.

#[derive(Clone, Copy)]
enum Marker {
    Dot,
    Ring,
    Square,
}

/// One line on a panel, with its legend entry.
struct Series {
    label: String,
    color: &'static str,
    dash: Option<&'static str>,
    marker: Marker,
    /// (block bytes, value), all plottable.
    points: Vec<(f64, f64)>,
    /// Drawn beside the last point: names a baseline on the plot itself.
    end_label: Option<String>,
}

impl Series {
    fn new(
        label: String,
        color: &'static str,
        dash: Option<&'static str>,
        marker: Marker,
        points: Vec<(f64, f64)>,
    ) -> Self {
        Series { label, color, dash, marker, points, end_label: None }
    }

    fn draw_marker(&self, svg: &mut Svg, (x, y): (f64, f64)) {
        match self.marker {
            Marker::Dot => svg.circle((x, y), 3.5, self.color, self.color),
            Marker::Ring => svg.circle((x, y), 3.5, "#fff", self.color),
            Marker::Square => svg.rect((x - 3.0, y - 3.0), (6.0, 6.0), self.color, self.color),
        }
    }
}

/// One plot: frame, grid, ticks, axis titles, lines and legend.
struct Panel<'a> {
    x0: f64,
    title: &'a str,
    x: &'a Axis,
    y: &'a Axis,
    series: &'a [Series],
}

impl Panel<'_> {
    fn to_px(&self, (x, y): (f64, f64)) -> (f64, f64) {
        (self.x0 + self.x.frac(x) * PANEL_W, TOP + (1.0 - self.y.frac(y)) * PANEL_H)
    }

    fn draw(&self, svg: &mut Svg) {
        let (x0, bottom) = (self.x0, TOP + PANEL_H);
        svg.text(
            x0 + PANEL_W / 2.0,
            TOP - 10.0,
            self.title,
            r#"text-anchor="middle" font-size="14" font-weight="bold""#,
        );
        for (v, label) in &self.x.ticks {
            let px = x0 + self.x.frac(*v) * PANEL_W;
            svg.line((px, TOP), (px, bottom), "#e5e5e5");
            svg.text(px, bottom + 16.0, label, r#"text-anchor="middle""#);
        }
        for (v, label) in &self.y.ticks {
            let py = TOP + (1.0 - self.y.frac(*v)) * PANEL_H;
            svg.line((x0, py), (x0 + PANEL_W, py), "#e5e5e5");
            svg.text(x0 - 6.0, py + 4.0, label, r#"text-anchor="end""#);
        }
        svg.rect((x0, TOP), (PANEL_W, PANEL_H), "none", "#888");
        svg.text(x0 + PANEL_W / 2.0, bottom + 38.0, &self.x.title, r#"text-anchor="middle""#);
        let (yx, yy) = (x0 - 55.0, TOP + PANEL_H / 2.0);
        svg.text(yx, yy, &self.y.title, &format!(r#"text-anchor="middle" transform="rotate(-90 {yx} {yy})""#));
        if self.series.is_empty() {
            svg.text(x0 + PANEL_W / 2.0, yy, "no data", r##"text-anchor="middle" fill="#888""##);
        }
        for series in self.series {
            let pts: Vec<(f64, f64)> = series.points.iter().map(|&p| self.to_px(p)).collect();
            svg.polyline(&pts, series.color, series.dash);
            pts.iter().for_each(|&p| series.draw_marker(svg, p));
            if let (Some(label), Some(&(px, py))) = (&series.end_label, pts.last()) {
                let attrs = format!(r#"text-anchor="end" font-size="11" fill="{}""#, series.color);
                svg.text(px - 6.0, py - 7.0, label, &attrs);
            }
        }
        self.draw_legend(svg, bottom + LEGEND_OFFSET);
    }

    /// Two columns below the panel, so the legend never hides data.
    fn draw_legend(&self, svg: &mut Svg, top: f64) {
        for (i, series) in self.series.iter().enumerate() {
            let x = self.x0 + (i % 2) as f64 * PANEL_W / 2.0;
            let y = top + (i / 2) as f64 * LEGEND_ROW;
            svg.polyline(&[(x, y - 4.0), (x + 28.0, y - 4.0)], series.color, series.dash);
            series.draw_marker(svg, (x + 14.0, y - 4.0));
            svg.text(x + 36.0, y, &series.label, "");
        }
    }
}

// ---------------------------------------------------------------------------
// SVG text.

/// A minimal SVG writer: each method appends one element.
struct Svg {
    out: String,
}

impl Svg {
    fn new(width: f64, height: f64) -> Self {
        let mut svg = Svg { out: String::new() };
        svg.push(format_args!(
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
        ));
        // An opaque background: on GitHub's dark theme a transparent chart
        // would show dark text on a dark page.
        svg.rect((0.0, 0.0), (width, height), "#fff", "none");
        svg
    }

    fn push(&mut self, element: std::fmt::Arguments) {
        // Writing to a String cannot fail.
        let _ = self.out.write_fmt(element);
        self.out.push('\n');
    }

    fn line(&mut self, (x1, y1): (f64, f64), (x2, y2): (f64, f64), stroke: &str) {
        self.push(format_args!(r#"<line x1="{x1:.1}" y1="{y1:.1}" x2="{x2:.1}" y2="{y2:.1}" stroke="{stroke}"/>"#));
    }

    fn rect(&mut self, (x, y): (f64, f64), (w, h): (f64, f64), fill: &str, stroke: &str) {
        self.push(format_args!(
            r#"<rect x="{x:.1}" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{fill}" stroke="{stroke}"/>"#
        ));
    }

    fn circle(&mut self, (cx, cy): (f64, f64), r: f64, fill: &str, stroke: &str) {
        self.push(format_args!(
            r#"<circle cx="{cx:.1}" cy="{cy:.1}" r="{r:.1}" fill="{fill}" stroke="{stroke}" stroke-width="1.5"/>"#
        ));
    }

    /// A line through `pts`; nothing for fewer than two points (markers show those).
    fn polyline(&mut self, pts: &[(f64, f64)], stroke: &str, dash: Option<&str>) {
        if pts.len() < 2 {
            return;
        }
        let coords: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let dash = dash.map(|d| format!(r#" stroke-dasharray="{d}""#)).unwrap_or_default();
        self.push(format_args!(
            r#"<polyline points="{}" fill="none" stroke="{stroke}" stroke-width="2"{dash}/>"#,
            coords.join(" ")
        ));
    }

    /// `content` is escaped; `attrs` is trusted markup built in this module.
    fn text(&mut self, x: f64, y: f64, content: &str, attrs: &str) {
        let content = escape(content);
        self.push(format_args!(r#"<text x="{x:.1}" y="{y:.1}" {attrs}>{content}</text>"#));
    }

    fn finish(mut self) -> String {
        self.out.push_str("</svg>\n");
        self.out
    }
}

/// Escapes text for SVG/XML content and attribute values.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        std::env::temp_dir().join(format!("kvring-report-{name}-{}-{nanos}", std::process::id()))
    }

    fn row(transport: &str, op: &str, block_bytes: u64, gbps: f64, baseline: Option<(&str, f64)>) -> Row {
        Row {
            transport: transport.to_string(),
            op: op.to_string(),
            block_bytes,
            gbps,
            p50_us: block_bytes as f64 / 1000.0,
            p99_us: block_bytes as f64 / 100.0,
            baseline: baseline.map(|(n, g)| (n.to_string(), g)),
        }
    }

    /// Every opened tag is closed in order: enough to catch broken markup or escaping.
    fn assert_well_formed(svg: &str) {
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.trim_end().ends_with("</svg>"), "{svg}");
        assert!(!svg.contains("NaN") && !svg.contains("inf"), "{svg}");
        let mut stack = Vec::new();
        for tag in svg.split('<').skip(1) {
            let tag = tag.split('>').next().expect("split yields at least one piece");
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(stack.pop(), Some(name.to_string()), "{svg}");
            } else if !tag.ends_with('/') {
                stack.push(tag.split_whitespace().next().unwrap_or_default().to_string());
            }
        }
        assert!(stack.is_empty(), "unclosed {stack:?}");
    }

    #[test]
    fn writes_json_and_one_svg_per_transport() {
        let dir = temp_dir("two");
        let mut rows = Vec::new();
        for (transport, base) in [("shm", "memcpy"), ("tcp", "raw-tcp")] {
            for (i, block) in [4096u64, 65536, 1 << 20].into_iter().enumerate() {
                rows.push(row(transport, "write", block, 1.5 + i as f64, Some((base, 10.0 + i as f64))));
                rows.push(row(transport, "read", block, 2.5 + i as f64, Some((base, 12.0))));
            }
        }
        let paths = write(&dir, &rows).expect("write report");
        assert_eq!(paths, vec![dir.join("bench.json"), dir.join("bench-shm.svg"), dir.join("bench-tcp.svg")]);
        assert!(paths.iter().all(|p| p.is_file()));

        let json: Value = serde_json::from_str(&std::fs::read_to_string(&paths[0]).expect("read json")).expect("parse");
        let items = json.as_array().expect("array");
        assert_eq!(items.len(), rows.len());
        assert_eq!(items[2]["transport"], "shm");
        assert_eq!(items[2]["op"], "write");
        assert_eq!(items[2]["block_bytes"], 65536);
        assert_eq!(items[2]["gbps"], 2.5);
        assert_eq!(items[2]["p50_us"], 65.536);
        assert_eq!(items[2]["p99_us"], 655.36);
        assert_eq!(items[2]["baseline"], "memcpy");
        assert_eq!(items[2]["baseline_gbps"], 11.0);
        assert_eq!(items[11]["baseline"], "raw-tcp");

        for (path, transport, base) in [(&paths[1], "shm", "memcpy"), (&paths[2], "tcp", "raw-tcp")] {
            let svg = std::fs::read_to_string(path).expect("read svg");
            assert_well_formed(&svg);
            assert!(svg.contains(&format!("kvring bench — {transport}")));
            assert!(svg.contains(">64KiB<") && svg.contains(">4KiB<") && svg.contains(">1MiB<"));
            assert!(svg.contains(base));
            // p50 and p99 span 4 µs..10 ms: more than 10×, so a log axis.
            assert!(svg.contains("log10 scale"));
            assert!(svg.contains(FOOTNOTE));
        }
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn one_row_without_baseline_and_bad_values() {
        let dir = temp_dir("one");
        let rows = vec![Row { p99_us: f64::NAN, ..row("rdma", "read", 65536, 3.0, None) }];
        let paths = write(&dir, &rows).expect("write report");
        let svg = std::fs::read_to_string(&paths[1]).expect("read svg");
        assert_well_formed(&svg);
        assert!(svg.contains(">64KiB<") && svg.contains("read p50") && !svg.contains("read p99"));
        assert!(!svg.contains("baseline:"));
        let json: Value = serde_json::from_str(&std::fs::read_to_string(&paths[0]).expect("read json")).expect("parse");
        assert_eq!(json[0]["baseline"], Value::Null);
        assert_eq!(json[0]["baseline_gbps"], Value::Null);
        assert_eq!(json[0]["p99_us"], Value::Null);

        // Zero throughput is skipped, leaving a panel that says so rather than a point at 0.
        let rows = vec![row("zero", "write", 4096, 0.0, Some(("memcpy", f64::NAN)))];
        let paths = write(&dir, &rows).expect("write report");
        let svg = std::fs::read_to_string(&paths[1]).expect("read svg");
        assert_well_formed(&svg);
        assert!(svg.contains("no data"));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn escapes_text() {
        let dir = temp_dir("escape");
        let rows = vec![row("a<&>b", "write", 4096, 1.0, Some(("x\"<&>'", 2.0)))];
        let paths = write(&dir, &rows).expect("write report");
        assert_eq!(paths[1], dir.join("bench-a___b.svg"));
        let svg = std::fs::read_to_string(&paths[1]).expect("read svg");
        assert_well_formed(&svg);
        assert!(svg.contains("kvring bench — a&lt;&amp;&gt;b"));
        assert!(svg.contains("x&quot;&lt;&amp;&gt;&apos;"));
        assert!(!svg.contains("<&>"));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn error_names_the_path() {
        let file = temp_dir("file");
        std::fs::write(&file, "not a directory").expect("write file");
        let err = write(&file.join("sub"), &[]).expect_err("a file is in the way");
        assert!(err.contains(&file.display().to_string()), "{err}");
        std::fs::remove_file(&file).expect("clean up");
    }

    #[test]
    fn axes() {
        assert_eq!([10, 12, 16, 20, 31].map(format_bytes), ["1KiB", "4KiB", "64KiB", "1MiB", "2GiB"]);
        assert_eq!(format_bytes(9), "512B");
        assert_eq!(latency_axis(vec![5.0, 40.0]).kind, Kind::Linear);
        let log = latency_axis(vec![0.5, 20_000.0]);
        assert_eq!((log.kind, log.lo, log.hi), (Kind::Log10, -1.0, 5.0));
        assert_eq!(log.ticks[0].1, "0.1");
        let lin = linear_axis(vec![0.003, 0.004], "t");
        assert!(lin.hi >= 0.004 && lin.ticks.iter().all(|(_, l)| l.starts_with("0.00")), "{:?}", lin.ticks);
        // Many block sizes: labels thinned to at most MAX_TICKS.
        let rows: Vec<Row> = (0..=30).map(|e| row("t", "write", 1 << e, 1.0, None)).collect();
        let refs: Vec<&Row> = rows.iter().collect();
        assert!(block_axis(&refs).ticks.len() <= MAX_TICKS as usize);
        assert_eq!(op_color("write"), op_color("write"));
        assert_ne!(op_color("write"), op_color("read"));
    }
}
