//! Blocking socket I/O bounded by one deadline for a whole operation.
//!
//! A socket timeout bounds one `read` or `write` call; a peer that trickles
//! a byte per call would hold an operation forever. [`DeadlineIo`] sets the
//! timeout of every call to what is left of the operation's deadline, so a
//! message, a request or a response ends by its deadline however its bytes
//! arrive.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// A stream seen through one operation's deadline.
#[derive(Debug)]
pub(crate) struct DeadlineIo<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl<'a> DeadlineIo<'a> {
    /// `stream` (a blocking one), with every read and write ending by
    /// `deadline`.
    pub(crate) fn new(stream: &'a TcpStream, deadline: Instant) -> Self {
        Self { stream, deadline }
    }

    /// Time left, or a `TimedOut` error when none is.
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the operation's deadline passed"));
        }
        Ok(left)
    }
}

/// `WouldBlock` from a socket timeout means the deadline passed.
fn timed_out(error: io::Error) -> io::Error {
    match error.kind() {
        io::ErrorKind::WouldBlock => io::Error::new(io::ErrorKind::TimedOut, "the operation's deadline passed"),
        _ => error,
    }
}

// A socket timeout is kept in jiffies and can fire up to one tick before
// the time asked for: a `WouldBlock` with time left is tried again, so a
// timeout error always means the deadline itself passed (callers that
// check `Instant::now() >= deadline` then see it so).
impl Read for DeadlineIo<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            self.stream.set_read_timeout(Some(self.left()?))?;
            let mut stream = self.stream;
            match stream.read(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                other => return other.map_err(timed_out),
            }
        }
    }
}

impl Write for DeadlineIo<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            self.stream.set_write_timeout(Some(self.left()?))?;
            let mut stream = self.stream;
            match stream.write(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                other => return other.map_err(timed_out),
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// True for the errors a [`DeadlineIo`] reports when its deadline passed.
pub(crate) fn is_timeout(error: &io::Error) -> bool {
    matches!(error.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_trickling_peer_cannot_stretch_a_read_past_its_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let trickler = std::thread::spawn(move || {
            let (mut peer, _) = listener.accept().unwrap();
            // One byte every 50 ms: each read call alone would succeed.
            for _ in 0..40 {
                if peer.write_all(b"x").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let stream = TcpStream::connect(addr).unwrap();
        let started = Instant::now();
        let mut message = [0u8; 100];
        let error =
            DeadlineIo::new(&stream, started + Duration::from_millis(300)).read_exact(&mut message).unwrap_err();
        assert!(is_timeout(&error), "{error}");
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(2), "{took:?}");
        drop(stream);
        trickler.join().unwrap();
    }
}
