//! The test kit (feature `testkit`, and this crate's own tests): what tests, fuzzers, the
//! CLI's demo and its benchmarks set up again and again, written once.
//!
//! * [`host`]: hosts on a real device instance (context + PD + CQ + RC QP, optionally a
//!   registered buffer) and connected pairs over the in-process loopback link or over UDP on
//!   127.0.0.0/8;
//! * [`clock`]: the virtual clock, QP engines on a bare [`MemCore`](crate::MemCore) with
//!   packets passed by hand and time advanced explicitly (no device, no thread, no socket):
//!   the fuzzers run on it.
//!
//! It sits in the facade layer: it may use every layer below.
#![deny(unsafe_code)]

#[allow(unsafe_code)] // registering a buffer the test keeps using (`UserMemory::new`)
mod buf_host;
pub mod clock;
pub mod host;

pub use buf_host::{buf_mr, reg};
pub use clock::{VirtualNode, VirtualPair};
pub use host::{BufHost, Host};
