//! The `ibv_*_str` helpers with rdma-core's texts.

use std::ffi::{c_char, c_int, CStr};

/// `table[i]`, or "unknown" outside it (or where the table has no text): rdma-core's
/// `*_str` helpers.
fn table_str(table: &'static [Option<&'static CStr>], i: c_int) -> *const c_char {
    usize::try_from(i)
        .ok()
        .and_then(|i| table.get(i).copied().flatten())
        .unwrap_or(c"unknown")
        .as_ptr()
}

/// Texts of `ibv_wc_status_str`, indexed by `enum ibv_wc_status`.
static WC_STATUS_STR: [Option<&CStr>; 24] = [
    Some(c"success"),
    Some(c"local length error"),
    Some(c"local QP operation error"),
    Some(c"local EE context operation error"),
    Some(c"local protection error"),
    Some(c"Work Request Flushed Error"),
    Some(c"memory management operation error"),
    Some(c"bad response error"),
    Some(c"local access error"),
    Some(c"remote invalid request error"),
    Some(c"remote access error"),
    Some(c"remote operation error"),
    Some(c"transport retry counter exceeded"),
    Some(c"RNR retry counter exceeded"),
    Some(c"local RDD violation error"),
    Some(c"remote invalid RD request"),
    Some(c"aborted error"),
    Some(c"invalid EE context number"),
    Some(c"invalid EE context state"),
    Some(c"fatal error"),
    Some(c"response timeout error"),
    Some(c"general error"),
    Some(c"TM error"),
    Some(c"TM software rendezvous"),
];

/// `const char *ibv_wc_status_str(enum ibv_wc_status)`.
pub(crate) extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    table_str(&WC_STATUS_STR, status)
}

/// Texts of `ibv_node_type_str`, indexed by `enum ibv_node_type`.
static NODE_TYPE_STR: [Option<&CStr>; 8] = [
    None,
    Some(c"InfiniBand channel adapter"),
    Some(c"InfiniBand switch"),
    Some(c"InfiniBand router"),
    Some(c"iWARP NIC"),
    Some(c"usNIC"),
    Some(c"usNIC UDP"),
    Some(c"unspecified"),
];

/// `const char *ibv_node_type_str(enum ibv_node_type)`.
pub(crate) extern "C" fn ibv_node_type_str(t: c_int) -> *const c_char {
    table_str(&NODE_TYPE_STR, t)
}

/// Texts of `ibv_port_state_str`, indexed by `enum ibv_port_state`.
static PORT_STATE_STR: [Option<&CStr>; 6] = [
    Some(c"no state change (NOP)"),
    Some(c"down"),
    Some(c"init"),
    Some(c"armed"),
    Some(c"active"),
    Some(c"active defer"),
];

/// `const char *ibv_port_state_str(enum ibv_port_state)`.
pub(crate) extern "C" fn ibv_port_state_str(s: c_int) -> *const c_char {
    table_str(&PORT_STATE_STR, s)
}

/// Texts of `ibv_event_type_str`, indexed by `enum ibv_event_type`.
static EVENT_TYPE_STR: [Option<&CStr>; 20] = [
    Some(c"CQ error"),
    Some(c"local work queue catastrophic error"),
    Some(c"invalid request local work queue error"),
    Some(c"local access violation work queue error"),
    Some(c"communication established"),
    Some(c"send queue drained"),
    Some(c"path migrated"),
    Some(c"path migration request error"),
    Some(c"local catastrophic error"),
    Some(c"port active"),
    Some(c"port error"),
    Some(c"LID change"),
    Some(c"P_Key change"),
    Some(c"SM change"),
    Some(c"SRQ catastrophic error"),
    Some(c"SRQ limit reached"),
    Some(c"last WQE reached"),
    Some(c"client reregistration"),
    Some(c"GID table change"),
    Some(c"WQ fatal"),
];

/// `const char *ibv_event_type_str(enum ibv_event_type)`.
pub(crate) extern "C" fn ibv_event_type_str(e: c_int) -> *const c_char {
    table_str(&EVENT_TYPE_STR, e)
}
