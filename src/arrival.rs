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
//! The table is lock-free: lanes add from their loops (never a lock on the
//! data path) while the owner reads and forgets. Each slot is one atomic
//! word, `tag << 32 | bytes`, so a tag and its count always change together
//! and a forgotten slot taken by another tag can never receive the first
//! tag's bytes (every change is a compare-and-swap on the whole word).
//! Tags are placed by open addressing with a bounded probe. The table is
//! bounded: a tag that finds no free slot, or whose count would pass
//! 4 GiB, is not counted, and [`Arrivals::dropped`] says how often.
//! Peers can fill it with tags nobody forgets; the owner's `forget` is what
//! frees slots, and a waiter on an uncounted tag ends at its deadline.

use crate::sync::{AtomicU64, Ordering};

/// Slots in an engine's table (tags in flight at once).
pub const ARRIVAL_SLOTS: usize = if cfg!(loom) { 4 } else { 1 << 14 };
/// Slots a tag may be placed in, from its home slot on.
const MAX_PROBE: usize = if cfg!(loom) { 4 } else { 64 };

/// One engine's arrival counters.
#[derive(Debug)]
pub struct Arrivals {
    slots: Box<[AtomicU64]>,
    dropped: AtomicU64,
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
    word & u64::from(u32::MAX)
}

impl Arrivals {
    /// An empty table of [`ARRIVAL_SLOTS`] slots.
    pub fn new() -> Self {
        Self { slots: (0..ARRIVAL_SLOTS).map(|_| AtomicU64::new(0)).collect(), dropped: AtomicU64::new(0) }
    }

    /// The slots `tag` may live in, in probe order.
    fn probe(&self, tag: u32) -> impl Iterator<Item = &AtomicU64> {
        // Fibonacci hashing spreads consecutive tags (layer after layer).
        let home = (u64::from(tag).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % self.slots.len();
        (0..MAX_PROBE.min(self.slots.len())).map(move |i| &self.slots[(home + i) % self.slots.len()])
    }

    /// Adds `bytes` landed under `tag`; false (and counted as dropped) when
    /// the tag is 0, finds no slot, or its count would pass `u32::MAX`.
    pub fn land(&self, tag: u32, bytes: u64) -> bool {
        if tag == 0 || bytes > u64::from(u32::MAX) {
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
                    (t, _) if t == tag => match bytes_of(word).checked_add(bytes) {
                        Some(sum) if sum <= u64::from(u32::MAX) => (u64::from(tag) << 32) | sum,
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

    /// Bytes landed under `tag` so far (0 for a tag never seen).
    pub fn landed(&self, tag: u32) -> u64 {
        if tag == 0 {
            return 0;
        }
        self.probe(tag).map(|slot| slot.load(Ordering::Acquire)).filter(|&w| tag_of(w) == tag).map(bytes_of).sum()
    }

    /// Frees `tag`'s slots; returns the bytes they had counted.
    pub fn forget(&self, tag: u32) -> u64 {
        if tag == 0 {
            return 0;
        }
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
    fn a_count_past_four_gib_and_a_full_table_are_dropped_not_wrapped() {
        let arrivals = Arrivals::new();
        assert!(arrivals.land(1, u64::from(u32::MAX)));
        assert!(!arrivals.land(1, 1));
        assert_eq!(arrivals.landed(1), u64::from(u32::MAX));
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
