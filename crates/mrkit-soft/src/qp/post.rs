//! Posting rules: the post-time checks of a send work request, and when a post runs the
//! requester on the caller's thread.
#![forbid(unsafe_code)]

use super::req;
use super::{
    send_flags, PostError, QpCap, QpInner, QpObject, QpState, RecvWqe, RecvWr, SendWr, WrOpcode,
};
use crate::error::{err, Result};

/// `v` rounded up to a power of two (0 stays 0): how `max_rd_atomic` and `max_dest_rd_atomic`
/// are stored.
pub(crate) fn pow2(v: u32) -> u32 {
    if v == 0 {
        0
    } else {
        v.next_power_of_two()
    }
}

pub(crate) fn validate_send(wr: &SendWr, cap: &QpCap) -> Result<req::Wqe> {
    use WrOpcode as O;
    if wr.sg_list.len() as u32 > cap.max_send_sge && wr.flags & send_flags::INLINE == 0 {
        return Err(err!(
            EINVAL,
            "{} SGEs > max_send_sge {}",
            wr.sg_list.len(),
            cap.max_send_sge
        ));
    }
    let len = wr.total_len();
    if len > 1 << 31 {
        return Err(err!(
            EINVAL,
            "message of {len} bytes exceeds max_msg_sz 2^31"
        ));
    }
    let inline = wr.flags & send_flags::INLINE != 0;
    if wr.opcode.is_atomic() {
        if len != 8 {
            return Err(err!(
                EINVAL,
                "atomics need exactly 8 bytes of local result buffer, got {len}"
            ));
        }
        if wr.remote_addr % 8 != 0 {
            return Err(err!(
                EINVAL,
                "atomic remote address {:#x} is not 8-byte aligned",
                wr.remote_addr
            ));
        }
    }
    if inline {
        if !matches!(
            wr.opcode,
            O::Send | O::SendWithImm | O::SendWithInv | O::RdmaWrite | O::RdmaWriteWithImm
        ) {
            return Err(err!(EINVAL, "{:?} cannot be INLINE", wr.opcode));
        }
        if len > u64::from(cap.max_inline_data) {
            return Err(err!(
                EINVAL,
                "inline message of {len} bytes > max_inline_data {}",
                cap.max_inline_data
            ));
        }
        // The bytes of an inline message are `inline_data`; a gather list with bytes beside
        // an empty `inline_data` would silently send an empty message (this API cannot read
        // raw addresses the way `ibv_post_send` copies an inline gather list).
        if wr.inline_data.is_empty() && wr.sg_list.iter().any(|s| s.length > 0) {
            return Err(err!(
                EINVAL,
                "INLINE with an empty inline_data but a gather list: put the bytes in inline_data"
            ));
        }
    }
    if wr.opcode == O::BindMw && (!wr.sg_list.is_empty() || wr.imm_data != 0 || wr.bind.is_none()) {
        return Err(err!(
            EINVAL,
            "BIND_MW takes no SGEs and no immediate, and needs bind info"
        ));
    }
    if wr.opcode == O::LocalInv && !wr.sg_list.is_empty() {
        return Err(err!(EINVAL, "LOCAL_INV takes no SGEs"));
    }
    Ok(req::Wqe::from_wr(wr, len, inline))
}

/// Whether `post_send` runs the requester on the caller's thread: the send queue is empty, or
/// holds one message already sent that waits for its ACK. The second case is request/response
/// traffic with delayed ACKs (`held_acks::ACK_DELAY_MAX`): the peer's ACK of this side's last
/// reply travels behind its next request, so the reply to that request is posted before the ACK
/// of the previous one is processed; scheduling it instead cost a progress pass (~2.4 µs of a
/// SEND echo). More than one WQE queued is a stream, whose packets the next progress pass sends
/// together (one GSO send per run): running each post inline sends each message on its own
/// (4 KiB WRITEs with 64 in flight fell from ~2.9 to ~1.1 GB/s).
pub(crate) fn idle_for_inline(sq: &req::SendQueue) -> bool {
    sq.cursor == sq.q.len() && sq.q.len() <= 1
}

/// `ibv_post_send`'s queueing on a locked QP: each WR in turn gets the post-time checks (state
/// RESET/INIT/RTR → EINVAL, [`validate_send`], send queue full → ENOMEM) and joins the send
/// queue; the WRs before the failing one stay posted. Running the QP is the caller's.
pub(crate) fn push_sends(g: &mut QpInner, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
    for (i, wr) in wrs.iter().enumerate() {
        let fail = |error| PostError { bad_wr: i, error };
        if matches!(g.state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(fail(err!(
                EINVAL,
                "post_send on a QP in {:?}; move it to RTS first",
                g.state
            )));
        }
        let wqe = validate_send(wr, &g.attr.cap).map_err(fail)?;
        if g.sq.q.len() as u32 >= g.attr.cap.max_send_wr {
            return Err(fail(err!(
                ENOMEM,
                "send queue full ({} WRs outstanding); poll the CQ or raise max_send_wr",
                g.attr.cap.max_send_wr
            )));
        }
        g.sq.q.push_back(wqe);
    }
    Ok(())
}

/// `ibv_post_recv`'s queueing on a locked QP: RESET → EINVAL, a QP on an SRQ → EINVAL, too
/// many SGEs → EINVAL, receive queue full → ENOMEM; the WRs before the failing one stay
/// posted. Also returns whether a WR was posted in ERR (the caller schedules the QP, whose
/// next run flushes it).
pub(crate) fn push_recvs(
    q: &QpObject,
    g: &mut QpInner,
    wrs: &[RecvWr],
) -> (std::result::Result<(), PostError>, bool) {
    let qpn = q.qpn;
    let mut flushed = false;
    let res = (|| {
        for (i, wr) in wrs.iter().enumerate() {
            let fail = |error| PostError { bad_wr: i, error };
            if q.srq.is_some() {
                return Err(fail(err!(
                    EINVAL,
                    "QP {qpn} takes receives from an SRQ; use post_srq_recv"
                )));
            }
            if g.state == QpState::Reset {
                return Err(fail(err!(
                    EINVAL,
                    "post_recv on a QP in RESET; move it to INIT first"
                )));
            }
            if wr.sg_list.len() as u32 > g.attr.cap.max_recv_sge {
                return Err(fail(err!(
                    EINVAL,
                    "{} SGEs > max_recv_sge {}",
                    wr.sg_list.len(),
                    g.attr.cap.max_recv_sge
                )));
            }
            if g.rq.len() as u32 >= g.attr.cap.max_recv_wr {
                return Err(fail(err!(
                    ENOMEM,
                    "receive queue full ({})",
                    g.attr.cap.max_recv_wr
                )));
            }
            g.rq.push_back(RecvWqe {
                wr_id: wr.wr_id,
                sges: wr.sg_list.clone(),
            });
            flushed |= g.state == QpState::Err;
        }
        Ok(())
    })();
    (res, flushed)
}

#[cfg(test)]
mod inline_tests {
    use super::req::{SendQueue, Wqe};
    use super::*;

    #[test]
    fn post_send_runs_inline_only_on_an_idle_or_answering_queue() {
        // (WQEs queued, of which started) -> inline
        let table = [
            ((0, 0), true),  // empty
            ((1, 1), true),  // the last reply, sent, waiting for its (delayed) ACK
            ((1, 0), false), // one not yet sent: the requester is busy (a retry, a window)
            ((2, 2), false), // a stream in flight: the next pass batches
            ((3, 1), false),
        ];
        for ((queued, started), want) in table {
            let mut sq = SendQueue::default();
            for _ in 0..queued {
                sq.q.push_back(Wqe::new(SendWr::new(1, WrOpcode::Send), 8, false));
            }
            sq.cursor = started;
            assert_eq!(
                idle_for_inline(&sq),
                want,
                "{queued} queued, {started} started"
            );
        }
    }

    #[test]
    fn inline_post_time_rules() {
        let cap = QpCap::default(); // max_inline_data 64
        let inline = |op, bytes: usize, sge_len: Option<u32>| {
            let mut w = SendWr::new(1, op).flags(send_flags::INLINE | send_flags::SIGNALED);
            w.inline_data = vec![7; bytes];
            if let Some(l) = sge_len {
                w = w.sge(0x1000, l, 5);
            }
            w
        };
        use WrOpcode as O;
        // (WR, accepted at post)
        let table = [
            (inline(O::Send, 8, None), true),
            (inline(O::Send, 8, Some(8)), true), // the libibverbs shape: bytes + gather list
            (inline(O::RdmaWrite, 64, None), true),
            (inline(O::Send, 0, None), true), // a zero-length message
            (inline(O::Send, 0, Some(0)), true), // ... with a zero-length SGE
            (inline(O::Send, 65, None), false), // > max_inline_data
            (inline(O::RdmaRead, 8, None), false),
            (inline(O::AtomicFetchAndAdd, 8, None), false),
            // The bytes left in the gather list: would send an empty message.
            (inline(O::Send, 0, Some(8)), false),
            (inline(O::RdmaWrite, 0, Some(8)), false),
        ];
        for (i, (wr, ok)) in table.into_iter().enumerate() {
            match validate_send(&wr, &cap) {
                Ok(_) => assert!(ok, "row {i} accepted"),
                Err(e) => {
                    assert!(!ok, "row {i}: {e}");
                    assert_eq!(e.errno(), crate::Errno::EINVAL, "row {i}");
                }
            }
        }
    }
}
