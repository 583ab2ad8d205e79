//! How a lane does its socket I/O, chosen by measurement: the server side
//! of a loopback connection driven the way a lane would drive it, in two
//! models, against the same busy-polled client:
//!
//! - **epoll**: a non-blocking socket registered with mio (epoll,
//!   edge-triggered), the thread polling with a zero timeout and reading
//!   and writing until the socket would block: what the lanes do;
//! - **glommio**: glommio's `TcpStream` on a `LocalExecutor` (io_uring),
//!   awaited as an async task would. Without `spin_before_park`: with it a
//!   round trip took as long as the spin (1 ms of spin, 1 ms round trips;
//!   10 ms, 8 ms), since the spinning reactor does not reap the socket's
//!   completions; parked in `io_uring_enter` it is woken by them.
//!
//! Two shapes: a 4 KiB message and its 8-byte ack (a single-block WRITE's
//! round trip; p50), and a stream of 64 KiB and 1 MiB messages (GB/s). A
//! third comparison is the stream's sender with `MSG_ZEROCOPY` against a
//! plain `send` (epoll server). Every figure is printed with its ratio to
//! the epoll figure of the same run.
//!
//! `cargo bench --bench socket_io`; `-- --test` (CI) runs a short pass.

use futures_lite::{AsyncReadExt, AsyncWriteExt};
use mio::{Events, Interest, Poll, Token};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

const PING: usize = 4096;
const ACK: usize = 8;

#[derive(Clone, Copy, PartialEq)]
enum Model {
    /// epoll polled with a zero timeout in a loop (a lane's busy window).
    Epoll,
    /// epoll waited on (a parked lane, woken by the socket).
    EpollParked,
    Glommio,
}

#[derive(Clone, Copy)]
enum Shape {
    /// `n` round trips of PING bytes and an ACK.
    PingPong(usize),
    /// `total` bytes in `block`-sized messages, then one ACK.
    Stream { block: usize, total: usize },
}

/// The cores of the client and the server (two distinct ones where there
/// are two).
fn cores() -> (Option<usize>, Option<usize>) {
    let ids: Vec<usize> = core_affinity::get_core_ids().unwrap_or_default().into_iter().map(|c| c.id).collect();
    (ids.first().copied(), ids.get(1).or(ids.first()).copied())
}

fn pin(core: Option<usize>) {
    if let Some(id) = core {
        core_affinity::set_for_current(core_affinity::CoreId { id });
    }
}

/// Reads exactly `buf`, spinning on a non-blocking stream.
fn spin_read(stream: &mut TcpStream, buf: &mut [u8]) {
    let mut at = 0;
    while at < buf.len() {
        match stream.read(&mut buf[at..]) {
            Ok(0) => panic!("the peer closed"),
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// Writes all of `buf`, spinning on a non-blocking stream (with
/// `MSG_ZEROCOPY` when `zerocopy`).
fn spin_write(stream: &mut TcpStream, buf: &[u8], zerocopy: bool) {
    let mut at = 0;
    while at < buf.len() {
        let sent = if zerocopy {
            // SAFETY: `buf[at..]` is valid for reads for its length and, as
            // MSG_ZEROCOPY requires, is not modified until its completion is
            // reaped (the bench never writes to it).
            let n = unsafe {
                libc::send(stream.as_raw_fd(), buf[at..].as_ptr().cast(), buf.len() - at, libc::MSG_ZEROCOPY)
            };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        } else {
            stream.write(&buf[at..])
        };
        match sent {
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if zerocopy {
                    reap_zerocopy(stream);
                }
                std::hint::spin_loop();
            }
            // Out of option memory: completions must be reaped first.
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => reap_zerocopy(stream),
            Err(e) => panic!("write: {e}"),
        }
    }
}

/// Drains `MSG_ZEROCOPY` completions from the socket's error queue.
fn reap_zerocopy(stream: &TcpStream) {
    let mut control = [0u8; 256];
    loop {
        // SAFETY: a zeroed msghdr is a valid empty header; `control` outlives
        // the call and its length is given.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len();
        // SAFETY: `msg` points only at `control`, valid for its length.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_ERRQUEUE | libc::MSG_DONTWAIT) };
        if n < 0 {
            return;
        }
    }
}

/// The server in the epoll model: one connection, served until it closes.
fn serve_epoll(listener: TcpListener, shape: Shape, parked: bool) {
    let (mut stream, _) = listener.accept().expect("accept");
    stream.set_nonblocking(true).expect("non-blocking");
    stream.set_nodelay(true).expect("nodelay");
    let mut poll = Poll::new().expect("poll");
    let mut events = Events::with_capacity(8);
    poll.registry()
        .register(&mut mio::unix::SourceFd(&stream.as_raw_fd()), Token(0), Interest::READABLE)
        .expect("register");
    let (want, answer_every) = match shape {
        Shape::PingPong(n) => (n * PING, PING),
        Shape::Stream { total, .. } => (total, total),
    };
    let mut buf = vec![0u8; 1 << 20];
    let (mut got, mut since_answer) = (0usize, 0usize);
    while got < want {
        poll.poll(&mut events, if parked { None } else { Some(Duration::ZERO) }).expect("poll");
        if events.is_empty() {
            continue;
        }
        // Edge-triggered: read until it would block.
        loop {
            match stream.read(&mut buf[..(answer_every - since_answer).min(1 << 20)]) {
                Ok(0) => return,
                Ok(n) => {
                    got += n;
                    since_answer += n;
                    if since_answer == answer_every {
                        since_answer = 0;
                        spin_write(&mut stream, &[1; ACK], false);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("server read: {e}"),
            }
        }
    }
}

/// The server in the glommio model.
fn serve_glommio(listener: TcpListener, core: Option<usize>, shape: Shape) {
    let placement = core.map_or(glommio::Placement::Unbound, glommio::Placement::Fixed);
    let executor = glommio::LocalExecutorBuilder::new(placement)
        .io_memory(512 << 10)
        .make()
        .expect("a glommio executor (needs 512 KiB of locked memory)");
    executor.run(async move {
        use std::os::fd::{FromRawFd, IntoRawFd};
        // SAFETY: the descriptor is the std listener's, whose ownership
        // `into_raw_fd` hands over: glommio's listener is its only owner.
        let listener = unsafe { glommio::net::TcpListener::from_raw_fd(listener.into_raw_fd()) };
        let mut stream = listener.accept().await.expect("accept");
        stream.set_nodelay(true).expect("nodelay");
        let (messages, size) = match shape {
            Shape::PingPong(n) => (n, PING),
            Shape::Stream { total, .. } => (1, total),
        };
        let mut buf = vec![0u8; 1 << 20];
        for _ in 0..messages {
            let mut left = size;
            while left > 0 {
                let n = stream.read(&mut buf[..left.min(1 << 20)]).await.expect("server read");
                assert!(n > 0, "the client closed");
                left -= n;
            }
            stream.write_all(&[1; ACK]).await.expect("ack");
        }
    });
}

/// Runs one shape against one server model: p50 in µs (ping-pong) or GB/s
/// (stream).
fn run(model: Model, shape: Shape, zerocopy: bool) -> f64 {
    let (client_core, server_core) = cores();
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr: SocketAddr = listener.local_addr().expect("address");
    let server = std::thread::spawn(move || {
        pin(server_core);
        match model {
            Model::Epoll => serve_epoll(listener, shape, false),
            Model::EpollParked => serve_epoll(listener, shape, true),
            Model::Glommio => serve_glommio(listener, server_core, shape),
        }
    });
    pin(client_core);
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    stream.set_nonblocking(true).expect("non-blocking");
    if zerocopy {
        let on: libc::c_int = 1;
        // SAFETY: `on` is a valid c_int for the option's length.
        let set = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ZEROCOPY,
                (&on as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(set, 0, "SO_ZEROCOPY: {}", std::io::Error::last_os_error());
    }
    let mut ack = [0u8; ACK];
    let figure = match shape {
        Shape::PingPong(n) => {
            let ping = vec![0x5au8; PING];
            let mut times: Vec<Duration> = (0..n)
                .map(|_| {
                    let started = Instant::now();
                    spin_write(&mut stream, &ping, false);
                    spin_read(&mut stream, &mut ack);
                    started.elapsed()
                })
                .collect();
            times.sort_unstable();
            times[n / 2].as_secs_f64() * 1e6
        }
        Shape::Stream { block, total } => {
            let data = vec![0x5au8; block];
            let started = Instant::now();
            for _ in 0..total / block {
                spin_write(&mut stream, &data, zerocopy);
            }
            spin_read(&mut stream, &mut ack);
            total as f64 / started.elapsed().as_secs_f64() / 1e9
        }
    };
    drop(stream);
    server.join().expect("the server thread");
    figure
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The median of `rounds` runs of each model, alternating, so noise lands
/// on all of them.
fn compare(rounds: usize, shape: Shape) -> [f64; 3] {
    let models = [Model::Epoll, Model::EpollParked, Model::Glommio];
    let mut figures: [Vec<f64>; 3] = Default::default();
    for _ in 0..rounds {
        for (i, &model) in models.iter().enumerate() {
            figures[i].push(run(model, shape, false));
        }
    }
    figures.map(median)
}

fn main() {
    let test_mode = std::env::args().any(|a| a == "--test");
    let (rounds, pings, stream_bytes) = if test_mode { (1, 500, 64 << 20) } else { (5, 20_000, 1 << 30) };
    let (client, server) = cores();
    println!("socket_io: loopback, client on core {client:?}, server on core {server:?}; epoll is the baseline");
    let [busy, parked, glommio] = compare(rounds, Shape::PingPong(pings));
    println!(
        "  4 KiB + ack round trip p50  epoll busy {busy:7.2} us | epoll parked {parked:7.2} us ({:.2}x) | glommio {glommio:7.2} us ({:.2}x)",
        parked / busy,
        glommio / busy
    );
    for block in [64 << 10, 1 << 20] {
        let [busy, parked, glommio] = compare(rounds, Shape::Stream { block, total: stream_bytes });
        println!(
            "  {:>4} KiB stream             epoll busy {busy:7.2} GB/s | epoll parked {parked:7.2} GB/s ({:5.1}%) | glommio {glommio:7.2} GB/s ({:5.1}%)",
            block >> 10,
            parked / busy * 100.0,
            glommio / busy * 100.0
        );
    }
    let shape = Shape::Stream { block: 1 << 20, total: stream_bytes };
    let (mut plain, mut zerocopy) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        plain.push(run(Model::EpollParked, shape, false));
        zerocopy.push(run(Model::EpollParked, shape, true));
    }
    let (plain, zerocopy) = (median(plain), median(zerocopy));
    println!(
        "  1 MiB stream, its sender     send {plain:7.2} GB/s | MSG_ZEROCOPY {zerocopy:7.2} GB/s ({:5.1}% of send)",
        zerocopy / plain * 100.0
    );
}
