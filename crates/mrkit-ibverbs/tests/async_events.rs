//! Device async events through the C API (`tests/c/async_events.c`, linked against the system
//! libibverbs, run against ours): SRQ limit, LAST_WQE_REACHED on QP → ERR, CQ overflow
//! (CQ_ERR + QP_FATAL), element pointers, `async_fd` poll readiness and O_NONBLOCK/EAGAIN,
//! per-context delivery, acks, and `ibv_destroy_{qp,cq,srq}` waiting for them (plus
//! `ibv_destroy_cq` waiting for `ibv_ack_cq_events`).

mod common;

use common::{compile_c_with, run_with_lib, text};

fn run(scenario: &str) {
    let prog = compile_c_with("async_events.c", true, &["-pthread"]);
    let o = run_with_lib(&prog, &[scenario], &[]);
    let out = text(&o);
    println!("{out}");
    assert!(
        o.status.success() && out.contains("all checks passed"),
        "async_events {scenario} failed:\n{out}"
    );
}

#[test]
fn srq_limit_and_last_wqe_reached_events() {
    run("srq");
}

#[test]
fn cq_overflow_raises_cq_err_then_qp_fatal() {
    run("cq");
}

#[test]
fn unread_events_are_dropped_by_destroy() {
    run("unread");
}

#[test]
fn destroy_cq_waits_for_completion_event_acks() {
    run("comp");
}
