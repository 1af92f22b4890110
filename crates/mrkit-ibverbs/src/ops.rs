//! The ops table: the one place that names every object file (as rxe's `rxe_ctx_ops`). It
//! fills the `ibv_context_ops` / `verbs_context` function pointers the inline verbs of the
//! headers call (`ibv_post_send`, `ibv_poll_cq`, `ibv_query_port`, `ibv_create_cq_ex`, ...)
//! and opens contexts with them ([`ibv_open_device`]). Nothing below this file names it.

use std::ffi::c_void;

use crate::abi::*;
use crate::context;
use crate::device::device_ptr;
use crate::ffi::{guard, set_errno};
use crate::{cq, device, mr, mw, post};

/// `ibv_context.ops`: the data-path entry points and the MW verbs; the `_compat_*` slots of
/// the old ABI stay NULL (the v44 library never calls them).
fn new_ops() -> ibv_context_ops {
    let n = std::ptr::null();
    ibv_context_ops {
        _compat_query_device: n,
        _compat_query_port: n,
        _compat_alloc_pd: n,
        _compat_dealloc_pd: n,
        _compat_reg_mr: n,
        _compat_rereg_mr: n,
        _compat_dereg_mr: n,
        alloc_mw: Some(mw::op_alloc_mw),
        bind_mw: Some(mw::op_bind_mw),
        dealloc_mw: Some(mw::op_dealloc_mw),
        _compat_create_cq: n,
        poll_cq: Some(cq::op_poll_cq),
        req_notify_cq: Some(cq::op_req_notify_cq),
        _compat_cq_event: n,
        _compat_resize_cq: n,
        _compat_destroy_cq: n,
        _compat_create_srq: n,
        _compat_modify_srq: n,
        _compat_query_srq: n,
        _compat_destroy_srq: n,
        post_srq_recv: Some(post::op_post_srq_recv),
        _compat_create_qp: n,
        _compat_query_qp: n,
        _compat_modify_qp: n,
        _compat_destroy_qp: n,
        post_send: Some(post::op_post_send),
        post_recv: Some(post::op_post_recv),
        _compat_create_ah: n,
        _compat_destroy_ah: n,
        _compat_attach_mcast: n,
        _compat_detach_mcast: n,
        _compat_async_event: n,
    }
}

/// The `verbs_context` of a new context: the extended verbs mrkit0 implements, every other
/// slot NULL (the inline wrappers then fail with EOPNOTSUPP), `sz` and the `ibv_context`.
fn new_vctx() -> verbs_context {
    let n = std::ptr::null();
    verbs_context {
        query_port: Some(device::vctx_query_port),
        advise_mr: Some(mr::vctx_advise_mr),
        alloc_null_mr: n,
        read_counters: n,
        attach_counters_point_flow: n,
        create_counters: n,
        destroy_counters: n,
        reg_dm_mr: n,
        alloc_dm: n,
        free_dm: n,
        modify_flow_action_esp: n,
        destroy_flow_action: n,
        create_flow_action_esp: n,
        modify_qp_rate_limit: n,
        alloc_parent_domain: n,
        dealloc_td: n,
        alloc_td: n,
        modify_cq: n,
        post_srq_ops: n,
        destroy_rwq_ind_table: n,
        create_rwq_ind_table: n,
        destroy_wq: n,
        modify_wq: n,
        create_wq: n,
        query_rt_values: n,
        create_cq_ex: Some(cq::vctx_create_cq_ex),
        priv_: n,
        query_device_ex: Some(device::vctx_query_device_ex),
        ibv_destroy_flow: n,
        ABI_placeholder2: n,
        ibv_create_flow: n,
        ABI_placeholder1: n,
        open_qp: n,
        create_qp_ex: n,
        get_srq_num: n,
        create_srq_ex: n,
        open_xrcd: n,
        close_xrcd: n,
        _ABI_placeholder3: 0,
        sz: std::mem::size_of::<verbs_context>(),
        context: ibv_context {
            device: device_ptr(),
            ops: new_ops(),
            cmd_fd: -1,
            async_fd: -1,
            num_comp_vectors: 1,
            mutex: libc::PTHREAD_MUTEX_INITIALIZER,
            abi_compat: usize::MAX as *mut c_void,
        },
    }
}

/// `struct ibv_context *ibv_open_device(struct ibv_device *device)`: a context with this
/// file's ops table.
///
/// # Safety
/// `device` must be NULL or a device from `ibv_get_device_list`.
pub(crate) unsafe extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    guard(std::ptr::null_mut(), || {
        if device != device_ptr() {
            set_errno(libc::ENODEV);
            return std::ptr::null_mut();
        }
        context::open(new_vctx())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::{ibv_close_device, post_async_event};
    use crate::device::{
        ibv_ack_async_event, ibv_free_device_list, ibv_get_async_event, ibv_get_device_list,
        ibv_query_port, vctx_query_port, MrkitDevice,
    };

    #[test]
    fn async_events_are_pollable_and_delivered_in_order() {
        // SAFETY: test of the exported functions with valid arguments throughout.
        unsafe {
            let mut n = 0;
            let list = ibv_get_device_list(&mut n);
            assert_eq!(n, 1);
            let ctx = ibv_open_device(*list);
            ibv_free_device_list(list);
            assert!(!ctx.is_null());
            let fd = (*ctx).async_fd;
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            assert_eq!(libc::poll(&mut pfd, 1, 0), 0, "nothing pending");
            assert!(post_async_event(ctx, 7, 9)); // IBV_EVENT_PORT_ACTIVE
            assert!(post_async_event(ctx, 8, 10)); // IBV_EVENT_PORT_ERR
            assert_eq!(libc::poll(&mut pfd, 1, 0), 1, "readable after an event");
            let mut ev = ibv_async_event {
                element: 0,
                event_type: 0,
            };
            assert_eq!(ibv_get_async_event(ctx, &mut ev), 0);
            assert_eq!((ev.element, ev.event_type), (7, 9));
            ibv_ack_async_event(&mut ev);
            assert_eq!(ibv_get_async_event(ctx, &mut ev), 0);
            assert_eq!((ev.element, ev.event_type), (8, 10));
            assert_eq!(libc::poll(&mut pfd, 1, 0), 0, "drained");
            assert_eq!(ibv_close_device(ctx), 0);
        }
    }

    #[test]
    fn compat_query_port_fills_only_the_48_byte_prefix() {
        // SAFETY: valid arguments; attr is a full ibv_port_attr; the context is closed.
        unsafe {
            let ctx = ibv_open_device(device_ptr());
            let mut attr = ibv_port_attr {
                port_cap_flags2: 0xaaaa,
                ..Default::default()
            };
            assert_eq!(ibv_query_port(ctx, 1, &mut attr), 0);
            assert_eq!(attr.state, IBV_PORT_ACTIVE);
            assert_eq!(attr.link_layer, IBV_LINK_LAYER_ETHERNET);
            assert_eq!(
                attr.port_cap_flags2, 0xaaaa,
                "compat entry wrote past 48 bytes"
            );
            let mut full = ibv_port_attr {
                port_cap_flags2: 0xaaaa,
                ..Default::default()
            };
            assert_eq!(vctx_query_port(ctx, 1, &mut full, 52), 0);
            assert_eq!(full.port_cap_flags2, 0);
            assert_eq!(ibv_query_port(ctx, 0, &mut attr), libc::EINVAL);
            assert_eq!(ibv_close_device(ctx), 0);
        }
    }

    #[test]
    fn context_layout_is_what_inline_verbs_expect() {
        // SAFETY: valid arguments; the context is closed at the end.
        unsafe {
            let ctx = ibv_open_device(device_ptr());
            assert!(!ctx.is_null());
            assert_eq!((*ctx).abi_compat as usize, usize::MAX);
            assert_eq!((*ctx).device, device_ptr());
            // verbs_context.sz sits right before the ibv_context (ibv_devinfo: *(ctx-8)).
            assert_eq!(*(ctx.cast::<u8>().sub(8).cast::<usize>()), 648);
            // The word after the device (verbs_device.ops) is NULL.
            assert!((*device_ptr().cast::<MrkitDevice>())
                .verbs_device_ops
                .is_null());
            assert!((*ctx).ops.post_send.is_some() && (*ctx).ops.poll_cq.is_some());
            assert_eq!(ibv_close_device(ctx), 0);
        }
    }
}
