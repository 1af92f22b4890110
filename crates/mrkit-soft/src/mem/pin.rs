//! Long-term page pinning.
//!
//! Primary path: io_uring fixed-buffer registration (`IORING_REGISTER_BUFFERS2` sparse table +
//! `IORING_REGISTER_BUFFERS_UPDATE`), which runs the kernel's `pin_user_pages(FOLL_WRITE |
//! FOLL_LONGTERM)`, exactly what `ibv_reg_mr` uses. It blocks migration and counts in VmPin.
//! It always pins writable and caps one buffer at 1 GiB (larger pins use several slots).
//! Fallback: `mlock` with per-page pin counts (two pins over the same page never unlock each
//! other), used when io_uring is unavailable or the mapping is read-only.
//!
//! # io_uring slot pool
//!
//! A process-global pool of up to [`MAX_RINGS`] small rings is created lazily; each ring has a
//! sparse table of [`SLOTS_PER_RING`] buffer slots (see there for why the table is small) and a mutex-protected free list. Pinning takes
//! a free slot and updates it with the range's iovec (one `io_uring_register` syscall); unpinning
//! updates the slot with an empty iovec, which on current kernels (verified on 6.18 by the tests:
//! VmPin drops at once) releases the pages synchronously, and gives the slot back. Each slot is
//! its own pin: overlapping pins never unpin each other. Rings are never destroyed.
//!
//! After `fork` the child shares the parent's rings through the inherited descriptors but has
//! its own copy of the free lists, so both would hand out the same slots and each would unpin
//! the other's buffers. A forked child therefore pins in a pool of its own (keyed by
//! the fork generation), and dropping a pin it inherited leaves the parent's slot alone.
//!
//! Kernel accounting: io_uring charges the pages to the *user's* `locked_vm` against
//! RLIMIT_MEMLOCK unless the ring was created with CAP_IPC_LOCK (rings live for the process, so
//! dropping the capability later does not bring the kernel limit back; [`super::account`] still
//! enforces it). Both paths charge `mm->pinned_vm`/`locked_vm` in the kernel; the device's own
//! accounting is separate ([`super::account`]).
//!
//! # mlock fallback
//!
//! Pin counts per page are kept in a process-global [`RangeCounter`]: only pages whose count goes
//! 0 → 1 are `mlock`ed and only pages going 1 → 0 are `munlock`ed. A writable mlock pin first runs
//! `MADV_POPULATE_WRITE` (breaks COW like a FOLL_WRITE pin and detects read-only mappings); a
//! read-only one runs `MADV_POPULATE_READ` (detects unmapped and PROT_NONE ranges). mlock keeps
//! pages resident but does not block migration, and the counts assume the caller does not
//! `munlock` or unmap pinned memory behind the device's back.
//!
//! # Selecting the path
//!
//! `MRKIT_PIN=auto|io_uring|mlock` (read once; default `auto`) or [`set_pin_mode`]. `auto` uses
//! io_uring and falls back to mlock for read-only mappings (read-only pins only), file mappings
//! io_uring refuses (EOPNOTSUPP), an unusable io_uring, or an exhausted slot pool. A forced path
//! never falls back; [`pin_via`] selects a path for a single call.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;

use io_uring::IoUring;
use parking_lot::Mutex;

use super::range_count::RangeCounter;
use crate::error::{err, Errno, Error, Result};

/// Fixed-buffer slots in each ring's sparse table.
///
/// The kernel allows 16384, but for every huge (compound) page in a new buffer it scans the
/// whole table of the ring to avoid accounting the page twice (`headpage_already_acct`), so a
/// pin of one 2 MiB THP costs ~27 µs with 16384 slots, ~4 µs with 1024 and ~2.7 µs with 1
/// (measured on 6.18). 4 KiB pages are unaffected. 1024 keeps THP pins cheap while one ring (one
/// file descriptor) still serves 1024 pins.
pub const SLOTS_PER_RING: u32 = 1024;
/// Upper bound on rings in the pool (`MAX_RINGS * SLOTS_PER_RING` = 1 Mi concurrent io_uring
/// pins, above the device's `max_mr`). Each ring costs one file descriptor; when no further ring
/// can be created (RLIMIT_NOFILE) the auto mode falls back to mlock.
pub const MAX_RINGS: usize = 1024;
/// Largest buffer io_uring accepts in one slot.
pub const IO_URING_MAX_BUFFER: u64 = 1 << 30;

/// Which kernel mechanism holds a pin.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PinPath {
    /// io_uring fixed buffers: `pin_user_pages(FOLL_WRITE | FOLL_LONGTERM)`.
    IoUring,
    /// `mlock(2)` with per-page pin counts.
    Mlock,
}

impl PinPath {
    /// Short name for tools and statistics.
    pub fn name(self) -> &'static str {
        match self {
            PinPath::IoUring => "io_uring",
            PinPath::Mlock => "mlock",
        }
    }
}

/// How [`pin`] chooses its path (`MRKIT_PIN`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PinMode {
    /// io_uring when usable, mlock where io_uring cannot pin (the default).
    Auto,
    /// Always io_uring; never falls back.
    IoUring,
    /// Always mlock.
    Mlock,
}

impl PinMode {
    /// Parse `auto`, `io_uring` (or `iouring`, `io-uring`) or `mlock`.
    pub fn parse(s: &str) -> Option<PinMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Some(PinMode::Auto),
            "io_uring" | "iouring" | "io-uring" => Some(PinMode::IoUring),
            "mlock" => Some(PinMode::Mlock),
            _ => None,
        }
    }
}

const MODE_UNSET: u8 = 0;
const MODE_AUTO: u8 = 1;
const MODE_IO_URING: u8 = 2;
const MODE_MLOCK: u8 = 3;

/// The selected [`PinMode`], `MODE_UNSET` until `MRKIT_PIN` was read.
static MODE: AtomicU8 = AtomicU8::new(MODE_UNSET);

/// The current pin mode: [`set_pin_mode`] if called, else `MRKIT_PIN` (read once), else auto.
pub fn pin_mode() -> PinMode {
    let m = match MODE.load(Ordering::Relaxed) {
        MODE_UNSET => {
            let m = match std::env::var("MRKIT_PIN") {
                Ok(v) => match PinMode::parse(&v) {
                    Some(m) => m,
                    None => {
                        tracing::warn!(
                            "MRKIT_PIN={v:?} is not one of auto, io_uring, mlock; using auto"
                        );
                        PinMode::Auto
                    }
                },
                Err(_) => PinMode::Auto,
            };
            let code = match m {
                PinMode::Auto => MODE_AUTO,
                PinMode::IoUring => MODE_IO_URING,
                PinMode::Mlock => MODE_MLOCK,
            };
            // Keep a concurrent set_pin_mode if it won.
            match MODE.compare_exchange(MODE_UNSET, code, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => code,
                Err(other) => other,
            }
        }
        m => m,
    };
    match m {
        MODE_IO_URING => PinMode::IoUring,
        MODE_MLOCK => PinMode::Mlock,
        _ => PinMode::Auto,
    }
}

/// Override the pin mode for the whole process (tests, benchmarks). Affects later pins only.
pub fn set_pin_mode(mode: PinMode) {
    let code = match mode {
        PinMode::Auto => MODE_AUTO,
        PinMode::IoUring => MODE_IO_URING,
        PinMode::Mlock => MODE_MLOCK,
    };
    MODE.store(code, Ordering::Relaxed);
}

/// Pinned pages `[start, start + len)` (page aligned). Dropping it unpins.
#[derive(Debug)]
pub struct Pin {
    start: u64,
    len: u64,
    path: PinPath,
    holder: Holder,
}

/// What must be undone when a [`Pin`] drops.
#[derive(Debug)]
enum Holder {
    /// Pin counts in [`MLOCKS`] of the process (fork generation) that pinned.
    Mlock { gen: u64 },
    /// One io_uring slot.
    Slot(SlotId),
    /// Several io_uring slots (ranges above the per-buffer cap).
    Slots(Vec<SlotId>),
}

impl Pin {
    /// Page-aligned start address.
    pub fn start(&self) -> u64 {
        self.start
    }
    /// Length in bytes (multiple of the page size).
    pub fn len(&self) -> u64 {
        self.len
    }
    /// True for an empty pin (never produced by [`pin`]).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The mechanism that holds the pages.
    pub fn path(&self) -> PinPath {
        self.path
    }
    /// io_uring fixed-buffer slots this pin occupies (0 on the mlock path).
    pub fn slots(&self) -> usize {
        match &self.holder {
            Holder::Mlock { .. } => 0,
            Holder::Slot(_) => 1,
            Holder::Slots(v) => v.len(),
        }
    }
}

fn check_range(start: u64, len: u64) -> Result<u64> {
    let ps = super::page_size() as u64;
    if start % ps != 0 || len % ps != 0 {
        return Err(err!(
            EINVAL,
            "pin range [{start:#x}, +{len:#x}) is not page aligned; round it with \
             mem::page_span first"
        ));
    }
    if len == 0 {
        return Err(err!(
            EINVAL,
            "cannot pin an empty range; pass a length of at least one page"
        ));
    }
    start.checked_add(len).ok_or_else(|| {
        err!(
            EINVAL,
            "pin range [{start:#x}, +{len:#x}) wraps the address space; pass a valid buffer"
        )
    })
}

/// Pin the page-aligned range `[start, start + len)`.
///
/// `writable` requests a write pin (breaks COW, fails with EFAULT on a read-only mapping); a
/// read-only pin succeeds on read-only mappings. Unmapped or PROT_NONE ranges fail with EFAULT.
/// Memlock *accounting* is not done here (see [`super::account`]).
pub fn pin(start: u64, len: u64, writable: bool) -> Result<Pin> {
    check_range(start, len)?;
    match pin_mode() {
        PinMode::Mlock => pin_mlock(start, len, writable),
        PinMode::IoUring => pin_io_uring(start, len, IO_URING_MAX_BUFFER),
        PinMode::Auto => {
            if !io_uring_available() {
                return pin_mlock(start, len, writable);
            }
            match uring_pin_slots(start, len, IO_URING_MAX_BUFFER) {
                Ok(h) => Ok(Pin {
                    start,
                    len,
                    path: PinPath::IoUring,
                    holder: h,
                }),
                // Read-only mapping (or unmapped: mlock reports that as EFAULT too).
                Err(UringErr::Os(libc::EFAULT)) if !writable => pin_mlock(start, len, false),
                // The kernel's io_uring memlock accounting is per user and also charges the
                // ring itself, so it can refuse a pin that mrkit's pinned_vm model (the
                // authoritative check, done before pinning) allowed: pin through mlock instead.
                Err(UringErr::Os(libc::ENOMEM)) => pin_mlock(start, len, writable),
                // File mapping io_uring does not pin, or no ring / slot left.
                Err(UringErr::Os(libc::EOPNOTSUPP))
                | Err(UringErr::Unavailable)
                | Err(UringErr::Exhausted) => pin_mlock(start, len, writable),
                Err(e) => Err(uring_error(e, start, len)),
            }
        }
    }
}

/// Pin through one specific path, never falling back (tests, benchmarks, diagnostics).
///
/// `PinPath::IoUring` always pins writable (the kernel offers nothing else), so `writable` is
/// ignored there and a read-only mapping fails with EFAULT.
pub fn pin_via(path: PinPath, start: u64, len: u64, writable: bool) -> Result<Pin> {
    check_range(start, len)?;
    match path {
        PinPath::IoUring => pin_io_uring(start, len, IO_URING_MAX_BUFFER),
        PinPath::Mlock => pin_mlock(start, len, writable),
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.holder, Holder::Mlock { gen: u64::MAX }) {
            Holder::Mlock { gen } => {
                if self.len != 0 {
                    unpin_mlock(self.start, self.len, gen)
                }
            }
            Holder::Slot(s) => release_slot(s),
            Holder::Slots(v) => v.into_iter().for_each(release_slot),
        }
    }
}

/// Whether the io_uring path is usable in this process (probed once).
pub fn io_uring_available() -> bool {
    ring(0).is_some()
}

/// Why io_uring is unusable (`None` when it is usable). Probes like [`io_uring_available`].
pub fn io_uring_unavailable_reason() -> Option<String> {
    match ring_set().cell(0) {
        Ok(_) => None,
        Err(e) => Some(e.clone()),
    }
}

// ---------------------------------------------------------------------------------------------
// io_uring path

/// One ring of the pool: a sparse fixed-buffer table and its free slots.
struct Ring {
    uring: IoUring,
    /// Free slot indices of `uring`'s buffer table (popped from the end).
    free: Mutex<Vec<u32>>,
    /// Serialises use of the submission and completion queues ([`Pin::dma`]); registration
    /// updates do not use the queues.
    queues: Mutex<()>,
}

impl Ring {
    fn create() -> std::result::Result<Ring, String> {
        let uring = IoUring::new(2).map_err(|e| format!("io_uring_setup failed: {e}"))?;
        uring
            .submitter()
            .register_buffers_sparse(SLOTS_PER_RING)
            .map_err(|e| format!("IORING_REGISTER_BUFFERS2 (sparse) failed: {e}"))?;
        Ok(Ring {
            uring,
            free: Mutex::new((0..SLOTS_PER_RING).rev().collect()),
            queues: Mutex::new(()),
        })
    }

    /// Install `iov` in `slot` (an empty iovec clears the slot and unpins its pages).
    fn update(&self, slot: u32, iov: libc::iovec) -> std::io::Result<()> {
        // SAFETY: the kernel only reads the iovec array during this call; the buffer it names
        // is pinned by the kernel (not dereferenced by us), and the slot is exclusively ours.
        unsafe {
            self.uring
                .submitter()
                .register_buffers_update(slot, &[iov], None)
        }
    }
}

type RingCell = OnceLock<std::result::Result<Box<Ring>, String>>;

/// The ring pool of one process, created lazily; `rings[0]` doubles as the availability probe.
struct RingSet {
    rings: [RingCell; MAX_RINGS],
    /// A ring that probably has free slots: where slot searches start.
    hint: AtomicUsize,
}

/// This process's ring pool. A forked child shares its parent's rings through the inherited
/// descriptors, but not the parent's free lists: both would hand out the same slot, and each
/// update of a shared slot replaces (unpins) the other's buffer. So a child makes a pool of its
/// own ([`super::PerProcess`]), and leaves the slots of pins it inherited alone (those pin the
/// parent's pages, not its own).
static RING_SET: super::PerProcess<RingSet> = super::PerProcess::new();

fn ring_set() -> &'static super::Generation<RingSet> {
    let made = RING_SET.get_or_try_init(|_| {
        Ok::<_, std::convert::Infallible>(RingSet {
            rings: [const { OnceLock::new() }; MAX_RINGS],
            hint: AtomicUsize::new(0),
        })
    });
    match made {
        Ok(set) => set,
        Err(never) => match never {},
    }
}

impl RingSet {
    /// Ring `i`, created on first use (or why it could not be).
    fn cell(&self, i: usize) -> &std::result::Result<Box<Ring>, String> {
        self.rings[i].get_or_init(|| Ring::create().map(Box::new))
    }

    fn ring(&self, i: usize) -> Option<&Ring> {
        self.cell(i).as_ref().ok().map(|b| &**b)
    }
}

fn ring(i: usize) -> Option<&'static Ring> {
    ring_set().ring(i)
}

/// A fixed-buffer slot: (pool generation, ring index, slot index) and the range it pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SlotId {
    gen: u64,
    ring: u32,
    slot: u32,
    /// First address of the buffer installed in the slot.
    base: u64,
    /// Its length.
    len: u64,
}

enum UringErr {
    /// io_uring cannot be set up in this process.
    Unavailable,
    /// Every slot of every ring is in use (or no further ring could be created).
    Exhausted,
    /// The kernel refused the update.
    Os(i32),
}

fn acquire_slot(set: &super::Generation<RingSet>) -> std::result::Result<SlotId, UringErr> {
    let hint = set.hint.load(Ordering::Relaxed);
    for i in (hint..MAX_RINGS).chain(0..hint) {
        let Some(r) = set.ring(i) else {
            return Err(if i == 0 {
                UringErr::Unavailable
            } else {
                UringErr::Exhausted
            });
        };
        if let Some(slot) = r.free.lock().pop() {
            if i != hint {
                set.hint.store(i, Ordering::Relaxed);
            }
            return Ok(SlotId {
                gen: set.gen,
                ring: i as u32,
                slot,
                base: 0,
                len: 0,
            });
        }
    }
    Err(UringErr::Exhausted)
}

/// Clear a slot (unpins its pages) and return it to its ring's free list. A slot of another
/// generation's pool (a pin inherited from the parent process) is left alone: it pins the
/// parent's pages, and the parent releases it.
fn release_slot(s: SlotId) {
    let set = ring_set();
    if s.gen != set.gen {
        return;
    }
    let r = set
        .ring(s.ring as usize)
        .expect("a slot was handed out by this ring");
    let empty = libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    };
    if let Err(e) = r.update(s.slot, empty) {
        // Leak the slot rather than hand out one whose state is unknown.
        tracing::error!(
            "io_uring: clearing fixed-buffer slot {} failed: {e}",
            s.slot
        );
        return;
    }
    r.free.lock().push(s.slot);
    set.hint.fetch_min(s.ring as usize, Ordering::Relaxed);
}

/// Pin `[start, start + len)` in slots of at most `cap` bytes (`cap` is a parameter so tests can
/// exercise the splitting without pinning more than 1 GiB).
fn uring_pin_slots(start: u64, len: u64, cap: u64) -> std::result::Result<Holder, UringErr> {
    let set = ring_set();
    let mut held: Vec<SlotId> = Vec::new();
    let mut off = 0u64;
    while off < len {
        let chunk = cap.min(len - off);
        let mut s = match acquire_slot(set) {
            Ok(s) => s,
            Err(e) => {
                held.into_iter().for_each(release_slot);
                return Err(e);
            }
        };
        let iov = libc::iovec {
            iov_base: (start + off) as *mut libc::c_void,
            iov_len: chunk as usize,
        };
        let r = set.ring(s.ring as usize).expect("slot from a live ring");
        if let Err(e) = r.update(s.slot, iov) {
            // A failed update leaves the slot empty: give it straight back.
            r.free.lock().push(s.slot);
            held.into_iter().for_each(release_slot);
            return Err(UringErr::Os(e.raw_os_error().unwrap_or(libc::EFAULT)));
        }
        (s.base, s.len) = (start + off, chunk);
        held.push(s);
        off += chunk;
    }
    Ok(if held.len() == 1 {
        Holder::Slot(held[0])
    } else {
        Holder::Slots(held)
    })
}

fn pin_io_uring(start: u64, len: u64, cap: u64) -> Result<Pin> {
    uring_pin_slots(start, len, cap)
        .map(|holder| Pin {
            start,
            len,
            path: PinPath::IoUring,
            holder,
        })
        .map_err(|e| uring_error(e, start, len))
}

fn uring_error(e: UringErr, start: u64, len: u64) -> Error {
    let end = start + len;
    match e {
        UringErr::Unavailable => err!(
            EOPNOTSUPP,
            "io_uring pinning is unavailable ({}); set MRKIT_PIN=mlock or auto, or allow \
             io_uring (sysctl kernel.io_uring_disabled=0, seccomp)",
            io_uring_unavailable_reason().unwrap_or_default()
        ),
        UringErr::Exhausted => err!(
            ENOMEM,
            "all {} io_uring fixed-buffer slots are in use; deregister memory or use \
             MRKIT_PIN=auto to fall back to mlock",
            MAX_RINGS as u64 * SLOTS_PER_RING as u64
        ),
        UringErr::Os(libc::EFAULT) => err!(
            EFAULT,
            "cannot pin [{start:#x}, {end:#x}) writable: part of the range is unmapped, \
             PROT_NONE or read-only; register mapped read-write memory (or drop the write \
             access flags for a read-only mapping)"
        ),
        UringErr::Os(libc::ENOMEM) => err!(
            ENOMEM,
            "the kernel refused to pin {} pages at {start:#x}: RLIMIT_MEMLOCK ({} bytes) \
             exceeded or out of memory; raise `ulimit -l` or grant CAP_IPC_LOCK",
            len / super::page_size() as u64,
            super::account::memlock_limit()
        ),
        UringErr::Os(libc::EOPNOTSUPP) => err!(
            EOPNOTSUPP,
            "io_uring cannot long-term pin [{start:#x}, {end:#x}) (file-backed mapping); \
             register anonymous, shmem or hugetlbfs memory, or use MRKIT_PIN=auto"
        ),
        UringErr::Os(raw) => Error::new(
            Errno::from_raw_os(raw),
            format!(
                "io_uring pin of [{start:#x}, {end:#x}) failed: {}; check the range is \
                 ordinary mapped memory",
                std::io::Error::from_raw_os_error(raw)
            ),
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// DMA through the pinned frames

/// A [`Pin::dma`] transfer.
pub(crate) enum Dma<'a> {
    /// Write these bytes into the pinned frames.
    ToFrames(&'a [u8]),
    /// Read the pinned frames into this buffer.
    FromFrames(&'a mut [u8]),
}

impl Dma<'_> {
    fn len(&self) -> usize {
        match self {
            Dma::ToFrames(b) => b.len(),
            Dma::FromFrames(b) => b.len(),
        }
    }
}

impl Pin {
    /// Move bytes between `dma`'s buffer and the pinned frames of `[va, va + len)` (inside this
    /// pin) the way a NIC's DMA does: through the kernel's own references to the pinned pages
    /// (`IORING_OP_READ_FIXED` from a pipe into the fixed buffer, `IORING_OP_WRITE_FIXED` from
    /// it into a pipe), whatever the process maps at `va` now: read-only, `PROT_NONE` or
    /// nothing. A few syscalls per 64 KiB: for the rare copy that faulted, never the normal
    /// path. io_uring pins only; `ENOTSUP` on the mlock path (it holds no page reference, so
    /// after `munmap` nothing is left to reach) and for a pin inherited from a parent process.
    pub(crate) fn dma(&self, va: u64, mut dma: Dma<'_>) -> std::io::Result<()> {
        let unsupported = || std::io::Error::from_raw_os_error(libc::ENOTSUP);
        let slots: &[SlotId] = match &self.holder {
            Holder::Mlock { .. } => return Err(unsupported()),
            Holder::Slot(s) => std::slice::from_ref(s),
            Holder::Slots(v) => v,
        };
        let set = ring_set();
        let len = dma.len() as u64;
        let end = va
            .checked_add(len)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EFAULT))?;
        if va < self.start || end > self.start + self.len {
            return Err(std::io::Error::from_raw_os_error(libc::EFAULT));
        }
        let mut fds = [0; 2];
        // SAFETY: pipe2 writes two descriptors into `fds`.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: two fresh descriptors owned by nobody else; closed when these drop.
        let (pr, pw) = unsafe {
            use std::os::fd::FromRawFd;
            (
                std::os::fd::OwnedFd::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        };
        // The pipe's capacity bounds one step: a write of at most that much into the empty
        // pipe, and the read of it, never block.
        // SAFETY: F_GETPIPE_SZ only reads the pipe's size.
        let cap = usize::try_from(unsafe { libc::fcntl(fds[1], libc::F_GETPIPE_SZ) })
            .unwrap_or(4096)
            .max(1);
        let mut done = 0u64;
        for s in slots {
            if s.gen != set.gen {
                return Err(unsupported());
            }
            let ring = set.ring(s.ring as usize).ok_or_else(unsupported)?;
            // The part of [va + done, end) inside this slot.
            let lo = (va + done).max(s.base);
            let hi = end.min(s.base + s.len);
            if lo >= hi || lo != va + done {
                continue;
            }
            while va + done < hi {
                let at = va + done;
                let n = ((hi - at) as usize).min(cap);
                let o = done as usize;
                match &mut dma {
                    Dma::ToFrames(b) => {
                        rustix::io::write(&pw, &b[o..o + n])
                            .and_then(|w| (w == n).then_some(()).ok_or(rustix::io::Errno::AGAIN))?;
                        let mut got = 0;
                        while got < n {
                            let op = io_uring::opcode::ReadFixed::new(
                                io_uring::types::Fd(std::os::fd::AsRawFd::as_raw_fd(&pr)),
                                (at as usize + got) as *mut u8,
                                (n - got) as u32,
                                s.slot as u16,
                            );
                            got += ring.run(op.build())?;
                        }
                    }
                    Dma::FromFrames(b) => {
                        let mut put = 0;
                        while put < n {
                            let op = io_uring::opcode::WriteFixed::new(
                                io_uring::types::Fd(std::os::fd::AsRawFd::as_raw_fd(&pw)),
                                (at as usize + put) as *const u8,
                                (n - put) as u32,
                                s.slot as u16,
                            );
                            put += ring.run(op.build())?;
                        }
                        let mut got = 0;
                        while got < n {
                            got += rustix::io::read(&pr, &mut b[o + got..o + n])?;
                        }
                    }
                }
                done += n as u64;
            }
        }
        if done == len {
            Ok(())
        } else {
            Err(std::io::Error::from_raw_os_error(libc::EFAULT))
        }
    }
}

impl Ring {
    /// Submit one entry and wait for its completion: the byte count, or the error. A result of
    /// 0 bytes is EIO (the pipe would not move data: no progress is possible).
    fn run(&self, entry: io_uring::squeue::Entry) -> std::io::Result<usize> {
        let _q = self.queues.lock();
        // SAFETY: `queues` gives this thread exclusive use of the submission queue; the entry's
        // buffer is a range of a registered fixed buffer (validated by the kernel against the
        // slot) and its file a pipe that outlives the wait below.
        unsafe {
            let mut sq = self.uring.submission_shared();
            sq.push(&entry)
                .map_err(|_| std::io::Error::from_raw_os_error(libc::EBUSY))?;
            sq.sync();
        }
        self.uring.submit_and_wait(1)?;
        // SAFETY: exclusive use of the completion queue under `queues`.
        let cqe = unsafe { self.uring.completion_shared() }
            .next()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EIO))?;
        match cqe.result() {
            n if n > 0 => Ok(n as usize),
            0 => Err(std::io::Error::from_raw_os_error(libc::EIO)),
            e => Err(std::io::Error::from_raw_os_error(-e)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// mlock path

/// Per-page mlock pin counts of the whole process. Held across the mlock/munlock syscalls so
/// that the kernel's lock state always matches the counts. Per process: memory locks are not
/// inherited by a forked child, so it starts with no counts, and unpinning a pin it inherited
/// leaves its own locks alone.
static MLOCKS: super::PerProcess<Mutex<RangeCounter>> = super::PerProcess::new();

fn mlocks() -> &'static super::Generation<Mutex<RangeCounter>> {
    MLOCKS.get_or_init(|| Mutex::new(RangeCounter::new()))
}

fn os_err(e: rustix::io::Errno) -> i32 {
    e.raw_os_error()
}

/// `madvise(MADV_POPULATE_{WRITE,READ})`: fault the range in, failing like GUP would.
pub(crate) fn populate(start: u64, len: u64, write: bool) -> Result<()> {
    let advice = if write {
        rustix::mm::Advice::LinuxPopulateWrite
    } else {
        rustix::mm::Advice::LinuxPopulateRead
    };
    loop {
        // SAFETY: MADV_POPULATE_* only faults pages in (as a touch would); it never changes the
        // contents or the mapping layout, so no Rust reference can be invalidated.
        let r = unsafe { rustix::mm::madvise(start as *mut _, len as usize, advice) };
        let end = start + len;
        let what = if write { "writable" } else { "readable" };
        return match r.map_err(os_err) {
            Ok(()) => Ok(()),
            Err(libc::EINTR) | Err(libc::EAGAIN) => continue,
            Err(libc::ENOMEM) => Err(err!(
                EFAULT,
                "[{start:#x}, {end:#x}) is not entirely mapped; register memory the process \
                 has mapped"
            )),
            // Measured on 6.18: POPULATE_WRITE on a PROT_READ mapping and POPULATE_* on
            // PROT_NONE fail with EINVAL (as do VM_IO/VM_PFNMAP mappings and kernels older
            // than 5.14); a SIGBUS/SIGSEGV-type fault gives EFAULT.
            Err(libc::EINVAL) | Err(libc::EFAULT) | Err(libc::EPERM) | Err(libc::EACCES) => {
                Err(err!(
                    EFAULT,
                    "[{start:#x}, {end:#x}) cannot be faulted in {what}: {}; {}",
                    if write {
                        "part of it is read-only, PROT_NONE or a VM_IO/VM_PFNMAP mapping"
                    } else {
                        "part of it is PROT_NONE or a VM_IO/VM_PFNMAP mapping"
                    },
                    if write {
                        "mprotect it PROT_READ|PROT_WRITE or drop the write access flags"
                    } else {
                        "register accessible memory"
                    }
                ))
            }
            Err(libc::EHWPOISON) => Err(err!(
                EFAULT,
                "[{start:#x}, {end:#x}) contains a hardware-poisoned page; use another buffer"
            )),
            Err(raw) => Err(err!(
                EFAULT,
                "faulting in [{start:#x}, {end:#x}) failed: {}; register ordinary mapped memory",
                std::io::Error::from_raw_os_error(raw)
            )),
        };
    }
}

fn pin_mlock(start: u64, len: u64, writable: bool) -> Result<Pin> {
    populate(start, len, writable)?;
    let end = start + len;
    let cell = mlocks();
    let mut counts = cell.lock();
    let fresh = counts.inc(start, end);
    for &(s, e) in &fresh {
        // SAFETY: mlock only changes residency of pages the process already maps.
        if let Err(errno) = unsafe { rustix::mm::mlock(s as *mut _, (e - s) as usize) } {
            for (gs, ge) in counts.dec(start, end) {
                // SAFETY: as above; undoing the locks taken for this pin.
                let _ = unsafe { rustix::mm::munlock(gs as *mut _, (ge - gs) as usize) };
            }
            drop(counts);
            let npages = len / super::page_size() as u64;
            return Err(match os_err(errno) {
                libc::EPERM => err!(
                    EPERM,
                    "mlock of {npages} pages refused: RLIMIT_MEMLOCK is 0 and the process \
                     lacks CAP_IPC_LOCK; raise `ulimit -l` or grant CAP_IPC_LOCK"
                ),
                libc::ENOMEM | libc::EAGAIN => err!(
                    ENOMEM,
                    "mlock of {npages} pages at {start:#x} would exceed RLIMIT_MEMLOCK ({} \
                     bytes, VmLck already counted); raise `ulimit -l` or grant CAP_IPC_LOCK",
                    super::account::memlock_limit()
                ),
                raw => Error::new(
                    Errno::from_raw_os(raw),
                    format!(
                        "mlock of [{start:#x}, {end:#x}) failed: {}; register ordinary \
                         mapped memory",
                        std::io::Error::from_raw_os_error(raw)
                    ),
                ),
            });
        }
    }
    drop(counts);
    Ok(Pin {
        start,
        len,
        path: PinPath::Mlock,
        holder: Holder::Mlock { gen: cell.gen },
    })
}

fn unpin_mlock(start: u64, len: u64, gen: u64) {
    let cell = mlocks();
    if cell.gen != gen {
        return; // the parent's pin, inherited by this forked child
    }
    let mut counts = cell.lock();
    for (s, e) in counts.dec(start, start + len) {
        // SAFETY: munlock only changes residency; failure (range unmapped by the caller since)
        // is harmless.
        let _ = unsafe { rustix::mm::munlock(s as *mut _, (e - s) as usize) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::test_util::{child_pfns, expect_delta, serial, status_kb, Map};
    use rustix::mm::ProtFlags;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * 1024;

    fn counter(path: PinPath) -> &'static str {
        match path {
            PinPath::IoUring => "VmPin",
            PinPath::Mlock => "VmLck",
        }
    }

    fn rise_and_fall(path: PinPath, len: u64) {
        let m = Map::new(len);
        m.touch();
        let field = counter(path);
        expect_delta(&format!("{field} for {len} bytes"), len / KIB, || {
            let before = status_kb(field);
            let p = pin_via(path, m.addr, m.len, true).unwrap();
            assert_eq!(p.path(), path);
            assert_eq!((p.start(), p.len()), (m.addr, m.len));
            let during = status_kb(field);
            drop(p);
            let after = status_kb(field);
            (during.saturating_sub(before), during.saturating_sub(after))
        });
    }

    #[test]
    fn io_uring_pin_unpin_sizes() {
        if !io_uring_available() {
            println!("io_uring unavailable: {:?}", io_uring_unavailable_reason());
            return;
        }
        let _g = serial();
        // VmPin drops right after the empty-slot update: unpinning is synchronous.
        for len in [4 * KIB, 64 * KIB, 8 * MIB] {
            rise_and_fall(PinPath::IoUring, len);
        }
    }

    #[test]
    fn mlock_pin_unpin_sizes() {
        let _g = serial();
        for len in [4 * KIB, 64 * KIB, 8 * MIB] {
            rise_and_fall(PinPath::Mlock, len);
        }
    }

    #[test]
    fn auto_prefers_io_uring() {
        let _g = serial();
        let m = Map::new(64 * KIB);
        let p = pin(m.addr, m.len, true).unwrap();
        match pin_mode() {
            PinMode::Mlock => assert_eq!(p.path(), PinPath::Mlock),
            _ if io_uring_available() => assert_eq!(p.path(), PinPath::IoUring),
            _ => assert_eq!(p.path(), PinPath::Mlock),
        }
        assert_eq!(p.slots(), usize::from(p.path() == PinPath::IoUring));
    }

    #[test]
    fn mlock_overlapping_pins_do_not_unlock_each_other() {
        let _g = serial();
        let m = Map::new(16 * 4 * KIB);
        m.touch();
        let ps = 4 * KIB;
        // A = pages 0..12, B = pages 4..16; shared part 4..12.
        let mut ok = false;
        let mut seen = Vec::new();
        for _ in 0..5 {
            let v0 = status_kb("VmLck");
            let a = pin_via(PinPath::Mlock, m.addr, 12 * ps, true).unwrap();
            let v1 = status_kb("VmLck");
            let b = pin_via(PinPath::Mlock, m.addr + 4 * ps, 12 * ps, true).unwrap();
            let v2 = status_kb("VmLck");
            drop(a);
            let v3 = status_kb("VmLck");
            drop(b);
            let v4 = status_kb("VmLck");
            let got = (
                v1 - v0,
                v2 - v0,
                v3 as i64 - v0 as i64,
                v4 as i64 - v0 as i64,
            );
            // 48 KiB, then 64 KiB, then 48 KiB (pages 4..16 still locked), then 0.
            if got == (48, 64, 48, 0) {
                ok = true;
                break;
            }
            seen.push(got);
        }
        assert!(ok, "VmLck deltas (A, A+B, B, none) = {seen:?}");
        assert!(mlocks().lock().count_at(m.addr) == 0);
    }

    #[test]
    fn read_only_mapping() {
        let _g = serial();
        let m = Map::with_prot(64 * KIB, ProtFlags::READ);
        if io_uring_available() {
            let e = pin_via(PinPath::IoUring, m.addr, m.len, true).unwrap_err();
            assert_eq!(e.errno(), Errno::EFAULT, "{e}");
        }
        let e = pin_via(PinPath::Mlock, m.addr, m.len, true).unwrap_err();
        assert_eq!(e.errno(), Errno::EFAULT, "{e}");
        if pin_mode() != PinMode::IoUring {
            let e = pin(m.addr, m.len, true).unwrap_err();
            assert_eq!(e.errno(), Errno::EFAULT, "{e}");
            let p = pin(m.addr, m.len, false).unwrap();
            assert_eq!(p.path(), PinPath::Mlock);
        }
    }

    #[test]
    fn prot_none_and_unmapped_are_efault() {
        let _g = serial();
        let none = Map::with_prot(16 * KIB, ProtFlags::empty());
        let gone = Map::new(16 * KIB);
        let addr = gone.addr;
        drop(gone);
        for (start, what) in [(none.addr, "PROT_NONE"), (addr, "unmapped")] {
            for writable in [true, false] {
                for path in [PinPath::IoUring, PinPath::Mlock] {
                    if path == PinPath::IoUring && !io_uring_available() {
                        continue;
                    }
                    let e = pin_via(path, start, 16 * KIB, writable).unwrap_err();
                    assert_eq!(
                        e.errno(),
                        Errno::EFAULT,
                        "{what} {path:?} w={writable}: {e}"
                    );
                }
                if pin_mode() != PinMode::IoUring {
                    let e = pin(start, 16 * KIB, writable).unwrap_err();
                    assert_eq!(e.errno(), Errno::EFAULT, "{what} auto: {e}");
                }
            }
        }
    }

    #[test]
    fn bad_ranges_are_einval() {
        assert_eq!(pin(0x1001, 4096, true).unwrap_err().errno(), Errno::EINVAL);
        assert_eq!(pin(0x1000, 0, true).unwrap_err().errno(), Errno::EINVAL);
        assert_eq!(
            pin(!0xfff_u64, 0x2000, true).unwrap_err().errno(),
            Errno::EINVAL
        );
    }

    #[test]
    fn io_uring_slot_splitting() {
        if !io_uring_available() {
            println!("io_uring unavailable: {:?}", io_uring_unavailable_reason());
            return;
        }
        let _g = serial();
        let m = Map::new(256 * KIB);
        m.touch();
        expect_delta("VmPin for 4 slots of 64 KiB", 256, || {
            let before = status_kb("VmPin");
            let p = pin_io_uring(m.addr, m.len, 64 * KIB).unwrap();
            assert_eq!(p.slots(), 4);
            let during = status_kb("VmPin");
            drop(p);
            let after = status_kb("VmPin");
            (during.saturating_sub(before), during.saturating_sub(after))
        });
        // A split pin whose tail is unmapped fails as a whole and releases its head slots.
        let ro = Map::new(128 * KIB);
        // SAFETY: changing protection of our own mapping that nothing references.
        unsafe {
            rustix::mm::mprotect(
                (ro.addr + 64 * KIB) as *mut _,
                (64 * KIB) as usize,
                rustix::mm::MprotectFlags::READ,
            )
        }
        .unwrap();
        let free_slots = || -> usize {
            (0..MAX_RINGS)
                .filter_map(|i| ring_set().rings[i].get().and_then(|r| r.as_ref().ok()))
                .map(|r| r.free.lock().len())
                .sum()
        };
        let mut seen = Vec::new();
        for _ in 0..5 {
            let before = free_slots();
            let e = pin_io_uring(ro.addr, ro.len, 32 * KIB).unwrap_err();
            assert_eq!(e.errno(), Errno::EFAULT, "{e}");
            let after = free_slots();
            if before == after {
                return;
            }
            seen.push((before, after));
        }
        panic!("a failed split pin leaked slots: free (before, after) = {seen:?}");
    }

    #[test]
    fn io_uring_overlapping_pins_are_independent() {
        if !io_uring_available() {
            return;
        }
        let _g = serial();
        let m = Map::new(64 * KIB);
        m.touch();
        expect_delta("VmPin with two overlapping pins", 64, || {
            let v0 = status_kb("VmPin");
            let a = pin_via(PinPath::IoUring, m.addr, m.len, true).unwrap();
            let b = pin_via(PinPath::IoUring, m.addr, m.len, true).unwrap();
            let v2 = status_kb("VmPin");
            drop(a);
            let v3 = status_kb("VmPin");
            drop(b);
            let v4 = status_kb("VmPin");
            // Both count (no dedup for 4 KiB pages); dropping A leaves B's 64 KiB pinned.
            if v2 != v0 + 128 || v4 != v0 {
                return (u64::MAX, 0);
            }
            (v3.saturating_sub(v0), v3.saturating_sub(v4))
        });
    }

    /// The precise check that a page is (or no longer is) long-term pinned: fork() copies
    /// "maybe DMA-pinned" anonymous pages into the child at once instead of sharing them
    /// copy-on-write, so the child sees a different frame number for exactly the pinned pages.
    /// This shows that the empty-slot update drops the page references synchronously (VmPin
    /// only shows the accounting), and that mlock does not pin.
    #[test]
    fn fork_shows_real_pin_state() {
        let _g = serial();
        let ps = 4096;
        let m = Map::new(4 * ps);
        m.touch();
        let parent = crate::mem::translate::walk(m.addr, m.len).unwrap();
        if !parent.has_pfns() {
            println!("frame numbers hidden: cannot observe pin state through fork");
            return;
        }
        assert_eq!(pinned_pages(&m), vec![false; 4]);
        if io_uring_available() {
            let p = pin_via(PinPath::IoUring, m.addr, 2 * ps, true).unwrap();
            assert_eq!(
                pinned_pages(&m),
                vec![true, true, false, false],
                "io_uring-pinned pages must be copied at fork"
            );
            drop(p);
            // Immediately after the empty-slot update the pages are shared again: unpinned.
            assert_eq!(pinned_pages(&m), vec![false; 4]);
        }
        let p = pin_via(PinPath::Mlock, m.addr, 2 * ps, true).unwrap();
        assert_eq!(pinned_pages(&m), vec![false; 4], "mlock is no DMA pin");
        drop(p);
        assert_eq!(pinned_pages(&m), vec![false; 4]);
    }

    /// Which of `m`'s pages a forked child gets as copies, i.e. which are long-term pinned.
    /// Compared with the parent's frames around that fork, not with frames seen earlier: the
    /// parent's frames may change in between. Each fork leaves the pages write-protected and no
    /// longer exclusive, and a later FOLL_WRITE pin (io_uring) or mlock (which populates with
    /// FOLL_WRITE) copies a page instead of reusing it when anything else still holds a
    /// reference (the exiting child, a per-CPU LRU batch) — seen under CPU load, about one run
    /// in 25. A measurement during which the parent's frames moved is taken again.
    fn pinned_pages(m: &Map) -> Vec<bool> {
        for _ in 0..100 {
            let before = crate::mem::translate::walk(m.addr, m.len).unwrap().pfns;
            let child = child_pfns(m.addr, m.len);
            let after = crate::mem::translate::walk(m.addr, m.len).unwrap().pfns;
            if before == after {
                return child.iter().zip(&after).map(|(c, p)| c != p).collect();
            }
        }
        panic!("the parent's frames kept changing during 100 forks");
    }

    /// Four touched pages for the fork tests, or `None` (said loudly) without io_uring or
    /// visible frame numbers.
    fn fork_test_map() -> Option<Map> {
        let m = Map::new(4 * 4096);
        m.touch();
        let pfns = crate::mem::translate::walk(m.addr, m.len)
            .unwrap()
            .has_pfns();
        if !io_uring_available() || !pfns {
            println!("SKIP: needs io_uring and visible frame numbers");
            return None;
        }
        Some(m)
    }

    /// A forked child that drops a pin it inherited (a destructor running in the child, an
    /// `ibv_dereg_mr` on the parent's MR) must not unpin the parent's pages: the io_uring rings
    /// are shared through the inherited descriptors. It did before rings were per process.
    #[test]
    fn a_child_dropping_an_inherited_pin_leaves_the_parent_pinned() {
        let _g = serial();
        let Some(m) = fork_test_map() else { return };
        let p = pin_via(PinPath::IoUring, m.addr, m.len, true).unwrap();
        assert_eq!(pinned_pages(&m), vec![true; 4]);
        // SAFETY: the child only drops the pin (an io_uring register call at most) and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            drop(p);
            // SAFETY: leave the forked child without running the parent's destructors.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0);
        let mut status = 0;
        // SAFETY: reaping our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(
            pinned_pages(&m),
            vec![true; 4],
            "the parent's pages stay pinned"
        );
        drop(p);
        assert_eq!(pinned_pages(&m), vec![false; 4]);
    }

    /// After a fork, parent and child pin new memory at the same time: the child pins in rings
    /// of its own, so neither update replaces the other's slot (before, both took the same free
    /// slot of the shared ring, and the child's release unpinned the parent's new pin).
    #[test]
    fn parent_and_child_pin_after_fork_without_sharing_slots() {
        use std::io::{Read, Write};
        let _g = serial();
        let Some(m) = fork_test_map() else { return };
        let mine = Map::new(4 * 4096);
        mine.touch();
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        // SAFETY: the child pins, talks over a socket and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let mut byte = [0u8; 1];
            let ok = pin_via(PinPath::IoUring, mine.addr, mine.len, true).map(|pin| {
                let _ = b.write_all(b"p"); // pinned
                let _ = b.read_exact(&mut byte); // the parent has pinned too
                drop(pin);
            });
            let _ = b.write_all(if ok.is_ok() { b"d" } else { b"e" });
            // SAFETY: leave the forked child without running the parent's destructors.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0);
        let mut byte = [0u8; 1];
        a.read_exact(&mut byte).expect("child pinned");
        let p = pin_via(PinPath::IoUring, m.addr, m.len, true).unwrap();
        a.write_all(b"go").unwrap();
        a.read_exact(&mut byte).expect("child released its pin");
        assert_eq!(&byte, b"d", "the child pinned and released its own memory");
        let mut status = 0;
        // SAFETY: reaping our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(
            pinned_pages(&m),
            vec![true; 4],
            "the parent's pin survived the child's release"
        );
        drop(p);
    }

    #[test]
    fn mode_parsing() {
        assert_eq!(PinMode::parse("mlock"), Some(PinMode::Mlock));
        assert_eq!(PinMode::parse("IO_URING"), Some(PinMode::IoUring));
        assert_eq!(PinMode::parse(""), Some(PinMode::Auto));
        assert_eq!(PinMode::parse("gup"), None);
    }
}
