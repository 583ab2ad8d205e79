//! The raw-TCP baseline: what a plain socket moves over the same path, so
//! the tcp transport's figures are a ratio measured in the same run.
//!
//! `kvring serve` runs a [`RawSink`]. On connect the sink sends a 16-byte
//! challenge; the client answers with 32 bytes: the token's answer to it
//! (`Token::answer`), zeros when the sink has no token. A sink with a token
//! closes a connection whose answer is wrong, so the baseline needs the
//! token just as the engine does. Then the client sends 16-byte requests
//! (`op`, `bytes`, little-endian u64s); for op 1 (write) it then streams
//! `bytes` and the sink answers one byte when all have arrived; for op 2
//! (read) the sink streams `bytes` back. At most [`MAX_SINK_CONNECTIONS`]
//! are served at once; more are closed at once.

use kvring::Token;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most baseline connections served at once (each has a 1 MiB buffer).
const MAX_SINK_CONNECTIONS: usize = 8;
/// A client must answer the challenge within this.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

/// Largest transfer one raw request may ask for.
const MAX_RAW_BYTES: u64 = 1 << 40;
/// Buffer the sink reads into and writes from.
const SINK_BUFFER: usize = 1 << 20;

/// A listener that serves raw-TCP baseline requests, one thread each.
pub struct RawSink {
    addr: SocketAddr,
}

impl RawSink {
    /// Binds `ip:0` and serves in the background; with `token`, only
    /// clients that answer its challenge.
    pub fn start(ip: std::net::IpAddr, token: Option<Token>) -> std::io::Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))?;
        let addr = listener.local_addr()?;
        let active = Arc::new(AtomicUsize::new(0));
        let token = Arc::new(token);
        std::thread::Builder::new().name("kvring-raw-sink".into()).spawn(move || {
            for stream in listener.incoming().flatten() {
                if active.fetch_add(1, Ordering::AcqRel) >= MAX_SINK_CONNECTIONS {
                    active.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
                let (for_thread, token) = (active.clone(), token.clone());
                let spawned = std::thread::Builder::new().name("kvring-raw-conn".into()).spawn(move || {
                    let _ = serve(stream, token.as_ref().as_ref());
                    for_thread.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    // The closure (and its decrement) never ran.
                    active.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })?;
        Ok(Self { addr })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn serve(mut stream: TcpStream, token: Option<&Token>) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    let challenge = Token::challenge();
    stream.write_all(&challenge)?;
    stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
    let mut answer = [0u8; 32];
    stream.read_exact(&mut answer)?;
    if token.is_some_and(|token| !token.check_answer(&challenge, &answer)) {
        return Ok(());
    }
    stream.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut buffer = vec![0u8; SINK_BUFFER];
    loop {
        let mut request = [0u8; 16];
        if stream.read_exact(&mut request).is_err() {
            return Ok(());
        }
        let op = u64::from_le_bytes(request[..8].try_into().expect("8 bytes"));
        let bytes = u64::from_le_bytes(request[8..].try_into().expect("8 bytes"));
        if bytes > MAX_RAW_BYTES {
            return Ok(());
        }
        let mut left = bytes;
        match op {
            1 => {
                while left > 0 {
                    let n = stream.read(&mut buffer[..(left as usize).min(SINK_BUFFER)])?;
                    if n == 0 {
                        return Ok(());
                    }
                    left -= n as u64;
                }
                stream.write_all(&[1])?;
            }
            2 => {
                while left > 0 {
                    let n = (left as usize).min(SINK_BUFFER);
                    stream.write_all(&buffer[..n])?;
                    left -= n as u64;
                }
            }
            _ => return Ok(()),
        }
    }
}

/// GB/s of moving `total` bytes to (write) or from (read) the sink at
/// `addr` in `block`-sized socket calls, answering its challenge with
/// `token`.
pub fn baseline(addr: &str, token: Option<&str>, write: bool, block: u64, total: u64) -> Result<f64, String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("raw baseline: connecting to {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    stream.set_read_timeout(Some(Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let mut challenge = [0u8; 16];
    stream.read_exact(&mut challenge).map_err(|e| format!("raw baseline: reading the sink's challenge: {e}"))?;
    let answer = token.map_or([0u8; 32], |token| Token::new(token).answer(&challenge));
    stream.write_all(&answer).map_err(|e| format!("raw baseline: {e}"))?;
    let block = block.min(total).max(1) as usize;
    let mut buffer = vec![0x5au8; block];
    let mut request = [0u8; 16];
    request[..8].copy_from_slice(&(if write { 1u64 } else { 2 }).to_le_bytes());
    request[8..].copy_from_slice(&total.to_le_bytes());
    let started = Instant::now();
    stream.write_all(&request).map_err(|e| e.to_string())?;
    let mut left = total;
    while left > 0 {
        let n = (left as usize).min(block);
        if write {
            stream.write_all(&buffer[..n]).map_err(|e| format!("raw baseline: {e}"))?;
        } else {
            stream.read_exact(&mut buffer[..n]).map_err(|e| format!("raw baseline: {e}"))?;
        }
        left -= n as u64;
    }
    if write {
        let mut ack = [0u8; 1];
        stream.read_exact(&mut ack).map_err(|e| format!("raw baseline: {e}"))?;
    }
    Ok(total as f64 / started.elapsed().as_secs_f64() / 1e9)
}
