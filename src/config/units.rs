//! Sizes and durations as people write them in flags, files and variables.

use std::time::Duration;

/// Parses `4096`, `4KiB`, `64KiB`, `1MiB`, `1GiB` (also `K`, `M`, `G`,
/// `KB`, `MB`, `GB` as binary units).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits.parse().map_err(|_| format!("{text:?} is not a size (e.g. 4KiB, 1MiB, 1GiB)"))?;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit {other:?} in {text:?}")),
    };
    number.checked_mul(multiplier).ok_or_else(|| format!("{text:?} overflows 64 bits"))
}

/// Parses `500ms`, `60s`, `2m`, `100us`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits.parse().map_err(|_| format!("{text:?} is not a duration (e.g. 500ms, 60s)"))?;
    match unit {
        "us" => Ok(Duration::from_micros(number)),
        "ms" => Ok(Duration::from_millis(number)),
        "s" | "" => Ok(Duration::from_secs(number)),
        "m" => Ok(Duration::from_secs(number.saturating_mul(60))),
        other => Err(format!("unknown duration unit {other:?} in {text:?}")),
    }
}
