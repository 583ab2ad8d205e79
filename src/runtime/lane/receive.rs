//! A target's receive completions (the RDMA receives that count arrivals),
//! polled from this lane's loop: once a round while the lane is busy (an
//! empty CQ costs one look), and waited on in the lane's poller when it
//! parks, armed first so that the next arrival wakes it.

use super::poll::Lane;
use crate::transport::{Receiver, RECEIVER_KEY};
use mio::unix::SourceFd;
use mio::Interest;

impl Lane {
    /// Takes `receiver`'s descriptors into the poller and polls it from now on.
    pub(super) fn adopt_receiver(&mut self, receiver: Box<dyn Receiver>) {
        for fd in receiver.wake_fds() {
            // A descriptor the poller refuses leaves the receiver polled
            // while the lane is busy and at each park's timeout.
            let _ = self.poller.registry().register(&mut SourceFd(&fd), RECEIVER_KEY, Interest::READABLE);
        }
        self.receiver = Some(receiver);
    }

    /// Takes what arrived; how many completions.
    pub(super) fn poll_receiver(&mut self) -> usize {
        self.receiver.as_mut().map_or(0, |receiver| receiver.poll())
    }

    /// Before parking: arms the receiver's wake-up; true when something
    /// arrived meanwhile (taken: the lane keeps polling).
    pub(super) fn arm_receiver(&mut self) -> bool {
        self.receiver.as_mut().is_some_and(|receiver| receiver.arm())
    }
}
