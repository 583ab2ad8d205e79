//! The rounds a hand-written bench (`harness = false`) runs, from its
//! command line.

/// `smoke` rounds under `cargo bench -- --test` (CI's one pass), else the
/// `N` of `--rounds N`, else `default`.
pub fn rounds(smoke: usize, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--test") {
        return smoke;
    }
    args.iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .map(|n| n.parse().expect("--rounds N"))
        .unwrap_or(default)
}
