//! Memory: the kernel-driver half of registration, done from user space.
//!
//! * [`account`]: RLIMIT_MEMLOCK accounting the way the kernel counts `mm->pinned_vm`.
//! * [`pin`]: long-term page pinning (io_uring fixed buffers = `pin_user_pages(FOLL_LONGTERM)`,
//!   mlock fallback with per-page pin counts).
//! * [`translate`]: the page walk (backing page size, frame numbers from `/proc/self/pagemap`).
//! * [`fork`]: refcounted `MADV_DONTFORK` ranges.
//! * [`fault`]: on-demand paging primitives (fault-in, present-page snapshot).
//! * [`range_count`]: the interval refcount map shared by the mlock pins and the DONTFORK marks.
//! * `uaccess`: fault-recovering copies (the data path's copies never die from a fault on
//!   registered memory the application protected or unmapped) and their slow paths.
//!
//! `unsafe` is allowed here for the system calls that take raw addresses and for the
//! fault-recovering copy; the crate denies it everywhere else except the byte-copy module of
//! the data path, the registration contract (`user_mem`), the link's socket calls
//! (`net/sockio`) and the exit handler (`driver/at_exit`).

pub mod account;
pub mod fault;
pub mod fork;
pub mod pin;
pub mod range_count;
pub mod translate;
pub(crate) mod uaccess;

#[cfg(test)]
pub(crate) mod test_util;

/// Bumped in every forked child (`pthread_atfork`): state keyed by an older generation (the
/// pagemap file, the io_uring pinning rings) belongs to the parent process.
static FORK_GEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// The atfork handler is registered. A flag, not a `Once`: a `Once` running while another
/// thread forks stays "running" forever in the child.
static ATFORK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn atfork_child() {
    FORK_GEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// This process's fork generation (0 unless it is a forked child of a process that used this
/// module): cheap (one atomic load after the first call), so callers may compare it on every
/// verb to refuse objects a parent process made. Registers the `pthread_atfork` child handler on first use, so every fork after the
/// first pin or page walk bumps the child's generation. (A child made by a raw `clone` that
/// bypasses libc's fork handlers keeps its parent's generation.)
pub fn fork_generation() -> u64 {
    use std::sync::atomic::Ordering;
    if !ATFORK.load(Ordering::Acquire) && !ATFORK.swap(true, Ordering::AcqRel) {
        // SAFETY: registers a handler that only bumps an atomic (async-signal-safe), valid for
        // the whole life of the program.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(atfork_child)) };
        if rc != 0 {
            tracing::warn!("pthread_atfork failed ({rc}); a forked child must not pin or walk");
        }
    }
    FORK_GEN.load(Ordering::Acquire)
}

/// A value made at most once per process and never freed: a forked child (a newer
/// [`fork_generation`]) that finds its parent's value makes and publishes its own. Published
/// through an atomic pointer, not behind a lock or a `Once`: either, held or running in another
/// thread at `fork`, would stay so forever in the child. The parent's value stays allocated
/// (and untouched) in the child: nothing of it is dropped there.
pub struct PerProcess<T> {
    ptr: std::sync::atomic::AtomicPtr<Generation<T>>,
    /// Shared like a `&T` (the cell is `Sync` only when `T` is).
    _value: std::marker::PhantomData<T>,
}

/// A [`PerProcess`] value and the fork generation of the process that made it.
pub struct Generation<T> {
    /// The [`fork_generation`] of the process that made the value.
    pub gen: u64,
    value: T,
}

impl<T> std::ops::Deref for Generation<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<T> Default for PerProcess<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> PerProcess<T> {
    /// An empty cell (the first [`get_or_try_init`](Self::get_or_try_init) of each process
    /// makes the value).
    pub const fn new() -> Self {
        PerProcess {
            ptr: std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
            _value: std::marker::PhantomData,
        }
    }

    /// This process's value, made with `make` if there is none yet (see
    /// [`get_or_try_init`](Self::get_or_try_init)).
    pub fn get_or_init(&'static self, mut make: impl FnMut() -> T) -> &'static Generation<T> {
        match self.get_or_try_init(|_| Ok::<T, std::convert::Infallible>(make())) {
            Ok(v) => v,
            Err(never) => match never {},
        }
    }

    /// This process's value, made with `make` (given the generation) if there is none yet.
    /// Threads racing to make it use the first one published (`make` may run in several).
    pub fn get_or_try_init<E>(
        &'static self,
        mut make: impl FnMut(u64) -> std::result::Result<T, E>,
    ) -> std::result::Result<&'static Generation<T>, E> {
        use std::sync::atomic::Ordering;
        let gen = fork_generation();
        loop {
            let current = self.ptr.load(Ordering::Acquire);
            // SAFETY: a non-null pointer is a leaked `Box` published below and never freed.
            if let Some(v) = unsafe { current.as_ref() }.filter(|v| v.gen == gen) {
                return Ok(v);
            }
            let mine = Box::into_raw(Box::new(Generation {
                gen,
                value: make(gen)?,
            }));
            if self
                .ptr
                .compare_exchange(current, mine, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                // SAFETY: just published; never freed.
                return Ok(unsafe { &*mine });
            }
            // Another thread published first: use its value (next iteration).
            // SAFETY: `mine` was never published, so this is its only owner.
            drop(unsafe { Box::from_raw(mine) });
        }
    }
}

/// The base page size of this machine (4 KiB on x86-64).
pub fn page_size() -> usize {
    rustix::param::page_size()
}

/// `[align_down(addr), align_up(addr + len))` in base pages, overflow-checked.
/// Returns `None` when `addr + len` or its page-rounded end wraps the address space.
pub fn page_span(addr: u64, len: u64) -> Option<(u64, u64)> {
    let ps = page_size() as u64;
    let end = addr.checked_add(len)?;
    let end_up = end.checked_add(ps - 1)? & !(ps - 1);
    let start = addr & !(ps - 1);
    Some((start, end_up - start))
}
