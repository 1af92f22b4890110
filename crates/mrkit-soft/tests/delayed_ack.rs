//! Delayed ACKs on the UDP link (`held_acks::ACK_DELAY_MAX`): a plain ACK an application
//! progress pass holds back leaves within the bound even if the application never sends
//! again, and at once when the QP is destroyed or the device closed. Deterministic: manual
//! progress, and the application's passes get an injected `now`.
mod common;

use std::time::{Duration, Instant};

use common::{all, connect_udp, ctx_with, host_with_cap, BufHost};
use mrkit_soft::cq::{Wc, WcOpcode, WcStatus};
use mrkit_soft::driver::held_acks::ACK_DELAY_MAX;
use mrkit_soft::qp::connect::ConnectOpts;
use mrkit_soft::qp::{attr_mask, QpAttr, QpCap, QpState, RecvWr, SendWr, WrOpcode};
use mrkit_soft::DeviceConfig;

/// A host with a 4 KiB buffer on a device with `cfg`, in manual-progress mode if `manual`.
fn host_on(cfg: DeviceConfig, manual: bool) -> BufHost {
    host_with_cap(ctx_with(cfg, manual), 64, QpCap::default(), false).with_buf(4096, all())
}

fn host() -> BufHost {
    host_on(DeviceConfig::rxe().delayed_acks(true), true)
}

fn pair() -> (BufHost, BufHost) {
    let a = host();
    let b = host();
    connect_udp(&a, &b, ConnectOpts::default());
    (a, b)
}

fn tx(h: &BufHost) -> u64 {
    h.ctx.net_stats().tx_datagrams
}

/// Run `pass` until `h`'s CQ yields a completion (packets take a moment to cross the sockets).
fn until_wc(h: &BufHost, mut pass: impl FnMut()) -> Wc {
    let end = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while Instant::now() < end {
        pass();
        h.ctx.poll_cq(h.cq, &mut out, 1).unwrap();
        if let Some(wc) = out.pop() {
            return wc;
        }
        std::thread::yield_now();
    }
    panic!("no completion within 10 s: {:?}", h.ctx.net_stats());
}

/// Post one 64-byte receive on `b`.
fn post_recv(b: &BufHost) {
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 7,
                sg_list: b.sge(0, 64),
            }],
        )
        .unwrap();
}

/// `a` SENDs 8 bytes to `b`, whose application pass (at `t0`) receives it.
fn send_one(a: &BufHost, b: &BufHost, t0: Instant) {
    post_recv(b);
    let mut s = SendWr::new(1, WrOpcode::Send);
    s.sg_list = a.sge(0, 8);
    a.ctx.post_send(a.qp, &[s]).unwrap();
    a.ctx.progress_once(Instant::now());
    let wc = until_wc(b, || {
        b.ctx.progress_once_as_app(t0);
    });
    assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Recv));
}

/// As [`send_one`], and `b` holds the ACK.
fn send_and_hold(a: &BufHost, b: &BufHost, t0: Instant) {
    send_one(a, b, t0);
    assert_eq!(b.ctx.held_ack_count(), 1, "the ACK is held back");
}

fn send_completes(a: &BufHost) {
    let wc = until_wc(a, || {
        a.ctx.progress_once(Instant::now());
    });
    assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::Send));
}

#[test]
fn held_ack_leaves_within_the_bound_when_the_application_stops_sending() {
    let (a, b) = pair();
    let t0 = Instant::now();
    send_and_hold(&a, &b, t0);
    let sent = tx(&b);
    // Younger than the bound: still held.
    b.ctx
        .progress_once_as_app(t0 + ACK_DELAY_MAX - Duration::from_micros(1));
    assert_eq!(b.ctx.held_ack_count(), 1);
    assert_eq!(tx(&b), sent);
    // The first application pass at the bound sends it, though the application sends nothing.
    b.ctx.progress_once_as_app(t0 + ACK_DELAY_MAX);
    assert_eq!(b.ctx.held_ack_count(), 0);
    assert_eq!(tx(&b), sent + 1);
    send_completes(&a);

    // That ACK waited for nothing (b never answered): b's next ACKs on this QP leave at once.
    send_one(&a, &b, t0 + 2 * ACK_DELAY_MAX);
    assert_eq!(
        b.ctx.held_ack_count(),
        0,
        "not held after one that waited in vain"
    );
    assert_eq!(tx(&b), sent + 2);
    send_completes(&a);
}

#[test]
fn held_ack_leaves_with_the_next_send() {
    let (a, b) = pair();
    a.ctx
        .post_recv(
            a.qp,
            &[RecvWr {
                wr_id: 8,
                sg_list: a.sge(64, 64),
            }],
        )
        .unwrap();
    let t0 = Instant::now();
    send_and_hold(&a, &b, t0);
    let sent = tx(&b);
    // b replies: its SEND leaves, and the held ACK right after it (two datagrams).
    let mut s = SendWr::new(2, WrOpcode::Send);
    s.sg_list = b.sge(0, 8);
    b.ctx.post_send(b.qp, &[s]).unwrap();
    b.ctx.progress_once_as_app(t0);
    assert_eq!(b.ctx.held_ack_count(), 0);
    assert_eq!(tx(&b), sent + 2);
    let mut got = Vec::new();
    let end = Instant::now() + Duration::from_secs(10);
    while got.len() < 2 && Instant::now() < end {
        a.ctx.progress_once(Instant::now());
        a.ctx.poll_cq(a.cq, &mut got, 2).unwrap();
    }
    let mut ops: Vec<_> = got.iter().map(|w| (w.status, w.opcode)).collect();
    ops.sort_by_key(|o| o.1 as u32);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(
        ops.contains(&(WcStatus::Success, WcOpcode::Send)),
        "{ops:?}"
    );
    assert!(
        ops.contains(&(WcStatus::Success, WcOpcode::Recv)),
        "{ops:?}"
    );
}

#[test]
fn held_ack_is_flushed_at_destroy_qp() {
    let (a, b) = pair();
    send_and_hold(&a, &b, Instant::now());
    let sent = tx(&b);
    b.ctx.destroy_qp(b.qp).unwrap();
    assert_eq!(b.ctx.held_ack_count(), 0);
    assert_eq!(tx(&b), sent + 1);
    send_completes(&a);
}

#[test]
fn held_ack_is_flushed_when_the_device_closes() {
    let (a, b) = pair();
    send_and_hold(&a, &b, Instant::now());
    drop(b); // the last Context of b's device: ibv_close_device
    send_completes(&a);
}

#[test]
fn progress_thread_pass_flushes_held_acks() {
    let (a, b) = pair();
    send_and_hold(&a, &b, Instant::now());
    b.ctx.progress_once(Instant::now());
    assert_eq!(
        b.ctx.held_ack_count(),
        0,
        "the progress thread's pass sends it"
    );
    send_completes(&a);
}

#[test]
fn held_ack_is_flushed_at_modify_qp() {
    let (a, b) = pair();
    send_and_hold(&a, &b, Instant::now());
    let sent = tx(&b);
    let attr = QpAttr {
        qp_state: QpState::Err as u32,
        ..QpAttr::default()
    };
    b.ctx.modify_qp(b.qp, &attr, attr_mask::STATE).unwrap();
    assert_eq!(b.ctx.held_ack_count(), 0);
    assert_eq!(tx(&b), sent + 1);
    send_completes(&a);
}

#[test]
fn rnr_nak_is_never_held() {
    let (a, b) = pair();
    // No receive posted at b: the SEND gets an RNR NAK, which leaves at once.
    let mut s = SendWr::new(1, WrOpcode::Send);
    s.sg_list = a.sge(0, 8);
    a.ctx.post_send(a.qp, &[s]).unwrap();
    a.ctx.progress_once(Instant::now());
    let t0 = Instant::now();
    let sent = tx(&b);
    let end = Instant::now() + Duration::from_secs(10);
    while tx(&b) == sent && Instant::now() < end {
        b.ctx.progress_once_as_app(t0);
    }
    assert_eq!(
        tx(&b),
        sent + 1,
        "RNR NAK sent by the pass that produced it"
    );
    assert_eq!(b.ctx.held_ack_count(), 0);
}

#[test]
fn on_by_default() {
    assert!(DeviceConfig::rxe().uses_delayed_acks());
    assert!(DeviceConfig::connectx5_seed().uses_delayed_acks());
}

#[test]
fn off_every_ack_leaves_at_once() {
    let mk = || host_on(DeviceConfig::rxe().delayed_acks(false), true);
    let (a, b) = (mk(), mk());
    connect_udp(&a, &b, ConnectOpts::default());
    let sent = tx(&b);
    send_one(&a, &b, Instant::now());
    assert_eq!(
        b.ctx.held_ack_count(),
        0,
        "hardware behaviour: nothing held"
    );
    assert_eq!(tx(&b), sent + 1, "the ACK left in the same pass");
    send_completes(&a);
}

/// Environment variable that makes [`exiting_receiver_role`] play the receiver.
const EXIT_CHILD: &str = "MRKIT_TEST_DELAYED_ACK_EXIT_CHILD";

/// Not a test on its own: the child process of
/// [`receiver_exiting_right_after_its_receive_still_acks`] (does nothing unless [`EXIT_CHILD`]
/// is set). It receives one SEND through its application's `poll_cq`, checks that the ACK is
/// held, and exits with `std::process::exit` without destroying anything.
#[test]
fn exiting_receiver_role() {
    use std::io::{BufRead, Write};
    if std::env::var_os(EXIT_CHILD).is_none() {
        return;
    }
    // Default configuration (delayed ACKs on). Manual progress driven as the application's
    // poll_cq drives it: with a progress thread, that thread sometimes receives the SEND
    // first and ACKs it at once, and there is then nothing held to test.
    let b = host_on(DeviceConfig::rxe(), true);
    let ip = common::udp_ip(&b);
    println!("@QP {ip} {}", b.qp);
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();
    let mut it = line.split_whitespace();
    let peer_ip: std::net::IpAddr = it.next().unwrap().parse().unwrap();
    let peer_qpn: u32 = it.next().unwrap().parse().unwrap();
    connect_for_exit(&b, peer_ip, peer_qpn);
    post_recv(&b);
    println!("@READY");
    std::io::stdout().flush().unwrap();
    let wc = until_wc(&b, || {
        b.ctx.progress_once_as_app(Instant::now());
    });
    assert_eq!(wc.status, WcStatus::Success);
    println!("@HELD {}", b.ctx.held_ack_count());
    std::io::stdout().flush().unwrap();
    // As a program that is done would: no destroy_qp, no close.
    std::process::exit(0);
}

/// Connect `h`'s QP to the peer's, with [`exit_opts`].
fn connect_for_exit(h: &BufHost, ip: std::net::IpAddr, qpn: u32) {
    let remote = mrkit_soft::qp::connect::RemoteQp {
        qpn,
        psn: 0,
        ip: Some(ip),
        node: 0,
    };
    mrkit_soft::qp::connect::connect_qp(&h.ctx, h.qp, remote, exit_opts()).unwrap();
}

/// One retry after a 1.07 s timeout: a lost ACK fails the sender within ~2.2 s. (A 17 ms
/// timeout failed under CI load: the child, descheduled, had not even received the SEND
/// before the sender gave up.)
fn exit_opts() -> ConnectOpts {
    ConnectOpts {
        timeout: 18,
        retry_cnt: 1,
        ..ConnectOpts::default()
    }
}

/// On a ConnectX the responder's ACK has left before the receiver's application sees the
/// completion, so a receiver that exits right after its last receive still completes its
/// peer's send. With delayed ACKs that ACK is held in the receiver's process: it must leave at
/// `exit` (the `atexit` handler), else the sender fails with RETRY_EXC_ERR.
#[test]
fn receiver_exiting_right_after_its_receive_still_acks() {
    use std::io::{BufRead, Write};
    use std::process::{Command, Stdio};
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "exiting_receiver_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(EXIT_CHILD, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut expect = |prefix: &str| -> String {
        for l in lines.by_ref() {
            let l = l.unwrap();
            // libtest may print "test exiting_receiver_role ... " on the same line first.
            if let Some(at) = l.find(prefix) {
                return l[at + prefix.len()..].trim().to_string();
            }
        }
        panic!("the child ended before printing {prefix:?}");
    };
    let child_qp = expect("@QP ");
    let mut it = child_qp.split_whitespace();
    let child_ip: std::net::IpAddr = it.next().unwrap().parse().unwrap();
    let child_qpn: u32 = it.next().unwrap().parse().unwrap();
    let a = host_on(DeviceConfig::rxe(), false);
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{} {}", common::udp_ip(&a), a.qp).unwrap();
    stdin.flush().unwrap();
    connect_for_exit(&a, child_ip, child_qpn);
    expect("@READY");
    let mut s = SendWr::new(1, WrOpcode::Send);
    s.sg_list = a.sge(0, 8);
    a.ctx.post_send(a.qp, &[s]).unwrap();
    let held: usize = expect("@HELD ").parse().unwrap();
    assert_eq!(
        held, 1,
        "the child held its ACK when it exited (else this tests nothing)"
    );
    assert!(child.wait().unwrap().success());
    let wc = until_wc(&a, || {}); // the progress thread runs
    assert_eq!(
        (wc.status, wc.opcode),
        (WcStatus::Success, WcOpcode::Send),
        "the exiting receiver's ACK must reach the sender"
    );
}
