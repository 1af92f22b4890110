//! Per-message costs: registering every message, one reused MR, the MR pool, and the
//! registration cache's scenarios.

use std::sync::Arc;
use std::time::Instant;

use mrkit::{AccessFlags, Buffer, Context};
use mrkit_soft::mr::KeyUse;
use mrkit_soft::UserMemory;
use serde_json::{json, Value};

use super::registration::alloc;

pub(super) struct PerMessage {
    pub(super) messages: u64,
    pub(super) per_message_reg_ns: f64,
    pub(super) reused_mr_ns: f64,
    pub(super) error: Option<String>,
    /// ns per message through `mrkit::pool::MrPool` (alloc + free of a 4 KiB slot).
    pub(super) pool_ns: Result<f64, String>,
    /// ns to copy 4 KiB (the work a message does anyway), for the CPU-share estimate.
    pub(super) copy_ns: f64,
}

/// Per-message cost through the MR pool: allocate a 4 KiB slot, write the message, free it.
pub(super) fn pool_per_message(ctx: &Context, n: u64) -> Result<f64, String> {
    use mrkit::pool::{MrPool, PoolConfig};
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let pool = MrPool::new(
        &pd,
        PoolConfig {
            chunk_size: 4 << 20,
            ..PoolConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let msg = [0x5au8; 4096];
    // Warm the thread's magazine.
    drop(pool.alloc().map_err(|e| e.to_string())?);
    let t = Instant::now();
    for _ in 0..n {
        let mut s = pool.alloc().map_err(|e| e.to_string())?;
        s.as_mut_slice()[..4096].copy_from_slice(&msg);
        std::hint::black_box(s.lkey());
    }
    let total = t.elapsed().as_nanos() as f64 / n as f64;
    Ok(total)
}

/// One registration-cache scenario: `lookups` gets over `buffers` buffers of 64 KiB with room
/// for `max_entries` entries.
pub(super) fn cache_scenario(
    ctx: &Context,
    buffers: usize,
    max_entries: usize,
    lookups: u64,
) -> Value {
    use mrkit::cache::{CacheConfig, RegCache};
    let run = || -> Result<Value, String> {
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        let cache = RegCache::new(
            &pd,
            CacheConfig {
                max_entries,
                ..CacheConfig::default()
            },
        )
        .map_err(|e| e.to_string())?;
        let bufs: Vec<Buffer> = (0..buffers)
            .map(|_| alloc(64 << 10, false).ok_or_else(|| "allocation failed".to_string()))
            .collect::<Result<_, _>>()?;
        let t = Instant::now();
        for i in 0..lookups {
            // A strided walk over the working set (every buffer, in a scrambled order).
            let b = &bufs[(i as usize * 7 + i as usize / buffers) % buffers];
            let h = cache
                .get_ref(b.as_slice(), AccessFlags::empty())
                .map_err(|e| e.to_string())?;
            std::hint::black_box(h.lkey());
        }
        let ns = t.elapsed().as_nanos() as f64 / lookups as f64;
        let st = cache.stats();
        let total = (st.hits + st.misses).max(1);
        Ok(json!({
            "buffers": buffers,
            "buffer_size": 64 << 10,
            "max_entries": max_entries,
            "lookups": lookups,
            "ns_per_lookup": ns,
            "hits": st.hits,
            "fast_hits": st.fast_hits,
            "misses": st.misses,
            "evictions": st.evictions,
            "hit_rate": st.hits as f64 / total as f64,
            "error": null,
        }))
    };
    run().unwrap_or_else(
        |e| json!({"buffers": buffers, "max_entries": max_entries, "lookups": lookups, "error": e}),
    )
}

pub(super) fn pm_failed(n: u64, per: f64, error: Option<String>) -> PerMessage {
    PerMessage {
        messages: n,
        per_message_reg_ns: per,
        reused_mr_ns: 0.0,
        error,
        pool_ns: Err("not run".into()),
        copy_ns: 0.0,
    }
}

pub(super) fn copy_cost(n: u64) -> f64 {
    let src = vec![0x5au8; 4096];
    let mut dst = vec![0u8; 4096];
    let t = Instant::now();
    for _ in 0..n {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

/// Per-message registration vs one big MR reused (what a pool does, without the pool's own
/// bookkeeping): registering and deregistering 4 KiB for every message vs a key lookup and
/// range check against one registered 1 MiB slab (on a device other than mrkit0, whose key
/// table is not reachable, the range check of the safe API's `MemoryRegion::remote`).
pub(super) fn per_message(ctx: &Context, pd: u32, n: u64) -> PerMessage {
    let dev = ctx.provider();
    let slab = match alloc(1 << 20, false) {
        Some(b) => Arc::new(b),
        None => return pm_failed(n, 0.0, Some("allocation failed".into())),
    };
    let t = Instant::now();
    for i in 0..n {
        let off = (i % 256) * 4096;
        let Some(mem) = UserMemory::owned_range(slab.clone(), off, 4096) else {
            return pm_failed(n, 0.0, Some("slab too small".into()));
        };
        let iova = slab.addr() + off;
        match dev.reg_mr(
            pd,
            mem,
            iova,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        ) {
            Ok(mr) => {
                let _ = dev.dereg_mr(mr.lkey);
            }
            Err(e) => return pm_failed(n, 0.0, Some(e.to_string())),
        }
    }
    let per = t.elapsed().as_nanos() as f64 / n as f64;
    let addr = slab.addr();
    let big = match dev.reg_mr(
        pd,
        UserMemory::owned(slab),
        addr,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    ) {
        Ok(m) => m,
        Err(e) => return pm_failed(n, per, Some(e.to_string())),
    };
    let t = Instant::now();
    let mut ok = 0u64;
    for i in 0..n {
        let off = (i % 256) * 4096;
        let fits = match ctx.soft() {
            Some(soft) => soft
                .check_access(
                    big.rkey,
                    pd,
                    AccessFlags::REMOTE_WRITE,
                    big.iova + off,
                    4096,
                    KeyUse::Remote,
                    0,
                )
                .is_ok(),
            // The range check a sender does against the remote MR's (iova, length).
            None => std::hint::black_box(big.iova)
                .checked_add(off + 4096)
                .is_some_and(|end| end <= big.iova + big.length),
        };
        if fits {
            ok += 1;
        }
    }
    let reused = t.elapsed().as_nanos() as f64 / n as f64;
    let _ = dev.dereg_mr(big.lkey);
    PerMessage {
        messages: n,
        per_message_reg_ns: per,
        reused_mr_ns: reused,
        error: (ok != n).then(|| format!("{} of {n} accesses refused", n - ok)),
        pool_ns: pool_per_message(ctx, n),
        copy_ns: copy_cost(n),
    }
}
