//! Held ACKs leave when the process exits normally (`exit`, a return from `main`) without
//! destroying its QPs or closing its devices.
//!
//! A hardware responder has sent its ACK before the application even sees the completion, so
//! a program that receives its last message and exits at once still completes its peer's
//! send on a ConnectX. With delayed ACKs (`held_acks::ACK_DELAY_MAX`) that ACK may still be
//! held in this process; an `atexit` handler sends the ACKs held by every open device. Not
//! covered: `_exit`, and death by a signal or a crash, which run no exit handlers (the peer
//! then retransmits to a receiver that is gone, and completes with RETRY_EXC_ERR).
//!
//! The same handler removes the process's statistics files (`stat_export::shutdown`), so a C
//! program on the drop-in library, which calls no shutdown of its own, leaves none behind.
//!
//! The only `unsafe` is the `atexit` registration.

use std::sync::atomic::{AtomicBool, Ordering};

/// Set by the first call of [`register`]: guards the one `atexit` registration.
static REGISTERED: AtomicBool = AtomicBool::new(false);

/// Register the exit handler (once per process; later calls do nothing).
pub(crate) fn register() {
    if REGISTERED.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: `flush_at_exit` is a plain `extern "C" fn()` that lives for the whole program
    // and never unwinds out (it catches panics); `atexit` only stores the pointer.
    let rc = unsafe { libc::atexit(flush_at_exit) };
    if rc != 0 {
        tracing::warn!("atexit failed: held ACKs will not be sent at exit");
    }
}

extern "C" fn flush_at_exit() {
    // A panic must not unwind into libc; nothing is left to report it to at exit.
    let _ = std::panic::catch_unwind(crate::driver::loopback::flush_held_acks_of_every_device);
    let _ = std::panic::catch_unwind(crate::stat_export::shutdown); // remove the stat files
}
