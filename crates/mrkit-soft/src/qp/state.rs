//! RC QP state machine: the `ib_modify_qp_is_ok` table for RC and the attribute rules of
//! `docs/semantics.md` §8 (pure functions, table-driven tests in `tests/datapath_state.rs`).
#![forbid(unsafe_code)]

use crate::error::{err, Error};

/// `enum ibv_qp_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum QpState {
    /// 0
    Reset = 0,
    /// 1
    Init = 1,
    /// 2
    Rtr = 2,
    /// 3
    Rts = 3,
    /// 4: send queue drain.
    Sqd = 4,
    /// 5: send queue error (UC; never entered by an RC QP on its own).
    Sqe = 5,
    /// 6
    Err = 6,
}

impl QpState {
    /// All states, in numeric order.
    pub const ALL: [QpState; 7] = [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Sqd,
        QpState::Sqe,
        QpState::Err,
    ];
    /// From the numeric value (values above ERR are EINVAL at modify).
    pub fn from_u32(v: u32) -> Option<QpState> {
        QpState::ALL.get(v as usize).copied()
    }
}

/// `enum ibv_qp_attr_mask` bits.
pub mod attr_mask {
    /// IBV_QP_STATE
    pub const STATE: u32 = 0x1;
    /// IBV_QP_CUR_STATE
    pub const CUR_STATE: u32 = 0x2;
    /// IBV_QP_EN_SQD_ASYNC_NOTIFY
    pub const EN_SQD_ASYNC_NOTIFY: u32 = 0x4;
    /// IBV_QP_ACCESS_FLAGS
    pub const ACCESS_FLAGS: u32 = 0x8;
    /// IBV_QP_PKEY_INDEX
    pub const PKEY_INDEX: u32 = 0x10;
    /// IBV_QP_PORT
    pub const PORT: u32 = 0x20;
    /// IBV_QP_QKEY
    pub const QKEY: u32 = 0x40;
    /// IBV_QP_AV
    pub const AV: u32 = 0x80;
    /// IBV_QP_PATH_MTU
    pub const PATH_MTU: u32 = 0x100;
    /// IBV_QP_TIMEOUT
    pub const TIMEOUT: u32 = 0x200;
    /// IBV_QP_RETRY_CNT
    pub const RETRY_CNT: u32 = 0x400;
    /// IBV_QP_RNR_RETRY
    pub const RNR_RETRY: u32 = 0x800;
    /// IBV_QP_RQ_PSN
    pub const RQ_PSN: u32 = 0x1000;
    /// IBV_QP_MAX_QP_RD_ATOMIC
    pub const MAX_QP_RD_ATOMIC: u32 = 0x2000;
    /// IBV_QP_ALT_PATH
    pub const ALT_PATH: u32 = 0x4000;
    /// IBV_QP_MIN_RNR_TIMER
    pub const MIN_RNR_TIMER: u32 = 0x8000;
    /// IBV_QP_SQ_PSN
    pub const SQ_PSN: u32 = 0x10000;
    /// IBV_QP_MAX_DEST_RD_ATOMIC
    pub const MAX_DEST_RD_ATOMIC: u32 = 0x20000;
    /// IBV_QP_PATH_MIG_STATE
    pub const PATH_MIG_STATE: u32 = 0x40000;
    /// IBV_QP_CAP
    pub const CAP: u32 = 0x80000;
    /// IBV_QP_DEST_QPN
    pub const DEST_QPN: u32 = 0x100000;
    /// IBV_QP_RATE_LIMIT (not supported: EOPNOTSUPP).
    pub const RATE_LIMIT: u32 = 0x2000000;
    /// Bits 0..=20: the standard range.
    pub const STANDARD: u32 = 0x1F_FFFF;
}

use attr_mask as m;

/// `(required, optional)` attribute bits (besides STATE) for an RC transition, or `None` when
/// the transition is not in the table.
pub fn rc_transition(from: QpState, to: QpState) -> Option<(u32, u32)> {
    use QpState::*;
    Some(match (from, to) {
        (Reset, Reset) => (0, 0),
        (Reset, Init) => (m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS, 0),
        (Init, Init) => (0, m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS),
        (Init, Rtr) => (
            m::AV
                | m::PATH_MTU
                | m::DEST_QPN
                | m::RQ_PSN
                | m::MAX_DEST_RD_ATOMIC
                | m::MIN_RNR_TIMER,
            m::ALT_PATH | m::ACCESS_FLAGS | m::PKEY_INDEX,
        ),
        (Rtr, Rts) => (
            m::TIMEOUT | m::RETRY_CNT | m::RNR_RETRY | m::SQ_PSN | m::MAX_QP_RD_ATOMIC,
            m::CUR_STATE | m::ALT_PATH | m::ACCESS_FLAGS | m::MIN_RNR_TIMER | m::PATH_MIG_STATE,
        ),
        (Rts, Rts) => (
            0,
            m::CUR_STATE | m::ACCESS_FLAGS | m::ALT_PATH | m::PATH_MIG_STATE | m::MIN_RNR_TIMER,
        ),
        (Rts, Sqd) => (0, m::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Rts) => (
            0,
            m::CUR_STATE | m::ALT_PATH | m::ACCESS_FLAGS | m::MIN_RNR_TIMER | m::PATH_MIG_STATE,
        ),
        (Sqd, Sqd) => (
            0,
            m::PORT
                | m::AV
                | m::TIMEOUT
                | m::RETRY_CNT
                | m::RNR_RETRY
                | m::MAX_QP_RD_ATOMIC
                | m::MAX_DEST_RD_ATOMIC
                | m::ALT_PATH
                | m::ACCESS_FLAGS
                | m::PKEY_INDEX
                | m::MIN_RNR_TIMER
                | m::PATH_MIG_STATE,
        ),
        (Init | Rtr | Rts | Sqd | Sqe | Err, Reset) => (0, 0),
        (Init | Rtr | Rts | Sqd | Sqe | Err, Err) => (0, 0),
        _ => return None,
    })
}

/// The mask rules of §8: returns the target state or the errno (EINVAL / EOPNOTSUPP).
/// `target` is the raw `qp_state` value (only read when STATE is in the mask).
pub fn check_modify(cur: QpState, mask: u32, target: u32) -> Result<QpState, Error> {
    if mask & !m::STANDARD != 0 {
        return Err(err!(
            EOPNOTSUPP,
            "attribute mask bits {:#x} are outside the standard range (e.g. RATE_LIMIT); mrkit0 \
             does not support them",
            mask & !m::STANDARD
        ));
    }
    let to = if mask & m::STATE != 0 {
        QpState::from_u32(target)
            .ok_or_else(|| err!(EINVAL, "qp_state {target} is not a QP state (0..=6)"))?
    } else {
        cur
    };
    if mask & m::CUR_STATE != 0
        && !matches!(
            cur,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    {
        return Err(err!(
            EINVAL,
            "IBV_QP_CUR_STATE is only legal in RTR, RTS, SQD or SQE (QP is {cur:?})"
        ));
    }
    if mask & m::STATE == 0 && cur == QpState::Reset && mask != 0 {
        return Err(err!(
            EINVAL,
            "a QP in RESET cannot modify attributes without a transition"
        ));
    }
    let (req, opt) = rc_transition(cur, to).ok_or_else(|| {
        err!(
            EINVAL,
            "{cur:?} -> {to:?} is not a legal RC transition (IBA table, docs/semantics.md §8)"
        )
    })?;
    let given = mask & !m::STATE;
    if given & req != req {
        return Err(err!(
            EINVAL,
            "{cur:?} -> {to:?} requires attribute bits {req:#x}; missing {:#x}",
            req & !given
        ));
    }
    if given & !(req | opt) != 0 {
        return Err(err!(
            EINVAL,
            "{cur:?} -> {to:?} does not allow attribute bits {:#x}",
            given & !(req | opt)
        ));
    }
    Ok(to)
}
