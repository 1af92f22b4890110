//! The exported names and their version nodes.
//!
//! Each entry becomes a tiny trampoline (`jmp` to the Rust implementation) whose name is
//! versioned with `.symver __mrkit_sym_NAME, NAME@@NODE`; the version script
//! (`libibverbs.map`, passed by `build.rs`) defines the nodes. The Rust implementations
//! themselves are not exported, so the dynamic symbol table holds exactly the versioned names.
//! `verbs_allow_disassociate_destroy` is a 1-byte data object (`bool`, false), as in rdma-core.

#[cfg(target_arch = "x86_64")]
macro_rules! trampoline {
    ($name:ident, $ver:literal, $f:path) => {
        std::arch::global_asm!(
            concat!(".pushsection .text.__mrkit_sym_", stringify!($name), ",\"ax\",@progbits"),
            concat!(".globl __mrkit_sym_", stringify!($name)),
            concat!(".type __mrkit_sym_", stringify!($name), ",@function"),
            ".p2align 4",
            concat!("__mrkit_sym_", stringify!($name), ":"),
            "jmp {f}",
            concat!(".size __mrkit_sym_", stringify!($name), ", . - __mrkit_sym_", stringify!($name)),
            concat!(".symver __mrkit_sym_", stringify!($name), ", ", stringify!($name), "@@", $ver),
            ".popsection",
            f = sym $f,
        );
    };
}

#[cfg(target_arch = "aarch64")]
macro_rules! trampoline {
    ($name:ident, $ver:literal, $f:path) => {
        std::arch::global_asm!(
            concat!(".pushsection .text.__mrkit_sym_", stringify!($name), ",\"ax\",%progbits"),
            concat!(".globl __mrkit_sym_", stringify!($name)),
            concat!(".type __mrkit_sym_", stringify!($name), ",%function"),
            ".p2align 2",
            concat!("__mrkit_sym_", stringify!($name), ":"),
            "b {f}",
            concat!(".size __mrkit_sym_", stringify!($name), ", . - __mrkit_sym_", stringify!($name)),
            concat!(".symver __mrkit_sym_", stringify!($name), ", ", stringify!($name), "@@", $ver),
            ".popsection",
            f = sym $f,
        );
    };
}

/// Other architectures: no versioned exports (build.rs skips the version script too); the
/// implementations are only referenced so that they are not dead code.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
macro_rules! trampoline {
    ($name:ident, $ver:literal, $f:path) => {
        const _: () = {
            let _f = $f;
        };
    };
}

macro_rules! exports {
    ($( $name:ident @ $ver:literal => $f:path; )*) => {
        $( trampoline!($name, $ver, $f); )*
        /// Every exported name with its version node (the data object
        /// `verbs_allow_disassociate_destroy@@IBVERBS_PRIVATE_34` included).
        pub const EXPORTS: &[(&str, &str)] = &[
            $( (stringify!($name), $ver), )*
            ("verbs_allow_disassociate_destroy", "IBVERBS_PRIVATE_34"),
        ];
    };
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
std::arch::global_asm!(
    ".pushsection .data.__mrkit_sym_verbs_allow_disassociate_destroy,\"aw\"",
    ".globl __mrkit_sym_verbs_allow_disassociate_destroy",
    ".type __mrkit_sym_verbs_allow_disassociate_destroy, %object",
    ".size __mrkit_sym_verbs_allow_disassociate_destroy, 1",
    "__mrkit_sym_verbs_allow_disassociate_destroy: .byte 0",
    ".symver __mrkit_sym_verbs_allow_disassociate_destroy, verbs_allow_disassociate_destroy@@IBVERBS_PRIVATE_34",
    ".popsection",
);

exports! {
    ibv_copy_path_rec_from_kern @ "IBVERBS_1.0" => crate::stubs::stub_void;
    ibv_copy_qp_attr_from_kern @ "IBVERBS_1.0" => crate::stubs::stub_void;
    ibv_create_comp_channel @ "IBVERBS_1.0" => crate::channel::ibv_create_comp_channel;
    ibv_destroy_comp_channel @ "IBVERBS_1.0" => crate::channel::ibv_destroy_comp_channel;
    ibv_get_sysfs_path @ "IBVERBS_1.0" => crate::stubs::ibv_get_sysfs_path;
    ibv_read_sysfs_file @ "IBVERBS_1.0" => crate::stubs::ibv_read_sysfs_file;
    ibv_ack_async_event @ "IBVERBS_1.1" => crate::device::ibv_ack_async_event;
    ibv_ack_cq_events @ "IBVERBS_1.1" => crate::cq::ibv_ack_cq_events;
    ibv_alloc_pd @ "IBVERBS_1.1" => crate::pd::ibv_alloc_pd;
    ibv_attach_mcast @ "IBVERBS_1.1" => crate::stubs::stub_int;
    ibv_close_device @ "IBVERBS_1.1" => crate::context::ibv_close_device;
    ibv_copy_ah_attr_from_kern @ "IBVERBS_1.1" => crate::stubs::stub_void;
    ibv_create_ah @ "IBVERBS_1.1" => crate::ah::ibv_create_ah;
    ibv_create_ah_from_wc @ "IBVERBS_1.1" => crate::stubs::stub_null;
    ibv_create_cq @ "IBVERBS_1.1" => crate::cq::ibv_create_cq;
    ibv_create_qp @ "IBVERBS_1.1" => crate::qp::ibv_create_qp;
    ibv_create_srq @ "IBVERBS_1.1" => crate::srq::ibv_create_srq;
    ibv_dealloc_pd @ "IBVERBS_1.1" => crate::pd::ibv_dealloc_pd;
    ibv_dereg_mr @ "IBVERBS_1.1" => crate::mr::ibv_dereg_mr;
    ibv_destroy_ah @ "IBVERBS_1.1" => crate::ah::ibv_destroy_ah;
    ibv_destroy_cq @ "IBVERBS_1.1" => crate::cq::ibv_destroy_cq;
    ibv_destroy_qp @ "IBVERBS_1.1" => crate::qp::ibv_destroy_qp;
    ibv_destroy_srq @ "IBVERBS_1.1" => crate::srq::ibv_destroy_srq;
    ibv_detach_mcast @ "IBVERBS_1.1" => crate::stubs::stub_int;
    ibv_dofork_range @ "IBVERBS_1.1" => crate::stubs::stub_zero;
    ibv_dontfork_range @ "IBVERBS_1.1" => crate::stubs::stub_zero;
    ibv_fork_init @ "IBVERBS_1.1" => crate::fork::ibv_fork_init;
    ibv_free_device_list @ "IBVERBS_1.1" => crate::device::ibv_free_device_list;
    ibv_get_async_event @ "IBVERBS_1.1" => crate::device::ibv_get_async_event;
    ibv_get_cq_event @ "IBVERBS_1.1" => crate::cq::ibv_get_cq_event;
    ibv_get_device_guid @ "IBVERBS_1.1" => crate::device::ibv_get_device_guid;
    ibv_get_device_list @ "IBVERBS_1.1" => crate::device::ibv_get_device_list;
    ibv_get_device_name @ "IBVERBS_1.1" => crate::device::ibv_get_device_name;
    ibv_modify_qp @ "IBVERBS_1.1" => crate::qp::ibv_modify_qp;
    ibv_modify_srq @ "IBVERBS_1.1" => crate::srq::ibv_modify_srq;
    ibv_open_device @ "IBVERBS_1.1" => crate::ops::ibv_open_device;
    ibv_query_device @ "IBVERBS_1.1" => crate::device::ibv_query_device;
    ibv_query_gid @ "IBVERBS_1.1" => crate::device::ibv_query_gid;
    ibv_query_pkey @ "IBVERBS_1.1" => crate::device::ibv_query_pkey;
    ibv_query_port @ "IBVERBS_1.1" => crate::device::ibv_query_port;
    ibv_query_qp @ "IBVERBS_1.1" => crate::qp::ibv_query_qp;
    ibv_query_srq @ "IBVERBS_1.1" => crate::srq::ibv_query_srq;
    ibv_reg_mr @ "IBVERBS_1.1" => crate::mr::ibv_reg_mr;
    mrkit_query_mr @ "MRKIT_1.0" => crate::ext::mrkit_query_mr;
    ibv_rereg_mr @ "IBVERBS_1.1" => crate::mr::ibv_rereg_mr;
    ibv_resize_cq @ "IBVERBS_1.1" => crate::cq::ibv_resize_cq;
    ibv_resolve_eth_l2_from_gid @ "IBVERBS_1.1" => crate::stubs::stub_int;
    ibv_wc_status_str @ "IBVERBS_1.1" => crate::strings::ibv_wc_status_str;
    ibv_import_device @ "IBVERBS_1.10" => crate::stubs::stub_null;
    ibv_import_mr @ "IBVERBS_1.10" => crate::stubs::stub_null;
    ibv_import_pd @ "IBVERBS_1.10" => crate::stubs::stub_null;
    ibv_query_ece @ "IBVERBS_1.10" => crate::stubs::stub_int;
    ibv_set_ece @ "IBVERBS_1.10" => crate::stubs::stub_int;
    ibv_unimport_mr @ "IBVERBS_1.10" => crate::stubs::stub_void;
    ibv_unimport_pd @ "IBVERBS_1.10" => crate::stubs::stub_void;
    _ibv_query_gid_ex @ "IBVERBS_1.11" => crate::device::_ibv_query_gid_ex;
    _ibv_query_gid_table @ "IBVERBS_1.11" => crate::device::_ibv_query_gid_table;
    ibv_reg_dmabuf_mr @ "IBVERBS_1.12" => crate::stubs::stub_null;
    ibv_import_dm @ "IBVERBS_1.13" => crate::stubs::stub_null;
    ibv_is_fork_initialized @ "IBVERBS_1.13" => crate::fork::ibv_is_fork_initialized;
    ibv_unimport_dm @ "IBVERBS_1.13" => crate::stubs::stub_void;
    ibv_query_qp_data_in_order @ "IBVERBS_1.14" => crate::stubs::stub_zero;
    ibv_get_pkey_index @ "IBVERBS_1.5" => crate::device::ibv_get_pkey_index;
    ibv_qp_to_qp_ex @ "IBVERBS_1.6" => crate::stubs::stub_null;
    ibv_reg_mr_iova2 @ "IBVERBS_1.8" => crate::mr::ibv_reg_mr_iova2;
    ibv_get_device_index @ "IBVERBS_1.9" => crate::device::ibv_get_device_index;
    __verbs_log @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_void;
    _verbs_init_and_alloc_context @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_null;
    execute_ioctl @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_advise_mr @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_alloc_dm @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_alloc_mw @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_alloc_pd @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_attach_mcast @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_close_xrcd @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_ah @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_counters @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_cq_ex @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_flow @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_flow_action_esp @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_qp_ex @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_qp_ex2 @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_rwq_ind_table @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_srq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_srq_ex @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_create_wq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_dealloc_mw @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_dealloc_pd @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_dereg_mr @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_destroy_ah @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_destroy_counters @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_destroy_cq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_destroy_flow @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_destroy_flow_action @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_destroy_qp @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_destroy_rwq_ind_table @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_destroy_srq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_destroy_wq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_detach_mcast @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_free_dm @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_get_context @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_modify_cq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_modify_flow_action_esp @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_modify_qp @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_modify_qp_ex @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_modify_srq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_modify_wq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_open_qp @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_open_xrcd @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_query_context @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_query_device_any @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_query_mr @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_query_port @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_query_qp @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_query_srq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_read_counters @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_reg_dm_mr @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_reg_dmabuf_mr @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_reg_mr @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_rereg_mr @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_cmd_resize_cq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    ibv_query_gid_type @ "IBVERBS_PRIVATE_34" => crate::device::ibv_query_gid_type;
    verbs_init_cq @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_int;
    verbs_open_device @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_null;
    verbs_register_driver_34 @ "IBVERBS_PRIVATE_34" => crate::stubs::verbs_register_driver_34;
    verbs_set_ops @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_void;
    verbs_uninit_context @ "IBVERBS_PRIVATE_34" => crate::stubs::stub_void;
    ibv_event_type_str @ "IBVERBS_1.1" => crate::strings::ibv_event_type_str;
    ibv_node_type_str @ "IBVERBS_1.1" => crate::strings::ibv_node_type_str;
    ibv_port_state_str @ "IBVERBS_1.1" => crate::strings::ibv_port_state_str;
    ibv_reg_mr_iova @ "IBVERBS_1.7" => crate::mr::ibv_reg_mr_iova;
}
