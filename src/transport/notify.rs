//! Notifications a target receives: small messages from initiators ("request
//! 42's blocks are in place"), queued until the engine's owner polls them.
//!
//! Both ways in (a NOTIFY frame on a tcp data connection, a notify request
//! on the control plane for shm peers) deliver into one bounded queue; a full
//! queue refuses the message with `Busy`, so the sender knows it was not
//! delivered.

use crate::error::{Error, Result};
use crossbeam_queue::ArrayQueue;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Default number of notifications queued before senders are refused.
pub const DEFAULT_NOTIFY_QUEUE: usize = 4096;
/// Largest notification message accepted.
pub use super::tcp::frame::MAX_NOTIFY_BYTES;

/// One notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sender's segment name.
    pub from: String,
    /// The message.
    pub message: Vec<u8>,
}

/// Called after each delivery (the engine rings the lane that posts
/// notification CQEs).
pub type DeliveryHook = Box<dyn Fn() + Send + Sync>;

/// The bounded queue notifications land in. Many connection threads
/// deliver into it, so it is crossbeam's MPMC `ArrayQueue`.
pub struct NotificationQueue {
    queue: ArrayQueue<Notification>,
    /// Deliveries so far: a lane compares it with what it last saw.
    delivered: AtomicU64,
    on_delivery: OnceLock<DeliveryHook>,
}

impl std::fmt::Debug for NotificationQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotificationQueue").field("queued", &self.queue.len()).finish()
    }
}

impl NotificationQueue {
    /// A queue holding up to `capacity` notifications.
    pub fn new(capacity: usize) -> Self {
        Self { queue: ArrayQueue::new(capacity.max(1)), delivered: AtomicU64::new(0), on_delivery: OnceLock::new() }
    }

    /// Sets what runs after each delivery (once; later calls are ignored).
    pub fn on_delivery(&self, hook: DeliveryHook) {
        let _ = self.on_delivery.set(hook);
    }

    /// Notifications delivered so far.
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Acquire)
    }

    /// Queues a notification; refused with `Busy` when full, or with
    /// `InvalidArgument` when the message is too large.
    pub fn deliver(&self, notification: Notification) -> Result<()> {
        if notification.message.len() > MAX_NOTIFY_BYTES {
            return Err(Error::MessageTooLarge {
                len: notification.message.len() as u64,
                max: MAX_NOTIFY_BYTES as u64,
            });
        }
        self.queue
            .push(notification)
            .map_err(|_| Error::Busy { queue: "notification queue", capacity: self.queue.capacity() })?;
        // Counted after the push: whoever sees the count finds the message.
        self.delivered.fetch_add(1, Ordering::AcqRel);
        if let Some(hook) = self.on_delivery.get() {
            hook();
        }
        Ok(())
    }

    /// The oldest notification, if any.
    pub fn poll(&self) -> Option<Notification> {
        self.queue.pop()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_refuses_and_order_is_kept() {
        let queue = NotificationQueue::new(2);
        let n = |m: &str| Notification { from: "p".into(), message: m.as_bytes().to_vec() };
        queue.deliver(n("a")).unwrap();
        queue.deliver(n("b")).unwrap();
        assert!(matches!(queue.deliver(n("c")), Err(Error::Busy { queue: "notification queue", capacity: 2 })));
        assert_eq!(queue.poll().unwrap().message, b"a");
        assert_eq!(queue.poll().unwrap().message, b"b");
        assert!(queue.poll().is_none());
        assert_eq!(queue.delivered(), 2, "refused messages are not counted");
        let huge = Notification { from: "p".into(), message: vec![0; MAX_NOTIFY_BYTES + 1] };
        assert!(matches!(queue.deliver(huge), Err(Error::MessageTooLarge { .. })));
    }
}
