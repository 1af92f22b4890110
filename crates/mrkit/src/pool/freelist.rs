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
}

impl FreeStack {
    /// An empty stack for indices `0..capacity`.
    pub fn new(capacity: u32) -> FreeStack {
        FreeStack {
            head: AtomicU64::new(u64::from(NIL)),
            next: (0..capacity).map(|_| AtomicU32::new(NIL)).collect(),
        }
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
        let mut v = Vec::with_capacity(1);
        self.pop_many(1, &mut v);
        v.pop()
    }

    /// Pop up to `n` indices into `out` with one compare-and-swap of the head (a magazine
    /// refill costs one contended operation, not one per index); returns how many.
    ///
    /// The chain is read from the links before the swap. If the swap succeeds, the head and
    /// its tag did not change since they were loaded, so no push or pop happened in between
    /// and the links read were those of the stack as it was (every link was written before the
    /// release swap that published it, and the acquire load of the head synchronises with
    /// every earlier swap, all of them read-modify-writes of one location). A link read while
    /// the stack changed can be anything, but then the tag makes the swap fail and the walk is
    /// redone.
    pub fn pop_many(&self, n: usize, out: &mut Vec<u32>) -> usize {
        let mark = out.len();
        if n == 0 {
            return 0;
        }
        let mut h = self.head.load(Ordering::Acquire);
        loop {
            out.truncate(mark);
            let mut cur = h as u32;
            while cur != NIL && out.len() - mark < n {
                out.push(cur);
                // Relaxed: ordered by the acquire load of `head` (see above).
                cur = self.next[cur as usize].load(Ordering::Relaxed);
            }
            if out.len() == mark {
                return 0;
            }
            let tag = (h >> 32).wrapping_add(1);
            let new = (tag << 32) | u64::from(cur);
            // Acquire on success: we own the popped indices and read nothing else of them;
            // release: the tag bump publishes nothing, but keeps every head update a release
            // so later poppers synchronise with all earlier pushes (see above).
            match self
                .head
                .compare_exchange_weak(h, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return out.len() - mark,
                Err(cur) => h = cur,
            }
        }
    }
}
