//! What the check before every call costs, measured on its own against the
//! call it guards (`benches/cma_check.rs`): the liveness word (`live`), the
//! remote head read it replaced (`live_by_head_read`), and no check, each
//! around the same `process_vm_writev` into a region of this very process
//! (a pid may attach to itself), interleaved round by round.

use super::page::{CmaExport, CmaPeer};
use super::sys::{vm_copy, IoVec};
use crate::desc::RegionId;
use crate::mem::{Access, MemoryKind, RegionKind};
use crate::ring::Opcode;
use crate::segment::{local_host_id, RemoteRegion, SegmentDescriptor};
use std::time::{Duration, Instant};

/// Median time of one call (one chunk) of `block` bytes, by check.
#[derive(Debug, Clone, Copy)]
pub struct CheckCost {
    /// The call alone.
    pub none: Duration,
    /// The liveness word's check, then the call.
    pub word: Duration,
    /// The remote head read's check, then the call.
    pub head_read: Duration,
}

/// Measures `rounds` rounds of `calls` calls of `block` bytes per check,
/// interleaved (one round of each in turn).
pub fn check_cost(block: usize, calls: usize, rounds: usize) -> CheckCost {
    let epoch = u64::from_le_bytes(crate::auth::random_bytes()) | 1;
    let export = CmaExport::create(epoch, 4).expect("a cma page");
    let mut target = vec![0u8; block];
    let source = vec![7u8; block];
    let id = RegionId::new(1, 1);
    export.publish(id, target.as_mut_ptr() as usize, block, Access::ALL);
    let descriptor = SegmentDescriptor {
        name: "self".into(),
        epoch,
        host_id: local_host_id().to_string(),
        pid: std::process::id(),
        instance: 0,
        gpu_fds: None,
        regions: vec![RemoteRegion {
            id,
            kind: RegionKind::Raw,
            len: block as u64,
            access: Access::ALL,
            layer: 0,
            block_bytes: 0,
            shm_path: None,
            addr: target.as_ptr() as u64,
            memory: MemoryKind::Host,
            gpu_export: Ok(Vec::new()),
        }],
        control_addr: String::new(),
        tcp_addr: None,
        rdma: None,
        cma: Some(export.reach()),
    };
    let peer = CmaPeer::open(&descriptor).expect("the page opens");
    let local = [IoVec { base: source.as_ptr() as usize, len: block }];
    let remote = [IoVec { base: target.as_mut_ptr() as usize, len: block }];
    let call = || {
        // SAFETY: both ranges are this function's own buffers, alive and
        // untouched by anything else during the call.
        let moved = unsafe { vm_copy(Opcode::Write, std::process::id(), &local, &remote) };
        assert_eq!(moved.expect("self-attach"), block);
    };
    let round = |check: u8| {
        let started = Instant::now();
        for _ in 0..calls {
            let entered = peer.enter(&[1]);
            let live = match check {
                0 => true,
                1 => peer.live(&entered),
                _ => peer.live_by_head_read(&entered),
            };
            assert!(live && peer.listed(&entered, 1));
            call();
        }
        started.elapsed() / calls as u32
    };
    let mut samples = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..rounds.max(1) {
        for (check, times) in samples.iter_mut().enumerate() {
            times.push(round(check as u8));
        }
    }
    let [none, word, head_read] = samples.map(|mut times| {
        times.sort();
        times[times.len() / 2]
    });
    drop(peer);
    export.close();
    CheckCost { none, word, head_read }
}
