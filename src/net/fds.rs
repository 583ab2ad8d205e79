//! The file-descriptor budget. Every connection a server holds costs one
//! descriptor; a process at its limit cannot accept, and `accept` failing
//! with `EMFILE` in a loop burns a core. So an engine raises its soft limit
//! to the hard one when it starts, and sizes its servers' connection tables
//! to what is left after a reserve for everything else.

/// Descriptors kept for everything but server connections (regions' files,
/// the application's own, outgoing connections).
pub const FD_RESERVE: u64 = 256;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit; returns the soft
/// limit now in force (unlimited reads as `u64::MAX`).
pub(crate) fn raise_fd_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
        // SAFETY: setrlimit reads one rlimit from the struct we own.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    limit.rlim_cur
}

/// How many connections servers may hold with a soft limit of `limit`
/// descriptors, one descriptor each, after [`FD_RESERVE`].
pub(crate) fn fd_budget(limit: u64) -> usize {
    usize::try_from(limit.saturating_sub(FD_RESERVE)).unwrap_or(usize::MAX).max(16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_is_raised_to_the_hard_one_and_the_budget_keeps_a_reserve() {
        let soft = raise_fd_limit();
        let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: as above.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        assert_eq!(soft, limit.rlim_cur);
        assert_eq!(limit.rlim_cur, limit.rlim_max);
        assert_eq!(fd_budget(1024), 768);
        assert_eq!(fd_budget(100), 16, "a tiny limit still serves a few");
    }
}
