//! Registered memory is locked memory: every registration pins its pages
//! and is charged to RLIMIT_MEMLOCK, once per NIC it is registered with
//! (Documentation/libibverbs.md, "Permissions": the process must be allowed
//! to lock memory for all registered MRs). A registration past the limit
//! fails inside `ibv_reg_mr` with a bare ENOMEM; the node checks first and
//! names the limit (VERBS-REVIEW finding 8).

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};

/// What the node has pinned, against what it may pin.
#[derive(Debug)]
pub(super) struct Memlock {
    /// The soft RLIMIT_MEMLOCK in bytes; `None` when unlimited or when the
    /// process may lock without limit (CAP_IPC_LOCK, as root has).
    pub limit_bytes: Option<u64>,
    /// Bytes charged by the node's registrations (each × its NICs).
    pub charged_bytes: AtomicU64,
}

impl Memlock {
    /// This process's limit.
    pub fn of_process() -> Self {
        Self { limit_bytes: limit_bytes(), charged_bytes: AtomicU64::new(0) }
    }

    /// Charges `len` bytes registered on `nics` NICs, or refuses with the
    /// limit and what to do when that would pass it.
    pub fn charge(&self, len: u64, nics: usize) -> Result<()> {
        let charge = len.saturating_mul(nics as u64);
        let Some(limit) = self.limit_bytes else {
            self.charged_bytes.fetch_add(charge, Ordering::Relaxed);
            return Ok(());
        };
        let mut charged = self.charged_bytes.load(Ordering::Relaxed);
        loop {
            let total = charged.saturating_add(charge);
            if total > limit {
                return Err(Error::Device {
                    device: "rdma".into(),
                    reason: format!(
                        "registering {len} bytes on {nics} NIC(s) locks {charge} bytes, {charged} bytes already locked: \
                         past RLIMIT_MEMLOCK ({limit} bytes); raise `ulimit -l` (a container's memlock limit), \
                         or register less"
                    ),
                });
            }
            match self.charged_bytes.compare_exchange_weak(charged, total, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(now) => charged = now,
            }
        }
    }

    /// Gives back a charge of `len` bytes on `nics` NICs.
    pub fn release(&self, len: u64, nics: usize) {
        let charge = len.saturating_mul(nics as u64);
        let _ =
            self.charged_bytes.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| Some(c.saturating_sub(charge)));
    }
}

/// The soft RLIMIT_MEMLOCK, `None` when it does not bind: unlimited, or
/// the process holds CAP_IPC_LOCK (capabilities(7): "lock memory" beyond
/// RLIMIT_MEMLOCK).
fn limit_bytes() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    if rc != 0 || limit.rlim_cur == libc::RLIM_INFINITY || has_ipc_lock() {
        return None;
    }
    Some(limit.rlim_cur)
}

/// Whether CAP_IPC_LOCK (bit 14) is in the effective set.
fn has_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?.trim().to_string();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registration_past_the_limit_names_it_and_ulimit() {
        let memlock = Memlock { limit_bytes: Some(10 << 20), charged_bytes: AtomicU64::new(0) };
        memlock.charge(2 << 20, 2).unwrap();
        let error = memlock.charge(4 << 20, 2).unwrap_err().to_string();
        assert!(error.contains("RLIMIT_MEMLOCK (10485760 bytes)") && error.contains("ulimit -l"), "{error}");
        assert!(error.contains("4194304 bytes already locked"), "{error}");
        memlock.release(2 << 20, 2);
        memlock.charge(4 << 20, 2).unwrap();
        let unlimited = Memlock { limit_bytes: None, charged_bytes: AtomicU64::new(0) };
        unlimited.charge(u64::MAX / 2, 8).unwrap();
    }
}
