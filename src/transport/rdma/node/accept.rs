//! Accepting initiators' QPs: one QP of this engine's connected to each,
//! owned by the initiator's identity (name and epoch), bounded per
//! initiator and in total, reused across reconnects.

use super::{RdmaNode, Spare, MAX_ACCEPTED_QPS, MAX_CONNECT_ENDPOINTS};
use crate::auth::Initiator;
use crate::error::{Error, Result};
use crate::transport::rdma::verbs::QpEndpoint;
use std::collections::HashMap;

/// An initiator's identity: its name and epoch.
pub(super) type Identity = (String, u64);

/// QPs accepted for initiators, by identity (name and epoch: a restarted
/// initiator is another identity).
#[derive(Debug, Default)]
pub(super) struct Accepted {
    pub by_initiator: HashMap<Identity, AcceptedSet>,
    pub total: usize,
    /// Connects so far: orders initiators by how recently they connected.
    clock: u64,
}

#[derive(Debug)]
pub(super) struct AcceptedSet {
    pub qps: Vec<(usize, Spare)>,
    connected: u64,
    /// Where the initiator's control plane listens (for probes, and for
    /// the fences this engine pushes to it).
    pub addr: String,
    /// Its lanes check writes against mirrors of this engine's fence
    /// tables (it said so when it connected): the key its connect gave,
    /// which each fence pushed to it carries.
    pub push_key: Option<Vec<u8>>,
}

impl RdmaNode {
    /// Whether an rdma connect of `endpoints` QPs over `nics` NICs could be
    /// accepted by its shape: checked before anything is done for it (the
    /// writer's address dialled back, `accept`). A connect of no QP is
    /// refused: it would list a writer that writes nothing, and cost a
    /// kept connection (hostile review 11).
    pub fn check_connect_shape(&self, nics: usize, endpoints: usize) -> Result<()> {
        if nics == 0 || nics > self.nics.len() || endpoints == 0 || endpoints > MAX_CONNECT_ENDPOINTS {
            return Err(Error::invalid(
                "rdma connect",
                format!(
                    "{endpoints} endpoints over {nics} nics (this engine has {} nics and takes 1 to \
                     {MAX_CONNECT_ENDPOINTS})",
                    self.nics.len()
                ),
            ));
        }
        Ok(())
    }

    /// Accepts an initiator's QPs (lane-major over `nics` NICs): one QP of
    /// ours connected to each, returned in the same order. The QPs belong
    /// to `initiator` (name and epoch, from its handshake): connecting
    /// again (it reopened us) gives back its earlier QPs, reset for reuse;
    /// those of an initiator that went away are released by the engine's
    /// reaper, which probes it. At most
    /// [`MAX_CONNECT_ENDPOINTS`] per initiator and [`MAX_ACCEPTED_QPS`] in
    /// all, the least recently connected initiator giving way.
    /// `push_key`: its lanes check writes against mirrors of this
    /// engine's fence tables, and take the fences pushed with this key
    /// (`None`: every fence cuts it off).
    pub fn accept(
        &self,
        initiator: &Initiator,
        nics: usize,
        endpoints: &[QpEndpoint],
        push_key: Option<Vec<u8>>,
    ) -> Result<Vec<QpEndpoint>> {
        self.check_connect_shape(nics, endpoints.len())?;
        let released = self.with_accepted(|accepted| {
            let mut released = Vec::new();
            // Its own earlier QPs (it reconnects). Another identity's are
            // never touched here, even under the same name: whether that one
            // went away is for the reaper's probe to find out.
            let identity = (initiator.name.clone(), initiator.epoch);
            if let Some(set) = accepted.remove(&identity) {
                released.extend(set.qps);
            }
            while accepted.total + endpoints.len() > MAX_ACCEPTED_QPS {
                let Some(oldest) = accepted.least_recent() else { break };
                if let Some(set) = accepted.remove(&oldest) {
                    released.extend(set.qps);
                }
            }
            released
        });
        self.release_passive(released);
        let mut qps = Vec::with_capacity(endpoints.len());
        let made = (|| {
            for (index, remote) in endpoints.iter().enumerate() {
                let nic = index % nics;
                let spare = self.take(nic, true, 0)?;
                qps.push((nic, spare));
                self.connect_qp(spare.qp, *remote)?;
            }
            Ok(())
        })();
        if let Err(error) = made {
            self.release_passive(qps);
            return Err(error);
        }
        let ours = qps.iter().map(|(_, spare)| spare.endpoint).collect();
        let replaced = self.with_accepted(|accepted| accepted.insert(initiator, qps, push_key));
        self.release_passive(replaced.map(|set| set.qps).unwrap_or_default());
        Ok(ours)
    }
}

impl RdmaNode {
    /// Hands back accepted QPs: all moved to ERR first, so their
    /// IBV_EVENT_QP_LAST_WQE_REACHED come in together and the drains wait
    /// for the slowest once, not for each in turn; then each drained and
    /// reset for reuse (or destroyed).
    pub(super) fn release_passive(&self, qps: Vec<(usize, Spare)>) {
        for (_, spare) in &qps {
            let _ = self.verbs.modify_qp(spare.qp, crate::transport::rdma::verbs::QpTransition::Error);
        }
        for (nic, spare) in qps {
            self.keep_or_destroy(nic, spare, true);
        }
    }
}

impl Accepted {
    pub(super) fn remove(&mut self, identity: &Identity) -> Option<AcceptedSet> {
        let set = self.by_initiator.remove(identity)?;
        self.total -= set.qps.len();
        Some(set)
    }

    /// Books `initiator`'s QPs; hands back a set it replaces (two connects
    /// of one initiator raced: the later one holds).
    fn insert(
        &mut self,
        initiator: &Initiator,
        qps: Vec<(usize, Spare)>,
        push_key: Option<Vec<u8>>,
    ) -> Option<AcceptedSet> {
        self.clock += 1;
        self.total += qps.len();
        let set = AcceptedSet { qps, connected: self.clock, addr: initiator.addr.clone(), push_key };
        let old = self.by_initiator.insert((initiator.name.clone(), initiator.epoch), set)?;
        self.total -= old.qps.len();
        Some(old)
    }

    fn least_recent(&self) -> Option<Identity> {
        self.by_initiator.iter().min_by_key(|(_, set)| set.connected).map(|(identity, _)| identity.clone())
    }
}
