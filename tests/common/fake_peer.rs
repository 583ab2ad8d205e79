//! Stand-ins for a peer that tests control: a control server answering one
//! handshake with a descriptor of the test's choosing (`answering`), and a
//! proxy in front of a target's data port that decides what each dial of
//! the initiator meets (`proxy`): the target, a close after the hello, a
//! listener that never answers, a refusal, a slow answer.

use super::WAIT;
use kvring::gpu::{Gpu, SimGpu};
use kvring::testing::tcp::{ServerHello, SERVER_HELLO_BYTES};
use kvring::ErrorCode;
use kvring::{BlockDesc, Engine, RegionInfo, Segment, TransportKind};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zerocopy::IntoBytes;

/// A control server in this process answering one untokened handshake
/// with `descriptor`, hinting its own end of the connection (the true
/// owner: the peer and the test share this process, so the same-host check
/// passes), holding it until the initiator closes it or `WAIT` passed.
pub fn answering(descriptor: &kvring::testing::SegmentDescriptor) -> (String, std::thread::JoinHandle<()>) {
    answering_wire(descriptor.to_proto())
}

/// [`answering`] with the descriptor as it goes on the wire (a test may
/// make it what no engine would).
pub fn answering_wire(segment: kvring::testing::control::SegmentDescriptor) -> (String, std::thread::JoinHandle<()>) {
    use kvring::testing::control::{preface, read_frame, response, write_frame, HandshakeResponse};
    use std::os::fd::AsRawFd;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        let mut theirs = [0u8; 8];
        s.read_exact(&mut theirs).unwrap();
        s.write_all(&preface()).unwrap();
        let _ = read_frame(&mut s, kvring::testing::control::MAX_CONTROL_MESSAGE_BYTES);
        let answer = response(kvring::testing::control::response::Body::Handshake(HandshakeResponse {
            segment: Some(Box::new(segment)),
            answering_fd: Some(s.as_raw_fd() as u32),
            ..Default::default()
        }));
        write_frame(&mut s, &answer).unwrap();
        let _ = s.read_to_end(&mut Vec::new());
    });
    (addr, server)
}

/// The client hello's size (the server hello's is exported).
pub const CLIENT_HELLO_BYTES: usize = std::mem::size_of::<kvring::testing::tcp::ClientHello>();

/// What the proxy does with one accepted data connection.
#[derive(Clone, Copy, Debug)]
pub enum Mode {
    /// Relays both ways to the target.
    Relay,
    /// Relays the hello both ways, then closes the initiator's side at
    /// once (a peer that accepts a dial and closes again).
    CloseAfterHello,
    /// Accepts and never answers (a dial that never ends by itself).
    Silent,
    /// Answers the hello with this refusal code, as a target would.
    Refuse(ErrorCode),
    /// Relays, after holding the connection unanswered this long (a dial
    /// that takes a while: what comes meanwhile is parked).
    RelayAfter(Duration),
}

/// A proxy in front of a target's data port.
pub struct Proxy {
    /// Where the initiator dials.
    pub addr: SocketAddr,
    /// Accepted connections so far (each a dial of the initiator).
    pub dials: Arc<AtomicUsize>,
    /// The initiator's side of each accepted connection, by order.
    pub accepted: Arc<Mutex<Vec<TcpStream>>>,
    /// Where connections accepted from now on are relayed.
    pub upstream: Arc<Mutex<SocketAddr>>,
}

impl Proxy {
    /// Closes the `n`th accepted connection both ways (as the target's idle
    /// close or an eviction would) and waits until the initiator's end has
    /// read it (`CLOSE_WAIT`), before any chunk is sent on it.
    pub fn close(&self, n: usize) {
        let s = self.accepted.lock().unwrap()[n].try_clone().unwrap();
        s.shutdown(std::net::Shutdown::Both).unwrap();
        let deadline = Instant::now() + WAIT;
        while !closed_by_peer_towards(&self.addr) {
            assert!(Instant::now() < deadline, "the initiator never saw the close");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Connections accepted so far.
    pub fn dials(&self) -> usize {
        self.dials.load(Ordering::SeqCst)
    }
}

/// A proxy to `upstream` whose `n`th connection (from 0) meets `mode(n)`.
pub fn proxy(upstream: SocketAddr, mode: impl Fn(usize) -> Mode + Send + 'static) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let dials = Arc::new(AtomicUsize::new(0));
    let accepted = Arc::new(Mutex::new(Vec::new()));
    let (count, keep) = (dials.clone(), accepted.clone());
    let upstream = Arc::new(Mutex::new(upstream));
    let to = upstream.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let n = count.fetch_add(1, Ordering::SeqCst);
            // Past a few hundred dials the test has its answer: close this
            // one and stop listening (later dials are refused), so a
            // looping initiator cannot exhaust descriptors.
            if n > 400 {
                return;
            }
            keep.lock().unwrap().push(client.try_clone().unwrap());
            let (m, upstream) = (mode(n), *to.lock().unwrap());
            std::thread::spawn(move || serve(client, upstream, m));
        }
    });
    Proxy { addr, dials, accepted, upstream }
}

/// Serves one accepted connection as `mode` says.
fn serve(mut client: TcpStream, upstream: SocketAddr, mode: Mode) {
    match mode {
        Mode::Silent => {
            // Held open, never answered, until the initiator goes.
            let _ = client.read_to_end(&mut Vec::new());
        }
        Mode::Refuse(code) => {
            let mut hello = [0u8; CLIENT_HELLO_BYTES];
            if client.read_exact(&mut hello).is_ok() {
                let _ = client.write_all(ServerHello::new(-(code as i32), 0, 0, [0; 16]).as_bytes());
            }
        }
        Mode::CloseAfterHello => {
            let Ok(mut target) = TcpStream::connect(upstream) else { return };
            let mut hello = [0u8; CLIENT_HELLO_BYTES];
            let mut answer = [0u8; SERVER_HELLO_BYTES];
            if client.read_exact(&mut hello).is_ok()
                && target.write_all(&hello).is_ok()
                && target.read_exact(&mut answer).is_ok()
            {
                let _ = client.write_all(&answer);
            }
            let _ = client.shutdown(std::net::Shutdown::Both);
        }
        Mode::RelayAfter(wait) => {
            std::thread::sleep(wait);
            serve(client, upstream, Mode::Relay);
        }
        Mode::Relay => {
            let Ok(target) = TcpStream::connect(upstream) else { return };
            let (mut c2, mut t2) = (client.try_clone().unwrap(), target.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c2, &mut t2);
                let _ = t2.shutdown(std::net::Shutdown::Both);
                let _ = c2.shutdown(std::net::Shutdown::Both);
            });
            let (mut t, mut c) = (target, client);
            let _ = std::io::copy(&mut t, &mut c);
            let _ = c.shutdown(std::net::Shutdown::Both);
            let _ = t.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// True when some connection of this host to `to` was closed by `to` and
/// not yet by us (`CLOSE_WAIT`, state 08 in `/proc/net/tcp`).
pub fn closed_by_peer_towards(to: &SocketAddr) -> bool {
    let port = format!(":{:04X}", to.port());
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table).is_ok_and(|text| {
            text.lines().skip(1).any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                fields.get(2).is_some_and(|remote| remote.ends_with(&port)) && fields.get(3) == Some(&"08")
            })
        })
    })
}

/// A target, an initiator with one lane (one data connection) reaching the
/// target's data port through a proxy, and an open tcp segment.
pub struct ProxiedPair {
    pub target: Engine,
    pub region: kvring::Region,
    pub initiator: Engine,
    pub local: kvring::Region,
    pub segment: Segment,
    pub proxy: Proxy,
    /// The whole local region onto the whole target region.
    pub descs: [BlockDesc; 1],
}

/// [`proxied_pair`] with host memory and the builder as it is.
pub fn pair(name: &str, io_timeout: Duration, mode: impl Fn(usize) -> Mode + Send + 'static) -> ProxiedPair {
    proxied_pair(name, io_timeout, None, |b| b, mode)
}

/// A [`ProxiedPair`]: the initiator's region on `gpu`'s device 0 where given
/// (staged over tcp through pinned pages), its builder passed through
/// `tweak`.
pub fn proxied_pair(
    name: &str,
    io_timeout: Duration,
    gpu: Option<Arc<SimGpu>>,
    tweak: impl FnOnce(kvring::EngineBuilder) -> kvring::EngineBuilder,
    mode: impl Fn(usize) -> Mode + Send + 'static,
) -> ProxiedPair {
    let target = super::engine(&format!("{name}-target"));
    let region = target.alloc_region(8192, RegionInfo::raw()).unwrap();
    let upstream: SocketAddr = target.tcp_addr().unwrap().parse().unwrap();
    let proxy = proxy(upstream, mode);
    let mut descriptor = kvring::testing::descriptor(&target);
    descriptor.tcp_addr = Some(proxy.addr.to_string());
    let (control, _server) = answering(&descriptor);
    let mut builder = tweak(super::builder(&format!("{name}-initiator")).lanes(1).io_timeout(io_timeout));
    let mut info = RegionInfo::raw();
    if let Some(gpu) = gpu {
        builder = builder.gpu(gpu as Arc<dyn Gpu>);
        info = info.on_gpu(0);
    }
    let initiator = builder.build().unwrap();
    let local = initiator.alloc_region(8192, info).unwrap();
    let segment = initiator.open_segment_with(&control, Some(TransportKind::Tcp), WAIT).unwrap();
    assert_eq!(proxy.dials(), 1, "the open dials one data connection");
    let descs = [BlockDesc::new(local.id(), 0, region.id(), 0, 8192)];
    ProxiedPair { target, region, initiator, local, segment, proxy, descs }
}

impl ProxiedPair {
    /// Polls until the proxy saw `n` dials.
    pub fn until_dials(&self, n: usize) {
        let deadline = Instant::now() + WAIT;
        while self.proxy.dials() < n {
            assert!(Instant::now() < deadline, "the initiator never dialled again");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}
