//! `mrkit bench pool-cache`: the registration services measured in one process.
//!
//! * `pool_alloc_free_ns`: one `MrPool::alloc` + drop of a 4 KiB slot, one thread.
//! * `pool_alloc_free_ns_2threads`: the same, two threads at once (ns per pair per thread).
//! * `owned_slot_same_thread_ns`: one `MrPool::alloc_owned` + drop (a `'static` slot), one
//!   thread: the borrowed figure above plus what owning costs (no reference count is taken).
//! * `owned_slot_cross_thread_ns`: owned slots allocated on one thread and dropped on another
//!   (the posting thread / completion thread shape), handed over 1,024 at a time through a
//!   channel; ns per slot. `pool_slot_cross_thread_ns`: the same with borrowed slots (the
//!   floor: the hand-over and the magazine exchange, without ownership). These three: the
//!   fastest of 5 runs (the machine's other load only ever adds time).
//! * `cache_hit_ns_p50`: median of `RegCache::get_ref` + drop on one cached range, one thread.
//! * `cache_hit_ns_p50_2threads`: the same, two threads hitting the *same* entry at once
//!   (mean of the two threads' medians): the case where a cache line written by every hit
//!   (a shared reference count) bounces between the cores.
//! * Working-set sweep (userfaultfd monitor, page-rounded entries, room for every buffer):
//!   N registered 4 KiB buffers (N = 1, 16, 64, 1,024, 4,096, 65,536); two worker threads
//!   warm up alike (each looks up every buffer once, then max(2N, 4,000) in its random
//!   order); then five rounds, each of which measures, one after the other, the cache's
//!   lookups, the same lookups reading the key, and the memory floor, each as: the first
//!   makes 200,000 lookups (`get` + drop) in a random order alone, timed in batches of
//!   1,000, while the second waits; then the second alone while the first waits; then both
//!   at once. Each timed phase starts with 16N (at
//!   least 4,000) untimed lookups by its threads: a thread that waited at a barrier finds an
//!   8 MiB table at up to 5x its steady cost on this kind of virtual machine for its first
//!   few hundred thousand lookups (the UCX program does the same). A phase's figure is the
//!   median of its batch means; a round's one-thread figure is the mean of the two threads'
//!   alone figures, its two-thread figure the mean of the two at once; each key is the median
//!   over the rounds. One and two threads are thus measured after the same warm-up (before
//!   session 12 the one-thread figure came from the thread that had created the entries,
//!   after more passes than the fresh two-thread pair had made), and next to each other in
//!   time (until session 18 there was one round: the VM's memory state, which moves the
//!   65,536-buffer figure 3x within minutes, then decided the two-thread ÷ one-thread ratio
//!   more than the code did: 0.45 to 2.7 over 8 runs, against 0.99 to 1.01 with rounds).
//!   * `cache_hit_ns_p50_n{N}`: one thread; `cache_hit_ns_p50_n{N}_2threads`: two threads
//!     at once over the same N buffers (each its own random order; mean of the two medians);
//!   * `cache_two_over_one_n{N}` and `hit_floor_two_over_one_n{N}`: what hitting at the
//!     same time as another thread costs per hit, the median of the rounds' two-thread ÷
//!     one-thread ratios, the cache beside the memory floor (also `…_n65536_scattered`);
//!   * `cache_fast_share_n{N}`: share of the one-thread lookups served by the per-thread
//!     path (first round);
//!   * `cache_hit_key_ns_p50_n{N}` (and `_2threads`, `cache_hit_key_isolated_ns_n{N}`): the
//!     same lookups reading the handle's lkey before the drop (`get_ref` + `lkey` + drop), as
//!     a program about to post does; `cache_key_over_ucx_n{N}` (and `_2threads`) divide it
//!     by UCX's figure (whose lookups always read their region's key);
//!   * `cache_hit_isolated_ns_n{N}`: the first thread alone again after its alone phase of
//!     each round, over 50,000 further lookups each followed by `LFENCE` (`serialize`): no overlap between lookups, each pays its
//!     misses in full, as in a program that looks a buffer up and then posts; the same key
//!     for the floor (`hit_floor_isolated_ns_n{N}`) and UCX (`ucx_rcache_hit_isolated_ns_n{N}`),
//!     with `cache_over_floor_isolated_n{N}` and `cache_over_ucx_isolated_n{N}`;
//!   * `hit_floor_ns_n{N}` (and `_2threads`): the memory floor under a hit in the same
//!     protocol and run ([`HitFloor`]: the hit's one line — the thread's lease cell, found
//!     by the lease table's own hash — and its count updates, over a THP-advised array as
//!     large as the cache's table, no cache), in the cache's loop (the same slice of the
//!     buffer, a handle-sized value kept; every loop inlines its lookup, since session 20:
//!     before, the cache's lookup was called out of line and the floor's loop did less
//!     around its call); `cache_over_floor_n{N}` (and
//!     `_2threads`, `_isolated`): the cache over it, the median of the rounds' ratios (the
//!     two are measured in the same rounds, seconds apart: until session 20 each ran its
//!     own five rounds and the VM's slow seconds, which fell on one or the other, moved the
//!     ratio from 1.3 to 5 between runs). At 65,536 buffers (~8 MiB per thread) both are
//!     bound by the memory system, which moves ~3x between states of the VM;
//!   * `ucx_rcache_hit_ns_p50_n{N}` (and `_2threads`): UCX's `ucs_rcache` in the same shape
//!     and the same run, each lookup reading the key its region carries (as a UCX transport
//!     keeps it, right after the rcache's header), with a no-op registration callback
//!     storing it and no memory events, when
//!     `libucx-dev` and a C compiler are installed (a small C program built at run time);
//!     `cache_over_ucx_n{N}` (and `_2threads`): the mrkit figure divided by UCX's.
//! * `cache_cross_thread_drop_ns_n64`, `…_n65536`: the posting thread / completion thread
//!   shape: `get_ref` in random order on one thread, the handles dropped on another,
//!   handed over 1,024 at a time (as `pool_slot_cross_thread_ns`, the hand-over's own cost);
//!   ns per lookup, fastest of 3 runs; `ucx_rcache_cross_thread_drop_ns_n{N}` UCX's rcache
//!   in the same shape (`ucs_rcache_get` here, `ucs_rcache_region_put` there, the batches
//!   handed over through polled queues: no blocking wake-up on UCX's side) and
//!   `cache_cross_thread_drop_over_ucx_n{N}` the ratio.
//! * Scattered shape (`…_n65536_scattered`): the same protocol over 65,536 single-page
//!   buffers at a random page of each 16-page window of one mapping, beside the floor over
//!   the same pages ([`scattered_point`]): the layout the lease table's hash does not place
//!   in home cells; UCX's rcache over the same pages beside it (`ucx_rcache_…_scattered`,
//!   `cache_over_ucx_…_scattered`).
//! * `cache_bytes_per_entry`: resident memory the process gains per entry while 65,536
//!   entries are created (cache and device state: index, per-thread table, MR), and
//!   `ucx_rcache_bytes_per_entry` for UCX's cache (no device behind it).
//! * `cache_miss_overhead_ns`: a miss (get + drop + invalidate, i.e. register + deregister
//!   through the cache) minus a bare `reg_mr` + `dereg_mr` of the same range (medians).
//! * `per_message_reg_ns` / `pooled_ns`: the seed scenario, 16384 messages of 4 KiB: one
//!   `reg_mr` + `dereg_mr` per message vs pool slot alloc + SGE + hold + free. The
//!   payload write is identical work on both sides and is *excluded* from these two keys
//!   (on small VMs it is memory-bandwidth bound, ~1 µs per cold 4 KiB, and would hide the
//!   registration cost the seed measured); the human output also shows both with the write.
//!   Data correctness of the scenario is verified by `tests/pool_basic.rs`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use mrkit::cache::test_support::{random_order, serialize, HitFloor};
use mrkit::cache::{CacheConfig, RegCache};
use mrkit::pool::{MrPool, OwnedSlot, PoolConfig, Slot};
use mrkit::{AccessFlags, Buffer, Context, DeviceConfig, ProtectionDomain};
use mrkit_soft::UserMemory;

const MSGS: usize = 16384;
const MSG: usize = 4096;

/// Working-set sizes of the hit sweep.
pub const SWEEP_SIZES: [usize; 6] = [1, 16, 64, 1024, 4096, 65536];
/// How long each point of the hit sweep measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effort {
    /// Timed lookups per point and thread.
    pub lookups: usize,
    /// Passes over the working set a thread makes, untimed, right before each timed phase
    /// ([`rewarm`]).
    pub rewarm_passes: usize,
    /// Rounds of (first thread alone, second alone, both at once); every figure is the
    /// median over the rounds ([`one_and_two`]).
    pub rounds: usize,
}

impl Effort {
    /// `mrkit bench pool-cache`: 200,000 lookups, [`REWARM_PASSES`], 5 rounds.
    pub const FULL: Effort = Effort {
        lookups: 200_000,
        rewarm_passes: REWARM_PASSES,
        rounds: 5,
    };
    /// `--quick`: a tenth of the lookups and 2 passes of re-warm. Every key is reported; the
    /// figures are noisier and, at 65,536 buffers, may include the slow start after a wait
    /// that [`REWARM_PASSES`] is there to skip. One round.
    pub const QUICK: Effort = Effort {
        lookups: 20_000,
        rewarm_passes: 2,
        rounds: 1,
    };
}
/// Lookups per timed batch.
const BATCH: usize = 1000;
/// The isolated pass makes 1/ISOLATED of a point's lookups (each pays its misses in full).
const ISOLATED: usize = 4;
/// Passes over the working set a thread makes right before a timed phase ([`rewarm`]): on
/// this kind of virtual machine a thread that waited (blocked at a barrier) comes back to
/// an 8 MiB table at up to 5x its steady cost for its first few hundred thousand lookups,
/// and after 6 passes it was still settling.
const REWARM_PASSES: usize = 16;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn pool_cfg() -> PoolConfig {
    PoolConfig {
        chunk_size: 64 << 20,
        max_chunks: 1,
        ..PoolConfig::default()
    }
}

fn pool_alloc_free(pool: &MrPool, n: u64) -> f64 {
    // Warm the thread's magazine.
    drop(pool.alloc().expect("pool alloc"));
    let t0 = Instant::now();
    for _ in 0..n {
        let s = pool.alloc().expect("pool alloc");
        black_box(&s);
        drop(s);
    }
    t0.elapsed().as_nanos() as f64 / n as f64
}

/// `MrPool::alloc_owned` + drop on one thread, ns per pair.
fn owned_alloc_free(pool: &MrPool, n: u64) -> f64 {
    drop(pool.alloc_owned().expect("pool alloc"));
    let t0 = Instant::now();
    for _ in 0..n {
        let s = pool.alloc_owned().expect("pool alloc");
        black_box(&s);
        drop(s);
    }
    t0.elapsed().as_nanos() as f64 / n as f64
}

/// Slots handed from thread to thread per batch in the cross-thread rows.
const HANDOVER: usize = 1024;

/// `n` slots made by `alloc` on this thread and dropped on another, `HANDOVER` at a time
/// (the batch vectors travel back for reuse, so no allocation is timed); ns per slot.
fn cross_thread<T: Send>(n: usize, alloc: impl Fn() -> T) -> f64 {
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<T>>(2);
    let (back_tx, back) = std::sync::mpsc::channel::<Vec<T>>();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(move || {
            for mut v in rx {
                v.clear(); // the slots are freed here, on the consumer thread
                if back_tx.send(v).is_err() {
                    break;
                }
            }
        });
        for _ in 0..n / HANDOVER {
            let mut v = back
                .try_recv()
                .unwrap_or_else(|_| Vec::with_capacity(HANDOVER));
            for _ in 0..HANDOVER {
                v.push(alloc());
            }
            if tx.send(v).is_err() {
                break;
            }
        }
        drop(tx);
    });
    t0.elapsed().as_nanos() as f64 / (n / HANDOVER * HANDOVER) as f64
}

/// The fastest of `runs` measurements.
fn best_of(runs: usize, mut f: impl FnMut() -> f64) -> f64 {
    (0..runs).map(|_| f()).fold(f64::INFINITY, f64::min)
}

fn cache_hit(cache: &RegCache, mem: &[u8]) -> f64 {
    let acc = AccessFlags::empty();
    let page = &mem[..4096];
    drop(cache.get_ref(page, acc).expect("cache get"));
    let mut per_batch = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let t0 = Instant::now();
        for _ in 0..1000 {
            let h = cache.get_ref(black_box(page), acc).expect("cache get");
            black_box(&h);
            drop(h);
        }
        per_batch.push(t0.elapsed().as_nanos() as f64 / 1000.0);
    }
    median(&mut per_batch)
}

/// The `i`-th 4 KiB buffer of `mem`.
#[inline]
fn page(mem: &[u8], i: u32) -> &[u8] {
    &mem[i as usize * 4096..][..4096]
}

/// Warm a thread up on `n` buffers: every buffer once (its entry enters the thread's table),
/// then `2n` (at least 4 batches) lookups in random order, so that the thread's table and
/// leases have been walked a few times before anything is timed (the first passes over fresh
/// memory cost up to 3x the steady state on this kind of virtual machine).
fn warm_thread(n: usize, seed: u64, lookup: &impl Fn(u32)) {
    for i in (0..n as u32).chain(random_order(n, (2 * n).max(4 * BATCH), seed)) {
        lookup(i);
    }
}

/// Lookups a thread makes, untimed, right before each timed phase: `passes` times the working
/// set (at least 4 batches) in random order.
fn rewarm(n: usize, passes: usize, seed: u64, lookup: &impl Fn(u32)) {
    for i in random_order(n, (passes * n).max(4 * BATCH), seed) {
        lookup(i);
    }
}

/// Median of the batch means of `lookup` over `order` (buffer indices).
fn hit_random(order: &[u32], lookup: &impl Fn(u32)) -> f64 {
    let mut per_batch = Vec::with_capacity(order.len() / BATCH);
    for chunk in order.chunks_exact(BATCH) {
        let t0 = Instant::now();
        for &i in chunk {
            lookup(black_box(i));
        }
        per_batch.push(t0.elapsed().as_nanos() as f64 / BATCH as f64);
    }
    median(&mut per_batch)
}

/// What each lookup of the sweep does with its handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    /// Nothing (`get_ref` + drop: the shape of the issue that set the targets).
    Nothing,
    /// Reads its lkey, as a program about to post does (`get_ref` + `lkey` + drop).
    Key,
}

/// What a sweep point times. The subjects of a point are measured in the same rounds, one
/// after the other ([`one_and_two`]), so that the virtual machine's memory state, which
/// moves the 65,536-buffer figures several-fold within seconds, is the same for each of
/// them in a round and the ratios between them are taken round by round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Subject {
    /// The cache's lookups, each handle used as [`Use`] says.
    Cache(Use),
    /// The memory floor under them ([`HitFloor`]: each thread its own table over the same
    /// pages).
    Floor,
}

/// A thread's state for one [`Subject`].
enum Local {
    Cache(Use),
    Floor(HitFloor),
}

/// One sweep point's buffers: buffer `i` is page `page_of(i)` of `mem`, registered through
/// `cache`.
struct Point<'a, P> {
    cache: &'a RegCache,
    mem: &'a [u8],
    page_of: P,
}

impl<P: Fn(u32) -> u32 + Sync> Point<'_, P> {
    fn addr(&self, i: u32) -> u64 {
        self.mem.as_ptr() as u64 + u64::from((self.page_of)(i)) * 4096
    }

    /// A thread's state for `s` over `n` buffers (the floor's table is the thread's own).
    fn local(&self, s: Subject, n: usize) -> Local {
        match s {
            Subject::Cache(u) => Local::Cache(u),
            Subject::Floor => Local::Floor(HitFloor::at_pages(
                &(0..n as u32).map(|i| self.addr(i)).collect::<Vec<_>>(),
            )),
        }
    }

    /// The cache's lookup of buffer `i`, its handle used as `used` says, then dropped.
    #[inline(always)]
    fn cache_lookup(&self, i: u32, used: Use) {
        let h = self
            .cache
            .get_ref(page(self.mem, (self.page_of)(i)), AccessFlags::empty())
            .expect("cache get");
        match used {
            Use::Nothing => {
                black_box(&h);
            }
            Use::Key => {
                black_box(h.lkey());
            }
        }
        drop(h);
    }

    /// The floor's lookup of buffer `i`, in the loop the cache's lookups run in: the same
    /// slice of `mem` (bounds checked) and a value of a handle's size given to `black_box`
    /// by reference, so that the floor differs from [`cache_lookup`](Self::cache_lookup) by
    /// the cache's work alone (until session 20 it computed the address and kept a `bool`:
    /// about 12 fewer instructions per lookup than the cache's loop around the same call,
    /// which at 65,536 buffers, where the number of instructions per lookup decides how many
    /// lookups the CPU overlaps, counted against the cache).
    #[inline(always)]
    fn floor_lookup(&self, f: &HitFloor, i: u32) {
        let mem = page(self.mem, (self.page_of)(i));
        let hit = f.hit(mem.as_ptr() as u64, mem.len() as u64);
        black_box(&(hit, mem));
        assert!(hit);
    }

    /// One lookup through `l`, untimed (warm-up).
    fn lookup(&self, l: &Local, i: u32) {
        match l {
            Local::Cache(u) => self.cache_lookup(i, *u),
            Local::Floor(f) => self.floor_lookup(f, i),
        }
    }

    /// [`hit_random`] over `order` through `l`, each lookup followed by [`serialize`] when
    /// `isolated`: one loop per subject and shape, with no dispatch inside.
    fn timed(&self, l: &Local, order: &[u32], isolated: bool) -> f64 {
        // Each loop gets a closure of its own (two per subject): a closure called from one
        // place is inlined into it, so no loop pays a call the others do not (with one
        // closure shared by the isolated and the plain loop, the cache's lookup was called
        // out of line, ~10 instructions more per lookup than the floor's loop).
        macro_rules! timed_loop {
            (|$i:ident| $look:expr) => {
                if isolated {
                    hit_random(order, &|$i: u32| {
                        $look;
                        serialize();
                    })
                } else {
                    hit_random(order, &|$i: u32| $look)
                }
            };
        }
        match l {
            Local::Cache(Use::Nothing) => timed_loop!(|i| self.cache_lookup(i, Use::Nothing)),
            Local::Cache(Use::Key) => timed_loop!(|i| self.cache_lookup(i, Use::Key)),
            Local::Floor(f) => timed_loop!(|i| self.floor_lookup(f, i)),
        }
    }

    /// The share of the lookups `measure` makes that the per-thread path serves (the cache's
    /// counters around it; NaN for the floor), with `measure`'s figure.
    fn with_share(&self, l: &Local, measure: impl FnOnce() -> f64) -> (f64, f64) {
        match l {
            Local::Cache(_) => {
                let s0 = self.cache.stats();
                let ns = measure();
                let s1 = self.cache.stats();
                let hits = (s1.hits - s0.hits).max(1) as f64;
                (ns, (s1.fast_hits - s0.fast_hits) as f64 / hits)
            }
            Local::Floor(_) => (measure(), f64::NAN),
        }
    }
}

/// One subject's figures, round by round (ns per lookup).
#[derive(Debug, Clone, Default)]
struct Rounds {
    /// One thread: the mean of the two threads' alone figures.
    one: Vec<f64>,
    /// Two threads at once: the mean of the two.
    two: Vec<f64>,
    /// The first thread's isolated lookups.
    isolated: Vec<f64>,
    /// Share of the first round's first alone phase served by the per-thread path.
    fast_share: f64,
}

impl Rounds {
    /// Medians over the rounds.
    fn figures(&self) -> HitFigures {
        HitFigures {
            one: median_or_nan(self.one.clone()),
            two: median_or_nan(self.two.clone()),
            isolated: median_or_nan(self.isolated.clone()),
            two_over_one: median_of_ratios(&self.two, &self.one),
            fast_share: self.fast_share,
        }
    }

    /// `self` over `peer`, round by round (one thread, two threads, isolated): the medians
    /// of the rounds' ratios.
    fn over(&self, peer: &Rounds) -> Ratios {
        Ratios {
            one: median_of_ratios(&self.one, &peer.one),
            two: median_of_ratios(&self.two, &peer.two),
            isolated: median_of_ratios(&self.isolated, &peer.isolated),
        }
    }
}

/// The median of the rounds' `a ÷ b` (NaN for no round).
fn median_of_ratios(a: &[f64], b: &[f64]) -> f64 {
    median_or_nan(a.iter().zip(b).map(|(x, y)| x / y).collect())
}

/// The median, NaN for no value.
fn median_or_nan(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        median(&mut v)
    }
}

/// One subject over another, each the median of the rounds' ratios ([`Rounds::over`]).
#[derive(Debug, Clone, Copy)]
pub struct Ratios {
    /// One thread.
    pub one: f64,
    /// Two threads at once.
    pub two: f64,
    /// Isolated lookups.
    pub isolated: f64,
}

/// One thread and two threads looking up the `n` buffers of `point` through each of
/// `subjects`, from the same two warm threads: each sets up its state for every subject
/// and warms every subject up alike ([`warm_thread`]), then `effort.rounds` times, for
/// each subject in turn: the first thread measures alone while the second waits, the
/// second alone while the first waits, then both at once (each over its own random
/// order); every timed phase starts with [`rewarm`]. Alone, the first thread also measures
/// isolated lookups each round (each followed by [`serialize`], over lookups its alone
/// phase did not just make); in the first round it reads the share of its alone lookups
/// the per-thread path served ([`Point::with_share`]). Each thread measures alone so that
/// both figures include a thread that waited: on this kind of virtual machine the thread
/// that waited stays ~20 % slower at 65,536 buffers for as long as we measured (over a
/// million lookups), which the one-thread figure of the first thread alone did not show.
/// The subjects of a round are adjacent in time, so the ratios between them are taken round
/// by round ([`Rounds::over`]), as is each `two_over_one` (until session 20 each subject
/// ran its own rounds, one subject after the other: at 65,536 buffers the floor then
/// measured 3.6 to 18 ns and the cache 6 to 39 ns within single runs, and which one met
/// the VM's slow seconds decided their ratio).
fn one_and_two<P: Fn(u32) -> u32 + Sync>(
    point: &Point<'_, P>,
    n: usize,
    effort: Effort,
    subjects: &[Subject],
) -> Vec<Rounds> {
    let go = std::sync::Barrier::new(2);
    let go = &go;
    let per_thread = std::thread::scope(|s| {
        let ts: Vec<_> = [0x2545_f491_4f6c_dd1d_u64, 0x1405_7b7e_f767_814f]
            .into_iter()
            .enumerate()
            .map(|(k, seed)| {
                s.spawn(move || {
                    let locals: Vec<Local> = subjects.iter().map(|&s| point.local(s, n)).collect();
                    for l in &locals {
                        warm_thread(n, seed, &|i| point.lookup(l, i));
                    }
                    // Three parts: alone, isolated, then both threads at once.
                    let lookups = effort.lookups;
                    let few = (lookups / ISOLATED).max(BATCH).min(lookups);
                    let order = random_order(n, 2 * lookups + few, seed.rotate_left(17));
                    let (first, rest) = order.split_at(lookups);
                    let (few, second) = rest.split_at(few);
                    let mut out = vec![Rounds::default(); locals.len()];
                    for r in 0..effort.rounds.max(1) as u64 {
                        for (j, (l, o)) in locals.iter().zip(&mut out).enumerate() {
                            // Each phase's re-warm draws its own order.
                            let salt = 4 * (r * locals.len() as u64 + j as u64);
                            let look = |i: u32| point.lookup(l, i);
                            go.wait();
                            if k == 0 {
                                rewarm(n, effort.rewarm_passes, seed ^ (1 + salt), &look);
                                let one = if r == 0 {
                                    let (one, share) =
                                        point.with_share(l, || point.timed(l, first, false));
                                    o.fast_share = share;
                                    one
                                } else {
                                    point.timed(l, first, false)
                                };
                                o.one.push(one);
                                o.isolated.push(point.timed(l, few, true));
                            }
                            go.wait();
                            if k == 1 {
                                rewarm(n, effort.rewarm_passes, seed ^ (3 + salt), &look);
                                o.one.push(point.timed(l, first, false));
                            }
                            go.wait();
                            rewarm(n, effort.rewarm_passes, seed ^ (2 + salt), &look);
                            o.two.push(point.timed(l, second, false));
                        }
                    }
                    out
                })
            })
            .collect();
        ts.into_iter().map(|t| t.join().ok()).collect::<Vec<_>>()
    });
    let mut r = per_thread.into_iter().flatten();
    let (Some(t0), Some(t1)) = (r.next(), r.next()) else {
        return vec![Rounds::default(); subjects.len()];
    };
    // A round's figure: the mean of the two threads'.
    let mean = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x + y) / 2.0).collect();
    t0.into_iter()
        .zip(t1)
        .map(|(a, b)| Rounds {
            one: mean(&a.one, &b.one),
            two: mean(&a.two, &b.two),
            isolated: a.isolated,
            fast_share: a.fast_share,
        })
        .collect()
}

/// One point's figures for one structure (ns per lookup).
#[derive(Debug, Clone, Copy)]
pub struct HitFigures {
    /// One thread, back-to-back lookups.
    pub one: f64,
    /// Two threads at once (mean of the two).
    pub two: f64,
    /// One thread, lookups separated by [`serialize`] (no overlap between lookups).
    pub isolated: f64,
    /// Two threads over one thread, the median of each round's ratio ([`one_and_two`]).
    pub two_over_one: f64,
    /// Share of the one-thread lookups served by the per-thread path (the cache only).
    pub fast_share: f64,
}

/// Resident bytes of this process (`/proc/self/statm`).
fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * rustix::param::page_size() as u64)
}

/// One point of the hit sweep.
#[derive(Debug, Clone, Copy)]
pub struct SweepPoint {
    /// Registered buffers (4 KiB each).
    pub buffers: usize,
    /// The cache's hits.
    pub cache: HitFigures,
    /// The cache's hits, each reading its handle's lkey.
    pub cache_key: HitFigures,
    /// The memory floor under a hit ([`HitFloor`]) in the same rounds.
    pub floor: HitFigures,
    /// The cache's hits over the floor, round by round ([`Rounds::over`]).
    pub over_floor: Ratios,
    /// Resident bytes gained per entry while the entries were created.
    pub bytes_per_entry: Option<f64>,
    /// Lookups whose handles are dropped on another thread ([`cross_thread_drops`]), at
    /// [`CROSS_DROP_SIZES`].
    pub cross_drop: Option<f64>,
}

/// Sweep sizes that also measure [`cross_thread_drops`].
const CROSS_DROP_SIZES: [usize; 2] = [64, 65536];

/// The posting thread / completion thread shape: `get_ref` of buffers in random order on
/// this thread, the handles dropped on another, handed over [`HANDOVER`] at a time (as
/// [`cross_thread`] hands pool slots over: `pool_slot_cross_thread_ns` is the hand-over's
/// own cost); ns per lookup, the fastest of 3 runs. A handle dropped off its lease's owner
/// thread takes the lease's read-modify-write path, and the lease's line moves to that
/// thread and back.
fn cross_thread_drops(cache: &RegCache, mem: &[u8], n: usize, effort: Effort) -> f64 {
    let order = random_order(n, effort.lookups, 0x5851_f42d_4c95_7f2d);
    let next = std::cell::Cell::new(0usize);
    best_of(3, || {
        next.set(0);
        cross_thread(order.len(), || {
            let i = order[next.get() % order.len()];
            next.set(next.get() + 1);
            cache
                .get_ref(page(mem, i), AccessFlags::empty())
                .expect("cache get")
        })
    })
}

/// A cache for a sweep point of `n` buffers: room for all of them, the userfaultfd monitor
/// (the default: the safe lookups need it).
fn sweep_cache(pd: &ProtectionDomain, n: usize) -> Result<RegCache, String> {
    RegCache::new(
        pd,
        CacheConfig {
            max_entries: n.max(1024),
            ..CacheConfig::default()
        },
    )
    .map_err(|e| e.to_string())
}

/// The mrkit hit sweep: `lookups` per point and thread, at each of `sizes`.
pub fn hit_sweep(
    pd: &ProtectionDomain,
    sizes: &[usize],
    effort: Effort,
) -> Result<Vec<SweepPoint>, String> {
    let mut out = Vec::new();
    for &n in sizes {
        let cache = sweep_cache(pd, n)?;
        let mut buf = Buffer::new(n * 4096).map_err(|e| e.to_string())?;
        buf.as_mut_slice().fill(1);
        let mem = buf.as_slice();
        let acc = AccessFlags::empty();
        let rss0 = rss_bytes();
        let mut warm = Vec::with_capacity(n);
        for i in 0..n as u32 {
            warm.push(
                cache
                    .get_ref(page(mem, i), acc)
                    .map_err(|e| e.to_string())?,
            );
        }
        drop(warm);
        let bytes_per_entry = match (rss0, rss_bytes()) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / n as f64),
            _ => None,
        };
        let point = Point {
            cache: &cache,
            mem,
            page_of: |i| i,
        };
        let subjects = [
            Subject::Cache(Use::Nothing),
            Subject::Cache(Use::Key),
            Subject::Floor,
        ];
        let [cache_figs, cache_key, floor]: [Rounds; 3] = one_and_two(&point, n, effort, &subjects)
            .try_into()
            .map_err(|_| "one round list per subject".to_string())?;
        let cross_drop = CROSS_DROP_SIZES
            .contains(&n)
            .then(|| cross_thread_drops(&cache, mem, n, effort));
        out.push(SweepPoint {
            buffers: n,
            cache: cache_figs.figures(),
            cache_key: cache_key.figures(),
            floor: floor.figures(),
            over_floor: cache_figs.over(&floor),
            bytes_per_entry,
            cross_drop,
        });
        drop(cache);
        drop(buf);
    }
    Ok(out)
}

/// Pages per window of the scattered shape: buffer `i` is a page at random in pages
/// `16i .. 16i + 16` of one mapping.
const SCATTER: u32 = 16;
/// Seed of the scattered shape's offsets (the UCX program draws the same ones).
const SCATTER_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// Buffers of the scattered shape (as many as the sweep's largest point). Each is alone in
/// its part of the mapping; the userfaultfd monitor bridges the gaps between them (its
/// "Bridged gaps"), without which 65,536 of them would exceed the default
/// `vm.max_map_count`.
pub const SCATTERED_BUFFERS: usize = 65_536;

/// The scattered shape: the sweep's protocol over `n` buffers that are single pages at
/// random places (page `16i + r_i` of one mapping, as buffers allocated one by one land),
/// beside the floor over the same pages; userfaultfd monitor, as the sweep.
pub fn scattered_point(
    pd: &ProtectionDomain,
    n: usize,
    effort: Effort,
) -> Result<(HitFigures, HitFigures, Ratios), String> {
    // Declared before the cache: dropped after it.
    let buf = Buffer::new(n * SCATTER as usize * 4096).map_err(|e| e.to_string())?;
    let cache = sweep_cache(pd, n)?;
    let offsets = random_order(SCATTER as usize, n, SCATTER_SEED);
    let page_of = |i: u32| i * SCATTER + offsets[i as usize];
    let mem = buf.as_slice();
    let point = Point {
        cache: &cache,
        mem,
        page_of,
    };
    let [c, f]: [Rounds; 2] = one_and_two(
        &point,
        n,
        effort,
        &[Subject::Cache(Use::Nothing), Subject::Floor],
    )
    .try_into()
    .map_err(|_| "one round list per subject".to_string())?;
    let stats = cache.stats();
    if stats.uncached > 0 || stats.entries as usize != n {
        return Err(format!(
            "scattered shape: {} of {n} buffers cached, {} uncached registrations",
            stats.entries, stats.uncached
        ));
    }
    drop(cache);
    Ok((c.figures(), f.figures(), c.over(&f)))
}

/// UCX's figures at one size: one thread, two threads, bytes per entry.
#[derive(Debug, Clone, Copy)]
pub struct UcxPoint {
    /// Regions in the cache.
    pub buffers: usize,
    /// The scattered shape ([`scattered_point`]'s pages), else contiguous buffers.
    pub scattered: bool,
    /// ns per hit, one thread.
    pub one: f64,
    /// ns per hit, two threads.
    pub two: f64,
    /// ns per hit, one thread, each lookup followed by `lfence` (as [`serialize`]).
    pub isolated: f64,
    /// Resident bytes per region.
    pub bytes_per_entry: f64,
    /// Cross-thread drops ([`cross_thread_drops`]'s shape), at [`CROSS_DROP_SIZES`].
    pub cross_drop: Option<f64>,
}

/// The same sweep against UCX's `ucs_rcache` (no-op registration callback, no memory events):
/// a C program built with `cc ... -lucs` at run time, over `sizes` contiguous buffers and
/// then `scattered` buffers in the scattered shape (the same pages as [`scattered_point`]:
/// the program draws the offsets with the same generator and seed). `Err` says why it could
/// not run.
pub fn ucx_sweep(
    sizes: &[usize],
    scattered: &[usize],
    effort: Effort,
) -> Result<Vec<UcxPoint>, String> {
    ucx_sweep_in(&std::env::temp_dir(), sizes, scattered, effort)
}

/// [`ucx_sweep`] with its scratch directory made in `parent`.
fn ucx_sweep_in(
    parent: &std::path::Path,
    sizes: &[usize],
    scattered: &[usize],
    effort: Effort,
) -> Result<Vec<UcxPoint>, String> {
    if !std::path::Path::new("/usr/include/ucs/memory/rcache.h").exists() {
        return Err("UCX not installed (libucx-dev): no ucs/memory/rcache.h".into());
    }
    // A private directory (mkdtemp, mode 0700): the program is compiled, then run, from
    // there, so no other user may place or swap a file in it (a predictable name under /tmp
    // could be created by another user first).
    let scratch = tempfile::Builder::new()
        .prefix("mrkit-ucx-bench-")
        .tempdir_in(parent)
        .map_err(|e| format!("cannot create a private scratch directory: {e}"))?;
    let dir = scratch.path();
    (|| {
        let src = dir.join("rcache_bench.c");
        let exe = dir.join("rcache_bench");
        std::fs::write(&src, UCX_BENCH_C).map_err(|e| e.to_string())?;
        let cc = std::process::Command::new("cc")
            .args(["-O2", "-pthread"])
            .arg(format!("-DREWARM={}", effort.rewarm_passes))
            .arg(format!("-DROUNDS={}", effort.rounds.max(1)))
            .arg(format!("-DSCATTER={SCATTER}"))
            .arg(format!("-DSCATTER_SEED={SCATTER_SEED:#x}ULL"))
            .arg("-o")
            .arg(&exe)
            .arg(&src)
            .arg("-lucs")
            .output()
            .map_err(|e| format!("cannot run cc: {e}"))?;
        if !cc.status.success() {
            return Err(format!(
                "building the UCX rcache benchmark failed: {}",
                String::from_utf8_lossy(&cc.stderr).trim()
            ));
        }
        let mut args = vec![effort.lookups.to_string(), BATCH.to_string()];
        args.extend(sizes.iter().map(|n| {
            let cross = if CROSS_DROP_SIZES.contains(n) {
                "x"
            } else {
                ""
            };
            format!("{n}{cross}")
        }));
        args.extend(scattered.iter().map(|n| format!("{n}s")));
        let run = std::process::Command::new(&exe)
            .args(&args)
            .output()
            .map_err(|e| e.to_string())?;
        if !run.status.success() {
            return Err(format!(
                "the UCX rcache benchmark failed: {}",
                String::from_utf8_lossy(&run.stderr).trim()
            ));
        }
        let text = String::from_utf8_lossy(&run.stdout);
        // "cross N ns" lines: the cross-thread drops of the point before.
        let cross: Vec<(usize, f64)> = text
            .lines()
            .filter_map(|l| {
                let mut w = l.strip_prefix("cross ")?.split_whitespace();
                Some((w.next()?.parse().ok()?, w.next()?.parse().ok()?))
            })
            .collect();
        let pts: Vec<UcxPoint> = text
            .lines()
            .filter(|l| !l.starts_with("cross "))
            .enumerate()
            .filter_map(|(k, l)| {
                let v: Vec<f64> = l
                    .split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect();
                (v.len() == 5).then(|| UcxPoint {
                    buffers: v[0] as usize,
                    scattered: k >= sizes.len(),
                    one: v[1],
                    two: v[2],
                    bytes_per_entry: v[3],
                    isolated: v[4],
                    cross_drop: cross
                        .iter()
                        .find(|c| c.0 == v[0] as usize && k < sizes.len())
                        .map(|c| c.1),
                })
            })
            .collect();
        if pts.len() != sizes.len() + scattered.len() {
            return Err(format!(
                "unexpected output of the UCX rcache benchmark: {text}"
            ));
        }
        Ok(pts)
    })()
    // `scratch` is removed when it drops.
}

/// The UCX side of the sweep, in the same shape as [`one_and_two`].
const UCX_BENCH_C: &str = r#"
#include <ucs/memory/rcache.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* A region as a UCX transport keeps it: the rcache's header, then the registration's key
   (what a lookup is for: every lookup below reads it). */
struct region { ucs_rcache_region_t super; uint32_t lkey; };
static ucs_status_t reg(void *c, ucs_rcache_t *r, void *a, ucs_rcache_region_t *g, uint16_t f)
{ (void)c; (void)r; (void)a; (void)f; ((struct region *)g)->lkey = (uint32_t)(uintptr_t)g; return UCS_OK; }
static void dereg(void *c, ucs_rcache_t *r, ucs_rcache_region_t *g) { (void)c; (void)r; (void)g; }
static void dump(void *c, ucs_rcache_t *r, ucs_rcache_region_t *g, char *b, size_t m)
{ (void)c; (void)r; (void)g; if (m) b[0] = 0; }
static const ucs_rcache_ops_t ops = { reg, dereg, dump };

/* As mrkit's cache::test_support::serialize: lfence, a full fence elsewhere. */
#if defined(__x86_64__) || defined(__i386__)
#define SERIALIZE() __builtin_ia32_lfence()
#else
#define SERIALIZE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#endif

static size_t lookups, batch;
static double now_ns(void)
{ struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static int cmp(const void *a, const void *b)
{ double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
static long rss(void)
{ long a = 0, b = 0; FILE *f = fopen("/proc/self/statm", "r");
  if (f) { if (fscanf(f, "%ld %ld", &a, &b) != 2) b = 0; fclose(f); } return b * sysconf(_SC_PAGESIZE); }

/* Buffer i is page page[i] of base. */
struct job { ucs_rcache_t *rc; char *base; const uint32_t *page; size_t n; uint64_t seed; int first; pthread_barrier_t *bar; double one[ROUNDS], two[ROUNDS], iso[ROUNDS]; };
#define BUF(j, i) ((j)->base + (size_t)(j)->page[i] * 4096)

static volatile uint32_t key_sink;
static void one_get(ucs_rcache_t *rc, void *addr)
{
    ucs_rcache_region_t *r;
    if (ucs_rcache_get(rc, addr, 4096, PROT_READ | PROT_WRITE, NULL, &r) != UCS_OK) {
        fprintf(stderr, "ucs_rcache_get failed\n"); exit(1);
    }
    key_sink = ((struct region *)r)->lkey;
    ucs_rcache_region_put(rc, r);
}

static void order_of(uint32_t *order, size_t len, uint64_t s, size_t n)
{
    size_t i;
    for (i = 0; i < len; i++) { s ^= s << 13; s ^= s >> 7; s ^= s << 17; order[i] = (uint32_t)(s % n); }
}

/* `len` lookups of `order`; with `fenced`, an lfence after each (isolated lookups). */
static double measure(struct job *j, const uint32_t *order, size_t len, int fenced, double *v)
{
    size_t i, b, nb = len / batch;
    for (b = 0; b < nb; b++) {
        double t0 = now_ns();
        for (i = b * batch; i < (b + 1) * batch; i++) {
            one_get(j->rc, BUF(j, order[i]));
            if (fenced) SERIALIZE();
        }
        v[b] = (now_ns() - t0) / batch;
    }
    qsort(v, nb, sizeof(*v), cmp);
    return v[nb / 2];
}

/* As the mrkit side: warm up (every buffer once, then max(2n, 4 batches) in random order),
   then ROUNDS times: the first thread measures alone while the second waits, the second
   alone while the first waits, then both at once; each timed phase starts with
   max(REWARM * n, 4 batches) untimed lookups, drawn anew each round. */
static void *run(void *p)
{
    struct job *j = p;
    int r;
    size_t warm = 2 * j->n > 4 * batch ? 2 * j->n : 4 * batch, i;
    size_t rewarm = REWARM * j->n > 4 * batch ? REWARM * j->n : 4 * batch;
    uint32_t *rw = malloc(rewarm * sizeof(*rw));
    size_t few = lookups / 4 > batch ? lookups / 4 : batch;
    uint32_t *w = malloc(warm * sizeof(*w)), *order;
    double *v = malloc((lookups / batch + 1) * sizeof(*v));
    order_of(w, warm, j->seed, j->n);
    if (few > lookups) few = lookups;
    /* Three parts, as the mrkit side: alone, isolated, both threads at once. */
    order = malloc((2 * lookups + few) * sizeof(*order));
    order_of(order, 2 * lookups + few, (j->seed << 17) | (j->seed >> 47), j->n);
    for (i = 0; i < j->n; i++) one_get(j->rc, BUF(j, i));
    for (i = 0; i < warm; i++) one_get(j->rc, BUF(j, w[i]));
    for (r = 0; r < ROUNDS; r++) {
        uint64_t salt = 4 * (uint64_t)r;
        pthread_barrier_wait(j->bar);
        if (j->first) {
            order_of(rw, rewarm, j->seed ^ (1 + salt), j->n);
            for (i = 0; i < rewarm; i++) one_get(j->rc, BUF(j, rw[i]));
            j->one[r] = measure(j, order, lookups, 0, v);
            j->iso[r] = measure(j, order + lookups, few, 1, v);
        }
        pthread_barrier_wait(j->bar);
        if (!j->first) {
            order_of(rw, rewarm, j->seed ^ (3 + salt), j->n);
            for (i = 0; i < rewarm; i++) one_get(j->rc, BUF(j, rw[i]));
            j->one[r] = measure(j, order, lookups, 0, v);
        }
        pthread_barrier_wait(j->bar);
        order_of(rw, rewarm, j->seed ^ (2 + salt), j->n);
        for (i = 0; i < rewarm; i++) one_get(j->rc, BUF(j, rw[i]));
        j->two[r] = measure(j, order + lookups + few, lookups, 0, v);
    }
    free(w); free(rw); free(order); free(v);
    return NULL;
}

/* Cross-thread drops, as the mrkit side's `cross_thread_drops`: this thread gets regions in
   random order and hands them to a thread that puts them, HANDOVER at a time through a
   queue of 2 batches, the batch buffers travelling back for reuse. Both queues are polled
   (no blocking wake-up: the best case for this side). */
#define HANDOVER 1024
struct handq { ucs_rcache_region_t **b[4]; int cap; unsigned head, tail; int closed; };
static void hq_push(struct handq *q, ucs_rcache_region_t **b)
{
    while (__atomic_load_n(&q->tail, __ATOMIC_ACQUIRE) - __atomic_load_n(&q->head, __ATOMIC_ACQUIRE) >= (unsigned)q->cap) ;
    q->b[q->tail % 4] = b;
    __atomic_store_n(&q->tail, q->tail + 1, __ATOMIC_RELEASE);
}
static ucs_rcache_region_t **hq_pop(struct handq *q)
{
    ucs_rcache_region_t **b;
    while (__atomic_load_n(&q->head, __ATOMIC_ACQUIRE) == __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE))
        if (__atomic_load_n(&q->closed, __ATOMIC_ACQUIRE) &&
            __atomic_load_n(&q->head, __ATOMIC_ACQUIRE) == __atomic_load_n(&q->tail, __ATOMIC_ACQUIRE)) return NULL;
    b = q->b[q->head % 4];
    __atomic_store_n(&q->head, q->head + 1, __ATOMIC_RELEASE);
    return b;
}
struct xjob { ucs_rcache_t *rc; struct handq *full, *back; };
static void *putter(void *p)
{
    struct xjob *x = p;
    ucs_rcache_region_t **b;
    size_t i;
    while ((b = hq_pop(x->full)) != NULL) {
        for (i = 0; i < HANDOVER; i++) ucs_rcache_region_put(x->rc, b[i]);
        hq_push(x->back, b);
    }
    return NULL;
}
static double cross_once(ucs_rcache_t *rc, char *base, const uint32_t *page, const uint32_t *order, size_t len)
{
    struct handq full = { {0}, 2, 0, 0, 0 }, back = { {0}, 4, 0, 0, 0 };
    struct xjob x = { rc, &full, &back };
    ucs_rcache_region_t **mem[4];
    pthread_t t;
    size_t k, i, done = len / HANDOVER * HANDOVER;
    double t0;
    for (k = 0; k < 4; k++) { mem[k] = malloc(HANDOVER * sizeof(**mem)); hq_push(&back, mem[k]); }
    t0 = now_ns();
    pthread_create(&t, NULL, putter, &x);
    for (k = 0; k < done; k += HANDOVER) {
        ucs_rcache_region_t **b = hq_pop(&back);
        for (i = 0; i < HANDOVER; i++) {
            if (ucs_rcache_get(rc, base + (size_t)page[order[k + i]] * 4096, 4096, PROT_READ | PROT_WRITE, NULL, &b[i]) != UCS_OK) {
                fprintf(stderr, "ucs_rcache_get failed\n"); exit(1);
            }
        }
        hq_push(&full, b);
    }
    __atomic_store_n(&full.closed, 1, __ATOMIC_RELEASE);
    pthread_join(t, NULL);
    t0 = (now_ns() - t0) / done;
    for (k = 0; k < 4; k++) free(mem[k]);
    return t0;
}
/* The fastest of 3, over the mrkit side's order (same generator and seed). */
static double cross_drops(ucs_rcache_t *rc, char *base, const uint32_t *page, size_t n)
{
    uint32_t *order = malloc(lookups * sizeof(*order));
    double best = 1e30, v;
    int r;
    order_of(order, lookups, 0x5851f42d4c957f2dULL, n);
    for (r = 0; r < 3; r++) { v = cross_once(rc, base, page, order, lookups); if (v < best) best = v; }
    free(order);
    return best;
}

int main(int argc, char **argv)
{
    int k;
    if (argc < 4) return 2;
    lookups = strtoul(argv[1], NULL, 0); batch = strtoul(argv[2], NULL, 0);
    for (k = 3; k < argc; k++) {
        /* "N": N contiguous buffers; "Ns": N buffers in the scattered shape, page
           SCATTER * i + r_i of the mapping, r_i drawn as the mrkit side draws them; "Nx": N
           contiguous buffers, then cross-thread drops over them. */
        char *end;
        size_t n = strtoul(argv[k], &end, 0), i;
        int scattered = *end == 's', cross = *end == 'x';
        size_t span = scattered ? n * SCATTER : n;
        uint32_t *page = malloc(n * sizeof(*page));
        ucs_rcache_params_t prm;
        ucs_rcache_t *rc;
        char *base = mmap(NULL, span * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        long r0;
        if (base == MAP_FAILED || !page) return 1;
        if (scattered) {
            order_of(page, n, SCATTER_SEED, SCATTER);
            for (i = 0; i < n; i++) page[i] += (uint32_t)(i * SCATTER);
        } else {
            for (i = 0; i < n; i++) page[i] = (uint32_t)i;
        }
        for (i = 0; i < n; i++) memset(base + (size_t)page[i] * 4096, 1, 4096);
        memset(&prm, 0, sizeof(prm));
        prm.region_struct_size = sizeof(struct region);
        prm.alignment = 16;
        prm.max_alignment = 4096;
        prm.ucm_events = 0;
        prm.ucm_event_priority = 1000;
        prm.ops = &ops;
        prm.flags = UCS_RCACHE_FLAG_NO_PFN_CHECK;
        prm.max_regions = (unsigned long)-1;
        prm.max_size = (size_t)-1;
        prm.max_unreleased = (size_t)-1;
        if (ucs_rcache_create(&prm, "bench", NULL, &rc) != UCS_OK) {
            fprintf(stderr, "ucs_rcache_create failed\n"); return 1;
        }
        r0 = rss();
        for (i = 0; i < n; i++) one_get(rc, base + (size_t)page[i] * 4096);
        {
            double bpe = (double)(rss() - r0) / n;
            pthread_barrier_t bar; pthread_t th[2];
            struct job t[2] = { { rc, base, page, n, 0x2545f4914f6cdd1dULL, 1, &bar, {0}, {0}, {0} },
                                { rc, base, page, n, 0x14057b7ef767814fULL, 0, &bar, {0}, {0}, {0} } };
            double one[ROUNDS], two[ROUNDS];
            int r;
            pthread_barrier_init(&bar, NULL, 2);
            pthread_create(&th[0], NULL, run, &t[0]); pthread_create(&th[1], NULL, run, &t[1]);
            pthread_join(th[0], NULL); pthread_join(th[1], NULL);
            pthread_barrier_destroy(&bar);
            /* Per round the mean of the two threads; the medians over the rounds. */
            for (r = 0; r < ROUNDS; r++) {
                one[r] = (t[0].one[r] + t[1].one[r]) / 2;
                two[r] = (t[0].two[r] + t[1].two[r]) / 2;
            }
            qsort(one, ROUNDS, sizeof(*one), cmp);
            qsort(two, ROUNDS, sizeof(*two), cmp);
            qsort(t[0].iso, ROUNDS, sizeof(*t[0].iso), cmp);
            printf("%zu %.2f %.2f %.1f %.2f\n", n, one[ROUNDS / 2], two[ROUNDS / 2], bpe, t[0].iso[ROUNDS / 2]);
            if (cross) printf("cross %zu %.2f\n", n, cross_drops(rc, base, page, n));
            fflush(stdout);
        }
        ucs_rcache_destroy(rc);
        munmap(base, span * 4096);
        free(page);
    }
    return 0;
}
"#;

fn cache_miss_overhead(pd: &ProtectionDomain, cache: &RegCache, buf: &Arc<Buffer>) -> f64 {
    let acc = AccessFlags::LOCAL_WRITE;
    let prov = pd.context().provider().clone();
    let pages = (buf.len() / 4096) as u64;
    let mut raw = Vec::new();
    let mut cached = Vec::new();
    for i in 0..4000u64 {
        let off = (i % pages) * 4096;
        let a = buf.addr() + off;
        // The MR holds a reference to the buffer until it is deregistered.
        let mem = UserMemory::owned_range(buf.clone(), off, 4096).expect("inside the buffer");
        let t0 = Instant::now();
        let info = prov.reg_mr(pd.handle(), mem, a, acc).expect("reg_mr");
        prov.dereg_mr(info.lkey).expect("dereg_mr");
        raw.push(t0.elapsed().as_nanos() as f64);
        let t0 = Instant::now();
        let h = cache
            .get_owned(buf, off..off + 4096, acc)
            .expect("cache miss");
        drop(h);
        cache.invalidate(a, 4096);
        cached.push(t0.elapsed().as_nanos() as f64);
    }
    (median(&mut cached) - median(&mut raw)).max(0.0)
}

/// Seed scenario, per-message registration: (write,) register, deregister.
fn per_message(pd: &ProtectionDomain, write: bool) -> f64 {
    let mut src = Buffer::new(MSGS * MSG).expect("buffer");
    src.as_mut_slice().fill(1); // fault the pages in once, outside the timing
    let addr = src.addr();
    // Each MR holds a reference to the buffer until it is deregistered, so between messages
    // (every MR deregistered) the buffer is ours alone again and can be written.
    let mut src = Arc::new(src);
    let prov = pd.context().provider().clone();
    let t0 = Instant::now();
    for i in 0..MSGS {
        let off = i * MSG;
        if write {
            Arc::get_mut(&mut src).expect("no MR left").as_mut_slice()[off..off + MSG]
                .fill(i as u8);
        }
        let a = addr + off as u64;
        let mem = UserMemory::owned_range(src.clone(), off as u64, MSG as u64).expect("inside");
        let info = prov
            .reg_mr(pd.handle(), mem, a, AccessFlags::LOCAL_WRITE)
            .expect("reg_mr");
        black_box(info.lkey);
        prov.dereg_mr(info.lkey).expect("dereg_mr");
    }
    t0.elapsed().as_nanos() as f64 / MSGS as f64
}

/// Seed scenario through the pool: alloc, (write,) SGE, hold (as a queue pair holds a posted
/// slot until its completion), free.
fn pooled(pool: &MrPool, write: bool) -> f64 {
    let t0 = Instant::now();
    let mut posted = Vec::with_capacity(MSGS);
    for i in 0..MSGS {
        let mut s = pool.alloc().expect("slot");
        if write {
            s.as_mut_slice().fill(i as u8);
        }
        black_box(s.local_all());
        posted.push(s);
    }
    drop(black_box(posted));
    t0.elapsed().as_nanos() as f64 / MSGS as f64
}

type Rows = Vec<(String, f64)>;

fn row(k: &str, v: f64) -> (String, f64) {
    (k.to_string(), v)
}

/// The sweep's rows (mrkit, UCX, ratios) and a note when UCX could not run.
pub fn sweep_rows(
    pd: &ProtectionDomain,
    sizes: &[usize],
    effort: Effort,
) -> Result<(Rows, Option<String>), String> {
    let pts = hit_sweep(pd, sizes, effort)?;
    let scattered: &[usize] = if sizes.iter().any(|&n| n >= SCATTERED_BUFFERS) {
        &[SCATTERED_BUFFERS]
    } else {
        &[]
    };
    let ucx = ucx_sweep(sizes, scattered, effort);
    let ucx_at = |n: usize, scattered: bool| {
        ucx.as_ref().ok().and_then(|u| {
            u.iter()
                .find(|u| u.buffers == n && u.scattered == scattered)
        })
    };
    let mut rows = Rows::new();
    for p in &pts {
        let n = p.buffers;
        let (c, f) = (&p.cache, &p.floor);
        rows.push((format!("cache_hit_ns_p50_n{n}"), c.one));
        rows.push((format!("cache_hit_ns_p50_n{n}_2threads"), c.two));
        rows.push((format!("cache_hit_isolated_ns_n{n}"), c.isolated));
        rows.push((format!("cache_fast_share_n{n}"), c.fast_share));
        rows.push((format!("hit_floor_ns_n{n}"), f.one));
        rows.push((format!("hit_floor_ns_n{n}_2threads"), f.two));
        rows.push((format!("hit_floor_isolated_ns_n{n}"), f.isolated));
        let point = format!("n{n}");
        ratio_rows(&mut rows, &point, "floor", p.over_floor);
        two_over_one_rows(&mut rows, &point, c, f);
        let ucx = ucx_at(n, false);
        if let Some(u) = ucx {
            ucx_rows(&mut rows, &point, c, u);
        }
        if let Some(x) = p.cross_drop {
            rows.push((format!("cache_cross_thread_drop_ns_n{n}"), x));
            if let Some(u) = ucx.and_then(|u| u.cross_drop) {
                rows.push((format!("ucx_rcache_cross_thread_drop_ns_n{n}"), u));
                rows.push((format!("cache_cross_thread_drop_over_ucx_n{n}"), x / u));
            }
        }
        let k = &p.cache_key;
        rows.push((format!("cache_hit_key_ns_p50_n{n}"), k.one));
        rows.push((format!("cache_hit_key_ns_p50_n{n}_2threads"), k.two));
        rows.push((format!("cache_hit_key_isolated_ns_n{n}"), k.isolated));
        if let Some(u) = ucx {
            rows.push((format!("cache_key_over_ucx_n{n}"), k.one / u.one));
            rows.push((format!("cache_key_over_ucx_n{n}_2threads"), k.two / u.two));
        }
    }
    for &n in scattered {
        let (c, f, over) = scattered_point(pd, n, effort)?;
        rows.push((format!("cache_hit_ns_p50_n{n}_scattered"), c.one));
        rows.push((format!("cache_hit_ns_p50_n{n}_scattered_2threads"), c.two));
        rows.push((format!("cache_hit_isolated_ns_n{n}_scattered"), c.isolated));
        rows.push((format!("hit_floor_ns_n{n}_scattered"), f.one));
        rows.push((format!("hit_floor_ns_n{n}_scattered_2threads"), f.two));
        rows.push((format!("cache_over_floor_n{n}_scattered"), over.one));
        rows.push((
            format!("cache_over_floor_n{n}_scattered_2threads"),
            over.two,
        ));
        two_over_one_rows(&mut rows, &format!("n{n}_scattered"), &c, &f);
        if let Some(u) = ucx_at(n, true) {
            ucx_rows(&mut rows, &format!("n{n}_scattered"), &c, u);
        }
    }
    if let Some(p) = pts.iter().max_by_key(|p| p.buffers) {
        if let Some(b) = p.bytes_per_entry {
            rows.push(row("cache_bytes_per_entry", b));
        }
        if let Some(u) = ucx_at(p.buffers, false) {
            rows.push(row("ucx_rcache_bytes_per_entry", u.bytes_per_entry));
        }
    }
    Ok((rows, ucx.err()))
}

/// `cache_over_{peer}_{point}`, `…_{point}_2threads` and `cache_over_{peer}_isolated_{point}`
/// (`point`: `n{N}`, or `n{N}_scattered`): the cache's figures over a peer's (one thread,
/// two threads, isolated).
fn ratio_rows(rows: &mut Rows, point: &str, peer: &str, r: Ratios) {
    rows.push((format!("cache_over_{peer}_{point}"), r.one));
    rows.push((format!("cache_over_{peer}_{point}_2threads"), r.two));
    rows.push((format!("cache_over_{peer}_isolated_{point}"), r.isolated));
}

/// `cache_two_over_one_{point}` and `hit_floor_two_over_one_{point}`: what a second thread
/// hitting at the same time costs per hit, the cache beside the memory floor (medians of the
/// rounds' ratios, [`one_and_two`]).
fn two_over_one_rows(rows: &mut Rows, point: &str, c: &HitFigures, f: &HitFigures) {
    rows.push((format!("cache_two_over_one_{point}"), c.two_over_one));
    rows.push((format!("hit_floor_two_over_one_{point}"), f.two_over_one));
}

/// UCX's figures at `point` (`ucx_rcache_hit_ns_p50_{point}`, `…_2threads`,
/// `ucx_rcache_hit_isolated_ns_{point}`) and the cache's over them ([`ratio_rows`]).
fn ucx_rows(rows: &mut Rows, point: &str, c: &HitFigures, u: &UcxPoint) {
    rows.push((format!("ucx_rcache_hit_ns_p50_{point}"), u.one));
    rows.push((format!("ucx_rcache_hit_ns_p50_{point}_2threads"), u.two));
    rows.push((format!("ucx_rcache_hit_isolated_ns_{point}"), u.isolated));
    // UCX runs in its own process, before the cache: ratios of the medians.
    let r = Ratios {
        one: c.one / u.one,
        two: c.two / u.two,
        isolated: c.isolated / u.isolated,
    };
    ratio_rows(rows, point, "ucx", r);
}

/// The hit sweep for `mrkit bench`'s raw.json (`"cache_hits"`): `sizes`, `lookups` per
/// point and thread, UCX beside it when installed.
pub fn sweep_json(sizes: &[usize], effort: Effort) -> serde_json::Value {
    use serde_json::json;
    let ctx = Context::open(DeviceConfig::rxe());
    let pts = match ctx
        .alloc_pd()
        .map_err(|e| e.to_string())
        .and_then(|pd| hit_sweep(&pd, sizes, effort))
    {
        Ok(p) => p,
        Err(e) => {
            return json!({
                "lookups": effort.lookups,
                "rounds": effort.rounds,
                "points": [],
                "error": e,
            })
        }
    };
    let ucx = ucx_sweep(sizes, &[], effort);
    let ucx_at = |n: usize| {
        ucx.as_ref()
            .ok()
            .and_then(|u| u.iter().find(|u| u.buffers == n && !u.scattered))
    };
    let points: Vec<_> = pts
        .iter()
        .map(|p| {
            let u = ucx_at(p.buffers);
            json!({
                "buffers": p.buffers,
                "ns": p.cache.one,
                "ns_2threads": p.cache.two,
                "ns_isolated": p.cache.isolated,
                "fast_share": p.cache.fast_share,
                "floor_ns": p.floor.one,
                "floor_ns_2threads": p.floor.two,
                "floor_ns_isolated": p.floor.isolated,
                "two_over_one": p.cache.two_over_one,
                "key_ns": p.cache_key.one,
                "key_ns_2threads": p.cache_key.two,
                "floor_two_over_one": p.floor.two_over_one,
                "over_floor": p.over_floor.one,
                "over_floor_2threads": p.over_floor.two,
                "ucx_ns": u.map(|u| u.one),
                "ucx_ns_2threads": u.map(|u| u.two),
                "ucx_ns_isolated": u.map(|u| u.isolated),
                "over_ucx": u.map(|u| p.cache.one / u.one),
                "over_ucx_2threads": u.map(|u| p.cache.two / u.two),
            })
        })
        .collect();
    let last = pts.last();
    json!({
        "lookups": effort.lookups,
        "rounds": effort.rounds,
        "points": points,
        "bytes_per_entry": last.and_then(|p| p.bytes_per_entry),
        "ucx_bytes_per_entry": last.and_then(|p| ucx_at(p.buffers)).map(|u| u.bytes_per_entry),
        "ucx_error": ucx.as_ref().err(),
        "error": null,
    })
}

fn measure(ctx: &Context, quick: bool) -> Result<(Rows, Rows, Option<String>), String> {
    // `--quick`: a tenth of every count (every key is still measured).
    let k = if quick { 10 } else { 1 };
    let effort = if quick { Effort::QUICK } else { Effort::FULL };
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let pool = MrPool::new(&pd, pool_cfg()).map_err(|e| e.to_string())?;
    let one = pool_alloc_free(&pool, 20_000_000 / k);
    let two = std::thread::scope(|s| {
        let a = s.spawn(|| pool_alloc_free(&pool, 10_000_000 / k));
        let b = s.spawn(|| pool_alloc_free(&pool, 10_000_000 / k));
        (a.join().unwrap_or(f64::NAN) + b.join().unwrap_or(f64::NAN)) / 2.0
    });
    let owned_same = best_of(5, || owned_alloc_free(&pool, 4_000_000 / k));
    let owned_cross = best_of(5, || {
        cross_thread::<OwnedSlot>((1 << 20) / k as usize, || {
            pool.alloc_owned().expect("pool alloc")
        })
    });
    let borrowed_cross = best_of(5, || {
        cross_thread::<Slot<'_>>((1 << 20) / k as usize, || pool.alloc().expect("pool alloc"))
    });
    // The safe lookups need the userfaultfd monitor (explicit invalidation is an `unsafe`
    // promise this crate does not make).
    let cache = RegCache::new(&pd, CacheConfig::default()).map_err(|e| e.to_string())?;
    let buf = Arc::new(Buffer::new(4 << 20).map_err(|e| e.to_string())?);
    let hit = cache_hit(&cache, buf.as_slice());
    let go = std::sync::Barrier::new(2);
    let hit2 = std::thread::scope(|s| {
        let (c, g, a) = (&cache, &go, buf.as_slice());
        let t1 = s.spawn(move || {
            g.wait();
            cache_hit(c, a)
        });
        let t2 = s.spawn(move || {
            g.wait();
            cache_hit(c, a)
        });
        (t1.join().unwrap_or(f64::NAN) + t2.join().unwrap_or(f64::NAN)) / 2.0
    });
    let miss = cache_miss_overhead(&pd, &cache, &buf);
    drop(cache);
    let (sweep, ucx_note) = sweep_rows(&pd, &SWEEP_SIZES, effort)?;
    let per_msg = per_message(&pd, false);
    let pooled_ns = pooled(&pool, false);
    let per_msg_w = per_message(&pd, true);
    let pooled_w = pooled(&pool, true);
    let extra = vec![
        row("per_message_reg_ns (with 4 KiB write)", per_msg_w),
        row("pooled_ns (with 4 KiB write)", pooled_w),
        row("ratio (with 4 KiB write)", per_msg_w / pooled_w),
    ];
    let mut rows = vec![
        row("pool_alloc_free_ns", one),
        row("pool_alloc_free_ns_2threads", two),
        row("owned_slot_same_thread_ns", owned_same),
        row("owned_slot_cross_thread_ns", owned_cross),
        row("pool_slot_cross_thread_ns", borrowed_cross),
        row("cache_hit_ns_p50", hit),
        row("cache_hit_ns_p50_2threads", hit2),
        row("cache_miss_overhead_ns", miss),
    ];
    rows.extend(sweep);
    rows.extend([
        row("per_message_reg_ns", per_msg),
        row("pooled_ns", pooled_ns),
        row("per_message_over_pooled", per_msg / pooled_ns),
    ]);
    Ok((rows, extra, ucx_note))
}

/// The target of metric `k`, if the issues set one.
fn target(k: &str) -> &'static str {
    match k {
        "pool_alloc_free_ns" | "pool_alloc_free_ns_2threads" => "<= 20 ns",
        "owned_slot_same_thread_ns" => "<= 15 ns",
        "owned_slot_cross_thread_ns" => "<= 30 ns",
        "cache_hit_ns_p50" | "cache_hit_ns_p50_2threads" => "<= 30 ns",
        "cache_hit_ns_p50_n64" | "cache_hit_ns_p50_n64_2threads" => "<= 15 ns",
        "cache_hit_ns_p50_n65536" | "cache_hit_ns_p50_n65536_2threads" => "<= 25 ns",
        "cache_miss_overhead_ns" => "<= 2000 ns",
        k if k.starts_with("cache_two_over_one_") => "<= 1 (floor's beside)",
        "per_message_over_pooled" => ">= 20x",
        k if k.starts_with("cache_over_ucx_") => "<= 0.5",
        _ => "",
    }
}

/// [`target`] of `k` as the text report prints it: a hit's target with the same run's
/// memory floor of its accesses beside it (`hit_floor_ns_*` of the same shape), since when
/// the VM's memory is slow the floor alone can exceed it (docs/cache.md, session 22).
fn target_text(rows: &[(String, f64)], k: &str) -> String {
    let t = target(k);
    let floor = k
        .strip_prefix("cache_hit_ns_p50_")
        .and_then(|shape| {
            let name = format!("hit_floor_ns_{shape}");
            rows.iter().find(|(n, _)| *n == name)
        })
        .map(|(_, v)| *v);
    match floor {
        Some(f) if !t.is_empty() => format!("{t} (floor {f:.2} ns)"),
        _ => t.to_string(),
    }
}

/// Run the pool/cache benchmark on `ctx` (any device: every experiment goes through the
/// generic API); `json` selects JSON output.
pub fn run(json: bool, quick: bool, ctx: &Context) -> u8 {
    let (rows, extra, ucx_note) = match measure(ctx, quick) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("mrkit bench pool-cache: {e}");
            return crate::exit::VERB_FAILED;
        }
    };
    if let Some(n) = &ucx_note {
        eprintln!("note: {n}; UCX's rcache not measured, mrkit alone");
    }
    if json {
        let mut m = serde_json::Map::new();
        for (k, v) in &rows {
            let v = (v * 100.0).round() / 100.0;
            m.insert(
                k.clone(),
                serde_json::Number::from_f64(v)
                    .map_or(serde_json::Value::Null, serde_json::Value::Number),
            );
        }
        println!("{}", serde_json::Value::Object(m));
    } else {
        println!("{:<40} {:>12}  target", "metric", "value");
        for (k, v) in rows.iter().chain(&extra) {
            println!("{k:<40} {v:>12.2}  {}", target_text(&rows, k));
        }
    }
    crate::exit::OK
}

#[cfg(test)]
mod tests {
    /// The text report's targets: a hit's with the same run's floor of its shape beside it,
    /// others as set, none for metrics without one.
    #[test]
    fn hit_targets_print_the_same_shape_floor() {
        let rows: Vec<(String, f64)> = [
            ("cache_hit_ns_p50_n65536", 30.0),
            ("hit_floor_ns_n65536", 25.8),
            ("hit_floor_ns_n65536_2threads", 26.9),
            ("cache_hit_ns_p50_n64", 3.0),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let cases = [
            ("cache_hit_ns_p50_n65536", "<= 25 ns (floor 25.80 ns)"),
            (
                "cache_hit_ns_p50_n65536_2threads",
                "<= 25 ns (floor 26.90 ns)",
            ),
            // No floor row for that shape in the run: the target alone.
            ("cache_hit_ns_p50_n64", "<= 15 ns"),
            ("cache_hit_ns_p50", "<= 30 ns"),
            ("cache_hit_ns_p50_n16", ""),
            ("cache_miss_overhead_ns", "<= 2000 ns"),
        ];
        for (k, want) in cases {
            assert_eq!(super::target_text(&rows, k), want, "{k}");
        }
    }

    /// Another user may create, under the shared temporary directory, the name this process
    /// would pick: before session 16 the UCX program's source went to
    /// `$TMPDIR/mrkit-ucx-bench-<pid>/rcache_bench.c` through whatever was there (a planted
    /// symlink made the bench overwrite its target; a planted directory let its owner swap
    /// the binary between build and run). The program is now built in a private directory
    /// (mkdtemp): the planted link's target is untouched, and nothing is left behind. (The
    /// parent here is a private directory of the test, standing for `$TMPDIR`, so that
    /// other processes' benches cannot disturb the count.)
    #[test]
    fn the_ucx_program_is_built_in_a_private_directory() {
        let tmp = tempfile::tempdir().expect("parent");
        let pid = std::process::id();
        let planted = tmp.path().join(format!("mrkit-ucx-bench-{pid}"));
        let victim = tmp.path().join("victim");
        std::fs::create_dir(&planted).expect("plant the directory");
        std::fs::write(&victim, b"precious").expect("victim");
        std::os::unix::fs::symlink(&victim, planted.join("rcache_bench.c")).expect("plant");
        let r = super::ucx_sweep_in(
            tmp.path(),
            &[1, 16, 64],
            &[64],
            super::Effort {
                lookups: 4000,
                rewarm_passes: 2,
                rounds: 2,
            },
        );
        let kept = std::fs::read(&victim).expect("victim");
        assert!(
            kept == b"precious",
            "the planted link was followed: its target now holds {} bytes",
            kept.len()
        );
        let mut left: Vec<_> = std::fs::read_dir(tmp.path())
            .expect("parent")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [format!("mrkit-ucx-bench-{pid}"), "victim".to_string()],
            "a scratch directory was left behind"
        );
        match r {
            Ok(points) => {
                let shape: Vec<_> = points.iter().map(|p| (p.buffers, p.scattered)).collect();
                assert_eq!(shape, [(1, false), (16, false), (64, false), (64, true)]);
                // 64 contiguous buffers are a cross-thread drop size: that figure too.
                let cross: Vec<_> = points.iter().map(|p| p.cross_drop.is_some()).collect();
                assert_eq!(cross, [false, false, true, false]);
                assert!(points.iter().filter_map(|p| p.cross_drop).all(|x| x > 0.0));
                assert!(points
                    .iter()
                    .all(|p| p.one > 0.0 && p.two > 0.0 && p.isolated > 0.0));
            }
            Err(e) if e.contains("not installed") => {
                eprintln!("MRKIT-SKIP the UCX run itself: {e}");
            }
            Err(e) => panic!("UCX sweep: {e}"),
        }
    }
}
