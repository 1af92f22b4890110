//! Where a registration's time goes, measured inside the device: each registration records
//! the end of its phases and keeps the result with the MR ([`crate::MrInfo::reg_timing`],
//! `mrkit reg`, `mrkit stat --mrs`, `mrkit_query_mr`). Phases, in order:
//!
//! * **accounting**: argument and access checks, the memory-lock budget (`RLIMIT_MEMLOCK`
//!   charge);
//! * **pin**: pinning the pages (io_uring fixed buffers or mlock);
//! * **walk**: the page walk (`/proc/self/pagemap`, page sizes, frame numbers);
//! * **translation**: `MADV_DONTFORK` and reserving the translation entries;
//! * **key**: taking a key and publishing the MR.
//!
//! An on-demand MR has no pin or walk (0). Each phase end also fires its USDT probe
//! ([`crate::probes`]).
#![forbid(unsafe_code)]

use std::time::Instant;

/// A registration's duration and its phases, in nanoseconds (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegTiming {
    /// Whole registration, from the call to the published key.
    pub total_ns: u64,
    /// Checks and memory-lock accounting.
    pub accounting_ns: u64,
    /// Pinning the pages.
    pub pin_ns: u64,
    /// The page walk.
    pub walk_ns: u64,
    /// DONTFORK and translation entries.
    pub translation_ns: u64,
    /// Key and publication.
    pub key_ns: u64,
}

/// A phase of a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Accounting,
    Pin,
    Walk,
    Translation,
    Key,
}

/// Measures one registration: [`RegTimer::mark`] ends a phase.
#[derive(Debug)]
pub(crate) struct RegTimer {
    t0: Instant,
    last: Instant,
    t: RegTiming,
}

impl RegTimer {
    pub(crate) fn start() -> RegTimer {
        let now = Instant::now();
        RegTimer {
            t0: now,
            last: now,
            t: RegTiming::default(),
        }
    }

    /// End `phase` now (its time: since the previous mark); `bytes` goes to its probe.
    pub(crate) fn mark(&mut self, phase: Phase, bytes: u64) {
        let now = Instant::now();
        let ns = now.duration_since(self.last).as_nanos() as u64;
        self.last = now;
        let slot = match phase {
            Phase::Accounting => &mut self.t.accounting_ns,
            Phase::Pin => &mut self.t.pin_ns,
            Phase::Walk => &mut self.t.walk_ns,
            Phase::Translation => &mut self.t.translation_ns,
            Phase::Key => &mut self.t.key_ns,
        };
        *slot = slot.saturating_add(ns);
        crate::probes::reg_phase(phase, bytes, ns);
    }

    /// The record, its total up to the last mark (no clock read: a clock read costs ~60 ns
    /// in the VMs mrkit is measured on, and a registration reads it once per phase already).
    pub(crate) fn finish(&self) -> RegTiming {
        RegTiming {
            total_ns: self.last.duration_since(self.t0).as_nanos() as u64,
            ..self.t
        }
    }

    /// Time since the start, read now (for a registration that failed between two marks).
    pub(crate) fn elapsed_ns(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }
}
