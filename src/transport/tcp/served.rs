//! The target's data connections as one lane serves them: the lane adopts
//! connections the acceptor hands it, registers each with its poller, and
//! drives each one's [`TargetConn`] state machine when the poller says the
//! socket is ready, from the same loop that drains its rings. An idle
//! connection costs its descriptor and a few hundred bytes (its read buffer
//! is freed after a second of quiet), never a thread.
//!
//! Admission is the listener's, shared with the acceptor: a connection is
//! booked pending when accepted, admitted here when its hello proves itself,
//! and leaves the book when this lane closes it.

use super::target::{StagingSlot, TargetConn, TargetContext};
use crate::net::{Admission, IdleCell};
use crate::transport::Service;
use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};
use std::collections::HashMap;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One served connection.
#[derive(Debug)]
struct Slot {
    stream: TcpStream,
    conn: TargetConn,
    /// Its admission id.
    id: u64,
    /// Its idleness as the admission book reads it (a newcomer of a source
    /// below its fair share may take the place of a quiet connection of a
    /// source above it), kept here with no lock.
    idle: Option<Arc<IdleCell>>,
    /// What `idle` was last told: true once marked idle.
    quiet: bool,
}

impl Slot {
    /// Marks the connection idle in the book once it is quiet (between
    /// frames, nothing in hand); it stays busy otherwise.
    fn mark_quiet(&mut self, now: Instant) {
        if !self.quiet && self.conn.quiet() {
            if let Some(idle) = &self.idle {
                // False only once evicted: its lane closes it on the
                // `Evict` that follows.
                self.quiet = idle.idle(now);
            }
        }
    }

    /// Marks it busy before anything it sent is read. False once its place
    /// was taken: it is closed, and nothing more of it is served.
    fn mark_busy(&mut self) -> bool {
        if !self.quiet {
            return true;
        }
        self.quiet = false;
        self.idle.as_ref().is_none_or(|idle| idle.busy())
    }
}

/// One lane's share of a target's data connections.
#[derive(Debug)]
pub(crate) struct Served {
    ctx: Arc<TargetContext>,
    admission: Arc<Mutex<Admission<u64>>>,
    timeout: Duration,
    /// By poller key.
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    by_id: HashMap<u64, usize>,
    /// Connections held, read by the acceptor to pick the least loaded lane.
    load: Arc<AtomicUsize>,
    /// Connections that stopped at their read budget with bytes perhaps
    /// left: driven again next round (their socket raises no new edge).
    again: Vec<usize>,
    /// `again` as it is being driven (kept to reuse its allocation).
    driving: Vec<usize>,
    /// The lane's staging of GPU regions' bytes.
    stage: StagingSlot,
    /// Keys of connections' staging copies, to their slots.
    by_key: HashMap<u32, usize>,
    next_key: u32,
    /// Connections waiting for staging pages.
    stalled: Vec<usize>,
}

impl Served {
    /// An empty share of the target `ctx`, booking with `admission`; `load`
    /// counts its connections for the acceptor.
    /// The lane's `copies` counters count its staging copies' methods.
    pub(crate) fn new(
        ctx: Arc<TargetContext>,
        admission: Arc<Mutex<Admission<u64>>>,
        load: Arc<AtomicUsize>,
        copies: Arc<crate::gpu::CopyCounters>,
        staging: Arc<crate::transport::stage::StageCounters>,
    ) -> Self {
        let timeout = lock(&admission).limits().timeout;
        Self {
            ctx,
            admission,
            timeout,
            slots: Vec::new(),
            free: Vec::new(),
            by_id: HashMap::new(),
            load,
            again: Vec::new(),
            driving: Vec::new(),
            stage: StagingSlot::new(copies, staging),
            by_key: HashMap::new(),
            next_key: 0,
            stalled: Vec::new(),
        }
    }

    /// Settles the staging copies that ended; their connections are driven
    /// again (a gated reply may go), and so is every connection that waited
    /// for pages.
    fn settle_copies(&mut self) -> bool {
        let Served { ctx, slots, stage, by_key, again, stalled, .. } = self;
        let settled = stage.poll(ctx, |id, result, stage| {
            let Some(&index) = by_key.get(&((id >> 32) as u32)) else { return };
            if let Some(Some(slot)) = slots.get_mut(index) {
                slot.conn.copy_ended(ctx, id, result, stage);
                again.push(index);
            }
        });
        // Pages went back (a copy settled, a READ reply from pages sent):
        // whoever waits for one tries again.
        if settled | stage.take_returned() {
            for index in stalled.drain(..) {
                if let Some(Some(slot)) = slots.get_mut(index) {
                    slot.conn.unstall();
                    again.push(index);
                }
            }
        }
        settled
    }

    /// Closes the connection in `index`; `booked`: it still has its place
    /// in the admission book, which it gives back.
    fn close(&mut self, registry: &Registry, index: usize, booked: bool) {
        let Some(mut slot) = self.slots.get_mut(index).and_then(Option::take) else { return };
        // Whatever is queued (a refusal, the last replies) gets one try.
        let _ = slot.conn.on_writable(&mut slot.stream, &self.ctx, &mut self.stage);
        slot.conn.release(&self.ctx, &mut self.stage);
        self.by_key.retain(|_, &mut at| at != index);
        let _ = registry.deregister(&mut SourceFd(&slot.stream.as_raw_fd()));
        let _ = slot.stream.shutdown(std::net::Shutdown::Both);
        self.by_id.remove(&slot.id);
        self.free.push(index);
        self.load.fetch_sub(1, Ordering::Relaxed);
        if booked {
            lock(&self.admission).leave(slot.id);
        }
    }
}

impl Service for Served {
    fn adopt(&mut self, registry: &Registry, stream: TcpStream, id: u64, now: Instant) {
        let index = self.free.pop().unwrap_or(self.slots.len());
        // Edge-triggered, both ways: `ready` drives the connection until its
        // socket would block; it leaves the poller in `close`, before the
        // stream drops.
        let registered = stream.set_nonblocking(true).and_then(|()| {
            let _ = stream.set_nodelay(true);
            let interest = Interest::READABLE | Interest::WRITABLE;
            registry.register(&mut SourceFd(&stream.as_raw_fd()), Token(index), interest)
        });
        if registered.is_err() {
            self.free.push(index);
            lock(&self.admission).leave(id);
            return;
        }
        let mut conn = TargetConn::new(now, self.timeout);
        self.next_key = self.next_key.wrapping_add(1);
        conn.set_stage_key(self.next_key);
        self.by_key.insert(self.next_key, index);
        let idle = lock(&self.admission).watch(id);
        let slot = Slot { stream, conn, id, idle, quiet: false };
        if index == self.slots.len() {
            self.slots.push(Some(slot));
        } else {
            self.slots[index] = Some(slot);
        }
        self.by_id.insert(id, index);
        self.load.fetch_add(1, Ordering::Relaxed);
    }

    fn evict(&mut self, registry: &Registry, id: u64, too_late: bool) {
        let Some(&index) = self.by_id.get(&id) else { return };
        if too_late {
            if let Some(Some(slot)) = self.slots.get_mut(index) {
                slot.conn.too_late(self.ctx.epoch);
            }
        }
        // Out of the book already (evicted or expired there).
        self.close(registry, index, false);
    }

    fn ready(&mut self, registry: &Registry, index: usize, now: Instant) -> bool {
        let Served { ctx, admission, slots, stage, .. } = self;
        let Some(Some(slot)) = slots.get_mut(index) else { return false };
        if !slot.mark_busy() {
            // Evicted for a newcomer while quiet: out of the book already.
            self.close(registry, index, false);
            return true;
        }
        let id = slot.id;
        let mut admit = || lock(admission).admit(id);
        // Edge-triggered: read until the socket would block (or too many
        // replies wait), write until it would block (or none is left), and
        // again while either moved, since written replies make room to
        // read. What stops the loop is a socket that would block (its next
        // edge wakes the lane) or nothing left to do.
        let mut moved = false;
        let outcome = loop {
            let read = match slot.conn.on_readable(&mut slot.stream, ctx, &mut admit, now, stage) {
                Ok(read) => read,
                Err(close) => break Err(close),
            };
            let wrote = match slot.conn.on_writable(&mut slot.stream, ctx, stage) {
                Ok(wrote) => wrote,
                Err(close) => break Err(close),
            };
            moved |= read | wrote;
            if slot.conn.finished() || slot.conn.unread() || !(read || wrote) {
                break Ok(());
            }
        };
        if outcome.is_ok() && !slot.conn.finished() {
            if slot.conn.unread() {
                self.again.push(index);
            }
            if slot.conn.stalled() && !self.stalled.contains(&index) {
                self.stalled.push(index);
            }
            slot.mark_quiet(now);
            return moved;
        }
        self.close(registry, index, true);
        true
    }

    fn drive_again(&mut self, registry: &Registry, now: Instant) -> bool {
        let settled = self.settle_copies();
        if self.again.is_empty() {
            return settled;
        }
        std::mem::swap(&mut self.again, &mut self.driving);
        let mut moved = false;
        let mut driving = std::mem::take(&mut self.driving);
        for index in driving.drain(..) {
            // A closed (or reused) slot is driven harmlessly: it reads what
            // its own socket has.
            moved |= self.ready(registry, index, now);
        }
        self.driving = driving;
        moved | settled
    }

    fn waiting_on_copies(&self) -> bool {
        self.stage.running()
    }

    fn tick(&mut self, registry: &Registry, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for index in 0..self.slots.len() {
            let Some(slot) = self.slots[index].as_mut() else { continue };
            if slot.conn.expired(now).is_some() {
                // A hello out of time is told so; the rest just close.
                slot.conn.too_late(self.ctx.epoch);
                self.close(registry, index, true);
                continue;
            }
            if slot.conn.stall_expired(now) {
                // No page came back in time: driven again, its frame is
                // refused `Busy` rather than left waiting for ever.
                slot.conn.unstall();
                self.stalled.retain(|&at| at != index);
                self.again.push(index);
            }
            slot.conn.shrink_if_idle(now);
            // One whose staging copies settled since it was last driven.
            slot.mark_quiet(now);
            let deadline = slot.conn.next_deadline();
            next = Some(next.map_or(deadline, |n| n.min(deadline)));
        }
        next
    }

    fn close_all(&mut self, registry: &Registry) {
        for index in 0..self.slots.len() {
            self.close(registry, index, true);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
