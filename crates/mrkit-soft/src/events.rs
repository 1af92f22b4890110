//! Asynchronous events ([`AsyncEvent`]) and where they go: the device's queue
//! (`Context::get_async_event`) or, once installed, a hook (`Context::set_async_event_hook`,
//! in the driver).
//!
//! mrkit-ibverbs installs a hook so each event reaches the `ibv_context` that owns the QP, CQ
//! or SRQ it names (its `async_fd` becomes readable at once), with no thread polling the
//! queue. The hook runs on the thread that raised the event (the progress thread, or an
//! application thread running progress inline) after the QP's lock was released; it must be
//! quick and must not block.
#![forbid(unsafe_code)]

use std::sync::Arc;

use parking_lot::RwLock;

/// Affiliated and unaffiliated asynchronous events (`enum ibv_event_type` subset).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncEvent {
    /// IBV_EVENT_CQ_ERR (0): a CQ overflowed.
    CqErr {
        /// CQ number.
        cqn: u32,
    },
    /// IBV_EVENT_QP_FATAL (1).
    QpFatal {
        /// QP number.
        qpn: u32,
    },
    /// IBV_EVENT_QP_REQ_ERR (2): invalid request detected as responder (hardware model).
    QpReqErr {
        /// QP number.
        qpn: u32,
    },
    /// IBV_EVENT_QP_ACCESS_ERR (3): rkey violation detected as responder (hardware model).
    QpAccessErr {
        /// QP number.
        qpn: u32,
    },
    /// IBV_EVENT_SQ_DRAINED (5).
    SqDrained {
        /// QP number.
        qpn: u32,
    },
    /// IBV_EVENT_QP_LAST_WQE_REACHED (16): a QP attached to an SRQ entered ERR.
    QpLastWqeReached {
        /// QP number.
        qpn: u32,
    },
    /// IBV_EVENT_SRQ_LIMIT_REACHED (15): an armed SRQ dropped below its limit.
    SrqLimitReached {
        /// SRQ number.
        srqn: u32,
    },
}

/// Receives every asynchronous event of a device instance once installed.
pub type AsyncEventHook = Arc<dyn Fn(AsyncEvent) + Send + Sync>;

/// The installed hook, if any.
#[derive(Default)]
pub(crate) struct HookSlot(pub(crate) RwLock<Option<AsyncEventHook>>);

impl std::fmt::Debug for HookSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("HookSlot")
            .field(&self.0.read().is_some())
            .finish()
    }
}
