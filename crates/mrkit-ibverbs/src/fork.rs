//! Fork support: `ibv_fork_init` and `ibv_is_fork_initialized`, with libibverbs' rules, and
//! whether contexts opened from now on mark their registrations MADV_DONTFORK.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::abi::*;

/// Set once the process registered an MR (`ibv_fork_init` after that is EINVAL, as in
/// libibverbs). Relaxed: a lone flag that orders no other memory.
static REGISTERED_ONCE: AtomicBool = AtomicBool::new(false);
/// `ibv_fork_init` was called (or RDMAV_FORK_SAFE / IBV_FORK_SAFE is set). Relaxed: a lone
/// flag read when a context opens, ordering no other memory.
static FORK_INIT: AtomicBool = AtomicBool::new(false);

/// Record that the process registered memory (see [`ibv_fork_init`]'s "too late" rule).
pub(crate) fn note_registration() {
    REGISTERED_ONCE.store(true, Ordering::Relaxed);
}

fn env_fork_safe() -> bool {
    ["RDMAV_FORK_SAFE", "IBV_FORK_SAFE"]
        .iter()
        .any(|k| std::env::var_os(k).is_some())
}

/// Whether contexts opened from now on must mark registrations MADV_DONTFORK even when
/// `MRKIT_DONTFORK=0` (ibv_fork_init was called, or RDMAV_FORK_SAFE/IBV_FORK_SAFE is set).
pub(crate) fn fork_protection_requested() -> bool {
    FORK_INIT.load(Ordering::Relaxed) || env_fork_safe()
}

fn device_dontfork_default() -> bool {
    mrkit_soft::DeviceConfig::from_env()
        .map(|c| c.uses_dontfork())
        .unwrap_or(false)
}

/// `int ibv_fork_init(void)`: turns MADV_DONTFORK marking on for the device opened from now on
/// (registrations made after that are marked; earlier ones stay unmarked, as in libibverbs).
/// Returns 0. The one EINVAL case is libibverbs' "too late" rule of kernels that share pinned
/// pages with a forked child (before 5.13): a registration was made unmarked already. On
/// kernels that copy pinned pages at fork libibverbs makes this call a no-op; mrkit still
/// honours it (marking only costs the caller who asks), while [`ibv_is_fork_initialized`]
/// answers UNNEEDED as libibverbs does.
pub(crate) extern "C" fn ibv_fork_init() -> c_int {
    if device_dontfork_default()
        || FORK_INIT.load(Ordering::Relaxed)
        || mrkit_soft::mem::fork::kernel_copies_pinned_pages_on_fork()
        || !REGISTERED_ONCE.load(Ordering::Relaxed)
    {
        FORK_INIT.store(true, Ordering::Relaxed);
        return 0;
    }
    libc::EINVAL
}

/// `enum ibv_fork_status ibv_is_fork_initialized(void)`, libibverbs' answer: UNNEEDED on
/// kernels that copy pinned pages into a forked child (5.13 and later), whether or not
/// `ibv_fork_init` was called (it takes precedence); otherwise ENABLED when registrations are
/// marked DONTFORK (ibv_fork_init, RDMAV_FORK_SAFE / IBV_FORK_SAFE, MRKIT_DONTFORK=1),
/// DISABLED when not.
pub(crate) extern "C" fn ibv_is_fork_initialized() -> c_int {
    if mrkit_soft::mem::fork::kernel_copies_pinned_pages_on_fork() {
        IBV_FORK_UNNEEDED
    } else if device_dontfork_default() || fork_protection_requested() {
        IBV_FORK_ENABLED
    } else {
        IBV_FORK_DISABLED
    }
}
