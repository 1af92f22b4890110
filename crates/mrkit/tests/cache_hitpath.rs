//! The per-thread hit path over working sets larger than a handful of buffers: every warm
//! hit is served by the thread's own table (no index lock), at any working-set size, on
//! every thread; invalidation, eviction, thread exit and table overflow keep it correct.
//! Counters, keys and the device are checked, never timings.

mod cache_util;
mod providers_util;

use std::sync::mpsc;

use cache_util::*;
use mrkit::cache::{CacheConfig, RegCache};
use mrkit::AccessFlags;

const RW: AccessFlags = AccessFlags::LOCAL_WRITE;
const PAGE: u64 = 4096;

fn explicit(max_entries: usize) -> CacheConfig {
    CacheConfig {
        monitor: cache_util::explicit_only(),
        max_entries,
        ..CacheConfig::default()
    }
}

/// A scrambled order over `n` items, `passes` times (reproducible).
fn scrambled(n: usize, passes: usize, seed: u64) -> Vec<usize> {
    mrkit::cache::test_support::random_order(n, n * passes, seed)
        .into_iter()
        .map(|i| i as usize)
        .collect()
}

#[test]
fn warm_hits_over_many_buffers_are_all_thread_local() {
    let (ctx, pd) = open();
    for n in [16usize, 64, 1024] {
        let cache = RegCache::new(&pd, explicit(4096)).unwrap();
        let m = Map::new(n * PAGE as usize);
        let keys: Vec<u32> = (0..n as u64)
            .map(|i| cache.raw(m.addr + i * PAGE, PAGE, RW).unwrap().lkey())
            .collect();
        let s0 = cache.stats();
        assert_eq!(s0.misses, n as u64);
        let order = scrambled(n, 4, 0x9e37_79b9_7f4a_7c15);
        for &i in &order {
            let a = m.addr + i as u64 * PAGE;
            let h = cache.raw(a, PAGE, RW).unwrap();
            assert_eq!(h.lkey(), keys[i], "buffer {i}: another registration");
        }
        let s1 = cache.stats();
        assert_eq!(s1.misses, s0.misses, "{n} buffers: warm lookups missed");
        assert_eq!(
            s1.fast_hits - s0.fast_hits,
            order.len() as u64,
            "{n} buffers: warm hits left the per-thread path"
        );
        drop(cache);
        assert_live_mrs(&ctx, 0, "live MRs");
    }
}

#[test]
fn two_threads_hit_the_same_entries_each_on_its_own_path() {
    let (ctx, pd) = open();
    let n = 256usize;
    let cache = RegCache::new(&pd, explicit(1024)).unwrap();
    let m = Map::new(n * PAGE as usize);
    let keys: Vec<u32> = (0..n as u64)
        .map(|i| cache.raw(m.addr + i * PAGE, PAGE, RW).unwrap().lkey())
        .collect();
    let s0 = cache.stats();
    std::thread::scope(|s| {
        for seed in [1u64, 2] {
            let (c, keys, base) = (&cache, &keys, m.addr);
            s.spawn(move || {
                for &i in &scrambled(n, 8, seed * 0x2545_f491_4f6c_dd1d) {
                    let h = c.raw(base + i as u64 * PAGE, PAGE, RW).unwrap();
                    assert_eq!(h.lkey(), keys[i]);
                }
            });
        }
    });
    let s1 = cache.stats();
    let lookups = 2 * 8 * n as u64;
    assert_eq!(s1.misses, s0.misses);
    assert_eq!(s1.hits - s0.hits, lookups);
    // Each thread's first lookup of a buffer goes through the shared index once.
    assert!(
        s1.fast_hits - s0.fast_hits >= lookups - 2 * n as u64,
        "fast hits {} of {lookups}",
        s1.fast_hits - s0.fast_hits
    );
    drop(cache);
    assert_live_mrs(&ctx, 0, "live MRs");
}

#[test]
fn invalidation_reaches_every_thread_table() {
    let (ctx, pd) = open();
    let n = 64usize;
    let cache = RegCache::new(&pd, explicit(1024)).unwrap();
    let m = Map::new(n * PAGE as usize);
    // A second thread warms its table over every buffer and waits.
    let (warm_tx, warm_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let (c, base) = (&cache, m.addr);
        let t = s.spawn(move || {
            let old: Vec<u32> = (0..n as u64)
                .map(|i| c.raw(base + i * PAGE, PAGE, RW).unwrap().lkey())
                .collect();
            warm_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            // After the invalidation returned: nothing from the table.
            let before = c.stats();
            let new: Vec<u32> = (0..n as u64)
                .map(|i| c.raw(base + i * PAGE, PAGE, RW).unwrap().lkey())
                .collect();
            let after = c.stats();
            // The main thread registered them again: slow hits, none from the table.
            assert_eq!(after.hits - before.hits, n as u64);
            assert_eq!(after.fast_hits, before.fast_hits);
            (old, new)
        });
        warm_rx.recv().unwrap();
        // This thread's own table too.
        for i in 0..n as u64 {
            drop(cache.raw(m.addr + i * PAGE, PAGE, RW).unwrap());
        }
        assert_eq!(cache.invalidate(m.addr, n as u64 * PAGE), n);
        let before = cache.stats();
        for i in 0..n as u64 {
            drop(cache.raw(m.addr + i * PAGE, PAGE, RW).unwrap());
        }
        assert_eq!(cache.stats().fast_hits, before.fast_hits);
        go_tx.send(()).unwrap();
        let (old, new) = t.join().unwrap();
        for (i, k) in new.iter().enumerate() {
            assert_translates_key(&ctx, &pd, *k, m.addr + i as u64 * PAGE, PAGE);
        }
        for (o, n) in old.iter().zip(&new) {
            assert_ne!(o, n, "an invalidated registration was served again");
        }
    });
    drop(cache);
    assert_live_mrs(&ctx, 0, "live MRs");
}

#[test]
fn handle_outlives_its_thread_and_the_cache() {
    let (ctx, pd) = open();
    let cache = RegCache::new(&pd, explicit(64)).unwrap();
    let m = Map::new(4 * PAGE as usize);
    // Taken (and cloned) on a thread that exits: its table's holds go with it.
    let (h, c) = std::thread::scope(|s| {
        s.spawn(|| {
            let h = cache.raw(m.addr, PAGE, RW).unwrap();
            let again = cache.raw(m.addr, PAGE, RW).unwrap();
            assert_eq!(h.lkey(), again.lkey());
            (h, again.clone())
        })
        .join()
        .unwrap()
    });
    drop(c);
    assert_eq!(cache.invalidate(m.addr, PAGE), 1);
    assert_eq!(cache.stats().invalidated_in_use, 1);
    assert!(!h.is_cached());
    assert_translates(&ctx, &pd, &h, m.addr, PAGE);
    drop(cache);
    assert_translates(&ctx, &pd, &h, m.addr, PAGE);
    assert_live_mrs(&ctx, 1, "live MRs");
    drop(h);
    assert_live_mrs(&ctx, 0, "live MRs");
}

#[test]
fn thread_table_overflow_and_evictions_serve_only_live_registrations() {
    let (ctx, pd) = open();
    // 300 entries of 8 pages, looked up at every page: 2,400 keys against a thread table of
    // 1,200; a second round of 300 other buffers evicts the first.
    let n = 300usize;
    let per = 8u64;
    let cache = RegCache::new(&pd, explicit(n)).unwrap();
    let m = Map::new(2 * n * (per * PAGE) as usize);
    let order = scrambled(n * per as usize, 3, 7);
    for round in 0..2u64 {
        let base = |b: u64| m.addr + (round * n as u64 + b) * per * PAGE;
        for b in 0..n as u64 {
            drop(cache.raw(base(b), per * PAGE, RW).unwrap());
        }
        let s0 = cache.stats();
        for &k in &order {
            let (b, p) = ((k / per as usize) as u64, k as u64 % per);
            let a = base(b) + p * PAGE;
            let h = cache.raw(a, PAGE, RW).unwrap();
            assert_eq!(h.range(), (base(b), base(b) + per * PAGE));
            assert_translates(&ctx, &pd, &h, a, PAGE);
        }
        let s1 = cache.stats();
        assert_eq!(s1.misses, s0.misses, "round {round}: page lookups missed");
        assert!(s1.entries <= n as u64, "limit: {} entries", s1.entries);
    }
    let s = cache.stats();
    assert_eq!(s.evictions, n as u64);
    assert_eq!(s.registrations - s.deregistrations, s.entries);
    drop(cache);
    assert_live_mrs(&ctx, 0, "live MRs");
}

/// A thread that takes turns between caches over the same addresses: each lookup is served
/// by that cache's own per-thread table (its own keys, counted as its fast hits), whichever
/// cache the thread used last; a cache dropped while its table is the thread's current one
/// is never consulted for the next cache (a new registration, then hits on it).
#[test]
fn caches_taking_turns_on_one_thread_each_hit_their_own_table() {
    let (ctx, pd) = open();
    let n = 32u64;
    let m = Map::new((n * PAGE) as usize);
    let caches: Vec<RegCache> = (0..3)
        .map(|_| RegCache::new(&pd, explicit(64)).unwrap())
        .collect();
    let keys: Vec<Vec<u32>> = caches
        .iter()
        .map(|c| {
            (0..n)
                .map(|i| c.raw(m.addr + i * PAGE, PAGE, RW).unwrap().lkey())
                .collect()
        })
        .collect();
    let before: Vec<_> = caches.iter().map(|c| c.stats()).collect();
    let order = scrambled(n as usize * 3, 8, 0x2545_f491_4f6c_dd1d);
    let mut per_cache = [0u64; 3];
    for &k in &order {
        // Runs of one to three lookups on a cache, then another cache.
        let (c, i) = ((k / n as usize) % 3, k as u64 % n);
        per_cache[c] += 1;
        let h = caches[c].raw(m.addr + i * PAGE, PAGE, RW).unwrap();
        assert_eq!(h.lkey(), keys[c][i as usize], "cache {c}, buffer {i}");
    }
    for (c, cache) in caches.iter().enumerate() {
        let s = cache.stats();
        assert_eq!(s.misses, before[c].misses, "cache {c}: warm lookups missed");
        assert_eq!(s.fast_hits - before[c].fast_hits, per_cache[c], "cache {c}");
    }
    // The last cache hit is the thread's current one; drop it and open another.
    let mut caches = caches;
    drop(caches[2].raw(m.addr, PAGE, RW).unwrap());
    drop(caches.pop());
    let fresh = RegCache::new(&pd, explicit(64)).unwrap();
    let h = fresh.raw(m.addr, PAGE, RW).unwrap();
    assert_eq!(
        fresh.stats().misses,
        1,
        "a new cache hit a dropped cache's table"
    );
    assert!(!keys[2].contains(&h.lkey()));
    let again = fresh.raw(m.addr, PAGE, RW).unwrap();
    assert_eq!((again.lkey(), fresh.stats().fast_hits), (h.lkey(), 1));
    assert_eq!(caches[0].raw(m.addr, PAGE, RW).unwrap().lkey(), keys[0][0]);
    drop((h, again, fresh, caches));
    assert_live_mrs(&ctx, 0, "live MRs");
}

/// The kill's side of the lease protocol when the leases belong to a live other thread
/// (whose hits and same-thread drops have no locked instruction): an invalidation of many
/// entries deregisters every idle one at once (one barrier for all of them), an entry whose
/// handle the owner still holds at its drop on the owner thread, and one whose handle went to
/// this thread at its drop here (the cross-thread path).
#[test]
fn invalidating_entries_leased_by_a_live_thread_retires_each_at_the_right_time() {
    let (ctx, pd) = open();
    let n = 256usize;
    let cache = RegCache::new(&pd, explicit(1024)).unwrap();
    let m = Map::new(n * PAGE as usize);
    let (warm_tx, warm_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        // Owned here: a failed assertion below drops it, which ends the thread's wait.
        let go_tx = go_tx;
        let (c, base, tctx, tpd) = (&cache, m.addr, &ctx, &pd);
        let t = s.spawn(move || {
            // Leases on every entry, warm (the second lookup is a table hit).
            for _ in 0..2 {
                for i in 0..n as u64 {
                    drop(c.raw(base + i * PAGE, PAGE, RW).unwrap());
                }
            }
            let kept = c.raw(base, PAGE, RW).unwrap();
            let sent = c.raw(base + PAGE, PAGE, RW).unwrap();
            assert_eq!(c.stats().misses, n as u64);
            warm_tx.send(sent).unwrap();
            // Alive (its table holds the leases) while the entries are invalidated.
            go_rx.recv().unwrap();
            assert!(!kept.is_cached());
            let key = kept.lkey();
            drop(kept); // the owner thread's drop of a killed entry's last handle
            assert!(!cache_util::key_valid(tctx, tpd, key, base));
            done_tx.send(()).unwrap();
        });
        let sent = warm_rx.recv().unwrap();
        assert_live_mrs(&ctx, n as u64, "registered");
        assert_eq!(cache.invalidate(m.addr, n as u64 * PAGE), n);
        // Every idle entry went at once; the two with handles stay.
        assert_live_mrs(&ctx, 2, "after the invalidation");
        assert_eq!(cache.stats().invalidated_in_use, 2);
        assert_translates(&ctx, &pd, &sent, m.addr + PAGE, PAGE);
        let key = sent.lkey();
        drop(sent); // off its lease's owner thread
        assert!(!cache_util::key_valid(&ctx, &pd, key, m.addr + PAGE));
        assert_live_mrs(&ctx, 1, "after the cross-thread drop");
        go_tx.send(()).unwrap();
        done_rx.recv().unwrap();
        assert_live_mrs(&ctx, 0, "after the owner's drop");
        t.join().unwrap();
    });
    let s = cache.stats();
    assert_eq!(s.registrations - s.deregistrations, s.entries);
    drop(cache);
    assert_live_mrs(&ctx, 0, "after the cache's drop");
}

/// Misses at the limits evict entries another live thread has leases on: their kills share
/// membarriers (up to 32 evictions each), so a registration may outlive its eviction until
/// the batch is full, never beyond it, and `stats`, an invalidation or the cache's drop
/// retire the rest; an evicted entry is never served again.
#[test]
fn evictions_of_entries_leased_by_a_live_thread_retire_in_batches() {
    let (ctx, pd) = open();
    let n = 64usize;
    let cache = RegCache::new(&pd, explicit(n)).unwrap();
    let m = Map::new(4 * n * PAGE as usize);
    let (warm_tx, warm_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        // Owned here: a failed assertion below drops it, which ends the thread's wait.
        let go_tx = go_tx;
        let (c, base) = (&cache, m.addr);
        s.spawn(move || {
            for _ in 0..2 {
                for i in 0..n as u64 {
                    drop(c.raw(base + i * PAGE, PAGE, RW).unwrap());
                }
            }
            warm_tx.send(()).unwrap();
            // Alive, its table holding leases on every first-round entry.
            go_rx.recv().unwrap();
        });
        warm_rx.recv().unwrap();
        let old: Vec<u32> = (0..n as u64)
            .map(|i| cache.raw(m.addr + i * PAGE, PAGE, RW).unwrap().lkey())
            .collect();
        // Three more rounds of other buffers: every miss evicts one entry.
        for i in n as u64..4 * n as u64 {
            drop(cache.raw(m.addr + i * PAGE, PAGE, RW).unwrap());
            if let Some(live) = native_live_mrs(&ctx) {
                assert!(
                    live <= n as u64 + 32,
                    "{live} registrations for at most {n} entries"
                );
            }
        }
        let st = cache.stats();
        assert_eq!(st.evictions, 3 * n as u64);
        assert_eq!(st.registrations - st.deregistrations, st.entries);
        assert_live_mrs(&ctx, st.entries, "after stats");
        // The first round again: new registrations, none of the evicted ones.
        for (i, k) in old.iter().enumerate() {
            let a = m.addr + i as u64 * PAGE;
            let h = cache.raw(a, PAGE, RW).unwrap();
            assert_ne!(h.lkey(), *k, "an evicted registration was served again");
            assert_translates(&ctx, &pd, &h, a, PAGE);
        }
        go_tx.send(()).unwrap();
    });
    drop(cache);
    assert_live_mrs(&ctx, 0, "after the cache's drop");
}

/// A hit's handle reads its lkey from the lease's own line when one MR covers the entry, and
/// from the entry's pieces when the registration was split: either way every wrapper (raw,
/// shared borrow, exclusive borrow) and every SGE carries the key of the piece that holds the
/// byte, the device accepts it for those bytes, and it stays right after the entry is
/// invalidated while the handle lives.
#[test]
fn handle_keys_are_the_pieces_keys_for_one_mr_and_for_split_registrations() {
    let (ctx, pd) = open();
    // (max_chunk, pages of the registration): one MR, then split into 4 MRs of 1 page.
    for (max_chunk, pages) in [(1u64 << 30, 4u64), (PAGE, 4)] {
        let cache = RegCache::new(
            &pd,
            CacheConfig {
                max_chunk,
                ..explicit(64)
            },
        )
        .unwrap();
        let mut buf = mrkit::Buffer::new((pages * PAGE) as usize).unwrap();
        let base = buf.addr();
        let whole = cache.raw(base, pages * PAGE, RW).unwrap();
        let pieces = whole.pieces().to_vec();
        assert_eq!(
            pieces.len() as u64,
            if max_chunk == PAGE { pages } else { 1 }
        );
        let key_at = |a: u64| {
            pieces
                .iter()
                .find(|p| a >= p.addr && a < p.addr + p.len)
                .map(|p| p.lkey)
        };
        assert_eq!(whole.lkey(), pieces[0].lkey);
        assert_eq!(whole.lkey_for(base + pages * PAGE), None, "past the end");
        assert_eq!(whole.lkey_for(base - 1), None, "before the start");
        // Lookups at every page and across page boundaries (hits on `whole`'s entry).
        for (off, len) in [
            (0u64, 64u64),
            (PAGE + 100, 200),
            (PAGE - 8, 16),
            (3 * PAGE, PAGE),
        ] {
            let a = base + off;
            let raw = cache.raw(a, len, RW).unwrap();
            assert_eq!(raw.lkey_for(a), key_at(a), "raw at +{off}");
            let sges = raw.sges_at(a, len).unwrap();
            let mut at = a;
            for s in &sges {
                assert_eq!((s.addr, Some(s.lkey)), (at, key_at(at)), "SGE at +{off}");
                assert_translates_key(&ctx, &pd, s.lkey, s.addr, u64::from(s.len));
                at += u64::from(s.len);
            }
            assert_eq!(at, a + len, "SGEs of +{off} cover it");
            let bytes = &buf.as_slice()[off as usize..(off + len) as usize];
            let r = cache.get_ref(bytes, AccessFlags::empty()).unwrap();
            assert_eq!(Some(r.lkey()), key_at(a), "get_ref at +{off}");
            let mut v = Vec::new();
            mrkit::Registered::sges(&r, 0..len, &mut v).unwrap();
            assert_eq!(v, sges, "get_ref's SGEs at +{off}");
        }
        let tail = &mut buf.as_mut_slice()[(pages * PAGE - 64) as usize..];
        let w = cache.get_mut(tail, RW).unwrap();
        let end = base + pages * PAGE - 64;
        assert_eq!(Some(w.lkey()), key_at(end), "get_mut at the last bytes");
        drop(w);
        // Invalidated while held: still registered, same keys.
        let held = cache.raw(base + PAGE, PAGE, RW).unwrap();
        cache.invalidate(base, pages * PAGE);
        assert!(!held.is_cached());
        assert_eq!(held.lkey_for(base + PAGE), key_at(base + PAGE));
        assert_translates(&ctx, &pd, &held, base + PAGE, PAGE);
        drop((held, whole));
    }
}

/// A thread looking up more distinct pages than its table may hold (4 x `max_entries`, at
/// least 1,024 leases) lets go of a quarter of the table when it fills, not all of it: here
/// 1,536 pages of 192 entries against 1,024 leases keep ~59 % of warm lookups on the thread's
/// path (41.7 % when the whole table went), every one with the right registration.
#[test]
fn a_working_set_above_the_thread_table_keeps_most_of_it() {
    let (ctx, pd) = open();
    let (n, per) = (192usize, 8u64);
    let cache = RegCache::new(&pd, explicit(256)).unwrap();
    let m = Map::new(n * (per * PAGE) as usize);
    for b in 0..n as u64 {
        drop(cache.raw(m.addr + b * per * PAGE, per * PAGE, RW).unwrap());
    }
    let order = scrambled(n * per as usize, 6, 11);
    let lookups = |check: bool| {
        for &k in &order {
            let a = m.addr + k as u64 * PAGE;
            let h = cache.raw(a, PAGE, RW).unwrap();
            if check {
                let start = m.addr + (k as u64 / per) * per * PAGE;
                assert_eq!(h.range(), (start, start + per * PAGE));
                assert_translates(&ctx, &pd, &h, a, PAGE);
            }
        }
    };
    lookups(false);
    let s0 = cache.stats();
    lookups(true);
    let s1 = cache.stats();
    assert_eq!(s1.misses, s0.misses, "warm lookups missed");
    let share = (s1.fast_hits - s0.fast_hits) as f64 / order.len() as f64;
    assert!(
        share > 0.55,
        "{share:.3} of the lookups on the thread's path"
    );
    drop(cache);
    assert_live_mrs(&ctx, 0, "live MRs");
}
