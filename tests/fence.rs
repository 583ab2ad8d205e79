//! Fenced destinations (`Engine::fence`, `Batch::grant`) over each
//! transport that has them: (a) a fence while a stale push is in flight
//! (the slot freed and reused): the new owner's bytes are never
//! overwritten once `fence` returned; (b) a stale sender after an abort:
//! a push naming an old grant gets `Fenced` and nothing of it lands.

mod common;

use common::{engine, fenced, pattern, WAIT};
use kvring::{Batch, BlockDesc, Engine, Error, Outcome, Region, RegionId, RegionInfo, Segment, TransportKind};

const MIB: usize = 1 << 20;
const BLOCK: u64 = 64 * 1024;

/// A target and an initiator, the target's destination (2 MiB: the first
/// one is fenced) in shm-backed memory or in the caller's own.
struct Setup {
    initiator: Engine,
    local: Region,
    segment: Segment,
    shm: Option<Region>,
    target: Engine,
    remote: RegionId,
    /// The caller memory the target registered (dropped after the engines).
    memory: Vec<u8>,
}

impl Setup {
    fn new(transport: TransportKind, caller_memory: bool) -> Self {
        let target = engine("target");
        let mut memory = Vec::new();
        let (shm, remote) = if caller_memory {
            memory = vec![0u8; 2 * MIB];
            // SAFETY: `memory` outlives both engines (dropped after them) and
            // is touched here only through raw pointers.
            let id = unsafe { target.register(memory.as_mut_ptr(), 2 * MIB, RegionInfo::raw()) }.unwrap();
            (None, id)
        } else {
            let region = target.alloc_region(2 * MIB, RegionInfo::raw()).unwrap();
            let id = region.id();
            (Some(region), id)
        };
        let initiator = engine("initiator");
        let local = initiator.alloc_region(MIB, RegionInfo::raw()).unwrap();
        let segment = initiator.open_segment_with(&target.control_addr().to_string(), Some(transport), WAIT).unwrap();
        assert_eq!(segment.transport(), transport);
        Self { initiator, local, segment, shm, target, remote, memory }
    }

    /// The target's bytes at `[offset, offset + len)`.
    fn read(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        match &self.shm {
            // SAFETY: no write naming these bytes is in flight (waited for, or fenced out).
            Some(region) => unsafe { region.read_at(offset as u64, &mut out).unwrap() },
            // SAFETY: as above; the range lies in `memory`.
            None => unsafe { std::ptr::copy_nonoverlapping(self.memory.as_ptr().add(offset), out.as_mut_ptr(), len) },
        }
        out
    }

    /// The new owner writes its bytes over the fenced MiB.
    fn own(&self, byte: u8) {
        match &self.shm {
            // SAFETY: fenced: no write under an older grant is in the range.
            Some(region) => unsafe { region.write_at(0, &vec![byte; MIB]).unwrap() },
            // SAFETY: as above; the range lies in `memory`, written through
            // its pointer only.
            None => unsafe { std::ptr::write_bytes(self.memory.as_ptr().cast_mut(), byte, MIB) },
        }
    }

    /// Blocks of the initiator's region onto the fenced MiB, `rounds` times.
    fn descs(&self, rounds: u64) -> Vec<BlockDesc> {
        let remote = self.segment.region(0).unwrap();
        let per_round = MIB as u64 / BLOCK;
        (0..rounds * per_round)
            .map(|i| BlockDesc::new(self.local.id(), (i % per_round) * BLOCK, remote, (i % per_round) * BLOCK, BLOCK))
            .collect()
    }

    fn push(&self, descs: &[BlockDesc], grant: Option<u32>) -> Outcome {
        common::push_granted(&self.initiator, &self.segment, descs, grant)
    }
}

/// (b) on one transport.
fn stale_grant_is_fenced(transport: TransportKind, caller_memory: bool) {
    let s = Setup::new(transport, caller_memory);
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 1)).unwrap() };
    let blocks = s.descs(1);
    let old = s.target.fence(s.remote, 0, MIB as u64).unwrap();
    s.push(&blocks, Some(old)).into_result().unwrap();
    assert_eq!(s.read(0, MIB), pattern(MIB, 1));

    // The request is aborted; its blocks go to another one.
    let new = s.target.fence(s.remote, 0, MIB as u64).unwrap();
    assert!(new > old);
    s.own(0xEE);
    let outcome = s.push(&blocks, Some(old));
    assert!(fenced(&outcome), "{transport:?}: a stale grant's push must fail Fenced, got {outcome:?}");
    let outcome = s.push(&blocks, None);
    assert!(fenced(&outcome), "{transport:?}: no grant, into a fenced range: {outcome:?}");
    assert_eq!(s.read(0, MIB), vec![0xEE; MIB], "{transport:?}: nothing of a refused push landed");

    // Past the fenced range nothing is fenced: no grant is needed there.
    let remote = s.segment.region(0).unwrap();
    let beyond: Vec<_> =
        (0..4).map(|i| BlockDesc::new(s.local.id(), i * BLOCK, remote, MIB as u64 + i * BLOCK, BLOCK)).collect();
    s.push(&beyond, None).into_result().unwrap();

    s.push(&blocks, Some(new)).into_result().unwrap();
    assert_eq!(s.read(0, MIB), pattern(MIB, 1), "{transport:?}: the current grant lands");
}

/// (a) on one transport.
fn fence_during_a_stale_push(transport: TransportKind, caller_memory: bool) {
    let s = Setup::new(transport, caller_memory);
    // SAFETY: no batch touches these bytes yet.
    unsafe { s.local.write_at(0, &pattern(MIB, 3)).unwrap() };
    // 256 MiB of copies into the same MiB: in flight for a while.
    let blocks = s.descs(256);
    let mut sub = s.initiator.submitter().unwrap();
    let mut refused = 0;
    for round in 0..4u8 {
        let old = s.target.fence(s.remote, 0, MIB as u64).unwrap();
        let id = sub.submit(&Batch::write(&s.segment).descs(&blocks).grant(old)).unwrap();
        // Let the push get going (it takes far longer than this), so the
        // fence meets it mid-copy rather than before its first chunk.
        std::thread::sleep(std::time::Duration::from_millis(2));
        s.target.fence(s.remote, 0, MIB as u64).unwrap();
        // The property under test: `fence` returned, so no write under
        // `old` is in the range and none starts.
        s.own(0xE0 | round);
        let outcome = sub.wait(id, WAIT).unwrap();
        refused += usize::from(fenced(&outcome));
        assert_eq!(
            s.read(0, MIB),
            vec![0xE0 | round; MIB],
            "{transport:?} round {round}: a stale byte landed after fence"
        );
    }
    assert!(refused > 0, "{transport:?}: no fence met a push in flight");
}

#[test]
fn shm_a_push_under_a_stale_grant_is_fenced_and_nothing_lands() {
    stale_grant_is_fenced(TransportKind::Shm, false);
}

#[test]
fn shm_a_fence_during_a_stale_push_keeps_the_new_owners_bytes() {
    fence_during_a_stale_push(TransportKind::Shm, false);
}

#[test]
fn tcp_a_push_under_a_stale_grant_is_fenced_and_nothing_lands() {
    stale_grant_is_fenced(TransportKind::Tcp, true);
    stale_grant_is_fenced(TransportKind::Tcp, false);
}

#[test]
fn tcp_a_fence_during_a_stale_push_keeps_the_new_owners_bytes() {
    fence_during_a_stale_push(TransportKind::Tcp, true);
}

#[test]
fn cma_a_push_under_a_stale_grant_is_fenced_and_nothing_lands() {
    stale_grant_is_fenced(TransportKind::Cma, true);
}

#[test]
fn cma_a_fence_during_a_stale_push_keeps_the_new_owners_bytes() {
    fence_during_a_stale_push(TransportKind::Cma, true);
}

/// Bad fences are refused with a typed error, never a panic.
#[test]
fn fences_out_of_bounds_of_nothing_or_of_unknown_regions_are_refused() {
    let target = engine("target");
    let region = target.alloc_region(MIB, RegionInfo::raw()).unwrap();
    assert!(matches!(target.fence(region.id(), MIB as u64, 1), Err(Error::OutOfBounds { .. })));
    assert!(matches!(target.fence(region.id(), 1, u64::MAX), Err(Error::LengthOverflow { .. })));
    assert!(matches!(target.fence(region.id(), 0, 0), Err(Error::InvalidArgument { .. })));
    assert!(matches!(target.fence(RegionId::from_raw(0x00ff_00ff), 0, 1), Err(Error::UnknownRegion { .. })));
}

/// The KV layer carries the grant with the block table: decode fences a
/// request's blocks in every layer and kind under one grant
/// (`fence_blocks`), prefill pushes them naming it (`push_blocks_granted`,
/// `push_layer_granted`); after the blocks are fenced again for another
/// request, the old grant's push fails `Fenced` and the blocks keep the new
/// owner's bytes, while other requests' grants are untouched (a request's
/// blocks in every layer take one entry of the table, so many requests fit).
#[test]
fn kv_blocks_fenced_per_request_refuse_a_stale_push_in_every_layer() {
    use kvring::kv::{CacheShape, KvLayout};
    let shape = CacheShape::mha(4, 64, 8, 128, 2, 4, 2).unwrap();
    for transport in [TransportKind::Shm, TransportKind::Tcp] {
        let (prefill, decode) = (engine("prefill-kv"), engine("decode-kv"));
        let bytes = shape.bytes().unwrap() as usize;
        let p_region = prefill.alloc_region(bytes, RegionInfo::raw()).unwrap();
        // SAFETY: nothing touches these bytes yet.
        unsafe { p_region.fill_pattern(1) };
        let p_layout = KvLayout::contiguous(shape, p_region.id(), 0).unwrap();
        prefill.set_kv_layout(p_layout.clone()).unwrap();
        let d_region = decode.alloc_region(bytes, RegionInfo::raw()).unwrap();
        decode.set_kv_layout(KvLayout::contiguous(shape, d_region.id(), 0).unwrap()).unwrap();
        let segment = prefill.open_segment_with(&decode.control_addr().to_string(), Some(transport), WAIT).unwrap();
        let remote = segment.kv_layout(WAIT).unwrap();
        let mut sub = prefill.submitter().unwrap();

        // Many requests of two blocks each, every one granted and pushed.
        let grants: Vec<u32> = (0..32u64).map(|r| decode.fence_blocks(&[2 * r, 2 * r + 1]).unwrap()).collect();
        for (r, &grant) in grants.iter().enumerate() {
            let ids = [2 * r as u64, 2 * r as u64 + 1];
            let id = sub.push_blocks_granted(&segment, &p_layout, &remote, &ids, &ids, grant).unwrap();
            sub.wait(id, WAIT).unwrap().into_result().unwrap_or_else(|e| panic!("{transport:?} request {r}: {e}"));
        }
        // Request 0 is aborted; its blocks go to another request.
        let fresh = decode.fence_blocks(&[0, 1]).unwrap();
        let before = read_all(&d_region, bytes);
        let id = sub.push_blocks_granted(&segment, &p_layout, &remote, &[40, 41], &[0, 1], grants[0]).unwrap();
        assert!(fenced(&sub.wait(id, WAIT).unwrap()), "{transport:?}: the old grant's push");
        for layer in 0..shape.layers {
            let id =
                sub.push_layer_granted(&segment, &p_layout, &remote, layer, &[40, 41], &[0, 1], grants[0]).unwrap();
            assert!(fenced(&sub.wait(id, WAIT).unwrap()), "{transport:?}: layer {layer} under the old grant");
        }
        assert!(read_all(&d_region, bytes) == before, "{transport:?}: a stale byte landed");
        // Every other request's grant still lands (none was folded into
        // the region-wide floor); so does the new one.
        for (r, &grant) in grants.iter().enumerate().skip(1) {
            let ids = [2 * r as u64, 2 * r as u64 + 1];
            let id = sub.push_blocks_granted(&segment, &p_layout, &remote, &ids, &ids, grant).unwrap();
            sub.wait(id, WAIT)
                .unwrap()
                .into_result()
                .unwrap_or_else(|e| panic!("{transport:?} request {r} again: {e}"));
        }
        let id = sub.push_blocks_granted(&segment, &p_layout, &remote, &[40, 41], &[0, 1], fresh).unwrap();
        sub.wait(id, WAIT).unwrap().into_result().unwrap();
    }
}

fn read_all(region: &Region, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: no write naming these bytes is in flight (waited for, or fenced out).
    unsafe { region.read_at(0, &mut out).unwrap() };
    out
}
