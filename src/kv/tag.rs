//! Arrival tags for KV pushes: one per (request, layer), so the decode side
//! can wait for layer L of request R while later layers are still in
//! flight ([`Engine::wait_landed`](crate::Engine::wait_landed)).

use super::layout::MAX_LAYERS;
use crate::error::{Error, Result};

/// Bits of a tag that name the layer (layers below [`MAX_LAYERS`]).
const LAYER_BITS: u32 = 12;
/// Largest request slot a tag can name: slots are small numbers an engine
/// reuses (a request's index in its running batch), not request ids.
pub const MAX_REQUEST_SLOT: u32 = (1 << (32 - LAYER_BITS)) - 1;

const _: () = assert!(MAX_LAYERS <= 1 << LAYER_BITS);

/// The arrival tag of `layer` of the request in `slot` (1..=[`MAX_REQUEST_SLOT`]):
/// `slot << 12 | layer`, never 0.
pub fn arrival_tag(slot: u32, layer: u32) -> Result<u32> {
    if slot == 0 || slot > MAX_REQUEST_SLOT {
        return Err(Error::invalid("request slot", format!("{slot} is not in 1..={MAX_REQUEST_SLOT}")));
    }
    if layer >= MAX_LAYERS {
        return Err(Error::invalid("layer", format!("{layer} is not below {MAX_LAYERS}")));
    }
    Ok(slot << LAYER_BITS | layer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_distinct_per_request_and_layer_and_never_zero() {
        assert_eq!(arrival_tag(1, 0).unwrap(), 1 << 12);
        assert_ne!(arrival_tag(1, 5).unwrap(), arrival_tag(2, 5).unwrap());
        assert_ne!(arrival_tag(1, 5).unwrap(), arrival_tag(1, 6).unwrap());
        assert_eq!(arrival_tag(MAX_REQUEST_SLOT, 4095).unwrap(), u32::MAX);
        assert!(arrival_tag(0, 1).unwrap_err().to_string().contains("request slot"));
        assert!(arrival_tag(MAX_REQUEST_SLOT + 1, 1).is_err());
        assert!(arrival_tag(1, 4096).unwrap_err().to_string().contains("layer"));
    }
}
