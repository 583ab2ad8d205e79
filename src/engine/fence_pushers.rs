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
use std::time::{Duration, Instant};

/// A writer's key: its name and epoch (one start of it).
type WriterKey = (String, u64);

/// How long a writer cut off for a fence it did not answer is refused at
/// its next connects: a few fence waits, so that one which answers its
/// dial but not its fences cannot be cut off and let in again at every
/// fence, each time costing the fence its whole wait.
const CUT_OFF_HOLD: Duration = Duration::from_secs(10);

/// Writers remembered as cut off, at most (the oldest forgotten first).
const MAX_CUT_OFF: usize = 1024;

/// The kept push connections, by writer.
pub(super) struct FencePushers {
    /// What this engine proves when it dials a writer.
    token: Option<Token>,
    kept: Mutex<HashMap<WriterKey, ControlClient>>,
    /// Control addresses of writers cut off for a fence they stalled, and
    /// when: by the address as parsed and canonical (an IPv4 address spelt
    /// as IPv4-mapped IPv6 is the same), whatever name or epoch claims it
    /// next (hostile review 12).
    cut_off: Mutex<HashMap<SocketAddr, Instant>>,
}

impl FencePushers {
    /// No connection yet; `token` is this engine's, proven to writers.
    pub fn new(token: Option<Token>) -> Self {
        Self { token, kept: Mutex::new(HashMap::new()), cut_off: Mutex::new(HashMap::new()) }
    }

    /// A control connection to `writer`'s claimed address, handshaken as
    /// `me`, whose answering engine is `writer` itself (name and epoch).
    /// Another engine at that address (two pods behind one NAT address, a
    /// port forward) is refused: it must not answer `writer`'s fences.
    ///
    /// The address is the peer's word, so this engine dials where a peer
    /// says: only a literal `IP:port` (no name to resolve, which would wait
    /// on DNS past any deadline), and every way the dial can fail (nothing
    /// there, something else there, another engine there) reads the same
    /// to the peer, so the refusal is no port scanner's probe of addresses
    /// only this engine reaches (hostile review 11); which step failed, and
    /// the system's error, go to this engine's log.
    pub fn reach(&self, me: &Initiator, writer: &Initiator, deadline: Instant) -> Result<ControlClient> {
        let refused = |why: &str| Error::Unsupported {
            what: format!(
                "rdma: this target pushes its fences to the control address {} claimed ({:?}), and {why}; \
                 advertise an address this target can reach (`advertise`, `listen`)",
                writer.name, writer.addr
            ),
        };
        let unreached = |step: &str, detail: &dyn std::fmt::Display| {
            static LIMIT: RateLimit = RateLimit::per_second();
            log_limited!(warn, LIMIT, writer = %writer.name, addr = %writer.addr, step, %detail, "an rdma writer's control address did not answer as the writer (its connect, or a fence's dial again, is refused)");
            refused("the writer did not answer there")
        };
        let addr: SocketAddr = writer.addr.parse().map_err(|_| refused("it is not an IP address and port"))?;
        let mut client =
            ControlClient::connect(&addr.to_string(), deadline).map_err(|error| unreached("connecting", &error))?;
        let handshake =
            client.handshake(me, self.token.as_ref(), deadline).map_err(|error| unreached("the handshake", &error))?;
        let answered = &handshake.descriptor;
        if answered.name != writer.name || answered.epoch != writer.epoch {
            let who = format!("{} (epoch {:#x})", answered.name, answered.epoch);
            return Err(unreached("another engine answered", &who));
        }
        Ok(client)
    }

    /// Refuses `writer` while its claimed address is held for a fence it
    /// stalled.
    pub fn check_not_cut_off(&self, writer: &Initiator) -> Result<()> {
        let Some(key) = canonical(&writer.addr) else { return Ok(()) };
        let mut cut_off = lock(&self.cut_off);
        match cut_off.get(&key) {
            Some(at) if at.elapsed() < CUT_OFF_HOLD => Err(Error::Unsupported {
                what: format!(
                    "rdma: the writer at {key} did not answer a fence of this target within its wait and was cut \
                     off; its address is refused for {} s after",
                    CUT_OFF_HOLD.as_secs()
                ),
            }),
            Some(_) => {
                cut_off.remove(&key);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Remembers `writer`'s address as held for a fence it stalled (its
    /// kept connection, if any, is gone with the fence's answer).
    pub fn cut_off(&self, writer: &Initiator) {
        let Some(key) = canonical(&writer.addr) else { return };
        let mut cut_off = lock(&self.cut_off);
        cut_off.retain(|_, at| at.elapsed() < CUT_OFF_HOLD);
        if cut_off.len() >= MAX_CUT_OFF {
            if let Some(oldest) = cut_off.iter().min_by_key(|(_, at)| **at).map(|(key, _)| *key) {
                cut_off.remove(&oldest);
            }
        }
        cut_off.insert(key, Instant::now());
    }

    /// Keeps `client` for `writer`'s fences (in place of an older one), and
    /// drops the connections of writers no longer among `listed`.
    pub fn keep<'a>(
        &self,
        writer: &Initiator,
        client: ControlClient,
        listed: impl Iterator<Item = &'a Initiator> + Clone,
    ) {
        let mut kept = lock(&self.kept);
        kept.insert((writer.name.clone(), writer.epoch), client);
        retain_listed(&mut kept, listed);
    }

    /// Drops the connections of writers no longer among `listed` (the
    /// reaper released them).
    pub fn prune<'a>(&self, listed: impl Iterator<Item = &'a Initiator> + Clone) {
        retain_listed(&mut lock(&self.kept), listed);
    }

    /// Takes the kept connection of each of `writers`, in order, and drops
    /// those of writers no longer among them.
    pub fn take<'a>(&self, writers: impl Iterator<Item = &'a Initiator> + Clone) -> Vec<Option<ControlClient>> {
        let mut kept = lock(&self.kept);
        retain_listed(&mut kept, writers.clone());
        writers.map(|w| kept.remove(&(w.name.clone(), w.epoch))).collect()
    }
}

/// A claimed address as parsed, its IP canonical (`::ffff:a.b.c.d` is
/// `a.b.c.d`); `None` for one that is not `IP:port`.
fn canonical(addr: &str) -> Option<SocketAddr> {
    let addr: SocketAddr = addr.parse().ok()?;
    Some(SocketAddr::new(addr.ip().to_canonical(), addr.port()))
}

fn retain_listed<'a>(
    kept: &mut HashMap<WriterKey, ControlClient>,
    listed: impl Iterator<Item = &'a Initiator> + Clone,
) {
    kept.retain(|(name, epoch), _| listed.clone().any(|w| &w.name == name && w.epoch == *epoch));
}
