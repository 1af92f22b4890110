//! On-demand paging state of an ODP MR: which pages the device has faulted in.
//!
//! An ODP MR pins nothing. Before the device touches `[va, va+len)` it calls
//! [`OdpState::ensure`], which faults missing pages in (`MADV_POPULATE_READ/WRITE`, the user-space
//! analogue of `hmm_range_fault`) and records them as mapped. [`OdpState::invalidate`] is the MMU
//! notifier's half: the registration cache's memory monitor (or an explicit call) clears ranges
//! the application unmapped, so the next access faults again and follows the *current* mapping.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use parking_lot::Mutex;

use crate::error::Result;
use crate::mem;

/// Faulted-in ranges of an ODP MR (page aligned, non-overlapping, keyed by start).
#[derive(Debug, Default)]
pub struct OdpState {
    mapped: Mutex<BTreeMap<u64, u64>>,
}

impl OdpState {
    /// Snapshot the already-present pages of `[start, start+len)` (no faulting), as rxe does at
    /// registration. Implicit MRs start empty.
    pub fn snapshot(start: u64, len: u64) -> OdpState {
        let st = OdpState::default();
        if let Ok(present) = mem::fault::present_pages(start, len) {
            let ps = mem::page_size() as u64;
            let mut m = st.mapped.lock();
            let mut run: Option<u64> = None;
            for (i, p) in present.iter().enumerate() {
                let a = start + i as u64 * ps;
                match (p, run) {
                    (true, None) => run = Some(a),
                    (false, Some(s)) => {
                        m.insert(s, a);
                        run = None;
                    }
                    _ => {}
                }
            }
            if let Some(s) = run {
                m.insert(s, start + present.len() as u64 * ps);
            }
        }
        st
    }

    fn covered(m: &BTreeMap<u64, u64>, start: u64, end: u64) -> bool {
        let mut pos = start;
        for (&s, &e) in m.range(..end) {
            if e <= pos {
                continue;
            }
            if s > pos {
                return false;
            }
            pos = e;
            if pos >= end {
                return true;
            }
        }
        pos >= end
    }

    fn insert(m: &mut BTreeMap<u64, u64>, mut start: u64, mut end: u64) {
        let overlapping: Vec<(u64, u64)> = m
            .range(..=end)
            .filter(|(_, &e)| e >= start)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in overlapping {
            m.remove(&s);
            start = start.min(s);
            end = end.max(e);
        }
        m.insert(start, end);
    }

    /// Record the pages of `[va, va+len)` that are present now, without faulting
    /// (`IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT`).
    pub fn record_present(&self, va: u64, len: u64) {
        let Some((start, span)) = mem::page_span(va, len) else {
            return;
        };
        let snap = OdpState::snapshot(start, span);
        let found: Vec<(u64, u64)> = snap.mapped.lock().iter().map(|(s, e)| (*s, *e)).collect();
        let mut m = self.mapped.lock();
        for (s, e) in found {
            Self::insert(&mut m, s, e);
        }
    }

    /// Make sure `[va, va+len)` is mapped (writable if `write`), faulting it in if needed.
    /// Returns the number of faults taken (0 or 1). EFAULT if the range cannot be mapped.
    pub fn ensure(&self, va: u64, len: u64, write: bool) -> Result<u64> {
        if len == 0 {
            return Ok(0);
        }
        let Some((start, span)) = mem::page_span(va, len) else {
            return Err(crate::error::err!(
                EFAULT,
                "ODP access wraps the address space"
            ));
        };
        let end = start + span;
        // Writes always re-fault: a read fault may have mapped the shared zero page.
        if !write && Self::covered(&self.mapped.lock(), start, end) {
            return Ok(0);
        }
        mem::fault::fault_in(start, span, write)?;
        Self::insert(&mut self.mapped.lock(), start, end);
        Ok(1)
    }

    /// Forget `[va, va+len)`: the next access faults again (MMU-notifier invalidation).
    pub fn invalidate(&self, va: u64, len: u64) {
        let end = va.saturating_add(len);
        let mut m = self.mapped.lock();
        let hit: Vec<(u64, u64)> = m
            .range(..end)
            .filter(|(_, &e)| e > va)
            .map(|(&s, &e)| (s, e))
            .collect();
        for (s, e) in hit {
            m.remove(&s);
            if s < va {
                m.insert(s, va);
            }
            if e > end {
                m.insert(end, e);
            }
        }
    }

    /// Bytes currently recorded as mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped.lock().iter().map(|(s, e)| e - s).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_bookkeeping() {
        let st = OdpState::default();
        {
            let mut m = st.mapped.lock();
            OdpState::insert(&mut m, 0x1000, 0x3000);
            OdpState::insert(&mut m, 0x3000, 0x5000);
            OdpState::insert(&mut m, 0x8000, 0x9000);
            assert!(OdpState::covered(&m, 0x1000, 0x5000));
            assert!(!OdpState::covered(&m, 0x1000, 0x6000));
        }
        st.invalidate(0x2000, 0x1000);
        let m = st.mapped.lock();
        assert!(!OdpState::covered(&m, 0x1000, 0x5000));
        assert!(OdpState::covered(&m, 0x3000, 0x5000));
        assert!(OdpState::covered(&m, 0x1000, 0x2000));
    }
}
