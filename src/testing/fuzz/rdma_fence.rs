//! The rdma fence messages an initiator decodes: a target's connect reply
//! (its fence tables) and its pushed fences.

use crate::proto::{RdmaConnectResponse, RdmaFenceRequest};
use crate::transport::rdma::fences::{decode_pushed, Mirrors};
use prost::Message;
use std::time::Instant;

/// Arbitrary bytes as a connect reply's fence tables, then as a pushed
/// fence (the first byte says where the reply ends, in 8-byte steps): no
/// panic; a table that is installed and a fence that is applied leave
/// every pushed range refusing a grant older than the fence's.
pub fn rdma_fence(data: &[u8]) {
    let Some((&cut, data)) = data.split_first() else { return };
    let (head, rest) = data.split_at(data.len().min(usize::from(cut) * 8));
    let Ok(reply) = RdmaConnectResponse::decode(head) else { return };
    let mirrors = Mirrors::new(reply.fences.iter().map(|t| t.region).chain([1]));
    if mirrors.install(&reply.fences).is_err() {
        return;
    }
    let Ok(request) = RdmaFenceRequest::decode(rest) else { return };
    let Ok(pushed) = decode_pushed(&request.regions) else { return };
    // No lane holds a count: the fence does not wait.
    mirrors.apply(pushed.clone(), request.generation, Instant::now()).expect("nothing to wait for");
    let generation = request.generation;
    if generation == 0 {
        return;
    }
    for (region, spans) in &pushed {
        let Some(table) = mirrors.table(*region) else { continue };
        let view = table.view();
        let Some(pass) = view.enter() else { continue };
        for span in spans.iter().filter(|s| s.len > 0 && s.count > 0 && s.start < u64::MAX) {
            assert!(
                !pass.admits(span.start, span.start + 1, generation - 1),
                "a pushed fence {span:?} at {generation} let an older grant through"
            );
        }
    }
}
