//! The registration cache's hit where memory is slow: working sets whose thread table no
//! longer fits the CPU caches, beside the memory floor of the same accesses.
//!
//! ```text
//! cargo run --release -p mrkit --example hit_memory_bound -- 262144
//! MRKIT_MAX_MR=2000000 cargo run --release -p mrkit --example hit_memory_bound -- 1048576
//! ```
//!
//! `mrkit bench pool-cache` stops at 65,536 buffers, whose 8 MiB table sits in this kind of
//! machine's L3: how fast a hit is there depends on the machine's state (a VM's neighbours)
//! as much as on the cache. Here the table is 32 MiB (262,144 buffers) or 128 MiB
//! (1,048,576), so every hit pays a DRAM access, as in a slow state, and what decides the
//! cost is how many lookups the CPU overlaps — the hit's instruction count. The floor
//! (`HitFloor`) makes the same memory accesses without the cache around them, in the same
//! loop (the buffer's slice, a handle-sized value kept; since session 20). It registers
//! N 4 KiB buffers of one mapping (N x 4 KiB pinned: 1 GiB for 262,144; the soft device's
//! default `max_mr` is 524,287), warms the thread's table, then times 2^20 lookups in random
//! order, 7 times alternating with the floor, and prints the medians.
use std::hint::black_box;
use std::time::Instant;

use mrkit::cache::test_support::{random_order, warm_cache, HitFloor};
use mrkit::AccessFlags;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 262_144,
    };
    let (cache, mem) = warm_cache(n)?;
    let all = mem.as_slice();
    let base = all.as_ptr() as u64;
    let page = |i: u32| &all[i as usize * 4096..][..4096];
    let floor = HitFloor::new(base, n);
    for i in random_order(n, 2 * n, 9) {
        black_box(floor.hit(base + u64::from(i) * 4096, 4096));
    }
    let before = cache.stats();
    let (mut hit, mut bare) = (Vec::new(), Vec::new());
    for round in 0..7 {
        let order = random_order(n, 1 << 20, 11 + round);
        let t0 = Instant::now();
        for &i in &order {
            let h = cache
                .get_ref(page(black_box(i)), AccessFlags::empty())
                .expect("cache get");
            black_box(&h);
        }
        hit.push(t0.elapsed().as_nanos() as f64 / order.len() as f64);
        let t0 = Instant::now();
        // The cache's loop around the floor's accesses: the same slice, and a value of a
        // handle's size kept by reference.
        for &i in &order {
            let mem = page(black_box(i));
            let hit = floor.hit(mem.as_ptr() as u64, mem.len() as u64);
            black_box(&(hit, mem));
        }
        bare.push(t0.elapsed().as_nanos() as f64 / order.len() as f64);
    }
    let after = cache.stats();
    let (hit, bare) = (median(hit), median(bare));
    println!(
        "{n} buffers: hit {hit:.1} ns, floor {bare:.1} ns, hit / floor {:.2}; \
         {} misses and {} per-thread hits while timed",
        hit / bare,
        after.misses - before.misses,
        after.fast_hits - before.fast_hits,
    );
    Ok(())
}
