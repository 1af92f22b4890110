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

/// Set errno to `e` and return NULL (constructors: `ibv_create_*`, `ibv_alloc_*`, `ibv_reg_*`).
pub(crate) fn fail_null<T>(e: c_int) -> *mut T {
    set_errno(e);
    std::ptr::null_mut()
}

/// Set errno to `e` and return it (verbs that return an errno value).
pub(crate) fn fail(e: c_int) -> c_int {
    set_errno(e);
    e
}

/// [`fail`] with EINVAL.
pub(crate) fn einval() -> c_int {
    fail(libc::EINVAL)
}

/// The errno value of a device error (mrkit-soft's errnos are the kernel's).
pub(crate) fn soft_errno(e: &mrkit_soft::Error) -> c_int {
    e.errno().raw()
}

/// C structs for which all-zero bytes are a valid value: plain data (pointers, integers,
/// pthread objects, whose `PTHREAD_*_INITIALIZER` is zero), no references, no enums with holes.
///
/// # Safety
/// Implement only for types whose every field is valid when all its bytes are zero.
pub(crate) unsafe trait ZeroValid {}
// SAFETY: integers, raw pointers, `Option<extern fn>` (NULL = None), pthread mutex/cond.
unsafe impl ZeroValid for crate::abi::ibv_cq_ex {}
// SAFETY: integers, raw pointers, pthread mutex/cond.
unsafe impl ZeroValid for crate::abi::ibv_qp {}
// SAFETY: integers, raw pointers, pthread mutex/cond.
unsafe impl ZeroValid for crate::abi::ibv_srq {}
// SAFETY: integers, raw pointers and integer arrays.
unsafe impl ZeroValid for crate::abi::ibv_send_wr {}

/// An all-zero value of a C struct.
pub(crate) fn zeroed<T: ZeroValid>() -> T {
    // SAFETY: T is valid when all-zero (ZeroValid's contract).
    unsafe { std::mem::zeroed() }
}
