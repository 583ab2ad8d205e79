//! A lane that panicked. It fails loudly: the panic is logged with its
//! message and counted, the lane is marked dead, every part (and
//! notification) it held ends with [`Error::LaneDied`](crate::Error::LaneDied) naming it, and from
//! then on it only refuses: submitters see the error before they queue
//! anything, and what was already queued ends with it too.
//!
//! Restarting the lane instead would mean trusting the tables the panic
//! interrupted; nothing here does. A part whose chunks a link cannot be
//! shown to have ended (a copy the lane can no longer follow) keeps its
//! leases forever, so its regions can never be unregistered and reused
//! while something may still write them.

use super::super::status::PartEnd;
use super::links::{acknowledge, Links};
use super::poll::Lane;
use super::shared::LaneCommand;
use crate::desc::RegionId;
use crate::ring::Sqe;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};

impl Lane {
    /// Ends the lane's work after a panic, then refuses work until the
    /// engine stops it.
    pub(super) fn die_and_refuse(&mut self, payload: Box<dyn Any + Send>) {
        self.die(&*payload);
        if let Err(again) = catch_unwind(AssertUnwindSafe(|| self.refuse_until_stopped())) {
            // Nothing of the lane is used after this: the engine's submitters
            // already see it dead, and what it still held waits for its
            // deadline.
            tracing::error!(
                lane = self.config.index,
                panic = %panic_message(&*again),
                "a dead lane panicked again while refusing work; it exits"
            );
        }
    }

    /// Marks the lane dead and ends what it held.
    fn die(&mut self, payload: &(dyn Any + Send)) {
        let reason = panic_message(payload);
        tracing::error!(
            lane = self.config.index,
            panic = %reason,
            "lane panicked: the batches it held end with LaneDied and it takes no new work"
        );
        if self.shared.death.set(reason).is_ok() {
            self.shared.metrics.panicked();
        }
        // Set before the links are aborted: whatever a link reports for a
        // chunk, its part ends with the lane's error.
        for ticket in self.tickets.iter_mut().filter(|t| t.live) {
            ticket.end = Some(PartEnd::Failed(self.shared.died().expect("marked dead above")));
        }
        // Through each link's own abort: its chunks end, its connections
        // close, and the leases of the parts they carried go back.
        let aborted = catch_unwind(AssertUnwindSafe(|| self.abort_all("its lane panicked"))).is_ok();
        let mut kept = 0;
        for index in 0..self.tickets.len() {
            let ticket = &mut self.tickets[index];
            if !ticket.live {
                continue;
            }
            if ticket.outstanding > 0 || !aborted {
                // Memory its chunks name may still be written by a copy
                // the lane can no longer follow: the leases stay taken.
                kept += ticket.leases.len();
                ticket.leases.clear();
            }
            ticket.outstanding = 0;
            ticket.end = Some(PartEnd::Failed(self.shared.died().expect("marked dead above")));
            if catch_unwind(AssertUnwindSafe(|| self.end_ticket(index))).is_err() {
                self.tickets[index].live = false;
            }
        }
        self.free_tickets = (0..self.tickets.len() as u32).rev().collect();
        let links = std::mem::replace(&mut self.links, Links::new(0, None));
        if kept > 0 || !aborted {
            tracing::error!(
                lane = self.config.index,
                leases = kept,
                "a dead lane's links may still have copies in flight: they and their regions' leases are kept"
            );
            std::mem::forget(links);
        } else {
            let _ = catch_unwind(AssertUnwindSafe(|| drop(links)));
        }
        if let Some(mut service) = self.service.take() {
            let registry = self.poller.registry();
            let _ = catch_unwind(AssertUnwindSafe(|| service.close_all(registry)));
        }
        let _ = catch_unwind(AssertUnwindSafe(|| self.receiver = None));
        self.next_tick = None;
    }

    /// The dead lane's loop: ends every SQE that still reaches it with
    /// [`Error::LaneDied`](crate::Error::LaneDied), answers commands that wait for an answer, and
    /// parks in between; exits when the engine stops it.
    fn refuse_until_stopped(&mut self) {
        loop {
            let mut worked = self.take_commands();
            self.flush_cq_backlog();
            worked += self.announce_notifications();
            for index in 0..self.rings.len() {
                while let Some(sqe) = self.rings[index].as_mut().and_then(|slot| slot.rings.sq.pop()) {
                    self.refuse_part(index, sqe);
                    worked += 1;
                }
            }
            if worked > 0 {
                continue;
            }
            if self.shared.stopping() {
                return;
            }
            self.park();
        }
    }

    /// Ends one part that reached the dead lane: its descriptors leave the
    /// arena and their leases go back (none of them moved), and its batch
    /// learns the lane's error.
    fn refuse_part(&mut self, ring_index: usize, sqe: Sqe) {
        let Some(slot) = self.rings[ring_index].as_mut() else { return };
        let descs = &mut slot.rings.descs;
        // A part the panic cut short may have left descriptors in the
        // arena; they are skipped (that part's leases stay kept).
        let behind = (sqe.desc_position as usize).wrapping_sub(descs.position());
        if behind <= descs.slots() {
            descs.read_chunk(behind).for_each(drop);
        }
        let mut run: Option<RegionId> = None;
        let mut runs = Vec::new();
        for desc in descs.read_chunk(sqe.desc_count as usize) {
            if run != Some(desc.local_region) {
                runs.extend(run);
                run = Some(desc.local_region);
            }
        }
        for region in runs.into_iter().chain(run) {
            // SAFETY: the submitter kept one lease per run of this part for
            // the lane; no block of the part moved, and each is given back
            // once, here.
            unsafe { self.registry.release_kept(region) };
        }
        let Some(index) = self.free_tickets.pop() else { return };
        slot.tickets += 1;
        let ticket = &mut self.tickets[index as usize];
        *ticket = super::execute::Ticket::new();
        ticket.ring = ring_index;
        ticket.sqe = sqe;
        ticket.end = Some(PartEnd::Failed(self.shared.died().expect("only a dead lane refuses")));
        ticket.live = true;
        self.end_ticket(index as usize);
    }

    /// What a dead lane does with a command: it still takes submitters'
    /// rings (to refuse what they queue), answers those that wait, and
    /// drops the rest.
    pub(super) fn dead_command(&mut self, command: LaneCommand) {
        match command {
            LaneCommand::AttachSubmitter(rings) => self.attach_submitter(*rings),
            LaneCommand::DetachSegment { done, .. } => acknowledge(done),
            LaneCommand::Notify { reply, .. } => {
                let _ = reply.send(Err(self.shared.died().expect("only a dead lane is sent here")));
            }
            LaneCommand::AttachSegment { .. }
            | LaneCommand::Serve(_)
            | LaneCommand::Receive(_)
            | LaneCommand::Adopt { .. }
            | LaneCommand::Evict { .. } => {}
        }
    }
}

/// A panic's message: the `&str` or `String` it was raised with.
pub(super) fn panic_message(payload: &(dyn Any + Send)) -> String {
    match (payload.downcast_ref::<&str>(), payload.downcast_ref::<String>()) {
        (Some(text), _) => (*text).to_string(),
        (_, Some(text)) => text.clone(),
        (None, None) => "a panic with no message".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panics_message_is_found_whatever_it_was_raised_with() {
        let by_str = catch_unwind(|| panic!("plain")).unwrap_err();
        assert_eq!(panic_message(&*by_str), "plain");
        let by_string = catch_unwind(|| panic!("formatted {}", 7)).unwrap_err();
        assert_eq!(panic_message(&*by_string), "formatted 7");
        let by_value = catch_unwind(|| std::panic::panic_any(7u32)).unwrap_err();
        assert_eq!(panic_message(&*by_value), "a panic with no message");
    }
}
