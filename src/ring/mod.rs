//! Rings: the lock-free SPSC ring and the entries it carries.
//!
//! A submitter owns the producer halves of its submission rings and the
//! consumer halves of its completion rings; each lane owns the other halves.
//! The halves are `Send` but not `Sync` and not `Clone`, so a second
//! producer cannot compile. Through the public path (`kvring::testing`,
//! which kvring's own doctests build with), a half can be sent:
//!
//! ```
//! fn needs_send<T: Send>(_: &T) {}
//! let (tx, rx) = kvring::testing::ring::channel::<u64>(4);
//! needs_send(&tx);
//! needs_send(&rx);
//! ```
//!
//! but not shared (E0277: the trait bound `Sync` is not satisfied):
//!
//! ```compile_fail,E0277
//! fn needs_sync<T: Sync>(_: &T) {}
//! let (tx, _rx) = kvring::testing::ring::channel::<u64>(4);
//! needs_sync(&tx);
//! ```
//!
//! nor cloned (E0599: no method `clone`):
//!
//! ```compile_fail,E0599
//! let (tx, _rx) = kvring::testing::ring::channel::<u64>(4);
//! let _second = tx.clone();
//! ```

pub mod entry;
pub mod spsc;

pub use entry::{Cqe, CqeKind, Opcode, Sqe, SQE_FLAG_CHECKSUM};
#[cfg(feature = "testing")]
pub use spsc::Full;
pub use spsc::{channel, Consumer, Producer};
