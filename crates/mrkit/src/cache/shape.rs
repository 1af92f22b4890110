//! Shaping a miss: which range to register for a request ([`Shape`]): exact, page-rounded,
//! merged with neighbouring entries, or the whole allocation (from `/proc/self/maps`).

use std::sync::Arc;

use super::config::Shape;
use super::entry::{Entry, REMOTE_RIGHTS};
use super::index::IntervalIndex;
use super::page_span;
use super::stats::{inc, Counters};
use super::RegCache;
use crate::AccessFlags;

impl RegCache {
    /// The range a miss on `[addr, end)` registers before merging; `no_widen` keeps it
    /// page-rounded (a widened shape failed to register).
    pub(super) fn shape(&self, addr: u64, end: u64, no_widen: bool) -> (u64, u64) {
        let page = self.inner.page;
        let rounded = page_span(page, addr, end);
        match self.inner.cfg.shape {
            Shape::Exact => (addr, end),
            Shape::PageRounded | Shape::Merge { .. } => rounded,
            Shape::WholeAllocation { cap } => {
                if no_widen {
                    return rounded;
                }
                match vma_bounds(addr, end) {
                    Some((s, e)) if e - s <= cap => (s, e),
                    _ => rounded,
                }
            }
        }
    }
}

/// Bounds of the mapping(s) containing `[a, b)` from `/proc/self/maps` (contiguous VMAs
/// with equal permissions), or `None`.
///
/// ```
/// let b = mrkit::Buffer::new(3 * 4096).unwrap();
/// let (s, e) = mrkit::cache::vma_bounds(b.addr() + 10, b.addr() + 20).unwrap();
/// assert!(s <= b.addr() && b.addr() + 3 * 4096 <= e);
/// ```
///
/// A read of `/proc/self/maps` is not atomic: while another thread maps or unmaps, the
/// kernel can skip a VMA between two `read` chunks. A miss is therefore retried a few
/// times before the caller falls back to the page-rounded shape.
pub fn vma_bounds(a: u64, b: u64) -> Option<(u64, u64)> {
    (0..4).find_map(|_| vma_bounds_once(a, b))
}

pub(super) fn vma_bounds_once(a: u64, b: u64) -> Option<(u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let mut vmas = maps.lines().filter_map(|l| {
        let mut it = l.split_whitespace();
        let range = it.next()?;
        let perms = it.next()?.to_string();
        let (s, e) = range.split_once('-')?;
        Some((
            u64::from_str_radix(s, 16).ok()?,
            u64::from_str_radix(e, 16).ok()?,
            perms,
        ))
    });
    let (s, mut e, perms) = vmas.by_ref().find(|(s, e, _)| *s <= a && a < *e)?;
    while e < b {
        let (ns, ne, np) = vmas.next()?;
        if ns != e || np != perms {
            return None;
        }
        e = ne;
    }
    Some((s, e))
}

/// [`Shape::Merge`], under the index write lock: widen `[s, e)` over ready neighbours of the
/// same kind (at most three rounds, at most `cap` bytes), then supersede every such entry
/// inside the result (killed here, retired by the caller outside the lock). Returns the
/// merged range and the union of the rights.
///
/// Only entries of the same kind merge: with remote rights the union would expose every
/// member's bytes to peers, which only members that asked for remote rights themselves (raw
/// callers, under their contract) have agreed to.
pub(super) fn merge(
    ix: &mut IntervalIndex<Arc<Entry>>,
    (mut s, mut e): (u64, u64),
    access: AccessFlags,
    cap: u64,
    superseded: &mut Vec<Arc<Entry>>,
    c: &Counters,
) -> (u64, u64, AccessFlags) {
    let mut acc = access;
    let remote = access.intersects(REMOTE_RIGHTS);
    let joins = |x: &Entry| {
        x.ready().is_some()
            && !x.is_dead()
            && x.mergeable
            && x.access.intersects(REMOTE_RIGHTS) == remote
    };
    for _ in 0..3 {
        let near: Vec<(u64, u64, AccessFlags)> = ix
            .overlapping(s, e, true)
            .filter(|(_, _, _, x)| joins(x))
            .map(|(a, b, _, x)| (a, b, x.access))
            .collect();
        let ns = near.iter().map(|n| n.0).min().unwrap_or(s).min(s);
        let ne = near.iter().map(|n| n.1).max().unwrap_or(e).max(e);
        if (ns, ne) == (s, e) || ne - ns > cap {
            break;
        }
        s = ns;
        e = ne;
        for n in &near {
            acc |= n.2;
        }
    }
    // Supersede every ready entry inside the merged range.
    let ids: Vec<(u64, u64)> = ix
        .overlapping(s, e, false)
        .filter(|(a, b, _, x)| *a >= s && *b <= e && joins(x))
        .map(|(a, _, id, _)| (a, id))
        .collect();
    for (a, id) in ids {
        if let Some(x) = ix.remove(a, id) {
            x.kill();
            inc(&c.merges);
            superseded.push(x);
        }
    }
    (s, e, acc)
}
