//! Lock-free lookup of the provider's handles (PD handle, CQ handle, QP number) on the data
//! path: a fixed direct-mapped index in front of the provider's maps, which stay the
//! authority. A post or a poll finds its object with four plain loads and no atomic
//! read-modify-write (a `RwLock` read takes and releases its lock word with two, and every
//! thread posting or polling bounces that cache line).
//!
//! Each slot is a seqlock over `(handle, pointer)`. Writers are the provider's create and
//! destroy verbs, serialised by the lock of the map they update; readers never write. A
//! reader gets a pointer only for a slot that was stable while it read both fields and holds
//! its handle; otherwise (an empty slot, another handle in it, a concurrent write) it asks the
//! map. Two handles that share a slot are both correct: the later one is in the slot, the
//! earlier one is found in the map.
//!
//! What a pointer found here may be used for is what the map's pointer may be used for: the
//! object lives until the verb that destroys it, which removes it here first.
#![forbid(unsafe_code)]

use std::sync::atomic::{fence, AtomicU32, AtomicUsize, Ordering};

/// Slots per index (a power of two): handles are usually small or sequential, so the first
/// thousand objects of a kind have a slot of their own.
const SLOTS: usize = 1024;

#[derive(Default)]
struct Slot {
    /// Even: stable; odd: a writer is between its two stores.
    seq: AtomicU32,
    handle: AtomicU32,
    /// The object's address (0: empty).
    addr: AtomicUsize,
}

/// The direct-mapped index (see the module docs).
pub(crate) struct FastIndex {
    slots: Box<[Slot]>,
}

impl Default for FastIndex {
    fn default() -> Self {
        FastIndex {
            slots: (0..SLOTS).map(|_| Slot::default()).collect(),
        }
    }
}

impl FastIndex {
    fn slot(&self, handle: u32) -> &Slot {
        // Fibonacci hashing spreads handles that step by a power of two (e.g. PD handles of
        // 256, 512, ...) over the slots.
        let i = (handle.wrapping_mul(0x9E37_79B9) >> 22) as usize;
        &self.slots[i % SLOTS]
    }

    /// The address recorded for `handle`, if its slot holds it.
    #[inline]
    pub(crate) fn get(&self, handle: u32) -> Option<usize> {
        let s = self.slot(handle);
        // Acquire: pairs with the writer's Release store of the even value, so the fields
        // read below are at least that write's.
        let before = s.seq.load(Ordering::Acquire);
        if before & 1 != 0 {
            return None;
        }
        let h = s.handle.load(Ordering::Relaxed);
        let a = s.addr.load(Ordering::Relaxed);
        // Orders the two field loads before the re-check of `seq`: if a writer's stores were
        // seen, its odd `seq` is seen too (the writer's Release fence orders them after it).
        fence(Ordering::Acquire);
        let after = s.seq.load(Ordering::Relaxed);
        (before == after && h == handle && a != 0).then_some(a)
    }

    /// Record `handle` at `addr` (replacing whatever the slot held). Callers serialise writes
    /// to one index (the map's lock).
    pub(crate) fn insert(&self, handle: u32, addr: usize) {
        self.write(self.slot(handle), handle, addr);
    }

    /// Forget `handle`, if its slot holds it. Same serialisation as [`FastIndex::insert`].
    pub(crate) fn remove(&self, handle: u32) {
        let s = self.slot(handle);
        if s.handle.load(Ordering::Relaxed) == handle {
            self.write(s, 0, 0);
        }
    }

    fn write(&self, s: &Slot, handle: u32, addr: usize) {
        let seq = s.seq.load(Ordering::Relaxed);
        // Odd first: a reader that sees any of the stores below then sees an odd or a newer
        // `seq` (Release fence: the odd store is ordered before the field stores).
        s.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        s.handle.store(handle, Ordering::Relaxed);
        s.addr.store(addr, Ordering::Relaxed);
        // Release: publishes the fields with the even value readers acquire.
        s.seq.store(seq.wrapping_add(2), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::FastIndex;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn finds_what_was_inserted_and_nothing_else() {
        let ix = FastIndex::default();
        assert_eq!(ix.get(7), None);
        ix.insert(7, 0x1000);
        assert_eq!(ix.get(7), Some(0x1000));
        assert_eq!(ix.get(8), None);
        // Handles sharing a slot: the later one wins it, the earlier is no longer found here.
        let other = (1..u32::MAX)
            .find(|&h| h != 7 && std::ptr::eq(ix.slot(h), ix.slot(7)))
            .unwrap();
        ix.insert(other, 0x2000);
        assert_eq!(ix.get(other), Some(0x2000));
        assert_eq!(ix.get(7), None);
        ix.remove(7); // not in the slot: leaves the other
        assert_eq!(ix.get(other), Some(0x2000));
        ix.remove(other);
        assert_eq!(ix.get(other), None);
    }

    #[test]
    fn readers_never_see_a_torn_pair() {
        // Two handles in one slot, each always with its own address: a reader that gets an
        // address for a handle gets that handle's.
        let ix = FastIndex::default();
        let a = 3u32;
        let b = (4..u32::MAX)
            .find(|&h| std::ptr::eq(ix.slot(h), ix.slot(a)))
            .unwrap();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..200_000u32 {
                    if i % 2 == 0 {
                        ix.insert(a, 0xa000);
                    } else {
                        ix.insert(b, 0xb000);
                    }
                }
                stop.store(true, Ordering::Relaxed);
            });
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(x) = ix.get(a) {
                        assert_eq!(x, 0xa000);
                    }
                    if let Some(x) = ix.get(b) {
                        assert_eq!(x, 0xb000);
                    }
                }
            });
        });
    }
}
