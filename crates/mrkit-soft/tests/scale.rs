//! Scale: 20,000 RC QPs between two device instances of one process over real UDP sockets
//! (each binds its own 127.x address), each QP with one WRITE in flight: every WRITE completes
//! successfully, every byte lands, in bounded time, on 2 vCPUs. Before, about 8,000 such QPs
//! ended mostly in RETRY_EXC_ERR: the receive buffer overflowed, every retransmission timer
//! fired in the same tick, and every QP opened its own send socket (one file descriptor per
//! QP source port).
mod common;

use std::time::{Duration, Instant};

use common::all;
use mrkit_soft::cq::{Wc, WcStatus};
use mrkit_soft::net::udp::MAX_TX_SOCKETS;
use mrkit_soft::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
use mrkit_soft::qp::{QpCap, QpInitAttr, SendWr, WrOpcode};
use mrkit_soft::{Context, DeviceConfig};

const QPS: usize = 20_000;
/// Bytes per WRITE.
const LEN: usize = 64;

struct Side {
    ctx: Context,
    cq: u32,
    qps: Vec<u32>,
    buf: Vec<u8>,
    lkey: u32,
    rkey: u32,
}

impl Drop for Side {
    fn drop(&mut self) {
        // Before the buffer is freed; if deregistration fails the buffer is leaked instead.
        if self.ctx.dereg_mr(self.lkey).is_err() {
            std::mem::forget(std::mem::take(&mut self.buf));
        }
    }
}

fn side() -> Side {
    let ctx = Context::open(DeviceConfig::default());
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(QPS as u32 + 16, None).unwrap();
    let cap = QpCap {
        max_send_wr: 1,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qps = (0..QPS)
        .map(|_| {
            ctx.create_qp(QpInitAttr {
                pd,
                send_cq: cq,
                recv_cq: cq,
                cap,
                sq_sig_all: true,
            })
            .unwrap()
            .0
        })
        .collect();
    let buf = vec![0u8; QPS * LEN];
    // SAFETY: the vector moves into `Side`, whose `Drop` deregisters the MR before the vector
    // is freed, and nothing resizes it.
    let mem = unsafe { mrkit_soft::UserMemory::new(buf.as_ptr() as u64, buf.len() as u64) };
    let mr = ctx.reg_mr_va(pd, mem, all()).unwrap();
    Side {
        ctx,
        cq,
        qps,
        buf,
        lkey: mr.lkey,
        rkey: mr.rkey,
    }
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

#[test]
fn twenty_thousand_qps_each_with_a_write_in_flight_all_complete() {
    let fds0 = open_fds();
    let mut a = side();
    let b = side();
    let (ipa, ipb) = (
        a.ctx.udp_port().unwrap().local_addr().ip(),
        b.ctx.udp_port().unwrap().local_addr().ip(),
    );
    let opts = ConnectOpts::default(); // perftest's: timeout 14 (≈ 67 ms), retry_cnt 7
    let t0 = Instant::now();
    for (&qa, &qb) in a.qps.iter().zip(&b.qps) {
        let to_b = RemoteQp {
            qpn: qb,
            psn: 0,
            ip: Some(ipb),
            node: 0,
        };
        let to_a = RemoteQp {
            qpn: qa,
            psn: 0,
            ip: Some(ipa),
            node: 0,
        };
        connect_qp(&a.ctx, qa, to_b, opts).unwrap();
        connect_qp(&b.ctx, qb, to_a, opts).unwrap();
    }
    let setup = t0.elapsed();
    for (i, x) in a.buf.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(13).wrapping_add(1);
    }
    let t1 = Instant::now();
    let base_a = a.buf.as_ptr() as u64;
    let base_b = b.buf.as_ptr() as u64;
    for (i, &qa) in a.qps.iter().enumerate() {
        let off = (i * LEN) as u64;
        let wr = SendWr::new(i as u64, WrOpcode::RdmaWrite)
            .sge(base_a + off, LEN as u32, a.lkey)
            .remote(base_b + off, b.rkey);
        a.ctx.post_send(qa, &[wr]).unwrap();
    }
    let mut wcs: Vec<Wc> = Vec::with_capacity(QPS);
    let end = Instant::now() + Duration::from_secs(300);
    while wcs.len() < QPS && Instant::now() < end {
        let want = QPS - wcs.len();
        if a.ctx.poll_cq(a.cq, &mut wcs, want.min(256)).unwrap() == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let took = t1.elapsed();
    let failed: Vec<&Wc> = wcs
        .iter()
        .filter(|w| w.status != WcStatus::Success)
        .collect();
    let fds = open_fds().saturating_sub(fds0);
    eprintln!(
        "{QPS} QPs: setup {setup:?}, {} WRITEs completed in {took:?} ({} failed), {fds} fds, \
         a {:?}, b {:?}",
        wcs.len(),
        failed.len(),
        a.ctx.net_stats(),
        b.ctx.net_stats()
    );
    assert_eq!(wcs.len(), QPS, "every WRITE completes within 300 s");
    assert!(
        failed.is_empty(),
        "{} failed, e.g. {:?}",
        failed.len(),
        &failed[..failed.len().min(4)]
    );
    assert!(a.buf == b.buf, "every byte landed");
    assert!(
        fds < 1024,
        "{fds} file descriptors for {QPS} QPs on two devices: QPs must not need one each"
    );
    for s in [&a, &b] {
        let n = s.ctx.udp_port().unwrap().tx_sockets();
        assert!(n <= MAX_TX_SOCKETS + 8, "{n} send sockets");
    }
}
