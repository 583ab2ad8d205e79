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
//! granted tag at all. Granting a tag that is already granted, or that
//! already counted bytes, is refused: a collision is reported to the owner
//! instead of being summed. A tag never granted counts as before (any
//! landing under it): only granted tags are bound. A zero-length landing
//! counts nothing.
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
pub const ARRIVAL_SLOTS: usize = if cfg!(loom) { 4 } else { 1 << 14 };
/// Slots a tag may be placed in, from its home slot on.
const MAX_PROBE: usize = if cfg!(loom) { 4 } else { 64 };

/// Most ranges one granted tag may list.
pub const MAX_GRANT_RANGES: usize = 1 << 16;
/// The slot word's "granted" bit: its tag counts only landings in its ranges.
const GRANTED: u64 = 1 << 31;
/// Most bytes one tag counts (2 GiB - 1).
const MAX_COUNT: u64 = GRANTED - 1;

/// One range a granted tag may count: `(region, start, end)`, the region's
/// raw id and a half-open byte range of it.
pub type GrantRange = (u32, u64, u64);

/// Why a grant was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantRefused {
    /// Tag 0 means "untagged".
    Zero,
    /// The tag is granted already, or counted bytes before it was granted:
    /// two requests (or two initiators) chose the same tag.
    InUse,
    /// No free slot for it, or more than [`MAX_GRANT_RANGES`] ranges, or an
    /// empty or wrapping range.
    Full,
}

/// One engine's arrival counters.
#[derive(Debug)]
pub struct Arrivals {
    slots: Box<[AtomicU64]>,
    dropped: AtomicU64,
    /// Landings refused under a granted tag (outside its ranges, or with no
    /// place to check).
    refused: AtomicU64,
    /// Granted tags' ranges, sorted by (region, start).
    grants: std::sync::RwLock<std::collections::HashMap<u32, Vec<GrantRange>>>,
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
        self.add(tag, bytes, None)
    }

    /// Adds `len` bytes landed under `tag` at `offset` of region `region`
    /// (raw id): under a granted tag, counted only when the range lies
    /// wholly inside one of its granted ranges.
    pub fn land_at(&self, tag: u32, region: u32, offset: u64, len: u64) -> bool {
        self.add(tag, len, Some((region, offset)))
    }

    fn add(&self, tag: u32, bytes: u64, at: Option<(u32, u64)>) -> bool {
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
                    (t, _) if t == tag => {
                        if word & GRANTED != 0 && !self.granted_covers(tag, at, bytes) {
                            self.refused.fetch_add(1, Ordering::Relaxed);
                            return false;
                        }
                        match bytes_of(word).checked_add(bytes) {
                            Some(sum) if sum <= MAX_COUNT => (word & !MAX_COUNT) | sum,
                            _ => {
                                self.dropped.fetch_add(1, Ordering::Relaxed);
                                return false;
                            }
                        }
                    }
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

    /// True when `len` bytes at `at` lie wholly inside one of `tag`'s
    /// granted ranges (false with no place, or no grant any more).
    fn granted_covers(&self, tag: u32, at: Option<(u32, u64)>, len: u64) -> bool {
        let Some((region, offset)) = at else { return false };
        let Some(end) = offset.checked_add(len) else { return false };
        let grants = self.grants.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(ranges) = grants.get(&tag) else { return false };
        // The last range starting at or before `offset` in `region`.
        let at = ranges.partition_point(|&(r, start, _)| (r, start) <= (region, offset));
        at > 0 && {
            let (r, start, stop) = ranges[at - 1];
            r == region && start <= offset && end <= stop
        }
    }

    /// Binds `tag` to `ranges` (each `(region, start, end)`, half-open):
    /// from now until [`forget`](Self::forget), only landings inside them
    /// count under it. Refused for a tag already granted or already
    /// counting (a collision), and for an empty or wrapping range.
    pub fn grant(&self, tag: u32, ranges: &[GrantRange]) -> Result<(), GrantRefused> {
        if tag == 0 {
            return Err(GrantRefused::Zero);
        }
        if ranges.is_empty() || ranges.len() > MAX_GRANT_RANGES || ranges.iter().any(|&(_, a, b)| a >= b) {
            return Err(GrantRefused::Full);
        }
        let mut sorted = ranges.to_vec();
        sorted.sort_unstable();
        let mut grants = self.grants.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if grants.contains_key(&tag) || self.landed(tag) > 0 {
            return Err(GrantRefused::InUse);
        }
        // Claim a free slot marked granted (under the grants' lock, so two
        // grants never race; landings only ever add to a slot they find).
        let claimed = self.probe(tag).any(|slot| {
            slot.compare_exchange(0, (u64::from(tag) << 32) | GRANTED, Ordering::AcqRel, Ordering::Acquire).is_ok()
        });
        if !claimed {
            return Err(GrantRefused::Full);
        }
        grants.insert(tag, sorted);
        Ok(())
    }

    /// Landings refused under granted tags (outside their ranges, or with
    /// no place the target could check).
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Bytes landed under `tag` so far (0 for a tag never seen). For a
    /// granted tag, only its granted slot counts: bytes a racing landing
    /// put in a second, ungranted slot while the grant was being made are
    /// not its own.
    pub fn landed(&self, tag: u32) -> u64 {
        if tag == 0 {
            return 0;
        }
        let words = || self.probe(tag).map(|slot| slot.load(Ordering::Acquire)).filter(move |&w| tag_of(w) == tag);
        let granted = words().any(|w| w & GRANTED != 0);
        words().filter(|&w| !granted || w & GRANTED != 0).map(bytes_of).sum()
    }

    /// Frees `tag`'s slots and its grant; returns the bytes they had
    /// counted.
    pub fn forget(&self, tag: u32) -> u64 {
        if tag == 0 {
            return 0;
        }
        let mut grants = self.grants.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        grants.remove(&tag);
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
        arrivals.grant(tag, &[(7, 65536, 131072), (7, 0, 4096), (9, 0, 4096)]).unwrap();
        // Another request's (or another sender's) writes under the tag:
        // elsewhere in the region, straddling a range's end, another region,
        // no place at all (an RDMA immediate), zero bytes.
        assert!(!arrivals.land_at(tag, 7, 8192, 4096));
        assert!(!arrivals.land_at(tag, 7, 131072 - 100, 4096));
        assert!(!arrivals.land_at(tag, 8, 0, 4096));
        assert!(!arrivals.land(tag, 4096));
        assert!(!arrivals.land_at(tag, 7, 65536, 0));
        assert!(!arrivals.land_at(tag, 7, u64::MAX - 10, 4096), "a wrapping range");
        assert_eq!((arrivals.landed(tag), arrivals.refused()), (0, 5));
        // Its own blocks count.
        assert!(arrivals.land_at(tag, 7, 65536, 65536));
        assert!(arrivals.land_at(tag, 7, 0, 4096));
        assert!(arrivals.land_at(tag, 9, 1024, 1024));
        assert_eq!(arrivals.landed(tag), 65536 + 4096 + 1024);
        // A second grant of the same tag (a colliding request) is refused,
        // as is one for a tag that already counted bytes ungranted.
        assert_eq!(arrivals.grant(tag, &[(7, 0, 1)]), Err(GrantRefused::InUse));
        assert!(arrivals.land(5, 10));
        assert_eq!(arrivals.grant(5, &[(7, 0, 1)]), Err(GrantRefused::InUse));
        assert_eq!(arrivals.grant(6, &[(7, 4, 4)]), Err(GrantRefused::Full), "an empty range");
        assert_eq!(arrivals.grant(0, &[(7, 0, 1)]), Err(GrantRefused::Zero));
        // Forgotten, the tag is free to grant again, with new ranges.
        assert_eq!(arrivals.forget(tag), 65536 + 4096 + 1024);
        arrivals.grant(tag, &[(8, 0, 4096)]).unwrap();
        assert!(!arrivals.land_at(tag, 7, 0, 4096));
        assert!(arrivals.land_at(tag, 8, 0, 4096));
        assert_eq!(arrivals.landed(tag), 4096);
    }

    #[test]
    fn a_zero_length_landing_counts_nothing_and_drops_nothing() {
        let arrivals = Arrivals::new();
        assert!(!arrivals.land(7, 0));
        assert!(!arrivals.land_at(7, 1, 0, 0));
        assert_eq!((arrivals.landed(7), arrivals.dropped(), arrivals.refused()), (0, 0, 0));
        // Nor does it take a slot: the table stays empty.
        assert!(arrivals.slots.iter().all(|slot| slot.load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn lanes_adding_at_once_lose_no_byte() {
        let arrivals = std::sync::Arc::new(Arrivals::new());
        let lanes: Vec<_> = (0..4)
            .map(|_| {
                let arrivals = arrivals.clone();
                std::thread::spawn(move || {
                    for i in 0..10_000u32 {
                        assert!(arrivals.land(1 + i % 16, 1));
                    }
                })
            })
            .collect();
        lanes.into_iter().for_each(|lane| lane.join().unwrap());
        assert_eq!((1..=16).map(|tag| arrivals.landed(tag)).sum::<u64>(), 40_000);
    }
}
