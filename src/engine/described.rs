//! Descriptors exchanged out of band, as NIXL's users exchange agent
//! metadata: this engine's descriptor as bytes, and opening a peer from
//! the bytes it sent. Also the wait on a caller's GPU stream that
//! Mooncake's `*_on_cuda` transfers start after.

use super::{Engine, Segment};
use crate::control::frame::MAX_CONTROL_MESSAGE_BYTES;
use crate::error::{Error, Result};
use crate::proto;
use crate::segment::SegmentDescriptor;
use crate::transport::TransportKind;
use prost::Message as _;
use std::time::Duration;

impl Engine {
    /// This engine's segment descriptor in its wire form (protobuf, as a
    /// handshake carries it): name, epoch, control address, regions. For
    /// peers that exchange metadata out of band instead of asking the
    /// engine itself (NIXL's `get_agent_metadata`).
    pub fn descriptor_bytes(&self) -> Vec<u8> {
        self.descriptor().to_proto().encode_to_vec()
    }

    /// Opens the peer that `descriptor` (another engine's
    /// [`descriptor_bytes`](Self::descriptor_bytes), received out of band)
    /// describes: a handshake with its control address, cached under that
    /// address. Bytes that do not decode, or describe no reachable engine,
    /// are refused with the reason; a peer whose live epoch is not the
    /// descriptor's (it restarted since) is `PeerRestarted`: ask it for
    /// fresh metadata.
    pub fn open_described(
        &self,
        descriptor: &[u8],
        transport: Option<TransportKind>,
        timeout: Duration,
    ) -> Result<Segment> {
        let described = decode(descriptor)?;
        if described.control_addr.is_empty() {
            return Err(Error::malformed("segment descriptor", "no control address"));
        }
        let segment = self.open_segment_with(&described.control_addr, transport, timeout)?;
        if segment.epoch() != described.epoch || segment.name() != described.name {
            return Err(Error::PeerRestarted {
                segment: described.name,
                detail: format!(
                    "{} now runs {} (epoch {:#x}), not the engine the descriptor names (epoch {:#x}): fetch its \
                     metadata again",
                    described.control_addr,
                    segment.name(),
                    segment.epoch(),
                    described.epoch
                ),
            });
        }
        Ok(segment)
    }

    /// Waits, at most `timeout`, until the work queued so far on a stream
    /// the caller made (a `cudaStream_t` / `CUstream` as an integer; 0:
    /// GPU `device`'s default stream) has finished. Without a GPU provider
    /// there is no stream to wait for: an error.
    pub fn wait_gpu_stream(&self, device: u32, stream: u64, timeout: Duration) -> Result<()> {
        let gpu = self
            .gpu()
            .ok_or_else(|| Error::invalid("stream", "no GPU provider: there is no GPU stream to wait for"))?;
        gpu.wait_caller_stream(device, stream, timeout)
    }
}

/// Decodes and checks a descriptor from outside.
fn decode(bytes: &[u8]) -> Result<SegmentDescriptor> {
    if bytes.len() > MAX_CONTROL_MESSAGE_BYTES as usize {
        return Err(Error::MessageTooLarge { len: bytes.len() as u64, max: u64::from(MAX_CONTROL_MESSAGE_BYTES) });
    }
    let message = proto::SegmentDescriptor::decode(bytes)
        .map_err(|e| Error::malformed("segment descriptor", format!("not a kvring descriptor ({e})")))?;
    SegmentDescriptor::from_proto(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_that_are_not_a_descriptor_are_refused_with_the_reason() {
        let error = decode(b"\xff\xff\xff not protobuf").unwrap_err();
        assert!(error.to_string().contains("not a kvring descriptor"), "{error}");
        let error = decode(&[]).unwrap_err(); // decodes, but names nothing
        assert!(error.to_string().contains("name must be"), "{error}");
        let big = vec![0u8; MAX_CONTROL_MESSAGE_BYTES as usize + 1];
        assert!(matches!(decode(&big), Err(Error::MessageTooLarge { .. })));
    }
}
