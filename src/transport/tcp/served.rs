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

use super::target::{TargetConn, TargetContext};
use crate::net::Admission;
use crate::transport::Service;
use polling::{Event, PollMode, Poller};
use std::collections::HashMap;
use std::net::TcpStream;
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
    /// The interest registered with the poller: (readable, writable).
    interest: (bool, bool),
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
}

impl Served {
    /// An empty share of the target `ctx`, booking with `admission`; `load`
    /// counts its connections for the acceptor.
    pub(crate) fn new(ctx: Arc<TargetContext>, admission: Arc<Mutex<Admission<u64>>>, load: Arc<AtomicUsize>) -> Self {
        let timeout = lock(&admission).limits().timeout;
        Self { ctx, admission, timeout, slots: Vec::new(), free: Vec::new(), by_id: HashMap::new(), load }
    }

    /// Closes the connection in `index`; `booked`: it still has its place
    /// in the admission book, which it gives back.
    fn close(&mut self, poller: &Poller, index: usize, booked: bool) {
        let Some(mut slot) = self.slots.get_mut(index).and_then(Option::take) else { return };
        // Whatever is queued (a refusal, the last replies) gets one try.
        let _ = slot.conn.on_writable(&mut slot.stream, &self.ctx);
        slot.conn.release(&self.ctx);
        let _ = poller.delete(&slot.stream);
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
    fn adopt(&mut self, poller: &Poller, stream: TcpStream, id: u64, now: Instant) {
        let index = self.free.pop().unwrap_or(self.slots.len());
        let registered = stream.set_nonblocking(true).and_then(|()| {
            let _ = stream.set_nodelay(true);
            // SAFETY: the stream is deleted from the poller in `close`,
            // before it is dropped.
            unsafe { poller.add_with_mode(&stream, Event::readable(index), PollMode::Level) }
        });
        if registered.is_err() {
            self.free.push(index);
            lock(&self.admission).leave(id);
            return;
        }
        let slot = Slot { stream, conn: TargetConn::new(now, self.timeout), id, interest: (true, false) };
        if index == self.slots.len() {
            self.slots.push(Some(slot));
        } else {
            self.slots[index] = Some(slot);
        }
        self.by_id.insert(id, index);
        self.load.fetch_add(1, Ordering::Relaxed);
    }

    fn evict(&mut self, poller: &Poller, id: u64, too_late: bool) {
        let Some(&index) = self.by_id.get(&id) else { return };
        if too_late {
            if let Some(Some(slot)) = self.slots.get_mut(index) {
                slot.conn.too_late(self.ctx.epoch);
            }
        }
        // Out of the book already (evicted or expired there).
        self.close(poller, index, false);
    }

    fn ready(&mut self, poller: &Poller, index: usize, readable: bool, writable: bool, now: Instant) -> bool {
        let Served { ctx, admission, slots, .. } = self;
        let Some(Some(slot)) = slots.get_mut(index) else { return false };
        let id = slot.id;
        let mut admit = || lock(admission).admit(id);
        let mut moved = false;
        let mut outcome = Ok(());
        if readable && slot.conn.wants_read() {
            outcome = slot.conn.on_readable(&mut slot.stream, ctx, &mut admit, now).map(|m| moved |= m);
        }
        if outcome.is_ok() && (writable || slot.conn.wants_write()) {
            outcome = slot.conn.on_writable(&mut slot.stream, ctx).map(|m| moved |= m);
        }
        if outcome.is_ok() && !slot.conn.finished() {
            let interest = (slot.conn.wants_read(), slot.conn.wants_write());
            if interest != slot.interest {
                slot.interest = interest;
                let mut event = Event::none(index);
                event.readable = interest.0;
                event.writable = interest.1;
                let _ = poller.modify_with_mode(&slot.stream, event, PollMode::Level);
            }
            return moved;
        }
        self.close(poller, index, true);
        true
    }

    fn tick(&mut self, poller: &Poller, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        for index in 0..self.slots.len() {
            let Some(slot) = self.slots[index].as_mut() else { continue };
            if slot.conn.expired(now).is_some() {
                // A hello out of time is told so; the rest just close.
                slot.conn.too_late(self.ctx.epoch);
                self.close(poller, index, true);
                continue;
            }
            slot.conn.shrink_if_idle(now);
            let deadline = slot.conn.next_deadline();
            next = Some(next.map_or(deadline, |n| n.min(deadline)));
        }
        next
    }

    fn close_all(&mut self, poller: &Poller) {
        for index in 0..self.slots.len() {
            self.close(poller, index, true);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
