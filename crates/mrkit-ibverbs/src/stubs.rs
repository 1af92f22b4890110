//! Everything exported but not implemented fails cleanly: EOPNOTSUPP (as errno and/or
//! return value) or NULL with errno EOPNOTSUPP, never a crash. The provider-private
//! `ibv_cmd_*` entry points only have to resolve (libmlx5/libefa import them but never reach
//! them: no device of theirs exists).
//!
//! The stubs ignore their arguments: on the SysV x86-64 and AAPCS64 ABIs a callee declared
//! with fewer parameters than the caller passes is harmless (arguments are in registers or
//! caller-cleaned stack).

use std::ffi::{c_char, c_int, c_void};

use crate::ffi::set_errno;

/// Integer-returning verb: errno = EOPNOTSUPP, returns EOPNOTSUPP.
pub(crate) extern "C" fn stub_int() -> c_int {
    set_errno(libc::EOPNOTSUPP);
    libc::EOPNOTSUPP
}

/// Pointer-returning verb: errno = EOPNOTSUPP, returns NULL.
pub(crate) extern "C" fn stub_null() -> *mut c_void {
    set_errno(libc::EOPNOTSUPP);
    std::ptr::null_mut()
}

/// `void` entry points with nothing to do (`ibv_ack_cq_events`, `ibv_unimport_*`,
/// `ibv_copy_*_from_kern`, `verbs_set_ops`, `verbs_uninit_context`, `__verbs_log`).
pub(crate) extern "C" fn stub_void() {}

/// Success without effect (`ibv_dofork_range` / `ibv_dontfork_range`: mrkit0 marks the ranges
/// it pins itself; `ibv_query_qp_data_in_order`: 0 = no in-order guarantee reported).
pub(crate) extern "C" fn stub_zero() -> c_int {
    0
}

/// `int ibv_read_sysfs_file(const char *dir, const char *file, char *buf, size_t size)`: there
/// is no sysfs for mrkit0: -1 with errno ENOENT (ibv_devinfo then omits board_id).
pub(crate) extern "C" fn ibv_read_sysfs_file() -> c_int {
    set_errno(libc::ENOENT);
    -1
}

/// `const char *ibv_get_sysfs_path(void)`.
pub(crate) extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// `void verbs_register_driver_34(const struct verbs_device_ops *)`: called from the ELF
/// constructors of libmlx5/libefa before `main`; a safe no-op (no allocation, no lock).
pub(crate) extern "C" fn verbs_register_driver_34(_ops: *const c_void) {}
