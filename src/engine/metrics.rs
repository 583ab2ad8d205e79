//! The `/metrics` endpoint: Prometheus text, rendered from the lanes'
//! counters only when scraped.

use super::{lock, EngineInner};
use crate::error::Result;
use crate::net::{Acceptor, AdmissionLimits, Admitted, DeadlineIo};
use crate::runtime::metrics::{render, EngineSeries};
use std::net::{SocketAddr, TcpStream};
use std::sync::Weak;
use std::time::{Duration, Instant};

/// Scrapes served at once; more wait in the listen backlog's stead of
/// being refused by the acceptor.
const MAX_SCRAPERS: usize = 8;
/// A scraper must send its whole request, and take the whole answer,
/// within this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The Prometheus text of `engine` now.
pub(crate) fn text(engine: &EngineInner) -> String {
    let lanes: Vec<_> = engine.lanes.iter().map(|lane| &*lane.shared.metrics).collect();
    let stats = lock(&engine.segments).cache.stats();
    let series = EngineSeries {
        cache: [stats.hits, stats.misses, stats.evictions, stats.stale_evictions],
        metadata_calls: engine.directory.as_ref().map_or(0, |directory| directory.calls()),
        memory_info_served: engine.context.memory_info_served.load(std::sync::atomic::Ordering::Relaxed),
    };
    render(&lanes, &series)
}

/// Serves `GET /metrics` on `listen` for as long as the engine lives.
pub(crate) fn serve(listen: SocketAddr, engine: Weak<EngineInner>) -> Result<Acceptor> {
    let limits = AdmissionLimits { timeout: REQUEST_TIMEOUT, ..AdmissionLimits::default() }.capped(MAX_SCRAPERS);
    Acceptor::start(
        listen,
        "metrics",
        limits,
        |stream, _bound| {
            let mut stream = DeadlineIo::new(stream, Instant::now() + Duration::from_millis(100));
            let _ = crate::http::write_response(&mut stream, "503 Service Unavailable", "text/plain", b"busy\n");
        },
        move |stream: TcpStream, conn: &Admitted<'_>| {
            let mut stream = DeadlineIo::new(&stream, conn.admission_deadline());
            let Ok((method, path)) = crate::http::read_request_line(&mut stream) else { return };
            let (status, body) = match (method.as_str(), path.split('?').next().unwrap_or_default()) {
                ("GET", "/metrics") => match engine.upgrade() {
                    Some(engine) => ("200 OK", text(&engine)),
                    None => ("503 Service Unavailable", "the engine has stopped\n".to_string()),
                },
                ("GET", _) => ("404 Not Found", "only /metrics is served here\n".to_string()),
                _ => ("405 Method Not Allowed", "only GET is served here\n".to_string()),
            };
            let _ = crate::http::write_response(&mut stream, status, "text/plain; version=0.0.4", body.as_bytes());
        },
    )
}
