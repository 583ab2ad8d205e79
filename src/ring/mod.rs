//! Rings: the lock-free SPSC ring and the entries it carries.
//!
//! A submitter owns the producer halves of its submission rings and the
//! consumer halves of its completion rings; each lane owns the other halves.
//! The halves are `Send` but not `Sync`, so a second producer cannot compile:
//!
//! ```compile_fail
//! fn needs_sync<T: Sync>() {}
//! needs_sync::<kvring::ring::spsc::Producer<u64>>();
//! ```
//!
//! ```compile_fail
//! let (tx, _rx) = kvring::ring::spsc::channel::<u64>(4);
//! let _second = tx.clone();
//! ```

pub mod entry;
pub mod spsc;

pub use entry::{Cqe, CqeKind, Opcode, Sqe};
#[cfg(feature = "testing")]
pub use spsc::Full;
pub use spsc::{channel, Consumer, Producer};
