//! The cma check before every call (one call per chunk), against the same
//! call with no check, interleaved round by round in one run: the liveness
//! word the kernel releases at exit or exec (one load and a pidfd `poll`),
//! and the remote head read it replaced (a `process_vm_readv` of the page's
//! head through the target, and the `poll`).
//!
//! `cargo bench --bench cma_check -- --rounds 30` (`-- --test`: one round,
//! the CI smoke run). Prints, per chunk size, the median time per call of
//! each and its ratio to the call alone.

use kvring::testing::cma::check_cost;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let smoke = args.iter().any(|a| a == "--test");
    let rounds = args
        .iter()
        .position(|a| a == "--rounds")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(if smoke { 1 } else { 30 });
    let calls = if smoke { 10 } else { 2000 };
    for block in [4 << 10, 64 << 10, 1 << 20] {
        let calls = if block >= 1 << 20 { calls / 10 } else { calls }.max(1);
        let cost = check_cost(block, calls, rounds);
        let ns = |d: std::time::Duration| d.as_secs_f64() * 1e9;
        println!(
            "cma_check/{} KiB chunk: call alone {:.0} ns; + liveness word {:.0} ns ({:.3}x); + head read {:.0} ns \
             ({:.3}x); check alone: word {:.0} ns, head read {:.0} ns",
            block >> 10,
            ns(cost.none),
            ns(cost.word),
            ns(cost.word) / ns(cost.none),
            ns(cost.head_read),
            ns(cost.head_read) / ns(cost.none),
            ns(cost.word) - ns(cost.none),
            ns(cost.head_read) - ns(cost.none),
        );
    }
}
