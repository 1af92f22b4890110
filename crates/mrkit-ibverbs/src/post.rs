//! Posting work requests: `ops.post_send`, `ops.post_recv` and `ops.post_srq_recv`, the entry
//! points the inline `ibv_post_*` of the headers call.
//!
//! Translation rules (`struct ibv_send_wr` → [`SendWr`]):
//! * WR chains are posted in one call; on failure `*bad_wr` is the first WR not posted (a WR
//!   the library cannot translate, e.g. an unknown opcode, fails with EINVAL before the device
//!   sees it; the WRs before it are posted).
//! * `IBV_SEND_INLINE`: the gather list's bytes are copied at post time (no lkey check), so
//!   the buffer may be reused as soon as `ibv_post_send` returns.
//! * `imm_data` is `__be32` (the wire bytes) in both `ibv_send_wr` and `ibv_wc`;
//!   `invalidate_rkey` / `invalidated_rkey` (same unions) are host order.

use std::ffi::{c_int, c_void};

use mrkit_soft::mw::BindInfo;
use mrkit_soft::qp::{BindWr, PostError, RecvWr, SendWr, Sge, WrOpcode};
use mrkit_soft::AccessFlags;

use crate::abi::*;
use crate::context::MrkitContext;
use crate::ffi::{fail, guard, soft_errno};
use crate::obj::{obj_ctx, Obj};
use crate::qp::MrkitQp;
use crate::srq::MrkitSrq;

/// # Safety
/// `sg` valid for `n` entries when `n > 0`.
unsafe fn sges(sg: *const ibv_sge, n: c_int) -> Vec<Sge> {
    let mut v = Vec::new();
    // SAFETY: forwarded contract.
    unsafe { extend_sges(&mut v, sg, n) };
    v
}

/// Append the `n` entries of the C gather/scatter list `sg` to `out`.
///
/// # Safety
/// `sg` valid for `n` entries when `n > 0`.
unsafe fn extend_sges(out: &mut Vec<Sge>, sg: *const ibv_sge, n: c_int) {
    if n <= 0 || sg.is_null() {
        return;
    }
    // SAFETY: caller contract.
    let c = unsafe { std::slice::from_raw_parts(sg, n as usize) };
    out.extend(c.iter().map(|s| Sge {
        addr: s.addr,
        length: s.length,
        lkey: s.lkey,
    }));
}

/// The device opcode of an `ibv_send_wr.opcode`; None for the ones mrkit0 does not take (TSO,
/// driver-private, ATOMIC_WRITE, tag matching).
fn opcode_of(op: u32) -> Option<WrOpcode> {
    Some(match op {
        IBV_WR_RDMA_WRITE => WrOpcode::RdmaWrite,
        IBV_WR_RDMA_WRITE_WITH_IMM => WrOpcode::RdmaWriteWithImm,
        IBV_WR_SEND => WrOpcode::Send,
        IBV_WR_SEND_WITH_IMM => WrOpcode::SendWithImm,
        IBV_WR_RDMA_READ => WrOpcode::RdmaRead,
        IBV_WR_ATOMIC_CMP_AND_SWP => WrOpcode::AtomicCmpAndSwp,
        IBV_WR_ATOMIC_FETCH_AND_ADD => WrOpcode::AtomicFetchAndAdd,
        IBV_WR_LOCAL_INV => WrOpcode::LocalInv,
        IBV_WR_BIND_MW => WrOpcode::BindMw,
        IBV_WR_SEND_WITH_INV => WrOpcode::SendWithInv,
        _ => return None,
    })
}

/// Translate one `ibv_send_wr` into `s`, reusing the capacity of its two vectors (a thread
/// posting one WR at a time allocates nothing per post, `op_post_send`).
///
/// # Safety
/// `w` a valid WR whose `sg_list` (and, for INLINE, the memory it describes) is readable, and
/// whose `bind_mw.mw` / `bind_info.mr` are live objects when the opcode is BIND_MW.
unsafe fn send_wr_from_c(w: &ibv_send_wr, s: &mut SendWr) -> Result<(), c_int> {
    let opcode = opcode_of(w.opcode).ok_or(libc::EINVAL)?;
    let mut sg = std::mem::take(&mut s.sg_list);
    let mut data = std::mem::take(&mut s.inline_data);
    sg.clear();
    data.clear();
    // SAFETY: forwarded contract (`num_sge` readable entries).
    unsafe { extend_sges(&mut sg, w.sg_list, w.num_sge) };
    *s = SendWr::new(w.wr_id, opcode).flags(w.send_flags);
    match opcode {
        WrOpcode::RdmaWrite | WrOpcode::RdmaWriteWithImm | WrOpcode::RdmaRead => {
            s.remote_addr = w.wr[0];
            s.rkey = w.wr[1] as u32;
        }
        WrOpcode::AtomicCmpAndSwp | WrOpcode::AtomicFetchAndAdd => {
            s.remote_addr = w.wr[0];
            s.compare_add = w.wr[1];
            s.swap = w.wr[2];
            s.rkey = w.wr[3] as u32;
        }
        WrOpcode::BindMw => {
            let mw = w.bind_mw[0] as *mut ibv_mw;
            let mr = w.bind_mw[2] as *mut ibv_mr;
            if mw.is_null() {
                return Err(libc::EINVAL);
            }
            // SAFETY: live MW / MR (caller contract).
            let (mw_rkey, mr_lkey) =
                unsafe { ((*mw).rkey, if mr.is_null() { 0 } else { (*mr).lkey }) };
            s.bind = Some(BindWr {
                mw_rkey,
                new_key: w.bind_mw[1] as u8,
                info: BindInfo {
                    mr_lkey,
                    addr: w.bind_mw[3],
                    length: w.bind_mw[4],
                    access: AccessFlags::from_bits_retain(w.bind_mw[5] as u32),
                },
            });
        }
        _ => {}
    }
    match opcode {
        WrOpcode::RdmaWriteWithImm | WrOpcode::SendWithImm => s.imm_data = u32::from_be(w.imm_data),
        WrOpcode::SendWithInv | WrOpcode::LocalInv => s.invalidate_rkey = w.imm_data,
        _ => {}
    }
    if w.send_flags & IBV_SEND_INLINE != 0 {
        for g in &sg {
            if g.length > 0 {
                // SAFETY: the application's gather list is readable at post time (INLINE
                // contract); addresses are process virtual addresses.
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(g.addr as usize as *const u8, g.length as usize)
                });
            }
        }
    }
    s.inline_data = data;
    s.sg_list = sg;
    Ok(())
}

/// WRs a thread keeps translated for reuse (their vectors' capacity with them).
const POST_SCRATCH_WRS: usize = 64;

thread_local! {
    /// `op_post_send`'s translated chain, reused per thread: the WR pointers and the WRs.
    static POST_SEND_SCRATCH: std::cell::RefCell<(Vec<*mut ibv_send_wr>, Vec<SendWr>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// `ops.post_send(qp, wr, bad_wr)`: 0, or an errno value with `*bad_wr` the first WR not
/// posted.
///
/// # Safety
/// `qp` a live QP; `wr` a valid chain; `bad_wr` valid for a write.
pub(crate) unsafe extern "C" fn op_post_send(
    qp: *mut c_void,
    wr: *mut c_void,
    bad_wr: *mut *mut c_void,
) -> c_int {
    let set_bad = |p: *mut ibv_send_wr| {
        if !bad_wr.is_null() {
            // SAFETY: valid out-pointer (caller contract).
            unsafe { bad_wr.write(p.cast()) };
        }
    };
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((q, m)) = (unsafe { obj_ctx::<MrkitQp>(qp.cast()) }) else {
        set_bad(wr.cast());
        return fail(libc::EINVAL);
    };
    let qpn = q.qpn;
    let post = |ptrs: &mut Vec<*mut ibv_send_wr>, wrs: &mut Vec<SendWr>| {
        ptrs.clear();
        let mut early: Option<c_int> = None;
        let mut p = wr.cast::<ibv_send_wr>();
        while !p.is_null() {
            // SAFETY: p is an element of the caller's valid chain.
            let w = unsafe { &*p };
            let n = ptrs.len();
            if n == wrs.len() {
                wrs.push(SendWr::new(0, WrOpcode::Send));
            }
            // SAFETY: forwarded contract for the WR's memory.
            match unsafe { send_wr_from_c(w, &mut wrs[n]) } {
                Ok(()) => ptrs.push(p),
                Err(e) => {
                    early = Some(e);
                    break;
                }
            }
            p = w.next;
        }
        let n = ptrs.len();
        let r = if n > 0 {
            m.soft.post_send(qpn, &wrs[..n]).err()
        } else {
            None
        };
        wrs.truncate(POST_SCRATCH_WRS);
        if let Some(PostError { bad_wr: i, error }) = r {
            set_bad(ptrs[i]);
            return fail(soft_errno(&error));
        }
        if let Some(e) = early {
            set_bad(p);
            return fail(e);
        }
        0
    };
    guard(libc::EIO, || {
        // This thread's scratch, unless it is in use (a post from a signal handler that
        // interrupted a post): then fresh vectors.
        POST_SEND_SCRATCH
            .try_with(|c| match c.try_borrow_mut() {
                Ok(mut g) => {
                    let (ptrs, wrs) = &mut *g;
                    post(ptrs, wrs)
                }
                Err(_) => post(&mut Vec::new(), &mut Vec::new()),
            })
            .unwrap_or_else(|_| post(&mut Vec::new(), &mut Vec::new()))
    })
}

/// Translate a receive chain.
///
/// # Safety
/// `wr` a valid chain.
unsafe fn recv_chain(wr: *mut ibv_recv_wr) -> (Vec<*mut ibv_recv_wr>, Vec<RecvWr>) {
    let mut ptrs = Vec::new();
    let mut wrs = Vec::new();
    let mut p = wr;
    while !p.is_null() {
        // SAFETY: element of the caller's chain.
        let w = unsafe { &*p };
        ptrs.push(p);
        wrs.push(RecvWr {
            wr_id: w.wr_id,
            // SAFETY: the WR's sg_list is valid for num_sge entries.
            sg_list: unsafe { sges(w.sg_list, w.num_sge) },
        });
        p = w.next;
    }
    (ptrs, wrs)
}

/// Post a receive chain through `post` (the QP's RQ or an SRQ): `*bad_wr` is the first WR not
/// posted on failure (all of them when `target` is not a live object of this library).
///
/// # Safety
/// `target` NULL or a live `T` of this library; `wr` a valid chain; `bad_wr` NULL or valid for
/// a write.
unsafe fn post_recv_common<T: Obj>(
    target: *mut c_void,
    wr: *mut c_void,
    bad_wr: *mut *mut c_void,
    post: impl FnOnce(&MrkitContext, &T, &[RecvWr]) -> Result<(), PostError>,
) -> c_int {
    let set_bad = |p: *mut c_void| {
        if !bad_wr.is_null() {
            // SAFETY: valid out-pointer (caller contract).
            unsafe { bad_wr.write(p) };
        }
    };
    // SAFETY: caller contract (a live object of this library; its context is open).
    let Some((t, m)) = (unsafe { obj_ctx::<T>(target) }) else {
        set_bad(wr);
        return fail(libc::EINVAL);
    };
    guard(libc::EIO, || {
        // SAFETY: caller contract.
        let (ptrs, wrs) = unsafe { recv_chain(wr.cast()) };
        match post(m, t, &wrs) {
            Ok(()) => 0,
            Err(PostError { bad_wr: i, error }) => {
                set_bad(ptrs[i].cast());
                fail(soft_errno(&error))
            }
        }
    })
}

/// `ops.post_recv(qp, wr, bad_wr)`.
///
/// # Safety
/// `qp` a live QP; `wr` a valid chain; `bad_wr` valid for a write.
pub(crate) unsafe extern "C" fn op_post_recv(
    qp: *mut c_void,
    wr: *mut c_void,
    bad_wr: *mut *mut c_void,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        post_recv_common(qp, wr, bad_wr, |m, q: &MrkitQp, wrs| {
            m.soft.post_recv(q.qpn, wrs)
        })
    }
}

/// `ops.post_srq_recv(srq, wr, bad_wr)`.
///
/// # Safety
/// `srq` a live SRQ; `wr` a valid chain; `bad_wr` valid for a write.
pub(crate) unsafe extern "C" fn op_post_srq_recv(
    srq: *mut c_void,
    wr: *mut c_void,
    bad_wr: *mut *mut c_void,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe {
        post_recv_common(srq, wr, bad_wr, |m, s: &MrkitSrq, wrs| {
            m.soft.post_srq_recv(s.srqn, wrs)
        })
    }
}
