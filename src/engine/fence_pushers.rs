//! The control connections a target pushes its rdma fences over, one per
//! writer, made when the writer connects its QPs, not at its first fence.
//!
//! A fence is pushed to the control address the writer *claimed* in its
//! handshake. Made lazily, at the first fence, a claimed address that
//! reaches nobody (a port behind a NAT, an address bound on another
//! interface, a lie) cost every fence of this engine the whole fence wait
//! (2 s) before the writer was cut off, and the writer's reconnect then
//! went through, to stall the next fence again. So the writer's rdma
//! connect dials its claimed address back first, outside the fencers'
//! mutex, and proves that the engine answering there is the writer (its
//! name and epoch in the handshake's checked descriptor): a writer fences
//! cannot reach is refused at connect, with the reason, and the connection
//! is kept for its fences (docs/ARCHITECTURE.md, "Fenced destinations over
//! rdma").

use super::lifecycle::lock;
use crate::auth::{Initiator, Token};
use crate::control::ControlClient;
use crate::error::{Error, Result};
use crate::log::ratelimit::{log_limited, RateLimit};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Instant;

/// A writer's key: its name and epoch (one start of it).
type WriterKey = (String, u64);

/// The kept push connections, by writer.
pub(super) struct FencePushers {
    /// What this engine proves when it dials a writer.
    token: Option<Token>,
    kept: Mutex<HashMap<WriterKey, ControlClient>>,
}

impl FencePushers {
    /// No connection yet; `token` is this engine's, proven to writers.
    pub fn new(token: Option<Token>) -> Self {
        Self { token, kept: Mutex::new(HashMap::new()) }
    }

    /// A control connection to `writer`'s claimed address, handshaken as
    /// `me`, whose answering engine is `writer` itself (name and epoch).
    /// Another engine at that address (two pods behind one NAT address, a
    /// port forward) is refused: it must not answer `writer`'s fences.
    ///
    /// The address is the peer's word, so this engine dials where a peer
    /// says: only a literal `IP:port` (no name to resolve, which would wait
    /// on DNS past any deadline), and the peer is told only which step
    /// failed, not the system's error (which would make this engine a port
    /// scanner's probe of addresses only it reaches); the details go to
    /// this engine's log.
    pub fn reach(&self, me: &Initiator, writer: &Initiator, deadline: Instant) -> Result<ControlClient> {
        let refused = |step: &str, detail: &dyn std::fmt::Display| {
            static LIMIT: RateLimit = RateLimit::per_second();
            log_limited!(warn, LIMIT, writer = %writer.name, addr = %writer.addr, %detail, "an rdma writer's control address {step}: its connect is refused");
            Error::Unsupported {
                what: format!(
                    "rdma: this target pushes its fences to the control address {} claimed ({:?}), and {step}; \
                     advertise an address this target can reach (`advertise`, `listen`)",
                    writer.name, writer.addr
                ),
            }
        };
        let addr: SocketAddr =
            writer.addr.parse().map_err(|_| refused("it is not an IP address and port", &"not IP:port"))?;
        let mut client = ControlClient::connect(&addr.to_string(), deadline)
            .map_err(|error| refused("it could not be connected to", &error))?;
        let handshake = client
            .handshake(me, self.token.as_ref(), deadline)
            .map_err(|error| refused("it did not complete a handshake", &error))?;
        let answered = &handshake.descriptor;
        if answered.name != writer.name || answered.epoch != writer.epoch {
            let who = format!("{} (epoch {:#x})", answered.name, answered.epoch);
            return Err(refused("another engine answers there", &who));
        }
        Ok(client)
    }

    /// Keeps `client` for `writer`'s fences (in place of an older one).
    pub fn keep(&self, writer: &Initiator, client: ControlClient) {
        lock(&self.kept).insert((writer.name.clone(), writer.epoch), client);
    }

    /// Takes the kept connection of each of `writers`, in order, and drops
    /// those of writers no longer among them.
    pub fn take<'a>(&self, writers: impl Iterator<Item = &'a Initiator> + Clone) -> Vec<Option<ControlClient>> {
        let mut kept = lock(&self.kept);
        kept.retain(|(name, epoch), _| writers.clone().any(|w| &w.name == name && w.epoch == *epoch));
        writers.map(|w| kept.remove(&(w.name.clone(), w.epoch))).collect()
    }
}
