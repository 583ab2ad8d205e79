//! The target side of the TCP transport: one acceptor thread books every
//! new data connection with the listener's [`Admission`] and hands it to
//! the least loaded lane, whose loop serves it from then on (`served.rs`).
//! The acceptor holds no connection and reads no byte; the engine's threads
//! are its lanes and a fixed few, whatever the number of peers.
//!
//! A connection must open with a valid hello (and with a token, a session
//! proof) within the admission deadline; pending connections are bounded
//! per source and in total, and the oldest is closed to make room for a
//! newcomer; a refusal reaches the initiator as `Busy` in the server hello.

use super::hello::ServerHello;
use crate::error::{Error, Result};
use crate::net::{Admission, Arrival};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zerocopy::IntoBytes;

/// Pause of the accepts after `accept` failed (out of descriptors).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(10);
/// How often the book is swept of connections pending past their deadline
/// while some are pending (the lanes close their own; this only keeps the
/// book from holding them).
const SWEEP: Duration = Duration::from_millis(500);
/// Bits of a connection id that name its lane.
pub(crate) const LANE_BITS: u32 = 16;

/// Where the acceptor sends connections: the engine's lanes.
pub(crate) trait Dispatch: Send + Sync + std::fmt::Debug {
    /// How many lanes there are.
    fn lanes(&self) -> usize;
    /// Connections lane `lane` serves now.
    fn load(&self, lane: usize) -> usize;
    /// Hands lane `lane` a connection booked under `id`.
    fn adopt(&self, lane: usize, stream: TcpStream, id: u64);
    /// Asks lane `lane` to close connection `id` (out of the book already);
    /// `too_late`: it did not prove itself in time, and is told so.
    fn evict(&self, lane: usize, id: u64, too_late: bool);
}

/// A running data listener.
#[derive(Debug)]
pub struct TcpDataServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    /// Wakes the acceptor (to stop).
    waker: Waker,
    stop: AtomicBool,
}

/// The listener's key in the acceptor's poller; the waker's is the other.
const LISTENER: Token = Token(0);

impl TcpDataServer {
    /// Binds `listen` (only that address) and accepts into `lanes`, booking
    /// with `admission`; `epoch` goes into refusals.
    pub(crate) fn start(
        listen: SocketAddr,
        admission: Arc<Mutex<Admission<u64>>>,
        lanes: Arc<dyn Dispatch>,
        epoch: u64,
    ) -> Result<Self> {
        let listener = TcpListener::bind(listen)
            .map_err(|e| Error::io(format!("binding the tcp data listener on {listen}"), e))?;
        let addr = listener.local_addr().map_err(|e| Error::io("reading the tcp data listener address", e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io("making the data listener non-blocking", e))?;
        let poll = Poll::new().map_err(|e| Error::io("creating the data listener's poller", e))?;
        // The listener leaves the poller when both drop, together, at the
        // end of `serve`.
        poll.registry()
            .register(&mut SourceFd(&listener.as_raw_fd()), LISTENER, Interest::READABLE)
            .map_err(|e| Error::io("polling the data listener", e))?;
        let waker = Waker::new(poll.registry(), Token(1)).map_err(|e| Error::io("creating the acceptor's waker", e))?;
        let shared = Arc::new(Shared { waker, stop: AtomicBool::new(false) });
        let acceptor = Acceptor { listener, poll, admission, lanes, epoch, shared: shared.clone(), next_id: 0 };
        let thread = std::thread::Builder::new()
            .name("kvring-tcp-accept".into())
            .spawn(move || acceptor.serve())
            .map_err(|e| Error::io("spawning the tcp acceptor", e))?;
        Ok(Self { addr, shared, thread: Some(thread) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting and waits for the acceptor (the lanes close the
    /// connections they serve when they stop).
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.shared.waker.wake();
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

struct Acceptor {
    listener: TcpListener,
    poll: Poll,
    admission: Arc<Mutex<Admission<u64>>>,
    lanes: Arc<dyn Dispatch>,
    epoch: u64,
    shared: Arc<Shared>,
    next_id: u64,
}

impl Acceptor {
    fn serve(mut self) {
        let mut events = Events::with_capacity(16);
        let mut paused_until: Option<Instant> = None;
        while !self.shared.stop.load(Ordering::Acquire) {
            // Asleep until a connection arrives, unless the book has pending
            // entries to sweep or the accepts are paused.
            let pending = lock(&self.admission).pending() > 0;
            let timeout = match (paused_until, pending) {
                (Some(until), _) => Some(until.saturating_duration_since(Instant::now())),
                (None, true) => Some(SWEEP),
                (None, false) => None,
            };
            if self.poll.poll(&mut events, timeout).is_err() {
                std::thread::sleep(ACCEPT_ERROR_PAUSE);
                continue;
            }
            let now = Instant::now();
            if paused_until.is_some_and(|until| now >= until) {
                paused_until = None;
            }
            // Edge-triggered: accept until the listener would block, on
            // every wake; after a pause too, since connections that queued
            // meanwhile raise no new edge.
            if paused_until.is_none() && !self.accept(now) {
                // Out of descriptors (or memory): pause rather than spin.
                paused_until = Some(now + ACCEPT_ERROR_PAUSE);
            }
            self.sweep(now);
        }
    }

    /// Accepts what waits; false when `accept` failed for want of
    /// resources.
    fn accept(&mut self, now: Instant) -> bool {
        loop {
            let (stream, source) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return false,
            };
            let lane = (0..self.lanes.lanes()).min_by_key(|&lane| self.lanes.load(lane)).unwrap_or(0);
            self.next_id += 1;
            let id = (self.next_id << LANE_BITS) | lane as u64;
            let arrival = lock(&self.admission).arrive(id, source.ip(), now);
            match arrival {
                Arrival::Accept => {}
                Arrival::AcceptEvicting(old) => self.lanes.evict(lane_of(old), old, false),
                Arrival::Refuse(bound) => {
                    refuse(&stream, bound, self.epoch);
                    continue;
                }
            }
            self.lanes.adopt(lane, stream, id);
        }
    }

    /// Takes connections pending past their deadline out of the book and
    /// has their lanes tell them so and close them.
    fn sweep(&mut self, now: Instant) {
        let mut expired = Vec::new();
        lock(&self.admission).expire(now, &mut expired);
        for id in expired {
            self.lanes.evict(lane_of(id), id, true);
        }
    }
}

/// The lane a connection id was handed to.
fn lane_of(id: u64) -> usize {
    (id & ((1 << LANE_BITS) - 1)) as usize
}

/// Answers a refused connection's hello with `Busy` (best effort: the
/// socket is fresh, so a 40-byte write fits its buffer) and closes it.
fn refuse(stream: &TcpStream, bound: &'static str, epoch: u64) {
    let _ = stream.set_nonblocking(true);
    let refusal = ServerHello::refusal(&Error::Busy { queue: bound, capacity: 0 }, epoch);
    let _ = std::io::Write::write(&mut &*stream, refusal.as_bytes());
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
