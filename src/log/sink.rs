//! Forwarding kvring's `tracing` events to a logger that is not Rust's:
//! the C ABI's callback (`ffi.rs`) and Python's `logging` (`python/`).
//!
//! The first [`set_sink`] installs, process-wide, a subscriber that turns
//! each enabled event into one line (the message, then ` field=value` for
//! every field) and hands it to the current sink; later calls only swap
//! the sink. With no sink the layer drops events at the cost of one lock
//! read, and kvring emits none on the per-block path, so this costs the
//! data path nothing.

use std::fmt::Write as _;
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;

/// Receives one event: its level, its target (the module path) and its
/// text. Called on the thread that emitted it, which may be a lane.
pub(crate) type Sink = Arc<dyn Fn(Level, &str, &str) + Send + Sync>;

static SINK: RwLock<Option<Sink>> = RwLock::new(None);

/// Makes `sink` (or nothing) the receiver of kvring's events. The first
/// call installs the process's tracing subscriber, filtered by `RUST_LOG`
/// or else `default_filter`; it fails if the process already has one (a
/// Rust host that set up its own logging), and the sink then gets nothing.
pub(crate) fn set_sink(sink: Option<Sink>, default_filter: &str) -> Result<(), &'static str> {
    static OURS: OnceLock<bool> = OnceLock::new();
    *SINK.write().unwrap_or_else(PoisonError::into_inner) = sink;
    let ours = *OURS.get_or_init(|| {
        let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
        tracing_subscriber::registry().with(filter).with(SinkLayer).try_init().is_ok()
    });
    if ours {
        Ok(())
    } else {
        Err("this process already has a tracing subscriber; kvring's events go to it")
    }
}

/// A sink that queues events for `forward`, called on a thread of its
/// own: for a logger whose calls may block (Python's takes the GIL), so
/// that no thread that logs (a lane, among others) ever waits on it. The
/// queue is bounded: a logger that stops taking events loses some, never
/// memory. The thread ends once the sink is dropped (replaced); join it.
#[cfg(feature = "python")]
pub(crate) fn on_own_thread(
    mut forward: impl FnMut(Level, String, String) + Send + 'static,
) -> std::io::Result<(Sink, std::thread::JoinHandle<()>)> {
    let (queue, events) = std::sync::mpsc::sync_channel::<(Level, String, String)>(1024);
    let thread = std::thread::Builder::new().name("kvring-log".into()).spawn(move || {
        for (level, target, text) in events {
            forward(level, target, text);
        }
    })?;
    let sink: Sink = Arc::new(move |level, target, text| {
        let _ = queue.try_send((level, target.to_owned(), text.to_owned()));
    });
    Ok((sink, thread))
}

/// The layer that formats an event and calls the current sink.
struct SinkLayer;

impl<S: Subscriber> Layer<S> for SinkLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let Some(sink) = SINK.read().unwrap_or_else(PoisonError::into_inner).clone() else { return };
        let mut text = Text::default();
        event.record(&mut text);
        text.message.push_str(&text.fields);
        let metadata = event.metadata();
        sink(*metadata.level(), metadata.target(), &text.message);
    }
}

/// An event as one line: the message, then its other fields.
#[derive(Default)]
struct Text {
    message: String,
    fields: String,
}

impl Visit for Text {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={}", field.name(), value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={:?}", field.name(), value);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_becomes_its_message_then_its_fields() {
        let lines = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = lines.clone();
        let sink: Sink = Arc::new(move |level, target, text| {
            seen.lock().unwrap().push((level, target.to_string(), text.to_string()))
        });
        // The unit-test binary installs no other subscriber.
        set_sink(Some(sink), "kvring=debug").unwrap();
        tracing::warn!(segment = "decode-0", epoch = format_args!("{:#x}", 255), "peer restarted");
        tracing::debug!(target: "elsewhere", "filtered out");
        set_sink(None, "kvring=debug").unwrap();
        tracing::warn!("after the sink went");
        let lines = lines.lock().unwrap();
        let ours: Vec<_> = lines.iter().filter(|(_, target, _)| target.starts_with("kvring::log")).collect();
        assert_eq!(ours.len(), 1, "{lines:?}");
        assert_eq!(ours[0].0, Level::WARN);
        assert_eq!(ours[0].2, "peer restarted segment=decode-0 epoch=0xff");
        assert!(lines.iter().all(|(_, target, _)| target != "elsewhere"));
    }
}
