//! The raw-TCP baseline: what a plain socket moves over the same path, so
//! the tcp transport's figures are a ratio measured in the same run.
//!
//! `kvring serve` runs a [`RawSink`]. A client sends a 16-byte request
//! (`op`, `bytes`, little-endian u64s); for op 1 (write) it then streams
//! `bytes` and the sink answers one byte when all have arrived; for op 2
//! (read) the sink streams `bytes` back.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// Largest transfer one raw request may ask for.
const MAX_RAW_BYTES: u64 = 1 << 40;
/// Buffer the sink reads into and writes from.
const SINK_BUFFER: usize = 1 << 20;

/// A listener that serves raw-TCP baseline requests, one thread each.
pub struct RawSink {
    addr: SocketAddr,
}

impl RawSink {
    /// Binds `ip:0` and serves in the background.
    pub fn start(ip: std::net::IpAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))?;
        let addr = listener.local_addr()?;
        std::thread::Builder::new().name("kvring-raw-sink".into()).spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = std::thread::Builder::new().name("kvring-raw-conn".into()).spawn(move || serve(stream));
            }
        })?;
        Ok(Self { addr })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn serve(mut stream: TcpStream) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
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
/// `addr` in `block`-sized socket calls, from `source` memory.
pub fn baseline(addr: &str, write: bool, block: u64, total: u64) -> Result<f64, String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("raw baseline: connecting to {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    stream.set_read_timeout(Some(Duration::from_secs(60))).map_err(|e| e.to_string())?;
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
