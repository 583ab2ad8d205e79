//! The SPSC ring against rtrb and crossbeam's ArrayQueue, in the same run:
//! two threads moving u64s, one at a time and in chunks of 32.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::time::{Duration, Instant};

const ITEMS_PER_ITER: u64 = 4096;
const CAPACITY: usize = 1024;
const CHUNK: usize = 32;

/// Runs `produce` and `consume` on two threads pinned to two cores (both
/// spawned fresh, so neither inherits a pinned mask), and times the whole.
fn two_threads(
    items: u64,
    produce: impl FnOnce(u64) + Send + 'static,
    consume: impl FnOnce(u64) + Send + 'static,
) -> Duration {
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let pinned = |index: usize| {
        let core = cores.get(index).copied();
        move || {
            if let Some(core) = core {
                core_affinity::set_for_current(core);
            }
        }
    };
    let (pin_consumer, pin_producer) = (pinned(0), pinned(1));
    let started = Instant::now();
    let producer = std::thread::spawn(move || {
        pin_producer();
        produce(items)
    });
    let consumer = std::thread::spawn(move || {
        pin_consumer();
        consume(items)
    });
    producer.join().unwrap();
    consumer.join().unwrap();
    started.elapsed()
}

/// The one-at-a-time producer: pushes `0..n` in order, spinning while the
/// queue is full (`push` hands a refused value back).
fn push_each(n: u64, mut push: impl FnMut(u64) -> Result<(), u64>) {
    for i in 0..n {
        let mut v = i;
        while let Err(back) = push(v) {
            v = back;
            std::hint::spin_loop();
        }
    }
}

/// The batched producer: offers `0..n` in order, `CHUNK` values at a time,
/// spinning while `push` refuses a chunk (the ring has no room for it).
fn push_chunks(n: u64, mut push: impl FnMut(std::ops::Range<u64>) -> bool) {
    let mut next = 0;
    while next < n {
        let want = (CHUNK as u64).min(n - next);
        if push(next..next + want) {
            next += want;
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The one-at-a-time consumer: pops until `n` values came, in order.
fn pop_each(n: u64, mut pop: impl FnMut() -> Option<u64>) {
    let mut got = 0;
    while got < n {
        if let Some(v) = pop() {
            debug_assert_eq!(v, got);
            got += 1;
        }
    }
}

fn kvring_single(items: u64) -> Duration {
    let (mut tx, mut rx) = kvring::testing::ring::channel::<u64>(CAPACITY);
    two_threads(
        items,
        move |n| push_each(n, |v| tx.push(v).map_err(|kvring::testing::ring::Full(back)| back)),
        move |n| pop_each(n, || rx.pop()),
    )
}

fn kvring_batched(items: u64) -> Duration {
    let (mut tx, mut rx) = kvring::testing::ring::channel::<u64>(CAPACITY);
    two_threads(
        items,
        move |n| {
            push_chunks(n, |values| match tx.write_chunk((values.end - values.start) as usize) {
                Ok(mut chunk) => {
                    for value in values {
                        let _ = chunk.push(value);
                    }
                    chunk.commit();
                    true
                }
                Err(_) => false,
            })
        },
        move |n| {
            let mut got = 0;
            while got < n {
                let chunk = rx.read_chunk(CHUNK);
                if chunk.len() == 0 {
                    std::hint::spin_loop();
                }
                for v in chunk {
                    debug_assert_eq!(v, got);
                    got += 1;
                }
            }
        },
    )
}

fn rtrb_single(items: u64) -> Duration {
    let (mut tx, mut rx) = rtrb::RingBuffer::<u64>::new(CAPACITY);
    two_threads(
        items,
        move |n| push_each(n, |v| tx.push(v).map_err(|rtrb::PushError::Full(back)| back)),
        move |n| pop_each(n, || rx.pop().ok()),
    )
}

fn rtrb_batched(items: u64) -> Duration {
    let (mut tx, mut rx) = rtrb::RingBuffer::<u64>::new(CAPACITY);
    two_threads(
        items,
        move |n| {
            push_chunks(n, |values| match tx.write_chunk_uninit((values.end - values.start) as usize) {
                Ok(chunk) => {
                    chunk.fill_from_iter(values);
                    true
                }
                Err(_) => false,
            })
        },
        move |n| {
            let mut got = 0;
            while got < n {
                let available = rx.slots().min(CHUNK);
                if available == 0 {
                    std::hint::spin_loop();
                    continue;
                }
                if let Ok(chunk) = rx.read_chunk(available) {
                    for _ in chunk.into_iter() {
                        got += 1;
                    }
                }
            }
        },
    )
}

fn array_queue(items: u64) -> Duration {
    let queue = std::sync::Arc::new(crossbeam_queue::ArrayQueue::<u64>::new(CAPACITY));
    let producer_queue = queue.clone();
    two_threads(items, move |n| push_each(n, |v| producer_queue.push(v)), move |n| pop_each(n, || queue.pop()))
}

/// A variant's name and the function that moves `n` items through it.
type Case = (&'static str, fn(u64) -> Duration);

fn rings(c: &mut Criterion) {
    let mut group = c.benchmark_group("ring");
    group.throughput(Throughput::Elements(ITEMS_PER_ITER));
    group.measurement_time(Duration::from_secs(3));
    let cases: [Case; 5] = [
        ("kvring/batched", kvring_batched),
        ("rtrb/batched", rtrb_batched),
        ("kvring/single", kvring_single),
        ("rtrb/single", rtrb_single),
        ("array_queue/single", array_queue),
    ];
    for (name, run) in cases {
        group.bench_function(BenchmarkId::from_parameter(name), |b| b.iter_custom(|iters| run(iters * ITEMS_PER_ITER)));
    }
    group.finish();
}

criterion_group!(benches, rings);
criterion_main!(benches);
