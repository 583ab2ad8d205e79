//! Ending chunks and parts: leases released, status and completions
//! published, counters bumped, a peer found gone marked stale.

use super::super::status::{BatchId, BatchState, PartEnd};
use super::poll::Lane;
use crate::error::Error;
use crate::log::ratelimit::{log_limited, RateLimit};
use crate::proto::ErrorCode;
use crate::ring::{Cqe, CqeKind, Opcode};
use crate::transport::TransferError;

impl Lane {
    /// Ends the chunks the links reported.
    pub(super) fn end_reported(&mut self) {
        let mut ended = std::mem::take(&mut self.ended);
        for (ticket, result) in ended.drain(..) {
            self.end_chunk(ticket as usize, result);
        }
        self.ended = ended;
    }

    fn end_chunk(&mut self, index: usize, result: Result<u64, TransferError>) {
        let Some(ticket) = self.tickets.get_mut(index) else { return };
        if ticket.outstanding == 0 {
            return;
        }
        ticket.outstanding -= 1;
        match result {
            Ok(bytes) => ticket.progress.bytes += bytes,
            Err((error, bytes)) => {
                ticket.progress.bytes += bytes;
                ticket.end.get_or_insert(PartEnd::Failed(error));
            }
        }
        let link = ticket.link;
        if ticket.outstanding == 0 {
            self.end_ticket(index);
        }
        // After the ticket: a detached link is dropped with its last chunk.
        if let Some(link) = link {
            self.links.chunk_ended(link);
        }
    }

    /// Ends a ticket whose chunks have all ended: releases its leases and
    /// publishes its part's status and completion (or a notification's
    /// result), then frees it.
    pub(super) fn end_ticket(&mut self, index: usize) {
        let Lane { shared, registry, rings, tickets, free_tickets, cq_backlog, config, links, .. } = self;
        let ticket = &mut tickets[index];
        ticket.live = false;
        for region in ticket.leases.drain(..) {
            // SAFETY: the submitter kept these leases for this part, whose
            // chunks have all ended; each is given back once, here.
            unsafe { registry.release_kept(region) };
        }
        let link = ticket.link.take().map(|link| links.get(link));
        let end = ticket.end.take();
        if let (Some(link), Some(PartEnd::Failed(error))) = (link, &end) {
            // The peer is gone or restarted, or the link broke: later
            // batches to this handle fail at once, and the next open of its
            // name reconnects.
            if matches!(error, Error::PeerRestarted { .. }) || link.state.is_broken() {
                // Logged by the first chunk that finds the link broken (its
                // other chunks and lanes find the handle stale already),
                // and limited besides: peers restart at their own pace.
                if !link.peer.is_stale() {
                    static LIMIT: RateLimit = RateLimit::per_second();
                    let peer = link.peer.descriptor();
                    log_limited!(
                        warn,
                        LIMIT,
                        segment = %peer.name,
                        epoch = format_args!("{:#x}", peer.epoch),
                        transport = link.state.kind().name(),
                        %error,
                        "link to a peer broke; its handle is stale"
                    );
                }
                link.peer.mark_stale();
            }
        }
        free_tickets.push(index as u32);
        if let Some(reply) = ticket.notify_reply.take() {
            let result = match end {
                Some(PartEnd::Failed(error)) => Err(error),
                _ => Ok(()),
            };
            let _ = reply.send(result);
            return;
        }
        let metrics = &shared.metrics;
        metrics.part_executed(ticket.progress.executed, ticket.progress.bytes);
        let Some(slot) = rings.get_mut(ticket.ring).and_then(Option::as_mut) else { return };
        slot.tickets -= 1;
        let sqe = ticket.sqe;
        let id = BatchId::from_raw(sqe.batch_id);
        let finished =
            slot.rings.status.finish_part(id, ticket.progress.bytes, end.unwrap_or(PartEnd::Done), result_code);
        if let (Some(op), true) = (Opcode::from_u8(sqe.opcode), ticket.started_ns != 0) {
            let transport = link.map(|l| l.state.kind());
            metrics.part(op, transport, ticket.progress.bytes);
            if let Some(completion) = &finished {
                let latency = config.clock.now_ns().saturating_sub(ticket.started_ns);
                metrics.batch(op, transport, completion.result, latency);
            }
        }
        if let Some(completion) = finished {
            let cqe = Cqe {
                user_data: sqe.user_data,
                batch_id: sqe.batch_id,
                bytes: completion.bytes,
                result: completion.result,
                kind: CqeKind::Batch as u32,
            };
            if slot.rings.cq.push(cqe).is_err() {
                cq_backlog.push_back((ticket.ring, cqe));
            }
        }
    }
}

/// A CQE's result: 0 for done, else the negated wire code of the outcome.
fn result_code(state: BatchState, failure: Option<&Error>) -> i32 {
    let code = match (state, failure) {
        (_, Some(error)) => error.code(),
        (BatchState::TimedOut, None) => ErrorCode::Timeout,
        (BatchState::Cancelled, None) => ErrorCode::Cancelled,
        (BatchState::Done | BatchState::Failed | BatchState::Free | BatchState::Pending, None) => return 0,
    };
    -(code as i32)
}
