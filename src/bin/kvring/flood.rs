//! `kvring bench --idle-connections N`: N connections to the target's data
//! port that never say a word, held open for as long as the flood runs (a
//! thread reopens those the target closes at its admission deadline), as a
//! hostile client would hold them. The bench measures its case with and
//! without them, round by round.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A running flood of idle connections.
pub struct IdleFlood {
    stop: Arc<AtomicBool>,
    open: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl IdleFlood {
    /// Opens `count` idle connections to `addr` and keeps them open; returns
    /// once all are (or after a few seconds, with as many as there are).
    pub fn start(addr: SocketAddr, count: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let open = Arc::new(AtomicUsize::new(0));
        let (stop_flag, open_count) = (stop.clone(), open.clone());
        let thread = std::thread::spawn(move || {
            let mut held: Vec<Option<TcpStream>> = (0..count).map(|_| None).collect();
            while !stop_flag.load(Ordering::Acquire) {
                let mut alive = 0;
                for slot in held.iter_mut() {
                    // One the target answered (a refusal) or closed is replaced.
                    if !slot.as_ref().is_some_and(silent) {
                        *slot = TcpStream::connect_timeout(&addr, Duration::from_millis(200))
                            .ok()
                            .filter(|s| s.set_nonblocking(true).is_ok());
                    }
                    alive += usize::from(slot.is_some());
                }
                open_count.store(alive, Ordering::Release);
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        let flood = Self { stop, open, thread: Some(thread) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while flood.open() < count && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        flood
    }

    /// Connections open at the last look.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

/// True when a non-blocking peek finds nothing to read (the connection is
/// open and the target has said nothing on it).
fn silent(stream: &TcpStream) -> bool {
    matches!(stream.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

impl Drop for IdleFlood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
