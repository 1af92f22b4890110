//! Interval index of live registrations: `[start, end)` ranges keyed by `(start, id)`, which
//! may overlap (exact and page-rounded shapes allow two entries over the same bytes).
//!
//! Lookups scan only the starts in `[addr - max_len, addr]` (containment) or
//! `(addr - max_len, end)` (overlap), where `max_len` is the longest range ever inserted, so
//! cost is O(log n + candidates).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

/// Intervals with values.
#[derive(Debug)]
pub struct IntervalIndex<V> {
    /// (start, id) -> (end, value).
    map: BTreeMap<(u64, u64), (u64, V)>,
    /// Longest interval ever inserted (bounds the backward scan; never shrinks).
    max_len: u64,
    /// Sum of the lengths of the intervals present.
    bytes: u64,
}

impl<V> Default for IntervalIndex<V> {
    fn default() -> Self {
        IntervalIndex {
            map: BTreeMap::new(),
            max_len: 0,
            bytes: 0,
        }
    }
}

impl<V> IntervalIndex<V> {
    /// Number of intervals.
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// Sum of lengths.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// Insert `[start, end)` under `id` (ids are unique).
    pub fn insert(&mut self, start: u64, end: u64, id: u64, v: V) {
        debug_assert!(start < end);
        self.max_len = self.max_len.max(end - start);
        self.bytes += end - start;
        self.map.insert((start, id), (end, v));
    }
    /// Remove the interval `(start, id)`.
    pub fn remove(&mut self, start: u64, id: u64) -> Option<V> {
        let (end, v) = self.map.remove(&(start, id))?;
        self.bytes -= end - start;
        Some(v)
    }
    /// Intervals containing `[a, b)`: `(start, end, id, &value)`.
    pub fn containing(&self, a: u64, b: u64) -> impl Iterator<Item = (u64, u64, u64, &V)> {
        let lo = a.saturating_sub(self.max_len);
        self.map
            .range((lo, 0)..=(a, u64::MAX))
            .filter(move |(_, (end, _))| *end >= b)
            .map(|(&(s, id), (e, v))| (s, *e, id, v))
    }
    /// Intervals overlapping `[a, b)` (or touching it when `touch` is set).
    pub fn overlapping(
        &self,
        a: u64,
        b: u64,
        touch: bool,
    ) -> impl Iterator<Item = (u64, u64, u64, &V)> {
        let lo = a.saturating_sub(self.max_len);
        let hi = if touch { b } else { b.saturating_sub(1) };
        self.map
            .range((lo, 0)..=(hi, u64::MAX))
            .filter(move |&(&(s, _), (end, _))| {
                if touch {
                    *end >= a && s <= b
                } else {
                    *end > a && s < b
                }
            })
            .map(|(&(s, id), (e, v))| (s, *e, id, v))
    }
    /// Every interval.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, u64, &V)> {
        self.map.iter().map(|(&(s, id), (e, v))| (s, *e, id, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contain_and_overlap() {
        let mut ix = IntervalIndex::default();
        ix.insert(0x1000, 0x3000, 1, 'a');
        ix.insert(0x2000, 0x2800, 2, 'b');
        ix.insert(0x5000, 0x6000, 3, 'c');
        let c: Vec<u64> = ix.containing(0x2100, 0x2200).map(|x| x.2).collect();
        assert_eq!(c, vec![1, 2]);
        let c: Vec<u64> = ix.containing(0x2100, 0x2900).map(|x| x.2).collect();
        assert_eq!(c, vec![1]);
        let o: Vec<u64> = ix.overlapping(0x2fff, 0x5001, false).map(|x| x.2).collect();
        assert_eq!(o, vec![1, 3]);
        let o: Vec<u64> = ix.overlapping(0x3000, 0x5000, false).map(|x| x.2).collect();
        assert!(o.is_empty());
        let o: Vec<u64> = ix.overlapping(0x3000, 0x5000, true).map(|x| x.2).collect();
        assert_eq!(o, vec![1, 3]);
        assert_eq!(ix.bytes(), 0x2000 + 0x800 + 0x1000);
        assert_eq!(ix.remove(0x2000, 2), Some('b'));
        assert_eq!(ix.len(), 2);
    }
}
