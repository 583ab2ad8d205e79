//! The caller's handle to an open peer segment.

use crate::auth::{Initiator, Token};
use crate::control::ControlClient;
use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use crate::kv::KvLayout;
use crate::segment::{PeerSegment, RemoteRegion};
use crate::transport::TransportKind;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The region among `regions` (id, start, length) that holds all of
/// `addr..addr + len`, and the offset of `addr` in it.
pub(crate) fn locate(
    regions: impl Iterator<Item = (RegionId, u64, u64)>,
    addr: u64,
    len: u64,
) -> Option<(RegionId, u64)> {
    let end = addr.checked_add(len)?;
    regions
        .filter(|&(_, start, size)| addr >= start && start.checked_add(size).is_some_and(|stop| end <= stop))
        .map(|(id, start, _)| (id, addr - start))
        .next()
}

/// An open peer segment. Cheap to clone; closing it (through the engine)
/// makes new submissions to it fail with `UnknownSegment`.
///
/// ```no_run
/// # let engine = kvring::Engine::builder().build().unwrap();
/// let decode = engine.open_segment("127.0.0.1:7100")?;
/// let first = decode.region(0)?;               // the peer's id for its first region
/// let sum = decode.remote_checksum(first, 0, 4096, std::time::Duration::from_secs(1))?;
/// # Ok::<(), kvring::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Segment {
    pub(crate) inner: Arc<SegmentInner>,
}

#[derive(Debug)]
pub(crate) struct SegmentInner {
    /// `slot:16 | generation:16`, carried by SQEs.
    pub(crate) key: u32,
    /// Epoch of the engine that opened it, so a handle from another engine
    /// is refused.
    pub(crate) owner_epoch: u64,
    /// The name or address it was opened by.
    pub(crate) opened_as: String,
    pub(crate) peer: Arc<PeerSegment>,
    pub(crate) transport: TransportKind,
    /// Who the engine is, and its token, for control RPCs to this peer.
    pub(crate) initiator: Initiator,
    pub(crate) token: Option<Token>,
    /// The transport link the lanes use (notifications share its path).
    pub(crate) link: Arc<crate::transport::LinkState>,
    /// The peer's KV layout after its first successful fetch. Sound to
    /// keep: a peer's published layout is fixed for its life
    /// (`Engine::set_kv_layout`), and a restarted peer (another epoch)
    /// needs a new handle, whose cache starts empty.
    pub(crate) kv_layout: OnceLock<KvLayout>,
}

impl Segment {
    /// The peer engine's name.
    pub fn name(&self) -> &str {
        &self.inner.peer.descriptor().name
    }

    /// What it was opened by (a name or `host:port`).
    pub fn opened_as(&self) -> &str {
        &self.inner.opened_as
    }

    /// The peer's epoch (random at each of its starts).
    pub fn epoch(&self) -> u64 {
        self.inner.peer.descriptor().epoch
    }

    /// Where the peer's tcp data listener is, when it serves one.
    pub fn tcp_addr(&self) -> Option<&str> {
        self.inner.peer.descriptor().tcp_addr.as_deref()
    }

    /// The transport the lanes use to reach it.
    pub fn transport(&self) -> TransportKind {
        self.inner.transport
    }

    /// The peer's regions, in the order its descriptor lists them.
    pub fn regions(&self) -> &[RemoteRegion] {
        &self.inner.peer.descriptor().regions
    }

    /// The id of the peer's `position`-th region.
    pub fn region(&self, position: usize) -> Result<RegionId> {
        let regions = self.regions();
        regions.get(position).map(|r| r.id).ok_or_else(|| {
            if regions.is_empty() {
                Error::invalid(
                    "region position",
                    format!("{} exposes no region yet (it may still be starting): open it again shortly", self.name()),
                )
            } else {
                Error::invalid(
                    "region position",
                    format!("{position} but {} has {} regions", self.name(), regions.len()),
                )
            }
        })
    }

    /// The peer region holding `addr..addr + len` of the peer's address
    /// space, and the offset of `addr` in it: for callers that name remote
    /// memory by address, as Mooncake's API does. Regions the peer
    /// registered after this handle was opened are not listed: reopen it.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// # let peer_buffer: u64 = 0x7f00_0000_0000;
    /// let decode = engine.open_segment("127.0.0.1:7100")?;
    /// let (region, offset) = decode.locate(peer_buffer, 4096)?;
    /// # Ok::<(), kvring::Error>(())
    /// ```
    pub fn locate(&self, addr: u64, len: u64) -> Result<(RegionId, u64)> {
        locate(self.regions().iter().map(|r| (r.id, r.addr, r.len)), addr, len).ok_or_else(|| {
            Error::invalid("remote address", format!("{addr:#x}+{len} lies in no region of {}", self.name()))
        })
    }

    /// True once the peer is known to have restarted or gone (a broken
    /// connection, another epoch, or its metadata entry changed): batches
    /// to this handle fail with `PeerRestarted`; open the name again.
    pub fn is_stale(&self) -> bool {
        self.inner.peer.is_stale()
    }

    /// True once closed.
    pub fn is_closed(&self) -> bool {
        self.inner.peer.is_closed()
    }

    /// The peer's registered KV-cache layout (the memory-info exchange);
    /// compare it with yours
    /// ([`KvLayout::check_compatible`](crate::kv::KvLayout::check_compatible))
    /// before the first transfer.
    ///
    /// The first successful call asks the peer over the control plane (a
    /// connection, the token's handshake where there is one, or else a
    /// probe, so that a peer with another epoch is refused as
    /// `PeerRestarted` rather than its layout paired with this handle);
    /// later calls answer from this handle's copy without a round trip, as
    /// a peer's published layout is fixed for its life
    /// ([`Engine::set_kv_layout`](crate::Engine::set_kv_layout)). A peer
    /// that has published no layout yet is an error, asked again next
    /// time. A stale handle (the peer restarted) answers
    /// `PeerRestarted`: open the name again for the new peer's layout.
    pub fn kv_layout(&self, timeout: Duration) -> Result<KvLayout> {
        if self.is_stale() {
            return Err(self.restarted("this handle is stale: open it again"));
        }
        if let Some(layout) = self.inner.kv_layout.get() {
            return Ok(layout.clone());
        }
        let deadline = crate::deadline::deadline_after(timeout);
        let mut client = ControlClient::connect(&self.inner.peer.descriptor().control_addr, deadline)?;
        let epoch = match &self.inner.token {
            Some(token) => client.handshake(&self.inner.initiator, Some(token), deadline)?.descriptor.epoch,
            None => client.probe(deadline)?.1,
        };
        if epoch != self.epoch() {
            return Err(self.restarted(&format!("it answers with epoch {epoch:#x}, not {:#x}", self.epoch())));
        }
        let layout = client.memory_info(deadline)?;
        // A racing first fetch may have set it: either copy is the peer's
        // one fixed layout.
        Ok(self.inner.kv_layout.get_or_init(|| layout).clone())
    }

    /// The peer's layout asked for now over a fresh control connection,
    /// past this handle's copy: what every `kv_layout` call cost before
    /// the copy was kept, for `benches/kv_layout.rs`'s baseline.
    #[cfg(feature = "testing")]
    pub(crate) fn kv_layout_uncached(&self, timeout: Duration) -> Result<KvLayout> {
        let deadline = crate::deadline::deadline_after(timeout);
        self.control_client(deadline)?.memory_info(deadline)
    }

    fn restarted(&self, detail: &str) -> Error {
        Error::PeerRestarted { segment: self.name().to_string(), detail: detail.to_string() }
    }

    /// Asks the peer for a checksum of `len` bytes at `offset` of its region
    /// (the region must allow remote reads), over the control plane.
    pub fn remote_checksum(&self, region: RegionId, offset: u64, len: u64, timeout: Duration) -> Result<u64> {
        let remote = self.inner.peer.region(region)?;
        crate::mem::registry::check_range(region, Side::Remote, 0, offset, len, remote.len)?;
        let deadline = crate::deadline::deadline_after(timeout);
        self.control_client(deadline)?.checksum(region.raw(), offset, len, deadline)
    }

    /// Checks the peer is there now: a fresh control connection and
    /// handshake (the token's proof, where there is one); a peer answering
    /// with another epoch (it restarted) is `PeerRestarted`. Mooncake's
    /// `send_probe`.
    pub fn probe(&self, timeout: Duration) -> Result<()> {
        let deadline = crate::deadline::deadline_after(timeout);
        let mut client = ControlClient::connect(&self.inner.peer.descriptor().control_addr, deadline)?;
        let answer = client.handshake(&self.inner.initiator, self.inner.token.as_ref(), deadline)?;
        if answer.descriptor.epoch != self.epoch() {
            return Err(self.restarted(&format!(
                "it answers with epoch {:#x}, not {:#x}",
                answer.descriptor.epoch,
                self.epoch()
            )));
        }
        Ok(())
    }

    /// A control connection to the peer, through the token's mutual proof
    /// when this engine has a token (a tokened peer answers nothing before).
    pub(crate) fn control_client(&self, deadline: Instant) -> Result<ControlClient> {
        let mut client = ControlClient::connect(&self.inner.peer.descriptor().control_addr, deadline)?;
        if let Some(token) = &self.inner.token {
            client.handshake(&self.inner.initiator, Some(token), deadline)?;
        }
        Ok(client)
    }
}
