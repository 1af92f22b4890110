//! The miss path: a lookup the thread table could not serve looks in the shared index
//! (hit, or wait for a concurrent miss of the same range: single flight), and on a miss
//! registers in named steps: shape ([`RegCache::shape`], merge), claim (placeholder under the
//! write lock, limits), attach to the monitor, register outside any lock, publish (or
//! reject a registration the monitor invalidated meanwhile and retry), fall back.

use super::config::Shape;
use super::entry::retire_all;
use super::entry::Entry;
use super::entry::OwnerRange;
use super::entry::Piece;
use super::entry::REMOTE_RIGHTS;
use super::evict::Pick;
use super::handle::RegHandle;
use super::lease;
use super::lease::Hold;
use super::lease::LeaseSet;
use super::page_span;
use super::shape::merge;
use super::stats::inc;
use super::RegCache;
use crate::AccessFlags;
use crate::Errno;
use crate::Error;
use parking_lot::Condvar;
use parking_lot::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::OnceLock;
use std::time::Instant;

/// What the shared index holds for a request.
pub(super) enum Lookup {
    Hit(RegHandle, Hold<Entry>),
    Wait(Arc<Entry>),
    Miss,
}

/// A failed slow lookup: the error, and whether it was a device or resource limit (a
/// candidate for the bounce pool).
pub(super) type SlowError = (Error, bool);

/// A slow lookup, and what its retries have changed.
struct Request<'o> {
    addr: u64,
    end: u64,
    access: AccessFlags,
    /// Register the page-rounded range only (a widened shape failed).
    no_widen: bool,
    /// The owner of an owned request with remote rights (the registration stays inside it).
    own: Option<&'o OwnerRange>,
    /// Eviction rounds after a device limit so far ([`DEVICE_LIMIT_ROUNDS`] at most).
    device_limit_rounds: u32,
}

/// A range claimed by a miss: its placeholder, and the entries the claim superseded (merge)
/// or evicted (limits), dead and out of the index, to retire outside the lock.
struct Claim {
    placeholder: Arc<Entry>,
    superseded: Vec<Arc<Entry>>,
    victims: Vec<Arc<Entry>>,
}

/// How one miss ended.
enum Step {
    Done(RegHandle),
    /// Look the range up again.
    Retry,
}

/// Eviction rounds a lookup may make after the device refused its registration for lack of
/// resources (1/64 of the idle entries, then 1/8, then all: `evict::Pick::DeviceLimitRound`).
const DEVICE_LIMIT_ROUNDS: u32 = 3;

impl RegCache {
    pub(super) fn lookup(&self, addr: u64, end: u64, access: AccessFlags) -> Lookup {
        let ix = self.inner.index.read();
        let mut wait = None;
        for (_, _, _, e) in ix.containing(addr, end) {
            if !e.access.contains(access) || e.is_dead() || e.failed.load(Ordering::Acquire) {
                continue;
            }
            if e.ready().is_some() {
                // In the index under the read lock: not dead (death is set under the write lock).
                // This thread's lease on the entry if its ring has one (one lease per thread
                // and entry for lookups all over a large entry), else a new one.
                let (h, hold) = self.tls_reuse(e).unwrap_or_else(|| lease::lease(e));
                return Lookup::Hit(RegHandle { h }, hold);
            } else if wait.is_none() {
                wait = Some(e.clone());
            }
        }
        match wait {
            Some(e) => Lookup::Wait(e),
            None => Lookup::Miss,
        }
    }

    /// A lookup the thread's table could not serve: the shared index, else a miss (retried
    /// while the range is invalidated under it, at most 64 times). `no_widen` registers the
    /// page-rounded range only; `own` is the owner of an owned request with remote rights.
    /// Never inlined: inlined into a lookup it made the hit path spill registers and grow
    /// its stack frame.
    #[inline(never)]
    pub(super) fn get_slow(
        &self,
        addr: u64,
        len: u64,
        access: AccessFlags,
        no_widen: bool,
        own: Option<&OwnerRange>,
    ) -> std::result::Result<RegHandle, SlowError> {
        let c = &self.inner.shared.c;
        let end = self.checked_end(addr, len)?;
        let mut req = Request {
            addr,
            end,
            access,
            no_widen,
            own,
            device_limit_rounds: 0,
        };
        for _attempt in 0..64 {
            let mseq = self.sync_monitor();
            match self.lookup(addr, end, access) {
                Lookup::Hit(h, hold) => {
                    inc(&c.hits_slow);
                    if mseq & 1 == 0 {
                        self.tls_insert(addr, hold, mseq);
                    }
                    return Ok(h);
                }
                Lookup::Wait(e) => {
                    inc(&c.single_flight_waits);
                    e.wait();
                    continue;
                }
                Lookup::Miss => {}
            }
            if let Step::Done(h) = self.miss(&mut req)? {
                return Ok(h);
            }
        }
        Err((
            Error::new(
                Errno::EAGAIN,
                "the range kept being invalidated while it was registered (64 attempts); the \
                 application is unmapping it concurrently",
            ),
            false,
        ))
    }

    /// `addr + len`, refused (`EINVAL`) when empty or when it wraps (with a page to spare, so
    /// page rounding cannot wrap either).
    fn checked_end(&self, addr: u64, len: u64) -> std::result::Result<u64, SlowError> {
        if len == 0 {
            return Err((
                Error::new(Errno::EINVAL, "length 0: nothing to register"),
                false,
            ));
        }
        addr.checked_add(len)
            .filter(|e| *e <= u64::MAX - self.inner.page)
            .ok_or_else(|| {
                (
                    Error::new(Errno::EINVAL, "addr + len wraps the address space"),
                    false,
                )
            })
    }

    /// One miss: shape the range outside the lock, claim it with a placeholder, attach it to
    /// the monitor, register outside any lock, then publish or fall back.
    fn miss(&self, req: &mut Request<'_>) -> std::result::Result<Step, SlowError> {
        // Remote rights never widen to the whole mapping: the kernel merges adjacent anonymous
        // mappings into one VMA (a 64 KiB `mmap` next to others measured 2,240 KiB here), so
        // the "allocation" would expose other owners' bytes to peers holding the rkey.
        let remote = req.access.intersects(REMOTE_RIGHTS);
        let (mut s, mut e) = self.shape(req.addr, req.end, req.no_widen || remote);
        if let Some(o) = req.own {
            // Peers may reach every byte of the registration: only the owner's.
            s = s.max(o.start);
            e = e.min(o.end);
        }
        let Some(claim) = self.claim(req, s, e) else {
            return Ok(Step::Retry);
        };
        inc(&self.inner.shared.c.misses);
        // Superseded and evicted entries were marked dead under the lock; each is
        // deregistered when its last reference (maybe this one) goes.
        retire_all(claim.superseded);
        self.retire_victims(claim.victims);
        let p = claim.placeholder;
        self.attach_monitor(&p);
        match self.register_pieces(p.start, p.end, p.access) {
            Ok(pieces) => Ok(self.publish(req.addr, p, pieces)),
            Err(err) => self.fall_back(req, p, err),
        }
    }

    /// Under the write lock: `None` when a covering entry (or placeholder) appeared meanwhile
    /// (look up again). Else widen by merging ([`Shape::Merge`]), make room within the
    /// limits (approximate LRU eviction), and insert the placeholder concurrent lookups of
    /// the range wait on (single flight); uncached when the limits cannot be met.
    fn claim(&self, req: &Request<'_>, s: u64, e: u64) -> Option<Claim> {
        let inner = &*self.inner;
        let c = &inner.shared.c;
        let (addr, end, access) = (req.addr, req.end, req.access);
        let mut ix = inner.index.write();
        if ix.containing(addr, end).any(|(_, _, _, x)| {
            x.access.contains(access) && !x.is_dead() && !x.failed.load(Ordering::Acquire)
        }) {
            return None;
        }
        let mut superseded = Vec::new();
        let (s, e, acc) = match (inner.cfg.shape, req.no_widen, req.own) {
            (Shape::Merge { cap }, false, None) => {
                merge(&mut ix, (s, e), access, cap, &mut superseded, c)
            }
            _ => (s, e, access),
        };
        let mut victims = Vec::new();
        let fits = self.make_room(&mut ix, e - s, &mut victims);
        let placeholder = self.placeholder((s, e), acc, fits, req.own);
        if fits {
            ix.insert(s, e, placeholder.id, placeholder.clone());
        } else {
            // Private to its handles: leases are born dead, the last release retires.
            placeholder.leases.kill();
            inc(&c.uncached);
        }
        Some(Claim {
            placeholder,
            superseded,
            victims,
        })
    }

    /// A new entry over `[s, e)` with no pieces yet: lookups of its range wait on it.
    fn placeholder(
        &self,
        (s, e): (u64, u64),
        access: AccessFlags,
        cached: bool,
        own: Option<&OwnerRange>,
    ) -> Arc<Entry> {
        let inner = &*self.inner;
        Arc::new(Entry {
            id: inner.next_id.fetch_add(1, Ordering::Relaxed),
            start: s,
            end: e,
            span: page_span(inner.page, s, e),
            access,
            dead: AtomicBool::new(false),
            pieces: OnceLock::new(),
            failed: AtomicBool::new(false),
            regs: Mutex::new(Vec::new()),
            cached: AtomicBool::new(cached),
            monitored: AtomicBool::new(false),
            idle_since: AtomicU64::new(self.tick(Instant::now())),
            wait_mx: Mutex::new(()),
            wait_cv: Condvar::new(),
            shared: inner.shared.clone(),
            leases: LeaseSet::new(),
            retired: AtomicBool::new(false),
            owner: Mutex::new(own.map(|o| o.owner.clone())),
            mergeable: own.is_none(),
        })
    }

    /// Attach a cached placeholder's pages to the monitor BEFORE pinning (see the monitor
    /// docs); when the monitor cannot attach them the registration goes uncached.
    fn attach_monitor(&self, p: &Arc<Entry>) {
        let c = &self.inner.shared.c;
        let Some(m) = self.inner.shared.monitor else {
            return;
        };
        if !p.cached.load(Ordering::Acquire) {
            return;
        }
        let (ps, pe) = p.span;
        match m.attach(ps, pe - ps) {
            Ok(()) => p.monitored.store(true, Ordering::Release),
            Err(err) => {
                tracing::debug!(error = %err, "monitor cannot attach; registration uncached");
                self.unindex(p);
                p.cached.store(false, Ordering::Release);
                p.leases.kill();
                inc(&c.uncached);
                inc(&c.unmonitored);
            }
        }
    }

    /// Publish the registered `pieces` in the placeholder, first applying invalidations that
    /// arrived while they were registered. `Retry` (stale reject) when the range was
    /// invalidated meanwhile: the pages may be those of the old mapping.
    fn publish(&self, addr: u64, p: Arc<Entry>, pieces: Vec<Piece>) -> Step {
        let c = &self.inner.shared.c;
        if pieces.len() > 1 {
            inc(&c.splits);
        }
        // Owned by the entry from now on: deregistered when its last reference goes.
        p.regs.lock().extend(pieces.iter().map(|x| x.lkey));
        let mseq = self.sync_monitor();
        // The handle's lease is counted under the same lock: an invalidation after
        // publication then finds a user and leaves the MR to our last release.
        let published = {
            let _ix = self.inner.index.write();
            if p.is_dead() {
                None
            } else {
                let _ = p.pieces.set(pieces);
                Some(lease::lease(&p))
            }
        };
        p.wake();
        let Some((h, hold)) = published else {
            inc(&c.stale_rejects);
            p.failed.store(true, Ordering::Release);
            self.unindex(&p);
            return Step::Retry;
        };
        if p.cached.load(Ordering::Acquire) && mseq & 1 == 0 {
            self.tls_insert(addr, hold, mseq);
        }
        Step::Done(RegHandle { h })
    }

    /// Registration failed: give the placeholder up (its waiters look up again), then the
    /// fallbacks. After a device limit (`ENOMEM`, `EAGAIN`), up to [`DEVICE_LIMIT_ROUNDS`]
    /// times per lookup: evict a growing share of the idle entries, least recently used
    /// first (1/64, 1/8, all), and retry. After a widened shape: retry page-rounded. Else the
    /// error.
    fn fall_back(
        &self,
        req: &mut Request<'_>,
        p: Arc<Entry>,
        err: Error,
    ) -> std::result::Result<Step, SlowError> {
        let c = &self.inner.shared.c;
        let (s, e) = (p.start, p.end);
        p.failed.store(true, Ordering::Release);
        self.unindex(&p);
        p.wake();
        drop(p);
        let limit = matches!(err.errno(), Errno::ENOMEM | Errno::EAGAIN);
        if limit && req.device_limit_rounds < DEVICE_LIMIT_ROUNDS {
            let round = req.device_limit_rounds;
            req.device_limit_rounds += 1;
            inc(&c.fallback_evict_retry);
            // Nothing released: retrying cannot succeed.
            let (evicted, earlier) = self.evict(Pick::DeviceLimitRound(round));
            if evicted + earlier > 0 {
                return Ok(Step::Retry);
            }
            req.device_limit_rounds = DEVICE_LIMIT_ROUNDS;
        }
        let (rs, re) = page_span(self.inner.page, req.addr, req.end);
        if !req.no_widen && (s, e) != (rs, re) && (s, e) != (req.addr, req.end) {
            req.no_widen = true;
            inc(&c.fallback_shrink);
            return Ok(Step::Retry);
        }
        Err((err, limit))
    }

    pub(super) fn unindex(&self, e: &Arc<Entry>) {
        let mut ix = self.inner.index.write();
        ix.remove(e.start, e.id);
    }
}
