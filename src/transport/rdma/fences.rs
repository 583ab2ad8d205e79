//! Fenced destinations over rdma, the initiator's side: a *mirror* of each
//! of the target's fence tables, in this engine's memory, that the lanes of
//! the link check every WRITE against (the one-sided writer path of
//! `mem::fence`: enter, check each block under its grant, keep the count
//! until the chunk's completion), and that the target keeps current by
//! pushing each new fence over the control plane (`RdmaFenceRequest`). The
//! answer goes back once the mirror's own fence returned: every write the
//! lanes posted before it has completed, so its bytes are placed at the
//! target. docs/ARCHITECTURE.md, "Fenced destinations over rdma".

use crate::error::{Error, Result};
use crate::mem::fence::{pauser, FenceFailed, FenceTable, Held, Span};
use crate::transport::Block;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// Most regions one connect's snapshot may carry (a registry's slots).
pub const MAX_FENCE_TABLES: usize = 64 * 1024;
/// Most spans one pushed fence may carry, over all its regions (a region
/// listed with none counts as one: a push of empty entries is bounded too).
pub const MAX_PUSHED_SPANS: usize = 64 * 1024;
/// Most pushes kept for one link before its snapshot is in (their spans
/// count against [`MAX_PUSHED_SPANS`] together): a target that holds its
/// connect reply back while it pushes cannot fill this engine's memory.
pub const MAX_PENDING_PUSHES: usize = 1024;
/// Longest a pushed fence may ask the initiator to wait for its writes.
pub const MAX_PUSH_WAIT: Duration = Duration::from_secs(10);

/// One pushed fence: per region (raw id), its spans.
pub type Pushed = Vec<(u64, Vec<Span>)>;

/// The mirrors of one target's tables at one initiator (one rdma link).
#[derive(Debug)]
pub struct Mirrors {
    /// By the target's region (raw id): those the link may write.
    tables: HashMap<u64, FenceTable>,
    /// Pushes that came before the connect's snapshot was installed; the
    /// lock also serialises the fencers of every table here.
    install: Mutex<Install>,
}

#[derive(Debug, Default)]
struct Install {
    installed: bool,
    pending: Vec<(Pushed, u32)>,
    /// Spans in `pending`, all pushes together.
    pending_spans: usize,
}

impl Mirrors {
    /// Empty mirrors of `regions` (raw ids): until [`Mirrors::install`],
    /// pushes are kept for later and no lane posts.
    pub fn new(regions: impl IntoIterator<Item = u64>) -> Arc<Self> {
        Arc::new(Self {
            tables: regions.into_iter().map(|region| (region, FenceTable::new())).collect(),
            install: Mutex::new(Install::default()),
        })
    }

    /// The mirror of the target's region `region` (raw id), if the link
    /// has one.
    #[cfg(any(test, feature = "testing"))]
    pub fn table(&self, region: u64) -> Option<&FenceTable> {
        self.tables.get(&region)
    }

    /// Takes the connect's snapshot (`RdmaConnectResponse::fences`) and
    /// replays what was pushed before it that it does not hold. A region
    /// the snapshot lacks refuses every write (it was unregistered
    /// meanwhile); a table that is not whole is the peer's malformed
    /// message.
    pub fn install(&self, snapshot: &[crate::proto::RdmaFenceTable]) -> Result<()> {
        if snapshot.len() > MAX_FENCE_TABLES {
            return Err(Error::malformed("rdma fence tables", format!("{} tables", snapshot.len())));
        }
        let mut install = self.install.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let given: HashMap<u64, &[u64]> = snapshot.iter().map(|t| (t.region, t.words.as_slice())).collect();
        for (region, table) in &self.tables {
            match given.get(region) {
                Some(words) => table.view().install(words).map_err(|_| {
                    Error::malformed("rdma fence table", format!("region {region:#x}: {} words", words.len()))
                })?,
                None => table.view().refuse_all(),
            }
        }
        // What the snapshot holds, before any replay moves `issued`: a push
        // is judged against it alone, whatever order the pushes came in.
        let held: HashMap<u64, u64> = self.tables.iter().map(|(region, t)| (*region, t.view().issued())).collect();
        install.pending_spans = 0;
        for (pushed, generation) in std::mem::take(&mut install.pending) {
            for (region, spans) in &pushed {
                let Some(table) = self.tables.get(region) else { continue };
                // A push the snapshot already holds is not entered twice
                // (a fence's generation rises above every earlier one).
                if u64::from(generation) > held.get(region).copied().unwrap_or(0) {
                    // No lane has posted yet: nothing to wait for.
                    let _ = table.view().fence(spans, generation, || false);
                }
            }
        }
        install.installed = true;
        Ok(())
    }

    /// Enters a pushed fence in the mirrors; returns once no write the
    /// lanes posted before it can still land (its count drained), or
    /// `RegionBusy` at `deadline`. Before the snapshot is in, it is kept
    /// for [`Mirrors::install`] and answered at once: no lane has posted.
    pub fn apply(&self, pushed: Pushed, generation: u32, deadline: Instant) -> Result<()> {
        let mut install = self.install.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !install.installed {
            let spans = pushed.iter().map(|(_, spans)| spans.len().max(1)).sum::<usize>();
            let total = install.pending_spans.saturating_add(spans);
            if install.pending.len() >= MAX_PENDING_PUSHES || total > MAX_PUSHED_SPANS {
                // Answered, not kept: the target cuts this link off.
                return Err(Error::Busy {
                    queue: "rdma fences pushed before the connect's snapshot",
                    capacity: MAX_PENDING_PUSHES,
                });
            }
            install.pending_spans = total;
            install.pending.push((pushed, generation));
            return Ok(());
        }
        let mut busy = 0;
        for (region, spans) in &pushed {
            // A region the link has no mirror of is one it cannot write.
            let Some(table) = self.tables.get(region) else { continue };
            // Entered in every table even when an earlier one timed out: a
            // failed fence leaves its ranges fenced for these lanes too.
            if let Err(FenceFailed::Busy(n)) = table.view().fence(spans, generation, pauser(deadline)) {
                busy += n;
            }
        }
        match busy {
            0 => Ok(()),
            n => Err(Error::RegionBusy {
                region: crate::RegionId::from_raw(pushed.first().map_or(0, |(region, _)| *region)),
                in_flight: u32::try_from(n).unwrap_or(u32::MAX),
            }),
        }
    }
}

impl Mirrors {
    /// A lane's WRITE chunk: enters the mirror of each run of blocks into
    /// one region (a count in `holds`, kept until the chunk completes) and
    /// checks every block's range under its grant, as the one-sided paths
    /// do (`Fenced`, or `RegionBusy` when fences kept the phase moving). On
    /// an error the caller gives back what `holds` took.
    pub fn enter_chunk(&self, blocks: &[Block], holds: &mut Vec<Held>) -> Result<()> {
        let mut current: Option<(u64, &FenceTable)> = None;
        for block in blocks {
            let region = block.desc.remote_region;
            let fenced = || Error::Fenced { region, grant: block.grant };
            let table = match current {
                Some((raw, table)) if raw == region.raw() => table,
                _ => {
                    // A region the target sent no table of cannot be written.
                    let table = self.tables.get(&region.raw()).ok_or_else(fenced)?;
                    let pass = table.view().enter().ok_or(Error::RegionBusy { region, in_flight: 0 })?;
                    holds.push(pass.detach());
                    current = Some((region.raw(), table));
                    table
                }
            };
            let Some(held) = holds.last() else { return Err(fenced()) };
            let start = block.desc.remote_offset;
            if !table.view().admits_held(held, start, start.saturating_add(block.desc.len), block.grant) {
                return Err(fenced());
            }
        }
        Ok(())
    }
}

/// Gives back a chunk's counts: its writes completed (or never posted).
///
/// # Safety
///
/// The mirrors they were entered in are still alive.
pub unsafe fn release(holds: &mut Vec<Held>) {
    for held in holds.drain(..) {
        // SAFETY: per this function's contract.
        unsafe { held.release() };
    }
}

/// A chunk whose writes may still be placed (its QP failed or was reset
/// with them posted): its counts are never given back, so every later
/// fence of those mirrors fails, and the target cuts this link off.
///
/// # Safety
///
/// As [`release`].
pub unsafe fn poison(holds: &mut Vec<Held>) {
    for held in holds.drain(..) {
        // SAFETY: per this function's contract.
        unsafe { held.poison() };
    }
}

/// A pushed fence's regions and spans, checked: at most
/// [`MAX_PUSHED_SPANS`] spans, each four words. Bytes from outside: fuzzed
/// (`kvring::testing::fuzz::rdma_fence`).
pub fn decode_pushed(regions: &[crate::proto::RdmaFenceSpans]) -> Result<Pushed> {
    let mut total = 0usize;
    regions
        .iter()
        .map(|entry| {
            if entry.spans.len() % 4 != 0 {
                return Err(Error::malformed("rdma fence", format!("{} span words", entry.spans.len())));
            }
            total = total.saturating_add((entry.spans.len() / 4).max(1));
            if total > MAX_PUSHED_SPANS {
                return Err(Error::malformed("rdma fence", format!("over {MAX_PUSHED_SPANS} spans")));
            }
            let spans = entry
                .spans
                .chunks_exact(4)
                // A single range's stride is its length (`Span::range`):
                // a stride of 0 would miss a write from its last byte on.
                .map(|w| match (w[2], w[3]) {
                    (0, 1) => Span::range(w[0], w[1]),
                    _ => Span { start: w[0], len: w[1], stride: w[2], count: w[3] },
                })
                .collect();
            Ok((entry.region, spans))
        })
        .collect()
}

/// The same, as it goes on the wire.
pub fn encode_pushed(pushed: &[(u64, Vec<Span>)]) -> Vec<crate::proto::RdmaFenceSpans> {
    pushed
        .iter()
        .map(|(region, spans)| crate::proto::RdmaFenceSpans {
            region: *region,
            spans: spans.iter().flat_map(|s| [s.start, s.len, s.stride, s.count]).collect(),
        })
        .collect()
}

/// Bytes of the key an initiator gives each target in its rdma connect,
/// that the target's pushes must carry.
pub const PUSH_KEY_BYTES: usize = 16;

/// This engine's links' mirrors, by target (name and epoch), for the
/// control server to find a push's mirrors by the pusher's handshake and
/// key.
#[derive(Debug, Default)]
pub struct MirrorBook {
    by_target: Mutex<HashMap<(String, u64), Booked>>,
    /// Counts bookings and installs, to order them.
    clock: std::sync::atomic::AtomicU64,
}

/// One target's key and the mirrors of every live link to it.
#[derive(Debug)]
struct Booked {
    key: [u8; PUSH_KEY_BYTES],
    /// More than one while a link connects beside one still live (a
    /// reopen): the old one's lanes may still post until the target
    /// replaced its QPs, so a push must reach its mirrors too.
    links: Vec<Filed>,
    /// The highest booking of a link that was installed (its connect's
    /// reply came: the target had accepted it, replacing every set of
    /// QPs of ours it accepted before).
    latest_install: u64,
    /// A link whose QPs were reset with WRITEs posted, installed at this
    /// tick: the target may still place them while it keeps those QPs, so
    /// every push is answered "no such link" (the target cuts them off)
    /// until a link booked after this tick is installed.
    posted_on_reset: Option<u64>,
}

#[derive(Debug)]
struct Filed {
    mirrors: Weak<Mirrors>,
    booked: u64,
    installed: Option<u64>,
}

impl Booked {
    fn holds(&self) -> bool {
        !self.links.is_empty() || self.posted_on_reset.is_some()
    }
}

impl MirrorBook {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, u64), Booked>> {
        self.by_target.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Files `mirrors` among those target `(name, epoch)` pushes to;
    /// returns the key its pushes must carry (made for the target when no
    /// link to it is filed, else the filed links' one).
    pub fn insert(&self, name: &str, epoch: u64, mirrors: &Arc<Mirrors>) -> [u8; PUSH_KEY_BYTES] {
        let mut book = self.lock();
        book.retain(|_, booked| {
            booked.links.retain(|filed| filed.mirrors.strong_count() > 0);
            booked.holds()
        });
        let booked = book.entry((name.to_string(), epoch)).or_insert_with(|| Booked {
            key: crate::auth::random_bytes(),
            links: Vec::new(),
            latest_install: 0,
            posted_on_reset: None,
        });
        booked.links.push(Filed { mirrors: Arc::downgrade(mirrors), booked: self.tick(), installed: None });
        booked.key
    }

    /// `mirrors`' link is connected: the target accepted its QPs, and
    /// with them replaced every set it held for this engine before.
    pub fn installed(&self, mirrors: &Arc<Mirrors>) {
        let now = self.tick();
        let mut book = self.lock();
        for booked in book.values_mut() {
            let Some(filed) = booked.links.iter_mut().find(|f| std::ptr::eq(f.mirrors.as_ptr(), Arc::as_ptr(mirrors)))
            else {
                continue;
            };
            filed.installed = Some(now);
            let at = filed.booked;
            booked.latest_install = booked.latest_install.max(at);
            // Booked after the reset link was installed: its connect was
            // accepted after that link's, whose QPs the target let go.
            if booked.posted_on_reset.is_some_and(|reset| at > reset) {
                booked.posted_on_reset = None;
            }
        }
    }

    /// The live mirrors target `(name, epoch)` pushes to (none: no link of
    /// ours writes there); `Unauthorized` when `key` is not the one given
    /// to it (the pusher is not the target our links connected to);
    /// `UnknownSegment` while a link reset with WRITEs posted may still
    /// hold live QPs there.
    pub fn get(&self, name: &str, epoch: u64, key: &[u8]) -> Result<Vec<Arc<Mirrors>>> {
        let book = self.lock();
        let Some(booked) = book.get(&(name.to_string(), epoch)) else { return Ok(Vec::new()) };
        // Every byte compared, whichever differs.
        let differ =
            key.len() != PUSH_KEY_BYTES || key.iter().zip(&booked.key).fold(0u8, |acc, (a, b)| acc | (a ^ b)) != 0;
        if differ {
            return Err(Error::Unauthorized { reason: format!("an rdma fence without {name}'s push key") });
        }
        if booked.posted_on_reset.is_some() {
            return Err(Error::UnknownSegment { segment: name.to_string() });
        }
        Ok(booked.links.iter().filter_map(|filed| filed.mirrors.upgrade()).collect())
    }

    /// Forgets `mirrors`: their link broke or closed (a push for it must
    /// cut it off). `posted`: its QPs were reset with WRITEs posted, which
    /// may still be placed while the target keeps those QPs.
    pub fn remove(&self, mirrors: &Arc<Mirrors>, posted: bool) {
        let mut book = self.lock();
        for booked in book.values_mut() {
            let Some(at) = booked.links.iter().position(|f| std::ptr::eq(f.mirrors.as_ptr(), Arc::as_ptr(mirrors)))
            else {
                continue;
            };
            let filed = booked.links.remove(at);
            match filed.installed {
                // A link booked after it was installed was installed too:
                // the target had already let its QPs go.
                Some(installed) if posted && booked.latest_install <= installed => {
                    booked.posted_on_reset = booked.posted_on_reset.max(Some(installed));
                }
                _ => {}
            }
        }
        book.retain(|_, booked| booked.holds());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{RdmaFenceSpans, RdmaFenceTable};

    fn snapshot_of(table: &FenceTable, region: u64) -> RdmaFenceTable {
        RdmaFenceTable { region, words: table.view().snapshot() }
    }

    #[test]
    fn a_mirror_refuses_what_the_targets_table_refuses_pushed_before_or_after_its_snapshot() {
        let target = FenceTable::new();
        target.view().fence(&[Span::range(0, 100)], 5, || true).unwrap();
        let mirrors = Mirrors::new([7, 8]);
        // Pushed before the snapshot came: kept, answered at once.
        let early = vec![(7, vec![Span::range(200, 100)])];
        mirrors.apply(early, 6, Instant::now()).unwrap();
        mirrors.install(&[snapshot_of(&target, 7)]).unwrap();
        let view = mirrors.table(7).unwrap().view();
        let pass = view.enter().unwrap();
        assert!(!pass.admits(0, 100, 4), "the snapshot's fence holds");
        assert!(pass.admits(0, 100, 5));
        assert!(!pass.admits(200, 300, 5), "the early push was replayed");
        assert!(!pass.admits(0, 100, 7), "a grant the target never issued is refused on fenced bytes");
        assert!(pass.admits(1000, 1100, 0), "unfenced bytes take grant 0");
        drop(pass);
        let absent = mirrors.table(8).unwrap().view().enter().unwrap();
        assert!(!absent.admits(0, 1, 6), "a region the snapshot lacks refuses every write");
        drop(absent);
        // A push after the snapshot: applied, waits for counted writers.
        let held = view.enter().unwrap();
        let busy = mirrors.apply(vec![(7, vec![Span::range(0, 100)])], 9, Instant::now());
        assert!(matches!(busy, Err(Error::RegionBusy { in_flight: 1, .. })), "{busy:?}");
        drop(held);
        mirrors.apply(vec![(7, vec![Span::range(0, 100)])], 10, Instant::now()).unwrap();
        assert!(!view.enter().unwrap().admits(0, 100, 9));
    }

    /// Review 8: pushes kept before the snapshot are bounded (a target
    /// holding its connect reply back while it pushes fills no memory),
    /// and each is replayed unless the snapshot itself holds it, whatever
    /// order they came in.
    #[test]
    fn pushes_before_the_snapshot_are_bounded_and_each_replayed_against_the_snapshot() {
        let mirrors = Mirrors::new([1]);
        let many = vec![(1, vec![Span::range(0, 1); MAX_PUSHED_SPANS / 2 + 1])];
        mirrors.apply(many.clone(), 3, Instant::now()).unwrap();
        let over = mirrors.apply(many, 4, Instant::now());
        assert!(matches!(over, Err(Error::Busy { .. })), "{over:?}");
        let mirrors = Mirrors::new([1]);
        mirrors.apply(vec![(1, vec![]); MAX_PUSHED_SPANS], 3, Instant::now()).unwrap();
        let over = mirrors.apply(vec![(1, vec![])], 4, Instant::now());
        assert!(matches!(over, Err(Error::Busy { .. })), "empty entries are kept too: {over:?}");
        let mirrors = Mirrors::new([1]);
        for generation in 0..MAX_PENDING_PUSHES as u32 {
            mirrors.apply(vec![], generation + 1, Instant::now()).unwrap();
        }
        assert!(matches!(mirrors.apply(vec![], u32::MAX, Instant::now()), Err(Error::Busy { .. })));

        let target = FenceTable::new();
        target.view().fence(&[Span::range(0, 10)], 10, || true).unwrap();
        let mirrors = Mirrors::new([1]);
        mirrors.apply(vec![(1, vec![Span::range(100, 10)])], 100, Instant::now()).unwrap();
        mirrors.apply(vec![(1, vec![Span::range(200, 10)])], 50, Instant::now()).unwrap();
        mirrors.install(&[snapshot_of(&target, 1)]).unwrap();
        let pass = mirrors.table(1).unwrap().view().enter().unwrap();
        assert!(!pass.admits(100, 110, 99) && !pass.admits(0, 10, 9));
        assert!(!pass.admits(200, 210, 49), "a push below an earlier one was dropped");
    }

    /// Review 8: a link reset with WRITEs posted (an abort, a drop with
    /// chunks in flight) leaves a mark that answers every push "no such
    /// link" (the target cuts the old QPs off) until a link booked after
    /// it was installed is installed: a reopen's new, empty mirrors must
    /// not answer for QPs the target still holds.
    #[test]
    fn a_link_reset_with_writes_posted_is_answered_for_until_a_later_link_is_installed() {
        let book = MirrorBook::default();
        let old = Mirrors::new([1]);
        let key = book.insert("t", 3, &old);
        book.installed(&old);
        book.remove(&old, true);
        drop(old);
        assert!(matches!(book.get("t", 3, &key), Err(Error::UnknownSegment { .. })), "no mirrors: cut off");
        let new = Mirrors::new([1]);
        assert_eq!(book.insert("t", 3, &new), key);
        assert!(matches!(book.get("t", 3, &key), Err(Error::UnknownSegment { .. })), "booked, not yet accepted");
        book.installed(&new);
        assert_eq!(book.get("t", 3, &key).unwrap().len(), 1, "accepted: the old QPs were let go");

        // A link that broke because a later connect replaced its QPs
        // leaves no mark (the later link was installed after it).
        let later = Mirrors::new([1]);
        book.insert("t", 3, &later);
        book.installed(&later);
        book.remove(&new, true);
        assert_eq!(book.get("t", 3, &key).unwrap().len(), 1);

        // Two connects raced: the one booked later was accepted first, so
        // the earlier-booked one's QPs are the live ones at the target.
        let book = MirrorBook::default();
        let (first, second) = (Mirrors::new([1]), Mirrors::new([1]));
        let key = book.insert("u", 1, &first);
        book.insert("u", 1, &second);
        book.installed(&second);
        book.installed(&first);
        book.remove(&first, true);
        assert!(matches!(book.get("u", 1, &key), Err(Error::UnknownSegment { .. })));
        // Closed with nothing posted: no mark.
        let book = MirrorBook::default();
        let idle = Mirrors::new([1]);
        let key = book.insert("v", 1, &idle);
        book.installed(&idle);
        book.remove(&idle, false);
        assert!(book.get("v", 1, &key).unwrap().is_empty());
    }

    #[test]
    fn malformed_tables_and_spans_are_refused() {
        let mirrors = Mirrors::new([1]);
        for words in [vec![], vec![0; 7], vec![0; 9], vec![0; 8 + 5 * 100]] {
            let bad = RdmaFenceTable { region: 1, words };
            assert!(matches!(mirrors.install(&[bad]), Err(Error::Malformed { .. })));
        }
        // `used` must say as many entries as the words hold.
        let mut words = vec![0; 13];
        words[4] = 2;
        assert!(mirrors.install(&[RdmaFenceTable { region: 1, words }]).is_err());
        assert!(decode_pushed(&[RdmaFenceSpans { region: 1, spans: vec![1, 2, 3] }]).is_err());
        // Review 8: empty entries count too (a 4 MiB message of them
        // decoded to some 45 MB, and were kept before the snapshot).
        let empty = vec![RdmaFenceSpans { region: 1, spans: vec![] }; MAX_PUSHED_SPANS + 1];
        assert!(matches!(decode_pushed(&empty), Err(Error::Malformed { .. })));
        assert_eq!(decode_pushed(&empty[..MAX_PUSHED_SPANS]).unwrap().len(), MAX_PUSHED_SPANS);
        let spans = vec![Span { start: 1, len: 2, stride: 3, count: 4 }];
        assert_eq!(decode_pushed(&encode_pushed(&[(9, spans.clone())])).unwrap(), vec![(9, spans)]);
    }

    #[test]
    fn the_book_finds_live_mirrors_only() {
        let book = MirrorBook::default();
        let mirrors = Mirrors::new([1]);
        let key = book.insert("t", 3, &mirrors);
        assert_eq!(book.get("t", 3, &key).unwrap().len(), 1);
        assert!(book.get("t", 4, &key).unwrap().is_empty(), "another start of the target");
        book.remove(&mirrors, false);
        assert!(book.get("t", 3, &key).unwrap().is_empty());
        let key = book.insert("t", 3, &mirrors);
        drop(mirrors);
        assert!(book.get("t", 3, &key).unwrap().is_empty(), "a dropped link's mirrors are gone");
    }

    /// Review 8: a push must prove it is the target's (its key), and a
    /// link that connects while another to the same target is live (a
    /// reopen) must not take the live one's pushes away: its lanes may
    /// post until the target replaced its QPs.
    #[test]
    fn the_book_wants_the_targets_key_and_reaches_every_live_link() {
        let book = MirrorBook::default();
        let old = Mirrors::new([1]);
        let key = book.insert("t", 3, &old);
        let new = Mirrors::new([1]);
        assert_eq!(book.insert("t", 3, &new), key, "one key per target while a link to it lives");
        let both = book.get("t", 3, &key).unwrap();
        assert!(both.iter().any(|m| Arc::ptr_eq(m, &old)) && both.iter().any(|m| Arc::ptr_eq(m, &new)));
        let mut forged = key;
        forged[PUSH_KEY_BYTES - 1] ^= 1;
        for bad in [&forged[..], &key[..8], &[][..]] {
            assert!(matches!(book.get("t", 3, bad), Err(Error::Unauthorized { .. })), "{bad:?}");
        }
        // The new link's connect failed: the old one still takes pushes.
        book.remove(&new, false);
        let left = book.get("t", 3, &key).unwrap();
        assert!(left.len() == 1 && Arc::ptr_eq(&left[0], &old));
    }
}
