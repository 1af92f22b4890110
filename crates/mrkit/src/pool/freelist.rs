//! A lock-free LIFO of slot indices (Treiber stack with an ABA tag), the shared level under the
//! per-thread magazines of [`super::MrPool`].
//!
//! Metadata is 4 bytes per slot (the `next` link), kept outside the registered memory so the
//! NIC can never write allocator state.

use super::sync::{AtomicU32, AtomicU64, Ordering};

/// "No slot" in a link or in the head.
pub const NIL: u32 = u32::MAX;

/// Lock-free stack of `u32` slot indices below a fixed capacity.
#[derive(Debug)]
pub struct FreeStack {
    /// `(tag << 32) | top index`. The tag is bumped by every successful push and pop so a
    /// pop that read `top` and `next[top]` cannot succeed after `top` was popped and pushed
    /// back in between (ABA). Guards: which index is on top, and (through the tag) the
    /// validity of the `next[top]` value a popper read.
    head: AtomicU64,
    /// `next[i]`: the index below `i` while `i` is on the stack. Written only by the thread
    /// that owns `i` (a pusher before its release-CAS publishes `i`); read by poppers after
    /// an acquire load of `head`; a stale read is harmless because the tag makes the CAS fail.
    next: Box<[AtomicU32]>,
    /// Number of indices on the stack (approximate between a CAS and this update; for
    /// statistics only, never for correctness).
    len: AtomicU64,
}

impl FreeStack {
    /// An empty stack for indices `0..capacity`.
    pub fn new(capacity: u32) -> FreeStack {
        FreeStack {
            head: AtomicU64::new(u64::from(NIL)),
            next: (0..capacity).map(|_| AtomicU32::new(NIL)).collect(),
            len: AtomicU64::new(0),
        }
    }

    /// Capacity (highest index + 1).
    pub fn capacity(&self) -> u32 {
        self.next.len() as u32
    }

    /// Approximate number of indices on the stack.
    pub fn len(&self) -> u64 {
        self.len.load(Ordering::Relaxed)
    }

    /// True when (approximately) empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Push a chain of indices (each must be owned by the caller, i.e. not on the stack).
    pub fn push_many(&self, idx: &[u32]) {
        let Some((&first, _)) = idx.split_first() else {
            return;
        };
        // Link the chain privately: idx[k] -> idx[k+1]; nobody else can see these links yet.
        for w in idx.windows(2) {
            self.next[w[0] as usize].store(w[1], Ordering::Relaxed);
        }
        let last = *idx.last().expect("non-empty");
        // Counted before publication so a racing pop can never make `len` underflow.
        self.len.fetch_add(idx.len() as u64, Ordering::Relaxed);
        let mut h = self.head.load(Ordering::Acquire);
        loop {
            self.next[last as usize].store(h as u32, Ordering::Relaxed);
            let tag = (h >> 32).wrapping_add(1);
            let new = (tag << 32) | u64::from(first);
            // Release: publishes the links written above to the popper that acquires `head`.
            match self
                .head
                .compare_exchange_weak(h, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(cur) => h = cur,
            }
        }
    }

    /// Push one index.
    pub fn push(&self, idx: u32) {
        self.push_many(&[idx]);
    }

    /// Pop one index.
    pub fn pop(&self) -> Option<u32> {
        let mut h = self.head.load(Ordering::Acquire);
        loop {
            let top = h as u32;
            if top == NIL {
                return None;
            }
            let next = self.next[top as usize].load(Ordering::Relaxed);
            let tag = (h >> 32).wrapping_add(1);
            let new = (tag << 32) | u64::from(next);
            match self
                .head
                .compare_exchange_weak(h, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.len.fetch_sub(1, Ordering::Relaxed);
                    return Some(top);
                }
                Err(cur) => h = cur,
            }
        }
    }

    /// Pop up to `n` indices into `out`; returns how many were popped.
    pub fn pop_many(&self, n: usize, out: &mut Vec<u32>) -> usize {
        let mut k = 0;
        while k < n {
            match self.pop() {
                Some(i) => {
                    out.push(i);
                    k += 1;
                }
                None => break,
            }
        }
        k
    }
}
