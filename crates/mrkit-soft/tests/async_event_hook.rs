//! `Context::set_async_event_hook` (`events.rs`): events already queued are handed to a new
//! hook, later events go to the hook instead of the queue, and removing the hook brings the
//! queue back. Self-contained, manual progress.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use mrkit_soft::driver::loopback::drive_until_idle;
use mrkit_soft::events::AsyncEventHook;
use mrkit_soft::progress::AsyncEvent;
use mrkit_soft::qp::{attr_mask as m, rc_connect, QpAttr, QpCap, QpInitAttr, QpState};
use mrkit_soft::{AccessFlags as A, Context, DeviceConfig};

#[test]
fn hook_receives_queued_and_new_events_and_can_be_removed() {
    let c = Context::open(DeviceConfig::rxe());
    c.set_manual_progress();
    let pd = c.alloc_pd().unwrap();
    let cq = c.create_cq(16, None).unwrap();
    let (srq, _) = c
        .create_srq(
            pd,
            mrkit_soft::srq::SrqAttr {
                max_wr: 4,
                max_sge: 1,
                srq_limit: 0,
            },
        )
        .unwrap();
    let init = QpInitAttr {
        pd,
        send_cq: cq,
        recv_cq: cq,
        cap: QpCap::default(),
        sq_sig_all: false,
    };
    let (q1, _) = c.create_qp_srq(init, srq).unwrap();
    let (q2, _) = c.create_qp(init).unwrap();
    let (q3, _) = c.create_qp_srq(init, srq).unwrap();
    let access = A::LOCAL_WRITE | A::REMOTE_WRITE;
    rc_connect(&c, q1, &c, q2, access, 3).unwrap();
    let err = QpAttr {
        qp_state: QpState::Err as u32,
        ..QpAttr::default()
    };
    // Before any hook: queued.
    c.modify_qp(q1, &err, m::STATE).unwrap();
    drive_until_idle(&[&c]);

    let seen: Arc<Mutex<Vec<AsyncEvent>>> = Arc::default();
    let s = seen.clone();
    let hook: AsyncEventHook = Arc::new(move |e| s.lock().unwrap().push(e));
    c.set_async_event_hook(Some(hook));
    assert_eq!(
        *seen.lock().unwrap(),
        vec![AsyncEvent::QpLastWqeReached { qpn: q1 }],
        "the queued event is handed over"
    );
    // With the hook: delivered to it, not queued.
    let init_attr = QpAttr {
        qp_state: QpState::Init as u32,
        port_num: 1,
        ..QpAttr::default()
    };
    c.modify_qp(
        q3,
        &init_attr,
        m::STATE | m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS,
    )
    .unwrap();
    c.modify_qp(q3, &err, m::STATE).unwrap();
    drive_until_idle(&[&c]);
    assert_eq!(
        seen.lock().unwrap().last(),
        Some(&AsyncEvent::QpLastWqeReached { qpn: q3 })
    );
    assert_eq!(c.get_async_event(Duration::ZERO), None, "nothing queued");

    // Hook removed: queued again.
    c.set_async_event_hook(None);
    c.modify_qp(q2, &err, m::STATE).unwrap();
    let reset = QpAttr::default();
    c.modify_qp(q1, &reset, m::STATE).unwrap();
    c.modify_qp(
        q1,
        &init_attr,
        m::STATE | m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS,
    )
    .unwrap();
    c.modify_qp(q1, &err, m::STATE).unwrap();
    drive_until_idle(&[&c]);
    assert_eq!(
        c.get_async_event(Duration::ZERO),
        Some(AsyncEvent::QpLastWqeReached { qpn: q1 })
    );
    assert_eq!(seen.lock().unwrap().len(), 2);
}
