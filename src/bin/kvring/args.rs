//! A small command-line parser: `--flag value` and `--switch`, with sizes
//! and durations that take units. Unknown flags are errors that name them.

use std::collections::VecDeque;
use std::time::Duration;

/// Arguments of one subcommand, consumed flag by flag.
pub struct Args {
    rest: VecDeque<String>,
}

impl Args {
    pub fn new(args: impl IntoIterator<Item = String>) -> Self {
        Self { rest: args.into_iter().collect() }
    }

    /// Removes `--name` and returns its value, if present.
    pub fn value(&mut self, name: &str) -> Result<Option<String>, String> {
        let Some(position) = self.rest.iter().position(|a| a == name || a.starts_with(&format!("{name}="))) else {
            return Ok(None);
        };
        let flag = self.rest.remove(position).expect("position is in range");
        if let Some((_, value)) = flag.split_once('=') {
            return Ok(Some(value.to_string()));
        }
        self.rest.remove(position).map(Some).ok_or_else(|| format!("{name} needs a value"))
    }

    /// Removes `--name` and reports whether it was there.
    pub fn switch(&mut self, name: &str) -> bool {
        match self.rest.iter().position(|a| a == name) {
            Some(position) => {
                self.rest.remove(position);
                true
            }
            None => false,
        }
    }

    /// True when `--name` is among the arguments (consumes nothing).
    pub fn has(&self, name: &str) -> bool {
        self.rest.iter().any(|a| a == name || a.starts_with(&format!("{name}=")))
    }

    pub fn duration(&mut self, name: &str) -> Result<Option<Duration>, String> {
        self.value(name)?.map(|v| parse_duration(&v).map_err(|e| format!("{name}: {e}"))).transpose()
    }

    pub fn size(&mut self, name: &str) -> Result<Option<u64>, String> {
        self.value(name)?.map(|v| parse_size(&v).map_err(|e| format!("{name}: {e}"))).transpose()
    }

    pub fn number(&mut self, name: &str) -> Result<Option<usize>, String> {
        self.value(name)?
            .map(|v| v.parse::<usize>().map_err(|_| format!("{name}: {v:?} is not a whole number")))
            .transpose()
    }

    /// Fails on anything not consumed.
    pub fn finish(self) -> Result<(), String> {
        match self.rest.front() {
            None => Ok(()),
            Some(extra) => Err(format!("unknown argument {extra:?} (see `kvring help`)")),
        }
    }
}

pub use kvring::config::{parse_duration, parse_size};

/// `4096` → `4KiB`, for printing.
pub fn format_size(bytes: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if bytes >= 1 << shift && bytes % (1 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_take_units() {
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("512"), Ok(512));
        assert!(parse_size("4XB").unwrap_err().contains("unknown size unit"));
        assert!(parse_size("huge").is_err());
        assert!(parse_size("99999999999999GiB").unwrap_err().contains("overflows"));
        assert_eq!(parse_duration("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("5ms"), Ok(Duration::from_millis(5)));
        assert!(parse_duration("5 fortnights").is_err());
        assert_eq!(format_size(65536), "64KiB");
        assert_eq!(format_size(1000), "1000B");
    }

    #[test]
    fn unknown_flags_are_named() {
        let mut args = Args::new(["--op".into(), "write".into(), "--bogus".into()]);
        assert_eq!(args.value("--op").unwrap().as_deref(), Some("write"));
        assert_eq!(args.finish().unwrap_err(), "unknown argument \"--bogus\" (see `kvring help`)");
        let mut args = Args::new(["--batch".into()]);
        assert_eq!(args.number("--batch").unwrap_err(), "--batch needs a value");
    }
}
