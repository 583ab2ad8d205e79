//! The `/metrics` endpoint: Prometheus text, rendered from the lanes'
//! counters only when scraped.

use super::{lock, EngineInner};
use crate::error::Result;
use crate::net::Acceptor;
use crate::runtime::metrics::{render, EngineSeries};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::Weak;
use std::time::Duration;

/// Scrapes served at once; more wait in the listen backlog's stead of
/// being refused by the acceptor.
const MAX_SCRAPERS: usize = 8;
/// A scraper must send its request within this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// The Prometheus text of `engine` now.
pub(crate) fn text(engine: &EngineInner) -> String {
    let lanes: Vec<_> = engine.lanes.iter().map(|lane| &*lane.shared.metrics).collect();
    let stats = lock(&engine.segments).cache.stats();
    let series = EngineSeries {
        cache: [stats.hits, stats.misses, stats.evictions, stats.stale_evictions],
        metadata_calls: engine.etcd.as_ref().map_or(0, |etcd| etcd.calls()),
    };
    render(&lanes, &series)
}

/// Serves `GET /metrics` on `listen` for as long as the engine lives.
pub(crate) fn serve(listen: SocketAddr, engine: Weak<EngineInner>) -> Result<Acceptor> {
    Acceptor::start(
        listen,
        "metrics",
        MAX_SCRAPERS,
        |stream| {
            let _ = crate::http::write_response(stream, "503 Service Unavailable", "text/plain", b"busy\n");
        },
        move |mut stream: TcpStream, _stop: &AtomicBool| {
            let _ = stream.set_read_timeout(Some(REQUEST_TIMEOUT));
            let _ = stream.set_write_timeout(Some(REQUEST_TIMEOUT));
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
