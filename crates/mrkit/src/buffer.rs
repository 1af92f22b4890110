//! Page-aligned buffers from `mmap`, optionally backed by transparent huge pages or made
//! read-only: the memory you register.
//!
//! One of the few modules of the crate allowed `unsafe` (`docs/architecture.md` lists them):
//! it owns an anonymous mapping and hands out slices of it.

use std::ptr::NonNull;

use rustix::mm::{self, Advice, MapFlags, MprotectFlags, ProtFlags};

/// How to allocate a [`Buffer`].
///
/// ```
/// use mrkit::{Buffer, BufferOptions};
/// let b = Buffer::with_options(1 << 20, BufferOptions { thp: true, ..Default::default() }).unwrap();
/// assert_eq!(b.addr() % (2 << 20), 0);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BufferOptions {
    /// Align to 2 MiB and `madvise(MADV_HUGEPAGE)` so THP can back it.
    pub thp: bool,
    /// Touch every page now (make it resident).
    pub populate: bool,
    /// Offset of the returned slice within the first page (to test unaligned registrations).
    pub offset: usize,
}

/// An owned anonymous mapping (`mmap`), page aligned, zero filled.
///
/// ```
/// use mrkit::Buffer;
/// let mut b = Buffer::new(8192).unwrap();
/// b.as_mut_slice()[0] = 7;
/// assert_eq!(b.as_slice()[0], 7);
/// assert_eq!(b.as_ptr() as usize % 4096, 0);
/// ```
#[derive(Debug)]
pub struct Buffer {
    map: NonNull<u8>,
    map_len: usize,
    offset: usize,
    len: usize,
    readonly: bool,
}

// SAFETY: the buffer exclusively owns its mapping; access follows Rust's borrow rules.
unsafe impl Send for Buffer {}
// SAFETY: shared references only allow reads.
unsafe impl Sync for Buffer {}

// SAFETY: the mapping stays at the same address, `len` bytes long, until the buffer is
// dropped (it is unmapped only in `Drop`); through `&Buffer` (all an `Arc` gives) nothing can
// resize, remap or free it, and no `&mut` to the bytes is reachable (`as_mut_slice` and
// `make_readonly` need `&mut Buffer`). A buffer made read-only can only be registered without
// write access (the pin of a writable registration fails with EFAULT).
unsafe impl mrkit_soft::OwnedMemory for Buffer {
    fn range(&self) -> (u64, u64) {
        (self.addr(), self.len as u64)
    }
}

const HUGE: usize = 2 << 20;

impl Buffer {
    /// A zeroed buffer of `len` bytes.
    ///
    /// ```
    /// let b = mrkit::Buffer::new(100).unwrap();
    /// assert_eq!(b.len(), 100);
    /// ```
    pub fn new(len: usize) -> std::io::Result<Buffer> {
        Buffer::with_options(len, BufferOptions::default())
    }

    /// A buffer with options (THP backing, populate, in-page offset).
    ///
    /// ```
    /// use mrkit::{Buffer, BufferOptions};
    /// let b = Buffer::with_options(4096, BufferOptions { offset: 16, populate: true, ..Default::default() }).unwrap();
    /// assert_eq!(b.addr() % 4096, 16);
    /// ```
    pub fn with_options(len: usize, opts: BufferOptions) -> std::io::Result<Buffer> {
        let ps = rustix::param::page_size();
        if opts.offset >= ps {
            return Err(std::io::Error::other("offset must be below the page size"));
        }
        let need = len
            .checked_add(opts.offset)
            .and_then(|n| n.checked_add(ps - 1))
            .ok_or_else(|| std::io::Error::other("length overflows"))?
            & !(ps - 1);
        let need = need.max(ps);
        let align = if opts.thp { HUGE } else { ps };
        let map_len = if opts.thp { need + HUGE } else { need };
        // SAFETY: anonymous private mapping at a kernel-chosen address; no existing memory is
        // affected.
        let raw = unsafe {
            mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )?
        } as *mut u8;
        let mut base = raw;
        let mut total = map_len;
        if opts.thp {
            // Trim to a 2 MiB-aligned window so whole huge pages fit.
            let addr = raw as usize;
            let aligned = (addr + align - 1) & !(align - 1);
            let head = aligned - addr;
            let tail = map_len - head - need;
            // SAFETY: head and tail are inside the mapping we just created.
            unsafe {
                if head > 0 {
                    mm::munmap(raw.cast(), head)?;
                }
                if tail > 0 {
                    mm::munmap((aligned + need) as *mut _, tail)?;
                }
            }
            base = aligned as *mut u8;
            total = need;
        }
        let b = Buffer {
            map: NonNull::new(base).expect("mmap returned null"),
            map_len: total,
            offset: opts.offset,
            len,
            readonly: false,
        };
        if opts.thp {
            // After `b` owns the mapping: a failed madvise unmaps it (drop) instead of leaking.
            // SAFETY: advice on our own mapping; MADV_HUGEPAGE changes no contents.
            unsafe { mm::madvise(base.cast(), total, Advice::LinuxHugepage)? };
        }
        if opts.populate {
            // SAFETY: the range is our own writable mapping.
            unsafe {
                let p = b.map.as_ptr();
                for off in (0..total).step_by(ps) {
                    p.add(off).write_volatile(0);
                }
            }
        }
        Ok(b)
    }

    /// Make the whole mapping read-only (`mprotect(PROT_READ)`), e.g. to reproduce the EFAULT
    /// of registering a read-only mapping with write access.
    ///
    /// ```
    /// let mut b = mrkit::Buffer::new(4096).unwrap();
    /// b.make_readonly().unwrap();
    /// assert!(b.is_readonly());
    /// ```
    pub fn make_readonly(&mut self) -> std::io::Result<()> {
        // SAFETY: our own mapping; no outstanding `&mut` can exist while `&mut self` is held.
        unsafe { mm::mprotect(self.map.as_ptr().cast(), self.map_len, MprotectFlags::READ)? };
        self.readonly = true;
        Ok(())
    }

    /// Start address of the usable bytes.
    ///
    /// ```
    /// let b = mrkit::Buffer::new(64).unwrap();
    /// assert_eq!(b.as_ptr() as u64, b.addr());
    /// ```
    pub fn as_ptr(&self) -> *const u8 {
        // SAFETY: offset < page size <= map_len.
        unsafe { self.map.as_ptr().add(self.offset) }
    }

    /// Start address as an integer (what registration takes).
    ///
    /// ```
    /// let b = mrkit::Buffer::new(64).unwrap();
    /// assert_eq!(b.addr() % 4096, 0);
    /// ```
    pub fn addr(&self) -> u64 {
        self.as_ptr() as u64
    }

    /// Usable length.
    ///
    /// ```
    /// assert_eq!(mrkit::Buffer::new(10).unwrap().len(), 10);
    /// ```
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    ///
    /// ```
    /// assert!(mrkit::Buffer::new(0).unwrap().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether [`make_readonly`](Self::make_readonly) was called.
    ///
    /// ```
    /// assert!(!mrkit::Buffer::new(64).unwrap().is_readonly());
    /// ```
    pub fn is_readonly(&self) -> bool {
        self.readonly
    }

    /// The bytes.
    ///
    /// ```
    /// assert_eq!(mrkit::Buffer::new(4).unwrap().as_slice(), &[0; 4]);
    /// ```
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is valid for map_len >= offset + len bytes, zero-initialised.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len) }
    }

    /// The bytes, mutably. Panics on a read-only buffer (writing would fault).
    ///
    /// ```
    /// let mut b = mrkit::Buffer::new(4).unwrap();
    /// b.as_mut_slice()[3] = 1;
    /// assert_eq!(b.as_slice(), &[0, 0, 0, 1]);
    /// ```
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        assert!(!self.readonly, "buffer is read-only");
        // SAFETY: as above, and `&mut self` guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_ptr().add(self.offset), self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: we own the mapping and nothing borrows it any more.
        let _ = unsafe { mm::munmap(self.map.as_ptr().cast(), self.map_len) };
    }
}
