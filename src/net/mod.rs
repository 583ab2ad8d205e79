//! What kvring's servers share: the accept loop of the thread-served ones
//! (control plane, metrics), the admission policy every listener applies
//! (connections per source, a deadline to prove itself, oldest unproven
//! connection out first), whole-operation deadlines on blocking sockets,
//! and the file-descriptor budget.

mod acceptor;
mod admission;
mod deadline;
mod fds;

pub(crate) use acceptor::{Acceptor, Admitted};
pub use admission::AdmissionLimits;
pub(crate) use admission::{Admission, Arrival};
pub(crate) use deadline::{is_timeout, DeadlineIo};
pub(crate) use fds::{fd_budget, raise_fd_limit};
