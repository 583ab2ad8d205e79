//! The one TCP accept loop both servers use (control plane and tcp data):
//! bind exactly the address given, a thread per connection, a bound on open
//! connections, and a stop that wakes the accept and cuts every open
//! connection, so peers see the engine gone at once.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The longest `stop` waits for connection threads to end.
const CONNECTION_DRAIN: Duration = Duration::from_secs(5);

struct Shared {
    stop: AtomicBool,
    active: AtomicUsize,
    /// A handle on every open connection, for `stop`.
    open: Mutex<HashMap<u64, TcpStream>>,
}

impl Shared {
    fn open(&self) -> std::sync::MutexGuard<'_, HashMap<u64, TcpStream>> {
        // Every critical section is one insert or remove: never inconsistent.
        self.open.lock().unwrap_or_else(|p| p.into_inner())
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
    /// Binds `listen` and serves each connection with `serve(stream, stop)`
    /// on its own thread, at most `max` at once; a connection past that is
    /// handed to `refuse` (to answer why) and closed. std sets SO_REUSEADDR
    /// on Unix listeners, so a restarted engine can bind the same port at once.
    pub(crate) fn start(
        listen: SocketAddr,
        what: &'static str,
        max: usize,
        refuse: impl Fn(&mut TcpStream) + Send + 'static,
        serve: impl Fn(TcpStream, &AtomicBool) + Send + Sync + 'static,
    ) -> Result<Self> {
        let listener =
            TcpListener::bind(listen).map_err(|e| Error::io(format!("binding {what} listener on {listen}"), e))?;
        let addr = listener.local_addr().map_err(|e| Error::io(format!("reading {what} listener address"), e))?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            active: AtomicUsize::new(0),
            open: Mutex::new(HashMap::new()),
        });
        let for_thread = shared.clone();
        let serve = Arc::new(serve);
        let thread = std::thread::Builder::new()
            .name(format!("kvring-{what}"))
            .spawn(move || accept_loop(listener, for_thread, max, refuse, serve))
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
        for stream in std::mem::take(&mut *self.shared.open()).into_values() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        // A cut connection's thread sees its stream end at once; one in the
        // middle of a request finishes it first.
        let waited = std::time::Instant::now();
        while self.shared.active.load(Ordering::Acquire) > 0 && waited.elapsed() < CONNECTION_DRAIN {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop<S>(
    listener: TcpListener,
    shared: Arc<Shared>,
    max: usize,
    refuse: impl Fn(&mut TcpStream),
    serve: Arc<S>,
) where
    S: Fn(TcpStream, &AtomicBool) + Send + Sync + 'static,
{
    let mut next_id = 0u64;
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(mut stream) = stream else { continue };
        if shared.active.fetch_add(1, Ordering::AcqRel) >= max {
            shared.active.fetch_sub(1, Ordering::AcqRel);
            refuse(&mut stream);
            continue;
        }
        next_id += 1;
        let id = next_id;
        if let Ok(handle) = stream.try_clone() {
            shared.open().insert(id, handle);
        }
        let (for_thread, serve) = (shared.clone(), serve.clone());
        let spawned = std::thread::Builder::new().name("kvring-conn".into()).spawn(move || {
            serve(stream, &for_thread.stop);
            // The server's state goes before the count does: `stop` waits on it.
            drop(serve);
            for_thread.open().remove(&id);
            for_thread.active.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            // The closure, and its clean-up, never ran.
            shared.open().remove(&id);
            shared.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}
