//! A bounded LRU cache of open segment handles, keyed by the name they were
//! opened by, with hit / miss / eviction counters.
//!
//! The engine keeps it behind its segment-table mutex: it is touched when a
//! segment is opened or closed, never on the data path.

use std::collections::{BTreeMap, HashMap};

/// Default number of open segments kept.
pub const DEFAULT_SEGMENT_CACHE_CAPACITY: usize = 256;

/// Counters of the engine's cache of open segment handles.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups that found an open handle.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
    /// Handles evicted because the cache was full.
    pub evictions: u64,
    /// Handles evicted because their peer restarted or went away.
    pub stale_evictions: u64,
    /// Handles cached now.
    pub len: usize,
    /// Most handles kept.
    pub capacity: usize,
}

/// The cache. `V` is the handle type.
#[derive(Debug)]
pub struct SegmentCache<V> {
    capacity: usize,
    /// name → (handle, last use).
    entries: HashMap<String, (V, u64)>,
    /// last use → name: the oldest is first.
    by_use: BTreeMap<u64, String>,
    clock: u64,
    stats: CacheStats,
}

impl<V> SegmentCache<V> {
    /// A cache keeping at most `capacity` handles (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            capacity,
            entries: HashMap::with_capacity(capacity),
            by_use: BTreeMap::new(),
            clock: 0,
            stats: CacheStats { capacity, ..CacheStats::default() },
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Looks a name up, counting a hit or a miss; a hit becomes the most
    /// recently used.
    pub fn get(&mut self, name: &str) -> Option<&V> {
        let now = self.tick();
        match self.entries.get_mut(name) {
            Some((value, used)) => {
                self.by_use.remove(used);
                *used = now;
                self.by_use.insert(now, name.to_string());
                self.stats.hits += 1;
                Some(value)
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Counts a lookup that found nothing usable (the caller reopens).
    pub fn note_miss(&mut self) {
        self.stats.misses += 1;
    }

    /// Every cached name and value, in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &V)> {
        self.entries.iter().map(|(name, (value, _))| (name.as_str(), value))
    }

    /// Looks a name up without counting or touching its recency.
    pub fn peek(&self, name: &str) -> Option<&V> {
        self.entries.get(name).map(|(value, _)| value)
    }

    /// Inserts a handle. Returns the handles pushed out: the one this name
    /// had before (replaced) and, when the cache was full, the least
    /// recently used one (evicted).
    pub fn insert(&mut self, name: &str, value: V) -> Vec<V> {
        let mut out = Vec::new();
        if let Some(old) = self.remove(name) {
            out.push(old);
        }
        if self.entries.len() >= self.capacity {
            if let Some((_, oldest)) = self.by_use.pop_first() {
                if let Some((value, _)) = self.entries.remove(&oldest) {
                    self.stats.evictions += 1;
                    out.push(value);
                }
            }
        }
        let now = self.tick();
        self.by_use.insert(now, name.to_string());
        self.entries.insert(name.to_string(), (value, now));
        out
    }

    /// Removes a name (closed by the caller).
    pub fn remove(&mut self, name: &str) -> Option<V> {
        let (value, used) = self.entries.remove(name)?;
        self.by_use.remove(&used);
        Some(value)
    }

    /// Removes a name whose peer restarted or went away, counting it.
    pub fn remove_stale(&mut self, name: &str) -> Option<V> {
        let value = self.remove(name)?;
        self.stats.stale_evictions += 1;
        Some(value)
    }

    /// The counters, with the current length.
    pub fn stats(&self) -> CacheStats {
        CacheStats { len: self.entries.len(), ..self.stats }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_handle_is_evicted_when_full() {
        let mut cache = SegmentCache::new(2);
        assert!(cache.insert("a", 1).is_empty());
        assert!(cache.insert("b", 2).is_empty());
        assert_eq!(cache.get("a"), Some(&1)); // b is now the oldest
        assert_eq!(cache.insert("c", 3), vec![2]);
        assert_eq!(cache.get("b"), None);
        assert_eq!(cache.get("c"), Some(&3));
        assert_eq!(cache.insert("d", 4), vec![1], "a was used before c");
        let stats = cache.stats();
        assert_eq!((stats.hits, stats.misses, stats.evictions, stats.len, stats.capacity), (2, 1, 2, 2, 2));
    }

    #[test]
    fn replacing_and_stale_removal_are_counted_apart() {
        let mut cache = SegmentCache::new(4);
        cache.insert("a", 1);
        assert_eq!(cache.insert("a", 2), vec![1], "the old handle comes back to be closed");
        assert_eq!(cache.peek("a"), Some(&2));
        assert_eq!(cache.remove_stale("a"), Some(2));
        assert_eq!(cache.remove_stale("a"), None);
        let stats = cache.stats();
        assert_eq!((stats.evictions, stats.stale_evictions, stats.len), (0, 1, 0));
    }

    #[test]
    fn many_inserts_keep_the_bound() {
        let mut cache = SegmentCache::new(3);
        let mut evicted = 0;
        for i in 0..100 {
            evicted += cache.insert(&format!("s{i}"), i).len();
            assert!(cache.stats().len <= 3);
        }
        assert_eq!(evicted, 97);
        assert_eq!(cache.stats().evictions, 97);
    }
}
