//! Notifications a target receives: small messages from initiators ("request
//! 42's blocks are in place"), queued until the engine's owner polls them.
//!
//! Both ways in (a NOTIFY frame on a tcp data connection, a notify request
//! on the control plane for shm peers) deliver into one queue with quotas by
//! count and by bytes, per sender and in total, so no peer can fill a
//! target's memory or crowd out the others. A refused message is `Busy`
//! back to its sender, which then knows it was not delivered.

use crate::delivered::Deliveries;
use crate::error::{Error, Result};
use crate::log::ratelimit::{log_limited, RateLimit};
use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, OnceLock};

/// Largest notification message accepted.
pub const MAX_NOTIFY_BYTES: usize = 64 * 1024;
/// Longest sender name accepted (a segment name's limit).
pub const MAX_SENDER_BYTES: usize = 256;
/// Largest encoded notification a NOTIFY frame may carry: the message, the
/// name, and protobuf's few bytes of tags and lengths.
pub const MAX_NOTIFY_FRAME_BYTES: usize = MAX_NOTIFY_BYTES + MAX_SENDER_BYTES + 16;
/// Default most notifications queued in total.
pub const DEFAULT_NOTIFY_QUEUE: usize = 4096;
/// Default most bytes (messages and names) queued in total.
pub const DEFAULT_NOTIFY_QUEUE_BYTES: usize = 16 << 20;
/// Default most notifications queued from one sender.
pub const DEFAULT_NOTIFY_PER_SENDER: usize = 1024;
/// Default most bytes queued from one sender.
pub const DEFAULT_NOTIFY_BYTES_PER_SENDER: usize = 4 << 20;

/// The bounds on what senders may queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotifyQuota {
    /// Most notifications queued in total.
    pub total: usize,
    /// Most bytes queued in total.
    pub total_bytes: usize,
    /// Most notifications queued from one sender.
    pub per_sender: usize,
    /// Most bytes queued from one sender.
    pub per_sender_bytes: usize,
}

impl Default for NotifyQuota {
    fn default() -> Self {
        Self {
            total: DEFAULT_NOTIFY_QUEUE,
            total_bytes: DEFAULT_NOTIFY_QUEUE_BYTES,
            per_sender: DEFAULT_NOTIFY_PER_SENDER,
            per_sender_bytes: DEFAULT_NOTIFY_BYTES_PER_SENDER,
        }
    }
}

/// One notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sender's segment name.
    pub from: String,
    /// The message.
    pub message: Vec<u8>,
}

impl Notification {
    fn cost(&self) -> usize {
        self.message.len() + self.from.len()
    }
}

/// Called after each delivery (the engine rings the lane that posts
/// notification CQEs).
pub type DeliveryHook = Box<dyn Fn() + Send + Sync>;

#[derive(Debug, Default)]
struct Queued {
    queue: VecDeque<Notification>,
    bytes: usize,
    /// Per sender: notifications and bytes queued or held.
    senders: HashMap<String, (usize, usize)>,
    /// Notifications past their quota check, not yet queued
    /// (`deliver_after`'s `before` is running).
    held: usize,
}

impl Queued {
    /// Frees the share of a notification of `cost` bytes from `from`.
    fn release(&mut self, from: &str, cost: usize) {
        self.bytes -= cost;
        if let Some((count, bytes)) = self.senders.get_mut(from) {
            *count -= 1;
            *bytes -= cost;
            if *count == 0 {
                self.senders.remove(from);
            }
        }
    }
}

/// The queue notifications land in. Deliveries come from the data server
/// and control threads and reads from the owner, none of them on a lane's
/// data path, so one mutex keeps the quotas exact.
pub struct NotificationQueue {
    quota: NotifyQuota,
    queued: Mutex<Queued>,
    /// Deliveries so far: a lane compares it with what it last saw.
    delivered: Deliveries,
    on_delivery: OnceLock<DeliveryHook>,
}

impl std::fmt::Debug for NotificationQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotificationQueue").field("quota", &self.quota).finish_non_exhaustive()
    }
}

impl NotificationQueue {
    /// An empty queue with these quotas.
    pub fn new(quota: NotifyQuota) -> Self {
        let quota = NotifyQuota { total: quota.total.max(1), per_sender: quota.per_sender.max(1), ..quota };
        Self {
            quota,
            queued: Mutex::new(Queued::default()),
            delivered: Deliveries::new(),
            on_delivery: OnceLock::new(),
        }
    }

    fn queued(&self) -> std::sync::MutexGuard<'_, Queued> {
        // Every critical section leaves the counts consistent.
        self.queued.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets what runs after each delivery (once; later calls are ignored).
    pub fn on_delivery(&self, hook: DeliveryHook) {
        let _ = self.on_delivery.set(hook);
    }

    /// Notifications delivered so far.
    pub fn delivered(&self) -> u64 {
        self.delivered.get()
    }

    /// The delivery count itself, for lane 0's look (`Deliveries`).
    pub fn deliveries(&self) -> &Deliveries {
        &self.delivered
    }

    /// Queues a notification; refused with `Busy` past a quota, with
    /// `MessageTooLarge` or `InvalidArgument` when the message or the
    /// sender's name is too long.
    pub fn deliver(&self, notification: Notification) -> Result<()> {
        self.deliver_after(notification, || Ok(()))
    }

    /// [`deliver`](Self::deliver), running `before` first for a
    /// notification that passed every size check and quota (its place is
    /// held meanwhile, outside the lock): a refused sender never makes
    /// `before` run, so it cannot buy work (a GPU flush) at any rate.
    /// `before`'s error refuses the notification and frees its place.
    pub fn deliver_after(&self, notification: Notification, before: impl FnOnce() -> Result<()>) -> Result<()> {
        if notification.message.len() > MAX_NOTIFY_BYTES {
            return Err(Error::MessageTooLarge {
                len: notification.message.len() as u64,
                max: MAX_NOTIFY_BYTES as u64,
            });
        }
        if notification.from.len() > MAX_SENDER_BYTES {
            return Err(Error::invalid("notification sender", format!("a name of {} bytes", notification.from.len())));
        }
        let cost = notification.cost();
        let refused = {
            let mut queued = self.queued();
            let refused = self.refusal(&queued, &notification.from, cost);
            if refused.is_none() {
                // Held: counted against the quotas until pushed or freed.
                let (count, bytes) = queued.senders.get(&notification.from).copied().unwrap_or_default();
                queued.senders.insert(notification.from.clone(), (count + 1, bytes + cost));
                queued.bytes += cost;
                queued.held += 1;
            }
            refused
        };
        if let Some((kind, error)) = refused {
            // Logged outside the lock, and limited: a peer can cause this
            // at any rate.
            static LIMITS: [RateLimit; 4] = [const { RateLimit::per_second() }; 4];
            if let Error::Busy { queue, capacity } = &error {
                let from = &notification.from;
                log_limited!(warn, LIMITS[kind], %from, quota = *queue, capacity, "notification refused");
            }
            return Err(error);
        }
        let ran = before();
        {
            let mut queued = self.queued();
            queued.held -= 1;
            match ran {
                Ok(()) => queued.queue.push_back(notification),
                Err(error) => {
                    queued.release(&notification.from, cost);
                    return Err(error);
                }
            }
        }
        // Counted after the push: whoever sees the count finds the message.
        self.delivered.count();
        if let Some(hook) = self.on_delivery.get() {
            hook();
        }
        Ok(())
    }

    /// Why `from`'s notification of `cost` bytes does not fit, if it does
    /// not: the kind of quota (an index for its log rate limit) and the error.
    fn refusal(&self, queued: &Queued, from: &str, cost: usize) -> Option<(usize, Error)> {
        let quota = self.quota;
        let (count, bytes) = queued.senders.get(from).copied().unwrap_or_default();
        let (kind, queue, capacity) = if queued.queue.len() + queued.held >= quota.total {
            (0, "notification queue", quota.total)
        } else if queued.bytes + cost > quota.total_bytes {
            (1, "notification queue bytes", quota.total_bytes)
        } else if count >= quota.per_sender {
            (2, "notifications from one sender", quota.per_sender)
        } else if bytes + cost > quota.per_sender_bytes {
            (3, "notification bytes from one sender", quota.per_sender_bytes)
        } else {
            return None;
        };
        Some((kind, Error::Busy { queue, capacity }))
    }

    /// The oldest notification, if any.
    pub fn poll(&self) -> Option<Notification> {
        let mut queued = self.queued();
        let notification = queued.queue.pop_front()?;
        let cost = notification.cost();
        queued.release(&notification.from, cost);
        Some(notification)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(from: &str, message: &str) -> Notification {
        Notification { from: from.into(), message: message.as_bytes().to_vec() }
    }

    #[test]
    fn quotas_hold_per_sender_and_in_total_and_order_is_kept() {
        let quota = NotifyQuota { total: 3, total_bytes: 1000, per_sender: 2, per_sender_bytes: 1000 };
        let queue = NotificationQueue::new(quota);
        queue.deliver(n("p", "a")).unwrap();
        queue.deliver(n("p", "b")).unwrap();
        let error = queue.deliver(n("p", "c")).unwrap_err();
        assert!(matches!(error, Error::Busy { queue: "notifications from one sender", capacity: 2 }), "{error}");
        // Another sender still gets through, up to the total.
        queue.deliver(n("q", "x")).unwrap();
        assert!(matches!(queue.deliver(n("r", "y")), Err(Error::Busy { queue: "notification queue", capacity: 3 })));
        assert_eq!(queue.poll().unwrap().message, b"a");
        // Polling frees the sender's share.
        queue.deliver(n("p", "c")).unwrap();
        let order: Vec<_> = std::iter::from_fn(|| queue.poll()).map(|n| n.message).collect();
        assert_eq!(order, [b"b".to_vec(), b"x".to_vec(), b"c".to_vec()]);
        assert_eq!(queue.delivered(), 4, "refused messages are not counted");
    }

    #[test]
    fn byte_quotas_and_size_limits_refuse_with_clear_errors() {
        let quota = NotifyQuota { total: 100, total_bytes: 50, per_sender: 100, per_sender_bytes: 30 };
        let queue = NotificationQueue::new(quota);
        queue.deliver(n("p", &"a".repeat(20))).unwrap();
        assert!(matches!(
            queue.deliver(n("p", &"a".repeat(20))),
            Err(Error::Busy { queue: "notification bytes from one sender", .. })
        ));
        queue.deliver(n("q", &"a".repeat(20))).unwrap();
        assert!(matches!(
            queue.deliver(n("r", "abcdefghij")),
            Err(Error::Busy { queue: "notification queue bytes", .. })
        ));
        let huge = Notification { from: "p".into(), message: vec![0; MAX_NOTIFY_BYTES + 1] };
        assert!(matches!(queue.deliver(huge), Err(Error::MessageTooLarge { .. })));
        let long_name = Notification { from: "p".repeat(MAX_SENDER_BYTES + 1), message: vec![] };
        assert!(queue.deliver(long_name).unwrap_err().to_string().contains("notification sender"));
    }

    #[test]
    fn before_runs_only_for_a_notification_within_its_quotas_and_its_error_frees_the_place() {
        let quota = NotifyQuota { total: 10, total_bytes: 1000, per_sender: 1, per_sender_bytes: 1000 };
        let queue = NotificationQueue::new(quota);
        let ran = std::cell::Cell::new(0);
        let before = || {
            ran.set(ran.get() + 1);
            Ok(())
        };
        queue.deliver_after(n("p", "a"), before).unwrap();
        assert!(matches!(queue.deliver_after(n("p", "b"), before), Err(Error::Busy { .. })));
        assert!(queue.deliver_after(n("p", &"x".repeat(MAX_NOTIFY_BYTES + 1)), before).is_err());
        assert_eq!(ran.get(), 1, "an over-quota or oversized notification runs nothing");
        let failed = queue.deliver_after(n("q", "c"), || Err(Error::Shutdown));
        assert!(matches!(failed, Err(Error::Shutdown)));
        queue.deliver(n("q", "d")).unwrap();
        let order: Vec<_> = std::iter::from_fn(|| queue.poll()).map(|n| n.message).collect();
        assert_eq!(order, [b"a".to_vec(), b"d".to_vec()], "the failed one's place was freed, nothing queued");
        assert_eq!(queue.delivered(), 2);
    }
}
