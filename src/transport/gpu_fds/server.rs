//! The exporter's side of the GPU descriptor socket (see the module above):
//! one accepting thread, a bounded number of connection threads, each
//! connection proven before anything is passed.

use super::MAX_FABRIC_PER_MESSAGE;
use super::{old_request_version, Answer, Challenge, Hello, Request, HELLO_BYTES, MAX_REFUSAL_BYTES, REQUEST_BYTES};
use crate::auth::{random_bytes, Authenticator, MAC_BYTES};
use crate::gpu::fd::{peer_cred, send_with_fds, MAX_FDS_PER_MESSAGE};
use crate::gpu::{HandleKind, Shareable};
use crate::mem::{Access, Registry};
use crate::region_id::RegionId;
use crate::seal::{check_gpu_fds_proof, gpu_fds_proof, End};
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// Longest `stop` tries to connect to its own socket to wake the accept.
const STOP_WAKE_WAIT: Duration = Duration::from_secs(1);

/// Most connections served at once; more are closed at accept.
pub(crate) const MAX_CONNECTIONS: usize = 16;
/// Longest a proven connection may keep the server waiting for its next
/// bytes.
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest a connection may take to send its hello and proof: one that
/// proves nothing holds one of [`MAX_CONNECTIONS`] only this long.
pub(crate) const PROOF_TIMEOUT: Duration = Duration::from_secs(2);
/// Most connections one process (its `SO_PEERCRED` pid) may hold before
/// they prove the session: one process reconnecting without end cannot
/// take every one of [`MAX_CONNECTIONS`] from the openers that prove.
pub(crate) const MAX_UNPROVEN_PER_PROCESS: usize = 4;
/// Most unproven connections all the processes of one user other than
/// this process's own (`SO_PEERCRED` uid) may hold together: a stranger
/// with many processes holds no more than one with one.
pub(crate) const MAX_UNPROVEN_PER_STRANGER: usize = 4;
/// Most unproven connections all users other than this process's own may
/// hold together: at least half of [`MAX_CONNECTIONS`] stay for the
/// owner's user, whose processes are its peers (docs/SECURITY.md: processes
/// of the owner's own user are outside what the token separates, and they
/// are bounded per process only).
pub(crate) const MAX_UNPROVEN_STRANGERS: usize = MAX_CONNECTIONS / 2;

/// Unproven connections, counted by process, by stranger user, and for all
/// strangers together.
#[derive(Debug, Default)]
struct UnprovenCounts {
    by_pid: std::collections::HashMap<u32, usize>,
    by_stranger: std::collections::HashMap<u32, usize>,
    strangers: usize,
}

/// Who holds the other end of one unproven connection.
#[derive(Debug, Clone, Copy)]
struct Opener {
    pid: u32,
    /// The uid, when it is not this process's own.
    stranger: Option<u32>,
}

impl UnprovenCounts {
    /// Counts `opener` in, unless it or its user holds its share already.
    fn admit(&mut self, opener: Opener) -> bool {
        let process = self.by_pid.get(&opener.pid).copied().unwrap_or(0);
        if process >= MAX_UNPROVEN_PER_PROCESS {
            return false;
        }
        if let Some(uid) = opener.stranger {
            let user = self.by_stranger.get(&uid).copied().unwrap_or(0);
            if user >= MAX_UNPROVEN_PER_STRANGER || self.strangers >= MAX_UNPROVEN_STRANGERS {
                return false;
            }
            *self.by_stranger.entry(uid).or_insert(0) += 1;
            self.strangers += 1;
        }
        *self.by_pid.entry(opener.pid).or_insert(0) += 1;
        true
    }

    /// Counts `opener` out (it proved the session, or its connection ended).
    fn release(&mut self, opener: Opener) {
        fn down(map: &mut std::collections::HashMap<u32, usize>, key: u32) {
            if let Some(count) = map.get_mut(&key) {
                *count -= 1;
                if *count == 0 {
                    map.remove(&key);
                }
            }
        }
        down(&mut self.by_pid, opener.pid);
        if let Some(uid) = opener.stranger {
            down(&mut self.by_stranger, uid);
            self.strangers -= 1;
        }
    }
}

/// What every connection of one server reads.
#[derive(Debug)]
struct Shared {
    registry: Arc<Registry>,
    auth: Option<Arc<Authenticator>>,
    epoch: u64,
    connections: AtomicUsize,
    /// Connections not yet proven, by who holds their other end.
    unproven: Mutex<UnprovenCounts>,
    stop: AtomicBool,
}

/// One connection counted among its process's unproven ones until it
/// proves the session or ends.
struct Unproven<'a> {
    shared: &'a Shared,
    opener: Option<Opener>,
}

impl Unproven<'_> {
    fn proven(&mut self) {
        let Some(opener) = self.opener.take() else { return };
        self.shared.unproven.lock().unwrap_or_else(|p| p.into_inner()).release(opener);
    }
}

impl Drop for Unproven<'_> {
    fn drop(&mut self) {
        self.proven();
    }
}

/// The servers of this process's engines, by socket name: a peer in this
/// very process is served from its registry directly.
static LOCAL: Mutex<Vec<(String, Weak<Shared>)>> = Mutex::new(Vec::new());

fn local() -> std::sync::MutexGuard<'static, Vec<(String, Weak<Shared>)>> {
    LOCAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// An engine's GPU descriptor server; stopped when dropped.
#[derive(Debug)]
pub(crate) struct GpuFdServer {
    name: String,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl GpuFdServer {
    /// Serves the GPU regions of `registry` on the abstract socket of
    /// engine `epoch`, with proofs under `auth` when the engine has a token.
    pub(crate) fn start(
        registry: Arc<Registry>,
        auth: Option<Arc<Authenticator>>,
        epoch: u64,
    ) -> std::io::Result<Self> {
        let name = super::name(crate::gpu::fd::instance(), epoch);
        let listener = UnixListener::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
        let shared = Arc::new(Shared {
            registry,
            auth,
            epoch,
            connections: AtomicUsize::new(0),
            unproven: Mutex::default(),
            stop: AtomicBool::new(false),
        });
        let accepting = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvring-gpu-fds".into())
            .spawn(move || accept_loop(listener, accepting))?;
        let mut servers = local();
        servers.retain(|(_, weak)| weak.strong_count() > 0);
        servers.push((name.clone(), Arc::downgrade(&shared)));
        Ok(Self { name, shared, thread: Some(thread) })
    }

    /// The socket's abstract name (what the descriptor advertises).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Stops accepting; connections in progress end at their next read.
    pub(crate) fn stop(&mut self) {
        let Some(thread) = self.thread.take() else { return };
        self.shared.stop.store(true, Ordering::Release);
        local().retain(|(name, _)| name != &self.name);
        // Wakes the accept (it sees `stop` and returns). Where no connection
        // can be made (descriptors run out, or a flood keeps the queue full
        // past the wake's deadline), the thread is left to end at the next
        // one rather than waited for without a bound.
        let deadline = std::time::Instant::now() + STOP_WAKE_WAIT;
        let woken = crate::gpu::fd::connect_abstract(self.name.as_bytes(), deadline).is_ok();
        if woken {
            let _ = thread.join();
        }
    }
}

impl Drop for GpuFdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Serves one connection already accepted (the fuzz target's way in).
#[cfg(feature = "testing")]
pub(crate) fn serve_connection(
    stream: &UnixStream,
    registry: Arc<Registry>,
    auth: Option<Arc<Authenticator>>,
    epoch: u64,
) -> Result<(), String> {
    let shared = Shared {
        registry,
        auth,
        epoch,
        connections: AtomicUsize::new(1),
        unproven: Mutex::default(),
        stop: AtomicBool::new(false),
    };
    serve(stream, &shared, Unproven { shared: &shared, opener: None })
}

/// Region `id` of the engine of this process serving socket `name`, as its
/// own registry has it (address, length and rights, never a descriptor's):
/// `None` when no engine of this process serves that socket.
pub(crate) fn local_region(name: &str, id: RegionId) -> Option<Result<(u64, u64, Access), String>> {
    let shared = local().iter().find(|(n, _)| n == name).and_then(|(_, weak)| weak.upgrade())?;
    Some(shared.registry.get(id).map_err(|e| e.to_string()).and_then(|entry| {
        if entry.device.is_none() || !grants_peers(entry.info.access) {
            return Err(format!("region {id} is not GPU memory open to peers"));
        }
        Ok((entry.addr as u64, entry.len as u64, entry.info.access))
    }))
}

/// Region `id`'s fence table page, of the engine of this process serving
/// socket `name` (shared as it is, no descriptor): `None` when no engine of
/// this process serves that socket.
pub(crate) fn local_fences(
    name: &str,
    id: RegionId,
) -> Option<Result<Arc<crate::mem::fence_file::SharedFences>, String>> {
    let shared = local().iter().find(|(n, _)| n == name).and_then(|(_, weak)| weak.upgrade())?;
    Some(shared.registry.get(id).map_err(|e| e.to_string()).and_then(|entry| {
        let device = entry.device.as_ref().ok_or_else(|| format!("region {id} is not GPU memory"))?;
        device.fences.clone()
    }))
}

/// True when peers hold some right to a region.
fn grants_peers(access: Access) -> bool {
    access.contains(Access::REMOTE_READ) || access.contains(Access::REMOTE_WRITE)
}

fn accept_loop(listener: UnixListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(stream) = stream else { continue };
        if shared.connections.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            shared.connections.fetch_sub(1, Ordering::AcqRel);
            continue; // closed: the opener sees its hello go unanswered
        }
        // One process, and all the processes of one other user, hold at
        // most a few unproven places; other users together at most half.
        // Credentials the kernel will not give are a stranger's (uid
        // u32::MAX, nobody's).
        let (pid, uid) = peer_cred(&stream).unwrap_or((0, u32::MAX));
        // SAFETY: geteuid has no preconditions and cannot fail.
        let stranger = (uid != unsafe { libc::geteuid() }).then_some(uid);
        let opener = Opener { pid, stranger };
        if !shared.unproven.lock().unwrap_or_else(|p| p.into_inner()).admit(opener) {
            shared.connections.fetch_sub(1, Ordering::AcqRel);
            continue;
        }
        let serving = shared.clone();
        let spawned = std::thread::Builder::new().name("kvring-gpu-fds-conn".into()).spawn(move || {
            let unproven = Unproven { shared: &serving, opener: Some(opener) };
            if let Err(reason) = serve(&stream, &serving, unproven) {
                tracing::debug!(%reason, "GPU descriptor connection ended");
            }
            serving.connections.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            drop(Unproven { shared: &shared, opener: Some(opener) });
            shared.connections.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One connection: the proofs, then requests until the opener hangs up.
fn serve(stream: &UnixStream, shared: &Shared, mut unproven: Unproven<'_>) -> Result<(), String> {
    let io = |e: std::io::Error| e.to_string();
    // One deadline for the hello and the proof together: a timeout per
    // read let a stranger trickling a byte at a time hold its place for
    // as many timeouts as the hello and proof have bytes.
    let proof_deadline = std::time::Instant::now() + PROOF_TIMEOUT;
    stream.set_write_timeout(Some(IO_TIMEOUT)).map_err(io)?;
    let mut hello = [0u8; HELLO_BYTES];
    read_by(stream, &mut hello, proof_deadline).map_err(io)?;
    let hello = Hello::decode(&hello)?;
    let nonce = random_bytes();
    let session = match &shared.auth {
        None => None,
        // A session this engine's start never issued gets no proof of
        // anything, and its connection is closed.
        Some(auth) => Some(auth.session_for(&hello.cn, &hello.sn).ok_or("a session this engine never issued")?),
    };
    let proof = session
        .as_ref()
        .map_or([0u8; MAC_BYTES], |s| gpu_fds_proof(s, End::Target, &hello.nonce, &nonce, shared.epoch));
    let challenge = Challenge { proof_required: session.is_some(), nonce, proof };
    (&*stream).write_all(&challenge.encode()).map_err(io)?;
    if let Some(session) = &session {
        let mut theirs = [0u8; MAC_BYTES];
        read_by(stream, &mut theirs, proof_deadline).map_err(io)?;
        if !check_gpu_fds_proof(session, End::Initiator, &hello.nonce, &nonce, shared.epoch, &theirs) {
            return Err("the opener did not prove the session".into());
        }
    }
    unproven.proven();
    stream.set_read_timeout(Some(IO_TIMEOUT)).map_err(io)?;
    loop {
        let mut request = [0u8; REQUEST_BYTES];
        match (&*stream).read_exact(&mut request[..4]) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
        // An older opener's request ("KVF3": 28 bytes) is refused by name
        // at once, not read as this form nor left to the read timeout.
        if let Some(reason) = old_request_version(&request[..4]) {
            refuse(stream, reason.clone()).map_err(io)?;
            return Err(reason);
        }
        (&*stream).read_exact(&mut request[4..]).map_err(io)?;
        let request = Request::decode(&request)?;
        // A stopped engine's server passes nothing more.
        if shared.stop.load(Ordering::Acquire) {
            return Ok(());
        }
        match descriptors(shared, request) {
            Ok(Run::Fds(fds, handles)) => {
                let answer = Answer::Descriptors { count: fds.len() as u32, handles };
                let borrowed: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
                send_with_fds(stream, &answer.encode(), &borrowed).map_err(io)?;
                // Our copies close here: the opener holds its own.
            }
            Ok(Run::Fabric(..)) if !request.takes_fabric => {
                // A "KVF6" opener reads FABRIC regions as unopenable (their
                // handles are in a field it skips); were it to ask anyway,
                // it is told why rather than sent an answer it cannot read.
                let why = format!("region {:#x}: {}", request.region, crate::segment::gpu::FABRIC_FOR_OLDER_PEERS);
                refuse(stream, why).map_err(io)?;
            }
            Ok(Run::Fabric(fabric, handles)) => {
                let mut bytes = Answer::Fabric { count: fabric.len() as u32, handles }.encode().to_vec();
                fabric.iter().for_each(|handle| bytes.extend_from_slice(handle));
                (&*stream).write_all(&bytes).map_err(io)?;
            }
            Err(reason) => refuse(stream, reason).map_err(io)?,
        }
    }
}

/// Answers a request with a refusal and its reason (cut to
/// `MAX_REFUSAL_BYTES` on a character boundary).
fn refuse(stream: &UnixStream, mut reason: String) -> std::io::Result<()> {
    let mut end = reason.len().min(MAX_REFUSAL_BYTES);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason.truncate(end);
    let answer = Answer::Refused { len: reason.len() as u32 };
    let mut bytes = answer.encode().to_vec();
    bytes.extend_from_slice(reason.as_bytes());
    (&*stream).write_all(&bytes)
}

/// Fills `buf` from `stream` by `deadline`, however the bytes are split.
fn read_by(stream: &UnixStream, buf: &mut [u8], deadline: std::time::Instant) -> std::io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        stream.set_read_timeout(Some(left))?;
        match (&*stream).read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A run of what opens a region's handles, and the region's handle count.
enum Run {
    Fds(Vec<OwnedFd>, u32),
    Fabric(Vec<[u8; crate::gpu::FABRIC_HANDLE_BYTES]>, u32),
}

/// The descriptors (or fabric handles) a request asks for, made now from
/// this engine's own export of the region (never from anything the opener
/// sent but the region's id and a range of its handles), and the region's
/// handle count.
fn descriptors(shared: &Shared, request: Request) -> Result<Run, String> {
    let id = RegionId::from_raw(request.region);
    // The lease keeps the region registered while its memory is shared.
    let lease = shared.registry.lease(id).map_err(|_| format!("region {id} is not registered here"))?;
    let entry = lease.entry();
    if !grants_peers(entry.info.access) {
        return Err(format!("region {id} grants peers no right"));
    }
    let device = entry.device.as_ref().ok_or_else(|| format!("region {id} is not GPU memory"))?;
    if request.first == super::FENCE_TABLE {
        // Writers check it; a region peers may only read needs none.
        if !entry.info.access.contains(Access::REMOTE_WRITE) {
            return Err(format!("region {id} grants peers no write, so it has no fence table for them"));
        }
        let page = device.fences.as_ref().map_err(|why| format!("region {id}: {why}"))?;
        let fd = page.share().map_err(|e| format!("region {id}'s fence table: {e}"))?;
        return Ok(Run::Fds(vec![fd], super::FENCE_TABLE));
    }
    let export = device.export.as_ref().map_err(|why| format!("region {id} was not exported: {why}"))?;
    let handles = export.handles();
    let first = request.first as usize;
    let fabric = handles.first().is_some_and(|h| h.kind == HandleKind::Fabric);
    let most = if fabric { MAX_FABRIC_PER_MESSAGE } else { MAX_FDS_PER_MESSAGE };
    let count = (request.count as usize).min(most).min(handles.len().saturating_sub(first));
    if count == 0 {
        return Err(format!("region {id} has {} handles; asked for {} from {first}", handles.len(), request.count));
    }
    let total = handles.len() as u32;
    let (mut fds, mut fabrics) = (Vec::new(), Vec::new());
    for (i, handle) in handles[first..first + count].iter().enumerate() {
        let shared = device.gpu.share(handle).map_err(|e| format!("handle {} of region {id}: {e}", first + i))?;
        match (shared, fabric) {
            (Some(Shareable::Fd(fd)), false) => fds.push(fd),
            (Some(Shareable::Fabric(bytes)), true) => fabrics.push(bytes),
            _ => return Err(format!("handle {} of region {id} is shared by nothing a peer can open", first + i)),
        }
    }
    Ok(if fabric { Run::Fabric(fabrics, total) } else { Run::Fds(fds, total) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_server_leaves_no_name_behind() {
        let registry = Arc::new(Registry::new(4));
        let mut server = GpuFdServer::start(registry, None, 0x5eed).unwrap();
        let name = server.name().to_string();
        assert!(local_region(&name, RegionId::new(0, 1)).is_some_and(|r| r.is_err()), "nothing registered");
        server.stop();
        assert!(local_region(&name, RegionId::new(0, 1)).is_none());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        assert!(UnixStream::connect_addr(&addr).is_err(), "nobody listens any more");
    }

    #[test]
    fn strangers_are_bounded_per_user_and_together_the_owners_user_per_process() {
        let mut counts = UnprovenCounts::default();
        let stranger = |pid, uid| Opener { pid, stranger: Some(uid) };
        // One stranger user, many processes: 4 places in all.
        let admitted = (0..10).filter(|&pid| counts.admit(stranger(100 + pid, 1000))).count();
        assert_eq!(admitted, MAX_UNPROVEN_PER_STRANGER);
        // Strangers together: half the places.
        let admitted = (0..10).filter(|&uid| counts.admit(stranger(200 + uid, 2000 + uid))).count();
        assert_eq!(admitted, MAX_UNPROVEN_STRANGERS - MAX_UNPROVEN_PER_STRANGER);
        assert_eq!(counts.strangers, MAX_UNPROVEN_STRANGERS);
        // The owner's user: per process only, untouched by the strangers.
        let owner = |pid| Opener { pid, stranger: None };
        let admitted = (0..MAX_UNPROVEN_PER_PROCESS + 2).filter(|_| counts.admit(owner(7))).count();
        assert_eq!(admitted, MAX_UNPROVEN_PER_PROCESS);
        assert!(counts.admit(owner(8)));
        // A stranger's connection that ends gives its place back.
        counts.release(stranger(100, 1000));
        assert!(counts.admit(stranger(300, 1000)));
        assert!(!counts.admit(stranger(301, 1000)));
    }
}
