//! The device and its queries.
//!
//! * One device, `mrkit0`, in a static (it outlives `ibv_free_device_list`, as pyverbs needs),
//!   followed by a NULL pointer at offset 664 (`verbs_device.ops`, read by libmlx5/libefa to
//!   recognise their own devices).
//! * Identity: vendor_id 0xFFFFFF (no vendor; rxe's value; set in `context.rs`), vendor_part_id
//!   0.
//! * Port 1: ACTIVE, Ethernet, max MTU 4096, active MTU by rxe's rule (4096 on loopback), 4X
//!   EDR, LID 0.
//! * GID table: one RoCE v2 entry, the device's UDP address (`MRKIT_ADDR`, or the default
//!   127.x.y.z of this device instance) as an IPv4-mapped GID.
//! * The context's async events: `ibv_get_async_event` / `ibv_ack_async_event`.

use std::cell::UnsafeCell;
use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::abi::*;
use crate::context::{open_context, MrkitContext};
use crate::events::{add_completed, event_type as et};
use crate::ffi::{copy_prefix, einval, guard, set_errno};

/// Name of the device (`ibv_get_device_name`).
pub const DEVICE_NAME: &str = mrkit_soft::DEVICE_NAME;

/// `ibv_device` plus the `verbs_device.ops` word libmlx5/libefa read at offset 664.
#[repr(C)]
pub(crate) struct MrkitDevice {
    pub(crate) dev: ibv_device,
    pub(crate) verbs_device_ops: *const c_void,
    _reserved: [u64; 7],
}

struct StaticDevice(UnsafeCell<MrkitDevice>);
// SAFETY: the device is never written after initialisation (C callers treat it as read-only);
// the cell only exists because C receives a `*mut`.
unsafe impl Sync for StaticDevice {}

const fn cbuf<const N: usize>(s: &str) -> [c_char; N] {
    let b = s.as_bytes();
    let mut a = [0 as c_char; N];
    let mut i = 0;
    while i < b.len() && i + 1 < N {
        a[i] = b[i] as c_char;
        i += 1;
    }
    a
}

static DEVICE: StaticDevice = StaticDevice(UnsafeCell::new(MrkitDevice {
    dev: ibv_device {
        _ops: _ibv_device_ops {
            _dummy1: std::ptr::null(),
            _dummy2: std::ptr::null(),
        },
        node_type: IBV_NODE_CA,
        transport_type: IBV_TRANSPORT_IB,
        name: cbuf("mrkit0"),
        dev_name: cbuf("uverbs0"),
        dev_path: cbuf("/sys/class/infiniband_verbs/uverbs0"),
        ibdev_path: cbuf("/sys/class/infiniband/mrkit0"),
    },
    verbs_device_ops: std::ptr::null(),
    _reserved: [0; 7],
}));

pub(crate) fn device_ptr() -> *mut ibv_device {
    DEVICE.0.get().cast()
}

/// The GID table of port 1 (raw 16-byte GIDs, network order): one entry, the device's RoCEv2
/// UDP address (`MRKIT_ADDR`, or the default 127.x.y.z of this device instance) as an
/// IPv4-mapped GID. Querying it binds the UDP port. Empty if the port cannot be bound.
fn gid_table(m: &MrkitContext) -> Vec<[u8; 16]> {
    match m.soft.query_gid() {
        Ok(g) => vec![g],
        Err(e) => {
            eprintln!("libibverbs (mrkit): {DEVICE_NAME} has no GID: {e}");
            Vec::new()
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Exported functions.

/// `struct ibv_device **ibv_get_device_list(int *num_devices)`.
///
/// # Safety
/// `num` must be NULL or valid for a write.
pub(crate) unsafe extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    guard(std::ptr::null_mut(), || {
        // SAFETY: calloc of 2 pointers; checked for NULL below.
        let list = unsafe { libc::calloc(2, std::mem::size_of::<*mut ibv_device>()) }
            .cast::<*mut ibv_device>();
        if list.is_null() {
            set_errno(libc::ENOMEM);
            return list;
        }
        // SAFETY: list has room for 2 pointers; the second stays NULL (calloc).
        unsafe { *list = device_ptr() };
        if !num.is_null() {
            // SAFETY: caller contract.
            unsafe { *num = 1 };
        }
        list
    })
}

/// `void ibv_free_device_list(struct ibv_device **list)`.
///
/// # Safety
/// `list` must be NULL or a list returned by [`ibv_get_device_list`], not yet freed.
pub(crate) unsafe extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: allocated with calloc in ibv_get_device_list (free(NULL) is a no-op).
    unsafe { libc::free(list.cast()) }
}

/// `const char *ibv_get_device_name(struct ibv_device *device)`.
///
/// # Safety
/// `device` must be NULL or a device from [`ibv_get_device_list`].
pub(crate) unsafe extern "C" fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char {
    if device.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null();
    }
    // SAFETY: device points to a live ibv_device (ours is static).
    unsafe { (*device).name.as_ptr() }
}

/// `__be64 ibv_get_device_guid(struct ibv_device *device)`.
///
/// # Safety
/// `device` must be NULL or a device from [`ibv_get_device_list`].
pub(crate) unsafe extern "C" fn ibv_get_device_guid(_device: *mut ibv_device) -> u64 {
    mrkit_soft::DeviceConfig::rxe().attr().node_guid.to_be()
}

/// `int ibv_get_device_index(struct ibv_device *device)`.
///
/// # Safety
/// `device` must be NULL or a device from [`ibv_get_device_list`].
pub(crate) unsafe extern "C" fn ibv_get_device_index(device: *mut ibv_device) -> c_int {
    if device == device_ptr() {
        0
    } else {
        -1
    }
}

fn device_attr(m: &MrkitContext) -> ibv_device_attr {
    let a = m.soft.query_device();
    let i = |v: u32| v.min(i32::MAX as u32) as c_int;
    ibv_device_attr {
        fw_ver: cbuf(&a.fw_ver),
        node_guid: a.node_guid.to_be(),
        sys_image_guid: a.sys_image_guid.to_be(),
        max_mr_size: a.max_mr_size,
        page_size_cap: a.page_size_cap,
        vendor_id: a.vendor_id,
        vendor_part_id: a.vendor_part_id,
        hw_ver: a.hw_ver,
        max_qp: i(a.max_qp),
        max_qp_wr: i(a.max_qp_wr),
        device_cap_flags: a.device_cap_flags as c_uint,
        max_sge: i(a.max_sge),
        max_sge_rd: i(a.max_sge_rd),
        max_cq: i(a.max_cq),
        max_cqe: i(a.max_cqe),
        max_mr: i(a.max_mr),
        max_pd: i(a.max_pd),
        max_qp_rd_atom: i(a.max_qp_rd_atom),
        max_ee_rd_atom: 0,
        max_res_rd_atom: i(a.max_res_rd_atom),
        max_qp_init_rd_atom: i(a.max_qp_init_rd_atom),
        max_ee_init_rd_atom: 0,
        atomic_cap: i(a.atomic_cap),
        max_ee: 0,
        max_rdd: 0,
        max_mw: i(a.max_mw),
        max_raw_ipv6_qp: 0,
        max_raw_ethy_qp: 0,
        max_mcast_grp: 0,
        max_mcast_qp_attach: 0,
        max_total_mcast_qp_attach: 0,
        max_ah: 32767,
        max_fmr: 0,
        max_map_per_fmr: 0,
        max_srq: i(a.max_srq),
        max_srq_wr: i(a.max_srq_wr),
        max_srq_sge: i(a.max_srq_sge),
        max_pkeys: a.max_pkeys,
        local_ca_ack_delay: a.local_ca_ack_delay,
        phys_port_cnt: a.phys_port_cnt,
    }
}

fn device_attr_ex(m: &MrkitContext) -> ibv_device_attr_ex {
    let a = m.soft.query_device();
    ibv_device_attr_ex {
        orig_attr: device_attr(m),
        comp_mask: 0,
        odp_caps: ibv_odp_caps {
            general_caps: a.odp_general_caps,
            per_transport_caps: ibv_odp_transport_caps {
                rc_odp_caps: if a.odp_general_caps != 0 {
                    a.odp_rc_caps
                } else {
                    0
                },
                uc_odp_caps: 0,
                ud_odp_caps: 0,
            },
        },
        completion_timestamp_mask: 0,
        hca_core_clock: 0,
        device_cap_flags_ex: a.device_cap_flags,
        tso_caps: Default::default(),
        rss_caps: Default::default(),
        max_wq_type_rq: 0,
        packet_pacing_caps: Default::default(),
        raw_packet_caps: 0,
        tm_caps: Default::default(),
        cq_mod_caps: Default::default(),
        max_dm_size: 0,
        pci_atomic_caps: Default::default(),
        xrc_odp_caps: 0,
        phys_port_cnt_ex: u32::from(a.phys_port_cnt),
    }
}

/// `int ibv_query_device(struct ibv_context *, struct ibv_device_attr *)`.
///
/// # Safety
/// `ctx` must be NULL or an open context; `attr` NULL or valid for a write.
pub(crate) unsafe extern "C" fn ibv_query_device(
    ctx: *mut ibv_context,
    attr: *mut ibv_device_attr,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { open_context(ctx) }) else {
        return einval();
    };
    if attr.is_null() {
        return einval();
    }
    guard(libc::EIO, || {
        let v = device_attr(m);
        // SAFETY: attr is valid for a full ibv_device_attr (caller contract).
        unsafe { attr.write(v) };
        0
    })
}

/// `verbs_context.query_device_ex`: `(ctx, input, attr, attr_size)`; copies
/// `min(attr_size, 400)` bytes.
///
/// # Safety
/// `ctx` an open context; `input` NULL or valid; `attr` valid for `attr_size` bytes.
pub(crate) unsafe extern "C" fn vctx_query_device_ex(
    ctx: *mut ibv_context,
    input: *const ibv_query_device_ex_input,
    attr: *mut ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { open_context(ctx) }) else {
        return einval();
    };
    // SAFETY: input is NULL or valid (caller contract).
    if !input.is_null() && unsafe { (*input).comp_mask } != 0 {
        return einval();
    }
    if attr.is_null() || attr_size < std::mem::size_of::<ibv_device_attr>() {
        return einval();
    }
    guard(libc::EIO, || {
        let v = device_attr_ex(m);
        // SAFETY: attr is valid for attr_size bytes (caller contract).
        unsafe { copy_prefix(&v, attr, attr_size) };
        0
    })
}

/// Port 1 as `ibv_port_attr`: mrkit-soft's `query_port` (one definition of mrkit0's port,
/// shared with the Rust API), converted field by field.
fn port_attr(m: &MrkitContext) -> ibv_port_attr {
    let p = m.soft.query_port(1).unwrap_or_default();
    ibv_port_attr {
        state: p.state,
        max_mtu: p.max_mtu,
        active_mtu: p.active_mtu,
        gid_tbl_len: p.gid_tbl_len as c_int,
        port_cap_flags: p.port_cap_flags,
        max_msg_sz: p.max_msg_sz,
        bad_pkey_cntr: p.bad_pkey_cntr,
        qkey_viol_cntr: p.qkey_viol_cntr,
        pkey_tbl_len: p.pkey_tbl_len,
        lid: p.lid,
        sm_lid: p.sm_lid,
        lmc: p.lmc,
        max_vl_num: p.max_vl_num,
        sm_sl: p.sm_sl,
        subnet_timeout: p.subnet_timeout,
        init_type_reply: p.init_type_reply,
        active_width: p.active_width,
        active_speed: p.active_speed,
        phys_state: p.phys_state,
        link_layer: p.link_layer,
        flags: p.flags,
        port_cap_flags2: p.port_cap_flags2,
    }
}

/// `verbs_context.query_port`: `(ctx, port, attr, attr_len)`; copies `min(attr_len, 52)`.
///
/// # Safety
/// `ctx` an open context; `attr` valid for `len` bytes.
pub(crate) unsafe extern "C" fn vctx_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
    len: usize,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { open_context(ctx) }) else {
        return einval();
    };
    if port != 1 || attr.is_null() {
        return einval();
    }
    let v = port_attr(m);
    // SAFETY: attr valid for len bytes (caller contract).
    unsafe { copy_prefix(&v, attr, len) };
    0
}

/// Exported `ibv_query_port@IBVERBS_1.1`: the compat entry that fills only the 48-byte prefix
/// (`struct _compat_ibv_port_attr`).
///
/// # Safety
/// `ctx` an open context; `attr` valid for 48 bytes.
pub(crate) unsafe extern "C" fn ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut ibv_port_attr,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { vctx_query_port(ctx, port, attr, COMPAT_PORT_ATTR_LEN) }
}

fn gid_at(m: &MrkitContext, port: u32, index: i64) -> Option<[u8; 16]> {
    if port != 1 || index < 0 {
        return None;
    }
    gid_table(m).get(index as usize).copied()
}

/// `int ibv_query_gid(struct ibv_context *, uint8_t port, int index, union ibv_gid *gid)`:
/// 0, or -1 with errno EINVAL.
///
/// # Safety
/// `ctx` an open context; `gid` valid for 16 bytes.
pub(crate) unsafe extern "C" fn ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut ibv_gid,
) -> c_int {
    // SAFETY: caller contract.
    let m = unsafe { open_context(ctx) }.filter(|_| !gid.is_null());
    match m.and_then(|m| gid_at(m, u32::from(port), i64::from(index))) {
        Some(raw) => {
            // SAFETY: gid valid for a write (caller contract).
            unsafe { gid.write(ibv_gid { raw }) };
            0
        }
        None => {
            set_errno(libc::EINVAL);
            -1
        }
    }
}

/// `int ibv_query_gid_type(struct ibv_context *, uint8_t port, unsigned int index,
/// enum ibv_gid_type_sysfs *type)` (IBVERBS_PRIVATE_34, used by ibv_devinfo): RoCE v2.
///
/// # Safety
/// `ctx` an open context; `ty` valid for a write.
pub(crate) unsafe extern "C" fn ibv_query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: c_uint,
    ty: *mut c_int,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { open_context(ctx) }) else {
        return einval();
    };
    if ty.is_null() || gid_at(m, u32::from(port), i64::from(index)).is_none() {
        return einval();
    }
    // SAFETY: ty valid for a write.
    unsafe { ty.write(IBV_GID_TYPE_SYSFS_ROCE_V2) };
    0
}

fn gid_entry(index: u32, raw: [u8; 16]) -> ibv_gid_entry {
    ibv_gid_entry {
        gid: ibv_gid { raw },
        gid_index: index,
        port_num: 1,
        gid_type: IBV_GID_TYPE_ROCE_V2,
        ndev_ifindex: 0,
    }
}

/// `int _ibv_query_gid_ex(ctx, uint32_t port, uint32_t index, struct ibv_gid_entry *,
/// uint32_t flags, size_t entry_size)`: 0 or an errno value.
///
/// # Safety
/// `ctx` an open context; `entry` valid for `entry_size` bytes.
pub(crate) unsafe extern "C" fn _ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { open_context(ctx) }) else {
        return einval();
    };
    if entry.is_null() || flags != 0 {
        return einval();
    }
    let Some(raw) = gid_at(m, port, i64::from(index)) else {
        return einval();
    };
    // SAFETY: entry valid for entry_size bytes.
    unsafe { copy_prefix(&gid_entry(index, raw), entry, entry_size) };
    0
}

/// `ssize_t _ibv_query_gid_table(ctx, struct ibv_gid_entry *entries, size_t max_entries,
/// uint32_t flags, size_t entry_size)`: number of entries, or a negative errno.
///
/// # Safety
/// `ctx` an open context; `entries` valid for `max_entries * entry_size` bytes.
pub(crate) unsafe extern "C" fn _ibv_query_gid_table(
    ctx: *mut ibv_context,
    entries: *mut ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { open_context(ctx) }) else {
        return -(libc::EINVAL as isize);
    };
    if flags != 0 || entry_size < std::mem::size_of::<ibv_gid_entry>() {
        return -(libc::EINVAL as isize);
    }
    let table = gid_table(m);
    if max_entries < table.len() || entries.is_null() {
        return -(libc::EINVAL as isize);
    }
    for (i, raw) in table.iter().enumerate() {
        // SAFETY: entry i lies inside the caller's max_entries * entry_size bytes.
        let dst = unsafe { entries.cast::<u8>().add(i * entry_size) }.cast::<ibv_gid_entry>();
        // SAFETY: dst valid for entry_size >= 32 bytes (checked), possibly unaligned.
        unsafe { dst.write_unaligned(gid_entry(i as u32, *raw)) };
    }
    table.len() as isize
}

/// `int ibv_query_pkey(ctx, uint8_t port, int index, __be16 *pkey)`: the default P_Key 0xffff
/// at index 0; -1 with errno EINVAL otherwise.
///
/// # Safety
/// `ctx` an open context; `pkey` valid for a write.
pub(crate) unsafe extern "C" fn ibv_query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    // SAFETY: caller contract.
    if unsafe { open_context(ctx) }.is_none() || port != 1 || index != 0 || pkey.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: pkey valid for a write.
    unsafe { pkey.write(0xffffu16.to_be()) };
    0
}

/// `int ibv_get_pkey_index(ctx, uint8_t port, __be16 pkey)`.
///
/// # Safety
/// `ctx` an open context.
pub(crate) unsafe extern "C" fn ibv_get_pkey_index(
    ctx: *mut ibv_context,
    port: u8,
    pkey: u16,
) -> c_int {
    // SAFETY: caller contract.
    if unsafe { open_context(ctx) }.is_some() && port == 1 && u16::from_be(pkey) | 0x8000 == 0xffff
    {
        0
    } else {
        set_errno(libc::EINVAL);
        -1
    }
}

/// `int ibv_get_async_event(ctx, struct ibv_async_event *event)`: blocks on the context's
/// eventfd (unless the application made it non-blocking: then -1 with EAGAIN). `element` is
/// the application's `ibv_qp*` / `ibv_cq*` / `ibv_srq*`; the event counts as reported for that
/// object (its destroy waits for the matching [`ibv_ack_async_event`]).
///
/// # Safety
/// `ctx` an open context; `event` valid for a write.
pub(crate) unsafe extern "C" fn ibv_get_async_event(
    ctx: *mut ibv_context,
    event: *mut ibv_async_event,
) -> c_int {
    // SAFETY: caller contract.
    let Some(m) = (unsafe { open_context(ctx) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    if event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    match m.events.get() {
        Ok(ev) => {
            // SAFETY: event valid for a write.
            unsafe { event.write(ev) };
            0
        }
        Err(()) => -1, // errno from read (EAGAIN when non-blocking)
    }
}

/// `void ibv_ack_async_event(struct ibv_async_event *event)`: as libibverbs, by event type:
/// `++cq->async_events_completed` (CQ_ERR), `++qp->events_completed` (QP events),
/// `++srq->events_completed` (SRQ events), each under the object's mutex with its cond
/// signalled (a pending `ibv_destroy_*` waits for it); other types need no ack.
///
/// # Safety
/// `event` NULL or an event returned by [`ibv_get_async_event`] whose object was not
/// destroyed (it cannot be: its destroy waits for this ack).
pub(crate) unsafe extern "C" fn ibv_ack_async_event(event: *mut ibv_async_event) {
    if event.is_null() {
        return;
    }
    // SAFETY: a valid event (caller contract).
    let ev = unsafe { *event };
    if ev.element == 0 {
        return;
    }
    let p = ev.element as usize;
    // (mutex, cond, counter) of the object the event type names, by field offset (the
    // element is the application's ibv_cq / ibv_qp / ibv_srq).
    let (mutex, cond, counter) = match ev.event_type {
        et::CQ_ERR => (
            std::mem::offset_of!(ibv_cq, mutex),
            std::mem::offset_of!(ibv_cq, cond),
            std::mem::offset_of!(ibv_cq, async_events_completed),
        ),
        et::QP_FATAL
        | et::QP_REQ_ERR
        | et::QP_ACCESS_ERR
        | et::COMM_EST
        | et::SQ_DRAINED
        | et::PATH_MIG
        | et::PATH_MIG_ERR
        | et::QP_LAST_WQE_REACHED => (
            std::mem::offset_of!(ibv_qp, mutex),
            std::mem::offset_of!(ibv_qp, cond),
            std::mem::offset_of!(ibv_qp, events_completed),
        ),
        et::SRQ_ERR | et::SRQ_LIMIT_REACHED => (
            std::mem::offset_of!(ibv_srq, mutex),
            std::mem::offset_of!(ibv_srq, cond),
            std::mem::offset_of!(ibv_srq, events_completed),
        ),
        _ => return,
    };
    // SAFETY: the element is the live object of the kind the event type names (caller
    // contract), so the offsets of that type's fields address its initialised mutex and cond
    // (zero = the static initialisers) and its counter, which is only written under the mutex.
    unsafe {
        add_completed(
            (p + mutex) as *mut libc::pthread_mutex_t,
            (p + cond) as *mut libc::pthread_cond_t,
            (p + counter) as *mut u32,
            1,
        )
    }
}
