//! Small FFI helpers: errno, panic containment, bounded struct copies.

use std::ffi::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Set the calling thread's `errno`.
pub(crate) fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns a valid pointer to this thread's errno.
    unsafe { *libc::__errno_location() = e };
}

/// Run `f`, turning a panic into `on_panic` (with errno EIO) instead of unwinding into C.
pub(crate) fn guard<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            set_errno(libc::EIO);
            on_panic
        }
    }
}

/// Copy the first `min(len, size_of::<T>())` bytes of `src` to `dst`; returns the byte count.
///
/// # Safety
/// `dst` must be valid for writes of `min(len, size_of::<T>())` bytes.
pub(crate) unsafe fn copy_prefix<T>(src: &T, dst: *mut T, len: usize) -> usize {
    let n = len.min(std::mem::size_of::<T>());
    // SAFETY: src is a valid T (n <= its size); the caller guarantees dst for n bytes; a
    // caller's buffer never overlaps our stack value.
    unsafe { std::ptr::copy_nonoverlapping((src as *const T).cast::<u8>(), dst.cast::<u8>(), n) };
    n
}
