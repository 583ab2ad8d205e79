//! Arrival counters: how many bytes of pushes carrying a tag have landed on
//! this target, so the decode side can start layer L of request R the
//! moment its bytes are in place, while later layers are still in flight,
//! without a notification per layer.
//!
//! A push carries a 32-bit tag (0: none) on the data path itself: a field
//! of each tagged tcp frame, the immediate data of each RDMA WRITE. The
//! target adds a frame's (or a write's) bytes to its tag once they are in
//! place: in host memory when the payload has been read into the region, in
//! device memory once the copy's event completed. Its owner polls
//! [`Arrivals::landed`] or waits on it, then forgets the tag.
//!
//! **Grants.** A tag is a small predictable number (`slot << 12 | layer`),
//! and any peer allowed to write any byte here could tag its writes with
//! another request's tag, or two prefill engines could use the same slot
//! for different requests. So the owner *grants* a tag the region ranges its
//! request was given ([`Arrivals::grant`]) before the push: from then on a
//! landing counts under that tag only if it lies wholly inside one of those
//! ranges (its region, offset and length known: tcp), and a landing whose
//! place the target cannot see (an RDMA immediate) does not count under a
//! granted tag at all. Granting a tag that is already granted is refused: a
//! collision is reported to the owner instead of being summed. A tag never granted counts as before (any
//! landing under it): only granted tags are bound. A zero-length landing
//! counts nothing. Under a granted tag a byte counts once: a block written
//! again (a retry, or a peer rewriting one block over and over) adds only
//! the bytes of it not counted before, so a layer's count reaches its size
//! only when every granted byte has landed. A grant takes over what its tag
//! counted before it (a stranger's early landing cannot deny the owner its
//! tag).
//!
//! **Senders.** A grant may also name the sender: the initiator engine's
//! name as it proved it in its tokened handshake (a data connection is
//! tied to that handshake by its session proof). Grants are then keyed by
//! (sender, tag): two prefill engines that pick the same tag each get
//! their own grant and count, and a landing counts only under the grant of
//! the sender that made it, so one peer cannot complete another's tag. A
//! grant with no sender takes the whole tag (any sender); it and sender
//! grants of the same tag exclude each other. Granted counts live in the
//! grants, under their lock (only granted landings take it).
//!
//! The table is lock-free: lanes add from their loops (never a lock on the
//! data path for an ungranted tag) while the owner reads and forgets. Each
//! slot is one atomic word, `tag << 32 | granted << 31 | bytes`, so a tag
//! and its count always change together and a forgotten slot taken by
//! another tag can never receive the first tag's bytes (every change is a
//! compare-and-swap on the whole word). A granted tag's ranges live beside
//! the table, read under a read lock only by landings on a granted slot.
//! Tags are placed by open addressing with a bounded probe. The table is
//! bounded: a tag that finds no free slot, or whose count would pass
//! 2 GiB, is not counted, and [`Arrivals::dropped`] says how often.
//! Peers can fill it with tags nobody forgets; the owner's `forget` is what
//! frees slots, and a waiter on an uncounted tag ends at its deadline.

use crate::sync::{AtomicU64, Ordering};

/// Slots in an engine's table (tags in flight at once).
/// (Small under loom and Miri, so models and interpreted tests reach a
/// full table in few steps.)
pub const ARRIVAL_SLOTS: usize = if cfg!(loom) {
    4
} else if cfg!(miri) {
    64
} else {
    1 << 14
};
/// Slots a tag may be placed in, from its home slot on.
const MAX_PROBE: usize = if cfg!(loom) {
    4
} else if cfg!(miri) {
    8
} else {
    64
};

/// Most ranges one granted tag may list.
pub const MAX_GRANT_RANGES: usize = 1 << 16;
/// The slot word's "granted" bit: its tag counts only landings in its ranges.
const GRANTED: u64 = 1 << 31;
/// Most bytes one tag counts (2 GiB - 1).
const MAX_COUNT: u64 = GRANTED - 1;

/// One range a granted tag may count: `(region, start, end)`, the region's
/// raw id and a half-open byte range of it.
pub type GrantRange = (u64, u64, u64);

/// Why a grant was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantRefused {
    /// Tag 0 means "untagged".
    Zero,
    /// The tag is granted already: two requests (or two initiators) chose
    /// the same tag.
    InUse,
    /// No free slot for it, or more than [`MAX_GRANT_RANGES`] ranges, or an
    /// empty or wrapping range.
    Full,
}

/// Most senders one tag may be granted to at once.
pub const MAX_TAG_SENDERS: usize = 64;

/// One engine's arrival counters.
#[derive(Debug)]
pub struct Arrivals {
    slots: Box<[AtomicU64]>,
    dropped: AtomicU64,
    /// Landings refused under a granted tag (outside its ranges, or with no
    /// place to check).
    refused: AtomicU64,
    /// Granted tags: per tag, each grant's sender (None: any), ranges and
    /// what has landed in them.
    grants: std::sync::Mutex<std::collections::HashMap<u32, Vec<Grant>>>,
}

/// Most separate landed ranges one granted tag tracks (a peer landing
/// scattered bytes cannot grow it without bound: past it, landings are
/// refused and counted as such).
const MAX_LANDED_RANGES: usize = 1 << 16;

/// One grant of a tag: whose landings count, where they may land, and
/// where they have.
#[derive(Debug, Default)]
struct Grant {
    /// The proven sender whose landings count; None: any sender's.
    sender: Option<Box<str>>,
    /// Sorted by (region, start), disjoint and not touching (merged).
    ranges: Vec<GrantRange>,
    /// The bytes counted so far, in the same form.
    landed: Vec<GrantRange>,
    /// Bytes counted (each granted byte once).
    count: u64,
}

/// Sorts and merges overlapping or touching ranges of one region.
fn merged(mut ranges: Vec<GrantRange>) -> Vec<GrantRange> {
    ranges.sort_unstable();
    let mut out: Vec<GrantRange> = Vec::with_capacity(ranges.len());
    for (region, start, end) in ranges {
        match out.last_mut() {
            Some((r, _, last_end)) if *r == region && start <= *last_end => *last_end = (*last_end).max(end),
            _ => out.push((region, start, end)),
        }
    }
    out
}

impl Grant {
    /// True when `[start, end)` of `region` lies inside one granted range.
    fn covers(&self, region: u64, start: u64, end: u64) -> bool {
        let at = self.ranges.partition_point(|&(r, s, _)| (r, s) <= (region, start));
        at > 0 && {
            let (r, s, e) = self.ranges[at - 1];
            r == region && s <= start && end <= e
        }
    }

    /// Records `[start, end)` of `region` as landed; returns the bytes of
    /// it not landed before, or None when the record is full.
    fn land(&mut self, region: u64, start: u64, end: u64) -> Option<u64> {
        // The landed ranges that overlap or touch the new one, as a run.
        let first = self.landed.partition_point(|&(r, _, e)| (r, e) < (region, start));
        let mut last = first;
        let (mut lo, mut hi, mut seen) = (start, end, 0u64);
        while let Some(&(r, s, e)) = self.landed.get(last) {
            if r != region || s > end {
                break;
            }
            seen += e.min(end).saturating_sub(s.max(start));
            (lo, hi) = (lo.min(s), hi.max(e));
            last += 1;
        }
        if first == last && self.landed.len() >= MAX_LANDED_RANGES {
            return None;
        }
        self.landed.splice(first..last, [(region, lo, hi)]);
        Some((end - start) - seen)
    }
}

impl Default for Arrivals {
    fn default() -> Self {
        Self::new()
    }
}

fn tag_of(word: u64) -> u32 {
    (word >> 32) as u32
}

fn bytes_of(word: u64) -> u64 {
    word & MAX_COUNT
}

impl Arrivals {
    /// An empty table of [`ARRIVAL_SLOTS`] slots.
    pub fn new() -> Self {
        Self {
            slots: (0..ARRIVAL_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            dropped: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            grants: Default::default(),
        }
    }

    /// The slots `tag` may live in, in probe order.
    fn probe(&self, tag: u32) -> impl Iterator<Item = &AtomicU64> {
        // Fibonacci hashing spreads consecutive tags (layer after layer).
        let home = (u64::from(tag).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % self.slots.len();
        (0..MAX_PROBE.min(self.slots.len())).map(move |i| &self.slots[(home + i) % self.slots.len()])
    }

    /// Adds `bytes` landed under `tag` at a place the target cannot see
    /// (an RDMA immediate): counted only under a tag never granted. False
    /// when not counted: zero bytes (nothing), a granted tag (refused), tag
    /// 0, no slot or a count past 2 GiB (dropped).
    pub fn land(&self, tag: u32, bytes: u64) -> bool {
        self.add(tag, bytes, None, None)
    }

    /// Adds `len` bytes landed under `tag` at `offset` of region `region`
    /// (raw id), from `sender` (the proven initiator's name; None when the
    /// connection proved none): under a granted tag, counted only under
    /// `sender`'s grant (or the tag's any-sender grant) and when the range
    /// lies wholly inside one of its granted ranges.
    pub fn land_at(&self, tag: u32, region: u64, offset: u64, len: u64, sender: Option<&str>) -> bool {
        self.add(tag, len, Some((region, offset)), sender)
    }

    fn add(&self, tag: u32, bytes: u64, at: Option<(u64, u64)>, sender: Option<&str>) -> bool {
        if bytes == 0 {
            // Nothing landed (a zero-length write needs no rights at all).
            return false;
        }
        if tag == 0 || bytes > MAX_COUNT {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        // The tag's own slot if it has one, else the first free one. A
        // forget racing with two first landings may leave a tag in two
        // slots: counts are summed over them, so no byte is lost.
        let own = self.probe(tag).find(|slot| tag_of(slot.load(Ordering::Acquire)) == tag);
        for slot in own.into_iter().chain(self.probe(tag)) {
            let mut word = slot.load(Ordering::Acquire);
            loop {
                let next = match (tag_of(word), word) {
                    // A granted tag counts in its grants, under their lock.
                    (t, _) if t == tag && word & GRANTED != 0 => return self.land_granted(tag, at, bytes, sender),
                    (t, _) if t == tag => match bytes_of(word).checked_add(bytes) {
                        Some(sum) if sum <= MAX_COUNT => (word & !MAX_COUNT) | sum,
                        _ => {
                            self.dropped.fetch_add(1, Ordering::Relaxed);
                            return false;
                        }
                    },
                    (_, 0) => (u64::from(tag) << 32) | bytes,
                    // Another tag's slot: try the next one.
                    _ => break,
                };
                // AcqRel pairs with the Acquire loads in `landed`: whoever
                // sees the count sees the bytes the lane put in place first.
                match slot.compare_exchange_weak(word, next, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return true,
                    Err(now) => word = now,
                }
            }
        }
        self.dropped.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// A landing under a granted tag: counted under `sender`'s grant of
    /// it (or its any-sender grant) when it lies wholly inside one of that
    /// grant's ranges, its bytes not counted before; refused otherwise (no
    /// place, another sender, outside, or the record of landed ranges
    /// full). True when it counted.
    fn land_granted(&self, tag: u32, at: Option<(u64, u64)>, len: u64, sender: Option<&str>) -> bool {
        let mut grants = self.grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let grant = grants.get_mut(&tag).and_then(|list| {
            list.iter_mut().find(|g| g.sender.is_none() || (sender.is_some() && g.sender.as_deref() == sender))
        });
        let fresh = at.zip(grant).and_then(|((region, offset), grant)| {
            let end = offset.checked_add(len)?;
            if !grant.covers(region, offset, end) {
                return None;
            }
            let fresh = grant.land(region, offset, end)?;
            Some((grant, fresh))
        });
        match fresh {
            // A rewrite of bytes already counted.
            Some((_, 0)) => false,
            Some((grant, fresh)) => match grant.count.checked_add(fresh) {
                Some(sum) if sum <= MAX_COUNT => {
                    grant.count = sum;
                    true
                }
                _ => {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    false
                }
            },
            None => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Binds `tag` to `ranges` (each `(region, start, end)`, half-open)
    /// for `sender`'s landings (None: any sender's): from now until
    /// [`forget`](Self::forget), only landings inside them count under it.
    /// Keyed by (sender, tag): another sender may be granted the same tag,
    /// each counting apart. Refused for a (sender, tag) already granted,
    /// for a sender grant of a tag granted to any sender (and the reverse),
    /// past [`MAX_TAG_SENDERS`] senders of one tag, and for an empty or
    /// wrapping range.
    pub fn grant_from(&self, sender: Option<&str>, tag: u32, ranges: &[GrantRange]) -> Result<(), GrantRefused> {
        if tag == 0 {
            return Err(GrantRefused::Zero);
        }
        if ranges.is_empty() || ranges.len() > MAX_GRANT_RANGES || ranges.iter().any(|&(_, a, b)| a >= b) {
            return Err(GrantRefused::Full);
        }
        let ranges = merged(ranges.to_vec());
        let mut grants = self.grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let grant = Grant { sender: sender.map(Box::from), ranges, ..Default::default() };
        if let Some(list) = grants.get_mut(&tag) {
            if sender.is_none() || list.iter().any(|g| g.sender.is_none() || g.sender.as_deref() == sender) {
                return Err(GrantRefused::InUse);
            }
            if list.len() >= MAX_TAG_SENDERS {
                return Err(GrantRefused::Full);
            }
            list.push(grant);
            return Ok(());
        }
        // What the tag counted before its grant is not its request's: a
        // stranger landing one byte first must not deny the owner the tag.
        for slot in self.probe(tag) {
            let mut word = slot.load(Ordering::Acquire);
            while tag_of(word) == tag && word & GRANTED == 0 {
                match slot.compare_exchange_weak(word, 0, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => break,
                    Err(now) => word = now,
                }
            }
        }
        // Claim a free slot marked granted (under the grants' lock, so two
        // grants never race; landings only ever add to a slot they find).
        let claimed = self.probe(tag).any(|slot| {
            slot.compare_exchange(0, (u64::from(tag) << 32) | GRANTED, Ordering::AcqRel, Ordering::Acquire).is_ok()
        });
        if !claimed {
            return Err(GrantRefused::Full);
        }
        grants.insert(tag, vec![grant]);
        Ok(())
    }

    /// Landings refused under granted tags (outside their ranges, or with
    /// no place the target could check).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Bytes landed under `tag` so far (0 for a tag never seen). For a
    /// granted tag, what its any-sender grant counted (0 when it is granted
    /// to named senders only: see [`landed_from`](Self::landed_from));
    /// bytes a racing landing put in a second, ungranted slot while the
    /// grant was being made are not its own.
    pub fn landed(&self, tag: u32) -> u64 {
        self.landed_from(None, tag)
    }

    /// Bytes landed under `sender`'s grant of `tag` (None: the tag's
    /// any-sender grant, or for a tag never granted its plain count); 0
    /// for a sender the tag is not granted to.
    pub fn landed_from(&self, sender: Option<&str>, tag: u32) -> u64 {
        if tag == 0 {
            return 0;
        }
        let words = || self.probe(tag).map(|slot| slot.load(Ordering::Acquire)).filter(move |&w| tag_of(w) == tag);
        if words().any(|w| w & GRANTED != 0) || sender.is_some() {
            let grants = self.grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let list = grants.get(&tag).map(Vec::as_slice).unwrap_or_default();
            return list.iter().find(|g| g.sender.as_deref() == sender).map_or(0, |g| g.count);
        }
        words().map(bytes_of).sum()
    }

    /// Forgets `sender`'s grant of `tag` (None: the whole tag, every grant
    /// and count of it, as [`forget`](Self::forget)); returns the bytes it
    /// had counted. The tag's slot is freed with its last grant.
    pub fn forget_from(&self, sender: Option<&str>, tag: u32) -> u64 {
        let Some(sender) = sender else { return self.forget(tag) };
        let mut grants = self.grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(list) = grants.get_mut(&tag) else { return 0 };
        let Some(at) = list.iter().position(|g| g.sender.as_deref() == Some(sender)) else { return 0 };
        let count = list.swap_remove(at).count;
        if list.is_empty() {
            grants.remove(&tag);
            self.free_slots(tag);
        }
        count
    }

    /// Frees `tag`'s slots and its grants; returns the bytes they had
    /// counted.
    pub fn forget(&self, tag: u32) -> u64 {
        if tag == 0 {
            return 0;
        }
        let mut grants = self.grants.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let granted: u64 = grants.remove(&tag).unwrap_or_default().iter().map(|g| g.count).sum();
        granted + self.free_slots(tag)
    }

    /// Frees `tag`'s slots; returns what they counted.
    fn free_slots(&self, tag: u32) -> u64 {
        let mut freed = 0;
        for slot in self.probe(tag) {
            let mut word = slot.load(Ordering::Acquire);
            while tag_of(word) == tag {
                match slot.compare_exchange_weak(word, 0, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        freed += bytes_of(word);
                        break;
                    }
                    Err(now) => word = now,
                }
            }
        }
        freed
    }

    /// Tags (or bytes) that could not be counted.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn bytes_add_up_per_tag_and_forgetting_frees_the_slot() {
        let arrivals = Arrivals::new();
        assert!(arrivals.land(7, 4096));
        assert!(arrivals.land(7, 4096));
        assert!(arrivals.land(8, 10));
        assert_eq!((arrivals.landed(7), arrivals.landed(8), arrivals.landed(9)), (8192, 10, 0));
        assert_eq!(arrivals.forget(7), 8192);
        assert_eq!(arrivals.landed(7), 0);
        assert!(arrivals.land(7, 1));
        assert_eq!(arrivals.landed(7), 1, "a forgotten tag starts again from zero");
        assert!(!arrivals.land(0, 1), "tag 0 means untagged");
        assert_eq!(arrivals.dropped(), 1);
    }

    #[test]
    fn a_count_past_two_gib_and_a_full_table_are_dropped_not_wrapped() {
        let arrivals = Arrivals::new();
        assert!(arrivals.land(1, MAX_COUNT));
        assert!(!arrivals.land(1, 1));
        assert_eq!(arrivals.landed(1), MAX_COUNT);
        // Fill every slot; the next new tag is refused and counted.
        let mut placed = 0u32;
        for tag in 2..=(ARRIVAL_SLOTS as u32 * 4) {
            placed += u32::from(arrivals.land(tag, 1));
        }
        assert_eq!(placed as usize, ARRIVAL_SLOTS - 1);
        assert!(arrivals.dropped() > 1);
        assert_eq!(arrivals.landed(2), 1, "what was counted stays counted");
    }

    #[test]
    fn a_granted_tag_counts_only_landings_inside_its_ranges() {
        let arrivals = Arrivals::new();
        let tag = 42 << 12 | 3;
        arrivals.grant_from(None, tag, &[(7, 65536, 131072), (7, 0, 4096), (9, 0, 4096)]).unwrap();
        // Another request's (or another sender's) writes under the tag:
        // elsewhere in the region, straddling a range's end, another region,
        // no place at all (an RDMA immediate), zero bytes.
        assert!(!arrivals.land_at(tag, 7, 8192, 4096, None));
        assert!(!arrivals.land_at(tag, 7, 131072 - 100, 4096, None));
        assert!(!arrivals.land_at(tag, 8, 0, 4096, None));
        assert!(!arrivals.land(tag, 4096));
        assert!(!arrivals.land_at(tag, 7, 65536, 0, None));
        assert!(!arrivals.land_at(tag, 7, u64::MAX - 10, 4096, None), "a wrapping range");
        assert_eq!((arrivals.landed(tag), arrivals.refused()), (0, 5));
        // Its own blocks count.
        assert!(arrivals.land_at(tag, 7, 65536, 65536, None));
        assert!(arrivals.land_at(tag, 7, 0, 4096, None));
        assert!(arrivals.land_at(tag, 9, 1024, 1024, None));
        assert_eq!(arrivals.landed(tag), 65536 + 4096 + 1024);
        // A second grant of the same tag (a colliding request) is refused.
        assert_eq!(arrivals.grant_from(None, tag, &[(7, 0, 1)]), Err(GrantRefused::InUse));
        // A tag a stranger landed bytes under before the grant: the grant
        // takes it over, from zero (one early byte cannot deny the owner).
        assert!(arrivals.land(5, 10));
        arrivals.grant_from(None, 5, &[(7, 0, 1)]).unwrap();
        assert_eq!(arrivals.landed(5), 0);
        assert_eq!(arrivals.grant_from(None, 6, &[(7, 4, 4)]), Err(GrantRefused::Full), "an empty range");
        assert_eq!(arrivals.grant_from(None, 0, &[(7, 0, 1)]), Err(GrantRefused::Zero));
        // Forgotten, the tag is free to grant again, with new ranges.
        assert_eq!(arrivals.forget(tag), 65536 + 4096 + 1024);
        arrivals.grant_from(None, tag, &[(8, 0, 4096)]).unwrap();
        assert!(!arrivals.land_at(tag, 7, 0, 4096, None));
        assert!(arrivals.land_at(tag, 8, 0, 4096, None));
        assert_eq!(arrivals.landed(tag), 4096);
    }

    /// A hostile review's probe: one block written again and again under a
    /// granted tag counted as the whole layer while another block never
    /// came. A granted byte now counts once.
    #[test]
    fn under_a_grant_a_byte_counts_once_however_often_it_lands() {
        let arrivals = Arrivals::new();
        let tag = 9 << 12 | 1;
        // Four 64 KiB blocks, granted as two touching ranges and one apart.
        arrivals.grant_from(None, tag, &[(3, 0, 131072), (3, 131072, 196608), (3, 262144, 327680)]).unwrap();
        for _ in 0..4 {
            arrivals.land_at(tag, 3, 65536, 65536, None);
        }
        assert_eq!(arrivals.landed(tag), 65536, "block 1 four times is one block");
        // Overlapping a counted block: only the new half counts.
        assert!(arrivals.land_at(tag, 3, 32768, 65536, None));
        assert_eq!(arrivals.landed(tag), 65536 + 32768);
        // Across two touching granted ranges (merged at grant).
        assert!(arrivals.land_at(tag, 3, 98304, 98304, None));
        assert_eq!(arrivals.landed(tag), 65536 * 2 + 32768, "only the half not counted yet");
        assert!(arrivals.land_at(tag, 3, 0, 32768, None));
        assert!(arrivals.land_at(tag, 3, 262144, 65536, None));
        assert_eq!(arrivals.landed(tag), 65536 * 4, "every granted byte, once");
        // The gap between the ranges never counts.
        assert!(!arrivals.land_at(tag, 3, 196608, 65536, None));
        assert_eq!(arrivals.landed(tag), 65536 * 4);
    }

    #[test]
    fn grants_are_keyed_by_sender_and_tag() {
        let arrivals = Arrivals::new();
        let tag = 42 << 12 | 3;
        // Two prefill engines picked the same tag for their own requests:
        // each is granted its own blocks, and neither is refused.
        arrivals.grant_from(Some("prefill-a"), tag, &[(7, 0, 8192)]).unwrap();
        arrivals.grant_from(Some("prefill-b"), tag, &[(7, 65536, 73728)]).unwrap();
        assert_eq!(arrivals.grant_from(Some("prefill-a"), tag, &[(7, 0, 1)]), Err(GrantRefused::InUse));
        assert_eq!(
            arrivals.grant_from(None, tag, &[(7, 0, 1)]),
            Err(GrantRefused::InUse),
            "any-sender over named ones"
        );
        // b writes a's blocks under the tag, and an unproven connection
        // writes them too: neither counts for a.
        assert!(!arrivals.land_at(tag, 7, 0, 8192, Some("prefill-b")));
        assert!(!arrivals.land_at(tag, 7, 0, 8192, None));
        assert_eq!(arrivals.landed_from(Some("prefill-a"), tag), 0);
        // Each sender's own blocks count under its own grant only.
        assert!(arrivals.land_at(tag, 7, 0, 8192, Some("prefill-a")));
        assert!(arrivals.land_at(tag, 7, 65536, 4096, Some("prefill-b")));
        assert_eq!(arrivals.landed_from(Some("prefill-a"), tag), 8192);
        assert_eq!(arrivals.landed_from(Some("prefill-b"), tag), 4096);
        assert_eq!(arrivals.landed_from(Some("prefill-c"), tag), 0);
        assert_eq!(arrivals.landed(tag), 0, "no any-sender grant");
        assert_eq!(arrivals.refused(), 2);
        // Forgetting a's grant leaves b's; the last one frees the tag.
        assert_eq!(arrivals.forget_from(Some("prefill-a"), tag), 8192);
        assert_eq!(arrivals.landed_from(Some("prefill-b"), tag), 4096);
        assert_eq!(arrivals.forget_from(Some("prefill-b"), tag), 4096);
        arrivals.grant_from(None, tag, &[(7, 0, 8192)]).unwrap();
        assert!(arrivals.land_at(tag, 7, 0, 4096, Some("anyone")));
        assert_eq!(arrivals.landed(tag), 4096);
        assert_eq!(arrivals.grant_from(Some("prefill-a"), tag, &[(7, 0, 1)]), Err(GrantRefused::InUse));
    }

    #[test]
    fn a_zero_length_landing_counts_nothing_and_drops_nothing() {
        let arrivals = Arrivals::new();
        assert!(!arrivals.land(7, 0));
        assert!(!arrivals.land_at(7, 1, 0, 0, None));
        assert_eq!((arrivals.landed(7), arrivals.dropped(), arrivals.refused()), (0, 0, 0));
        // Nor does it take a slot: the table stays empty.
        assert!(arrivals.slots.iter().all(|slot| slot.load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn lanes_adding_at_once_lose_no_byte() {
        // Fewer under Miri, which interprets every step (and checks each
        // interleaving it runs for data races).
        const LANDINGS: u32 = if cfg!(miri) { 200 } else { 10_000 };
        let arrivals = std::sync::Arc::new(Arrivals::new());
        let lanes: Vec<_> = (0..4)
            .map(|_| {
                let arrivals = arrivals.clone();
                std::thread::spawn(move || {
                    for i in 0..LANDINGS {
                        assert!(arrivals.land(1 + i % 16, 1));
                    }
                })
            })
            .collect();
        lanes.into_iter().for_each(|lane| lane.join().unwrap());
        assert_eq!((1..=16).map(|tag| arrivals.landed(tag)).sum::<u64>(), 4 * u64::from(LANDINGS));
    }
}
