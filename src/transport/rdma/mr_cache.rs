//! Memory registrations of one protection domain: each range is registered
//! once, and registering it again returns the cached keys at the cost of a
//! hash lookup. Dropping the cache deregisters everything it holds.

use super::verbs::{Mr, MrAccess, Pd, Verbs};
use crate::error::Result;
use std::collections::HashMap;
use std::sync::Arc;

/// The registrations of one PD.
#[derive(Debug)]
pub struct MrCache {
    verbs: Arc<dyn Verbs>,
    pd: Pd,
    by_range: HashMap<(u64, u64), (Mr, MrAccess)>,
}

impl MrCache {
    /// An empty cache for `pd`.
    pub fn new(verbs: Arc<dyn Verbs>, pd: Pd) -> Self {
        Self { verbs, pd, by_range: HashMap::new() }
    }

    /// The registration of `addr..addr + len`, made now or earlier.
    ///
    /// # Safety
    ///
    /// As [`Verbs::reg_mr`]: the range stays valid until it is
    /// [`unregister`](Self::unregister)ed or the cache is dropped.
    pub unsafe fn register(&mut self, addr: u64, len: u64, access: MrAccess) -> Result<Mr> {
        if let Some((mr, rights)) = self.by_range.get(&(addr, len)) {
            if *rights == access {
                return Ok(*mr);
            }
            // Another registration of the same range with other rights: the
            // old one goes, so no key grants more than asked for now.
            let _ = self.verbs.dereg_mr(mr.handle);
            self.by_range.remove(&(addr, len));
        }
        // SAFETY: forwarded from our caller.
        let mr = unsafe { self.verbs.reg_mr(self.pd, addr, len, access)? };
        self.by_range.insert((addr, len), (mr, access));
        Ok(mr)
    }

    /// Keeps a registration made outside the cache (device memory, through
    /// a dma-buf or peer memory), to be deregistered with the others; one
    /// already held for the range goes first.
    pub fn keep(&mut self, mr: Mr, access: MrAccess) {
        if let Some((old, _)) = self.by_range.insert((mr.addr, mr.len), (mr, access)) {
            let _ = self.verbs.dereg_mr(old.handle);
        }
    }

    /// The provider and PD this cache registers with.
    pub fn target(&self) -> (&Arc<dyn Verbs>, Pd) {
        (&self.verbs, self.pd)
    }

    /// Deregisters a range; unknown ranges are ignored.
    pub fn unregister(&mut self, addr: u64, len: u64) -> Result<()> {
        match self.by_range.remove(&(addr, len)) {
            Some((mr, _)) => self.verbs.dereg_mr(mr.handle),
            None => Ok(()),
        }
    }

    /// Registrations held.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_range.len()
    }
}

impl Drop for MrCache {
    fn drop(&mut self) {
        for (_, (mr, _)) in self.by_range.drain() {
            let _ = self.verbs.dereg_mr(mr.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rdma::sim::SimVerbs;

    #[test]
    fn the_same_range_is_registered_once_and_everything_is_released() {
        let sim = Arc::new(SimVerbs::new());
        let context = sim.open("sim0").unwrap();
        let pd = sim.alloc_pd(context).unwrap();
        let memory = vec![0u8; 8192];
        let addr = memory.as_ptr() as u64;
        {
            let mut cache = MrCache::new(sim.clone(), pd);
            // SAFETY: `memory` outlives the cache.
            let first = unsafe { cache.register(addr, 4096, MrAccess::ALL) }.unwrap();
            // SAFETY: as above.
            let again = unsafe { cache.register(addr, 4096, MrAccess::ALL) }.unwrap();
            assert_eq!(first, again);
            // SAFETY: as above.
            unsafe { cache.register(addr + 4096, 4096, MrAccess::ALL) }.unwrap();
            assert_eq!((cache.len(), sim.counts().mrs), (2, (2, 0)));
            cache.unregister(addr, 4096).unwrap();
            assert_eq!(sim.counts().mrs, (2, 1));
        }
        sim.dealloc_pd(pd).unwrap();
        sim.close(context).unwrap();
        assert!(sim.counts().balanced(), "{:?}", sim.counts());
    }
}
