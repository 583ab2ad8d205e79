//! CRC32C of this engine's memory for a peer (`Crc32cRequest`): how an rdma
//! initiator verifies a checksummed chunk once its work requests completed
//! (`transport::rdma::verify`, docs/CHECKSUMS.md). Both ends are here: the
//! target's answer, and the initiator's asker a verifier thread uses.
//!
//! The answer is a trust boundary: every field is the peer's. Each range
//! must name a live host region that grants peers REMOTE_READ (a CRC of a
//! region a peer may not read would tell it that region's contents, a
//! few bytes at a time), lie inside it (checked arithmetic), and the
//! request carry at most [`MAX_CRC32C_RANGES`] ranges and
//! [`MAX_CRC32C_BYTES`] in all; everything is checked before a byte is
//! read. It is not taken under `read_alone` (the bench's checksum): the
//! target's own batches do not make it fail. Each region is leased while
//! it is summed, so it cannot be unregistered under the read, and its
//! bytes (which a peer's NIC may be writing) are read through a bounce
//! buffer, never as a `&[u8]`.

use crate::auth::{Initiator, Token};
use crate::control::ControlClient;
use crate::error::{Error, Result, Side};
use crate::mem::registry::{check_range, Lease};
use crate::mem::{Access, Registry};
use crate::proto::Crc32cRequest;
use crate::region_id::RegionId;
use crate::transport::checksum::crc32c_shared;
use crate::transport::rdma::verify::{AskCrcs, Range, VerifyPeer, MAX_CRC32C_BYTES, MAX_CRC32C_RANGES};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Longest the answer waits for a region held by an exclusive read (the
/// bench's checksum) before it is refused `RegionBusy`.
const LEASE_WAIT: Duration = Duration::from_millis(100);

/// The checks every request passes before anything is read: the number
/// of ranges and their total length (checked arithmetic). Pure, so the
/// fuzz target runs it on decoded requests.
pub(crate) fn check_request(request: &Crc32cRequest) -> Result<()> {
    if request.ranges.len() > MAX_CRC32C_RANGES {
        return Err(Error::invalid(
            "crc32c request",
            format!("{} ranges; at most {MAX_CRC32C_RANGES} per request", request.ranges.len()),
        ));
    }
    let total = request.ranges.iter().try_fold(0u64, |sum, range| sum.checked_add(range.len));
    match total {
        Some(total) if total <= MAX_CRC32C_BYTES => Ok(()),
        Some(total) => Err(Error::invalid(
            "crc32c request",
            format!("{total} bytes in all; at most {MAX_CRC32C_BYTES} per request"),
        )),
        None => Err(Error::invalid("crc32c request", "its lengths overflow 64 bits")),
    }
}

/// Answers a peer's `Crc32cRequest` on `registry`: one CRC32C per range,
/// in order, or the first range's typed error (its index as `desc_index`).
pub(crate) fn answer(registry: &Registry, request: &Crc32cRequest) -> Result<Vec<u32>> {
    #[cfg(feature = "testing")]
    stall::wait();
    check_request(request)?;
    let mut leased: Vec<(usize, Lease<'_>)> = Vec::with_capacity(request.ranges.len());
    for (index, range) in request.ranges.iter().enumerate() {
        let id = RegionId::from_raw(range.region);
        let lease = match registry.lease_after_read(id, LEASE_WAIT) {
            Ok(lease) => lease,
            Err(Error::UnknownRegion { .. }) => return Err(Error::UnknownRegion { side: Side::Remote, region: id }),
            Err(other) => return Err(other),
        };
        let entry = lease.entry();
        let desc_index = index as u32;
        if !entry.info.access.contains(Access::REMOTE_READ) {
            return Err(Error::AccessDenied { desc_index, side: Side::Remote, region: id, needs: "remote read" });
        }
        if entry.device.is_some() || entry.info.memory != crate::mem::MemoryKind::Host {
            return Err(Error::Unsupported {
                what: format!(
                    "a CRC32C of region {id}: it is GPU memory, and kvring has no checksum kernel on the GPU yet"
                ),
            });
        }
        check_range(id, Side::Remote, desc_index, range.offset, range.len, entry.len as u64)?;
        leased.push((entry.addr, lease));
    }
    Ok(request
        .ranges
        .iter()
        .zip(&leased)
        .map(|(range, (addr, _lease))| {
            // SAFETY: inside a host region (checked above) its lease keeps
            // mapped past this read; a NIC may write it, so it is bounced.
            unsafe { crc32c_shared((addr + range.offset as usize) as *const u8, range.len as usize) }
        })
        .collect())
}

/// What an rdma link's verifier threads ask the peer at `addr` with: each
/// thread's own control client, dialed and handshaken (as the link's
/// connect was, with `token`) at its first question and again after any
/// failure.
pub(crate) fn verify_peer(addr: String, initiator: Initiator, token: Option<Token>, timeout: Duration) -> VerifyPeer {
    let dial = move || -> AskCrcs {
        let (addr, initiator, token) = (addr.clone(), initiator.clone(), token.clone());
        let mut client: Option<ControlClient> = None;
        Box::new(move |ranges: &[Range], deadline: Instant| {
            let mut connected = match client.take() {
                Some(client) => client,
                None => {
                    let mut fresh = ControlClient::connect(&addr, deadline)?;
                    fresh.handshake(&initiator, token.as_ref(), deadline)?;
                    fresh
                }
            };
            let crcs = connected.crc32c(ranges, deadline)?;
            // Kept only after a whole exchange: a failed one may have left
            // the connection out of step.
            client = Some(connected);
            Ok(crcs)
        })
    };
    VerifyPeer { dial: Arc::new(dial), timeout }
}

/// A target that does not answer (the `testing` feature): while a test
/// holds [`stall::hold`]'s guard, every answer of this process waits.
#[cfg(feature = "testing")]
pub(crate) mod stall {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    static STALLED: AtomicBool = AtomicBool::new(false);
    /// Answers waiting in [`wait`] now.
    static WAITING: AtomicUsize = AtomicUsize::new(0);
    /// Longest an answer waits, so a test that forgets its guard cannot
    /// hang a control thread for good.
    const MOST: Duration = Duration::from_secs(60);

    /// Stalls answers until the guard drops.
    #[derive(Debug)]
    pub struct Stalled(());

    impl Drop for Stalled {
        fn drop(&mut self) {
            STALLED.store(false, Ordering::Release);
        }
    }

    impl Stalled {
        /// How many answers are held now (a request reached the target).
        pub fn waiting(&self) -> usize {
            WAITING.load(Ordering::Acquire)
        }
    }

    /// Stalls every CRC32C answer of this process until the guard drops.
    pub fn hold() -> Stalled {
        STALLED.store(true, Ordering::Release);
        Stalled(())
    }

    pub(super) fn wait() {
        let until = Instant::now() + MOST;
        WAITING.fetch_add(1, Ordering::AcqRel);
        while STALLED.load(Ordering::Acquire) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        WAITING.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{Backing, RegionInfo};
    use crate::proto::Crc32cRange;

    fn request(ranges: &[(RegionId, u64, u64)]) -> Crc32cRequest {
        Crc32cRequest {
            ranges: ranges.iter().map(|&(id, offset, len)| Crc32cRange { region: id.raw(), offset, len }).collect(),
        }
    }

    /// Hostile requests get typed errors and read nothing; honest ones get
    /// the CRC32C of the bytes in place.
    #[test]
    fn hostile_requests_get_typed_errors_and_honest_ones_the_crc_of_the_bytes() {
        let registry = Registry::new(16);
        let mut bytes = vec![0u8; 8192];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        let readable = registry.register(bytes.as_ptr() as usize, 4096, RegionInfo::raw(), Backing::default()).unwrap();
        let write_only = RegionInfo::raw().with_access(Access::LOCAL_READ | Access::REMOTE_WRITE);
        let hidden = registry.register(bytes.as_ptr() as usize + 4096, 4096, write_only, Backing::default()).unwrap();

        let crcs = answer(&registry, &request(&[(readable, 0, 4096), (readable, 100, 17), (readable, 4096, 0)]));
        let want = |range: std::ops::Range<usize>| crate::transport::checksum::crc32c_of(&bytes[range]);
        assert_eq!(crcs.unwrap(), [want(0..4096), want(100..117), want(0..0)]);

        let past = answer(&registry, &request(&[(readable, 0, 8), (readable, 4000, 97)])).unwrap_err();
        assert!(matches!(past, Error::OutOfBounds { desc_index: 1, side: Side::Remote, .. }), "{past}");
        let wrap = answer(&registry, &request(&[(readable, u64::MAX - 3, 8)])).unwrap_err();
        assert!(matches!(wrap, Error::LengthOverflow { side: Side::Remote, .. }), "{wrap}");
        let lengths = answer(&registry, &request(&[(readable, 0, u64::MAX), (readable, 0, 2)])).unwrap_err();
        assert!(matches!(lengths, Error::InvalidArgument { .. }), "{lengths}");
        let huge = answer(&registry, &request(&[(readable, 0, MAX_CRC32C_BYTES + 1)])).unwrap_err();
        assert!(matches!(huge, Error::InvalidArgument { .. }) && huge.to_string().contains("bytes"), "{huge}");
        let many = request(&vec![(readable, 0, 1); 10_000]);
        let many = answer(&registry, &many).unwrap_err();
        assert!(matches!(many, Error::InvalidArgument { .. }) && many.to_string().contains("10000"), "{many}");
        let oracle = answer(&registry, &request(&[(readable, 0, 1), (hidden, 0, 1)])).unwrap_err();
        assert!(matches!(oracle, Error::AccessDenied { desc_index: 1, needs: "remote read", .. }), "{oracle}");
        let stale = RegionId::new(readable.index(), readable.generation() + 1);
        let unknown = answer(&registry, &request(&[(stale, 0, 1)])).unwrap_err();
        assert!(matches!(unknown, Error::UnknownRegion { side: Side::Remote, .. }), "{unknown}");
        let nowhere = answer(&registry, &request(&[(RegionId::new(9999, 1), 0, 1)])).unwrap_err();
        assert!(matches!(nowhere, Error::UnknownRegion { side: Side::Remote, .. }), "{nowhere}");
        assert_eq!(answer(&registry, &request(&[])).unwrap(), Vec::<u32>::new());
        // Every lease taken for a refused request was given back.
        registry.unregister(readable).unwrap();
        registry.unregister(hidden).unwrap();
    }

    /// The fuzz seeds of the new messages decode as them (so the fuzzer
    /// starts from a CRC32C request and answer).
    #[test]
    fn the_fuzz_seeds_are_a_crc32c_request_and_answer() {
        use crate::proto::{request, response};
        let seeds = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/seeds/control_message/");
        let asked = std::fs::read(format!("{seeds}crc32c_request")).unwrap();
        let Ok(request::Body::Crc32c(asked)) = crate::control::frame::decode_request(&asked) else { panic!() };
        assert_eq!(asked.ranges, [Crc32cRange { region: 1, offset: 0, len: 16 }]);
        assert!(check_request(&asked).is_ok());
        let told = std::fs::read(format!("{seeds}crc32c_response")).unwrap();
        let Ok(response::Body::Crc32c(told)) = crate::control::frame::decode_response(&told) else { panic!() };
        assert_eq!(told.crcs, [0x1234_5678]);
    }

    /// The target's own batches (leases on the region) do not make it
    /// fail, unlike the bench's `checksum`.
    #[test]
    fn a_region_in_use_by_the_targets_batches_is_still_answered() {
        let registry = Registry::new(4);
        let bytes = vec![3u8; 64];
        let id = registry.register(bytes.as_ptr() as usize, 64, RegionInfo::raw(), Backing::default()).unwrap();
        let _batch = registry.lease(id).unwrap();
        let crcs = answer(&registry, &request(&[(id, 0, 64)])).unwrap();
        assert_eq!(crcs, [crate::transport::checksum::crc32c_of(&bytes)]);
    }
}
