//! The links a lane owns: one per open segment, found by the key its SQEs
//! carry, kept after their segment closes until their chunks in flight
//! have ended, and polled only while they have some.

use crate::segment::PeerSegment;
use crate::transport::{ChunkEnd, LaneLink, LinkState, LINK_KEY_BASE};
use mio::unix::SourceFd;
use mio::{Interest, Registry, Token};
use std::os::fd::RawFd;
use std::sync::{mpsc, Arc};

/// One link and what the lane needs beside it.
#[derive(Debug)]
pub(super) struct LinkSlot {
    /// The peer's checked descriptor (the remote half of validation).
    pub peer: Arc<PeerSegment>,
    /// Shared with the other lanes' links and the segment handle.
    pub state: Arc<LinkState>,
    /// This lane's link.
    pub link: Box<dyn LaneLink>,
    /// Chunks (and notifications) in flight on it.
    chunks: u32,
    /// False once its segment was detached: dropped when `chunks` is 0.
    attached: bool,
    /// Its socket, registered with the lane's poller so a reply, or room
    /// in a full send buffer, wakes a parked lane; `None` for links no
    /// socket announces.
    wake: Option<RawFd>,
}

/// The arena of a lane's links. Indices are stable while a link has chunks
/// in flight, so a ticket names its link by index.
#[derive(Debug)]
pub(super) struct Links {
    slots: Vec<Option<LinkSlot>>,
    free: Vec<u32>,
    /// Segment slot (`key as u16`) → (key, arena index).
    by_segment: Vec<Option<(u32, u32)>>,
    /// Arena indices with chunks in flight, polled every round.
    active: Vec<u32>,
    /// The lane's poller, where links' sockets are registered (`None`:
    /// it could not be shared, and replies are found by polling alone).
    registry: Option<Registry>,
}

impl Links {
    /// Room for `max_segments` keys (preallocated: attaching never grows
    /// the key table).
    pub fn new(max_segments: usize, registry: Option<Registry>) -> Self {
        Self {
            slots: Vec::with_capacity(max_segments.min(64)),
            free: Vec::new(),
            by_segment: vec![None; max_segments],
            active: Vec::with_capacity(16),
            registry,
        }
    }

    /// Takes a segment's link under `key`; a link still under the same slot
    /// is detached first.
    pub fn attach(
        &mut self,
        key: u32,
        peer: Arc<PeerSegment>,
        state: Arc<LinkState>,
        link: Box<dyn LaneLink>,
        ended: &mut Vec<ChunkEnd>,
    ) {
        let segment = key as u16 as usize;
        if segment >= self.by_segment.len() {
            return;
        }
        if let Some((old, _)) = self.by_segment[segment] {
            self.detach(old, ended);
        }
        let index = self.free.pop().unwrap_or(self.slots.len() as u32);
        // Edge-triggered: each arrival wakes a parked lane once; the lane
        // reads what came by polling the link, as it always does. Writable
        // too: a lane whose socket's send buffer is full parks once its
        // busy-poll window passes, and the buffer draining must wake it:
        // readable alone, a WRITE of 64 blocks of 1 MiB (one chunk, whose
        // one ack comes at its end) slept out the park timeout (50 ms)
        // with the stream idle (docs/CHECKSUMS.md, "tcp against raw").
        // The kernel raises that edge only after a send found the buffer
        // full (`SOCK_NOSPACE`), so an idle link, or one waiting on
        // replies, is not woken by it.
        // The descriptor is the link's own (it lives as long as the link)
        // and leaves the poller in `drop_if_done`, before the link drops.
        let token = Token(LINK_KEY_BASE + index as usize);
        let interest = Interest::READABLE | Interest::WRITABLE;
        let wake = link.wake_fd().filter(|fd| {
            self.registry.as_ref().is_some_and(|r| r.register(&mut SourceFd(fd), token, interest).is_ok())
        });
        let slot = LinkSlot { peer, state, link, chunks: 0, attached: true, wake };
        if index as usize == self.slots.len() {
            self.slots.push(Some(slot));
        } else {
            self.slots[index as usize] = Some(slot);
        }
        self.by_segment[segment] = Some((key, index));
    }

    /// Lets go of `key`'s link: retired at once (a broken link hands back
    /// its resources and fails what it had in flight into `ended`), dropped
    /// once nothing of it is in flight.
    pub fn detach(&mut self, key: u32, ended: &mut Vec<ChunkEnd>) {
        let Some(entry) = self.by_segment.get_mut(key as u16 as usize) else { return };
        let Some((attached, index)) = *entry else { return };
        if attached != key {
            return;
        }
        *entry = None;
        let slot = self.slots[index as usize].as_mut().expect("an attached key names a live slot");
        slot.attached = false;
        slot.link.retire(ended);
        self.drop_if_done(index);
    }

    /// The arena index of `key`'s link.
    #[inline]
    pub fn find(&self, key: u32) -> Option<u32> {
        match self.by_segment.get(key as u16 as usize) {
            Some(&Some((attached, index))) if attached == key => Some(index),
            _ => None,
        }
    }

    /// The link at `index` (named by a live key or a ticket in flight).
    #[inline]
    pub fn get(&self, index: u32) -> &LinkSlot {
        self.slots[index as usize].as_ref().expect("a link in use is never dropped")
    }

    /// The link at `index`, to drive it.
    #[inline]
    pub fn get_mut(&mut self, index: u32) -> &mut LinkSlot {
        self.slots[index as usize].as_mut().expect("a link in use is never dropped")
    }

    /// A chunk went in flight on `index`: poll it from now on.
    pub fn chunk_started(&mut self, index: u32) {
        let slot = self.get_mut(index);
        slot.chunks += 1;
        if slot.chunks == 1 {
            self.active.push(index);
        }
    }

    /// A chunk of `index` ended; a link with none left is not polled, and a
    /// detached one is dropped.
    pub fn chunk_ended(&mut self, index: u32) {
        let slot = self.get_mut(index);
        slot.chunks = slot.chunks.saturating_sub(1);
        if slot.chunks == 0 {
            if let Some(position) = self.active.iter().position(|&a| a == index) {
                self.active.swap_remove(position);
            }
            self.drop_if_done(index);
        }
    }

    fn drop_if_done(&mut self, index: u32) {
        let done = self.slots[index as usize].as_ref().is_some_and(|s| !s.attached && s.chunks == 0);
        if done {
            if let (Some(fd), Some(registry)) =
                (self.slots[index as usize].as_ref().and_then(|s| s.wake), &self.registry)
            {
                // The link (which owns the descriptor) is still alive here.
                let _ = registry.deregister(&mut SourceFd(&fd));
            }
            self.slots[index as usize] = None;
            self.free.push(index);
        }
    }

    /// True when some link has chunks in flight.
    #[inline]
    pub fn any_active(&self) -> bool {
        !self.active.is_empty()
    }

    /// True when some link with chunks in flight has no socket to wake the
    /// lane when they progress, or waits on GPU copies (which wake nothing).
    pub fn any_active_without_wake(&self) -> bool {
        self.active.iter().any(|&index| {
            self.slots[index as usize].as_ref().is_some_and(|s| s.wake.is_none() || s.link.waiting_on_copies())
        })
    }

    /// True when some link with chunks in flight waits on a peer's thread
    /// (not on a GPU's copies, which need no thread of ours).
    pub fn any_waiting_on_peers(&self) -> bool {
        self.active.iter().any(|&index| self.slots[index as usize].as_ref().is_some_and(|s| !s.link.ends_on_its_own()))
    }

    /// Polls every link with chunks in flight; returns how many progressed.
    pub fn poll_active(&mut self, ended: &mut Vec<ChunkEnd>) -> usize {
        let mut progressed = 0;
        for &index in &self.active {
            let slot = self.slots[index as usize].as_mut().expect("an active link is live");
            progressed += slot.link.poll(ended) as usize;
            if slot.link.rewoken() {
                if let (Some(fd), Some(registry)) = (slot.wake, &self.registry) {
                    let token = Token(LINK_KEY_BASE + index as usize);
                    let _ = registry.register(&mut SourceFd(&fd), token, Interest::READABLE | Interest::WRITABLE);
                }
            }
        }
        progressed
    }

    /// Aborts what every link has in flight (the lane is exiting).
    pub fn abort_all(&mut self, reason: &str, ended: &mut Vec<ChunkEnd>) {
        for &index in &self.active {
            if let Some(slot) = self.slots[index as usize].as_mut() {
                slot.link.abort(reason, ended);
            }
        }
    }
}

/// Tells whoever waits on a detach that it is done.
pub(super) fn acknowledge(done: Option<mpsc::SyncSender<()>>) {
    if let Some(done) = done {
        let _ = done.try_send(());
    }
}
