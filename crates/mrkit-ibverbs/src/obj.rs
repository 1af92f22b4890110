//! How the library's objects are handed to C and recognised again.
//!
//! * CQs, QPs and SRQs are `#[repr(C)]` structs whose first member is the `ibv_*` struct C
//!   sees, followed by a magic word: [`Obj`] and [`obj`] turn a C pointer back into the object
//!   (None for NULL or a struct of another origin); [`EventObj`] adds the async-event accounting
//!   that `ibv_destroy_qp` / `ibv_destroy_srq` wait on ([`finish_destroy`]). Each object file
//!   implements them with [`impl_obj!`].
//! * PDs, MRs and MWs are the plain `ibv_*` structs, recorded in a per-process registry of live
//!   addresses ([`into_live`], [`is_live`]) so that a repeated release is EINVAL instead of a read
//!   of freed memory ([`release_boxed`]).

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use crate::abi::ibv_context;
use crate::context::{open_context, MrkitContext};
use crate::events::{wait_until, Kind, ObjEvents};
use crate::ffi::{fail, guard, set_errno, soft_errno};

/// A library object handed to C as a pointer to its first member (`ibv_cq`, `ibv_srq`,
/// `ibv_qp`), recognised by a magic word.
pub(crate) trait Obj: Sized {
    const MAGIC: u64;
    fn magic(&self) -> u64;
    /// The `ibv_context` it was created on.
    fn context(&self) -> *mut ibv_context;
}

/// The library object `p` points to; None for NULL or an object of another origin (a zeroed
/// struct: wrong magic).
///
/// # Safety
/// `p` NULL or a live object of type `T` created by this library (or memory at least as large
/// whose magic word does not match).
pub(crate) unsafe fn obj<'a, T: Obj>(p: *mut c_void) -> Option<&'a mut T> {
    if p.is_null() {
        return None;
    }
    // SAFETY: caller contract: p starts a T.
    let o = unsafe { &mut *p.cast::<T>() };
    (o.magic() == T::MAGIC).then_some(o)
}

/// [`obj`] plus the open context it belongs to.
///
/// # Safety
/// As [`obj`]; the object's context must be open.
pub(crate) unsafe fn obj_ctx<'a, T: Obj>(p: *mut c_void) -> Option<(&'a mut T, &'a MrkitContext)> {
    // SAFETY: forwarded contract.
    let o = unsafe { obj::<T>(p) }?;
    // SAFETY: the object's context is open (caller contract).
    let m = unsafe { open_context(o.context()) }?;
    Some((o, m))
}

/// A QP or SRQ: an object with affiliated async events and one `events_completed` counter.
pub(crate) trait EventObj: Obj {
    const KIND: Kind;
    /// QPN / SRQN.
    fn num(&self) -> u32;
    fn events(&self) -> &Arc<ObjEvents>;
    /// Mark it freed (wrong magic from now on).
    fn kill(&mut self);
    /// Its `(mutex, cond, events_completed)`.
    ///
    /// # Safety
    /// `this` is live.
    unsafe fn ack_sync(
        this: *mut Self,
    ) -> (
        *mut libc::pthread_mutex_t,
        *mut libc::pthread_cond_t,
        *mut u32,
    );
}

/// `impl Obj for $t` (`$field`: its leading `ibv_*` struct), and with `events: $kind, $num`
/// also `impl EventObj` (`$num`: the QPN/SRQN field).
macro_rules! impl_obj {
    ($t:ty, $($field:ident).+, $magic:expr) => {
        impl $crate::obj::Obj for $t {
            const MAGIC: u64 = $magic;
            fn magic(&self) -> u64 {
                self.magic
            }
            fn context(&self) -> *mut $crate::abi::ibv_context {
                self.$($field).+.context
            }
        }
    };
    ($t:ty, $field:ident, $magic:expr, events: $kind:expr, $num:ident) => {
        $crate::obj::impl_obj!($t, $field, $magic);
        impl $crate::obj::EventObj for $t {
            const KIND: $crate::events::Kind = $kind;
            fn num(&self) -> u32 {
                self.$num
            }
            fn events(&self) -> &std::sync::Arc<$crate::events::ObjEvents> {
                &self.ev
            }
            fn kill(&mut self) {
                self.magic = 0;
            }
            unsafe fn ack_sync(
                this: *mut Self,
            ) -> (
                *mut libc::pthread_mutex_t,
                *mut libc::pthread_cond_t,
                *mut u32,
            ) {
                // SAFETY: caller contract (this is live); only addresses are taken.
                unsafe {
                    (
                        std::ptr::addr_of_mut!((*this).$field.mutex),
                        std::ptr::addr_of_mut!((*this).$field.cond),
                        std::ptr::addr_of_mut!((*this).$field.events_completed),
                    )
                }
            }
        }
    };
}
pub(crate) use impl_obj;

/// The end of `ibv_destroy_qp` / `ibv_destroy_srq` once the device answered `r`: on success
/// stop routing the object's events (its unread ones are dropped), wait until every event
/// handed out for it was acked (libibverbs' `events_completed == events_reported` wait), free
/// it and return 0; on failure return the errno value (errno set), the object stays valid.
///
/// # Safety
/// `p` a live `T` allocated by Box in this library, not used after success; `m` its context.
pub(crate) unsafe fn finish_destroy<T: EventObj>(
    p: *mut T,
    m: &MrkitContext,
    r: mrkit_soft::Result<()>,
) -> c_int {
    if let Err(e) = r {
        return fail(soft_errno(&e));
    }
    let reported = {
        // SAFETY: p is live (caller contract).
        let o = unsafe { &*p };
        m.router.unregister(T::KIND, o.num(), o.events())
    };
    // SAFETY: p is live; its mutex/cond are initialised and events_completed is written under
    // that mutex (ibv_ack_async_event).
    unsafe {
        let (mutex, cond, completed) = T::ack_sync(p);
        wait_until(mutex, cond, || *completed == reported);
    }
    // SAFETY: p is live until the Box is freed below; allocated by Box in this library and
    // freed once (caller contract).
    unsafe {
        (*p).kill();
        drop(Box::from_raw(p));
    }
    0
}

/// Addresses of the PDs, MRs and MWs this library handed out and has not freed (this process's:
/// a forked child starts empty, so the parent's objects are refused there without being read).
/// The release verbs look the pointer up before reading the struct, so a second
/// `ibv_dereg_mr` / `ibv_dealloc_pd` / `dealloc_mw` of a freed object is EINVAL instead of a
/// read of freed memory. Control path only (one hash insert per create, one remove per
/// release); the data path never consults it.
static LIVE: mrkit_soft::mem::PerProcess<std::sync::Mutex<std::collections::HashSet<usize>>> =
    mrkit_soft::mem::PerProcess::new();

fn live() -> std::sync::MutexGuard<'static, std::collections::HashSet<usize>> {
    let cell = LIVE.get_or_init(Default::default);
    cell.lock().unwrap_or_else(|e| e.into_inner())
}

/// `Box::into_raw(Box::new(v))`, recorded as live for [`release_boxed`].
pub(crate) fn into_live<T>(v: T) -> *mut T {
    let p = Box::into_raw(Box::new(v));
    live().insert(p as usize);
    p
}

/// Whether `p` is a live object of this library (see [`LIVE`]).
pub(crate) fn is_live<T>(p: *const T) -> bool {
    live().contains(&(p as usize))
}

/// The body of the release verbs whose struct this library allocated with `Box`
/// (`ibv_dealloc_pd`, `ibv_dereg_mr`, `ops.dealloc_mw`): EINVAL (errno too) for NULL, an
/// object already released (not in [`LIVE`]: never read) or a closed context; else
/// `release(device, handle)`: on success the struct is freed and 0 returned, on failure the struct stays valid and the errno value is returned (and set).
///
/// # Safety
/// `obj` NULL, or a struct of type `T` this library allocated with [`into_live`] (live or
/// already released); `parts` returns its `(context, device handle)`.
pub(crate) unsafe fn release_boxed<T>(
    obj: *mut T,
    parts: impl FnOnce(&T) -> (*mut ibv_context, u32),
    release: impl FnOnce(&mrkit_soft::Context, u32) -> mrkit_soft::Result<()>,
) -> c_int {
    // Claim it: of two racing or repeated releases only one finds it live.
    if obj.is_null() || !live().remove(&(obj as usize)) {
        set_errno(libc::EINVAL);
        return libc::EINVAL;
    }
    let restore = || {
        live().insert(obj as usize);
    };
    // SAFETY: obj was live (found in LIVE, which only holds unfreed objects of this library).
    let (ctx, handle) = parts(unsafe { &*obj });
    // SAFETY: the object's context is a context of this library (open or closed).
    let Some(m) = (unsafe { open_context(ctx) }) else {
        restore();
        set_errno(libc::EINVAL);
        return libc::EINVAL;
    };
    let rc = guard(libc::EIO, || match release(&m.soft, handle) {
        Ok(()) => {
            // SAFETY: allocated by Box in this library (into_live) and claimed above, so freed
            // exactly once.
            drop(unsafe { Box::from_raw(obj) });
            0
        }
        Err(e) => {
            set_errno(soft_errno(&e));
            soft_errno(&e)
        }
    });
    if rc != 0 {
        restore();
    }
    rc
}
