//! The region registry: which local memory kvring may touch.
//!
//! Registration and unregistration are control operations and take a mutex.
//! The data path never does: a lane reaches a region through a *lease*, an
//! atomic count in the region's slot that the submitter takes before it
//! publishes a batch and the lane drops when the batch part ends. While a
//! region is leased it cannot be unregistered (`RegionBusy`), and a slot's
//! entry is only rewritten when it is neither live nor leased, so a leased
//! read needs no lock. The slot's protocol is in `lease.rs` (modelled with
//! loom).

use super::device::DeviceBacking;
use super::lease::{Refused, Slot, LEASE_MASK};
use super::region::{Access, RegionInfo};
use super::shm::ShmMapping;
use crate::desc::RegionId;
use crate::error::{Error, Result, Side};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// Default number of region slots.
pub const DEFAULT_MAX_REGIONS: usize = 4096;

/// Where a registered region's bytes are.
#[derive(Debug, Clone)]
pub struct RegionEntry {
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Kind, layer, block size, rights.
    pub info: RegionInfo,
    /// Set for regions from `alloc_region`: the shared mapping peers can open.
    pub shm: Option<Arc<ShmMapping>>,
    /// Set for GPU regions: the provider, the export, owned memory.
    pub device: Option<Arc<DeviceBacking>>,
    /// The region's fence table when it has no file to keep it in (caller
    /// and GPU memory): checked at this end by tcp and staged copies.
    pub fences: Arc<super::fence::FenceTable>,
}

/// What a region's bytes are backed by beyond the caller's pointer.
#[derive(Debug, Clone, Default)]
pub struct Backing {
    /// Engine-allocated shared memory.
    pub shm: Option<Arc<ShmMapping>>,
    /// GPU memory: how peers open it, and who frees it.
    pub device: Option<Arc<DeviceBacking>>,
}

impl RegionEntry {
    /// The fence table writers at this end check, keyed by offset in the
    /// region: the region file's (which same-host peers check too), a GPU
    /// region's page (which its cuda_ipc peers check too), or the entry's
    /// own.
    pub fn fence_view(&self) -> super::fence::FenceView<'_> {
        match (&self.shm, self.device.as_deref().map(|d| &d.fences)) {
            (Some(shm), _) => shm.fences(),
            // A GPU region's own page, which its cuda_ipc peers map.
            (None, Some(Ok(page))) => page.view(),
            _ => self.fences.view(),
        }
    }

    /// Checks `[offset, offset + len)` against the region and the right it
    /// needs; returns the start address of the range.
    #[inline]
    pub fn check(
        &self,
        region: RegionId,
        side: Side,
        desc_index: u32,
        offset: u64,
        len: u64,
        needs: Access,
    ) -> Result<usize> {
        if !self.info.access.contains(needs) {
            return Err(Error::AccessDenied { desc_index, side, region, needs: access_name(needs) });
        }
        check_range(region, side, desc_index, offset, len, self.len as u64)?;
        Ok(self.addr + offset as usize)
    }
}

/// Bounds check with checked arithmetic: `offset + len` must not overflow
/// and must not pass `region_len`.
#[inline]
pub fn check_range(
    region: RegionId,
    side: Side,
    desc_index: u32,
    offset: u64,
    len: u64,
    region_len: u64,
) -> Result<()> {
    let end = offset.checked_add(len).ok_or(Error::LengthOverflow { desc_index, side, offset, len })?;
    if end > region_len {
        return Err(Error::OutOfBounds { desc_index, side, region, offset, len, region_len });
    }
    Ok(())
}

/// Human name of one access right, for error messages.
pub fn access_name(access: Access) -> &'static str {
    match access {
        Access::LOCAL_READ => "local read",
        Access::LOCAL_WRITE => "local write",
        Access::REMOTE_READ => "remote read",
        Access::REMOTE_WRITE => "remote write",
        _ => "the requested access",
    }
}

struct Control {
    /// Start address → region, for overlap checks.
    by_addr: BTreeMap<usize, RegionId>,
    /// Slots never used or freed, reused last-in first-out.
    free: Vec<u32>,
    /// Slots whose generation was spent (never reused).
    retired: usize,
}

/// The registry. Shared by the engine, its submitters and its lanes.
pub struct Registry {
    slots: Box<[Slot<RegionEntry>]>,
    control: Mutex<Control>,
    /// Owner's lease takers waiting out an exclusive read
    /// ([`lease_after_read`](Self::lease_after_read)): no new exclusive
    /// read starts while one waits, so a peer asking back to back cannot
    /// keep the owner out (fairness only; the slot's word is the safety).
    lease_waiters: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("capacity", &self.slots.len()).field("registered", &self.len()).finish()
    }
}

impl Registry {
    /// A registry with room for `capacity` regions (at most 65535).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.clamp(1, u16::MAX as usize);
        let slots = (0..capacity).map(|_| Slot::new()).collect();
        let free = (0..capacity as u32).rev().collect();
        Self {
            slots,
            control: Mutex::new(Control { by_addr: BTreeMap::new(), free, retired: 0 }),
            lease_waiters: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    fn control(&self) -> MutexGuard<'_, Control> {
        // A panic while holding the lock leaves the map consistent (every
        // mutation is a single insert/remove), so poisoning is ignored.
        self.control.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of live regions.
    pub fn len(&self) -> usize {
        self.control().by_addr.len()
    }

    /// Registers `[addr, addr + len)`. The same range registered again with
    /// the same info returns the same id; any other overlap is refused.
    pub fn register(&self, addr: usize, len: usize, info: RegionInfo, backing: Backing) -> Result<RegionId> {
        let Backing { shm, device } = backing;
        if addr == 0 {
            return Err(Error::invalid("region address", "null pointer"));
        }
        if len == 0 {
            return Err(Error::invalid("region length", "must be greater than zero"));
        }
        let end = addr
            .checked_add(len)
            .ok_or_else(|| Error::invalid("region", format!("{addr:#x} + {len} overflows the address space")))?;
        let mut control = self.control();
        // The only candidates for overlap: the last region starting before
        // `end`; regions never overlap each other, so one check suffices.
        if let Some((&start, &id)) = control.by_addr.range(..end).next_back() {
            let existing = self.leased_entry_unchecked(id);
            if start == addr && existing.len == len && shm.is_none() && device.as_ref().is_none_or(|d| d.is_caller()) {
                return if existing.info == info { Ok(id) } else { Err(Error::RegionInfoMismatch { existing: id }) };
            }
            if start + existing.len > addr {
                return Err(Error::RegionOverlap {
                    addr,
                    len,
                    existing: id,
                    existing_addr: start,
                    existing_len: existing.len,
                });
            }
        }
        let index = control.free.pop().ok_or(Error::RegionTableFull { capacity: self.slots.len() })?;
        let slot = &self.slots[index as usize];
        let generation = slot.generation();
        if let Some(mapping) = &shm {
            // Peers check that the file's header names this id: written
            // before the region is listed (under the lock `snapshot` takes),
            // so no handshake announces it before its file proves it.
            mapping.set_region(RegionId::new(index, generation), info.access);
        }
        // SAFETY: the slot came off the free list under the control mutex:
        // not live, no leases, and nobody else publishes it.
        let issued = unsafe { slot.publish(RegionEntry { addr, len, info, shm, device, fences: Default::default() }) };
        debug_assert_eq!(issued, generation);
        let id = RegionId::new(index, generation);
        control.by_addr.insert(addr, id);
        Ok(id)
    }

    /// Unregisters a region; refused while batches hold it.
    pub fn unregister(&self, id: RegionId) -> Result<RegionEntry> {
        let mut control = self.control();
        let slot = self.slot(id, Side::Local)?;
        // One compare-and-swap decides (lease.rs): live and idle under this
        // generation, or refused. A slot whose generation would wrap is
        // retired, never reused: an id handed out once is never handed out
        // again in this process's life, so a peer's stale id can never come
        // to name a new buffer.
        let (entry, retire) = match slot.unpublish(id.generation()) {
            Ok(unpublished) => (unpublished.entry, unpublished.retired),
            Err(Refused::Held { leases, .. }) => {
                return Err(Error::RegionBusy { region: id, in_flight: leases.max(1) as u32 })
            }
            Err(Refused::Gone | Refused::Full) => return Err(Error::UnknownRegion { side: Side::Local, region: id }),
        };
        control.by_addr.remove(&entry.addr);
        if retire {
            control.retired += 1;
            tracing::warn!(region = %id, "region slot retired: its generation is spent (never reused)");
        } else {
            control.free.push(id.index());
        }
        Ok(entry)
    }

    /// Starts every free slot's next generation at `generation` (at least
    /// 1), so a test reaches a slot's last generations without 2^32
    /// registrations. Returns how many slots it set.
    #[cfg(any(test, feature = "testing"))]
    pub fn start_free_slots_at(&self, generation: u32) -> usize {
        let control = self.control();
        for &index in &control.free {
            // SAFETY: a free slot, under the control mutex: not live, no
            // leases, and nobody publishes it while we hold the lock.
            unsafe { self.slots[index as usize].start_at(generation.max(1)) };
        }
        control.free.len()
    }

    fn slot(&self, id: RegionId, side: Side) -> Result<&Slot<RegionEntry>> {
        self.slots.get(id.index() as usize).ok_or(Error::UnknownRegion { side, region: id })
    }

    /// Takes a lease on a region: while the returned guard (or the lease it
    /// [keeps](Lease::keep)) lives, the region cannot be unregistered and
    /// its entry can be read.
    #[inline]
    pub fn lease(&self, id: RegionId) -> Result<Lease<'_>> {
        let slot = self.slot(id, Side::Local)?;
        match slot.lease(id.generation()) {
            Ok(()) => Ok(Lease { registry: self, id }),
            Err(Refused::Gone) => Err(Error::UnknownRegion { side: Side::Local, region: id }),
            Err(Refused::Full) => Err(Error::Busy { queue: "region lease count", capacity: LEASE_MASK as usize }),
            Err(Refused::Held { .. }) => Err(Error::RegionBusy { region: id, in_flight: 1 }),
        }
    }

    /// As [`lease`](Self::lease), but a region held by an exclusive read
    /// ([`read_alone`](Self::read_alone): a peer's checksum) is waited for,
    /// at most `wait`, rather than refused: the owner's own batches are
    /// not denied by a peer that asks for checksums back to back.
    pub fn lease_after_read(&self, id: RegionId, wait: std::time::Duration) -> Result<Lease<'_>> {
        let slot = self.slot(id, Side::Local)?;
        let mut deadline = None;
        let mut spins = 0u32;
        /// Counts this taker among the waiters until it returns.
        struct Waiting<'a>(Option<&'a std::sync::atomic::AtomicUsize>);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                if let Some(waiters) = self.0 {
                    waiters.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        }
        let mut waiting = Waiting(None);
        loop {
            match slot.lease(id.generation()) {
                Ok(()) => return Ok(Lease { registry: self, id }),
                Err(Refused::Held { reading: true, .. }) => {
                    if waiting.0.is_none() {
                        self.lease_waiters.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        waiting.0 = Some(&self.lease_waiters);
                    }
                    let until = *deadline.get_or_insert_with(|| crate::deadline::deadline_after(wait));
                    if std::time::Instant::now() >= until {
                        return Err(Error::RegionBusy { region: id, in_flight: 1 });
                    }
                    spins += 1;
                    if spins < 64 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
                Err(Refused::Gone) => return Err(Error::UnknownRegion { side: Side::Local, region: id }),
                Err(Refused::Full) => {
                    return Err(Error::Busy { queue: "region lease count", capacity: LEASE_MASK as usize })
                }
                Err(Refused::Held { .. }) => return Err(Error::RegionBusy { region: id, in_flight: 1 }),
            }
        }
    }

    /// Runs `read` on a region's entry with no batch of this engine
    /// holding it: refused with `RegionBusy` while one does, and no lease
    /// is granted (`RegionBusy`) until `read` returns. For reads of a
    /// region's bytes that must not race with this engine's lanes (the
    /// control server's checksum for a peer).
    pub fn read_alone<R>(&self, id: RegionId, read: impl FnOnce(&RegionEntry) -> R) -> Result<R> {
        let slot = self.slot(id, Side::Local)?;
        // The owner waits to lease a region: it goes first.
        if self.lease_waiters.load(std::sync::atomic::Ordering::SeqCst) != 0 {
            return Err(Error::RegionBusy { region: id, in_flight: 1 });
        }
        match slot.read_alone(id.generation()) {
            Ok(()) => {}
            Err(Refused::Held { leases, .. }) => {
                return Err(Error::RegionBusy { region: id, in_flight: leases.max(1) as u32 })
            }
            Err(Refused::Gone | Refused::Full) => return Err(Error::UnknownRegion { side: Side::Local, region: id }),
        }
        /// Ends the read however `read` leaves (a panic included).
        struct End<'a>(&'a Slot<RegionEntry>);
        impl Drop for End<'_> {
            fn drop(&mut self) {
                // SAFETY: the exclusive read granted above, ended once; the
                // entry's borrow ended with `read`.
                unsafe { self.0.end_read() };
            }
        }
        let _end = End(slot);
        // SAFETY: the exclusive read keeps the slot live and unleased.
        Ok(unsafe { slot.read(read) })
    }

    /// Gives up a lease kept with [`Lease::keep`].
    ///
    /// # Safety
    ///
    /// The caller owns a lease on `id` that [`Lease::keep`] kept and nobody
    /// released yet, and no borrow from [`kept`](Self::kept) under it
    /// outlives this call: the region may be unregistered right after.
    #[inline]
    pub unsafe fn release_kept(&self, id: RegionId) {
        if let Ok(slot) = self.slot(id, Side::Local) {
            // SAFETY: the caller's kept lease, given back once (our contract).
            unsafe { slot.release() };
        }
    }

    /// The entry of a region under a lease kept with [`Lease::keep`].
    ///
    /// Checks the id's generation, so a lane handed a stale id gets an
    /// error instead of another region's bytes.
    ///
    /// # Safety
    ///
    /// The caller owns a kept lease on `id` for as long as the returned
    /// borrow lives (it releases it with [`release_kept`](Self::release_kept)
    /// only after).
    #[inline]
    pub unsafe fn kept(&self, id: RegionId) -> Result<&RegionEntry> {
        if !self.slot(id, Side::Local)?.is_held(id.generation()) {
            return Err(Error::UnknownRegion { side: Side::Local, region: id });
        }
        Ok(self.leased_entry_unchecked(id))
    }

    fn leased_entry_unchecked(&self, id: RegionId) -> &RegionEntry {
        let slot = &self.slots[id.index() as usize];
        // Callers hold a lease on `id` (the entry cannot be rewritten until it
        // is released) or the control mutex with `id` live in `by_addr`.
        // SAFETY: either way no writer exists while we read (module docs).
        unsafe { slot.entry() }
    }

    /// A copy of every live region, for handshakes and `kvring info`.
    pub fn snapshot(&self) -> Vec<(RegionId, RegionEntry)> {
        let control = self.control();
        control.by_addr.values().map(|&id| (id, self.leased_entry_unchecked(id).clone())).collect()
    }

    /// The live region holding `addr..addr + len`, and the offset of `addr`
    /// in it (regions never overlap, so only the last one starting at or
    /// before `addr` can).
    pub fn find(&self, addr: usize, len: usize) -> Option<(RegionId, u64)> {
        let control = self.control();
        let (&start, &id) = control.by_addr.range(..=addr).next_back()?;
        let entry = self.leased_entry_unchecked(id);
        let end = addr.checked_add(len)?;
        (end <= start + entry.len).then_some((id, (addr - start) as u64))
    }

    /// One live region's entry, copied (a control-path read).
    pub fn get(&self, id: RegionId) -> Result<RegionEntry> {
        // Holding the mutex keeps a live slot live for the read.
        let _control = self.control();
        if !self.slot(id, Side::Local)?.is_live(id.generation()) {
            return Err(Error::UnknownRegion { side: Side::Local, region: id });
        }
        Ok(self.leased_entry_unchecked(id).clone())
    }
}

/// A lease on one registered region, given back when dropped: while it
/// lives the region cannot be unregistered, so its entry (address, length,
/// rights) stays valid to read and its memory stays mapped.
#[derive(Debug)]
pub(crate) struct Lease<'a> {
    registry: &'a Registry,
    id: RegionId,
}

impl Lease<'_> {
    /// The region's entry.
    #[inline]
    pub fn entry(&self) -> &RegionEntry {
        self.registry.leased_entry_unchecked(self.id)
    }

    /// Keeps the lease past this guard, for work that carries it elsewhere
    /// (a submitter's batch to its lane, a target's frame across polls):
    /// whoever ends that work gives it back with [`Registry::release_kept`].
    /// A lease kept and never released only keeps its region registered.
    #[inline]
    pub fn keep(self) -> RegionId {
        let id = self.id;
        std::mem::forget(self);
        id
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        // SAFETY: this guard owns the lease, and `entry`'s borrows end with it.
        unsafe { self.registry.release_kept(self.id) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer(len: usize) -> (Vec<u8>, usize) {
        let v = vec![0u8; len];
        let addr = v.as_ptr() as usize;
        (v, addr)
    }

    #[test]
    fn same_range_is_idempotent_and_overlaps_are_refused() {
        let registry = Registry::new(8);
        let (_buf, addr) = buffer(4096);
        let id = registry.register(addr, 4096, RegionInfo::raw(), Backing::default()).unwrap();
        assert_eq!(registry.register(addr, 4096, RegionInfo::raw(), Backing::default()).unwrap(), id);
        let err = registry.register(addr, 4096, RegionInfo::raw().with_layer(2), Backing::default()).unwrap_err();
        assert!(matches!(err, Error::RegionInfoMismatch { existing } if existing == id));
        for (start, len) in [(addr + 100, 10), (addr - 10 + 4096, 20), (addr, 10)] {
            let err = registry.register(start, len, RegionInfo::raw(), Backing::default()).unwrap_err();
            assert!(matches!(err, Error::RegionOverlap { existing, .. } if existing == id), "{start:#x}+{len}: {err}");
        }
        // Adjacent is fine.
        let (_buf2, _) = buffer(1);
        assert!(registry.register(addr + 4096, 16, RegionInfo::raw(), Backing::default()).is_ok());
        assert_eq!(registry.len(), 2);
    }

    #[test]
    fn bad_ranges_are_refused() {
        let registry = Registry::new(2);
        assert!(registry
            .register(0, 10, RegionInfo::raw(), Backing::default())
            .unwrap_err()
            .to_string()
            .contains("null pointer"));
        assert!(registry
            .register(8, 0, RegionInfo::raw(), Backing::default())
            .unwrap_err()
            .to_string()
            .contains("greater than zero"));
        assert!(registry
            .register(usize::MAX - 4, 10, RegionInfo::raw(), Backing::default())
            .unwrap_err()
            .to_string()
            .contains("overflows"));
    }

    #[test]
    fn leased_regions_cannot_be_unregistered_and_stale_ids_are_rejected() {
        let registry = Registry::new(4);
        let (_buf, addr) = buffer(64);
        let id = registry.register(addr, 64, RegionInfo::raw(), Backing::default()).unwrap();
        let guard = registry.lease(id).unwrap();
        let kept = registry.lease(id).unwrap().keep();
        assert!(matches!(registry.unregister(id), Err(Error::RegionBusy { in_flight: 2, .. })));
        assert_eq!(guard.entry().len, 64);
        drop(guard);
        assert!(matches!(registry.unregister(id), Err(Error::RegionBusy { in_flight: 1, .. })), "kept past its guard");
        // SAFETY: the lease kept above, not released yet; the borrow ends here.
        assert_eq!(unsafe { registry.kept(kept) }.unwrap().len, 64);
        // SAFETY: that lease, given back once.
        unsafe { registry.release_kept(kept) };
        registry.unregister(id).unwrap();
        assert!(matches!(registry.lease(id), Err(Error::UnknownRegion { .. })));
        assert!(matches!(registry.unregister(id), Err(Error::UnknownRegion { .. })));
        // The slot is reused under a new generation; the old id stays dead.
        let again = registry.register(addr, 64, RegionInfo::raw(), Backing::default()).unwrap();
        assert_eq!(again.index(), id.index());
        assert_ne!(again.generation(), id.generation());
        assert!(registry.lease(id).is_err());
        assert!(registry.lease(RegionId::new(999, 1)).is_err(), "index past the table");
        assert!(registry.get(RegionId::new(again.index(), 0)).is_err(), "generation 0 is never issued");
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "65,536 registrations of one slot: minutes under Miri; the other registry tests run there"
    )]
    fn a_slot_churned_through_its_last_generations_is_retired_never_reused() {
        let registry = Registry::new(1);
        let (_buf, addr) = buffer(64);
        // 65,536 registrations: a 16-bit generation would have wrapped here.
        let first = registry.register(addr, 64, RegionInfo::raw(), Backing::default()).unwrap();
        let mut id = first;
        for _ in 0..=u16::MAX {
            registry.unregister(id).unwrap();
            id = registry.register(addr, 64, RegionInfo::raw(), Backing::default()).unwrap();
            assert_ne!(id, first);
        }
        assert_eq!((id.index(), id.generation()), (first.index(), u32::from(u16::MAX) + 2));
        registry.unregister(id).unwrap();
        // The slot's last generations: each issued once, then retired.
        assert_eq!(registry.start_free_slots_at(u32::MAX - 3), 1);
        let mut seen = std::collections::HashSet::from([first.raw()]);
        loop {
            match registry.register(addr, 64, RegionInfo::raw(), Backing::default()) {
                Ok(next) => {
                    assert!(seen.insert(next.raw()), "id {next} handed out twice");
                    id = next;
                    registry.unregister(id).unwrap();
                }
                Err(Error::RegionTableFull { capacity: 1 }) => break,
                Err(other) => panic!("{other}"),
            }
        }
        assert_eq!(seen.len(), 1 + 4, "generations u32::MAX - 3 ..= u32::MAX, once each");
        assert_eq!(id.generation(), u32::MAX);
        assert!(matches!(registry.lease(id), Err(Error::UnknownRegion { .. })));
        assert!(matches!(registry.lease(first), Err(Error::UnknownRegion { .. })), "the first id never comes back");
        assert_eq!(registry.control().retired, 1);
        assert_eq!(registry.start_free_slots_at(1), 0, "a retired slot is not free");
    }

    #[test]
    fn a_read_alone_waits_for_no_lease_and_holds_leases_and_unregister_off() {
        let registry = Registry::new(2);
        let (_buf, addr) = buffer(64);
        let id = registry.register(addr, 64, RegionInfo::raw(), Backing::default()).unwrap();
        let lease = registry.lease(id).unwrap();
        assert!(matches!(registry.read_alone(id, |e| e.len), Err(Error::RegionBusy { in_flight: 1, .. })));
        drop(lease);
        let (len, leased, unregistered) = registry
            .read_alone(id, |e| (e.len, registry.lease(id).map(|_| ()), registry.unregister(id).map(|_| ())))
            .unwrap();
        assert_eq!(len, 64);
        assert!(matches!(leased, Err(Error::RegionBusy { .. })), "{leased:?}");
        assert!(matches!(unregistered, Err(Error::RegionBusy { .. })), "{unregistered:?}");
        // Once the read ended, both are granted again; a stale id is unknown.
        drop(registry.lease(id).unwrap());
        registry.unregister(id).unwrap();
        assert!(matches!(registry.read_alone(id, |e| e.len), Err(Error::UnknownRegion { .. })));
    }

    #[test]
    fn full_table_is_a_clear_error() {
        let registry = Registry::new(1);
        let (_a, a) = buffer(8);
        let (_b, b) = buffer(8);
        registry.register(a, 8, RegionInfo::raw(), Backing::default()).unwrap();
        assert!(matches!(
            registry.register(b, 8, RegionInfo::raw(), Backing::default()),
            Err(Error::RegionTableFull { capacity: 1 })
        ));
    }

    #[test]
    fn checks_use_checked_arithmetic_and_rights() {
        let id = RegionId::new(0, 1);
        assert!(check_range(id, Side::Local, 0, 0, 4096, 4096).is_ok());
        assert!(matches!(
            check_range(id, Side::Local, 1, 1, 4096, 4096),
            Err(Error::OutOfBounds { desc_index: 1, .. })
        ));
        assert!(matches!(
            check_range(id, Side::Remote, 2, u64::MAX, 2, 4096),
            Err(Error::LengthOverflow { desc_index: 2, .. })
        ));
        let entry = RegionEntry {
            addr: 0x1000,
            len: 100,
            info: RegionInfo::raw().with_access(Access::LOCAL_READ),
            shm: None,
            device: None,
            fences: Default::default(),
        };
        assert_eq!(entry.check(id, Side::Local, 0, 10, 10, Access::LOCAL_READ).unwrap(), 0x100a);
        let err = entry.check(id, Side::Local, 0, 10, 10, Access::LOCAL_WRITE).unwrap_err();
        assert!(err.to_string().contains("does not allow local write"), "{err}");
    }
}
