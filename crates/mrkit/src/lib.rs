//! # mrkit: RDMA memory registration done right
//!
//! A safe Rust API over RDMA devices. The embedded software device `mrkit0`
//! ([`mrkit_soft`]) is the default provider: no NIC, no kernel module, no root.
//!
//! * [`Context::open`] opens `mrkit0`; [`Context::alloc_pd`] gives a [`ProtectionDomain`].
//! * [`Context::devices`] and [`Context::open_by_name`] also reach the devices of the system's
//!   rdma-core (`libibverbs.so.1`, loaded at run time: [`rdma_core`]); `MRKIT_DEVICE` picks the
//!   device [`Context::open_default`] opens. Everything below works on either provider.
//! * [`ProtectionDomain::register`] registers a [`Buffer`] it then *owns*: the buffer cannot be
//!   freed or reused while registered, and dropping the [`MemoryRegion`] deregisters first.
//! * [`ProtectionDomain::register_raw`] is the `unsafe` escape hatch for memory you manage.
//! * Errors are [`Error`]: the errno a real HCA would give plus a sentence with the fix.
//!
//! ```
//! use mrkit::{AccessFlags, Buffer, Context};
//! let ctx = Context::open_default().unwrap();
//! let pd = ctx.alloc_pd().unwrap();
//! let mr = pd
//!     .register(Buffer::new(64 << 10).unwrap(), AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
//!     .unwrap();
//! assert_eq!(mr.lkey(), mr.rkey());
//! // A classic mistake, caught with the errno ibv_reg_mr gives:
//! let err = pd.register(Buffer::new(4096).unwrap(), AccessFlags::REMOTE_WRITE).unwrap_err();
//! assert_eq!(err.errno(), mrkit::Errno::EINVAL);
//! ```

#![deny(unsafe_code)]

#[allow(unsafe_code)] // the mapping behind a `Buffer`
pub mod buffer;
pub mod cache;
pub mod pool;
pub mod provider;
pub mod qp;
#[allow(unsafe_code)] // calls into the C ABI of the loaded libibverbs
pub mod rdma_core;
pub mod stat_export;
#[allow(unsafe_code)] // `register_raw`, and the buffer an MR owns
mod verbs;

pub use buffer::{Buffer, BufferOptions};
pub use mrkit_soft::mr::{MrInfo, MrKind};
pub use mrkit_soft::mw::{BindInfo, MwInfo};
pub use mrkit_soft::qp::{QpCap, QpState};
pub use mrkit_soft::{
    AccessFlags, DeviceAttr, DeviceConfig, Errno, Error, MwType, Result, StatusModel,
};
pub use provider::{DeviceAttrEx, PortAttr, Provider, RegCounts};
pub use qp::endpoint::{ConnectOpts, Endpoint, Mtu};
pub use qp::registered::{DeviceWritable, Registered};
pub use qp::tcp;
pub use qp::{
    Completion, CompletionError, Owned, PostRefused, QueuePair, RawHandles, Ticket, WcError,
    WcOpcode, WcStatus, WorkCompletion,
};
pub use verbs::{
    Context, DeviceEntry, LocalSlice, MemoryRegion, MemoryWindow, ProtectionDomain,
    RawMemoryRegion, RemoteSlice, DEVICE_ENV, EMBEDDED_PROVIDER,
};
