//! The opener's side of the GPU descriptor socket (see the module above):
//! it connects to the socket a peer's descriptor advertises, takes it only
//! from the process that answered the handshake, proves the session, and
//! fetches descriptors a run at a time as the provider asks for them.

use super::{read_fabric, Answer, Challenge, Hello, Request, ANSWER_BYTES, CHALLENGE_BYTES, MAX_FABRIC_PER_MESSAGE};
use crate::auth::{random_bytes, Session};
use crate::error::{Error, Result};
use crate::gpu::fd::{connect_abstract, peer_pid, recv_with_fds, MAX_FDS_PER_MESSAGE};
use crate::gpu::{HandleKind, Shareable};
use crate::region_id::RegionId;
use crate::seal::{check_gpu_fds_proof, gpu_fds_proof, End};
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::Instant;

/// A proven connection to a peer's GPU descriptor server, and the run of
/// descriptors (or fabric handles) fetched but not yet handed over (at
/// most one answer's).
#[derive(Debug)]
pub(crate) struct GpuFdClient {
    stream: UnixStream,
    peer: String,
    deadline: Instant,
    /// The region and handle index the next fetched descriptor belongs to.
    region: Option<RegionId>,
    next: usize,
    fetched: VecDeque<Shareable>,
}

fn refused(peer: &str, reason: impl std::fmt::Display) -> Error {
    Error::Unauthorized { reason: format!("{peer}'s GPU descriptor socket: {reason}") }
}

impl GpuFdClient {
    /// A client over `stream`, taken as proven (the fuzz target's way in:
    /// a server's answers to decode).
    #[cfg(feature = "testing")]
    pub(crate) fn over(stream: UnixStream, deadline: Instant) -> Self {
        GpuFdClient { stream, peer: "a fuzzed peer".into(), deadline, region: None, next: 0, fetched: VecDeque::new() }
    }

    /// Connects to socket `name`, which must be held by process `pid` (the
    /// one that answered the handshake), and proves `session` (a tokened
    /// opener refuses a server that asks no proof, or cannot make one).
    pub(crate) fn connect(
        peer: &str,
        name: &str,
        pid: u32,
        session: Option<&Session>,
        epoch: u64,
        deadline: Instant,
    ) -> Result<Self> {
        let stream = connect_abstract(name.as_bytes(), deadline).map_err(|e| match crate::net::is_timeout(&e) {
            true => Error::Timeout { what: "the peer's GPU socket to accept", waited: std::time::Duration::ZERO },
            false => Error::io(format!("connecting to {peer}'s GPU socket"), e),
        })?;
        let holder = peer_pid(&stream).map_err(|e| Error::io("reading a socket's peer credentials", e))?;
        if holder != pid || pid == 0 {
            return Err(refused(
                peer,
                format!("it is served by pid {holder}, not by pid {pid}, the process that answered the handshake"),
            ));
        }
        let mut client =
            GpuFdClient { stream, peer: peer.to_string(), deadline, region: None, next: 0, fetched: VecDeque::new() };
        client.prove(session, epoch)?;
        Ok(client)
    }

    /// The hello, the server's challenge and proof, and ours.
    fn prove(&mut self, session: Option<&Session>, epoch: u64) -> Result<()> {
        let nonce = random_bytes();
        let (cn, sn) = session.map_or(([0; 16], [0; 16]), |s| (s.client_nonce, s.server_nonce));
        self.write(&Hello { cn, sn, nonce }.encode())?;
        let mut challenge = [0u8; CHALLENGE_BYTES];
        self.read(&mut challenge)?;
        let challenge = Challenge::decode(&challenge).map_err(|reason| refused(&self.peer, reason))?;
        match (session, challenge.proof_required) {
            (None, false) => Ok(()),
            (None, true) => Err(refused(&self.peer, "it requires a token; configure the cluster's token here too")),
            (Some(_), false) => Err(refused(&self.peer, "it asks no proof while this engine has a token; refusing it")),
            (Some(session), true) => {
                if !check_gpu_fds_proof(session, End::Target, &nonce, &challenge.nonce, epoch, &challenge.proof) {
                    return Err(refused(&self.peer, "it does not prove the session; nothing was taken from it"));
                }
                self.write(&gpu_fds_proof(session, End::Initiator, &nonce, &challenge.nonce, epoch))
            }
        }
    }

    /// What opens handle `index` of region `region` (of `handles`, all of
    /// `kind`): its descriptor or fabric handle, fetched with the next ones
    /// of the region unless already here.
    pub(crate) fn handle(
        &mut self,
        region: RegionId,
        kind: HandleKind,
        handles: usize,
        index: usize,
    ) -> Result<Shareable> {
        if self.region != Some(region) || self.next != index || self.fetched.is_empty() {
            self.fetched.clear(); // closes any left over
            self.fetch(region, kind, handles, index)?;
        }
        self.next += 1;
        Ok(self.fetched.pop_front().expect("fetched at least one"))
    }

    /// The descriptor of `region`'s fence table page (`mem::fence_file`).
    pub(crate) fn fence_fd(&mut self, region: RegionId) -> Result<OwnedFd> {
        self.fetched.clear();
        self.region = None;
        let request = Request { region: region.raw(), first: super::FENCE_TABLE, count: 1, takes_fabric: true };
        let what = format!("region {region}'s fence table");
        let (answer, mut fds) = self.exchange(&request, 1, &what)?;
        if answer == (Answer::Descriptors { count: 1, handles: super::FENCE_TABLE }) && fds.len() == 1 {
            return Ok(fds.pop().expect("one descriptor"));
        }
        Err(self.out_of_step(format!("{} descriptors ({answer:?}) for {what}", fds.len())))
    }

    /// Asks for handles `index..` of `region` and takes the answer's run,
    /// which must be of `kind`: descriptors attached, or fabric handles
    /// following it (each count checked before anything more is read).
    fn fetch(&mut self, region: RegionId, kind: HandleKind, handles: usize, index: usize) -> Result<()> {
        let most = if kind == HandleKind::Fabric { MAX_FABRIC_PER_MESSAGE } else { MAX_FDS_PER_MESSAGE };
        let want = handles.saturating_sub(index).min(most);
        let request = Request { region: region.raw(), first: index as u32, count: want as u32, takes_fabric: true };
        let what = format!("region {region}");
        let (answer, fds) = self.exchange(&request, MAX_FDS_PER_MESSAGE, &what)?;
        let (count, theirs, fabric) = match answer {
            Answer::Descriptors { count, handles } if kind != HandleKind::Fabric => (count, handles, false),
            Answer::Fabric { count, handles } if kind == HandleKind::Fabric && fds.is_empty() => (count, handles, true),
            other => {
                let said = format!("{other:?} with {} descriptors", fds.len());
                return Err(self.out_of_step(format!("{said}, for {kind:?} handles of {what}")));
            }
        };
        let got = if fabric { count as usize } else { fds.len() };
        if theirs as usize != handles || count as usize != got || got == 0 || got > want {
            return Err(self.out_of_step(format!(
                "{got} handles (said {count}) of {theirs} handles, for {want} of {handles} of {what}"
            )));
        }
        let run: VecDeque<Shareable> = match fabric {
            true => self.read_fabric(count)?.into_iter().map(Shareable::Fabric).collect(),
            false => fds.into_iter().map(Shareable::Fd).collect(),
        };
        (self.region, self.next, self.fetched) = (Some(region), index, run);
        Ok(())
    }

    /// The `count` fabric handles following an answer, by the deadline.
    fn read_fabric(&mut self, count: u32) -> Result<Vec<[u8; crate::gpu::FABRIC_HANDLE_BYTES]>> {
        self.set_timeouts()?;
        read_fabric(&mut &self.stream, count).map_err(|e| self.io_error(e))
    }

    /// Sends `request` and takes its answer (whatever follows it is the
    /// caller's to read) with the descriptors it carried (at most
    /// `max_fds`), or the peer's refusal, read whole, as an error naming
    /// `what`.
    fn exchange(&mut self, request: &Request, max_fds: usize, what: &str) -> Result<(Answer, Vec<OwnedFd>)> {
        self.write(&request.encode())?;
        let mut answer = [0u8; ANSWER_BYTES];
        self.set_timeouts()?;
        let fds = recv_with_fds(&self.stream, &mut answer, max_fds).map_err(|e| match e.kind() {
            // More descriptors than asked for: a protocol break, not a
            // failing socket (those attached were closed on receipt).
            std::io::ErrorKind::InvalidData => self.out_of_step(format!("{e}, for {what}")),
            _ => self.io_error(e),
        })?;
        match Answer::decode(&answer).map_err(|reason| self.out_of_step(reason))? {
            Answer::Refused { len } => {
                let mut reason = vec![0u8; len as usize];
                self.read(&mut reason)?;
                Err(Error::Gpu {
                    device: "cuda_ipc".into(),
                    reason: format!("{} refused {what}: {}", self.peer, String::from_utf8_lossy(&reason)),
                })
            }
            answer => Ok((answer, fds)),
        }
    }

    /// An answer that breaks the protocol: the connection is shut, so that
    /// whatever of it is left unread is never taken as a later answer.
    fn out_of_step(&self, reason: String) -> Error {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        malformed(reason)
    }

    fn set_timeouts(&self) -> Result<()> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout { what: "the peer's GPU socket", waited: std::time::Duration::ZERO });
        }
        let set = self.stream.set_read_timeout(Some(left)).and_then(|()| self.stream.set_write_timeout(Some(left)));
        set.map_err(|e| Error::io("setting a socket timeout", e))
    }

    /// A read or write that failed part way: the connection is shut, as
    /// for an answer out of step, since where the next answer starts is
    /// no longer known (cuda_ipc goes on with this client after a region's
    /// fence page fails).
    fn io_error(&self, error: std::io::Error) -> Error {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if crate::net::is_timeout(&error) {
            return Error::Timeout { what: "the peer's GPU socket", waited: std::time::Duration::ZERO };
        }
        Error::io(format!("{}'s GPU descriptor socket (did it close us?)", self.peer), error)
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.set_timeouts()?;
        (&self.stream).write_all(bytes).map_err(|e| self.io_error(e))
    }

    fn read(&mut self, bytes: &mut [u8]) -> Result<()> {
        self.set_timeouts()?;
        (&self.stream).read_exact(bytes).map_err(|e| self.io_error(e))
    }
}

/// An answer that breaks the descriptor protocol.
fn malformed(reason: String) -> Error {
    Error::malformed("GPU descriptor answer", reason)
}
