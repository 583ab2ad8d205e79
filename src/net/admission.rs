//! Who may hold a listener's connections.
//!
//! A connection is *pending* from accept until it proves itself (the token
//! handshake, or with no token a valid opening message), then *admitted*.
//! Pending connections are cheap to make and prove nothing, so they are
//! what a flood consists of: they get a short deadline, a bound per source
//! address and in total, and when one of those is reached the *oldest
//! pending* connection is closed to make room, never an admitted one and
//! never the newcomer. A legitimate peer proves itself within a round trip or two, so
//! a flood of idle connections cannot keep it out; it only churns itself.
//! Admitted connections are bounded per source and in total. When the table
//! is full, a newcomer from a source holding less than its *fair share*
//! (the table's size over the number of distinct sources, the newcomer's
//! counted) takes the place of the least recently active *idle* admitted
//! connection of the source holding the most above its share: one or two
//! sources cannot hold every place and shut every other peer out. A
//! connection is idle only between requests (its server says so with
//! [`Admission::idle`]); one in the middle of a request, or one whose
//! server never says, is never evicted. A server whose connections are
//! driven by lanes that must not take the book's lock (the data port) says
//! so through an [`IdleCell`] per connection instead, which the book claims
//! with one compare-and-swap, so a connection that just went busy is never
//! taken. A source at or above its share may
//! only push out its own pending connections. Past all that a newcomer is
//! refused (`Busy`, which the initiator may retry).

pub(crate) use super::idle_cell::IdleCell;
use super::idle_cell::{base, ticks};
use crate::log::ratelimit::{log_limited, RateLimit};
use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default most connections (pending and admitted) a listener holds.
pub const DEFAULT_MAX_CONNECTIONS: usize = 8192;
/// Default most admitted connections from one source address.
pub const DEFAULT_MAX_CONNECTIONS_PER_SOURCE: usize = 4096;
/// Default most pending connections from one source address.
pub const DEFAULT_MAX_PENDING_PER_SOURCE: usize = 64;
/// Default most pending connections in total.
pub const DEFAULT_MAX_PENDING: usize = 1024;
/// Default time a connection has to prove itself.
pub const DEFAULT_ADMISSION_TIMEOUT: Duration = Duration::from_secs(2);

/// The bounds one listener enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Most connections, pending and admitted.
    pub max_total: usize,
    /// Most admitted connections from one source address.
    pub max_per_source: usize,
    /// Most pending connections from one source address.
    pub max_pending_per_source: usize,
    /// Most pending connections in total.
    pub max_pending: usize,
    /// Time a connection has to prove itself before it is closed.
    pub timeout: Duration,
}

impl Default for AdmissionLimits {
    fn default() -> Self {
        Self {
            max_total: DEFAULT_MAX_CONNECTIONS,
            max_per_source: DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
            max_pending_per_source: DEFAULT_MAX_PENDING_PER_SOURCE,
            max_pending: DEFAULT_MAX_PENDING,
            timeout: DEFAULT_ADMISSION_TIMEOUT,
        }
    }
}

impl AdmissionLimits {
    /// These limits with the total capped at `max` (the fd budget, or a
    /// server's own bound).
    pub(crate) fn capped(mut self, max: usize) -> Self {
        self.max_total = self.max_total.min(max).max(1);
        self.max_pending = self.max_pending.min(self.max_total);
        self
    }
}

/// What to do with a connection that just arrived.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Arrival<K> {
    /// Keep it (pending).
    Accept,
    /// Keep it, and close `K` to make room: the oldest pending connection,
    /// or an idle admitted connection of a source above its fair share.
    AcceptEvicting(K),
    /// Refuse it: answer `Busy` naming the bound, and close it.
    Refuse(&'static str),
}

#[derive(Debug)]
struct Entry {
    source: IpAddr,
    /// Set while pending: when it arrived.
    pending_since: Option<Instant>,
    /// Set while admitted and between requests: since when. Only such a
    /// connection may be evicted for a newcomer, the longest idle first.
    idle_since: Option<Instant>,
    /// Where its server keeps its idleness instead, without the book's
    /// lock ([`Admission::watch`]).
    cell: Option<Arc<IdleCell>>,
}

#[derive(Debug, Default)]
struct SourceCounts {
    pending: usize,
    admitted: usize,
}

/// One listener's book of connections, keyed by the server's own id.
#[derive(Debug)]
pub(crate) struct Admission<K: Copy + Eq + Hash> {
    limits: AdmissionLimits,
    entries: HashMap<K, Entry>,
    sources: HashMap<IpAddr, SourceCounts>,
    /// Pending connections, oldest first; entries that have since been
    /// admitted or closed are skipped when met.
    pending: VecDeque<(K, Instant)>,
    pending_count: usize,
}

impl<K: Copy + Eq + Hash> Admission<K> {
    /// An empty book.
    pub(crate) fn new(limits: AdmissionLimits) -> Self {
        base();
        Self { limits, entries: HashMap::new(), sources: HashMap::new(), pending: VecDeque::new(), pending_count: 0 }
    }

    /// The limits in force.
    pub(crate) fn limits(&self) -> AdmissionLimits {
        self.limits
    }

    /// Connections held, pending and admitted.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Pending connections held.
    pub(crate) fn pending(&self) -> usize {
        self.pending_count
    }

    /// Books a new connection `key` from `source` as pending, or says why
    /// not. On `AcceptEvicting` the evicted connection is already out of
    /// the book; the caller closes it.
    pub(crate) fn arrive(&mut self, key: K, source: IpAddr, now: Instant) -> Arrival<K> {
        let counts = self.sources.get(&source);
        let from_source = counts.map_or(0, |c| c.pending);
        let evicted = if from_source >= self.limits.max_pending_per_source {
            self.evict_oldest_pending(Some(source))
        } else if self.pending_count >= self.limits.max_pending {
            self.evict_oldest_pending(None)
        } else if self.entries.len() >= self.limits.max_total {
            self.make_room_for(source)
        } else {
            None
        };
        if self.entries.len() >= self.limits.max_total {
            static LIMIT: RateLimit = RateLimit::per_second();
            log_limited!(warn, LIMIT, %source, bound = "connection table", limit = self.limits.max_total, "connection refused");
            return Arrival::Refuse("connection table");
        }
        if from_source >= self.limits.max_pending_per_source && evicted.is_none() {
            static LIMIT: RateLimit = RateLimit::per_second();
            log_limited!(
                warn,
                LIMIT,
                %source,
                bound = "pending connections from one address",
                limit = self.limits.max_pending_per_source,
                "connection refused"
            );
            return Arrival::Refuse("pending connections from one address");
        }
        self.entries.insert(key, Entry { source, pending_since: Some(now), idle_since: None, cell: None });
        self.sources.entry(source).or_default().pending += 1;
        self.pending.push_back((key, now));
        self.pending_count += 1;
        match evicted {
            Some(old) => Arrival::AcceptEvicting(old),
            None => Arrival::Accept,
        }
    }

    /// Room in a full table for a newcomer from `source`. Below its fair
    /// share it may push out any source's oldest pending connection, else
    /// the longest idle admitted connection of the source holding the most
    /// above the share (which is left with at least its share); at or above
    /// its share, only its own pending connections.
    fn make_room_for(&mut self, source: IpAddr) -> Option<K> {
        let sources = self.sources.len() + usize::from(!self.sources.contains_key(&source));
        let share = self.limits.max_total / sources;
        if self.held(source) >= share {
            return self.evict_oldest_pending(Some(source));
        }
        if let Some(evicted) = self.evict_oldest_pending(None) {
            return Some(evicted);
        }
        let (_, Reverse(since), key) = self
            .entries
            .iter()
            .filter(|(_, entry)| entry.pending_since.is_none())
            .filter_map(|(key, entry)| {
                let idle_since = match &entry.cell {
                    Some(cell) => cell.idle_since()?,
                    None => ticks(entry.idle_since?),
                };
                let held = self.held(entry.source);
                (held > share).then_some((held, Reverse(idle_since), *key))
            })
            .max_by_key(|&(held, idle_since, _)| (held, idle_since))?;
        // A watched connection whose lane marked it busy since it was seen
        // keeps its place; the newcomer is refused this time.
        if self.entries.get(&key).and_then(|e| e.cell.as_ref()).is_some_and(|cell| !cell.claim(since)) {
            return None;
        }
        self.leave(key);
        static LIMIT: RateLimit = RateLimit::per_second();
        log_limited!(info, LIMIT, %source, share, "an idle connection of a source above its fair share closed for a newcomer");
        Some(key)
    }

    /// Connections `source` holds, pending and admitted.
    fn held(&self, source: IpAddr) -> usize {
        self.sources.get(&source).map_or(0, |c| c.pending + c.admitted)
    }

    /// The connection is in the middle of a request, so not to be evicted;
    /// false if it is no longer in the book (evicted: its server closes it).
    pub(crate) fn busy(&mut self, key: K) -> bool {
        self.entries.get_mut(&key).map(|entry| entry.idle_since = None).is_some()
    }

    /// The admitted connection finished a request and waits for the next:
    /// from now it may be evicted for a newcomer if its source holds more
    /// than its fair share. A pending connection is unaffected (pending
    /// connections are evicted by age, [`Admission::arrive`]).
    pub(crate) fn idle(&mut self, key: K, now: Instant) {
        if let Some(entry) = self.entries.get_mut(&key).filter(|e| e.pending_since.is_none()) {
            entry.idle_since = Some(now);
        }
    }

    /// Its server keeps connection `key`'s idleness in the cell returned
    /// ([`IdleCell::idle`], [`IdleCell::busy`]) rather than through
    /// [`Admission::idle`] and [`Admission::busy`]: it starts busy. `None`
    /// when `key` is not in the book.
    pub(crate) fn watch(&mut self, key: K) -> Option<Arc<IdleCell>> {
        let entry = self.entries.get_mut(&key)?;
        Some(entry.cell.get_or_insert_with(Arc::default).clone())
    }

    fn evict_oldest_pending(&mut self, source: Option<IpAddr>) -> Option<K> {
        let position = self.pending.iter().position(|(key, since)| {
            self.entries
                .get(key)
                .is_some_and(|e| e.pending_since == Some(*since) && source.is_none_or(|s| s == e.source))
        })?;
        let (key, _) = self.pending.remove(position)?;
        self.leave(key);
        Some(key)
    }

    /// The connection proved itself. `Err` names the bound that refuses
    /// it (its source holds too many admitted connections): the caller
    /// answers `Busy` and closes it, then calls [`Admission::leave`].
    pub(crate) fn admit(&mut self, key: K) -> Result<(), &'static str> {
        let Some(entry) = self.entries.get_mut(&key) else { return Ok(()) };
        if entry.pending_since.is_none() {
            return Ok(());
        }
        let counts = self.sources.entry(entry.source).or_default();
        if counts.admitted >= self.limits.max_per_source {
            static LIMIT: RateLimit = RateLimit::per_second();
            let source = entry.source;
            log_limited!(
                warn,
                LIMIT,
                %source,
                bound = "connections from one address",
                limit = self.limits.max_per_source,
                "connection refused after its proof"
            );
            return Err("connections from one address");
        }
        entry.pending_since = None;
        counts.pending -= 1;
        counts.admitted += 1;
        self.pending_count -= 1;
        Ok(())
    }

    /// The connection is gone (closed by either side).
    pub(crate) fn leave(&mut self, key: K) {
        let Some(entry) = self.entries.remove(&key) else { return };
        if let Some(counts) = self.sources.get_mut(&entry.source) {
            if entry.pending_since.is_some() {
                counts.pending -= 1;
                self.pending_count -= 1;
            } else {
                counts.admitted -= 1;
            }
            if counts.pending == 0 && counts.admitted == 0 {
                self.sources.remove(&entry.source);
            }
        }
        if self.pending.len() > 2 * self.pending_count + 64 {
            // Compact the skipped entries now and then, so the queue stays
            // proportional to what is really pending.
            let entries = &self.entries;
            self.pending.retain(|(key, since)| entries.get(key).is_some_and(|e| e.pending_since == Some(*since)));
        }
    }

    /// Pending connections past their deadline, out of the book and into
    /// `expired` for the caller to close.
    pub(crate) fn expire(&mut self, now: Instant, expired: &mut Vec<K>) {
        while let Some(&(key, since)) = self.pending.front() {
            let still_pending = self.entries.get(&key).is_some_and(|e| e.pending_since == Some(since));
            if still_pending && now.saturating_duration_since(since) < self.limits.timeout {
                return;
            }
            self.pending.pop_front();
            if still_pending {
                self.leave(key);
                expired.push(key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> AdmissionLimits {
        AdmissionLimits {
            max_total: 6,
            max_per_source: 2,
            max_pending_per_source: 3,
            max_pending: 4,
            timeout: Duration::from_secs(2),
        }
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[test]
    fn a_flood_from_one_address_only_churns_its_own_pending_connections() {
        let mut book = Admission::new(limits());
        let t0 = Instant::now();
        for key in 0..3 {
            assert_eq!(book.arrive(key, A, t0), Arrival::Accept);
        }
        // A's fourth pending connection pushes out A's oldest.
        assert_eq!(book.arrive(3, A, t0), Arrival::AcceptEvicting(0));
        // B still gets in, and proves itself.
        assert_eq!(book.arrive(10, B, t0), Arrival::Accept);
        assert_eq!(book.admit(10), Ok(()));
        assert_eq!(book.pending(), 3);
        // A legitimate connection from A itself is accepted too, pushing
        // out the flood's oldest, and is admitted.
        assert_eq!(book.arrive(11, A, t0), Arrival::AcceptEvicting(1));
        assert_eq!(book.admit(11), Ok(()));
        assert_eq!(book.len(), 4);
    }

    #[test]
    fn bounds_refuse_with_a_reason_and_only_idle_connections_above_a_fair_share_are_evicted() {
        let mut book = Admission::new(limits());
        let t0 = Instant::now();
        for key in 0..2 {
            assert_eq!(book.arrive(key, A, t0), Arrival::Accept);
            assert_eq!(book.admit(key), Ok(()));
        }
        // A third admitted connection from A is refused at proof time.
        assert_eq!(book.arrive(2, A, t0), Arrival::Accept);
        assert_eq!(book.admit(2), Err("connections from one address"));
        book.leave(2);
        // Fill the table with admitted connections from many sources.
        for key in 3..7u8 {
            let source = IpAddr::V4(std::net::Ipv4Addr::new(10, 1, 0, key));
            assert_eq!(book.arrive(u32::from(key), source, t0), Arrival::Accept);
            assert_eq!(book.admit(u32::from(key)), Ok(()));
        }
        assert_eq!(book.len(), 6);
        // Full: B's fair share is 6 / 6 sources = 1, and A holds 2, but
        // A's connections never said they were idle: nothing to evict.
        assert_eq!(book.arrive(99, B, t0), Arrival::Refuse("connection table"));
        // Once one of A's is idle, B takes its place.
        book.idle(0, t0);
        assert_eq!(book.arrive(99, B, t0), Arrival::AcceptEvicting(0));
        assert_eq!(book.admit(99), Ok(()));
        assert_eq!(book.len(), 6);
        // A busy connection whose eviction already happened learns it.
        assert!(!book.busy(0));
        assert!(book.busy(1));
    }

    fn wide() -> AdmissionLimits {
        AdmissionLimits { max_per_source: 6, max_pending_per_source: 6, max_pending: 6, ..limits() }
    }

    /// Admitted connections from `source`: each key, idle since `t0` plus
    /// its seconds.
    fn hold(book: &mut Admission<u32>, source: IpAddr, keys: &[(u32, u64)], t0: Instant) {
        for &(key, idle_after) in keys {
            assert_eq!(book.arrive(key, source, t0), Arrival::Accept);
            assert_eq!(book.admit(key), Ok(()));
            book.idle(key, t0 + Duration::from_secs(idle_after));
        }
    }

    const C: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 3));

    #[test]
    fn a_newcomer_below_its_fair_share_takes_the_longest_idle_place_of_the_largest_source() {
        let mut book = Admission::new(wide());
        let t0 = Instant::now();
        hold(&mut book, A, &[(0, 3), (1, 1), (2, 4), (3, 2)], t0);
        hold(&mut book, B, &[(4, 0), (5, 0)], t0);
        // Share 6 / 3 = 2: A holds 4, so A's longest idle goes (not B's,
        // idle longer but within its share).
        assert_eq!(book.arrive(10, C, t0), Arrival::AcceptEvicting(1));
        assert_eq!(book.admit(10), Ok(()));
        book.idle(10, t0);
        assert_eq!(book.arrive(11, C, t0), Arrival::AcceptEvicting(3));
        assert_eq!(book.admit(11), Ok(()));
        // C now holds its share (2), as do A and B: C is refused, and so
        // are A and B, whose own pending connections are none.
        for (key, source) in [(12, C), (13, A), (14, B)] {
            assert_eq!(book.arrive(key, source, t0), Arrival::Refuse("connection table"));
        }
        assert_eq!(book.len(), 6);
    }

    /// Connections whose lane keeps their idleness in a cell (the data
    /// port): evicted like the others once idle, never while busy, and one
    /// whose place was taken learns it when its next bytes come.
    #[test]
    fn watched_connections_are_evicted_only_while_their_cell_says_idle() {
        let mut book = Admission::new(wide());
        let t0 = Instant::now();
        let mut cells = Vec::new();
        for key in 0..6 {
            assert_eq!(book.arrive(key, A, t0), Arrival::Accept);
            assert_eq!(book.admit(key), Ok(()));
            cells.push(book.watch(key).expect("in the book"));
        }
        assert!(book.watch(99).is_none(), "not in the book");
        // Every cell starts busy: nothing to evict.
        assert_eq!(book.arrive(10, B, t0), Arrival::Refuse("connection table"));
        // Idle at different times; key 4 longest.
        for (key, after) in [(2, 3), (4, 1), (5, 2)] {
            assert!(cells[key].idle(t0 + Duration::from_secs(after)));
        }
        assert_eq!(book.arrive(10, B, t0), Arrival::AcceptEvicting(4));
        assert_eq!(book.admit(10), Ok(()));
        assert!(!cells[4].busy(), "its next bytes find it evicted");
        assert!(!cells[4].idle(t0), "and it cannot come back idle");
        // Key 5 (idle since 2 s) went busy again: key 2 goes next.
        assert!(cells[5].busy());
        assert_eq!(book.arrive(11, B, t0), Arrival::AcceptEvicting(2));
        assert_eq!(book.admit(11), Ok(()));
        // A's other connections are busy: B, below its share (6 / 2 = 3),
        // is refused rather than take a busy place.
        assert_eq!(book.arrive(12, B, t0), Arrival::Refuse("connection table"));
        assert!(cells[0].busy() && cells[5].busy(), "never taken");
        assert_eq!(book.len(), 6);
    }

    #[test]
    fn a_busy_connection_is_never_evicted() {
        let mut book = Admission::new(wide());
        let t0 = Instant::now();
        hold(&mut book, A, &[(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)], t0);
        hold(&mut book, B, &[(5, 0)], t0);
        for key in 0..5 {
            assert!(book.busy(key));
        }
        // A holds 5 of a share of 2, but every one is mid-request.
        assert_eq!(book.arrive(10, C, t0), Arrival::Refuse("connection table"));
        // One request ends: that connection, and only it, may go.
        book.idle(3, t0 + Duration::from_secs(9));
        assert_eq!(book.arrive(10, C, t0), Arrival::AcceptEvicting(3));
        assert_eq!(book.admit(10), Ok(()));
        assert_eq!(book.arrive(11, C, t0), Arrival::Refuse("connection table"));
    }

    #[test]
    fn many_sources_each_at_their_fair_share_refuse_a_newcomer() {
        let mut book = Admission::new(wide());
        let t0 = Instant::now();
        for key in 0..6u8 {
            let source = IpAddr::V4(std::net::Ipv4Addr::new(10, 1, 0, key));
            hold(&mut book, source, &[(u32::from(key), 0)], t0);
        }
        // A seventh source's share is 6 / 7 = 0; an existing one's is 1,
        // which it holds.
        assert_eq!(book.arrive(10, C, t0), Arrival::Refuse("connection table"));
        let one = IpAddr::V4(std::net::Ipv4Addr::new(10, 1, 0, 0));
        assert_eq!(book.arrive(11, one, t0), Arrival::Refuse("connection table"));
        assert_eq!(book.len(), 6);
    }

    #[test]
    fn a_source_at_its_share_cannot_push_out_a_newcomers_pending_connection() {
        let mut book = Admission::new(wide());
        let t0 = Instant::now();
        hold(&mut book, A, &[(0, 0), (1, 1), (2, 2), (3, 3), (4, 4)], t0);
        assert_eq!(book.arrive(10, C, t0), Arrival::Accept);
        // Full. A (share 3, holding 5) reconnecting may not evict C's
        // pending connection (before the fair share, it evicted the oldest
        // pending of any source).
        assert_eq!(book.arrive(11, A, t0), Arrival::Refuse("connection table"));
        assert_eq!(book.admit(10), Ok(()));
        // B (share 6 / 3 = 2, holding none) takes A's longest idle place.
        assert_eq!(book.arrive(12, B, t0), Arrival::AcceptEvicting(0));
    }

    #[test]
    fn pending_connections_expire_at_their_deadline_and_admitted_ones_do_not() {
        let mut book = Admission::new(limits());
        let t0 = Instant::now();
        book.arrive(1, A, t0);
        book.arrive(2, B, t0 + Duration::from_secs(1));
        book.arrive(3, B, t0 + Duration::from_millis(500));
        assert_eq!(book.admit(3), Ok(()));
        let mut expired = Vec::new();
        book.expire(t0 + Duration::from_millis(1999), &mut expired);
        assert!(expired.is_empty());
        book.expire(t0 + Duration::from_secs(2), &mut expired);
        assert_eq!(expired, [1]);
        book.expire(t0 + Duration::from_secs(10), &mut expired);
        assert_eq!(expired, [1, 2]);
        assert_eq!((book.len(), book.pending()), (1, 0));
        // Leaving twice, or a key never booked, changes nothing.
        book.leave(1);
        book.leave(42);
        assert_eq!(book.len(), 1);
    }

    #[test]
    fn the_total_pending_bound_evicts_the_oldest_of_any_source() {
        let mut book = Admission::new(limits());
        let t0 = Instant::now();
        for (key, source) in [(1, A), (2, B), (3, A), (4, B)] {
            assert_eq!(book.arrive(key, source, t0), Arrival::Accept);
        }
        let c = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 3));
        assert_eq!(book.arrive(5, c, t0), Arrival::AcceptEvicting(1));
        assert_eq!(book.pending(), 4);
    }
}
