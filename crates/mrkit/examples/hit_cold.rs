//! The registration cache's hit when the application's own work has swept the CPU's caches
//! and TLB between lookups, beside the memory floor of the same accesses.
//!
//! ```text
//! cargo run --release -p mrkit --example hit_cold -- 65536
//! ```
//!
//! Between two lookups the program reads 64 MiB of other memory (twice this machine's L3),
//! so each lookup finds every line and page it touches gone: the table cell, as for the
//! floor (`HitFloor`), and whatever else the hit reads (the thread's current slot, the
//! counter, the monitor sequence). Each lookup is timed alone, fenced on both sides; the
//! medians of 1,000 lookups are printed, with their difference. This is the shape where
//! the VM's slow state hurt the cache more than the floor (docs/cache.md, session 21), and
//! the one that measures how many lines a hit needs besides its cell.
use std::hint::black_box;
use std::time::Instant;

use mrkit::cache::test_support::{buffers_arg, median, random_order, serialize, WarmCache};

/// Read one word of every line of `work` (the application's other work).
fn sweep(work: &[u64]) -> u64 {
    work.iter().step_by(8).fold(0u64, |s, &w| s.wrapping_add(w))
}

/// `f` timed alone: no earlier or later instruction overlaps it.
fn timed(f: impl FnOnce()) -> f64 {
    serialize();
    let t0 = Instant::now();
    serialize();
    f();
    serialize();
    t0.elapsed().as_nanos() as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n = buffers_arg(65_536)?;
    let w = WarmCache::new(n)?;
    let work = vec![1u64; 8 << 20];
    let before = w.cache.stats();
    let (mut hit, mut bare) = (Vec::new(), Vec::new());
    for &i in &random_order(n, 1000, 5) {
        black_box(sweep(&work));
        hit.push(timed(|| w.hit(i)));
        black_box(sweep(&work));
        bare.push(timed(|| w.floor_hit(i)));
    }
    let after = w.cache.stats();
    let (hit, bare) = (median(hit), median(bare));
    println!(
        "{n} buffers, caches swept before each lookup: hit {hit:.0} ns, floor {bare:.0} ns, \
         hit - floor {:.0} ns; {} misses and {} per-thread hits while timed",
        hit - bare,
        after.misses - before.misses,
        after.fast_hits - before.fast_hits,
    );
    Ok(())
}
