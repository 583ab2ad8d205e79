//! loom models: every interleaving of the rings, the status table, the
//! doorbell and the notification-CQE handshake, with capacities shrunk so the models reach wrap-around.
#![cfg(loom)]

use kvring_loom::doorbell::Doorbell;
use kvring_loom::spsc::{channel, Full};
use kvring_loom::status::{BatchState, PartEnd, StatusTable};
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use std::time::Duration;

/// Pushes `values` in order, yielding while the ring is full.
fn push_all(tx: &mut kvring_loom::spsc::Producer<u32>, values: &[u32]) {
    for &v in values {
        let mut value = v;
        loop {
            match tx.push(value) {
                Ok(()) => break,
                Err(Full(back)) => {
                    value = back;
                    thread::yield_now();
                }
            }
        }
    }
}

#[test]
fn wrap_around_keeps_order_and_loses_nothing() {
    loom::model(|| {
        let (mut tx, mut rx) = channel::<u32>(2);
        let producer = thread::spawn(move || push_all(&mut tx, &[1, 2, 3]));
        let mut got = Vec::new();
        while got.len() < 3 {
            match rx.pop() {
                Some(v) => got.push(v),
                None => thread::yield_now(),
            }
        }
        producer.join().unwrap();
        assert_eq!(got, [1, 2, 3]);
        assert_eq!(rx.pop(), None);
    });
}

#[test]
fn a_full_ring_hands_the_entry_back_until_the_consumer_frees_a_slot() {
    loom::model(|| {
        let (mut tx, mut rx) = channel::<u32>(1);
        tx.push(1).unwrap();
        let consumer = thread::spawn(move || {
            let v = loop {
                if let Some(v) = rx.pop() {
                    break v;
                }
                thread::yield_now();
            };
            (v, rx)
        });
        // Either still full (handed back) or free after the pop.
        match tx.push(2) {
            Ok(()) => {}
            Err(Full(v)) => assert_eq!(v, 2),
        }
        let (first, mut rx) = consumer.join().unwrap();
        assert_eq!(first, 1);
        let _ = rx.pop();
    });
}

#[test]
fn an_empty_ring_reads_nothing_or_the_whole_entry() {
    loom::model(|| {
        let (mut tx, mut rx) = channel::<u32>(2);
        let producer = thread::spawn(move || {
            tx.push(7).unwrap();
        });
        let seen = rx.pop();
        assert!(seen.is_none() || seen == Some(7));
        producer.join().unwrap();
        if seen.is_none() {
            assert_eq!(rx.pop(), Some(7));
        }
    });
}

#[test]
fn a_committed_chunk_appears_all_at_once() {
    loom::model(|| {
        let (mut tx, mut rx) = channel::<u32>(2);
        let producer = thread::spawn(move || {
            let mut chunk = tx.write_chunk(2).unwrap();
            chunk.push(10).unwrap();
            chunk.push(11).unwrap();
            chunk.commit();
        });
        let first: Vec<u32> = rx.read_chunk(2).collect();
        assert!(first.is_empty() || first == [10, 11], "saw a partial batch: {first:?}");
        producer.join().unwrap();
        let rest: Vec<u32> = rx.read_chunk(2).collect();
        let mut all = first;
        all.extend(rest);
        assert_eq!(all, [10, 11]);
    });
}

struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn dropping_a_ring_with_entries_inside_drops_each_once() {
    loom::model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let (mut tx, mut rx) = channel::<Counted>(2);
        tx.push(Counted(drops.clone())).ok().unwrap();
        tx.push(Counted(drops.clone())).ok().unwrap();
        let consumer = thread::spawn(move || {
            drop(rx.pop());
            drop(rx);
        });
        drop(tx);
        consumer.join().unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 2);
    });
}

fn code(state: BatchState, failure: Option<&u32>) -> i32 {
    failure.map_or(-(state as i32), |f| -(*f as i32))
}

#[test]
fn two_lane_parts_publish_one_terminal_state_with_every_byte() {
    loom::model(|| {
        let table = Arc::new(StatusTable::<u32>::new(1, 3));
        let id = table.begin(0, 2);
        let lane = |bytes: u64, end: fn() -> PartEnd<u32>| {
            let table = table.clone();
            thread::spawn(move || table.finish_part(id, bytes, end(), code))
        };
        let a = lane(100, || PartEnd::Done);
        let b = lane(28, || PartEnd::Failed(77));
        // A reader polling meanwhile sees Pending or the final state only.
        let seen = table.state(id).unwrap();
        assert!(seen == BatchState::Pending || seen == BatchState::Failed);
        let (a, b) = (a.join().unwrap(), b.join().unwrap());
        let completion = a.xor(b).expect("exactly one part completes the batch");
        assert_eq!(completion.state, BatchState::Failed);
        assert_eq!(completion.bytes, 128);
        assert_eq!(completion.result, -77);
        let finished = table.take(id).unwrap().unwrap();
        assert_eq!(finished.failure, Some(77));
        assert_eq!(finished.bytes, 128);
        assert!(table.state(id).is_err(), "consumed id is stale");
    });
}

#[test]
fn two_failures_keep_the_first_and_free_the_second() {
    loom::model(|| {
        let table = Arc::new(StatusTable::<Box<u32>>::new(1, 0));
        let id = table.begin(0, 2);
        let spawn = |v: u32| {
            let table = table.clone();
            thread::spawn(move || table.finish_part(id, 0, PartEnd::Failed(Box::new(v)), |_, _| -1))
        };
        let (a, b) = (spawn(1), spawn(2));
        let done = a.join().unwrap().is_some() as u32 + b.join().unwrap().is_some() as u32;
        assert_eq!(done, 1);
        let failure = table.take(id).unwrap().unwrap().failure.unwrap();
        assert!(*failure == 1 || *failure == 2);
    });
}

#[test]
fn the_doorbell_never_loses_a_wake_up() {
    loom::model(|| {
        let work = Arc::new(AtomicBool::new(false));
        let bell_slot: Arc<loom::sync::Mutex<Option<Arc<Doorbell>>>> = Arc::new(loom::sync::Mutex::new(None));
        let lane_bell = bell_slot.clone();
        let lane_work = work.clone();
        // The lane parks until it sees work; a lost wake-up is a deadlock,
        // which loom reports. It counts its parks: one ring ends at most
        // one sleep.
        let lane = thread::spawn(move || {
            let bell = Arc::new(Doorbell::for_current_thread());
            *lane_bell.lock().unwrap() = Some(bell.clone());
            let mut parks = 0;
            while !lane_work.load(Ordering::Acquire) {
                parks += u32::from(bell.park(Duration::from_secs(1), || lane_work.load(Ordering::Acquire)));
            }
            parks
        });
        // Submitter: wait for the doorbell to exist, publish, ring.
        let bell = loop {
            if let Some(bell) = bell_slot.lock().unwrap().clone() {
                break bell;
            }
            thread::yield_now();
        };
        work.store(true, Ordering::Release);
        bell.ring();
        let parks = lane.join().unwrap();
        assert!(parks <= 1, "the lane slept {parks} times on one ring");
    });
}

/// The production form: the lane sleeps in its poller (here the model of
/// its eventfd waker), exactly as `Lane::park` calls `park_with`.
#[test]
fn the_doorbell_wakes_a_lane_asleep_in_its_poller_and_never_loses_the_wake() {
    use kvring_loom::poller;
    loom::model(|| {
        let (poller, waker) = poller::pair();
        let bell = Arc::new(Doorbell::for_poller(waker));
        let work = Arc::new(AtomicBool::new(false));
        let lane = {
            let (bell, work) = (bell.clone(), work.clone());
            thread::spawn(move || {
                let (mut parks, mut wakes) = (0u32, 0u64);
                while !work.load(Ordering::Acquire) {
                    let parked = bell.park_with(
                        Duration::from_secs(1),
                        || work.load(Ordering::Acquire),
                        |timeout| wakes += poller.wait(timeout),
                    );
                    parks += u32::from(parked);
                }
                (parks, wakes, poller)
            })
        };
        work.store(true, Ordering::Release);
        bell.ring();
        let (parks, wakes, poller) = lane.join().unwrap();
        // A sleep ends only on a wake (a lost one deadlocks the model), and
        // there is one ring: at most one sleep, one wake consumed by it, and
        // every wake either consumed or still pending for the next wait.
        assert!(parks <= 1, "the lane slept {parks} times on one ring");
        assert_eq!(u64::from(parks), wakes, "each sleep consumed the ring's wake");
        assert!(wakes + poller.pending() <= 1, "one ring, at most one wake");
    });
}

/// The notification handshake, through the very `Deliveries` count and
/// `NotificationWatch` claim the queue and lane 0 use (src/runtime/watch.rs):
/// the deliverer queues then counts (`NotificationQueue::deliver`), lane 0
/// looks at the count and claims a CQE (`Lane::announce_notifications`), the
/// submitter releases the claim on reaping the CQE, then drains the queue
/// (`Submitter::reap`). The queue itself (a mutex) is a counter here.
#[test]
fn a_notification_is_never_left_without_a_cqe() {
    use kvring_loom::delivered::Deliveries;
    use kvring_loom::watch::NotificationWatch;
    use loom::sync::atomic::AtomicU32;
    loom::model(|| {
        let watch = Arc::new(NotificationWatch::new());
        watch.set(true);
        let queued = Arc::new(AtomicU32::new(0));
        let deliveries = Arc::new(Deliveries::new());
        let cqes = Arc::new(AtomicU32::new(0));

        // Lane 0's look, as `announce_notifications` makes it for one ring.
        let lane_pass = {
            let (watch, deliveries, cqes) = (watch.clone(), deliveries.clone(), cqes.clone());
            move |seen: &mut u64| {
                if deliveries.changed_since(seen) && watch.claim_post() {
                    cqes.fetch_add(1, Ordering::Release);
                }
            }
        };
        // A connection thread delivers two messages: push, then count.
        let deliverer = {
            let (queued, deliveries) = (queued.clone(), deliveries.clone());
            thread::spawn(move || {
                for _ in 0..2 {
                    queued.fetch_add(1, Ordering::AcqRel);
                    deliveries.count();
                }
            })
        };
        let lane = {
            let lane_pass = lane_pass.clone();
            thread::spawn(move || {
                let mut seen = 0;
                lane_pass(&mut seen);
                lane_pass(&mut seen);
                seen
            })
        };
        // The submitter reaps a CQE, releases the claim, then drains.
        for _ in 0..2 {
            if cqes.load(Ordering::Acquire) > 0 {
                cqes.fetch_sub(1, Ordering::AcqRel);
                watch.reaped();
                queued.swap(0, Ordering::AcqRel);
            }
        }
        deliverer.join().unwrap();
        let mut seen = lane.join().unwrap();
        // The lane keeps looking; once it has, every message is either
        // drained or announced by a CQE still in the ring.
        lane_pass(&mut seen);
        assert!(queued.load(Ordering::Acquire) == 0 || cqes.load(Ordering::Acquire) > 0, "a message without a CQE");
    });
}

/// Two lanes land bytes under one new tag while the owner forgets another
/// tag on the same probe path: every byte is counted, whatever slot each
/// landing took, and a reader never sees a count fall.
#[test]
fn arrivals_count_every_byte_while_slots_are_freed() {
    use kvring_loom::arrival::Arrivals;
    loom::model(|| {
        let arrivals = Arc::new(Arrivals::new());
        assert!(arrivals.land(9, 5));
        let lanes: Vec<_> = [1u64, 2]
            .into_iter()
            .map(|bytes| {
                let arrivals = arrivals.clone();
                thread::spawn(move || assert!(arrivals.land(7, bytes)))
            })
            .collect();
        let owner = {
            let arrivals = arrivals.clone();
            thread::spawn(move || assert_eq!(arrivals.forget(9), 5))
        };
        let first = arrivals.landed(7);
        let second = arrivals.landed(7);
        assert!(first <= second && second <= 3);
        lanes.into_iter().for_each(|lane| lane.join().unwrap());
        owner.join().unwrap();
        assert_eq!(arrivals.landed(7), 3);
        assert_eq!(arrivals.landed(9), 0);
    });
}
