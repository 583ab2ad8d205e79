//! What an open Python engine holds, and the batch helpers its methods share.

use crate::{Batch, BlockDesc, Engine, Error, Outcome, Region, Segment, Submitter, TransportKind};
use std::collections::HashMap;
use std::time::Duration;

/// What an open engine holds.
pub(super) struct Open {
    pub(super) engine: Engine,
    pub(super) submitter: Submitter,
    /// Regions this module allocated (`alloc`), by raw id.
    pub(super) allocated: HashMap<u64, Region>,
    /// The transport each segment name is opened with (None: the engine's order).
    pub(super) transports: HashMap<String, Option<TransportKind>>,
}

impl Open {
    /// The segment for `name`, opened (or found in the engine's cache) with
    /// the transport asked for it.
    pub(super) fn segment(&mut self, name: &str, timeout: Duration) -> crate::Result<Segment> {
        let kind = self.transports.get(name).copied().flatten();
        self.engine.open_segment_with(name, kind, timeout)
    }

    /// Turns (local address, remote address, length) triples into
    /// descriptors; a remote address the handle's region table lacks
    /// reopens the segment once (the peer may have registered it since).
    pub(super) fn descs_from_addrs(
        &mut self,
        name: &str,
        locals: &[u64],
        remotes: &[u64],
        lengths: &[u64],
        timeout: Duration,
    ) -> crate::Result<(Segment, Vec<BlockDesc>)> {
        if locals.len() != remotes.len() || locals.len() != lengths.len() {
            return Err(Error::invalid(
                "batch",
                format!("{} local addresses, {} remote, {} lengths", locals.len(), remotes.len(), lengths.len()),
            ));
        }
        let mut segment = self.segment(name, timeout)?;
        let mut descs = Vec::with_capacity(locals.len());
        let mut reopened = false;
        for ((&local, &remote), &len) in locals.iter().zip(remotes).zip(lengths) {
            let (local_region, local_offset) = self.engine.locate(local, len)?;
            let (remote_region, remote_offset) = match segment.locate(remote, len) {
                Ok(found) => found,
                Err(_) if !reopened => {
                    reopened = true;
                    self.engine.close_segment(&segment);
                    segment = self.segment(name, timeout)?;
                    segment.locate(remote, len)?
                }
                Err(error) => return Err(error),
            };
            descs.push(BlockDesc::new(local_region, local_offset, remote_region, remote_offset, len));
        }
        Ok((segment, descs))
    }

    /// Submits one batch with `timeout` as its deadline, checksummed end
    /// to end as `checksum` says (`None`: as the engine's setting).
    pub(super) fn submit(
        &mut self,
        segment: &Segment,
        write: bool,
        descs: &[BlockDesc],
        timeout: Duration,
        checksum: Option<bool>,
    ) -> crate::Result<crate::BatchId> {
        let batch = if write { Batch::write(segment) } else { Batch::read(segment) };
        let batch = batch.descs(descs).deadline(timeout);
        self.submitter.submit(&match checksum {
            Some(on) => batch.checksum(on),
            None => batch,
        })
    }

    // `submit`'s parameters again, on purpose: `run` is `submit` then a wait (docs/DUPLICATES.md).
    /// Submits one batch and waits for it (a little past its deadline).
    pub(super) fn run(
        &mut self,
        segment: &Segment,
        write: bool,
        descs: &[BlockDesc],
        timeout: Duration,
        checksum: Option<bool>,
    ) -> crate::Result<u64> {
        let id = self.submit(segment, write, descs, timeout, checksum)?;
        finish(self.submitter.wait(id, timeout + Duration::from_secs(1))?)
    }
}

pub(super) fn finish(outcome: Outcome) -> crate::Result<u64> {
    match outcome {
        Outcome::Done { bytes } => Ok(bytes),
        Outcome::Failed(error) => Err(error),
        Outcome::TimedOut { bytes } => Err(Error::DeadlinePassed { bytes }),
        Outcome::Cancelled { bytes } => Err(Error::Cancelled { bytes }),
    }
}
