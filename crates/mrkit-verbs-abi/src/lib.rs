//! `#[repr(C)]` mirrors of rdma-core v44's `<infiniband/verbs.h>` structures (x86-64/aarch64
//! LP64): the one set of C ABI definitions of the project. The drop-in `libibverbs.so.1`
//! (`mrkit-ibverbs`) fills them; `mrkit`'s rdma-core provider reads them from the system's
//! library. Field names follow the C headers. Checked against the system headers by
//! `mrkit-ibverbs`' `tests/layout.rs` (a C program printing `offsetof`/`sizeof`) and against
//! `docs/cabi.md` Appendix A by the compile-time assertions in this file.
#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]
#![forbid(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `IBV_SYSFS_NAME_MAX`.
pub const IBV_SYSFS_NAME_MAX: usize = 64;
/// `IBV_SYSFS_PATH_MAX`.
pub const IBV_SYSFS_PATH_MAX: usize = 256;

/// `enum ibv_node_type`: IBV_NODE_CA.
pub const IBV_NODE_CA: c_int = 1;
/// `enum ibv_transport_type`: IBV_TRANSPORT_IB.
pub const IBV_TRANSPORT_IB: c_int = 0;
/// `enum ibv_port_state`: IBV_PORT_ACTIVE.
pub const IBV_PORT_ACTIVE: u32 = 4;
/// `enum ibv_mtu`: IBV_MTU_1024.
pub const IBV_MTU_1024: u32 = 3;
/// `enum ibv_mtu`: IBV_MTU_4096.
pub const IBV_MTU_4096: u32 = 5;
/// `IBV_LINK_LAYER_ETHERNET`.
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;
/// `enum ibv_gid_type` (in `struct ibv_gid_entry`): RoCE v2.
pub const IBV_GID_TYPE_ROCE_V2: u32 = 2;
/// `enum ibv_gid_type_sysfs` (`ibv_query_gid_type`): RoCE v2.
pub const IBV_GID_TYPE_SYSFS_ROCE_V2: c_int = 1;
/// `enum ibv_fork_status`.
pub const IBV_FORK_DISABLED: c_int = 0;
/// `enum ibv_fork_status`.
pub const IBV_FORK_ENABLED: c_int = 1;
/// `enum ibv_fork_status`.
pub const IBV_FORK_UNNEEDED: c_int = 2;
/// `enum ibv_rereg_mr_err_code`.
pub const IBV_REREG_MR_ERR_INPUT: c_int = -1;
/// `enum ibv_rereg_mr_err_code`: the command failed (old MR: see docs).
pub const IBV_REREG_MR_ERR_CMD: c_int = -4;
/// `IBV_PORT_CM_SUP` in `port_cap_flags`.
pub const IBV_PORT_CM_SUP: u32 = 1 << 16;

/// `struct _ibv_device_ops` (two unused compat pointers).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct _ibv_device_ops {
    pub _dummy1: *const c_void,
    pub _dummy2: *const c_void,
}

/// `struct ibv_device` (664 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_device {
    pub _ops: _ibv_device_ops,
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

/// A `*mut c_void` slot for ops this library leaves NULL.
pub type Slot = *const c_void;

/// `ibv_context_ops.alloc_mw`.
pub type AllocMwFn = unsafe extern "C" fn(*mut ibv_pd, c_int) -> *mut ibv_mw;
/// `ibv_context_ops.bind_mw`.
pub type BindMwFn = unsafe extern "C" fn(*mut c_void, *mut ibv_mw, *mut c_void) -> c_int;
/// `ibv_context_ops.dealloc_mw`.
pub type DeallocMwFn = unsafe extern "C" fn(*mut ibv_mw) -> c_int;
/// `ibv_context_ops.poll_cq` (`struct ibv_cq *`, n, `struct ibv_wc *`).
pub type PollCqFn = unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> c_int;
/// `ibv_context_ops.req_notify_cq`.
pub type ReqNotifyCqFn = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
/// `post_send` / `post_recv` / `post_srq_recv`: (object, wr list, bad wr out).
pub type PostFn = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut *mut c_void) -> c_int;

/// `struct ibv_context_ops` (256 bytes). The `_compat_*` slots are never called by programs
/// built against v44 headers.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_context_ops {
    pub _compat_query_device: Slot,
    pub _compat_query_port: Slot,
    pub _compat_alloc_pd: Slot,
    pub _compat_dealloc_pd: Slot,
    pub _compat_reg_mr: Slot,
    pub _compat_rereg_mr: Slot,
    pub _compat_dereg_mr: Slot,
    pub alloc_mw: Option<AllocMwFn>,
    pub bind_mw: Option<BindMwFn>,
    pub dealloc_mw: Option<DeallocMwFn>,
    pub _compat_create_cq: Slot,
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyCqFn>,
    pub _compat_cq_event: Slot,
    pub _compat_resize_cq: Slot,
    pub _compat_destroy_cq: Slot,
    pub _compat_create_srq: Slot,
    pub _compat_modify_srq: Slot,
    pub _compat_query_srq: Slot,
    pub _compat_destroy_srq: Slot,
    pub post_srq_recv: Option<PostFn>,
    pub _compat_create_qp: Slot,
    pub _compat_query_qp: Slot,
    pub _compat_modify_qp: Slot,
    pub _compat_destroy_qp: Slot,
    pub post_send: Option<PostFn>,
    pub post_recv: Option<PostFn>,
    pub _compat_create_ah: Slot,
    pub _compat_destroy_ah: Slot,
    pub _compat_attach_mcast: Slot,
    pub _compat_detach_mcast: Slot,
    pub _compat_async_event: Slot,
}

/// `struct ibv_context` (328 bytes).
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// `verbs_context.query_port`.
pub type QueryPortFn =
    unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr, usize) -> c_int;
/// `verbs_context.query_device_ex`.
pub type QueryDeviceExFn = unsafe extern "C" fn(
    *mut ibv_context,
    *const ibv_query_device_ex_input,
    *mut ibv_device_attr_ex,
    usize,
) -> c_int;
/// `verbs_context.create_cq_ex`.
pub type CreateCqExFn =
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex;
/// `verbs_context.advise_mr`.
pub type AdviseMrFn = unsafe extern "C" fn(*mut ibv_pd, u32, u32, *mut ibv_sge, u32) -> c_int;

/// `struct verbs_context` (648 bytes): the extended op table *in front of* `ibv_context`.
/// It grows at the front in newer releases, so every op keeps its distance from the end.
#[repr(C)]
pub struct verbs_context {
    pub query_port: Option<QueryPortFn>,
    pub advise_mr: Option<AdviseMrFn>,
    pub alloc_null_mr: Slot,
    pub read_counters: Slot,
    pub attach_counters_point_flow: Slot,
    pub create_counters: Slot,
    pub destroy_counters: Slot,
    pub reg_dm_mr: Slot,
    pub alloc_dm: Slot,
    pub free_dm: Slot,
    pub modify_flow_action_esp: Slot,
    pub destroy_flow_action: Slot,
    pub create_flow_action_esp: Slot,
    pub modify_qp_rate_limit: Slot,
    pub alloc_parent_domain: Slot,
    pub dealloc_td: Slot,
    pub alloc_td: Slot,
    pub modify_cq: Slot,
    pub post_srq_ops: Slot,
    pub destroy_rwq_ind_table: Slot,
    pub create_rwq_ind_table: Slot,
    pub destroy_wq: Slot,
    pub modify_wq: Slot,
    pub create_wq: Slot,
    pub query_rt_values: Slot,
    pub create_cq_ex: Option<CreateCqExFn>,
    pub priv_: Slot,
    pub query_device_ex: Option<QueryDeviceExFn>,
    pub ibv_destroy_flow: Slot,
    pub ABI_placeholder2: Slot,
    pub ibv_create_flow: Slot,
    pub ABI_placeholder1: Slot,
    pub open_qp: Slot,
    pub create_qp_ex: Slot,
    pub get_srq_num: Slot,
    pub create_srq_ex: Slot,
    pub open_xrcd: Slot,
    pub close_xrcd: Slot,
    pub _ABI_placeholder3: u64,
    pub sz: usize,
    pub context: ibv_context,
}

/// `struct ibv_device_attr` (232 bytes). GUIDs are big-endian.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_query_device_ex_input`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_query_device_ex_input {
    pub comp_mask: u32,
}

/// `struct ibv_odp_caps.per_transport_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_odp_transport_caps {
    pub rc_odp_caps: u32,
    pub uc_odp_caps: u32,
    pub ud_odp_caps: u32,
}

/// `struct ibv_odp_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_odp_caps {
    pub general_caps: u64,
    pub per_transport_caps: ibv_odp_transport_caps,
}

/// `struct ibv_tso_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_tso_caps {
    pub max_tso: u32,
    pub supported_qpts: u32,
}

/// `struct ibv_rss_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_rss_caps {
    pub supported_qpts: u32,
    pub max_rwq_indirection_tables: u32,
    pub max_rwq_indirection_table_size: u32,
    pub rx_hash_fields_mask: u64,
    pub rx_hash_function: u8,
}

/// `struct ibv_packet_pacing_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_packet_pacing_caps {
    pub qp_rate_limit_min: u32,
    pub qp_rate_limit_max: u32,
    pub supported_qpts: u32,
}

/// `struct ibv_tm_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_tm_caps {
    pub max_rndv_hdr_size: u32,
    pub max_num_tags: u32,
    pub flags: u32,
    pub max_ops: u32,
    pub max_sge: u32,
}

/// `struct ibv_cq_moderation_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_cq_moderation_caps {
    pub max_cq_count: u16,
    pub max_cq_period: u16,
}

/// `struct ibv_pci_atomic_caps`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_pci_atomic_caps {
    pub fetch_add: u16,
    pub swap: u16,
    pub compare_swap: u16,
}

/// `struct ibv_device_attr_ex` (400 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_device_attr_ex {
    pub orig_attr: ibv_device_attr,
    pub comp_mask: u32,
    pub odp_caps: ibv_odp_caps,
    pub completion_timestamp_mask: u64,
    pub hca_core_clock: u64,
    pub device_cap_flags_ex: u64,
    pub tso_caps: ibv_tso_caps,
    pub rss_caps: ibv_rss_caps,
    pub max_wq_type_rq: u32,
    pub packet_pacing_caps: ibv_packet_pacing_caps,
    pub raw_packet_caps: u32,
    pub tm_caps: ibv_tm_caps,
    pub cq_mod_caps: ibv_cq_moderation_caps,
    pub max_dm_size: u64,
    pub pci_atomic_caps: ibv_pci_atomic_caps,
    pub xrc_odp_caps: u32,
    pub phys_port_cnt_ex: u32,
}

/// `struct ibv_port_attr` (52 bytes, align 4). The exported compat `ibv_query_port` fills
/// only the first 48 bytes (everything before `port_cap_flags2`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_port_attr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// Bytes of `ibv_port_attr` the compat `ibv_query_port@IBVERBS_1.1` fills.
pub const COMPAT_PORT_ATTR_LEN: usize = 48;

/// `union ibv_gid` (16 bytes, align 8 through its `global` member).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

/// `struct ibv_gid_entry` (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

/// `struct ibv_pd` (16 bytes).
#[repr(C)]
#[derive(Debug)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// `struct ibv_mr` (48 bytes).
#[repr(C)]
#[derive(Debug)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_mw` (32 bytes).
#[repr(C)]
#[derive(Debug)]
pub struct ibv_mw {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub rkey: u32,
    pub handle: u32,
    pub type_: c_int,
}

/// `struct ibv_sge` (16 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// `struct ibv_async_event` (16 bytes): `element` is a union of object pointers / port number.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_async_event {
    pub element: u64,
    pub event_type: c_int,
}

/// Layout table: `(name, offset or size, size)` rows in the format of `tests/c/layout.c`
/// (`struct` rows carry `sizeof` and alignment, `struct.field` rows `offsetof` and size).
pub fn layout_table() -> Vec<(String, usize, usize)> {
    use std::mem::{align_of, offset_of, size_of};
    fn field_size<T, F>(_: fn(&T) -> &F) -> usize {
        size_of::<F>()
    }
    let mut t: Vec<(String, usize, usize)> = Vec::new();
    macro_rules! s {
        ($ty:ident) => {
            t.push((
                stringify!($ty).to_string(),
                size_of::<$ty>(),
                align_of::<$ty>(),
            ))
        };
    }
    macro_rules! f {
        ($ty:ident, $field:ident, $cname:expr) => {{
            let size = field_size(|x: &$ty| &x.$field);
            t.push((
                format!("{}.{}", stringify!($ty), $cname),
                offset_of!($ty, $field),
                size,
            ))
        }};
        ($ty:ident, $field:ident) => {
            f!($ty, $field, stringify!($field))
        };
    }
    s!(ibv_device);
    f!(ibv_device, _ops);
    f!(ibv_device, node_type);
    f!(ibv_device, transport_type);
    f!(ibv_device, name);
    f!(ibv_device, dev_name);
    f!(ibv_device, dev_path);
    f!(ibv_device, ibdev_path);
    s!(ibv_context_ops);
    f!(ibv_context_ops, _compat_query_device);
    f!(ibv_context_ops, _compat_query_port);
    f!(ibv_context_ops, alloc_mw);
    f!(ibv_context_ops, bind_mw);
    f!(ibv_context_ops, dealloc_mw);
    f!(ibv_context_ops, poll_cq);
    f!(ibv_context_ops, req_notify_cq);
    f!(ibv_context_ops, post_srq_recv);
    f!(ibv_context_ops, post_send);
    f!(ibv_context_ops, post_recv);
    f!(ibv_context_ops, _compat_async_event);
    s!(ibv_context);
    f!(ibv_context, device);
    f!(ibv_context, ops);
    f!(ibv_context, cmd_fd);
    f!(ibv_context, async_fd);
    f!(ibv_context, num_comp_vectors);
    f!(ibv_context, mutex);
    f!(ibv_context, abi_compat);
    s!(verbs_context);
    f!(verbs_context, query_port);
    f!(verbs_context, advise_mr);
    f!(verbs_context, alloc_null_mr);
    f!(verbs_context, read_counters);
    f!(verbs_context, attach_counters_point_flow);
    f!(verbs_context, create_counters);
    f!(verbs_context, destroy_counters);
    f!(verbs_context, reg_dm_mr);
    f!(verbs_context, alloc_dm);
    f!(verbs_context, free_dm);
    f!(verbs_context, modify_flow_action_esp);
    f!(verbs_context, destroy_flow_action);
    f!(verbs_context, create_flow_action_esp);
    f!(verbs_context, modify_qp_rate_limit);
    f!(verbs_context, alloc_parent_domain);
    f!(verbs_context, dealloc_td);
    f!(verbs_context, alloc_td);
    f!(verbs_context, modify_cq);
    f!(verbs_context, post_srq_ops);
    f!(verbs_context, destroy_rwq_ind_table);
    f!(verbs_context, create_rwq_ind_table);
    f!(verbs_context, destroy_wq);
    f!(verbs_context, modify_wq);
    f!(verbs_context, create_wq);
    f!(verbs_context, query_rt_values);
    f!(verbs_context, create_cq_ex);
    f!(verbs_context, priv_, "priv");
    f!(verbs_context, query_device_ex);
    f!(verbs_context, ibv_destroy_flow);
    f!(verbs_context, ABI_placeholder2);
    f!(verbs_context, ibv_create_flow);
    f!(verbs_context, ABI_placeholder1);
    f!(verbs_context, open_qp);
    f!(verbs_context, create_qp_ex);
    f!(verbs_context, get_srq_num);
    f!(verbs_context, create_srq_ex);
    f!(verbs_context, open_xrcd);
    f!(verbs_context, close_xrcd);
    f!(verbs_context, _ABI_placeholder3);
    f!(verbs_context, sz);
    f!(verbs_context, context);
    s!(ibv_pd);
    f!(ibv_pd, context);
    f!(ibv_pd, handle);
    s!(ibv_mr);
    f!(ibv_mr, context);
    f!(ibv_mr, pd);
    f!(ibv_mr, addr);
    f!(ibv_mr, length);
    f!(ibv_mr, handle);
    f!(ibv_mr, lkey);
    f!(ibv_mr, rkey);
    s!(ibv_mw);
    f!(ibv_mw, context);
    f!(ibv_mw, pd);
    f!(ibv_mw, rkey);
    f!(ibv_mw, handle);
    f!(ibv_mw, type_, "type");
    s!(ibv_sge);
    f!(ibv_sge, addr);
    f!(ibv_sge, length);
    f!(ibv_sge, lkey);
    s!(ibv_device_attr);
    f!(ibv_device_attr, fw_ver);
    f!(ibv_device_attr, node_guid);
    f!(ibv_device_attr, sys_image_guid);
    f!(ibv_device_attr, max_mr_size);
    f!(ibv_device_attr, page_size_cap);
    f!(ibv_device_attr, vendor_id);
    f!(ibv_device_attr, vendor_part_id);
    f!(ibv_device_attr, hw_ver);
    f!(ibv_device_attr, max_qp);
    f!(ibv_device_attr, max_qp_wr);
    f!(ibv_device_attr, device_cap_flags);
    f!(ibv_device_attr, max_sge);
    f!(ibv_device_attr, max_sge_rd);
    f!(ibv_device_attr, max_cq);
    f!(ibv_device_attr, max_cqe);
    f!(ibv_device_attr, max_mr);
    f!(ibv_device_attr, max_pd);
    f!(ibv_device_attr, max_qp_rd_atom);
    f!(ibv_device_attr, max_ee_rd_atom);
    f!(ibv_device_attr, max_res_rd_atom);
    f!(ibv_device_attr, max_qp_init_rd_atom);
    f!(ibv_device_attr, max_ee_init_rd_atom);
    f!(ibv_device_attr, atomic_cap);
    f!(ibv_device_attr, max_ee);
    f!(ibv_device_attr, max_rdd);
    f!(ibv_device_attr, max_mw);
    f!(ibv_device_attr, max_raw_ipv6_qp);
    f!(ibv_device_attr, max_raw_ethy_qp);
    f!(ibv_device_attr, max_mcast_grp);
    f!(ibv_device_attr, max_mcast_qp_attach);
    f!(ibv_device_attr, max_total_mcast_qp_attach);
    f!(ibv_device_attr, max_ah);
    f!(ibv_device_attr, max_fmr);
    f!(ibv_device_attr, max_map_per_fmr);
    f!(ibv_device_attr, max_srq);
    f!(ibv_device_attr, max_srq_wr);
    f!(ibv_device_attr, max_srq_sge);
    f!(ibv_device_attr, max_pkeys);
    f!(ibv_device_attr, local_ca_ack_delay);
    f!(ibv_device_attr, phys_port_cnt);
    s!(ibv_odp_caps);
    s!(ibv_rss_caps);
    s!(ibv_tm_caps);
    s!(ibv_device_attr_ex);
    f!(ibv_device_attr_ex, orig_attr);
    f!(ibv_device_attr_ex, comp_mask);
    f!(ibv_device_attr_ex, odp_caps);
    f!(ibv_device_attr_ex, completion_timestamp_mask);
    f!(ibv_device_attr_ex, hca_core_clock);
    f!(ibv_device_attr_ex, device_cap_flags_ex);
    f!(ibv_device_attr_ex, tso_caps);
    f!(ibv_device_attr_ex, rss_caps);
    f!(ibv_device_attr_ex, max_wq_type_rq);
    f!(ibv_device_attr_ex, packet_pacing_caps);
    f!(ibv_device_attr_ex, raw_packet_caps);
    f!(ibv_device_attr_ex, tm_caps);
    f!(ibv_device_attr_ex, cq_mod_caps);
    f!(ibv_device_attr_ex, max_dm_size);
    f!(ibv_device_attr_ex, pci_atomic_caps);
    f!(ibv_device_attr_ex, xrc_odp_caps);
    f!(ibv_device_attr_ex, phys_port_cnt_ex);
    s!(ibv_port_attr);
    f!(ibv_port_attr, state);
    f!(ibv_port_attr, max_mtu);
    f!(ibv_port_attr, active_mtu);
    f!(ibv_port_attr, gid_tbl_len);
    f!(ibv_port_attr, port_cap_flags);
    f!(ibv_port_attr, max_msg_sz);
    f!(ibv_port_attr, bad_pkey_cntr);
    f!(ibv_port_attr, qkey_viol_cntr);
    f!(ibv_port_attr, pkey_tbl_len);
    f!(ibv_port_attr, lid);
    f!(ibv_port_attr, sm_lid);
    f!(ibv_port_attr, lmc);
    f!(ibv_port_attr, max_vl_num);
    f!(ibv_port_attr, sm_sl);
    f!(ibv_port_attr, subnet_timeout);
    f!(ibv_port_attr, init_type_reply);
    f!(ibv_port_attr, active_width);
    f!(ibv_port_attr, active_speed);
    f!(ibv_port_attr, phys_state);
    f!(ibv_port_attr, link_layer);
    f!(ibv_port_attr, flags);
    f!(ibv_port_attr, port_cap_flags2);
    s!(ibv_gid);
    s!(ibv_gid_entry);
    f!(ibv_gid_entry, gid);
    f!(ibv_gid_entry, gid_index);
    f!(ibv_gid_entry, port_num);
    f!(ibv_gid_entry, gid_type);
    f!(ibv_gid_entry, ndev_ifindex);
    s!(ibv_async_event);
    f!(ibv_async_event, element);
    f!(ibv_async_event, event_type);
    t
}

// The numbers of rdma-core v44 (`docs/cabi.md` Appendix A), checked at compile time.
const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ibv_device>() == 664);
    assert!(size_of::<ibv_context_ops>() == 256);
    assert!(offset_of!(ibv_context_ops, poll_cq) == 88);
    assert!(offset_of!(ibv_context_ops, post_send) == 200);
    assert!(offset_of!(ibv_context_ops, post_recv) == 208);
    assert!(offset_of!(ibv_context_ops, post_srq_recv) == 160);
    assert!(size_of::<ibv_context>() == 328);
    assert!(offset_of!(ibv_context, abi_compat) == 320);
    assert!(offset_of!(ibv_context, mutex) == 280);
    assert!(size_of::<verbs_context>() == 648);
    assert!(offset_of!(verbs_context, query_device_ex) == 216);
    assert!(offset_of!(verbs_context, sz) == 312);
    assert!(offset_of!(verbs_context, context) == 320);
    assert!(size_of::<ibv_pd>() == 16);
    assert!(size_of::<ibv_mr>() == 48);
    assert!(offset_of!(ibv_mr, lkey) == 36);
    assert!(size_of::<ibv_mw>() == 32);
    assert!(size_of::<ibv_device_attr>() == 232);
    assert!(offset_of!(ibv_device_attr, phys_port_cnt) == 227);
    assert!(size_of::<ibv_device_attr_ex>() == 400);
    assert!(offset_of!(ibv_device_attr_ex, odp_caps) == 240);
    assert!(offset_of!(ibv_device_attr_ex, max_dm_size) == 376);
    assert!(offset_of!(ibv_device_attr_ex, phys_port_cnt_ex) == 396);
    assert!(size_of::<ibv_port_attr>() == 52);
    assert!(offset_of!(ibv_port_attr, link_layer) == 46);
    assert!(size_of::<ibv_gid_entry>() == 32);
    assert!(offset_of!(ibv_gid_entry, gid_type) == 24);
};

// ---------------------------------------------------------------------------------------------
// Data path: CQ, completion channel, QP, SRQ, AH, work requests.

/// `struct ibv_comp_channel` (16 bytes).
#[repr(C)]
#[derive(Debug)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_cq` (128 bytes).
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `ibv_cq_ex` reader returning a u32 (`read_vendor_err`, `read_byte_len`, ...).
pub type CqReadU32 = unsafe extern "C" fn(*mut ibv_cq_ex) -> u32;
/// `ibv_cq_ex` reader returning a u8.
pub type CqReadU8 = unsafe extern "C" fn(*mut ibv_cq_ex) -> u8;
/// `ibv_cq_ex` reader returning a u16.
pub type CqReadU16 = unsafe extern "C" fn(*mut ibv_cq_ex) -> u16;
/// `ibv_cq_ex` reader returning a u64.
pub type CqReadU64 = unsafe extern "C" fn(*mut ibv_cq_ex) -> u64;

/// `struct ibv_cq_ex` (288 bytes): an `ibv_cq` followed by the poll API.
#[repr(C)]
pub struct ibv_cq_ex {
    pub cq: ibv_cq,
    pub comp_mask: u32,
    pub status: u32,
    pub wr_id: u64,
    pub start_poll: Option<unsafe extern "C" fn(*mut ibv_cq_ex, *mut c_void) -> c_int>,
    pub next_poll: Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> c_int>,
    pub end_poll: Option<unsafe extern "C" fn(*mut ibv_cq_ex)>,
    pub read_opcode: Option<CqReadU32>,
    pub read_vendor_err: Option<CqReadU32>,
    pub read_byte_len: Option<CqReadU32>,
    pub read_imm_data: Option<CqReadU32>,
    pub read_qp_num: Option<CqReadU32>,
    pub read_src_qp: Option<CqReadU32>,
    pub read_wc_flags: Option<CqReadU32>,
    pub read_slid: Option<CqReadU32>,
    pub read_sl: Option<CqReadU8>,
    pub read_dlid_path_bits: Option<CqReadU8>,
    pub read_completion_ts: Option<CqReadU64>,
    pub read_cvlan: Option<CqReadU16>,
    pub read_flow_tag: Option<CqReadU32>,
    pub read_tm_info: Option<unsafe extern "C" fn(*mut ibv_cq_ex, *mut c_void)>,
    pub read_completion_wallclock_ns: Option<CqReadU64>,
}

/// `struct ibv_cq_init_attr_ex` (56 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_cq_init_attr_ex {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut ibv_comp_channel,
    pub comp_vector: u32,
    pub wc_flags: u64,
    pub comp_mask: u32,
    pub flags: u32,
    pub parent_domain: *mut ibv_pd,
}

/// `struct ibv_srq` (128 bytes).
#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_srq_attr` (12 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

/// `struct ibv_srq_init_attr` (24 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

/// `struct ibv_qp` (160 bytes).
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: u32,
    pub qp_type: u32,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_qp_cap` (20 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr` (64 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route` (24 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr` (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr` (144 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_ah` (24 bytes).
#[repr(C)]
#[derive(Debug)]
pub struct ibv_ah {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub handle: u32,
}

/// `struct ibv_send_wr` (128 bytes). The `wr` union (40..72) and the `bind_mw`/`tso` union
/// (80..128) are kept as raw words and decoded per opcode.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: u32,
    pub send_flags: c_uint,
    /// `imm_data` (`__be32`) / `invalidate_rkey` (host order).
    pub imm_data: u32,
    /// `wr.rdma {remote_addr u64, rkey u32}` / `wr.atomic {remote_addr, compare_add, swap,
    /// rkey}` / `wr.ud {ah, remote_qpn, remote_qkey}`.
    pub wr: [u64; 4],
    pub qp_type: u32,
    pub _pad: u32,
    /// `bind_mw {struct ibv_mw *mw; u32 rkey; struct ibv_mw_bind_info {mr*, addr, length,
    /// mw_access_flags}}` / `tso`.
    pub bind_mw: [u64; 6],
}

/// `struct ibv_mw_bind` (48 bytes), the argument of `ibv_bind_mw` (`ops.bind_mw`): `wr_id`,
/// `send_flags`, then `struct ibv_mw_bind_info {mr, addr, length, mw_access_flags}` inline.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_mw_bind {
    pub wr_id: u64,
    pub send_flags: u32,
    pub mr: *mut ibv_mr,
    pub addr: u64,
    pub length: u64,
    pub mw_access_flags: u32,
}

/// `struct ibv_recv_wr` (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc` (48 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (`__be32`) / `invalidated_rkey`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `IBV_QPT_RC`.
pub const IBV_QPT_RC: u32 = 2;
/// `IBV_QP_INIT_ATTR_PD`.
pub const IBV_QP_INIT_ATTR_PD: u32 = 1;

/// `enum ibv_wr_opcode` (`ibv_send_wr.opcode`): the values mrkit0 translates.
pub const IBV_WR_RDMA_WRITE: u32 = 0;
/// `IBV_WR_RDMA_WRITE_WITH_IMM`.
pub const IBV_WR_RDMA_WRITE_WITH_IMM: u32 = 1;
/// `IBV_WR_SEND`.
pub const IBV_WR_SEND: u32 = 2;
/// `IBV_WR_SEND_WITH_IMM`.
pub const IBV_WR_SEND_WITH_IMM: u32 = 3;
/// `IBV_WR_RDMA_READ`.
pub const IBV_WR_RDMA_READ: u32 = 4;
/// `IBV_WR_ATOMIC_CMP_AND_SWP`.
pub const IBV_WR_ATOMIC_CMP_AND_SWP: u32 = 5;
/// `IBV_WR_ATOMIC_FETCH_AND_ADD`.
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: u32 = 6;
/// `IBV_WR_LOCAL_INV`.
pub const IBV_WR_LOCAL_INV: u32 = 7;
/// `IBV_WR_BIND_MW`.
pub const IBV_WR_BIND_MW: u32 = 8;
/// `IBV_WR_SEND_WITH_INV`.
pub const IBV_WR_SEND_WITH_INV: u32 = 9;
/// `IBV_SEND_INLINE` (`enum ibv_send_flags`): copy the gather list's bytes at post time.
pub const IBV_SEND_INLINE: u32 = 1 << 3;

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<ibv_comp_channel>() == 16);
    assert!(size_of::<ibv_cq>() == 128);
    assert!(offset_of!(ibv_cq, cqe) == 28);
    assert!(offset_of!(ibv_cq, comp_events_completed) == 120);
    assert!(size_of::<ibv_cq_ex>() == 288);
    assert!(offset_of!(ibv_cq_ex, status) == 132);
    assert!(offset_of!(ibv_cq_ex, wr_id) == 136);
    assert!(offset_of!(ibv_cq_ex, start_poll) == 144);
    assert!(offset_of!(ibv_cq_ex, read_opcode) == 168);
    assert!(offset_of!(ibv_cq_ex, read_completion_wallclock_ns) == 280);
    assert!(size_of::<ibv_cq_init_attr_ex>() == 56);
    assert!(offset_of!(ibv_cq_init_attr_ex, wc_flags) == 32);
    assert!(offset_of!(ibv_cq_init_attr_ex, parent_domain) == 48);
    assert!(size_of::<ibv_srq>() == 128);
    assert!(offset_of!(ibv_srq, events_completed) == 120);
    assert!(size_of::<ibv_srq_init_attr>() == 24);
    assert!(size_of::<ibv_qp>() == 160);
    assert!(offset_of!(ibv_qp, qp_num) == 52);
    assert!(offset_of!(ibv_qp, events_completed) == 152);
    assert!(size_of::<ibv_qp_cap>() == 20);
    assert!(size_of::<ibv_qp_init_attr>() == 64);
    assert!(offset_of!(ibv_qp_init_attr, sq_sig_all) == 56);
    assert!(size_of::<ibv_global_route>() == 24);
    assert!(size_of::<ibv_ah_attr>() == 32);
    assert!(offset_of!(ibv_ah_attr, is_global) == 29);
    assert!(size_of::<ibv_qp_attr>() == 144);
    assert!(offset_of!(ibv_qp_attr, ah_attr) == 56);
    assert!(offset_of!(ibv_qp_attr, pkey_index) == 120);
    assert!(offset_of!(ibv_qp_attr, max_rd_atomic) == 126);
    assert!(offset_of!(ibv_qp_attr, rnr_retry) == 132);
    assert!(offset_of!(ibv_qp_attr, rate_limit) == 136);
    assert!(size_of::<ibv_ah>() == 24);
    assert!(size_of::<ibv_send_wr>() == 128);
    assert!(offset_of!(ibv_send_wr, wr) == 40);
    assert!(offset_of!(ibv_send_wr, qp_type) == 72);
    assert!(offset_of!(ibv_send_wr, bind_mw) == 80);
    assert!(size_of::<ibv_recv_wr>() == 32);
    assert!(size_of::<ibv_mw_bind>() == 48);
    assert!(offset_of!(ibv_mw_bind, mr) == 16);
    assert!(offset_of!(ibv_mw_bind, mw_access_flags) == 40);
    assert!(size_of::<ibv_wc>() == 48);
    assert!(offset_of!(ibv_wc, pkey_index) == 40);
    assert!(offset_of!(ibv_wc, dlid_path_bits) == 45);
};
