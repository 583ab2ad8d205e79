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

fn kvring_single(items: u64) -> Duration {
    let (mut tx, mut rx) = kvring::testing::ring::channel::<u64>(CAPACITY);
    two_threads(
        items,
        move |n| {
            for i in 0..n {
                let mut v = i;
                while let Err(kvring::testing::ring::Full(back)) = tx.push(v) {
                    v = back;
                    std::hint::spin_loop();
                }
            }
        },
        move |n| {
            let mut got = 0;
            while got < n {
                if let Some(v) = rx.pop() {
                    debug_assert_eq!(v, got);
                    got += 1;
                }
            }
        },
    )
}

fn kvring_batched(items: u64) -> Duration {
    let (mut tx, mut rx) = kvring::testing::ring::channel::<u64>(CAPACITY);
    two_threads(
        items,
        move |n| {
            let mut next = 0;
            while next < n {
                let want = (CHUNK as u64).min(n - next) as usize;
                if let Ok(mut chunk) = tx.write_chunk(want) {
                    for value in next..next + want as u64 {
                        let _ = chunk.push(value);
                    }
                    next += want as u64;
                    chunk.commit();
                } else {
                    std::hint::spin_loop();
                }
            }
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
        move |n| {
            for i in 0..n {
                let mut v = i;
                while let Err(rtrb::PushError::Full(back)) = tx.push(v) {
                    v = back;
                    std::hint::spin_loop();
                }
            }
        },
        move |n| {
            let mut got = 0;
            while got < n {
                if rx.pop().is_ok() {
                    got += 1;
                }
            }
        },
    )
}

fn rtrb_batched(items: u64) -> Duration {
    let (mut tx, mut rx) = rtrb::RingBuffer::<u64>::new(CAPACITY);
    two_threads(
        items,
        move |n| {
            let mut next = 0;
            while next < n {
                let want = (CHUNK as u64).min(n - next) as usize;
                if let Ok(chunk) = tx.write_chunk_uninit(want) {
                    let start = next;
                    chunk.fill_from_iter(start..start + want as u64);
                    next += want as u64;
                } else {
                    std::hint::spin_loop();
                }
            }
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
    two_threads(
        items,
        move |n| {
            for i in 0..n {
                let mut v = i;
                while let Err(back) = producer_queue.push(v) {
                    v = back;
                    std::hint::spin_loop();
                }
            }
        },
        move |n| {
            let mut got = 0;
            while got < n {
                if queue.pop().is_some() {
                    got += 1;
                }
            }
        },
    )
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
