//! What kvring's servers share: the accept loop of the thread-served ones
//! (control plane, metrics), the admission policy every listener applies
//! (connections per source, a deadline to prove itself, oldest unproven
//! connection out first), whole-operation deadlines on blocking sockets,
//! the file-descriptor budget; and logging's two helpers, here because
//! every layer above reaches this module: a rate limit per kind of event
//! (what a peer can cause must not flood the logs) and the sink that
//! forwards events to the C ABI's callback or Python's `logging`.

mod acceptor;
mod admission;
mod deadline;
mod fds;
pub(crate) mod idle_cell;
mod workers;

pub(crate) use acceptor::{Acceptor, Admitted};
pub use admission::AdmissionLimits;
pub(crate) use admission::{Admission, Arrival, IdleCell};
pub(crate) use deadline::{is_timeout, DeadlineIo};
pub(crate) use fds::{fd_budget, raise_fd_limit};
pub(crate) use workers::{Job, Workers};
