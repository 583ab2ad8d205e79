//! Notifications: sending one to a peer (on the data path where the
//! transport has one, else on the control plane) and polling those peers
//! sent.

use super::{Engine, Segment};
use crate::error::{Error, Result};
use crate::notify::{Notification, MAX_NOTIFY_BYTES};
use crate::runtime::lane::LaneCommand;
use prost::Message as _;
use std::time::Duration;

impl Engine {
    /// Sends `message` to a peer ("request 42's blocks are in place") and
    /// waits (bounded by `timeout`) until the peer has queued it. Over tcp it
    /// travels on the data connection, after everything sent before it;
    /// over shm (no connection of its own) on the control plane. Call it
    /// after the batches it announces have ended `Done`: their bytes are
    /// then in place before the message is read.
    ///
    /// ```no_run
    /// # fn demo(engine: &kvring::Engine, decode: &kvring::Segment) -> kvring::Result<()> {
    /// engine.notify(decode, b"request 42: blocks in place", std::time::Duration::from_secs(1))?;
    /// # Ok(()) }
    /// ```
    pub fn notify(&self, segment: &Segment, message: &[u8], timeout: Duration) -> Result<()> {
        if segment.inner.owner_epoch != self.inner.epoch {
            return Err(Error::invalid("segment", "handle was opened by another engine"));
        }
        if segment.inner.peer.is_stale() {
            return Err(Error::PeerRestarted { segment: segment.name().to_string(), detail: "reopen it first".into() });
        }
        let deadline = crate::deadline::deadline_after(timeout);
        if segment.inner.link.carries_notifications() {
            return self.notify_on_data_path(segment, message, timeout);
        }
        segment.control_client(deadline)?.notify(&self.inner.config.name, message, deadline)
    }

    /// Hands a notification to lane 0, which queues it on its data
    /// connection to the peer behind what it has queued there.
    fn notify_on_data_path(&self, segment: &Segment, message: &[u8], timeout: Duration) -> Result<()> {
        if self.inner.is_stopped() {
            // The lanes read no more commands: fail now, not at the timeout.
            return Err(Error::Shutdown);
        }
        if message.len() > MAX_NOTIFY_BYTES {
            return Err(Error::MessageTooLarge { len: message.len() as u64, max: MAX_NOTIFY_BYTES as u64 });
        }
        let payload = crate::proto::Notification { from: self.inner.config.name.clone(), message: message.to_vec() }
            .encode_to_vec();
        let lane = self.inner.lanes.first().ok_or(Error::Shutdown)?;
        let (reply, result) = std::sync::mpsc::sync_channel(1);
        lane.shared.send(LaneCommand::Notify { key: segment.inner.key, payload, reply });
        match result.recv_timeout(timeout) {
            Ok(result) => result,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                Err(Error::Timeout { what: "lane 0 to send the notification", waited: timeout })
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(Error::Shutdown),
        }
    }

    /// The oldest notification peers sent this engine, if any.
    ///
    /// ```no_run
    /// # let engine = kvring::Engine::builder().build().unwrap();
    /// while let Some(n) = engine.poll_notification() {
    ///     println!("{} says {:?}", n.from, String::from_utf8_lossy(&n.message));
    /// }
    /// ```
    pub fn poll_notification(&self) -> Option<Notification> {
        self.inner.notifications.poll()
    }
}
