//! Turning a chunk of validated blocks into work requests, per NIC.
//!
//! Adjacent blocks (contiguous on both sides, same regions) are coalesced
//! into one request; requests larger than `slice_bytes` are cut into slices,
//! and slices and requests are striped round-robin over the lane's NICs
//! (over those nearest its GPU, for a block of device memory).
//! Writes of at most `max_inline` bytes go inline. Signalling is selective:
//! every `signal_every`-th request of a NIC asks for a completion, and so
//! does each NIC's last one, so the chunk's end is always seen. Nothing here
//! allocates once the output vectors are warm.

use super::verbs::{SendWr, WrOp};

/// How requests are shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostConfig {
    /// Requests larger than this are sliced (and the slices striped).
    pub slice_bytes: u64,
    /// Writes up to this many bytes are sent inline.
    pub max_inline: u32,
    /// Every this-many requests per NIC is signalled (and the last).
    pub signal_every: u32,
}

impl Default for PostConfig {
    fn default() -> Self {
        Self { slice_bytes: 1 << 20, max_inline: 64, signal_every: 16 }
    }
}

/// One block as the NICs see it: addresses and the regions whose keys to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyedBlock {
    /// Local address.
    pub local_addr: u64,
    /// Remote address.
    pub remote_addr: u64,
    /// Bytes.
    pub len: u64,
    /// Index of the local region in the lkey table.
    pub local_region: u64,
    /// Index of the remote region in the rkey table.
    pub remote_region: u64,
}

/// Keys per NIC: `lkey(nic, local_region)` and `rkey(nic, remote_region)`.
pub trait Keys {
    /// The local key of `region` on NIC `nic`.
    fn lkey(&self, nic: usize, region: u64) -> u32;
    /// The peer's key of `region` on NIC `nic`.
    fn rkey(&self, nic: usize, region: u64) -> u32;
    /// The NICs that blocks of local region `region` go over (bit n: NIC
    /// n; the NICs nearest a GPU for its memory); 0, or no NIC of the
    /// lane's, means any.
    fn nics(&self, _region: u64) -> u32 {
        0
    }
    /// Whether local region `region` is host memory the CPU may read: only
    /// then may a small write go inline, since inline data is copied by the
    /// CPU inside `ibv_post_send` (ibv_post_send(3) IBV_SEND_INLINE; mlx5
    /// `set_data_inl_seg`), and a device address there faults or reads
    /// garbage (review finding 2). Unknown: not host.
    fn host_memory(&self, _region: u64) -> bool {
        false
    }
}

/// The first NIC from `from` on (round robin over `nics`) that `mask`
/// allows; any NIC when it allows none of them.
fn pick(from: usize, nics: usize, mask: u32) -> usize {
    if mask == 0 {
        // Any NIC (host memory): the round robin as it stands, no search.
        return from % nics;
    }
    let usable = if nics >= 32 { mask } else { mask & ((1u32 << nics) - 1) };
    (0..nics).map(|i| (from + i) % nics).find(|&n| usable & (1 << n) != 0).unwrap_or(from % nics)
}

/// Builds the requests of `blocks` into `out[nic]` (cleared first);
/// `wr_id(seq)` names each request. Returns the number of requests.
pub fn build(
    op: WrOp,
    blocks: &[KeyedBlock],
    config: &PostConfig,
    keys: &impl Keys,
    wr_id: impl Fn(u64) -> u64,
    out: &mut [Vec<SendWr>],
) -> usize {
    let nics = out.len();
    if nics == 0 {
        return 0;
    }
    for list in out.iter_mut() {
        list.clear();
    }
    let slice = config.slice_bytes.max(1);
    let mut seq = 0u64;
    let mut nic = 0usize;
    let mut emit = |local_addr: u64, remote_addr: u64, len: u64, local_region: u64, remote_region: u64| {
        let mask = keys.nics(local_region);
        if mask != 0 {
            nic = pick(nic, nics, mask);
        }
        let list = &mut out[nic];
        let count = list.len() as u32 + 1;
        list.push(SendWr {
            wr_id: wr_id(seq),
            op,
            local_addr,
            len: len as u32,
            lkey: keys.lkey(nic, local_region),
            remote_addr,
            rkey: keys.rkey(nic, remote_region),
            signaled: count.is_multiple_of(config.signal_every.max(1)),
            inline: op.writes() && len <= u64::from(config.max_inline) && keys.host_memory(local_region),
        });
        seq += 1;
        nic = (nic + 1) % nics;
    };
    let mut pending: Option<KeyedBlock> = None;
    let flush = |run: KeyedBlock, emit: &mut dyn FnMut(u64, u64, u64, u64, u64)| {
        let mut done = 0;
        while done < run.len {
            let len = (run.len - done).min(slice);
            emit(run.local_addr + done, run.remote_addr + done, len, run.local_region, run.remote_region);
            done += len;
        }
    };
    for block in blocks {
        match &mut pending {
            Some(run)
                if run.local_region == block.local_region
                    && run.remote_region == block.remote_region
                    && run.local_addr + run.len == block.local_addr
                    && run.remote_addr + run.len == block.remote_addr =>
            {
                run.len += block.len;
            }
            _ => {
                if let Some(run) = pending.take() {
                    flush(run, &mut emit);
                }
                pending = Some(*block);
            }
        }
    }
    if let Some(run) = pending {
        flush(run, &mut emit);
    }
    // Each NIC's last request is signalled: its completion frees the send
    // queue and says the NIC's share of the chunk has ended.
    for list in out.iter_mut() {
        if let Some(last) = list.last_mut() {
            last.signaled = true;
        }
    }
    seq as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TestKeys;

    impl Keys for TestKeys {
        fn lkey(&self, nic: usize, region: u64) -> u32 {
            0x100 * (nic as u32 + 1) + region as u32
        }
        fn rkey(&self, nic: usize, region: u64) -> u32 {
            0x1000 * (nic as u32 + 1) + region as u32
        }
        fn host_memory(&self, region: u64) -> bool {
            region != DEVICE_REGION
        }
    }

    /// The local region the tests treat as device memory.
    const DEVICE_REGION: u64 = 9;

    fn block(local: u64, remote: u64, len: u64, regions: (u64, u64)) -> KeyedBlock {
        KeyedBlock { local_addr: local, remote_addr: remote, len, local_region: regions.0, remote_region: regions.1 }
    }

    #[test]
    fn adjacent_blocks_coalesce_and_others_do_not() {
        let blocks = [
            block(0, 1000, 100, (1, 2)),
            block(100, 1100, 100, (1, 2)), // adjacent both sides: joins
            block(300, 1200, 100, (1, 2)), // gap on the local side
            block(400, 1300, 100, (3, 2)), // adjacent, other local region
        ];
        let mut out = vec![Vec::new()];
        let count = build(WrOp::Write, &blocks, &PostConfig::default(), &TestKeys, |s| s, &mut out);
        assert_eq!(count, 3);
        let lens: Vec<_> = out[0].iter().map(|w| (w.local_addr, w.len, w.lkey)).collect();
        assert_eq!(lens, [(0, 200, 0x101), (300, 100, 0x101), (400, 100, 0x103)]);
        assert!(out[0].iter().all(|w| w.rkey == 0x1002));
    }

    #[test]
    fn large_blocks_are_sliced_and_striped_over_nics_with_their_own_keys() {
        let config = PostConfig { slice_bytes: 1 << 20, ..PostConfig::default() };
        let mut out = vec![Vec::new(), Vec::new()];
        let count = build(WrOp::Read, &[block(0, 0, 5 << 19, (1, 1))], &config, &TestKeys, |s| 7 << 32 | s, &mut out);
        assert_eq!(count, 3, "2.5 MiB in 1 MiB slices");
        assert_eq!(
            out[0].iter().map(|w| (w.local_addr, w.len)).collect::<Vec<_>>(),
            [(0, 1 << 20), (2 << 20, 1 << 19)]
        );
        assert_eq!(out[1].iter().map(|w| (w.local_addr, w.len)).collect::<Vec<_>>(), [(1 << 20, 1 << 20)]);
        assert!(out[0].iter().all(|w| w.lkey == 0x101 && w.rkey == 0x1001));
        assert!(out[1].iter().all(|w| w.lkey == 0x201 && w.rkey == 0x2001));
        assert_eq!(out[1][0].wr_id, 7 << 32 | 1);
        assert!(out.iter().flatten().all(|w| !w.inline), "reads are never inline");
    }

    struct NearKeys;

    impl Keys for NearKeys {
        fn lkey(&self, nic: usize, region: u64) -> u32 {
            TestKeys.lkey(nic, region)
        }
        fn rkey(&self, nic: usize, region: u64) -> u32 {
            TestKeys.rkey(nic, region)
        }
        fn nics(&self, region: u64) -> u32 {
            match region {
                1 => 0b100, // GPU memory nearest NIC 2
                2 => 0b011, // nearest NICs 0 and 1
                _ => 0,
            }
        }
    }

    #[test]
    fn blocks_of_device_memory_go_over_the_nics_nearest_their_gpu() {
        let config = PostConfig { slice_bytes: 1 << 20, ..PostConfig::default() };
        let mut out = vec![Vec::new(), Vec::new(), Vec::new()];
        let blocks = [block(0, 0, 3 << 20, (1, 1)), block(8 << 20, 8 << 20, 4 << 20, (2, 1))];
        build(WrOp::WriteImm(7), &blocks, &config, &NearKeys, |s| s, &mut out);
        assert_eq!(out[2].len(), 3, "every slice of region 1 over NIC 2");
        assert!(out[2].iter().all(|w| w.lkey == 0x301 && w.op == WrOp::WriteImm(7)));
        assert_eq!((out[0].len(), out[1].len()), (2, 2), "region 2 striped over NICs 0 and 1 only");
        // A mask naming no NIC of the lane's: any NIC.
        let mut two = vec![Vec::new(), Vec::new()];
        build(WrOp::Write, &blocks[..1], &config, &NearKeys, |s| s, &mut two);
        assert_eq!((two[0].len(), two[1].len()), (2, 1));
        assert_eq!(pick(1, 3, 0), 1);
        assert_eq!(pick(0, 3, 0b110), 1);
        assert_eq!(pick(2, 3, 0b001), 0);
    }

    #[test]
    fn signalling_is_selective_and_the_last_is_always_signalled_small_writes_inline() {
        let config = PostConfig { signal_every: 4, max_inline: 64, ..PostConfig::default() };
        let blocks: Vec<_> = (0..10).map(|i| block(i * 128, i * 128 + 64, 64, (1, 1))).collect();
        let mut out = vec![Vec::new()];
        build(WrOp::Write, &blocks, &config, &TestKeys, |s| s, &mut out);
        let signalled: Vec<_> = out[0].iter().enumerate().filter(|(_, w)| w.signaled).map(|(i, _)| i).collect();
        assert_eq!(signalled, [3, 7, 9]);
        assert!(out[0].iter().all(|w| w.inline));
        let mut out = vec![Vec::new()];
        build(WrOp::Write, &[block(0, 0, 65, (1, 1))], &config, &TestKeys, |s| s, &mut out);
        assert!(!out[0][0].inline, "65 bytes is past the inline limit");
        let device = [block(0, 0, 64, (DEVICE_REGION, 0))];
        build(WrOp::Write, &device, &config, &TestKeys, |s| s, &mut out);
        assert!(!out[0][0].inline, "device memory is never posted inline, however small");
    }
}
