//! The accept loop of the servers that give each connection a thread (the
//! control plane and `/metrics`, whose requests are few and may be slow;
//! threads are reused, [`super::workers`]):
//! bind exactly the address given, book every connection with the
//! listener's [`Admission`], and a stop that wakes the accept and cuts
//! every open connection, so peers see the engine gone at once.

use super::admission::{Admission, AdmissionLimits, Arrival};
use super::workers::Workers;
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The longest `stop` waits for connection threads to end.
const CONNECTION_DRAIN: Duration = Duration::from_secs(5);
/// Pause after a failed `accept` (out of descriptors, say), so the loop
/// does not spin on a condition that lasts.
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(10);

struct Shared {
    stop: AtomicBool,
    active: AtomicUsize,
    /// The threads connections are served on.
    workers: Arc<Workers>,
    /// The admission book and a handle on every open connection, for
    /// evictions and for `stop`.
    book: Mutex<Book>,
}

struct Book {
    admission: Admission<u64>,
    open: HashMap<u64, TcpStream>,
}

impl Shared {
    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        // Every critical section leaves the book consistent.
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What a connection's thread sees of its server.
#[derive(Debug)]
pub(crate) struct Admitted<'a> {
    id: u64,
    shared: &'a Shared,
    accepted: Instant,
    timeout: Duration,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("active", &self.active).finish_non_exhaustive()
    }
}

impl Admitted<'_> {
    /// True once the server is stopping.
    pub(crate) fn stopping(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    /// The connection proved itself; `Err` names the bound that refuses
    /// it (the caller answers `Busy` and closes).
    pub(crate) fn admit(&self) -> std::result::Result<(), &'static str> {
        self.shared.book().admission.admit(self.id)
    }

    /// A request began: the connection may not be evicted until
    /// [`Admitted::idle`]. False if it was evicted already (while idle):
    /// the caller ends it without serving the request.
    pub(crate) fn busy(&self) -> bool {
        self.shared.book().admission.busy(self.id)
    }

    /// The request is answered and the connection waits for the next: if
    /// admitted, it may now be evicted for a newcomer while its source holds
    /// more than its fair share of the table (its socket is shut down, so
    /// its next read ends it).
    pub(crate) fn idle(&self) {
        self.shared.book().admission.idle(self.id, Instant::now());
    }

    /// When the connection must have proved itself by.
    pub(crate) fn admission_deadline(&self) -> Instant {
        self.accepted + self.timeout
    }
}

/// A running accept loop.
pub(crate) struct Acceptor {
    addr: SocketAddr,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acceptor").field("addr", &self.addr).field("active", &self.shared.active).finish()
    }
}

impl Acceptor {
    /// Binds `listen` and serves each connection with `serve(stream, conn)`
    /// on its own thread, within `limits`; a connection the book refuses is
    /// handed to `refuse` (with the bound's name, to answer why) and
    /// closed. std sets SO_REUSEADDR on Unix listeners, so a restarted
    /// engine can bind the same port at once.
    pub(crate) fn start(
        listen: SocketAddr,
        what: &'static str,
        limits: AdmissionLimits,
        refuse: impl Fn(&mut TcpStream, &'static str) + Send + 'static,
        serve: impl Fn(TcpStream, &Admitted<'_>) + Send + Sync + 'static,
    ) -> Result<Self> {
        let listener =
            TcpListener::bind(listen).map_err(|e| Error::io(format!("binding {what} listener on {listen}"), e))?;
        let addr = listener.local_addr().map_err(|e| Error::io(format!("reading {what} listener address"), e))?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            workers: Workers::start("kvring-conn"),
            book: Mutex::new(Book { admission: Admission::new(limits), open: HashMap::new() }),
        });
        let for_thread = shared.clone();
        let serve = Arc::new(serve);
        let thread = std::thread::Builder::new()
            .name(format!("kvring-{what}"))
            .spawn(move || accept_loop(listener, for_thread, refuse, serve))
            .map_err(|e| Error::io(format!("spawning the {what} accept thread"), e))?;
        Ok(Self { addr, shared, thread: Some(thread) })
    }

    /// The bound address (with the real port when 0 was asked for).
    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, joins the accept thread, cuts open connections and
    /// waits (a bounded while) for their threads to end, so that when it
    /// returns nothing serves peers any more and nothing of the server's
    /// state is held by a connection thread.
    pub(crate) fn stop(&mut self) {
        if self.shared.stop.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wake the blocking accept with one connection of our own.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        for stream in std::mem::take(&mut self.shared.book().open).into_values() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        // A cut connection's thread sees its stream end at once; one in the
        // middle of a request finishes it first.
        let waited = Instant::now();
        while self.shared.active.load(Ordering::Acquire) > 0 && waited.elapsed() < CONNECTION_DRAIN {
            std::thread::sleep(Duration::from_millis(1));
        }
        // The waiting threads hold nothing of the server's but may as well
        // go now.
        self.shared.workers.stop();
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A served connection's clean-up: out of the book, out of the count.
struct Leave<'a> {
    id: u64,
    shared: &'a Shared,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        {
            let mut book = self.shared.book();
            book.open.remove(&self.id);
            book.admission.leave(self.id);
        }
        self.shared.active.fetch_sub(1, Ordering::AcqRel);
    }
}

fn accept_loop<S>(
    listener: TcpListener,
    shared: Arc<Shared>,
    refuse: impl Fn(&mut TcpStream, &'static str),
    serve: Arc<S>,
) where
    S: Fn(TcpStream, &Admitted<'_>) + Send + Sync + 'static,
{
    let mut next_id = 0u64;
    let timeout = shared.book().admission.limits().timeout;
    loop {
        let accepted = listener.accept();
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let (mut stream, source) = match accepted {
            Ok(accepted) => accepted,
            Err(_) => {
                std::thread::sleep(ACCEPT_ERROR_PAUSE);
                continue;
            }
        };
        next_id += 1;
        let id = next_id;
        let now = Instant::now();
        {
            let mut book = shared.book();
            match book.admission.arrive(id, source.ip(), now) {
                Arrival::Accept => {}
                Arrival::AcceptEvicting(old) => {
                    if let Some(old) = book.open.remove(&old) {
                        let _ = old.shutdown(std::net::Shutdown::Both);
                    }
                }
                Arrival::Refuse(bound) => {
                    drop(book);
                    refuse(&mut stream, bound);
                    continue;
                }
            }
            match stream.try_clone() {
                Ok(handle) => {
                    book.open.insert(id, handle);
                }
                Err(_) => {
                    book.admission.leave(id);
                    continue;
                }
            }
        }
        shared.active.fetch_add(1, Ordering::AcqRel);
        let serve = serve.clone();
        let for_thread = shared.clone();
        let job: super::workers::Job = Box::new(move || {
            // Review 7: the clean-up runs from a guard, so a `serve` that
            // panics still leaves the book and the count (a leaked entry
            // kept its source's and the table's quota for good, and a
            // leaked count made every `stop` wait out the drain).
            let _leave = Leave { id, shared: &for_thread };
            // Declared after the guard, so dropped before it, panic or
            // not: the server's state goes before the count does (`stop`
            // waits on it).
            let serve = serve;
            let conn = Admitted { id, shared: &for_thread, accepted: now, timeout };
            serve(stream, &conn);
        });
        if shared.workers.run(job).is_err() {
            // The job, and its clean-up, never ran.
            let mut book = shared.book();
            book.open.remove(&id);
            book.admission.leave(id);
            shared.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    // Review 7: a connection whose `serve` panics (after proving itself,
    // so its book entry never expires) must not keep its place in the
    // book. Before the guard, two such connections filled this table of
    // two for good and every later one was refused.
    #[test]
    fn a_connection_whose_serve_panics_leaves_the_book_and_the_count() {
        let limits = AdmissionLimits {
            max_total: 2,
            max_per_source: 2,
            max_pending_per_source: 2,
            max_pending: 2,
            timeout: Duration::from_secs(60),
        };
        let served = Arc::new(AtomicUsize::new(0));
        let count = served.clone();
        let mut acceptor = Acceptor::start(
            "127.0.0.1:0".parse().unwrap(),
            "test",
            limits,
            |_, _| {},
            move |stream, conn| {
                let _ = conn.admit();
                if count.fetch_add(1, Ordering::AcqRel) < 3 {
                    panic!("serve's panic (expected by this test)");
                }
                let _ = std::io::Write::write_all(&mut &stream, b"ok");
            },
        )
        .unwrap();
        let addr = acceptor.local_addr();
        for _ in 0..3 {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            assert!(rest.is_empty(), "the panicked connection was closed unanswered");
        }
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        assert_eq!(answer, b"ok", "served after three panicked connections");
        let waited = Instant::now();
        while acceptor.shared.active.load(Ordering::Acquire) > 0 && waited.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(acceptor.shared.active.load(Ordering::Acquire), 0, "no connection counted as open");
        assert_eq!(acceptor.shared.book().admission.len(), 0, "no entry left in the book");
        acceptor.stop();
    }
}
