//! An interval reference counter: a count per address over half-open ranges `[start, end)`.
//!
//! Used for per-page mlock pin counts ([`super::pin`]) and for refcounted `MADV_DONTFORK`
//! marks ([`super::fork`]): the caller performs the expensive syscall only on the parts of a
//! range whose count goes 0 → 1 ([`RangeCounter::inc`]) or 1 → 0 ([`RangeCounter::dec`]).
//! Storage is a `BTreeMap` of disjoint intervals with a non-zero count; adjacent intervals with
//! equal counts are merged, so the map stays as small as the set of distinct overlaps.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

/// Disjoint intervals `[start, end)` each with a count ≥ 1.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RangeCounter {
    /// start → (end, count); intervals never overlap and never have count 0.
    map: BTreeMap<u64, (u64, u64)>,
}

impl RangeCounter {
    /// An empty counter (every address at 0).
    pub const fn new() -> RangeCounter {
        RangeCounter {
            map: BTreeMap::new(),
        }
    }

    /// True when every address is at count 0.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Number of stored intervals (for tests and statistics).
    pub fn intervals(&self) -> usize {
        self.map.len()
    }

    /// The count at address `a`.
    pub fn count_at(&self, a: u64) -> u64 {
        match self.map.range(..=a).next_back() {
            Some((_, &(end, c))) if a < end => c,
            _ => 0,
        }
    }

    /// Split the interval containing `x` (strictly inside) at `x`.
    fn split_at(&mut self, x: u64) {
        let hit = match self.map.range(..x).next_back() {
            Some((&s, &(e, c))) if e > x => Some((s, e, c)),
            _ => None,
        };
        if let Some((s, e, c)) = hit {
            self.map.insert(s, (x, c));
            self.map.insert(x, (e, c));
        }
    }

    /// Merge equal-count neighbours around `[start, end]`.
    fn merge_around(&mut self, start: u64, end: u64) {
        let first = self
            .map
            .range(..start)
            .next_back()
            .map(|(&s, _)| s)
            .unwrap_or(start);
        let keys: Vec<u64> = self.map.range(first..=end).map(|(&s, _)| s).collect();
        let mut prev: Option<u64> = None;
        for k in keys {
            if let Some(p) = prev {
                let (pe, pc) = self.map[&p];
                let (ke, kc) = self.map[&k];
                if pe == k && pc == kc {
                    self.map.remove(&k);
                    self.map.insert(p, (ke, pc));
                    continue;
                }
            }
            prev = Some(k);
        }
    }

    /// Add one to every address of `[start, end)`; returns the sub-ranges that went 0 → 1, in
    /// address order and coalesced.
    pub fn inc(&mut self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut fresh = Vec::new();
        if start >= end {
            return fresh;
        }
        self.split_at(start);
        self.split_at(end);
        let existing: Vec<(u64, u64)> = self
            .map
            .range(start..end)
            .map(|(&s, &(e, _))| (s, e))
            .collect();
        let mut cursor = start;
        for (s, e) in existing {
            if s > cursor {
                fresh.push((cursor, s));
            }
            if let Some(v) = self.map.get_mut(&s) {
                v.1 += 1;
            }
            cursor = e;
        }
        if cursor < end {
            fresh.push((cursor, end));
        }
        for &(s, e) in &fresh {
            self.map.insert(s, (e, 1));
        }
        self.merge_around(start, end);
        fresh
    }

    /// Subtract one from every address of `[start, end)`; returns the sub-ranges that went
    /// 1 → 0, in address order and coalesced. Addresses already at 0 are left at 0 (a caller
    /// bug; checked in debug builds).
    pub fn dec(&mut self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut gone: Vec<(u64, u64)> = Vec::new();
        if start >= end {
            return gone;
        }
        self.split_at(start);
        self.split_at(end);
        let existing: Vec<(u64, u64, u64)> = self
            .map
            .range(start..end)
            .map(|(&s, &(e, c))| (s, e, c))
            .collect();
        debug_assert!(
            existing.first().map(|x| x.0) == Some(start)
                && existing.last().map(|x| x.1) == Some(end)
                && existing.windows(2).all(|w| w[0].1 == w[1].0),
            "RangeCounter::dec over addresses at count 0"
        );
        for (s, e, c) in existing {
            if c <= 1 {
                self.map.remove(&s);
                match gone.last_mut() {
                    Some(last) if last.1 == s => last.1 = e,
                    _ => gone.push((s, e)),
                }
            } else if let Some(v) = self.map.get_mut(&s) {
                v.1 = c - 1;
            }
        }
        self.merge_around(start, end);
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_inc_dec() {
        let mut r = RangeCounter::new();
        assert_eq!(r.inc(10, 20), vec![(10, 20)]);
        assert_eq!(r.inc(15, 30), vec![(20, 30)]);
        assert_eq!(r.count_at(14), 1);
        assert_eq!(r.count_at(15), 2);
        assert_eq!(r.count_at(29), 1);
        assert_eq!(r.count_at(30), 0);
        assert_eq!(r.inc(0, 40), vec![(0, 10), (30, 40)]);
        assert_eq!(r.dec(10, 20), Vec::<(u64, u64)>::new());
        assert_eq!(r.dec(0, 40), vec![(0, 15), (30, 40)]);
        assert_eq!(r.dec(15, 30), vec![(15, 30)]);
        assert!(r.is_empty());
    }

    #[test]
    fn merges_equal_neighbours() {
        let mut r = RangeCounter::new();
        r.inc(0, 10);
        r.inc(10, 20);
        assert_eq!(r.intervals(), 1);
        r.inc(5, 15);
        assert_eq!(r.intervals(), 3);
        r.dec(5, 15);
        assert_eq!(r.intervals(), 1);
        assert_eq!(r.dec(0, 20), vec![(0, 20)]);
        assert!(r.is_empty());
    }

    #[test]
    fn matches_naive_model() {
        // Deterministic pseudo-random operations checked against a per-address array.
        let mut r = RangeCounter::new();
        let mut naive = [0u64; 64];
        let mut held: Vec<(u64, u64)> = Vec::new();
        let mut x: u64 = 0x1234_5678;
        for _ in 0..2000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if held.is_empty() || x % 3 != 0 {
                let s = x % 60;
                let e = s + 1 + (x >> 8) % (64 - s);
                let fresh = r.inc(s, e);
                let mut expect = Vec::new();
                for a in s..e {
                    if naive[a as usize] == 0 {
                        expect.push(a);
                    }
                    naive[a as usize] += 1;
                }
                let got: Vec<u64> = fresh.iter().flat_map(|&(a, b)| a..b).collect();
                assert_eq!(got, expect);
                held.push((s, e));
            } else {
                let (s, e) = held.swap_remove((x >> 5) as usize % held.len());
                let gone = r.dec(s, e);
                let mut expect = Vec::new();
                for a in s..e {
                    naive[a as usize] -= 1;
                    if naive[a as usize] == 0 {
                        expect.push(a);
                    }
                }
                let got: Vec<u64> = gone.iter().flat_map(|&(a, b)| a..b).collect();
                assert_eq!(got, expect);
            }
            for a in 0..64u64 {
                assert_eq!(r.count_at(a), naive[a as usize]);
            }
        }
    }
}
