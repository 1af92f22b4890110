//! Property test: the registration cache against a model, over random sequences of
//! get / put / invalidate / munmap+remap / MADV_DONTNEED / idle scans, with the userfaultfd
//! monitor on (where userfaultfd is unavailable: explicit invalidation before each unmap). Invariants checked after every step:
//!
//! * a returned registration covers the request with at least the requested rights, and its
//!   MR pins exactly the frames mapped *now* (never those of an earlier mapping);
//! * every held handle's keys stay valid on the device until the handle drops;
//! * the cache never holds more than `max_entries` entries or `max_bytes` bytes;
//! * at the end, no MR is left on the device (no leak, in-use invalidated entries included).
//!
//! Some lookups and drops run on a helper thread (its own per-thread table and leases;
//! handles cross threads both ways). Two scales: a few pages under tight limits (evictions,
//! overlaps, merges), and many single pages under loose ones, so that the thread tables
//! grow (their leases move to a new block while some are in use) and reuse their cells.

mod cache_util;
mod providers_util;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use cache_util::*;
use mrkit::cache::{CacheConfig, MonitorMode, RegCache, RegHandle, Shape};
use mrkit::AccessFlags;
use proptest::prelude::*;

/// Pages per mapping, small scale.
const PAGES: u64 = 8;
/// Pages per mapping, large scale (three mappings: up to 192 keys per thread table, which
/// grows past 40 and 80).
const MANY_PAGES: u64 = 64;
const PS: u64 = 4096;

#[derive(Debug, Clone)]
enum Op {
    Get {
        b: usize,
        page: u64,
        npages: u64,
        off: u64,
        rights: u8,
        /// Looked up on the helper thread (its own thread table and leases); the handle is
        /// kept here.
        other: bool,
    },
    /// Drop a held handle (on the helper thread when the flag is set).
    Put(usize, bool),
    Invalidate {
        b: usize,
        page: u64,
        npages: u64,
    },
    Remap(usize),
    DontNeed(usize),
    Scan,
}

/// Operations over three mappings of `pages` pages; gets of at most `max_npages` pages
/// (`get_weight` to 3 puts).
fn op(pages: u64, max_npages: u64, get_weight: u32) -> impl Strategy<Value = Op> {
    prop_oneof![
        get_weight => (0..3usize, 0..pages, 1..=max_npages, 0..PS, 0..3u8, proptest::bool::weighted(0.3))
            .prop_map(|(b, page, npages, off, rights, other)| Op::Get { b, page, npages, off, rights, other }),
        3 => (0..64usize, proptest::bool::weighted(0.3)).prop_map(|(i, other)| Op::Put(i, other)),
        1 => (0..3usize, 0..pages, 1..=4u64).prop_map(|(b, page, npages)| Op::Invalidate { b, page, npages }),
        1 => (0..3usize).prop_map(Op::Remap),
        1 => (0..3usize).prop_map(Op::DontNeed),
        1 => Just(Op::Scan),
    ]
}

fn rights(r: u8) -> AccessFlags {
    match r {
        0 => AccessFlags::empty(),
        1 => AccessFlags::LOCAL_WRITE,
        _ => AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
    }
}

fn shape(s: u8) -> Shape {
    match s {
        0 => Shape::Exact,
        1 => Shape::PageRounded,
        _ => Shape::Merge { cap: 6 * PS },
    }
}

enum Req {
    Get(u64, u64, AccessFlags),
    Drop(RegHandle),
}

/// A second thread doing lookups and drops on request, one at a time (so the model stays
/// sequential): handles taken there count on its own leases, handles dropped there give
/// back counts of another thread's leases.
struct Helper {
    tx: Option<mpsc::Sender<Req>>,
    rx: mpsc::Receiver<Option<RegHandle>>,
    th: Option<std::thread::JoinHandle<()>>,
}

impl Helper {
    fn start(cache: &RegCache) -> Helper {
        let (tx, req) = mpsc::channel::<Req>();
        let (ret, rx) = mpsc::channel();
        let cache = cache.clone();
        let th = std::thread::spawn(move || {
            for r in req {
                let out = match r {
                    Req::Get(a, l, acc) => Some(cache.raw(a, l, acc).unwrap()),
                    Req::Drop(h) => {
                        drop(h);
                        None
                    }
                };
                if ret.send(out).is_err() {
                    return;
                }
            }
        });
        Helper {
            tx: Some(tx),
            rx,
            th: Some(th),
        }
    }
    fn call(&self, r: Req) -> Option<RegHandle> {
        self.tx.as_ref().unwrap().send(r).unwrap();
        self.rx.recv().unwrap()
    }
    fn get(&self, a: u64, l: u64, acc: AccessFlags) -> RegHandle {
        self.call(Req::Get(a, l, acc)).unwrap()
    }
    fn drop_there(&self, h: RegHandle) {
        self.call(Req::Drop(h));
    }
    fn stop(mut self) {
        drop(self.tx.take());
        if let Some(t) = self.th.take() {
            t.join().unwrap();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn cache_matches_model(ops in proptest::collection::vec(op(PAGES, 3, 6), 1..40), sh in 0..3u8) {
        check(ops, sh, PAGES, 6, 16)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn cache_with_grown_thread_tables_matches_model(
        ops in proptest::collection::vec(op(MANY_PAGES, 1, 120), 150..400),
        sh in 0..2u8,
    ) {
        check(ops, sh, MANY_PAGES, 400, 400)?;
    }
}

/// One sequence against the model: three mappings of `pages` pages, at most `max_entries`
/// entries and `max_pages` pages cached.
fn check(
    ops: Vec<Op>,
    sh: u8,
    pages: u64,
    max_entries: usize,
    max_pages: u64,
) -> Result<(), TestCaseError> {
    {
        let monitored = monitored_config().is_some();
        let (ctx, pd) = open();
        let cfg = CacheConfig {
            shape: shape(sh),
            max_entries,
            max_bytes: max_pages * PS,
            idle_timeout: Duration::from_secs(1),
            monitor: if monitored {
                MonitorMode::Userfaultfd
            } else {
                cache_util::explicit_only()
            },
            ..CacheConfig::default()
        };
        let max_bytes = cfg.max_bytes;
        let cache = RegCache::new(&pd, cfg).unwrap();
        let mut maps: Vec<Map> = (0..3).map(|_| Map::new((pages * PS) as usize)).collect();
        let mut held: Vec<RegHandle> = Vec::new();
        let helper = Helper::start(&cache);
        let t0 = Instant::now();
        let mut scans = 0u64;
        for op in ops {
            match op {
                Op::Get {
                    b,
                    page,
                    npages,
                    off,
                    rights: r,
                    other,
                } => {
                    let npages = npages.min(pages - page);
                    let addr = maps[b].addr + page * PS + off.min(PS - 1);
                    let len = (npages * PS - off.min(PS - 1)).max(1);
                    let acc = rights(r);
                    let h = if other {
                        helper.get(addr, len, acc)
                    } else {
                        cache.raw(addr, len, acc).unwrap()
                    };
                    let (s, e) = h.range();
                    prop_assert!(
                        s <= addr && addr + len <= e,
                        "range {s:#x}..{e:#x} misses request"
                    );
                    prop_assert!(h.access().contains(acc));
                    for p in h.pieces() {
                        assert_pfns_current(&ctx, p.lkey, p.addr, p.len);
                    }
                    assert_translates(&ctx, &pd, &h, addr, len);
                    held.push(h);
                }
                Op::Put(i, other) => {
                    if !held.is_empty() {
                        let h = held.swap_remove(i % held.len());
                        if other {
                            helper.drop_there(h);
                        }
                    }
                }
                Op::Invalidate { b, page, npages } => {
                    cache.invalidate(maps[b].addr + page * PS, npages * PS);
                }
                Op::Remap(b) => {
                    if !monitored {
                        // Without a monitor the application must say so first.
                        cache.invalidate(maps[b].addr, pages * PS);
                    }
                    maps[b].remap_fixed()
                }
                Op::DontNeed(b) => {
                    if !monitored {
                        cache.invalidate(maps[b].addr, pages * PS);
                    }
                    maps[b].dontneed()
                }
                Op::Scan => {
                    scans += 1;
                    cache.scan_idle(t0 + Duration::from_secs(2 * scans));
                }
            }
            // Held handles stay usable (possibly retired, never deregistered under us).
            let probes: Vec<(u32, u64)> = held
                .iter()
                .flat_map(|h| h.pieces().iter().map(|p| (p.lkey, p.addr)))
                .collect();
            for (&(key, _), ok) in probes.iter().zip(keys_valid(&ctx, &pd, &probes)) {
                prop_assert!(ok, "held key {:#x} died", key);
            }
            let entries = cache.entries();
            prop_assert!(entries.len() <= max_entries);
            let bytes: u64 = entries.iter().map(|e| e.1 - e.0).sum();
            prop_assert!(bytes <= max_bytes);
        }
        held.clear();
        // The helper's table goes with its thread.
        helper.stop();
        cache.flush_idle();
        prop_assert_eq!(cache.len(), 0);
        drop(cache);
        assert_live_mrs(&ctx, 0, "MRs leaked");
    }
    Ok(())
}
