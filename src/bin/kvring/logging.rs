//! The binary's logs: kvring's `tracing` events as lines on stderr, so
//! stdout stays the commands' output (bench tables, JSON).
//!
//! `RUST_LOG` chooses what is shown (`kvring=debug`, `off`, …); without it,
//! `serve` shows kvring's info and above (an engine's start and stop,
//! reopened segments, warnings: restarted peers, refusals, a lost metadata
//! store) and the other commands warnings only, so a bench's output is its
//! table.

use tracing_subscriber::EnvFilter;

/// Installs the stderr subscriber; call once, first thing in `main`, with
/// what to show when `RUST_LOG` is not set (`kvring=info`, `kvring=warn`).
pub fn init(default_filter: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // Colours only on a terminal; a file or a pipe gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let subscriber =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).finish();
    // Only fails if a subscriber is already set, which then keeps working.
    let _ = tracing::subscriber::set_global_default(subscriber);
}
