//! Sizes and durations as people write them in flags, files and variables.

use std::time::Duration;

/// The size units [`parse_size`] takes, as its errors list them.
const SIZE_UNITS: &str = "B; KB, MB, GB, TB (10^3, 10^6, 10^9, 10^12); KiB, MiB, GiB, TiB (2^10, 2^20, 2^30, 2^40)";

/// Parses a byte count with an optional unit, upper or lower case: `4096`,
/// `512B`; decimal `KB`, `MB`, `GB`, `TB` (10^3, 10^6, 10^9, 10^12 bytes,
/// as disks and links count); binary `KiB`, `MiB`, `GiB`, `TiB` (2^10 ..
/// 2^40, as memory counts). A bare `K`, `M` or `G` is refused: it would
/// mean one or the other by guess.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: u64 = digits.parse().map_err(|_| format!("{text:?} is not a size (e.g. 4KiB, 1MiB, 1GB)"))?;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(format!("unknown size unit {:?} in {text:?} (units: {SIZE_UNITS})", unit.trim())),
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
        other => Err(format!("unknown duration unit {other:?} in {text:?} (units: us, ms, s, m)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimal_and_binary_size_units_mean_what_they_say() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("512B"), Ok(512));
        assert_eq!(parse_size("4KB"), Ok(4_000));
        assert_eq!(parse_size("1MB"), Ok(1_000_000));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("2TB"), Ok(2_000_000_000_000));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("1gib"), Ok(1 << 30));
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        let error = parse_size("3XB").unwrap_err();
        assert!(
            error.contains("unknown size unit \"XB\"") && error.contains("KiB") && error.contains("10^9"),
            "{error}"
        );
        assert!(parse_size("1G").unwrap_err().contains("units:"), "a bare G is refused, naming the units");
        assert!(parse_size("huge").is_err());
        assert!(parse_size("99999999999999GiB").unwrap_err().contains("overflows"));
        assert!(parse_duration("5 fortnights").unwrap_err().contains("units: us, ms, s, m"));
    }
}
