//! `/metrics` scraped with a real HTTP request while batches move.

mod common;

use common::{engine, WAIT};
use kvring::{Batch, BlockDesc, RegionInfo, TransportKind};
use std::io::{Read, Write};
use std::net::TcpStream;

fn get(addr: std::net::SocketAddr, path: &str) -> kvring::testing::http::Response {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    kvring::testing::http::parse_response(&raw).unwrap()
}

fn value(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .unwrap()
}

#[test]
fn a_scrape_counts_bytes_batches_errors_latency_and_cache_use() {
    let target = engine("decode-0");
    let remote = target.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let initiator = common::builder("prefill-0").metrics("127.0.0.1:0".parse().unwrap()).build().unwrap();
    let addr = initiator.metrics_addr().expect("served");
    let local = initiator.alloc_region(1 << 20, RegionInfo::raw()).unwrap();
    let mut sub = initiator.submitter().unwrap();
    let name = target.control_addr().to_string();
    for (transport, blocks) in [(TransportKind::Tcp, 3u64), (TransportKind::Shm, 2)] {
        let segment = initiator.open_segment_with(&name, Some(transport), WAIT).unwrap();
        for i in 0..blocks {
            let desc = BlockDesc::new(local.id(), i * 4096, remote.id(), i * 4096, 4096);
            let id = sub.submit(&Batch::write(&segment).block(desc)).unwrap();
            assert!(sub.wait(id, WAIT).unwrap().is_done());
        }
    }
    let segment = initiator.open_segment(&name).unwrap(); // a cache hit
    let past_end = BlockDesc::new(local.id(), 0, remote.id(), (1 << 20) - 100, 4096);
    let id = sub.submit(&Batch::read(&segment).block(past_end)).unwrap();
    assert!(!sub.wait(id, WAIT).unwrap().is_done());

    let response = get(addr, "/metrics");
    assert_eq!(response.status, 200);
    let text = String::from_utf8(response.body).unwrap();
    assert_eq!(value(&text, "kvring_bytes_total{op=\"write\",transport=\"tcp\"}"), 3 * 4096);
    assert_eq!(value(&text, "kvring_bytes_total{op=\"write\",transport=\"shm\"}"), 2 * 4096);
    assert_eq!(value(&text, "kvring_batches_total{op=\"write\",transport=\"tcp\"}"), 3);
    assert_eq!(value(&text, "kvring_batches_total{op=\"read\",transport=\"shm\"}"), 1);
    assert_eq!(value(&text, "kvring_errors_total{code=\"OUT_OF_BOUNDS\"}"), 1);
    assert_eq!(value(&text, "kvring_batch_latency_seconds_count"), 6);
    assert_eq!(value(&text, "kvring_batch_latency_seconds_bucket{le=\"+Inf\"}"), 6);
    assert!(value(&text, "kvring_segment_cache_hits_total") >= 1);
    assert_eq!(value(&text, "kvring_segment_cache_misses_total"), 2);
    assert_eq!(value(&text, "kvring_ring_sqes_waiting{lane=\"0\"}"), 0);

    // Switched off, the lanes stop counting; the endpoint still answers.
    initiator.set_metrics_enabled(false);
    let desc = BlockDesc::new(local.id(), 0, remote.id(), 0, 4096);
    let id = sub.submit(&Batch::write(&segment).block(desc)).unwrap();
    assert!(sub.wait(id, WAIT).unwrap().is_done());
    let text = initiator.metrics_text();
    assert_eq!(value(&text, "kvring_batch_latency_seconds_count"), 6);

    assert_eq!(get(addr, "/other").status, 404);
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.write_all(b"POST /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).unwrap();
    assert_eq!(kvring::testing::http::parse_response(&raw).unwrap().status, 405);
}
