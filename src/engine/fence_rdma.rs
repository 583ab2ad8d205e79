//! Fenced destinations over rdma, the target's side: a fence is pushed to
//! every initiator that holds QPs on this engine (it may write its memory),
//! all at once, and `fence` returns once each answered that its writes
//! before the fence are done, or, past the deadline, once the QPs of one
//! that did not answer were moved to the error state, after which none of
//! its writes is placed (docs/ARCHITECTURE.md, "Fenced destinations over
//! rdma"). Fencing a range no write is in costs one round trip to each
//! writer, in parallel.

use super::Engine;
use crate::control::ControlClient;
use crate::mem::fence::Span;
use crate::transport::rdma::fences::encode_pushed;
use std::time::Instant;

/// Pushes fence `grant` of `pushed` (per region, raw id, its spans) to the
/// rdma writers; cuts off, before it returns, each that did not answer by
/// `deadline`. Nothing is sent when no initiator holds QPs here.
pub(super) fn push(engine: &Engine, grant: u32, pushed: &[(u64, Vec<Span>)], deadline: Instant) {
    let Some(node) = engine.inner.context.rdma.as_ref() else { return };
    let writers = node.writers();
    if writers.is_empty() {
        return;
    }
    // The initiator's own wait ends first, so its answer (busy or done)
    // comes back before ours does.
    let left = deadline.saturating_duration_since(Instant::now());
    let request = crate::proto::RdmaFenceRequest {
        generation: grant,
        regions: encode_pushed(pushed),
        wait_ms: u32::try_from((left * 3 / 4).as_millis()).unwrap_or(u32::MAX),
    };
    let me = engine.initiator();
    let token = engine.inner.config.token.as_ref();
    let answers: Vec<crate::error::Result<()>> = std::thread::scope(|scope| {
        let asks: Vec<_> = writers
            .iter()
            .map(|(writer, checks_fences)| {
                let (request, me) = (request.clone(), &me);
                scope.spawn(move || {
                    if !checks_fences {
                        return Err(crate::Error::Unsupported {
                            what: format!("{} does not check fences over rdma", writer.name),
                        });
                    }
                    let mut client = ControlClient::connect(&writer.addr, deadline)?;
                    client.handshake(me, token, deadline)?;
                    client.rdma_fence(request, deadline)
                })
            })
            .collect();
        asks.into_iter()
            .map(|ask| {
                ask.join().unwrap_or_else(|_| Err(crate::Error::invalid("rdma fence", "the push's thread panicked")))
            })
            .collect()
    });
    for ((writer, _), answer) in writers.iter().zip(answers) {
        if let Err(error) = answer {
            // ibv_modify_qp to ERR first (`release_initiator`): none of its
            // writes is placed after; it reconnects, with a new snapshot.
            tracing::warn!(initiator = %writer.name, %error, "an rdma writer did not confirm a fence: its QPs are cut off");
            node.release_initiator(writer);
        }
    }
}
