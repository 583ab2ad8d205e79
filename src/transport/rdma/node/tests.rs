//! The node over the simulated provider: what happens to accepted QPs'
//! completions and sizes (VERBS-REVIEW findings 4 and 9). The same rules
//! run over the real provider on the fake libibverbs in
//! tests/rdma_ibverbs.rs.

use super::*;
use crate::arrival::Arrivals;
use crate::transport::rdma::sim::SimVerbs;

fn initiator() -> Initiator {
    Initiator { name: "prefill".into(), epoch: 7, addr: String::new() }
}

/// A target node that accepted one QP of an initiator node, with a region
/// each (`target`'s granting remote write), and the initiator's QP in RTS.
struct Pair {
    sim: Arc<SimVerbs>,
    target: Arc<RdmaNode>,
    source: RdmaNode,
    qp: (Qp, Cq),
    memory: (Vec<u8>, Vec<u8>),
}

fn pair() -> Pair {
    let sim = Arc::new(SimVerbs::new());
    let target = Arc::new(RdmaNode::open(sim.clone(), &[], 8, None).unwrap());
    let source = RdmaNode::open(sim.clone(), &[], 8, None).unwrap();
    let memory = (vec![7u8; 4096], vec![0u8; 4096]);
    // SAFETY: both vectors outlive the nodes' registrations (the test's Pair owns them).
    unsafe {
        source.register_region(RegionId::from_raw(1), memory.0.as_ptr() as u64, 4096, Access::ALL).unwrap();
        target.register_region(RegionId::from_raw(2), memory.1.as_ptr() as u64, 4096, Access::ALL).unwrap();
    }
    let (qp, cq, endpoint) = source.take_qp(0, 64).unwrap();
    let remote = target.accept(&initiator(), 1, &[endpoint], Some(vec![7; 16])).unwrap();
    source.connect_qp(qp, remote[0]).unwrap();
    Pair { sim, target, source, qp: (qp, cq), memory }
}

impl Pair {
    /// One WRITE_WITH_IMM of `len` bytes under `tag`, its send completion polled.
    fn write_imm(&self, tag: u32, len: u32) {
        let lkey = self.source.with_lkeys(|keys| keys.lkey(1, 0)).unwrap();
        let info = self.target.info();
        let (_, addr, rkeys) = info.regions.iter().find(|(id, ..)| id.raw() == 2).unwrap();
        let wr = SendWr {
            wr_id: 1,
            op: WrOp::WriteImm(tag),
            local_addr: self.memory.0.as_ptr() as u64,
            len,
            lkey,
            remote_addr: *addr,
            rkey: rkeys[0],
            signaled: true,
            inline: false,
        };
        self.sim.post_send(self.qp.0, &[wr]).unwrap();
        let mut wcs = [Wc::new(0, WcStatus::Success); 4];
        let polled = (0..1000).map(|_| self.sim.poll_cq(self.qp.1, &mut wcs).unwrap()).find(|&n| n > 0);
        assert_eq!(polled.map(|_| wcs[0].status), Some(WcStatus::Success));
    }

    fn accepted_qp(&self) -> Qp {
        let accepted = self.target.accepted.lock().unwrap();
        accepted.by_initiator.values().next().unwrap().qps[0].1.qp
    }

    fn srq(&self) -> Srq {
        self.target.nics[0].receives.unwrap().0
    }
}

#[test]
fn a_released_accepted_qp_loses_no_arrival_and_no_receive() {
    let pair = pair();
    let arrivals = Arc::new(Arrivals::new());
    let _receiver = pair.target.receiver(arrivals.clone());
    pair.write_imm(42, 16);
    assert_eq!(pair.sim.srq_receives(pair.srq()), Some(SRQ_DEPTH as usize - 1), "one receive consumed");
    // The initiator goes away (or reconnects) before the receiving lane
    // polled: its QP is released with the completion still on the CQ.
    assert_eq!(pair.target.release_initiator(&initiator()), 1);
    assert_eq!(arrivals.landed(42), 16, "the bytes that landed are counted, not dropped with the CQE");
    assert_eq!(pair.sim.srq_receives(pair.srq()), Some(SRQ_DEPTH as usize), "the consumed receive is posted again");
}

#[test]
fn accepted_qps_are_created_with_the_smallest_send_queue() {
    let pair = pair();
    let caps = pair.sim.qp_caps(pair.accepted_qp()).unwrap();
    assert_eq!((caps.max_send_wr, caps.max_inline), (1, 0), "an accepted QP never sends");
    assert!(caps.srq.is_some());
    let own = pair.sim.qp_caps(pair.qp.0).unwrap();
    assert_eq!((own.max_send_wr, own.max_inline), (QP_DEPTH, MAX_INLINE));
}
