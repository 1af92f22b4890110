//! # mrkit-ibverbs: a drop-in `libibverbs.so.1` over the `mrkit0` software device
//!
//! `cargo build --release -p mrkit-ibverbs` leaves `target/release/libibverbs.so` (SONAME
//! `libibverbs.so.1`) and a `libibverbs.so.1` symlink to it, so that
//! `LD_LIBRARY_PATH=target/release ibv_devinfo` runs the unmodified Debian 12 (rdma-core v44)
//! tools against `mrkit0`. See `docs/ibverbs.md`.
//!
//! Layout:
//! * [`abi`]: `#[repr(C)]` mirrors of the v44 structures (layout-tested against the headers).
//! * `exports`: the exported names with their version nodes (`ibv_reg_mr@@IBVERBS_1.1`), made
//!   with `.symver` trampolines; the list is [`EXPORTS`].
//! * `device`: the device list, contexts (`verbs_context` in front of `ibv_context`), queries,
//!   GID table, `ibv_get_async_event` / `ibv_ack_async_event`.
//! * `events`: per-context async event queues (the pollable `async_fd`), routing the device's
//!   QP/CQ/SRQ events to the owning context, ack accounting for `ibv_destroy_*`.
//! * `verbs`: PD, MR (reg/rereg/dereg), MW, fork support, string helpers.
//! * `dp`: completion channels, CQs (and `ibv_cq_ex`), RC QPs, SRQs, AHs, and the `ctx->ops`
//!   data-path entry points (post_send/recv, post_srq_recv, poll_cq, req_notify_cq, bind_mw).
//! * `stubs`: every other exported verb: fails with EOPNOTSUPP (or NULL + errno), never crashes.
//!
//! This is the only crate of the workspace with FFI `unsafe` code; every `unsafe fn` documents
//! its contract under `# Safety` and every `unsafe` block carries a `// SAFETY:` comment.
#![warn(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

pub mod abi;
mod device;
mod dp;
mod events;
mod exports;
mod ext;
mod ffi;
mod stubs;
mod verbs;

pub use device::{post_async_event, DEVICE_NAME};
pub use exports::EXPORTS;
