//! How a connection's chunks end: in order through their replies, dropped
//! unsent when their batch already failed, or all at once when the
//! connection goes.

use super::{Awaited, Connection, FrameOp, Peer};
use crate::error::{Error, Result};
use crate::proto::ErrorCode;
use crate::transport::ChunkEnd;

impl Connection {
    /// Ends the oldest awaited chunk. A failed chunk's batch sends nothing
    /// more: its chunks not yet started are dropped from the queue at once,
    /// so the next batch does not wait behind them. An epoch mismatch kills
    /// the connection.
    pub(super) fn end_front(&mut self, result: Result<u64, (Error, u64)>, finished: &mut Vec<ChunkEnd>) -> Result<()> {
        let Some(mut ended) = self.awaiting.pop_front() else { return Ok(()) };
        self.release_window(&ended);
        let failure = match &result {
            Ok(_) => None,
            Err((Error::PeerRestarted { segment, detail }, _)) => {
                Some(Err(Error::PeerRestarted { segment: segment.clone(), detail: detail.clone() }))
            }
            Err((error, _)) => {
                Some(Ok((error.code(), format!("not sent: an earlier chunk of its batch failed ({error})"))))
            }
        };
        self.ended(ended.ticket, ended.chunk, result, finished);
        ended.spans.clear();
        self.spare.push(std::mem::take(&mut ended.spans));
        match failure {
            None => Ok(()),
            Some(Err(gone)) => Err(gone),
            Some(Ok(cause)) => {
                self.drop_unsent(ended.batch_id, &cause, finished);
                Ok(())
            }
        }
    }

    /// Drops the chunks of `batch_id` none of whose frames has started.
    pub(super) fn drop_unsent(&mut self, batch_id: u64, cause: &(ErrorCode, String), finished: &mut Vec<ChunkEnd>) {
        let error = || Error::Remote { code: cause.0, message: cause.1.clone() };
        self.drop_unsent_where(|entry| entry.batch_id == batch_id, error, finished);
    }

    /// Drops `ticket`'s chunks none of whose frames has started (its batch
    /// was cancelled): they end `Cancelled` with nothing moved. Returns how
    /// many; a chunk with a frame on its way stays, to end through its
    /// replies.
    pub fn withdraw_unsent(&mut self, ticket: u64, finished: &mut Vec<ChunkEnd>) -> usize {
        self.drop_unsent_where(|entry| entry.ticket == ticket, || Error::Cancelled { bytes: 0 }, finished)
    }

    /// Drops the chunks `matches` picks none of whose frames has started
    /// (or been sealed for sending), each ended with `error()`; returns how
    /// many.
    fn drop_unsent_where(
        &mut self,
        matches: impl Fn(&Awaited) -> bool,
        error: impl Fn() -> Error,
        finished: &mut Vec<ChunkEnd>,
    ) -> usize {
        // Chunk by chunk (a part's chunks share its ticket): a chunk with a
        // frame started or sent stays, to end through its replies.
        let started = (self.front_sent > 0).then(|| self.out.front().map(|f| f.chunk)).flatten();
        let (mut index, mut dropped_count) = (0, 0);
        while index < self.awaiting.len() {
            let entry = &self.awaiting[index];
            if !matches(entry) || entry.op == FrameOp::Notify || Some(entry.chunk) == started {
                index += 1;
                continue;
            }
            let chunk = entry.chunk;
            let unsent = self.out.iter().filter(|f| f.chunk == chunk && !f.sealed).count();
            if unsent != entry.spans.len() {
                index += 1;
                continue;
            }
            self.out.retain(|f| f.chunk != chunk);
            let Some(mut dropped) = self.awaiting.remove(index) else { break };
            self.release_window(&dropped);
            dropped.spans.clear();
            self.spare.push(std::mem::take(&mut dropped.spans));
            self.ended(dropped.ticket, chunk, Err((error(), 0)), finished);
            dropped_count += 1;
        }
        dropped_count
    }

    /// Reports chunk `chunk` of `ticket` ended; its id is kept, in the same
    /// order, for whoever tracks chunks (see [`Connection::track_chunks`]).
    pub(super) fn ended(
        &mut self,
        ticket: u64,
        chunk: u64,
        result: Result<u64, (Error, u64)>,
        finished: &mut Vec<ChunkEnd>,
    ) {
        finished.push((ticket, result));
        if self.track_chunks {
            self.ended_chunks.push(chunk);
        }
    }

    /// Keeps the ids of ended chunks, in the order their ends are reported
    /// (a part's chunks share its ticket, and do not always end in the
    /// order they were queued: an unsent chunk of a failed batch ends
    /// before one whose replies are still to come).
    pub fn track_chunks(&mut self) {
        self.track_chunks = true;
    }

    /// The ids of the chunks ended since the last call, in order.
    pub fn ended_chunks(&mut self) -> std::vec::Drain<'_, u64> {
        self.ended_chunks.drain(..)
    }

    /// Fails everything queued or awaited with `reason` (the connection is
    /// being dropped; nothing of theirs is touched afterwards).
    pub fn fail_all(&mut self, peer: &Peer, reason: &str, finished: &mut Vec<ChunkEnd>) {
        self.fail_each(finished, || peer.gone(reason.to_string()));
    }

    /// As [`Connection::fail_all`], each chunk failing as `why` says: a
    /// frame that failed its session MAC stays `Unauthorized` (nothing
    /// restarted; someone on the path tampered), anything else means the
    /// peer is gone.
    pub fn fail_all_for(&mut self, peer: &Peer, why: &Error, finished: &mut Vec<ChunkEnd>) {
        match why {
            Error::Unauthorized { reason } => {
                self.fail_each(finished, || Error::Unauthorized { reason: reason.clone() })
            }
            // Stalled, not restarted: the error says what may still land.
            Error::PeerStalled { segment, waited } => {
                self.fail_each(finished, || Error::PeerStalled { segment: segment.clone(), waited: *waited })
            }
            other => self.fail_all(peer, &Peer::detail(other), finished),
        }
    }

    pub(super) fn fail_each(&mut self, finished: &mut Vec<ChunkEnd>, error: impl Fn() -> Error) {
        self.out.clear();
        self.front_sent = 0;
        self.unacked_bytes = 0;
        while let Some(awaited) = self.awaiting.pop_front() {
            self.ended(awaited.ticket, awaited.chunk, Err((error(), awaited.moved)), finished);
        }
    }
}
