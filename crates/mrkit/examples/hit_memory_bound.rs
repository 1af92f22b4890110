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
use std::time::Instant;

use mrkit::cache::test_support::{buffers_arg, median, random_order, WarmCache};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n = buffers_arg(262_144)?;
    let w = WarmCache::new(n)?;
    for i in random_order(n, 2 * n, 9) {
        w.floor_hit(i);
    }
    let before = w.cache.stats();
    let (mut hit, mut bare) = (Vec::new(), Vec::new());
    for round in 0..7 {
        let order = random_order(n, 1 << 20, 11 + round);
        let t0 = Instant::now();
        for &i in &order {
            w.hit(i);
        }
        hit.push(t0.elapsed().as_nanos() as f64 / order.len() as f64);
        let t0 = Instant::now();
        for &i in &order {
            w.floor_hit(i);
        }
        bare.push(t0.elapsed().as_nanos() as f64 / order.len() as f64);
    }
    let after = w.cache.stats();
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
