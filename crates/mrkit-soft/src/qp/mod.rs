//! RC queue pairs below the driver: the work request and attribute types ([`wr`]), the state
//! machine ([`state`]), the posting rules (`post`), the engine contract and one QP run
//! (`run`), the three sans-IO engines ([`req`], [`resp`], [`comp`]) and connecting two QPs
//! ([`connect`]). The QP verbs themselves (`create_qp`, `modify_qp`, `post_send`, ...) are
//! the driver's (`driver/qp_verbs.rs`).
#![forbid(unsafe_code)]

pub mod comp;
pub mod connect;
#[cfg(test)]
mod dp_tests;
mod modify;
pub(crate) mod post;
pub mod req;
pub mod resp;
#[cfg(test)]
mod retry_tests;
pub(crate) mod run;
pub mod state;
pub mod wr;

pub use connect::rc_connect;
pub(crate) use post::{idle_for_inline, pow2};
pub(crate) use run::{CopyOwner, Notice, Out, QpCtx, QpInner, QpObject, RunHost, LAST_QP};
pub use state::{attr_mask, QpState};
pub(crate) use wr::RecvWqe;
pub use wr::{
    send_flags, AddressVector, BindWr, PostError, QpAttr, QpCap, QpInitAttr, RecvWr, SendWr, Sge,
    WrOpcode,
};
