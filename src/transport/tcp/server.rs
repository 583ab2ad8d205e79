//! The target side of the TCP transport: one thread polls the listener and
//! every accepted data connection (non-blocking sockets, an epoll set),
//! and drives each connection's [`TargetConn`] state machine. A connection
//! costs one descriptor and a few hundred bytes while idle, not a thread.
//!
//! Every connection is booked with the listener's [`Admission`]: it must
//! open with a valid hello (and with a token, a session proof) within the
//! admission deadline; pending connections are bounded per source and in
//! total, and the oldest is closed to make room for a newcomer; a refusal
//! reaches the initiator as `Busy` in the server hello.

use super::hello::ServerHello;
use super::target::{TargetConn, TargetContext};
use crate::error::{Error, Result};
use crate::net::{Admission, AdmissionLimits, Arrival};
use polling::{Event, Events, PollMode, Poller};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use zerocopy::IntoBytes;

/// How often deadlines are checked while the loop would otherwise sleep.
const TICK: Duration = Duration::from_millis(100);
/// Pause of the accepts after `accept` failed (out of descriptors).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(10);
/// The listener's key in the poller; connections use their slot + 1.
const LISTENER_KEY: usize = 0;

/// A running data server.
#[derive(Debug)]
pub struct TcpDataServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    poller: Poller,
    stop: AtomicBool,
    /// Connections open now.
    connections: AtomicUsize,
}

impl TcpDataServer {
    /// Binds `listen` (only that address) and serves `ctx`'s regions within
    /// `limits`.
    pub(crate) fn start(listen: SocketAddr, ctx: TargetContext, limits: AdmissionLimits) -> Result<Self> {
        let listener = TcpListener::bind(listen)
            .map_err(|e| Error::io(format!("binding the tcp data listener on {listen}"), e))?;
        let addr = listener.local_addr().map_err(|e| Error::io("reading the tcp data listener address", e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io("making the data listener non-blocking", e))?;
        let poller = Poller::new().map_err(|e| Error::io("creating the data server's poller", e))?;
        // SAFETY: the listener is deleted from the poller before it is
        // dropped (at the end of `serve`, which owns both).
        unsafe { poller.add_with_mode(&listener, Event::readable(LISTENER_KEY), PollMode::Level) }
            .map_err(|e| Error::io("polling the data listener", e))?;
        let shared = Arc::new(Shared { poller, stop: AtomicBool::new(false), connections: AtomicUsize::new(0) });
        let for_thread = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvring-tcp-data".into())
            .spawn(move || Server::new(listener, ctx, limits, &for_thread).serve())
            .map_err(|e| Error::io("spawning the tcp data server", e))?;
        Ok(Self { addr, shared, thread: Some(thread) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and closes every connection (their leases given
    /// back), and waits for the server thread.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.shared.poller.notify();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for TcpDataServer {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Slot {
    stream: TcpStream,
    conn: TargetConn,
    /// The interest registered with the poller: (readable, writable).
    interest: (bool, bool),
}

struct Server<'a> {
    listener: TcpListener,
    ctx: TargetContext,
    shared: &'a Shared,
    admission: Admission<usize>,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    accept_paused_until: Option<Instant>,
}

impl<'a> Server<'a> {
    fn new(listener: TcpListener, ctx: TargetContext, limits: AdmissionLimits, shared: &'a Shared) -> Self {
        Self {
            listener,
            ctx,
            shared,
            admission: Admission::new(limits),
            slots: Vec::new(),
            free: Vec::new(),
            accept_paused_until: None,
        }
    }

    fn serve(mut self) {
        let mut events = Events::new();
        let mut last_tick = Instant::now();
        while !self.shared.stop.load(Ordering::Acquire) {
            events.clear();
            if self.shared.poller.wait(&mut events, Some(TICK)).is_err() {
                std::thread::sleep(ACCEPT_ERROR_PAUSE);
                continue;
            }
            let now = Instant::now();
            for event in events.iter() {
                if event.key == LISTENER_KEY {
                    self.accept(now);
                } else {
                    self.drive(event.key - 1, event.readable, event.writable, now);
                }
            }
            if now.duration_since(last_tick) >= TICK {
                last_tick = now;
                self.tick(now);
            }
        }
        for index in 0..self.slots.len() {
            self.close(index);
        }
        let _ = self.shared.poller.delete(&self.listener);
    }

    fn accept(&mut self, now: Instant) {
        if self.accept_paused_until.is_some_and(|until| now < until) {
            return;
        }
        loop {
            let (stream, source) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => {
                    // Out of descriptors (or memory): the listener stays
                    // readable, so pause instead of spinning on it.
                    self.pause_accepts(now);
                    return;
                }
            };
            let index = self.free.pop().unwrap_or(self.slots.len());
            match self.admission.arrive(index, source.ip(), now) {
                Arrival::Accept => {}
                Arrival::AcceptEvicting(old) => self.close_booked(old),
                Arrival::Refuse(bound) => {
                    refuse(&stream, bound, self.ctx.epoch);
                    if index < self.slots.len() {
                        self.free.push(index);
                    }
                    continue;
                }
            }
            if self.open(index, stream, now).is_err() {
                self.admission.leave(index);
                if index < self.slots.len() {
                    self.free.push(index);
                }
            }
        }
    }

    fn pause_accepts(&mut self, now: Instant) {
        self.accept_paused_until = Some(now + ACCEPT_ERROR_PAUSE);
        let _ = self.shared.poller.modify_with_mode(&self.listener, Event::none(LISTENER_KEY), PollMode::Level);
    }

    fn open(&mut self, index: usize, stream: TcpStream, now: Instant) -> std::io::Result<()> {
        stream.set_nonblocking(true)?;
        let _ = stream.set_nodelay(true);
        // SAFETY: the stream is deleted from the poller in `close`, before
        // it is dropped.
        unsafe { self.shared.poller.add_with_mode(&stream, Event::readable(index + 1), PollMode::Level)? };
        let conn = TargetConn::new(now, self.admission.limits().timeout);
        let slot = Slot { stream, conn, interest: (true, false) };
        if index == self.slots.len() {
            self.slots.push(Some(slot));
        } else {
            self.slots[index] = Some(slot);
        }
        self.shared.connections.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Serves one connection's readiness.
    fn drive(&mut self, index: usize, readable: bool, writable: bool, now: Instant) {
        let Server { ctx, admission, slots, .. } = self;
        let Some(Some(slot)) = slots.get_mut(index) else { return };
        let mut admit = || admission.admit(index);
        let mut outcome = Ok(());
        if readable && slot.conn.wants_read() {
            outcome = slot.conn.on_readable(&mut slot.stream, ctx, &mut admit, now).map(drop);
        }
        if outcome.is_ok() && (writable || slot.conn.wants_write()) {
            outcome = slot.conn.on_writable(&mut slot.stream, ctx).map(drop);
        }
        let done = outcome.is_err() || slot.conn.finished();
        if !done {
            let interest = (slot.conn.wants_read(), slot.conn.wants_write());
            if interest != slot.interest {
                slot.interest = interest;
                let mut event = Event::none(index + 1);
                event.readable = interest.0;
                event.writable = interest.1;
                let _ = self.shared.poller.modify_with_mode(&slot.stream, event, PollMode::Level);
            }
            return;
        }
        self.close_booked(index);
    }

    /// Deadlines: unproven connections past the admission deadline, frames
    /// that take too long, idle connections; and idle buffers freed.
    fn tick(&mut self, now: Instant) {
        if self.accept_paused_until.is_some_and(|until| now >= until) {
            self.accept_paused_until = None;
            let _ = self.shared.poller.modify_with_mode(&self.listener, Event::readable(LISTENER_KEY), PollMode::Level);
        }
        let mut expired = Vec::new();
        self.admission.expire(now, &mut expired);
        for index in expired {
            if let Some(Some(slot)) = self.slots.get_mut(index) {
                slot.conn.too_late(self.ctx.epoch);
            }
            self.close(index);
        }
        for index in 0..self.slots.len() {
            let Some(slot) = self.slots[index].as_mut() else { continue };
            if slot.conn.expired(now).is_some() {
                self.close_booked(index);
            } else {
                slot.conn.shrink_if_idle(now);
            }
        }
    }

    /// Closes a connection and takes it out of the admission book.
    fn close_booked(&mut self, index: usize) {
        self.admission.leave(index);
        self.close(index);
    }

    fn close(&mut self, index: usize) {
        let Some(mut slot) = self.slots.get_mut(index).and_then(Option::take) else { return };
        // Whatever is queued (a refusal, the last replies) gets one try.
        let _ = slot.conn.on_writable(&mut slot.stream, &self.ctx);
        slot.conn.release(&self.ctx);
        let _ = self.shared.poller.delete(&slot.stream);
        let _ = slot.stream.shutdown(std::net::Shutdown::Both);
        self.free.push(index);
        self.shared.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Answers a refused connection's hello with `Busy` (best effort: the
/// socket is fresh, so a 40-byte write fits its buffer) and closes it.
fn refuse(stream: &TcpStream, bound: &'static str, epoch: u64) {
    let _ = stream.set_nonblocking(true);
    let refusal = ServerHello::refusal(&Error::Busy { queue: bound, capacity: 0 }, epoch);
    let _ = std::io::Write::write(&mut &*stream, refusal.as_bytes());
}
