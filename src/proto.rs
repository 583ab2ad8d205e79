//! Control-plane messages generated from `proto/kvring/control.proto`
//! (prost): the handshake, the segment descriptor, notifications, RDMA
//! endpoints, KV layouts, and the wire error codes.

#![allow(missing_docs, clippy::doc_lazy_continuation)]

include!(concat!(env!("OUT_DIR"), "/kvring.control.v1.rs"));
