//! A thread's leases placed by page key: the per-thread table of the hit path, whose slot
//! **is** the lease, so that a hit reads and writes one cache line.
//!
//! With a separate table of pointers, a hit on a large working set makes two dependent cache
//! misses (the slot, then the lease it points to) and the CPU cannot start the second before
//! the first returns. Here the table is an array of 64-byte lease cells ([`mem::Block`]),
//! open addressing with linear probing by the page key: the probe reads the cell's state and
//! key, the hit checks the lease's facts and counts on the same line.
//!
//! A lease cannot move while something points at it (a handle; the entry's lease set, which
//! is updated under the set's mutex; no hold leaves the table). Hence:
//!
//! * no deletion by shifting: a cell the table lets go of becomes *gone*, skipped by probes
//!   and reused (by a later insertion along its probe run) once its lease is freed — which
//!   may happen on any thread, so the block's record of leased cells is the slab's, under
//!   the slab mutex ([`mem::Block::claim`]);
//! * growth and compaction build a new block: leases with no handle are moved into it
//!   (under their set's mutex, where every other thread reaches them); the others are let
//!   go of in the old block, which stays mapped until its last lease is freed, and their
//!   pages come back through the slow path.
//!
//! A cell's state and key share one 32-bit word, its *tag*, written by the table's thread
//! only and never part of a lease's protocol: probes may read it in a cell whose lease
//! another thread is freeing. A probe step is one load and two compares (the live tag of
//! the key, or zero: empty). Keys are kept to their low 30 bits (pages 4 TiB apart share
//! one); a hit still checks the lease's own facts (range and rights), so an alias is a miss,
//! never a wrong handle, and an insertion replaces the alias's cell.

use std::marker::PhantomData;
use std::ptr::{addr_of, NonNull};
use std::sync::Arc;

use super::mem::{self, Block};
use super::{link, new, take, Asymmetric, Backout, Handle, Hold, Lease, Ordering, Retire};

/// Tag of a cell that never held a lease since the block was mapped (a fresh block is all
/// zero). Ends a probe.
const EMPTY: u32 = 0;
/// State bits of a cell holding the table's hold on the lease in it, for its key.
const LIVE: u32 = 1 << 30;
/// State bits of a cell whose lease the table let go of: skipped by probes, reusable once
/// that lease is freed.
const GONE: u32 = 2 << 30;
/// The key bits of a tag.
const KEY: u32 = (1 << 30) - 1;
/// The state bits of a tag.
const STATE: u32 = !KEY;

/// The smallest block (one 4 KiB page).
const MIN_CELLS: usize = 64;

/// At most this share of the cells (eighths) is not empty: probes stay short and always
/// end at an empty cell.
const MAX_USED_EIGHTHS: usize = 5;

/// One thread's leases by page key (see the module doc). Not `Send`: the thread holding
/// it owns its leases.
pub struct LeaseTable<T: Retire> {
    block: Block,
    /// Live cells.
    live: usize,
    /// Live and gone cells.
    used: usize,
    _own: PhantomData<(Lease<T>, *const ())>,
}

impl<T: Retire> Default for LeaseTable<T> {
    fn default() -> Self {
        Self::with_cells(MIN_CELLS)
    }
}

impl<T: Retire> std::fmt::Debug for LeaseTable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseTable")
            .field("cells", &self.block.cells())
            .field("live", &self.live)
            .field("used", &self.used)
            .finish()
    }
}

/// The tag of a live cell for page key `key`.
#[inline(always)]
pub fn live_tag(key: u64) -> u32 {
    LIVE | (key as u32 & KEY)
}

/// The home cell of a tag's key in a table of `cells` cells: Fibonacci hashing, the top
/// bits of the 64-bit product (taken as the high word of the product with the cell count:
/// one multiply, no variable shift).
///
/// The top bits place the keys of an arithmetic progression (the pages of buffers cut from
/// one allocation, at any stride) a golden-ratio step apart: at this table's load every one
/// of them sits in its home cell (`strided_pages_sit_in_their_home_cells`). That decides the
/// hit's cost at large working sets, more than the table's size: a probe whose outcome the
/// CPU mispredicts discards the next lookups it had started, so their cache misses no
/// longer overlap. Measured in `mrkit bench pool-cache` at 65,536 buffers (one thread, same
/// runs): 7.5–12.6 ns against 19.9–20.7 with bits 32 and up of the same product (which
/// leave 22 % of contiguous pages at home: their multiplier's bits there are close to
/// 45/61, so the keys bunch in runs). Random pages sit at home ~75 % of the time with
/// either. Session 14 had measured the top bits as slower; that bench let a thread measure
/// right after waiting at a barrier, when this virtual machine serves the 8 MiB table at up
/// to 5x its steady cost for a few hundred thousand lookups, and the mispredicting hash,
/// bound by its own stalls, hid that transient.
#[inline(always)]
pub fn home(tag: u32, cells: usize) -> usize {
    let h = u64::from(tag & KEY).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    ((u128::from(h) * cells as u128) >> 64) as usize
}

/// The cell after `i` in a table of `cells` cells (a probe's next step). A compare, not a
/// mask: the hit then reads the cell count alone (the block's), with nothing derived from it
/// before its first probe.
#[inline(always)]
pub fn next_cell(i: usize, cells: usize) -> usize {
    if i + 1 == cells {
        0
    } else {
        i + 1
    }
}

/// Cells of the block a rebuild makes for `live` leases.
fn cells_for(live: usize) -> usize {
    (2 * (live + 1)).next_power_of_two().max(MIN_CELLS)
}

/// Cells of a table grown by insertions to `n` leases (the bench's memory floor models that
/// layout): the smallest doubling of the first block that keeps them within 5/8.
pub fn cells_holding(n: usize) -> usize {
    let mut cells = MIN_CELLS;
    while n * 8 > cells * MAX_USED_EIGHTHS {
        cells *= 2;
    }
    cells
}

/// A cell's tag.
#[inline(always)]
fn tag<T: Retire>(p: NonNull<Lease<T>>) -> u32 {
    // SAFETY: a cell of a mapped block; its tag is valid in any cell (zeroed at mapping,
    // written only by the table's thread, never by a free), and is read through a reference
    // to that field alone.
    unsafe { (*addr_of!((*p.as_ptr()).tag)).load(Ordering::Relaxed) }
}

/// Set a cell's tag (the table's thread).
#[inline]
fn set_tag<T: Retire>(p: NonNull<Lease<T>>, tag: u32) {
    // SAFETY: as in `tag`.
    unsafe { (*addr_of!((*p.as_ptr()).tag)).store(tag, Ordering::Relaxed) }
}

impl<T: Retire> LeaseTable<T> {
    fn with_cells(cells: usize) -> Self {
        LeaseTable {
            block: mem::new_block(cells),
            live: 0,
            used: 0,
            _own: PhantomData,
        }
    }

    /// Live cells (leases the table holds).
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether the table holds no lease.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Cells of the block.
    pub fn cells(&self) -> usize {
        self.block.cells()
    }

    #[inline(always)]
    fn at(&self, i: usize) -> NonNull<Lease<T>> {
        self.block.cell(i).cast()
    }

    /// The table's cells as a hit reads them: its block's base and cell count.
    #[inline(always)]
    pub fn view(&self) -> TableView<T> {
        TableView {
            base: self.block.cell(0).cast(),
            cells: self.cells(),
            _own: PhantomData,
        }
    }

    /// The live cell of `key`.
    #[inline(always)]
    fn find(&self, key: u64) -> Option<NonNull<Lease<T>>> {
        // SAFETY: the view of our own block, attached while `self` lives.
        unsafe { self.view().find(key) }
    }

    /// A hit at page `key`: the lease of its cell, if its entry's facts pass `covers`, then a
    /// handle through it (or the [`Backout`] of a dead entry). No lock, no read-modify-write.
    #[inline(always)]
    pub fn hit(
        &self,
        key: u64,
        covers: impl FnOnce(&T::Meta) -> bool,
    ) -> Option<Result<Handle<T>, Backout<T>>> {
        // SAFETY: our own block; `false`: no claim about the barrier.
        unsafe { self.view().hit_with::<false>(key, covers) }
    }

    /// Whether `key` has a live cell.
    pub fn contains(&self, key: u64) -> bool {
        self.find(key).is_some()
    }

    /// Let go of the live cell `p`: the table's hold goes to `out` (dropped by the caller
    /// outside the thread's borrow: the lease's release may run drop code).
    fn vacate(&mut self, p: NonNull<Lease<T>>, out: &mut Vec<Hold<T>>) {
        set_tag(p, GONE);
        self.live -= 1;
        out.push(Hold {
            p,
            _local: PhantomData,
        });
    }

    /// Lease `entry` for lookups at page `key`. A live lease of the same entry stays;
    /// another is let go of (its hold pushed to `out`). The table's leases are held by the
    /// table alone (no hold of them leaves it), so that a rebuild can move them.
    pub fn insert(&mut self, key: u64, entry: &Arc<T>, out: &mut Vec<Hold<T>>) {
        if let Some(p) = self.find(key) {
            // SAFETY: live: initialised, held by the table.
            let l = unsafe { p.as_ref() };
            if Arc::ptr_eq(&l.entry, entry) && !l.dead.load(Ordering::Relaxed) {
                return;
            }
            self.vacate(p, out);
        }
        if (self.used + 1) * 8 > self.cells() * MAX_USED_EIGHTHS {
            self.rebuild(out);
        }
        let want = live_tag(key);
        // The probe run of `key` up to the empty cell that ends it; its gone cells are
        // reusable once their leases are freed.
        let mut gone = Vec::new();
        let cells = self.cells();
        let mut i = home(want, cells);
        let empty = loop {
            match tag(self.at(i)) {
                EMPTY => break i,
                t if t & STATE == GONE => gone.push(i),
                _ => {}
            }
            i = next_cell(i, cells);
        };
        let i = self
            .block
            .claim(&gone, Some(empty))
            .expect("an attached block");
        if i == empty {
            self.used += 1;
        }
        const { assert!(size_of::<Lease<T>>() <= mem::CELL && align_of::<Lease<T>>() <= mem::CELL) };
        let p = self.at(i);
        // SAFETY: claimed: the cell holds no lease (never did, or its lease was freed, and
        // the slab mutex orders that free before this write); it is ours alone.
        unsafe { p.as_ptr().write(new(entry, 0, 1)) };
        set_tag(p, want);
        link(p);
        self.live += 1;
    }

    /// Let go of `key`'s cell if its lease's entry passes `pred`.
    pub fn remove_if(
        &mut self,
        key: u64,
        pred: impl FnOnce(&T) -> bool,
        out: &mut Vec<Hold<T>>,
    ) -> bool {
        match self.find(key) {
            // SAFETY: live: initialised, held by the table.
            Some(p) if pred(&unsafe { p.as_ref() }.entry) => {
                self.vacate(p, out);
                true
            }
            _ => false,
        }
    }

    /// Keep the live cells whose lease `keep` accepts (given the entry and whether it was
    /// killed); let go of the others.
    pub fn retain(&mut self, mut keep: impl FnMut(&T, bool) -> bool, out: &mut Vec<Hold<T>>) {
        for i in 0..self.cells() {
            let p = self.at(i);
            if tag(p) & STATE != LIVE {
                continue;
            }
            // SAFETY: live: initialised, held by the table.
            let l = unsafe { p.as_ref() };
            if !keep(&l.entry, l.dead.load(Ordering::Relaxed)) {
                self.vacate(p, out);
            }
        }
    }

    /// A new block for the live cells (twice as large when they fill more than half of it
    /// plus one, else the same or smaller): the leases no handle or other hold points at
    /// move, the others are let go of (to `out`).
    fn rebuild(&mut self, out: &mut Vec<Hold<T>>) {
        let size = cells_for(self.live);
        let mut new = Self::with_cells(size);
        let (mut from, mut to) = (Vec::new(), Vec::new());
        for i in 0..self.cells() {
            let p = self.at(i);
            if tag(p) & STATE != LIVE {
                continue;
            }
            match new.move_in(p) {
                Some(j) => {
                    set_tag(p, GONE);
                    self.live -= 1;
                    from.push(i);
                    to.push(j);
                }
                None => self.vacate(p, out),
            }
        }
        new.block.mark(&to, true);
        // The old copies are not leases any more (nothing drops them).
        self.block.mark(&from, false);
        // The old block detaches (its remaining leases are the let-go ones).
        *self = new;
    }

    /// Move the live lease at `p` (of another block of this thread) into an empty cell of
    /// its key, if nothing but the table points at it: no handle (the table's hold is the
    /// only one, see `insert`).
    fn move_in(&mut self, p: NonNull<Lease<T>>) -> Option<usize> {
        // SAFETY: live in the old table: initialised, held by it.
        let l = unsafe { p.as_ref() };
        debug_assert_eq!(
            l.holds.load(Ordering::Relaxed),
            1,
            "a table lease held elsewhere"
        );
        let t = tag(p);
        // Under the set's mutex every other thread's access to the lease is excluded: the
        // killer, `try_retire`, counts and clones off the owner thread take it; a handle
        // dropped elsewhere needs a handle, and there is none (counted under the mutex; no
        // new one can appear: hits and owner clones are this thread's, busy here).
        let mut st = l.entry.leases().st.lock();
        if l.handles() != 0 {
            return None;
        }
        let cells = self.cells();
        let mut j = home(t, cells);
        while tag(self.at(j)) != EMPTY {
            j = next_cell(j, cells);
        }
        let q = self.at(j);
        // SAFETY: `q` is an empty cell of our new block, `p` an initialised lease nobody
        // else reaches now (see above); the copy takes over its entry reference (the old
        // copy is never dropped).
        unsafe { std::ptr::copy_nonoverlapping(p.as_ptr(), q.as_ptr(), 1) };
        let linked = st
            .leases
            .iter_mut()
            .find(|x| x.0 == p)
            .expect("a live lease is linked");
        linked.0 = q;
        drop(st);
        set_tag(q, t);
        self.live += 1;
        self.used += 1;
        Some(j)
    }
}

/// A table's cells as its hit reads them (its block's base and cell count): a copy the
/// thread can keep where a hit reaches it without following a pointer to the table (the
/// cache's current record, `cache::current`). Valid while the table lives and keeps its
/// block: until it is dropped or it grows or compacts (a rebuild: `insert`).
pub struct TableView<T: Retire> {
    base: NonNull<Lease<T>>,
    cells: usize,
    _own: PhantomData<(Lease<T>, *const ())>,
}

impl<T: Retire> Clone for TableView<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: Retire> Copy for TableView<T> {}

impl<T: Retire> TableView<T> {
    /// The view of no table (no cell): a placeholder, valid for no hit.
    pub const NONE: Self = TableView {
        base: NonNull::dangling(),
        cells: 0,
        _own: PhantomData,
    };

    #[inline(always)]
    fn at(self, i: usize) -> NonNull<Lease<T>> {
        // SAFETY: (callers) `i < cells`, inside the block's mapping, valid while the view is.
        // Cells are `mem::CELL` bytes apart (a lease may be smaller: under loom).
        unsafe { NonNull::new_unchecked(self.base.as_ptr().byte_add(i * mem::CELL)) }
    }

    /// The live cell of `key`.
    ///
    /// # Safety
    ///
    /// The view is valid (see the type's doc).
    #[inline(always)]
    unsafe fn find(self, key: u64) -> Option<NonNull<Lease<T>>> {
        let want = live_tag(key);
        let cells = self.cells;
        let mut i = home(want, cells);
        // At most 5/8 used: an empty cell ends every probe.
        loop {
            let p = self.at(i);
            match tag(p) {
                t if t == want => return Some(p),
                EMPTY => return None,
                _ => i = next_cell(i, cells),
            }
        }
    }

    /// A hit at page `key` ([`LeaseTable::hit`] through the view) with the proof of the
    /// asymmetric barrier: no flag tested on the way.
    ///
    /// # Safety
    ///
    /// The view is valid (see the type's doc) and the calling thread is its table's.
    #[inline(always)]
    pub unsafe fn hit_asymmetric(
        self,
        key: u64,
        covers: impl FnOnce(&T::Meta) -> bool,
        _: Asymmetric,
    ) -> Option<Result<Handle<T>, Backout<T>>> {
        // SAFETY: (caller) a valid view on its table's thread; the proof.
        unsafe { self.hit_with::<true>(key, covers) }
    }

    /// # Safety
    ///
    /// The view is valid and the calling thread is its table's; with `ASYMMETRIC`,
    /// [`asymmetric`](super::asymmetric) returned `Some`.
    #[inline(always)]
    unsafe fn hit_with<const ASYMMETRIC: bool>(
        self,
        key: u64,
        covers: impl FnOnce(&T::Meta) -> bool,
    ) -> Option<Result<Handle<T>, Backout<T>>> {
        // SAFETY: (caller) a valid view.
        let p = unsafe { self.find(key) }?;
        // SAFETY: live: an initialised lease, alive while the table holds it.
        if !covers(&unsafe { p.as_ref() }.meta) {
            return None;
        }
        // SAFETY: the table's hold: this thread owns the lease and keeps it alive; (caller)
        // the barrier claim.
        Some(unsafe { take::<T, ASYMMETRIC>(p) })
    }
}

impl<T: Retire> Drop for LeaseTable<T> {
    fn drop(&mut self) {
        for i in 0..self.cells() {
            let p = self.at(i);
            if tag(p) & STATE == LIVE {
                set_tag(p, GONE);
                drop(Hold {
                    p,
                    _local: PhantomData,
                });
            }
        }
        // The block detaches (field drop): unmapped with its last lease.
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::super::mem::block_count;
    use super::super::tests::SERIAL;
    use super::super::{Handle, Hold, LeaseSet, Retire};
    use super::LeaseTable;

    /// An entry: its page range (the facts a hit checks) and a count of retirements.
    struct E {
        id: u64,
        start: u64,
        end: u64,
        leases: LeaseSet<E>,
        retired: AtomicUsize,
    }

    impl Retire for E {
        type Meta = (u64, u64);
        fn meta(&self) -> (u64, u64) {
            (self.start, self.end)
        }
        fn leases(&self) -> &LeaseSet<E> {
            &self.leases
        }
        fn retire(&self) {
            self.retired.fetch_add(1, Ordering::Relaxed);
        }
    }

    const KEY_MASK: u64 = (1 << 30) - 1;

    fn entry(id: u64, first: u64, pages: u64) -> Arc<E> {
        Arc::new(E {
            id,
            start: first << 12,
            end: (first + pages) << 12,
            leases: LeaseSet::new(),
            retired: AtomicUsize::new(0),
        })
    }

    fn hit(t: &LeaseTable<E>, key: u64) -> Option<Handle<E>> {
        let a = key << 12;
        t.hit(key, |&(s, e)| s <= a && a < e)?.ok()
    }

    /// The table against a map: inserts (with replacement), removals, retains, rebuilds
    /// (growth and compaction) over colliding keys and aliases, with handles kept across
    /// them (dropped on this thread and on another), and killed entries. Every
    /// hit is the model's entry; every lease is freed at the end.
    #[test]
    fn lease_table_matches_a_map() {
        let _g = SERIAL.lock();
        let (blocks0, leased0) = block_count();
        let mut t: LeaseTable<E> = LeaseTable::default();
        let mut model: HashMap<u64, Arc<E>> = HashMap::new();
        let mut handles: Vec<Handle<E>> = Vec::new();
        let mut out: Vec<Hold<E>> = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for step in 0..60_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct keys (long probe runs, replacements); some alias in 30 bits.
            let key = (x % 700) + if x & (1 << 40) != 0 { 1 << 30 } else { 0 };
            match (x >> 32) % 16 {
                0..=5 => {
                    let e = entry(step, key, 1);
                    let replaced: Vec<u64> = model
                        .iter()
                        .filter(|(k, _)| **k & KEY_MASK == key & KEY_MASK)
                        .map(|(_, e)| e.id)
                        .collect();
                    t.insert(key, &e, &mut out);
                    // Let go of: the key's (or its alias's) old lease, and at a rebuild only
                    // leases a handle points at.
                    for o in &out {
                        let id = o.entry().id;
                        assert!(
                            replaced.contains(&id) || handles.iter().any(|h| h.entry().id == id),
                            "step {step}: lease {id} let go of at a rebuild"
                        );
                    }
                    // An alias's cell was replaced.
                    model.retain(|k, _| *k & KEY_MASK != key & KEY_MASK);
                    model.insert(key, e);
                }
                6..=7 => {
                    let removed = t.remove_if(key, |e| e.start == key << 12, &mut out);
                    assert_eq!(removed, model.remove(&key).is_some(), "step {step}");
                }
                8 => {
                    // Kill the key's entry: hits back out, then a miss.
                    if let Some(e) = model.get(&key) {
                        e.leases.kill();
                        LeaseSet::try_retire(&**e);
                        let a = key << 12;
                        assert!(matches!(
                            t.hit(key, |&(s, e)| s <= a && a < e),
                            Some(Err(_))
                        ));
                        model.remove(&key);
                        assert!(t.remove_if(key, |e| e.start == key << 12, &mut out));
                    }
                }
                9 if step % 64 == 0 => {
                    t.retain(|e, _| e.id % 2 == 0, &mut out);
                    model.retain(|_, e| e.id % 2 == 0);
                }
                10 if step % 4096 == 0 => {
                    // Drop everything held so far on another thread (the shared path).
                    let hs = std::mem::take(&mut handles);
                    std::thread::spawn(move || drop(hs))
                        .join()
                        .expect("dropper");
                }
                _ => {}
            }
            // Cells let go of (replaced, removed, or kept in place by a handle or ring hold at
            // a rebuild) are not the table's any more.
            for h in out.drain(..) {
                model.retain(|_, e| e.id != h.entry().id);
            }
            match (hit(&t, key), model.get(&key)) {
                (Some(h), Some(e)) => {
                    assert_eq!(h.entry().id, e.id, "step {step}: wrong lease");
                    if step % 5 == 0 {
                        handles.push(h);
                    }
                }
                (None, None) => {}
                (got, want) => panic!(
                    "step {step} key {key:#x}: hit {:?}, model {:?}",
                    got.map(|h| h.entry().id),
                    want.map(|e| e.id)
                ),
            }
            assert_eq!(t.len(), model.len(), "step {step}");
        }
        assert!(t.cells() >= 1024, "grew: {t:?}");
        for (k, e) in &model {
            assert_eq!(hit(&t, *k).map(|h| h.entry().id), Some(e.id));
        }
        drop(handles);
        drop(t);
        assert_eq!(block_count(), (blocks0, leased0), "blocks or leases left");
        // Every entry's leases were freed (none linked).
        for e in model.values() {
            assert_eq!(e.leases.live_leases(), 0);
        }
    }

    /// Where the hash puts buffers laid out at a regular stride (one allocation cut into
    /// buffers, the common case): every key in its home cell, so that a hit's probe is one
    /// compare whose branch the CPU predicts (a mispredicted probe stops it from overlapping
    /// the next lookup's cache miss). Random pages are not checked here: any hash leaves
    /// about a quarter of them past their home at this load.
    #[test]
    fn strided_pages_sit_in_their_home_cells() {
        let _g = SERIAL.lock();
        for (first, stride) in [
            (7 << 20, 1),
            (0x0007_f123_4567, 1),
            (1 << 29, 2),
            (5 << 20, 16),
        ] {
            let n = 65_536u64;
            let mut t: LeaseTable<E> = LeaseTable::default();
            let mut out = Vec::new();
            let es: Vec<Arc<E>> = (0..n).map(|i| entry(i, first + i * stride, 1)).collect();
            for e in &es {
                t.insert(e.start >> 12, e, &mut out);
            }
            assert!(out.is_empty());
            let away = es
                .iter()
                .filter(|e| {
                    let want = super::live_tag((e.start >> 12) & KEY_MASK);
                    super::tag(t.at(super::home(want, t.cells()))) != want
                })
                .count();
            assert_eq!(away, 0, "first {first:#x} stride {stride}");
            for e in &es {
                assert!(hit(&t, e.start >> 12).is_some());
            }
            t.retain(|_, _| false, &mut out);
        }
    }

    /// Growth by insertions makes the block the bench's floor models, and moves every
    /// lease (none is let go of without a handle).
    #[test]
    fn growth_makes_the_block_the_floor_models() {
        let _g = SERIAL.lock();
        for n in [1, 40, 41, 1000, 5000] {
            let mut t: LeaseTable<E> = LeaseTable::default();
            let mut out = Vec::new();
            let es: Vec<Arc<E>> = (0..n).map(|i| entry(i, 7 << 20 | i, 1)).collect();
            for e in &es {
                t.insert(e.start >> 12, e, &mut out);
            }
            assert!(out.is_empty(), "{n}: let go of {}", out.len());
            assert_eq!(t.cells(), super::cells_holding(n as usize), "{n}");
            assert_eq!(t.len(), n as usize);
        }
    }

    /// A rebuild moves leases no handle points at and lets go of the others, whose old
    /// block stays mapped until their last handle goes.
    #[test]
    fn a_rebuild_keeps_leases_in_use_where_they_are() {
        let _g = SERIAL.lock();
        let (blocks0, leased0) = block_count();
        let mut t: LeaseTable<E> = LeaseTable::default();
        let mut out = Vec::new();
        let es: Vec<Arc<E>> = (0..40).map(|i| entry(i, 1000 + i, 1)).collect();
        for (i, e) in es.iter().enumerate() {
            t.insert(1000 + i as u64, e, &mut out);
        }
        assert!(out.is_empty());
        let kept = hit(&t, 1003).expect("hit");
        let cells0 = t.cells();
        // Grow: 40 live of 64 cells, the next insertion rebuilds.
        let more: Vec<Arc<E>> = (40..200).map(|i| entry(i, 1000 + i, 1)).collect();
        for (i, e) in more.iter().enumerate() {
            t.insert(1040 + i as u64, e, &mut out);
        }
        assert!(t.cells() > cells0);
        // The lease with a handle was let go of; every other one moved.
        assert_eq!(out.len(), 1);
        drop(std::mem::take(&mut out));
        assert_eq!(t.len(), 199);
        assert_eq!(es[3].leases.live_leases(), 1, "the handle's lease stays");
        assert!(
            hit(&t, 1003).is_none(),
            "its page comes back through the slow path"
        );
        for i in (0..200u64).filter(|&i| i != 3) {
            assert_eq!(hit(&t, 1000 + i).map(|h| h.entry().id), Some(i));
        }
        // Old blocks stay mapped while the handle lives.
        assert!(block_count().0 >= blocks0 + 2);
        drop(kept);
        assert_eq!(es[3].leases.live_leases(), 0);
        drop(t);
        assert_eq!(block_count(), (blocks0, leased0));
    }
}
