//! Stale-translation torture: threads map a buffer, fill it with a round-specific pattern,
//! register it through the cache, RDMA READ it from a second device through the returned
//! rkey, then unmap and remap the same address (or drop its pages with MADV_DONTNEED) and
//! go again. The cache must never serve a registration of an earlier mapping:
//!
//! * the bytes an RDMA READ fetches through the cached rkey are this round's pattern;
//! * the MR's pinned frames are the frames mapped now (`/proc/self/pagemap`, root only);
//! * the key is not the key of an earlier mapping's registration that is still alive (some
//!   handles are deliberately kept across the unmap; keys of deregistered MRs may be reissued
//!   by the device once their 8-bit generation wraps, so only live ones are compared).
//!
//! Invalidation comes from the userfaultfd monitor only (no explicit `invalidate`).

mod cache_util;
mod providers_util;

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cache_util::*;
use mrkit::cache::{RegCache, Shape};
use mrkit::{AccessFlags, DeviceConfig};
use mrkit_soft::cq::WcStatus;
use mrkit_soft::qp::{rc_connect, QpCap, QpInitAttr, SendWr, WrOpcode};

struct Reader {
    ctx: mrkit_soft::Context,
    cq: u32,
    qp: u32,
    land_mr: u32,
    land: Vec<u8>,
}

impl Reader {
    /// RDMA READ `len` bytes at `(addr, rkey)` of the target into the landing buffer.
    fn read(&mut self, addr: u64, rkey: u32, len: u32) -> Vec<u8> {
        let wr = SendWr::new(addr, WrOpcode::RdmaRead)
            .sge(self.land.as_ptr() as u64, len, self.land_mr)
            .remote(addr, rkey)
            .flags(mrkit_soft::qp::send_flags::SIGNALED);
        self.ctx.post_send(self.qp, &[wr]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut v = Vec::new();
        loop {
            if self.ctx.poll_cq(self.cq, &mut v, 1).unwrap() == 1 {
                assert_eq!(
                    v[0].status,
                    WcStatus::Success,
                    "RDMA READ failed: {:?}",
                    v[0]
                );
                return self.land[..len as usize].to_vec();
            }
            assert!(Instant::now() < deadline, "no READ completion");
            let _ = self.ctx.wait_cq(self.cq, Duration::from_millis(10));
        }
    }
}

const ALL: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_WRITE);

#[test]
fn remapped_addresses_never_get_old_registrations() {
    torture(8, 3, 150, false);
}

/// The same with 64-page mappings registered page by page (an entry each) at 48 pages a round:
/// each thread's table grows past 40 leases (moving them to a new block) between remaps.
#[test]
fn remapped_addresses_never_get_old_registrations_through_grown_tables() {
    torture(64, 48, 30, true);
}

/// Three threads, each `rounds` times: map `pages` pages, fill them, look them up at the first
/// `lookups` pages (to the end of the mapping: the first misses, the others hit; or one page
/// each, `per_page`, exact shape: each page its own entry, looked up twice), RDMA READ through
/// the first three, then unmap or discard them.
fn torture(pages: usize, lookups: u64, rounds: usize, per_page: bool) {
    if providers_util::needs_native("drives QPs on mrkit-soft directly, beside the cache's MRs") {
        return;
    }
    let target = providers_util::open();
    let pd = target.alloc_pd().unwrap();
    let tsoft = target.soft().unwrap().clone();
    // The target side's QP (responder) lives on the same device as the cache's MRs.
    let tcq = tsoft.create_cq(64, None).unwrap();
    let (tqp, _) = tsoft
        .create_qp(QpInitAttr {
            pd: pd.handle(),
            send_cq: tcq,
            recv_cq: tcq,
            cap: QpCap::default(),
            sq_sig_all: false,
        })
        .unwrap();
    let ictx = mrkit_soft::Context::open(DeviceConfig::rxe());
    let ipd = ictx.alloc_pd().unwrap();
    let icq = ictx.create_cq(64, None).unwrap();
    let (iqp, _) = ictx
        .create_qp(QpInitAttr {
            pd: ipd,
            send_cq: icq,
            recv_cq: icq,
            cap: QpCap::default(),
            sq_sig_all: false,
        })
        .unwrap();
    rc_connect(&ictx, iqp, &tsoft, tqp, ALL, 3).unwrap();
    let len = pages << 12;
    let land = vec![0u8; 4096];
    let land_mr = ictx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            ipd,
            unsafe { mrkit_soft::UserMemory::new(land.as_ptr() as u64, 4096) },
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap()
        .lkey;
    let reader = Mutex::new(Reader {
        ctx: ictx.clone(),
        cq: icq,
        qp: iqp,
        land_mr,
        land,
    });

    let Some(mut cfg) = monitored_config() else {
        return;
    };
    if per_page {
        cfg.shape = Shape::Exact;
    }
    let cache = RegCache::new(&pd, cfg).unwrap();
    let threads = 3;
    std::thread::scope(|s| {
        for t in 0..threads {
            let (cache, reader, target, pd) = (&cache, &reader, &target, &pd);
            s.spawn(move || {
                let mut m = Map::new(len);
                let addr = m.addr;
                let mut old_keys: HashSet<u32> = HashSet::new();
                for r in 0..rounds {
                    let pat = (t * 64 + r % 64 + 1) as u8;
                    m.fill(pat);
                    // A few lookups per mapping: the first misses, the others hit.
                    let mut kept = Vec::new();
                    // Page by page: twice (the second pass hits through the grown table).
                    let passes = if per_page { 2 } else { 1 };
                    for k in (0..passes).flat_map(|_| 0..lookups) {
                        let off = k * 4096;
                        let l = if per_page { 4096 } else { len as u64 - off };
                        let h = cache.raw(addr + off, l, ALL).unwrap();
                        let key = h.rkey_for(addr + off).unwrap();
                        assert!(
                            !old_keys.contains(&key),
                            "thread {t} round {r}: key {key:#x} of an old mapping served"
                        );
                        if k < 3 {
                            assert_pfns_current(target, key, addr, len as u64);
                            let got = reader.lock().unwrap().read(addr + off, key, 4096);
                            assert!(
                                got.iter().all(|&b| b == pat),
                                "thread {t} round {r}: READ saw old bytes"
                            );
                        }
                        // Sometimes keep the handle across the unmap (retired while in use).
                        if r % 7 == 0 && k == 0 {
                            kept.push(key);
                            std::mem::forget(h.clone());
                        }
                        drop(h);
                    }
                    old_keys.extend(kept);
                    if r % 3 == 2 {
                        m.dontneed();
                    } else {
                        m.remap_fixed();
                    }
                }
                let _ = pd;
            });
        }
    });
    let st = cache.stats();
    eprintln!("torture stats: {st:?}");
    assert!(
        st.hits > 0 && st.invalidations > 0 && st.monitor_events > 0,
        "{st:?}"
    );
}
