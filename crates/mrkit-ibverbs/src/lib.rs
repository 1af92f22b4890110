//! # mrkit-ibverbs: a drop-in `libibverbs.so.1` over the `mrkit0` software device
//!
//! `cargo build --release -p mrkit-ibverbs` leaves `target/release/libibverbs.so` (SONAME
//! `libibverbs.so.1`) and a `libibverbs.so.1` symlink to it, so that
//! `LD_LIBRARY_PATH=target/release ibv_devinfo` runs the unmodified Debian 12 (rdma-core v44)
//! tools against `mrkit0`. See `docs/ibverbs.md`.
//!
//! Layout, bottom to top (a module names only modules before it in this list, so there is no
//! import cycle; `tests/module_graph.rs` checks it):
//! * [`abi`]: `#[repr(C)]` mirrors of the v44 structures (layout-tested against the headers);
//!   `ffi`: errno, panic containment, bounded struct copies, all-zero C structs; `stubs`: every
//!   exported verb mrkit0 does not implement (EOPNOTSUPP, or NULL + errno; never a crash);
//!   `strings`: the `ibv_*_str` helpers.
//! * `events`: per-context async event queues (the pollable `async_fd`), routing the device's
//!   QP/CQ/SRQ events to the owning context, ack accounting for `ibv_destroy_*`.
//! * `fork`: `ibv_fork_init` / `ibv_is_fork_initialized`.
//! * `context`: the open context (`verbs_context` in front of the library's state), the
//!   process's device instance, `ibv_close_device` and use-after-close protection.
//! * `obj`: how objects are handed to C and recognised again (magic words, the live registry).
//! * The object kinds, one file each: `device` (device list, queries, GID table, async event
//!   verbs), `pd`, `mr`, `channel` (completion channels), `cq` (CQs, `ibv_cq_ex`, CQ events),
//!   `srq`, `ah` (address handles and vectors), `qp`, `post` (post_send/recv/srq_recv), `mw`
//!   (alloc, dealloc, bind).
//! * `ops`: the ops table assembled from the object files, and `ibv_open_device`.
//! * `exports`: the exported names with their version nodes (`ibv_reg_mr@@IBVERBS_1.1`), made
//!   with `.symver` trampolines; the list is [`EXPORTS`].
//!
//! `unsafe` is denied at this root. It is allowed in the modules that implement the C ABI
//! (they dereference pointers from C or are called through them): `ffi`, `events`, `context`,
//! `obj`, `ops`, `exports` (its `global_asm!` trampolines) and the object files `device`, `pd`,
//! `mr`, `channel`, `cq`, `srq`, `ah`, `qp`, `post`, `mw`. `abi`, `stubs`, `strings` and `fork`
//! are safe code. Every `unsafe fn` documents its contract under `# Safety` and every `unsafe`
//! block carries a `// SAFETY:` comment (the lints below).
#![deny(unsafe_code)]
#![warn(clippy::undocumented_unsafe_blocks, clippy::missing_safety_doc)]

/// The v44 ABI definitions, shared with `mrkit`'s rdma-core provider (crate `mrkit-verbs-abi`).
pub use mrkit_verbs_abi as abi;
#[allow(unsafe_code)]
mod ah;
#[allow(unsafe_code)]
mod channel;
#[allow(unsafe_code)]
mod context;
#[allow(unsafe_code)]
mod cq;
#[allow(unsafe_code)]
mod device;
#[allow(unsafe_code)]
mod events;
#[allow(unsafe_code)]
mod exports;
#[allow(unsafe_code)]
mod ext;
#[allow(unsafe_code)]
mod ffi;
mod fork;
#[allow(unsafe_code)]
mod mr;
#[allow(unsafe_code)]
mod mw;
#[allow(unsafe_code)]
mod obj;
#[allow(unsafe_code)]
mod ops;
#[allow(unsafe_code)]
mod pd;
#[allow(unsafe_code)]
mod post;
#[allow(unsafe_code)]
mod qp;
#[allow(unsafe_code)]
mod srq;
mod strings;
mod stubs;

pub use context::post_async_event;
pub use device::DEVICE_NAME;
pub use exports::EXPORTS;
