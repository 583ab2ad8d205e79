//! kvring's logs: events go through the `tracing` facade (the application,
//! or `kvring serve`/`bench`, chooses the subscriber); events a peer can
//! cause are rate-limited ([`ratelimit`]); and for hosts that are not Rust
//! (the C ABI's callback, Python's `logging`), a sink forwards them
//! ([`sink`]). Nothing logs on the per-block path.

pub(crate) mod ratelimit;
pub(crate) mod sink;
