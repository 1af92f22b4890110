//! The one module of the data path allowed `unsafe`: moving bytes into and out of registered
//! memory.
//!
//! Every function takes an [`MrGuard`] (the proof returned by
//! [`Context::check_access`](crate::Context::check_access)) plus an offset and a length inside
//! the guard's checked range, and asserts `offset + len <= guard.len` before touching memory.
//! While the guard lives the MR cannot finish deregistration (dereg drains guards), so the
//! pages stay pinned; after dereg returns no guard exists and no function here can reach that
//! memory. Copies use `ptr::copy` (memmove), so overlapping source and destination (a QP
//! writing into the MR it reads from) are fine.
//!
//! Limitation shared by every user-space device that copies through the process's virtual
//! addresses: if the application `munmap`s registered memory while it is still registered,
//! a copy faults (SIGSEGV) instead of reaching the pinned pages. Applications must deregister
//! first (the safe `mrkit` API guarantees this: an MR owns its buffer).

use crate::mr::MrGuard;
use parking_lot::Mutex;

fn span(g: &MrGuard, off: u64, len: usize) -> *mut u8 {
    let end = off.checked_add(len as u64).expect("copy range overflows");
    assert!(
        end <= g.len,
        "copy outside the checked range ({off}+{len} > {})",
        g.len
    );
    (g.va + off) as *mut u8
}

/// Copy `src.len()` bytes from a slice into registered memory at `dst.va + off`.
pub(crate) fn write_from(dst: &MrGuard, off: u64, src: &[u8]) {
    if src.is_empty() {
        return;
    }
    let p = span(dst, off, src.len());
    // SAFETY: [p, p+len) lies inside the range check_access validated against the MR and
    // the guard keeps the MR registered (pinned) for the duration of the copy.
    unsafe { std::ptr::copy(src.as_ptr(), p, src.len()) }
}

/// Copy registered memory at `src.va + off` into a slice.
pub(crate) fn read_into(src: &MrGuard, off: u64, dst: &mut [u8]) {
    if dst.is_empty() {
        return;
    }
    let p = span(src, off, dst.len());
    // SAFETY: as in `write_from`.
    unsafe { std::ptr::copy(p as *const u8, dst.as_mut_ptr(), dst.len()) }
}

/// Copy `len` bytes between two registered ranges.
pub(crate) fn mem_to_mem(dst: &MrGuard, doff: u64, src: &MrGuard, soff: u64, len: usize) {
    if len == 0 {
        return;
    }
    let d = span(dst, doff, len);
    let s = span(src, soff, len);
    // SAFETY: both ranges were validated by check_access and are kept registered by their
    // guards; `copy` tolerates overlap.
    unsafe { std::ptr::copy(s as *const u8, d, len) }
}

/// Copy a batch of `(dst guard, dst offset, src guard, src offset, len)` pieces, in order,
/// with **one memmove per run of pieces that are contiguous on both sides** (the loopback
/// responder's coalesced WRITE placement: 4 KiB packets of one message become one large copy).
/// Every piece is bounds-checked against its own guard exactly as [`mem_to_mem`]; a run is the
/// union of adjacent ranges each covered by a live guard, so it is covered too. Runs whose
/// source and destination overlap are not merged (piecewise order would matter).
pub(crate) fn mem_to_mem_batch(items: &[(&MrGuard, u64, &MrGuard, u64, usize)]) {
    let mut i = 0;
    while i < items.len() {
        let (dg, doff, sg, soff, len) = items[i];
        let d0 = span(dg, doff, len) as usize;
        let s0 = span(sg, soff, len) as usize;
        let mut run = len;
        let mut j = i + 1;
        while j < items.len() {
            let (dg2, doff2, sg2, soff2, len2) = items[j];
            let d = span(dg2, doff2, len2) as usize;
            let s = span(sg2, soff2, len2) as usize;
            let total = run + len2;
            let disjoint = d0 + total <= s0 || s0 + total <= d0;
            if d != d0 + run || s != s0 + run || !disjoint {
                break;
            }
            run = total;
            j += 1;
        }
        if j == i + 1 {
            mem_to_mem(dg, doff, sg, soff, len);
        } else if run > 0 {
            // SAFETY: [d0, d0+run) is the union of the adjacent destination pieces i..j and
            // [s0, s0+run) of the adjacent source pieces, each validated by `span` against a
            // guard that is alive for this call (the guards keep their MRs registered and
            // pinned); the two unions do not overlap (checked above).
            unsafe { std::ptr::copy_nonoverlapping(s0 as *const u8, d0 as *mut u8, run) }
        }
        i = j;
    }
}

/// One lock for every atomic the device executes (IBV_ATOMIC_HCA: atomic with respect to
/// other device atomics, as rxe's global spinlock). Process-wide so that two device
/// instances in one process (loopback "hosts") targeting the same memory stay atomic; one per
/// process so that a forked child never waits for a lock a parent thread held at `fork`.
static ATOMIC_LOCK: crate::mem::PerProcess<Mutex<()>> = crate::mem::PerProcess::new();

/// Atomic operation on a native-endian u64.
#[derive(Debug, Clone, Copy)]
pub(crate) enum AtomicOp {
    CmpSwap { compare: u64, swap: u64 },
    FetchAdd { add: u64 },
}

/// Execute an atomic at `g.va` (8 bytes, 8-aligned: checked by the caller and asserted here).
/// Returns the original value.
pub(crate) fn atomic(g: &MrGuard, op: AtomicOp) -> u64 {
    let p = span(g, 0, 8) as *mut u64;
    assert!(p as usize % 8 == 0, "atomic target must be 8-byte aligned");
    let _l = ATOMIC_LOCK.get_or_init(|| Mutex::new(())).lock();
    // SAFETY: 8 aligned bytes inside the checked range; the guard keeps them registered.
    // Volatile so that the read-modify-write really happens in memory under the lock.
    unsafe {
        let orig = std::ptr::read_volatile(p);
        let new = match op {
            AtomicOp::CmpSwap { compare, swap } => (orig == compare).then_some(swap),
            AtomicOp::FetchAdd { add } => Some(orig.wrapping_add(add)),
        };
        if let Some(v) = new {
            std::ptr::write_volatile(p, v);
        }
        orig
    }
}
