//! Shared helpers for the data-path tests: the test kit's hosts (device instance, PD, CQ, RC
//! QP) on the loopback link with manual progress or the progress thread, or on the UDP link
//! (RoCEv2 over real sockets) each with one registered buffer (`mrkit_soft::testkit::host`).
#![allow(dead_code, unused_imports)]

pub use mrkit_soft::testkit::host::*;
pub use mrkit_soft::testkit::{buf_mr, reg};
