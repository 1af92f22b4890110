//! The cache's configuration: the miss [`Shape`], the invalidation [`MonitorMode`], limits
//! and fallbacks ([`CacheConfig`]).

use std::time::Duration;

use crate::pool::MrPool;

/// How a miss decides what to register.
///
/// ```
/// use mrkit::cache::{CacheConfig, RegCache, Shape};
/// use mrkit::{AccessFlags, Context};
/// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// let cfg = CacheConfig { shape: Shape::Merge { cap: 1 << 20 }, ..Default::default() };
/// let cache = RegCache::new(&pd, cfg).unwrap();
/// let mut v = vec![0u8; 3 * 4096];
/// drop(cache.get_mut(&mut v[..4096], AccessFlags::LOCAL_WRITE).unwrap());
/// drop(cache.get_mut(&mut v[4096..8192], AccessFlags::LOCAL_WRITE).unwrap());
/// assert_eq!(cache.stats().merges, 1); // one registration over both
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Exactly the requested bytes.
    Exact,
    /// The requested bytes rounded out to pages (default).
    PageRounded,
    /// Page-rounded, merged with overlapping or adjacent cached entries while the union is
    /// at most `cap` bytes.
    Merge {
        /// Largest merged registration.
        cap: u64,
    },
    /// The whole mapping (VMA) containing the range, if at most `cap` bytes. Requests with
    /// remote rights are page-rounded instead: the kernel merges adjacent anonymous mappings
    /// with the same rights into one VMA, so the "allocation" can hold other owners' bytes,
    /// which peers holding the rkey must not reach.
    WholeAllocation {
        /// Largest registration.
        cap: u64,
    },
}

/// Invalidation source besides explicit [`RegCache::invalidate`](super::RegCache::invalidate).
///
/// The default, [`MonitorMode::Userfaultfd`], is what makes the safe entry points sound for
/// borrowed memory: a cached registration outlives the borrow it was made from, and the
/// monitor is what drops it when that memory is unmapped, so a later lookup at the same
/// address never gets keys that translate to the old pages. Without it the application
/// makes that promise itself, which is why [`MonitorMode::explicit_only`] is `unsafe`.
///
/// ```
/// use mrkit::cache::{CacheConfig, MonitorMode};
/// assert_eq!(CacheConfig::default().monitor, MonitorMode::Userfaultfd);
/// // SAFETY: this program calls `invalidate` before it frees or unmaps cached memory.
/// let cfg = CacheConfig { monitor: unsafe { MonitorMode::explicit_only() }, ..Default::default() };
/// assert!(matches!(cfg.monitor, MonitorMode::ExplicitOnly(_)));
/// ```
///
/// Choosing explicit invalidation without `unsafe` does not compile:
///
/// ```compile_fail,E0133
/// use mrkit::cache::MonitorMode;
/// let m = MonitorMode::explicit_only();
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MonitorMode {
    /// userfaultfd events (UNMAP, REMOVE, REMAP). [`RegCache::new`](super::RegCache::new) fails loudly when
    /// userfaultfd is unavailable.
    Userfaultfd,
    /// Only explicit invalidation: the application has promised (through the `unsafe`
    /// [`MonitorMode::explicit_only`], the only way to make the token) to call
    /// [`RegCache::invalidate`](super::RegCache::invalidate) before it unmaps or `MADV_DONTNEED`s cached memory.
    ExplicitOnly(ExplicitInvalidation),
}

/// Proof that the application took on [`MonitorMode::explicit_only`]'s contract; made only by
/// that `unsafe` function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExplicitInvalidation(pub(super) ());

/// Cache configuration.
///
/// ```
/// use std::time::Duration;
/// use mrkit::cache::{CacheConfig, RegCache};
/// use mrkit::Context;
/// let pd = Context::open_default().unwrap().alloc_pd().unwrap();
/// let cfg = CacheConfig {
///     max_entries: 4096,
///     max_bytes: 1 << 30,
///     idle_timeout: Duration::from_secs(5),
///     ..CacheConfig::default()
/// };
/// let cache = RegCache::new(&pd, cfg).unwrap();
/// assert!(cache.is_monitored()); // the default monitor: userfaultfd
/// ```
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Registration shape.
    pub shape: Shape,
    /// Most entries cached at once.
    pub max_entries: usize,
    /// Most bytes registered by cached entries at once.
    pub max_bytes: u64,
    /// Largest single MR (clamped to the device's `max_mr_size`).
    pub max_chunk: u64,
    /// Idle time after which [`RegCache::scan_idle`](super::RegCache::scan_idle) releases an entry.
    pub idle_timeout: Duration,
    /// Invalidation source.
    pub monitor: MonitorMode,
    /// Capacity of the pending-invalidation set (ranges; coalescing when full).
    pub pending_capacity: usize,
    /// Opt-in bounce path for [`RegCache::get_or_bounce_raw`](super::RegCache::get_or_bounce_raw).
    pub bounce: Option<MrPool>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            shape: Shape::PageRounded,
            max_entries: 1024,
            max_bytes: 4 << 30,
            max_chunk: 1 << 30,
            idle_timeout: Duration::from_secs(30),
            monitor: MonitorMode::Userfaultfd,
            pending_capacity: 256,
            bounce: None,
        }
    }
}
