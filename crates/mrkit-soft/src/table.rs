//! Object tables with index + generation keys, two-phase publish and drain-before-free.
//!
//! A key is `(index << 8) | tag`. Indices are handed out by a rotating cursor over the whole
//! index range of the table (a freed index is not reused until the cursor has gone all the way
//! round), and the 8-bit tag is the slot's generation: the number of times the cursor has
//! wrapped. So the key of a destroyed object cannot match a later object until
//! `range × 256` keys have been issued (2^31 for MRs): strictly stronger than rxe's random tag
//! (1/256 per reuse, see `docs/semantics.md` §3).
//!
//! Life cycle (as rxe's pool): [`KeyTable::reserve`] takes a key and counts against the
//! limit; [`Reservation::publish`] makes the object visible to lookups; [`KeyTable::unpublish`]
//! removes it from lookup (every later lookup fails at once) and then [`Unpublished::drain`]
//! waits for the in-flight [`Guard`]s to drop. After that nobody can touch the object's memory.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;

/// An object in a table, with its in-flight user count.
#[derive(Debug)]
pub struct Entry<T> {
    /// Guards currently alive on this object. Incremented under the table's read lock (so no
    /// lookup can start after `unpublish` took the write lock), decremented when a guard drops;
    /// `drain` waits for zero.
    users: AtomicU32,
    key: u32,
    value: T,
}

impl<T> Entry<T> {
    /// The object's key.
    pub fn key(&self) -> u32 {
        self.key
    }
    /// The object.
    pub fn value(&self) -> &T {
        &self.value
    }
}

/// A live reference to a published object that blocks its destruction (drain) while alive.
#[derive(Debug)]
pub struct Guard<T> {
    entry: Arc<Entry<T>>,
}

impl<T> Guard<T> {
    /// The key the object was found by.
    pub fn key(&self) -> u32 {
        self.entry.key
    }
    /// The shared entry (for keeping the object, not its memory, alive).
    pub fn entry(&self) -> &Arc<Entry<T>> {
        &self.entry
    }
}

impl<T> Clone for Guard<T> {
    fn clone(&self) -> Self {
        self.entry.users.fetch_add(1, Ordering::AcqRel);
        Guard {
            entry: self.entry.clone(),
        }
    }
}

impl<T> Deref for Guard<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.entry.value
    }
}

impl<T> Drop for Guard<T> {
    fn drop(&mut self) {
        self.entry.users.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug)]
enum Slot<T> {
    Reserved,
    Live(Arc<Entry<T>>),
}

#[derive(Debug)]
struct Inner<T> {
    /// By index. FxHash: the indices are ours (a sequential cursor), so a key from the wire
    /// can only miss, never flood a bucket; SipHash cost ~20 ns per lookup on the data path.
    slots: HashMap<u32, Slot<T>, rustc_hash::FxBuildHasher>,
    /// Next index to try.
    cursor: u32,
    /// Times the cursor wrapped (mod 256): the tag of keys issued now.
    generation: u8,
}

/// Why a table refused to reserve a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveError {
    /// `limit` objects are alive (or reserved).
    Full {
        /// The limit in force.
        limit: u32,
    },
}

/// An index-keyed object table.
///
/// ```
/// use mrkit_soft::table::KeyTable;
/// let t: KeyTable<&str> = KeyTable::new(1, 1 << 10, 100);
/// let key = t.reserve().unwrap().publish("hello");
/// assert_eq!(*t.get(key).unwrap(), "hello");
/// assert!(t.get(key ^ 1).is_none()); // wrong tag
/// let gone = t.unpublish(key).unwrap().drain();
/// assert_eq!(gone, "hello");
/// assert!(t.get(key).is_none());
/// ```
#[derive(Debug)]
pub struct KeyTable<T> {
    inner: RwLock<Inner<T>>,
    min_index: u32,
    max_index: u32,
    /// Objects alive or reserved; bounded by `limit`.
    count: AtomicU32,
    /// Configured maximum of `count` (device attribute such as max_mr).
    limit: AtomicU32,
}

impl<T> KeyTable<T> {
    /// A table handing out indices `min_index..=max_index` (at most 2^24 - 1) with at most
    /// `limit` objects alive.
    pub fn new(min_index: u32, max_index: u32, limit: u32) -> KeyTable<T> {
        assert!(min_index >= 1 && max_index < (1 << 24) && min_index <= max_index);
        KeyTable {
            inner: RwLock::new(Inner {
                slots: HashMap::default(),
                cursor: min_index,
                generation: 0,
            }),
            min_index,
            max_index,
            count: AtomicU32::new(0),
            limit: AtomicU32::new(limit),
        }
    }

    /// Objects alive or reserved.
    pub fn len(&self) -> u32 {
        self.count.load(Ordering::Acquire)
    }

    /// True when no object is alive.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The limit on live objects.
    pub fn limit(&self) -> u32 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Reserve a key (phase one of creation). Fails when `limit` objects exist.
    pub fn reserve(&self) -> Result<Reservation<'_, T>, ReserveError> {
        let limit = self.limit();
        self.count
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                (c < limit).then_some(c + 1)
            })
            .map_err(|_| ReserveError::Full { limit })?;
        let range = self.max_index - self.min_index + 1;
        let mut g = self.inner.write();
        // The count bound guarantees a free index exists when limit <= range; if the limit
        // exceeds the range we still terminate after one full turn.
        for _ in 0..range {
            let idx = g.cursor;
            g.cursor = if idx == self.max_index {
                g.generation = g.generation.wrapping_add(1);
                self.min_index
            } else {
                idx + 1
            };
            if let std::collections::hash_map::Entry::Vacant(v) = g.slots.entry(idx) {
                v.insert(Slot::Reserved);
                let key = (idx << 8) | u32::from(g.generation);
                return Ok(Reservation {
                    table: self,
                    key,
                    done: false,
                });
            }
        }
        drop(g);
        self.count.fetch_sub(1, Ordering::AcqRel);
        Err(ReserveError::Full { limit })
    }

    /// Look up a published object by its exact key (index and tag). The guard blocks
    /// [`Unpublished::drain`] until dropped.
    pub fn get(&self, key: u32) -> Option<Guard<T>> {
        let g = self.inner.read();
        match g.slots.get(&(key >> 8)) {
            Some(Slot::Live(e)) if e.key == key => {
                e.users.fetch_add(1, Ordering::AcqRel);
                Some(Guard { entry: e.clone() })
            }
            _ => None,
        }
    }

    /// Remove an object from lookup (phase one of destruction). Later lookups fail at once.
    pub fn unpublish(&self, key: u32) -> Option<Unpublished<'_, T>> {
        let mut g = self.inner.write();
        let idx = key >> 8;
        match g.slots.get(&idx) {
            Some(Slot::Live(e)) if e.key == key => {}
            _ => return None,
        }
        let Some(Slot::Live(entry)) = g.slots.remove(&idx) else {
            unreachable!("checked above")
        };
        Some(Unpublished {
            table: self,
            entry,
            drained: false,
        })
    }

    /// Replace a published object in place (same key), e.g. for rereg PD/ACCESS changes.
    /// Returns once every guard on the old version has dropped, so after this no access runs
    /// under the old rights.
    pub fn replace(&self, key: u32, value: T) -> Result<Arc<Entry<T>>, T> {
        let old = {
            let mut g = self.inner.write();
            match g.slots.get_mut(&(key >> 8)) {
                Some(Slot::Live(e)) if e.key == key => {
                    let new = Arc::new(Entry {
                        users: AtomicU32::new(0),
                        key,
                        value,
                    });
                    std::mem::replace(e, new)
                }
                _ => return Err(value),
            }
        };
        wait_for_users(&old.users);
        Ok(old)
    }

    /// Look up by index only, ignoring the tag (memory windows, whose low byte changes on every
    /// bind, compare the full key against their current rkey themselves).
    pub fn get_by_index(&self, index: u32) -> Option<Guard<T>> {
        let g = self.inner.read();
        match g.slots.get(&index) {
            Some(Slot::Live(e)) => {
                e.users.fetch_add(1, Ordering::AcqRel);
                Some(Guard { entry: e.clone() })
            }
            _ => None,
        }
    }

    /// Every published key (for statistics and teardown).
    pub fn keys(&self) -> Vec<u32> {
        let g = self.inner.read();
        g.slots
            .values()
            .filter_map(|s| match s {
                Slot::Live(e) => Some(e.key),
                Slot::Reserved => None,
            })
            .collect()
    }
}

/// Spin briefly, then yield, then sleep until `users` is zero.
fn wait_for_users(users: &AtomicU32) {
    let start = Instant::now();
    let mut spins = 0u32;
    while users.load(Ordering::Acquire) != 0 {
        spins += 1;
        if spins < 1000 {
            std::hint::spin_loop();
        } else if start.elapsed() < Duration::from_millis(1) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// A reserved key; publish it or drop it to release the reservation.
#[derive(Debug)]
pub struct Reservation<'t, T> {
    table: &'t KeyTable<T>,
    key: u32,
    done: bool,
}

impl<T> Reservation<'_, T> {
    /// The key that will be published.
    pub fn key(&self) -> u32 {
        self.key
    }

    /// Make the object visible to lookups (phase two of creation).
    pub fn publish(mut self, value: T) -> u32 {
        let mut g = self.table.inner.write();
        g.slots.insert(
            self.key >> 8,
            Slot::Live(Arc::new(Entry {
                users: AtomicU32::new(0),
                key: self.key,
                value,
            })),
        );
        self.done = true;
        self.key
    }
}

impl<T> Drop for Reservation<'_, T> {
    fn drop(&mut self) {
        if !self.done {
            self.table.inner.write().slots.remove(&(self.key >> 8));
            self.table.count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// An object removed from lookup whose in-flight users may still be running.
#[derive(Debug)]
pub struct Unpublished<'t, T> {
    table: &'t KeyTable<T>,
    entry: Arc<Entry<T>>,
    /// `drain_entry` released the count already (its `Drop` then only drops the `Arc`).
    drained: bool,
}

impl<T> Unpublished<'_, T> {
    /// In-flight guards right now.
    pub fn users(&self) -> u32 {
        self.entry.users.load(Ordering::Acquire)
    }

    /// Wait until every guard has dropped, then return the object (phase two of destruction).
    /// Guards are held for one copy at a time, so this is short; it spins briefly, then sleeps.
    pub fn drain(self) -> T
    where
        T: Clone,
    {
        self.drain_entry().value.clone()
    }

    /// Like [`drain`](Self::drain) but returns the shared entry (no clone needed). The entry may
    /// still be referenced by other `Arc`s (never by guards).
    pub fn drain_entry(mut self) -> Arc<Entry<T>> {
        wait_for_users(&self.entry.users);
        self.table.count.fetch_sub(1, Ordering::AcqRel);
        // Not `mem::forget(self)`: that leaked this `Arc`, and with it every destroyed object
        // (and whatever it owns) for the life of the process.
        self.drained = true;
        self.entry.clone()
    }
}

impl<T> Drop for Unpublished<'_, T> {
    fn drop(&mut self) {
        if self.drained {
            return;
        }
        // Dropped without draining: still release the count once users are gone.
        wait_for_users(&self.entry.users);
        self.table.count.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap as Model;

    #[test]
    fn limit_and_release() {
        let t: KeyTable<u32> = KeyTable::new(1, 100, 2);
        let a = t.reserve().unwrap().publish(1);
        let r = t.reserve().unwrap();
        assert_eq!(t.reserve().unwrap_err(), ReserveError::Full { limit: 2 });
        drop(r);
        let b = t.reserve().unwrap().publish(2);
        assert_ne!(a, b);
        t.unpublish(a).unwrap().drain();
        assert_eq!(t.len(), 1);
    }

    /// A destroyed object is freed once the last reference to it goes: draining does not
    /// leak the table's reference (it used to, and with it every destroyed object).
    #[test]
    fn drained_objects_are_freed() {
        let t: KeyTable<Arc<()>> = KeyTable::new(1, 100, 10);
        let obj = Arc::new(());
        let k = t.reserve().unwrap().publish(obj.clone());
        let e = t.unpublish(k).unwrap().drain_entry();
        assert_eq!(Arc::strong_count(&e), 1, "only the returned reference");
        drop(e);
        assert_eq!(Arc::strong_count(&obj), 1, "the object went with its entry");
        let k = t.reserve().unwrap().publish(obj.clone());
        let _copy: Arc<()> = t.unpublish(k).unwrap().drain();
        assert_eq!(Arc::strong_count(&obj), 2, "only the drained copy is left");
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn keys_do_not_repeat_before_full_cycle() {
        // 16 indices × 256 generations = 4096 keys before any repeats.
        let t: KeyTable<()> = KeyTable::new(1, 16, 4);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..16 * 256 {
            let k = t.reserve().unwrap().publish(());
            assert!(seen.insert(k), "key {k:#x} repeated early");
            t.unpublish(k).unwrap().drain();
        }
        let k = t.reserve().unwrap().publish(());
        assert!(seen.contains(&k), "after a full cycle keys come back");
    }

    #[test]
    fn drain_waits_for_guards() {
        let t = Arc::new(KeyTable::<u64>::new(1, 100, 10));
        let k = t.reserve().unwrap().publish(7);
        let g = t.get(k).unwrap();
        let t2 = t.clone();
        let h = std::thread::spawn(move || {
            let u = t2.unpublish(k).unwrap();
            assert!(t2.get(k).is_none(), "unpublished keys never resolve");
            u.drain()
        });
        std::thread::sleep(Duration::from_millis(20));
        assert!(!h.is_finished(), "drain returned while a guard was alive");
        drop(g);
        assert_eq!(h.join().unwrap(), 7);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Create,
        Destroy(usize),
        Lookup(usize),
        LookupStale(usize),
    }

    proptest! {
        #[test]
        fn table_matches_model(ops in proptest::collection::vec(
            prop_oneof![
                Just(Op::Create),
                (0usize..64).prop_map(Op::Destroy),
                (0usize..64).prop_map(Op::Lookup),
                (0usize..64).prop_map(Op::LookupStale),
            ], 1..400)) {
            let t: KeyTable<u64> = KeyTable::new(1, 32, 16);
            let mut live: Model<u32, u64> = Model::new();
            let mut dead: Vec<u32> = Vec::new();
            let mut order: Vec<u32> = Vec::new();
            let mut next = 0u64;
            for op in ops {
                match op {
                    Op::Create => match t.reserve() {
                        Ok(r) => {
                            let k = r.publish(next);
                            prop_assert!(!live.contains_key(&k));
                            prop_assert!(!dead.contains(&k), "stale key reissued: {:#x}", k);
                            live.insert(k, next);
                            order.push(k);
                            next += 1;
                        }
                        Err(ReserveError::Full { .. }) => prop_assert_eq!(live.len(), 16),
                    },
                    Op::Destroy(i) if !order.is_empty() => {
                        let k = order.remove(i % order.len());
                        let v = t.unpublish(k).unwrap().drain();
                        prop_assert_eq!(Some(v), live.remove(&k));
                        dead.push(k);
                    }
                    Op::Lookup(i) if !order.is_empty() => {
                        let k = order[i % order.len()];
                        prop_assert_eq!(t.get(k).map(|g| *g), live.get(&k).copied());
                    }
                    Op::LookupStale(i) if !dead.is_empty() => {
                        let k = dead[i % dead.len()];
                        prop_assert!(t.get(k).is_none());
                    }
                    _ => {}
                }
                prop_assert_eq!(t.len() as usize, live.len());
            }
        }
    }
}
