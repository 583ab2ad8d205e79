//! Arrivals on this engine as a target: how many bytes of pushes carrying
//! an arrival tag have landed, so a decode instance can start a layer the
//! moment its bytes are in place (see [`Batch::arrival_tag`](crate::Batch::arrival_tag)).

use super::Engine;
use crate::error::{Error, Result};
use crate::runtime::backoff::{Backoff, Snooze};
use std::time::{Duration, Instant};

impl Engine {
    /// Bytes landed here so far under `tag` (pushes that carried it, each
    /// frame or write counted once its bytes are in place).
    pub fn landed(&self, tag: u32) -> u64 {
        self.inner.arrivals.landed(tag)
    }

    /// Waits until at least `bytes` have landed under `tag`, bounded by
    /// `timeout` (`Error::Timeout`, naming what had landed, past it).
    ///
    /// ```no_run
    /// # fn demo(engine: &kvring::Engine, layer_bytes: u64) -> kvring::Result<()> {
    /// let tag = kvring::kv::arrival_tag(42, 3)?; // request slot 42, layer 3
    /// engine.wait_landed(tag, layer_bytes, std::time::Duration::from_secs(1))?;
    /// // layer 3 of request 42 is in place: start it
    /// engine.forget_arrival(tag);
    /// # Ok(()) }
    /// ```
    pub fn wait_landed(&self, tag: u32, bytes: u64, timeout: Duration) -> Result<()> {
        self.wait_count(|| self.landed(tag), tag, bytes, timeout)
    }

    /// Forgets `tag` (its count starts again from 0, its slot is free for
    /// another tag); returns the bytes it had counted. A target keeps a
    /// bounded table of tags (16,384): forget each once it is consumed.
    pub fn forget_arrival(&self, tag: u32) -> u64 {
        self.inner.arrivals.forget(tag)
    }

    /// Binds `tag` to the ranges of this engine's regions its request was
    /// given (each `(region, offset, len)`), before the push: from now until
    /// [`forget_arrival`](Self::forget_arrival), only bytes landed wholly
    /// inside them count under `tag`. Another peer (or another request)
    /// tagging its writes with it counts nothing; a landing whose place the
    /// target cannot see (an RDMA WRITE_WITH_IMM) does not count under a
    /// granted tag, and a granted byte counts once however often it lands.
    /// What the tag counted before its grant is dropped. Refused
    /// (`InvalidArgument`) for a tag already granted: two requests chose
    /// the same tag.
    ///
    /// ```no_run
    /// # fn demo(engine: &kvring::Engine, kv: kvring::RegionId) -> kvring::Result<()> {
    /// let tag = kvring::kv::arrival_tag(42, 3)?;
    /// engine.grant_arrival(tag, &[(kv, 0, 65536)])?; // request 42's blocks of layer 3
    /// # Ok(()) }
    /// ```
    pub fn grant_arrival(&self, tag: u32, ranges: &[(crate::RegionId, u64, u64)]) -> Result<()> {
        self.grant(None, tag, ranges)
    }

    /// As [`grant_arrival`](Self::grant_arrival), for the landings of one
    /// sender only: `sender` is the initiator engine's name as it proved it
    /// in its tokened handshake with this engine (the name its
    /// `EngineBuilder::name` gave it). Grants are keyed by (sender, tag): two
    /// prefill engines that chose the same tag are each granted their own
    /// ranges and counted apart ([`landed_from`](Self::landed_from)), and one
    /// cannot complete the other's tag. Needs a token (without one no data
    /// connection proves who it is: `Unsupported`); refused
    /// (`InvalidArgument`) for a (sender, tag) already granted or a tag
    /// granted to any sender.
    ///
    /// ```no_run
    /// # fn demo(engine: &kvring::Engine, kv: kvring::RegionId) -> kvring::Result<()> {
    /// let tag = kvring::kv::arrival_tag(42, 3)?;
    /// engine.grant_arrival_from("prefill-0", tag, &[(kv, 0, 65536)])?;
    /// engine.wait_landed_from("prefill-0", tag, 65536, std::time::Duration::from_secs(5))?;
    /// engine.forget_arrival_from("prefill-0", tag);
    /// # Ok(()) }
    /// ```
    pub fn grant_arrival_from(&self, sender: &str, tag: u32, ranges: &[(crate::RegionId, u64, u64)]) -> Result<()> {
        if self.inner.context.auth.is_none() {
            return Err(Error::Unsupported {
                what: format!(
                    "an arrival grant for sender {sender:?}: without a token no data connection proves its sender \
                     (set a token on both engines, or grant_arrival for any sender)"
                ),
            });
        }
        if sender.is_empty() {
            return Err(Error::invalid("arrival grant", "an empty sender name"));
        }
        self.grant(Some(sender), tag, ranges)
    }

    fn grant(&self, sender: Option<&str>, tag: u32, ranges: &[(crate::RegionId, u64, u64)]) -> Result<()> {
        let mut raw = Vec::with_capacity(ranges.len());
        for &(region, offset, len) in ranges {
            let end = offset
                .checked_add(len)
                .ok_or_else(|| Error::invalid("arrival grant", format!("{region} at {offset} + {len} overflows")))?;
            raw.push((region.raw(), offset, end));
        }
        self.inner.arrivals.grant_from(sender, tag, &raw).map_err(|why| {
            let reason = match why {
                crate::arrival::GrantRefused::Zero => "tag 0 means untagged".to_string(),
                crate::arrival::GrantRefused::InUse => match sender {
                    None => format!("tag {tag:#x} is granted already: two requests chose the same tag"),
                    Some(sender) => format!(
                        "tag {tag:#x} is granted already to {sender:?} (or to any sender): two of its requests chose \
                         the same tag"
                    ),
                },
                crate::arrival::GrantRefused::Full => format!(
                    "no room for tag {tag:#x} (or {} senders of it already), or its ranges are empty or more than {}",
                    crate::arrival::MAX_TAG_SENDERS,
                    crate::arrival::MAX_GRANT_RANGES
                ),
            };
            Error::invalid("arrival grant", reason)
        })
    }

    /// Bytes landed under `sender`'s grant of `tag` (see
    /// [`grant_arrival_from`](Self::grant_arrival_from)); 0 for a sender the
    /// tag is not granted to.
    pub fn landed_from(&self, sender: &str, tag: u32) -> u64 {
        self.inner.arrivals.landed_from(Some(sender), tag)
    }

    /// Waits until at least `bytes` have landed under `sender`'s grant of
    /// `tag`, bounded by `timeout` (`Error::Timeout` past it).
    pub fn wait_landed_from(&self, sender: &str, tag: u32, bytes: u64, timeout: Duration) -> Result<()> {
        self.wait_count(|| self.landed_from(sender, tag), tag, bytes, timeout)
    }

    /// Forgets `sender`'s grant of `tag` (other senders' grants of it stay);
    /// returns the bytes it had counted.
    pub fn forget_arrival_from(&self, sender: &str, tag: u32) -> u64 {
        self.inner.arrivals.forget_from(Some(sender), tag)
    }

    fn wait_count(&self, landed: impl Fn() -> u64, tag: u32, bytes: u64, timeout: Duration) -> Result<()> {
        let started = Instant::now();
        let mut backoff =
            Backoff::new(self.inner.config.wait_backoff, Some(crate::deadline::deadline_from(started, timeout)));
        while landed() < bytes {
            // A stopped engine lands nothing more: its `close` (which waits
            // for this call in Python) hears at once, not at the timeout.
            if self.inner.is_stopped() {
                return Err(Error::Shutdown);
            }
            if backoff.snooze() == Snooze::Expired {
                tracing::debug!(tag, bytes, landed = landed(), "wait_landed timed out");
                return Err(Error::Timeout {
                    what: "the tag's bytes to land (wait_landed)",
                    waited: started.elapsed(),
                });
            }
        }
        Ok(())
    }

    /// Landings refused under granted tags (outside their ranges, or with
    /// no place the target could check).
    pub fn arrivals_refused(&self) -> u64 {
        self.inner.arrivals.refused()
    }

    /// Landings that could not be counted (the tag table full, or a tag's
    /// count past 4 GiB).
    pub fn arrivals_dropped(&self) -> u64 {
        self.inner.arrivals.dropped()
    }
}
