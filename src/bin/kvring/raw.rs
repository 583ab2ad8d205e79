//! The raw-TCP baseline: what a plain socket moves over the same path, both
//! ends busy-polling non-blocking sockets as kvring's lanes do, so
//! the tcp transport's figures are a ratio measured in the same run.
//!
//! `kvring serve --raw-sink` runs a [`RawSink`] (a bench's target passes
//! the flag; without it no sink listens). On connect the sink sends a 16-byte
//! challenge; the client answers with 32 bytes: the token's answer to it
//! (`Token::answer`), zeros when the sink has no token. A sink with a token
//! closes a connection whose answer is wrong, so the baseline needs the
//! token just as the engine does. Then the client sends 24-byte requests
//! (`op`, `bytes`, `span`, little-endian u64s). For op 1 (write) and op 2
//! (read) the sink readies `span` bytes of memory (faulted in, at most
//! [`MAX_SINK_SPAN`]) and answers one byte; then for op 1 the client
//! streams `bytes` and the sink answers one byte when all have arrived,
//! and for op 2 the sink streams `bytes` back. Both ends cycle through
//! `span` bytes, as kvring's bench cycles through its regions: the bytes
//! land in and leave from memory of the same size as kvring's, not a
//! buffer that stays in the cache (which read about twice kvring for
//! that alone). Ops 3 and 4 are the latency
//! floor, a ping-pong both ends busy-poll until the client closes: for op 3
//! the client sends `bytes` and the sink answers 8 bytes each time (a WRITE
//! and its ack); for op 4 the client sends 8 bytes and the sink answers
//! `bytes` (a READ). A request the sink cannot serve (an unknown op, a
//! ping-pong of 0 bytes, which would answer without being asked, or one
//! larger than its buffer) closes the connection. At most
//! [`MAX_SINK_CONNECTIONS`] are served at once; more are closed at once. A
//! connection that moves no byte for [`STALL`] is closed, and a waiting end
//! sleeps in epoll past its busy-poll window, so an idle or stalled client
//! neither holds a slot long nor spins on a lane's core. The stream memory
//! kept between connections is freed once none is open.

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
/// The floor's buffer: its largest ping-pong message.
const SINK_BUFFER: usize = 1 << 20;
/// Most memory one stream of the sink cycles through (the bench's default
/// region).
pub const MAX_SINK_SPAN: u64 = 128 << 20;
/// Bytes of a request.
const REQUEST_BYTES: usize = 24;
/// Bytes a baseline connection moves, untimed, before its timed stream: a
/// fresh connection starts with a 128 KiB receive buffer that the kernel
/// grows (up to `tcp_rmem`'s 32 MiB here) as the stream runs, while
/// kvring's lanes time connections that have long been streaming.
const WARM_UP_BYTES: u64 = 32 << 20;
/// A connection that moves no byte for this long (waiting for a request or
/// inside one) is closed: the bench's client never pauses that long, and an
/// idle client must not hold one of the few slots.
const STALL: Duration = Duration::from_secs(2);
/// Bytes of the ping-pong's small side (an ack, a request).
const PING_BYTES: usize = 8;
/// Round trips run before the floor's timed ones.
const FLOOR_WARMUP: usize = 200;
/// How long a stream's wait polls, yielding between looks, before it
/// sleeps in epoll: an idle lane's busy-poll window (its `busy_poll`
/// default), after which a lane parks in its poller.
const BUSY_POLL: Duration = Duration::from_millis(2);
/// Longest one sleep in epoll, so the stall check still runs.
const PARKED_LOOK: Duration = Duration::from_millis(100);

/// A listener that serves raw-TCP baseline requests, one thread each.
pub struct RawSink {
    addr: SocketAddr,
    /// Kept for the tests' look at what the sink holds.
    #[cfg_attr(not(test), allow(dead_code))]
    spans: Arc<Spans>,
}

impl RawSink {
    /// Binds `ip:0` and serves in the background; with `token`, only
    /// clients that answer its challenge. A connection runs on one of
    /// `cores` (the n-th of those open at once on the n-th, round robin;
    /// unpinned with none): `kvring serve` gives its lanes' (see
    /// [`sink_cores`]), so the baseline runs where kvring's target end does.
    pub fn start(ip: std::net::IpAddr, token: Option<Token>, cores: Vec<usize>) -> std::io::Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))?;
        let addr = listener.local_addr()?;
        let active = Arc::new(AtomicUsize::new(0));
        let token = Arc::new(token);
        let spans = Arc::new(Spans::default());
        let kept = spans.clone();
        std::thread::Builder::new().name("kvring-raw-sink".into()).spawn(move || {
            for stream in listener.incoming().flatten() {
                let open = active.fetch_add(1, Ordering::AcqRel);
                if open >= MAX_SINK_CONNECTIONS {
                    active.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
                let core = (!cores.is_empty()).then(|| cores[open % cores.len()]);
                let (for_thread, token, spans) = (active.clone(), token.clone(), spans.clone());
                let spawned = std::thread::Builder::new().name("kvring-raw-conn".into()).spawn(move || {
                    if let Some(core) = core {
                        core_affinity::set_for_current(core_affinity::CoreId { id: core });
                    }
                    let _ = serve(stream, token.as_ref().as_ref(), &spans);
                    // The last client gone, its memory goes too (up to
                    // `MAX_SINK_CONNECTIONS` x `MAX_SINK_SPAN` otherwise
                    // stays held by an idle serve).
                    if for_thread.fetch_sub(1, Ordering::AcqRel) == 1 {
                        spans.clear();
                    }
                });
                if spawned.is_err() {
                    // The closure (and its decrement) never ran.
                    active.fetch_sub(1, Ordering::AcqRel);
                }
            }
        })?;
        Ok(Self { addr, spans: kept })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// The cores for the sink's connections: the lanes' (`lane_cores`, the
/// pinned ones), where the engine serves a bench's connections, one per
/// lane of the bench; none (the scheduler's choice) when no lane is pinned.
///
/// The same cores as kvring's, not free ones: the baseline is then the
/// same path at its best (the same cores, each end polling as a lane does,
/// no framing), so kvring's ratio to it is what kvring itself costs. A sink
/// on a core of its own got a core kvring's target end never has, and on
/// a 2-core host, where both engines' lanes share a core, read about twice
/// kvring for that reason alone. An idle lane parks after its busy-poll
/// window (2 ms), so it does not starve a sink beside it.
pub fn sink_cores(lane_cores: &[Option<usize>]) -> Vec<usize> {
    lane_cores.iter().flatten().copied().collect()
}

/// The sink's stream memory, kept between the streams of connections open
/// at the same time and freed when the last one closes (faulted in before
/// the sink's ready answer, so outside the timed part either way).
#[derive(Default)]
struct Spans(std::sync::Mutex<Vec<Memory>>);

impl Spans {
    /// A faulted-in buffer of at least `len` bytes.
    fn take(&self, len: usize) -> std::io::Result<Memory> {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match kept.iter().position(|b| b.len() >= len) {
            Some(at) => Ok(kept.swap_remove(at)),
            None => memory(len).map_err(std::io::Error::other),
        }
    }

    /// Frees every kept buffer.
    fn clear(&self) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Bytes kept.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|m| m.len()).sum()
    }

    /// Keeps `buffer` for a later stream (as many as connections at once).
    fn give_back(&self, buffer: Memory) {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() < MAX_SINK_CONNECTIONS {
            kept.push(buffer);
        }
    }
}

/// The span a request asks to cycle through, within the sink's limits.
fn span_len(span: u64) -> usize {
    span.clamp(1, MAX_SINK_SPAN) as usize
}

fn serve(mut stream: TcpStream, token: Option<&Token>, spans: &Spans) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    let challenge = Token::challenge();
    stream.write_all(&challenge)?;
    stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
    let mut answer = [0u8; 32];
    stream.read_exact(&mut answer)?;
    if token.is_some_and(|token| !token.check_answer(&challenge, &answer)) {
        return Ok(());
    }
    // Both ends busy-poll, as kvring's lanes do: the baseline is what a
    // plain socket moves when nobody sleeps.
    let mut stream = Polled::new(stream, true)?;
    let mut buffer = vec![0u8; SINK_BUFFER];
    loop {
        let mut request = [0u8; REQUEST_BYTES];
        if !stream.read_exact(&mut request)? {
            return Ok(());
        }
        let field = |at: usize| u64::from_le_bytes(request[at..at + 8].try_into().expect("8 bytes"));
        let (op, bytes, span) = (field(0), field(8), field(16));
        if bytes > MAX_RAW_BYTES {
            return Ok(());
        }
        match op {
            1 | 2 => {
                let memory = spans.take(span_len(span))?;
                stream.write_all(&[1])?;
                let mut memory = Cycle::new(memory, span_len(span));
                let streamed = memory.stream(&mut stream, op == 2, bytes);
                spans.give_back(memory.into_inner());
                if !streamed? {
                    return Ok(());
                }
                if op == 1 {
                    stream.write_all(&[1])?;
                }
            }
            // A 0-byte message would be "read" at once, again and again:
            // the sink would answer unasked, forever.
            3 | 4 if bytes > 0 && bytes as usize <= SINK_BUFFER => {
                stream.retry = true;
                return ping_pong(stream, &mut buffer[..bytes as usize], op == 3);
            }
            _ => return Ok(()),
        }
    }
}

/// Memory a stream cycles through: `span` bytes, each socket call moving
/// all that is left up to the span's end (see [`piece`]), wrapping to the
/// start at the end.
struct Cycle {
    memory: Memory,
    span: usize,
    at: usize,
}

impl Cycle {
    fn new(memory: Memory, span: usize) -> Self {
        debug_assert!(memory.len() >= span && span > 0);
        Self { memory, span, at: 0 }
    }

    /// Moves `bytes` from the socket into the memory (`send` false) or from
    /// the memory out; false when the peer closed first.
    fn stream(&mut self, stream: &mut Polled, send: bool, bytes: u64) -> std::io::Result<bool> {
        let mut left = bytes;
        while left > 0 {
            let n = piece(left, self.at, self.span);
            let piece = &mut self.memory[self.at..self.at + n];
            if send {
                stream.write_all(piece)?;
            } else if !stream.read_exact(piece)? {
                return Ok(false);
            }
            self.at = (self.at + n) % self.span;
            left -= n as u64;
        }
        Ok(true)
    }

    fn into_inner(self) -> Memory {
        self.memory
    }
}

/// Memory a baseline stream moves bytes from or into.
type Memory = memmap2::MmapMut;

/// `len` bytes of the memory kvring's regions are made of (a pre-faulted
/// shared mapping of a /dev/shm file, as `Engine::alloc_region` makes), a
/// pattern in them, so the socket's copies into and out of it are those of
/// kvring's path. Heap memory is another kind: on a host whose /dev/shm is
/// backed by 2 MiB pages (`shmem_enabled` always) and whose heap gets 4 KiB
/// ones (THP on `madvise`), as this VM's, the baseline moved bytes between
/// other pages than kvring. (Measured here, the copies cost about the same
/// per byte either way, docs/CHECKSUMS.md, "tcp against raw"; the baseline
/// should not depend on that.)
fn memory(len: usize) -> Result<Memory, String> {
    let mut map = crate::scratch::shm_buffer(len.max(1))?;
    crate::scratch::fill(&mut map, len as u64);
    Ok(map)
}

/// The sink's side of the floor: busy-polls `block`-sized messages in and
/// 8-byte answers out (`write`), or the reverse, until the client closes.
fn ping_pong(mut stream: Polled, block: &mut [u8], write: bool) -> std::io::Result<()> {
    let mut ping = [0u8; PING_BYTES];
    loop {
        let (inbound, outbound): (&mut [u8], &[u8]) =
            if write { (block, &[1; PING_BYTES]) } else { (&mut ping, block) };
        if !stream.read_exact(inbound)? {
            return Ok(());
        }
        stream.write_all(outbound)?;
    }
}

/// A non-blocking stream whose waits busy-poll epoll (mio, edge-triggered)
/// rather than the socket: a reader spinning on `read` takes the socket's
/// lock on every try, which sends the writer's segments to the socket's
/// backlog and slowed a loopback stream to a fifth of its rate; a lane
/// likewise polls its poller, not its sockets.
struct Polled {
    stream: TcpStream,
    poll: (mio::Poll, mio::Events),
    /// Waits within the busy-poll window retry the socket itself, after a
    /// yield, rather than look at epoll (the floor: for one small message
    /// the lock costs nothing and a retry is the quickest look).
    retry: bool,
}

impl Polled {
    /// Waits on epoll (`through_epoll`) or, within the busy-poll window,
    /// by retrying the socket.
    fn new(stream: TcpStream, through_epoll: bool) -> std::io::Result<Self> {
        use std::os::fd::AsRawFd;
        stream.set_nonblocking(true)?;
        let poll = mio::Poll::new()?;
        let interest = mio::Interest::READABLE | mio::Interest::WRITABLE;
        poll.registry().register(&mut mio::unix::SourceFd(&stream.as_raw_fd()), mio::Token(0), interest)?;
        Ok(Self { stream, poll: (poll, mio::Events::with_capacity(4)), retry: !through_epoll })
    }

    /// Waits for the socket's next edge as a lane waits on its peer
    /// (`Lane::round`, then `Lane::park`): polls epoll, yielding the core
    /// between looks (a sink or client that shares its core with the other
    /// end lets it run instead of spinning out its time slice), and past
    /// [`BUSY_POLL`] sleeps in epoll. Sleeping matters on a loaded host: a
    /// thread that yields stays behind every runnable thread of the core
    /// for their slices, while one woken by its socket runs at once, and a
    /// baseline that only yielded read far below kvring's parking lanes.
    fn wait(&mut self, since: Instant) -> std::io::Result<()> {
        let started = Instant::now();
        loop {
            if since.elapsed() > STALL {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            let (poll, events) = &mut self.poll;
            if self.retry && since.elapsed() < BUSY_POLL {
                // The floor's ends share a core when the sink runs where
                // the target's lane does and the bench's lane shares it:
                // a retry that never yields would spin out its whole time
                // slice before the other end could answer.
                std::thread::yield_now();
                return Ok(());
            }
            // Past the busy-poll window (a stalled floor too) it sleeps.
            let timeout = if started.elapsed() < BUSY_POLL { Duration::ZERO } else { PARKED_LOOK };
            poll.poll(events, Some(timeout))?;
            if !events.is_empty() {
                return Ok(());
            }
            if timeout.is_zero() {
                std::thread::yield_now();
            }
        }
    }

    /// Reads exactly `buf`; false when the peer closed before its first
    /// byte.
    fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
        match self.until_done(buf.len(), |stream, at| stream.read(&mut buf[at..]))? {
            0 if !buf.is_empty() => Ok(false),
            moved if moved == buf.len() => Ok(true),
            _ => Err(std::io::ErrorKind::UnexpectedEof.into()),
        }
    }

    /// Moves `len` bytes with `step` (a read or a write at offset `at`),
    /// waiting (bounded by `wait`) while the socket would block; returns
    /// the bytes moved before `step` moved none (the peer closed), or `len`.
    fn until_done(
        &mut self,
        len: usize,
        mut step: impl FnMut(&mut TcpStream, usize) -> std::io::Result<usize>,
    ) -> std::io::Result<usize> {
        let mut at = 0;
        let mut last = Instant::now();
        while at < len {
            match step(&mut self.stream, at) {
                Ok(0) => return Ok(at),
                Ok(n) => {
                    at += n;
                    last = Instant::now();
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => self.wait(last)?,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(at)
    }

    /// Writes all of `buf`.
    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self.until_done(buf.len(), |stream, at| stream.write(&buf[at..]))? {
            moved if moved == buf.len() => Ok(()),
            _ => Err(std::io::ErrorKind::WriteZero.into()),
        }
    }
}

/// The latency floor: `samples` round trips (after a warm-up) of a
/// ping-pong with the sink at `addr` that both ends busy-poll, the shape
/// of one `block`-sized WRITE and its ack (`write`) or of a READ's request
/// and its `block` of data. Returns each round trip's time.
pub fn floor(
    addr: &str,
    token: Option<&str>,
    write: bool,
    block: u64,
    samples: usize,
) -> Result<Vec<Duration>, String> {
    let block = usize::try_from(block).ok().filter(|&b| b <= SINK_BUFFER).ok_or("floor: block too large")?;
    let stream = connect(addr, token)?;
    let request = request(if write { 3 } else { 4 }, block as u64, 0);
    let mut stream = Polled::new(stream, false).map_err(|e| format!("floor: {e}"))?;
    stream.write_all(&request).map_err(|e| format!("floor: {e}"))?;
    let mut payload = vec![0x5au8; block];
    let mut ping = [0u8; PING_BYTES];
    let mut times = Vec::with_capacity(samples);
    for i in 0..FLOOR_WARMUP + samples {
        let started = Instant::now();
        let (outbound, inbound): (&[u8], &mut [u8]) = if write { (&payload, &mut ping) } else { (&ping, &mut payload) };
        stream.write_all(outbound).map_err(|e| format!("floor: {e}"))?;
        match stream.read_exact(inbound) {
            Ok(true) => {}
            Ok(false) => return Err("floor: the sink closed the connection".into()),
            Err(e) => return Err(format!("floor: {e}")),
        }
        if i >= FLOOR_WARMUP {
            times.push(started.elapsed());
        }
    }
    Ok(times)
}

/// A connection to the sink at `addr`, its challenge answered with `token`.
fn connect(addr: &str, token: Option<&str>) -> Result<TcpStream, String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("raw baseline: connecting to {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    stream.set_read_timeout(Some(Duration::from_secs(60))).map_err(|e| e.to_string())?;
    let mut challenge = [0u8; 16];
    stream.read_exact(&mut challenge).map_err(|e| format!("raw baseline: reading the sink's challenge: {e}"))?;
    let answer = token.map_or([0u8; 32], |token| Token::new(token).answer(&challenge));
    stream.write_all(&answer).map_err(|e| format!("raw baseline: {e}"))?;
    Ok(stream)
}

/// A request to the sink.
fn request(op: u64, bytes: u64, span: u64) -> [u8; REQUEST_BYTES] {
    let mut request = [0u8; REQUEST_BYTES];
    for (at, field) in [op, bytes, span].into_iter().enumerate() {
        request[at * 8..at * 8 + 8].copy_from_slice(&field.to_le_bytes());
    }
    request
}

/// The raw-TCP baseline of every bench mode (the block sweep, `--checksum`,
/// `--kv`, staged GPU tcp): GB/s of moving `total` bytes to (write) or
/// from (read) the sink at `addr`, answering its challenge with `token`,
/// over one connection per lane of the bench (`lane_cores`), each on its
/// lane's core and moving its share of whole `block`s at the same time, as
/// kvring spreads a batch over its lanes' connections: the same connection
/// count and cores as kvring's, so the baseline stays an upper bound of
/// the same path with several lanes. The connections share `span` bytes
/// of memory at each end, as the lanes share a region; each moves its
/// share as one stream (see [`piece`]).
pub fn streams(
    addr: &str,
    token: Option<&str>,
    (write, block, total): (bool, u64, u64),
    (span, lane_cores): (u64, &[Option<usize>]),
) -> Result<f64, String> {
    let cores = if lane_cores.is_empty() { &[None][..] } else { lane_cores };
    let share = total.div_ceil(block.max(1)).div_ceil(cores.len() as u64) * block.max(1);
    let span = span.div_ceil(cores.len() as u64);
    // Every connection is open before any byte moves; the clock runs from
    // then to the last one's end.
    let ready = std::sync::Barrier::new(cores.len());
    let spans = std::thread::scope(|scope| {
        let handles: Vec<_> = cores
            .iter()
            .map(|&core| {
                let ready = &ready;
                scope.spawn(move || {
                    if let Some(core) = core {
                        core_affinity::set_for_current(core_affinity::CoreId { id: core });
                    }
                    let stream = connect(addr, token).and_then(|s| Polled::new(s, true).map_err(|e| e.to_string()));
                    // Whole blocks of memory, faulted in before the clock
                    // starts.
                    let block = block.min(share).max(1) as usize;
                    let memory = memory(span_len(span).max(block) / block * block);
                    let warmed = stream.and_then(|mut stream| {
                        let mut memory = memory?;
                        pump(&mut stream, &mut memory, (write, share.min(WARM_UP_BYTES)))?;
                        Ok((stream, memory))
                    });
                    ready.wait();
                    let (mut stream, mut memory) = warmed?;
                    pump(&mut stream, &mut memory, (write, share))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .collect::<Vec<_>>()
    });
    let spans: Vec<(Instant, Instant)> = spans.into_iter().collect::<Result<_, _>>()?;
    let first = spans.iter().map(|s| s.0).min().expect("one connection at least");
    let last = spans.iter().map(|s| s.1).max().expect("one connection at least");
    Ok((share * cores.len() as u64) as f64 / (last - first).as_secs_f64() / 1e9)
}

/// Bytes the next socket call of a stream offers: all that is `left`, up to
/// the end of the `span` it cycles through (from `at`), whatever the
/// block size. The least work that moves the bytes, so an upper bound of
/// kvring's path: a lane gathers up to 32 frames (each up to 1 MiB of a
/// block) into one `writev` and reads a payload of 16 KiB or more straight
/// into its block, so a baseline that made one call per block (as it did
/// until 2026-11-27) made up to 16 calls for kvring's one at 64 KiB blocks
/// and 256 at 4 KiB, and was no upper bound (kvring read 1.5-2.1x it).
fn piece(left: u64, at: usize, span: usize) -> usize {
    debug_assert!(at < span);
    usize::try_from(left).unwrap_or(usize::MAX).min(span - at)
}

/// Asks the sink for a transfer of `total` bytes and, once both ends have
/// their span of memory ready (`memory`'s size), moves them as one stream
/// (see [`piece`]; a write ends with the sink's one-byte ack); when the
/// transfer started and ended.
fn pump(stream: &mut Polled, memory: &mut [u8], (write, total): (bool, u64)) -> Result<(Instant, Instant), String> {
    let span = memory.len();
    let failed = |e: std::io::Error| format!("raw baseline: {e}");
    let closed =
        |read: bool| if read { Ok(()) } else { Err("raw baseline: the sink closed the connection".to_string()) };
    stream.write_all(&request(if write { 1 } else { 2 }, total, span as u64)).map_err(failed)?;
    let mut ack = [0u8; 1];
    closed(stream.read_exact(&mut ack).map_err(failed)?)?;
    let started = Instant::now();
    let (mut left, mut at) = (total, 0);
    while left > 0 {
        let n = piece(left, at, span);
        let bytes = &mut memory[at..at + n];
        if write {
            stream.write_all(bytes).map_err(failed)?;
        } else {
            closed(stream.read_exact(bytes).map_err(failed)?)?;
        }
        at = (at + n) % span;
        left -= n as u64;
    }
    if write {
        closed(stream.read_exact(&mut ack).map_err(failed)?)?;
    }
    Ok((started, Instant::now()))
}

/// Runs `work` on a thread pinned to `core` (when given) and returns what
/// it returns: the client side of a baseline runs where the bench's lane
/// runs, as the sink runs where the target's lane does.
pub fn on_core<T: Send>(core: Option<usize>, work: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                if let Some(core) = core {
                    core_affinity::set_for_current(core_affinity::CoreId { id: core });
                }
                work()
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

#[cfg(test)]
mod tests {
    use super::{piece, sink_cores, streams, RawSink};
    use kvring::Token;

    fn sink(token: Option<&str>) -> (RawSink, String) {
        let sink = RawSink::start("127.0.0.1".parse().unwrap(), token.map(Token::new), Vec::new()).unwrap();
        let addr = sink.addr().to_string();
        (sink, addr)
    }

    #[test]
    fn streams_move_every_byte_both_ways_over_several_connections() {
        let (_sink, addr) = sink(None);
        // A total that is not whole blocks, a span that is not whole
        // blocks, and one smaller than a block: each stream ends only once
        // the sink has every byte (write: its ack) or sent every byte.
        for (total, span) in [(3 << 20, 256 << 10), ((1 << 20) + 1000, 100_000), (300_000, 1000)] {
            for write in [true, false] {
                let gbps = streams(&addr, None, (write, 64 << 10, total), (span, &[None, None])).unwrap();
                assert!(gbps > 0.0, "write {write}, {total} bytes over a {span}-byte span: {gbps}");
            }
        }
        assert!(streams(&addr, None, (false, 1 << 20, 4 << 20), (2 << 20, &[None])).unwrap() > 0.0);
    }

    #[test]
    fn a_stream_offers_each_call_all_it_has_left_up_to_the_span_end() {
        // 4 KiB blocks cycling through a 1 MiB span: calls of up to 1 MiB,
        // not of 4 KiB (kvring gathers many blocks into one `writev`), each
        // ending at the span's end or the transfer's, none past either.
        let (span, total) = (1usize << 20, (5u64 << 20) / 2 + 4096);
        let (mut left, mut at, mut calls) = (total, 0usize, Vec::new());
        while left > 0 {
            let n = piece(left, at, span);
            assert!(n > 0 && at + n <= span, "{n} bytes from {at}");
            calls.push(n);
            at = (at + n) % span;
            left -= n as u64;
        }
        assert_eq!(calls, [span, span, span / 2 + 4096]);
        assert_eq!(piece(100, span - 10, span), 10);
        assert_eq!(piece(u64::MAX, 0, span), span);
    }

    #[test]
    fn the_sink_frees_its_stream_memory_once_its_clients_leave() {
        let (sink, addr) = sink(None);
        assert!(streams(&addr, None, (true, 1 << 20, 4 << 20), (4 << 20, &[])).unwrap() > 0.0);
        // The connection's thread frees after its client closed: wait for
        // it, bounded.
        for _ in 0..200 {
            if sink.spans.kept() == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(sink.spans.kept(), 0, "the sink still holds stream memory with no client");
    }

    #[test]
    fn the_sink_closes_a_ping_pong_whose_client_went_silent() {
        use std::io::{Read, Write};
        let (_sink, addr) = sink(None);
        let mut stream = super::connect(&addr, None).unwrap();
        // One floor request, then nothing: the sink waits (parked, past its
        // busy-poll window) and closes once `STALL` passed, freeing the
        // slot; the connection's 60 s read timeout bounds the test.
        stream.write_all(&super::request(3, 64, 0)).unwrap();
        let mut byte = [0u8; 1];
        assert_eq!(stream.read(&mut byte).unwrap(), 0, "the sink answered a ping it never got");
    }

    #[test]
    fn a_sink_with_a_token_refuses_a_stream_without_it() {
        let (_sink, addr) = sink(Some("secret"));
        assert!(streams(&addr, Some("secret"), (true, 4096, 1 << 20), (1 << 20, &[])).unwrap() > 0.0);
        let refused = streams(&addr, Some("guess"), (true, 4096, 1 << 20), (1 << 20, &[])).unwrap_err();
        assert!(refused.contains("raw baseline"), "{refused}");
    }

    #[test]
    fn baseline_memory_is_a_dev_shm_mapping_as_kvring_regions_are() {
        let memory = super::memory(1 << 20).unwrap();
        let addr = memory.as_ptr() as usize;
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let line = maps
            .lines()
            .find(|line| {
                let range = line.split_whitespace().next().unwrap_or_default();
                let (start, end) = range.split_once('-').unwrap_or_default();
                let (start, end) = (usize::from_str_radix(start, 16), usize::from_str_radix(end, 16));
                matches!((start, end), (Ok(start), Ok(end)) if start <= addr && addr < end)
            })
            .expect("the memory is mapped");
        assert!(line.contains(kvring::host::SHM_DIR), "not a mapping of a {} file: {line}", kvring::host::SHM_DIR);
        assert!(memory.iter().any(|&b| b != 0), "no pattern in the memory");
    }

    #[test]
    fn the_sink_takes_the_lanes_cores_or_none() {
        assert_eq!(sink_cores(&[Some(1)]), [1]);
        assert_eq!(sink_cores(&[Some(2), Some(0)]), [2, 0]);
        assert_eq!(sink_cores(&[None, None]), [0usize; 0]);
        assert_eq!(sink_cores(&[]), [0usize; 0]);
    }
}
