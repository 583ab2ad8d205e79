//! Fenced destinations over rdma, the target's side: a fence is pushed to
//! every initiator that holds QPs on this engine (it may write its memory),
//! all at once, and `fence` returns once each answered that its writes
//! before the fence are done, or, past the deadline, once the QPs of one
//! that did not answer were moved to the error state, after which none of
//! its writes is placed (docs/ARCHITECTURE.md, "Fenced destinations over
//! rdma"). Fencing a range no write is in costs one round trip to each
//! writer, in parallel, over the connection made when it connected
//! (`fence_pushers.rs`).

use super::fence_pushers::FencePushers;
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
        // Each writer's own, below.
        push_key: Vec::new(),
    };
    let me = engine.initiator();
    let pushers = &engine.inner.context.fence_pushers;
    // Writers that left: their connections go.
    let mut kept = pushers.take(writers.iter().map(|(w, _)| w));
    // A writer is held off at its next connects (`FencePushers::cut_off`)
    // only when it checks fences and its answer took half the wait or more
    // (it stalled the fence): not for a refusal that came at once, which a
    // stranger could otherwise earn for the name and address of an honest
    // writer (hostile review 12).
    let slow = left / 2;
    let one = |writer: &crate::auth::Initiator, push_key: &Option<Vec<u8>>, cached: Option<ControlClient>| {
        let Some(push_key) = push_key else {
            let why = format!("{} does not check fences over rdma", writer.name);
            return (Err(crate::Error::Unsupported { what: why }), None, false);
        };
        // What only the target its connect reached knows.
        let mut request = request.clone();
        request.push_key.clone_from(push_key);
        let asked = Instant::now();
        let (answer, client) = ask(pushers, writer, cached, &me, request, deadline);
        (answer, client, asked.elapsed() >= slow)
    };
    type Answer = (crate::error::Result<()>, Option<ControlClient>, bool);
    let answers: Vec<Answer> = match writers.as_slice() {
        // One writer (a decode instance's one prefill peer): asked on this
        // thread; a spawned one took 40 of an idle fence's 65 µs
        // (`cargo bench --bench fence`, docs/FIGURES.md).
        [(writer, push_key)] => vec![one(writer, push_key, kept[0].take())],
        _ => std::thread::scope(|scope| {
            let asks: Vec<_> = writers
                .iter()
                .zip(kept.iter_mut().map(Option::take))
                .map(|((writer, push_key), cached)| scope.spawn(|| one(writer, push_key, cached)))
                .collect();
            asks.into_iter()
                .map(|ask| {
                    ask.join().unwrap_or_else(|_| {
                        (Err(crate::Error::invalid("rdma fence", "the push's thread panicked")), None, false)
                    })
                })
                .collect()
        }),
    };
    let answers: Vec<_> = writers
        .iter()
        .zip(answers)
        .map(|((writer, _), (answer, client, slow))| {
            if let Some(client) = client {
                pushers.keep(writer, client, writers.iter().map(|(w, _)| w));
            }
            (answer, slow)
        })
        .collect();
    for ((writer, _), (answer, slow)) in writers.iter().zip(answers) {
        if let Err(error) = answer {
            // ibv_modify_qp to ERR first (`release_initiator`): none of its
            // writes is placed after; it reconnects, with a new snapshot.
            tracing::warn!(initiator = %writer.name, %error, "an rdma writer did not confirm a fence: its QPs are cut off");
            node.release_initiator(writer);
            if slow {
                pushers.cut_off(writer);
            }
        }
    }
}

/// One writer's answer to `request`, over its kept connection (made at its
/// connect; made anew, to the same engine, if it had gone stale: a push is
/// idempotent); the connection to keep, when it answered.
fn ask(
    pushers: &FencePushers,
    writer: &crate::auth::Initiator,
    cached: Option<ControlClient>,
    me: &crate::auth::Initiator,
    request: crate::proto::RdmaFenceRequest,
    deadline: Instant,
) -> (crate::error::Result<()>, Option<ControlClient>) {
    let fresh = || pushers.reach(me, writer, deadline);
    if let Some(mut client) = cached {
        match client.rdma_fence(request.clone(), deadline) {
            Ok(()) => return (Ok(()), Some(client)),
            // The writer's answer (busy, no such link): not asked again.
            Err(error) if !matches!(error, crate::Error::Io { .. } | crate::Error::Malformed { .. }) => {
                return (Err(error), None)
            }
            // The kept connection had gone (closed while idle): a new one.
            Err(_) => {}
        }
    }
    let mut client = match fresh() {
        Ok(client) => client,
        Err(error) => return (Err(error), None),
    };
    match client.rdma_fence(request, deadline) {
        Ok(()) => (Ok(()), Some(client)),
        Err(error) => (Err(error), None),
    }
}
