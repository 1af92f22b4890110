//! Completion channels (`ibv_create_comp_channel` / `ibv_destroy_comp_channel`). A channel's
//! `fd` is an eventfd (semaphore mode) that a forwarder thread signals for every CQ event of the
//! device's channel, so it is pollable and honours O_NONBLOCK like the kernel's. The events are
//! read with `ibv_get_cq_event` (`cq.rs`).

use std::collections::VecDeque;
use std::ffi::c_int;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::abi::*;
use crate::context::open_context;
use crate::ffi::{fail, fail_null, guard};

/// What a channel shares with its forwarder thread.
pub(crate) struct ChannelShared {
    /// CQ numbers of the events signalled on `fd` and not yet read by `ibv_get_cq_event`.
    pub(crate) queue: Mutex<VecDeque<u32>>,
    /// The eventfd (the channel's `fd`).
    fd: OwnedFd,
    /// Set by `ibv_destroy_comp_channel` (Release) and polled by the forwarder (Acquire), which
    /// then exits; it guards no other data.
    stop: AtomicBool,
}

/// `ibv_comp_channel` plus our state. `fd` is an eventfd (semaphore mode) that a forwarder
/// thread signals for every CQ event of the device's channel, so it is pollable and honours
/// O_NONBLOCK like the kernel's.
#[repr(C)]
pub(crate) struct MrkitChannel {
    pub(crate) ch: ibv_comp_channel,
    /// The device's completion channel whose events the forwarder thread relays.
    pub(crate) device_channel: u32,
    pub(crate) shared: Arc<ChannelShared>,
}

/// `struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *)`.
///
/// # Safety
/// `ctx` NULL or an open context.
pub(crate) unsafe extern "C" fn ibv_create_comp_channel(
    ctx: *mut ibv_context,
) -> *mut ibv_comp_channel {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { open_context(ctx) }) else {
        return fail_null(libc::EINVAL);
    };
    guard(std::ptr::null_mut(), || {
        // SAFETY: plain eventfd creation, checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE) };
        if fd < 0 {
            return std::ptr::null_mut();
        }
        // SAFETY: fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = fd.as_raw_fd();
        let device_channel = m.soft.create_comp_channel();
        let shared = Arc::new(ChannelShared {
            queue: Mutex::new(VecDeque::new()),
            fd,
            stop: AtomicBool::new(false),
        });
        let soft = m.soft.clone();
        let forwarder_shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("mrkit-compchan".into())
            .spawn(move || {
                while !forwarder_shared.stop.load(Ordering::Acquire) {
                    match soft.get_cq_event(device_channel, Some(Duration::from_millis(20))) {
                        Ok(Some(cqn)) => {
                            forwarder_shared
                                .queue
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push_back(cqn);
                            let one: u64 = 1;
                            // SAFETY: 8 bytes from a valid u64 to our own eventfd (alive:
                            // `forwarder_shared` holds it).
                            unsafe {
                                libc::write(
                                    forwarder_shared.fd.as_raw_fd(),
                                    (&one as *const u64).cast(),
                                    8,
                                )
                            };
                        }
                        Ok(None) => {}
                        Err(_) => break,
                    }
                }
            });
        if spawned.is_err() {
            return fail_null(libc::ENOMEM);
        }
        Box::into_raw(Box::new(MrkitChannel {
            ch: ibv_comp_channel {
                context: ctx,
                fd: raw,
                refcnt: 0,
            },
            device_channel,
            shared,
        }))
        .cast()
    })
}

/// `int ibv_destroy_comp_channel(struct ibv_comp_channel *)`: EBUSY while CQs use it.
///
/// # Safety
/// `ch` NULL or a channel from [`ibv_create_comp_channel`]; not used after success.
pub(crate) unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    if ch.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: ch is live (caller contract).
    if unsafe { (*ch).refcnt } > 0 {
        return fail(libc::EBUSY);
    }
    // SAFETY: allocated as a MrkitChannel by ibv_create_comp_channel; freed once.
    let b = unsafe { Box::from_raw(ch.cast::<MrkitChannel>()) };
    b.shared.stop.store(true, Ordering::Release);
    0
}
