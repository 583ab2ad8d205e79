//! Arbitrary bytes as a framed control message (what the control server and
//! client read from a socket): an error or a decoded message, never a panic;
//! the QP endpoints of an RDMA connect are checked or refused.
#![no_main]

use kvring::control::client::endpoint_from_proto;
use kvring::control::frame::{decode_request, decode_response, read_frame};
use kvring::proto::{request, response};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut reader = data;
    if let Ok(Some(body)) = read_frame(&mut reader, 1 << 16) {
        let _ = decode_request(&body);
        let _ = decode_response(&body);
    }
    if let Ok(request::Body::RdmaConnect(connect)) = decode_request(data) {
        for endpoint in &connect.endpoints {
            if let Ok(checked) = endpoint_from_proto(endpoint) {
                assert!(checked.qpn <= 0x00ff_ffff && (256..=4096).contains(&checked.mtu));
            }
        }
    }
    if let Ok(response::Body::RdmaConnect(reply)) = decode_response(data) {
        for endpoint in &reply.endpoints {
            let _ = endpoint_from_proto(endpoint);
        }
    }
});
