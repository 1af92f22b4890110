//! Address handles (`ibv_create_ah` / `ibv_destroy_ah`) and the translation of address
//! vectors between `ibv_ah_attr` and the device's [`AddressVector`]: `is_global` with an
//! IPv4-mapped `dgid` → the peer's IPv4 address (packets go over UDP); other GIDs → IPv6.
//! Without a GRH the QP talks to its own device instance (in-process loopback only).

use std::ffi::c_int;

use mrkit_soft::net::udp::{gid_of, ip_of_gid};
use mrkit_soft::qp::AddressVector;

use crate::abi::*;
use crate::context::{open_context, MrkitContext};
use crate::ffi::{fail, fail_null};

pub(crate) fn av_from_c(m: &MrkitContext, a: &ibv_ah_attr) -> AddressVector {
    if a.is_global != 0 {
        AddressVector {
            dest_node: 0,
            dgid: Some(ip_of_gid(a.grh.dgid.raw)),
            port_num: a.port_num,
        }
    } else {
        AddressVector {
            dest_node: m.soft.node_id(),
            dgid: None,
            port_num: a.port_num,
        }
    }
}

pub(crate) fn av_to_c(av: &AddressVector) -> ibv_ah_attr {
    let mut a = ibv_ah_attr {
        port_num: av.port_num,
        ..Default::default()
    };
    if let Some(ip) = av.dgid {
        a.is_global = 1;
        a.grh.dgid.raw = gid_of(ip);
        a.grh.hop_limit = 1;
    }
    a
}

#[repr(C)]
struct MrkitAh {
    ah: ibv_ah,
    attr: ibv_ah_attr,
}

/// `struct ibv_ah *ibv_create_ah(struct ibv_pd *, struct ibv_ah_attr *)`: port 1 and a GRH
/// only (RoCE); the attributes are kept (mrkit0 has no UD QPs, so nothing sends through it yet).
///
/// # Safety
/// `pd` NULL or a live PD; `attr` valid.
pub(crate) unsafe extern "C" fn ibv_create_ah(
    pd: *mut ibv_pd,
    attr: *mut ibv_ah_attr,
) -> *mut ibv_ah {
    if pd.is_null() || attr.is_null() {
        return fail_null(libc::EINVAL);
    }
    // SAFETY: live PD, valid attr (caller contract).
    let (ctx, a) = unsafe { ((*pd).context, *attr) };
    // SAFETY: the PD's context is open.
    if unsafe { open_context(ctx) }.is_none() || a.port_num != 1 {
        return fail_null(libc::EINVAL);
    }
    // RoCE: an AH needs a GRH (the kernel's rdma_check_ah_attr: EINVAL).
    if a.is_global == 0 {
        return fail_null(libc::EINVAL);
    }
    Box::into_raw(Box::new(MrkitAh {
        ah: ibv_ah {
            context: ctx,
            pd,
            handle: 0,
        },
        attr: a,
    }))
    .cast()
}

/// `int ibv_destroy_ah(struct ibv_ah *)`.
///
/// # Safety
/// `ah` NULL or a live AH; not used afterwards.
pub(crate) unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    if ah.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: allocated by Box in ibv_create_ah; freed once.
    drop(unsafe { Box::from_raw(ah.cast::<MrkitAh>()) });
    0
}
