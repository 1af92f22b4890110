//! # mrkit-soft: the software RDMA device `mrkit0`
//!
//! `mrkit0` plays both the RDMA NIC (HCA) and its kernel driver, in user space. The crate is
//! layered, bottom to top (no module uses one above it; `tests/layers.rs` checks it):
//!
//! * leaves: [`device`] (attributes, limits and profiles, rxe model by default, every limit
//!   configurable by builder or `MRKIT_*` environment variables), [`events`], [`addr`],
//!   [`fault`], [`wire`] (RoCEv2 headers and ICRC), [`mem`] (real page pinning, RLIMIT_MEMLOCK
//!   accounting, the page walk, DONTFORK), [`table`] (index + generation keys, two-phase
//!   publish, drain-before-free), [`stats`];
//! * the memory core: [`MemCore`] with [`pd`], [`mr`] (registration with the kernel's
//!   validation order and errnos; **the** access predicate every data path goes through),
//!   [`mw`] (memory windows type 1 and 2) and [`odp`];
//! * the sans-IO engines: [`qp`] (requester, responder, completer, one QP run), [`srq`],
//!   [`cq`], [`pkt`];
//! * the link: [`net`] (RoCEv2 over UDP);
//! * the driver: [`driver`] ([`Context`] and its verbs, the progress thread, caller-thread
//!   execution, the loopback link);
//! * this facade, which only declares and re-exports; beside it, with the feature `testkit`,
//!   the test kit (hosts, connected pairs, the virtual clock that runs the engines without a
//!   device) and the fuzz bodies that run on it.
//!
//! ```
//! use std::sync::Arc;
//! use mrkit_soft::{AccessFlags, Context, DeviceConfig, UserMemory};
//! let ctx = Context::open(DeviceConfig::rxe());
//! let pd = ctx.alloc_pd().unwrap();
//! // The MR keeps the buffer alive until it is deregistered (or use `unsafe UserMemory::new`).
//! let buf = Arc::new(vec![0u8; 8192]);
//! let mr = ctx
//!     .reg_mr_va(pd, UserMemory::owned(buf.clone()),
//!                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
//!     .unwrap();
//! assert_eq!(mr.lkey, mr.rkey);
//! ctx.dereg_mr(mr.lkey).unwrap();
//! ctx.dealloc_pd(pd).unwrap();
//! ```

#![deny(unsafe_code)]

// Layers, bottom to top (docs/architecture.md; `tests/layers.rs` keeps every `use crate::…`
// pointing down): leaves, the memory core, the sans-IO engines, the link, the driver, and
// this facade.
pub mod access;
pub mod addr;
#[allow(unsafe_code)] // moving bytes into and out of registered memory
mod copy;
pub mod counters;
pub mod cq;
pub mod device;
pub mod driver;
pub mod error;
pub mod events;
pub mod fault;
#[cfg(any(test, feature = "testkit"))]
pub mod fuzz;
mod last_used;
#[allow(unsafe_code)] // system calls on raw addresses, the fault-recovering copy
pub mod mem;
pub mod memcore;
pub mod mr;
pub mod mw;
pub mod net;
pub mod odp;
pub mod pd;
pub mod pkt;
pub mod probes;
pub mod qp;
pub mod reg_timing;
pub mod srq;
pub mod stat_export;
pub mod stats;
pub mod table;
#[cfg(any(test, feature = "testkit"))]
pub mod testkit;
#[allow(unsafe_code)] // `UserMemory::new`: the registration contract
pub mod user_mem;
pub mod wire;

pub use access::AccessFlags;
pub use device::{DeviceAttr, DeviceConfig, PortAttr, StatusModel};
pub use driver::{progress, Context, DeviceInner, ResourceCounts};
pub use error::{Errno, Error, Result};
pub use memcore::MemCore;
pub use mr::{MrInfo, ReregFlags};
pub use mw::MwType;
pub use net::sockio;
pub use user_mem::{OwnedMemory, UserMemory};

/// Name of the embedded device.
pub const DEVICE_NAME: &str = "mrkit0";

/// Devices this library provides (`ibv_get_device_list`).
///
/// ```
/// assert_eq!(mrkit_soft::device_list(), vec!["mrkit0"]);
/// ```
pub fn device_list() -> Vec<&'static str> {
    vec![DEVICE_NAME]
}
