//! In-process RDMA WRITE / READ bandwidth (4 KiB, 64 KiB, 1 MiB) and 8-byte latency over the
//! loopback link with the progress thread, beside memcpy of the same sizes over the same
//! DRAM-resident arenas (offsets rotate across 64 MiB, far beyond the LLC), same run.
//! Run: `cargo bench -p mrkit-soft --bench datapath`.
use std::time::{Duration, Instant};

use mrkit_soft::qp::{rc_connect, QpCap, QpInitAttr, SendWr, WrOpcode};
use mrkit_soft::{AccessFlags as A, Context, DeviceConfig, UserMemory};

const ARENA: usize = 64 << 20;

fn main() {
    let ctx = Context::open(DeviceConfig::rxe());
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4096, None).unwrap();
    let cq2 = ctx.create_cq(16, None).unwrap();
    let cap = QpCap {
        max_send_wr: 512,
        ..QpCap::default()
    };
    let (qa, _) = ctx
        .create_qp(QpInitAttr {
            pd,
            send_cq: cq,
            recv_cq: cq,
            cap,
            sq_sig_all: true,
        })
        .unwrap();
    let (qb, _) = ctx
        .create_qp(QpInitAttr {
            pd,
            send_cq: cq2,
            recv_cq: cq2,
            cap,
            sq_sig_all: false,
        })
        .unwrap();
    let full = A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ;
    rc_connect(&ctx, qa, &ctx, qb, full, 5).unwrap();
    let mut src = vec![0x5Au8; ARENA];
    let mut dst = vec![0u8; ARENA];
    // SAFETY: `src` and `dst` are neither freed nor resized before both MRs are deregistered
    // at the end of `main`. (The memcpy baseline below touches them while no work request is
    // outstanding.)
    let (ms, md) = unsafe {
        (
            ctx.reg_mr_va(
                pd,
                UserMemory::new(src.as_mut_ptr() as u64, ARENA as u64),
                full,
            )
            .unwrap(),
            ctx.reg_mr_va(
                pd,
                UserMemory::new(dst.as_mut_ptr() as u64, ARENA as u64),
                full,
            )
            .unwrap(),
        )
    };
    println!(
        "{:<10} {:>8} {:>12} {:>12} {:>7}",
        "op", "size", "rdma GB/s", "memcpy GB/s", "ratio"
    );
    for &size in &[4096usize, 65536, 1 << 20] {
        let mc = memcpy_bw(&mut src, &mut dst, size);
        for op in [WrOpcode::RdmaWrite, WrOpcode::RdmaRead] {
            let bw = rdma_bw(&ctx, qa, cq, op, &ms, &md, size);
            println!(
                "{:<10} {:>8} {:>12.2} {:>12.2} {:>7.2}",
                format!("{op:?}"),
                size,
                bw,
                mc,
                bw / mc
            );
        }
    }
    // 8-byte latency: one WRITE at a time, wait for its completion.
    let mut wcs = Vec::new();
    let iters = 20_000;
    let t = Instant::now();
    for i in 0..iters {
        let wr = SendWr::new(i, WrOpcode::RdmaWrite)
            .sge(ms.iova, 8, ms.lkey)
            .remote(md.iova, md.rkey);
        ctx.post_send(qa, &[wr]).unwrap();
        loop {
            wcs.clear();
            if ctx.poll_cq(cq, &mut wcs, 1).unwrap() == 1 {
                break;
            }
            std::hint::spin_loop();
        }
    }
    let lat = t.elapsed() / iters as u32;
    let t = Instant::now();
    for i in 0..iters as usize {
        let off = (i * 4096) % (ARENA - 8);
        dst[off..off + 8].copy_from_slice(&src[off..off + 8]);
    }
    let mlat = t.elapsed() / iters as u32;
    println!(
        "8-byte WRITE latency: {:?} (memcpy of 8 bytes: {:?})",
        lat, mlat
    );
    ctx.dereg_mr(ms.lkey).unwrap();
    ctx.dereg_mr(md.lkey).unwrap();
    drop((src, dst));
}

fn memcpy_bw(src: &mut [u8], dst: &mut [u8], size: usize) -> f64 {
    let slots = ARENA / size;
    let total = (512usize << 20).max(size * 64);
    let n = total / size;
    let t = Instant::now();
    for i in 0..n {
        let off = ((i * 7919) % slots) * size;
        dst[off..off + size].copy_from_slice(&src[off..off + size]);
    }
    std::hint::black_box(&dst);
    (n * size) as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn rdma_bw(
    ctx: &Context,
    qp: u32,
    cq: u32,
    op: WrOpcode,
    ms: &mrkit_soft::MrInfo,
    md: &mrkit_soft::MrInfo,
    size: usize,
) -> f64 {
    let slots = ARENA / size;
    let total = (512usize << 20).max(size * 64);
    let n = total / size;
    let depth = (16 << 20) / size;
    let depth = depth.clamp(4, 256);
    let mut wcs = Vec::with_capacity(256);
    let (mut posted, mut done, mut outstanding) = (0usize, 0usize, 0usize);
    let t = Instant::now();
    while done < n {
        while posted < n && outstanding < depth {
            let off = ((posted * 7919) % slots * size) as u64;
            let wr = match op {
                WrOpcode::RdmaRead => SendWr::new(posted as u64, op)
                    .sge(md.iova + off, size as u32, md.lkey)
                    .remote(ms.iova + off, ms.rkey),
                _ => SendWr::new(posted as u64, op)
                    .sge(ms.iova + off, size as u32, ms.lkey)
                    .remote(md.iova + off, md.rkey),
            };
            ctx.post_send(qp, &[wr]).unwrap();
            posted += 1;
            outstanding += 1;
        }
        wcs.clear();
        let k = ctx.poll_cq(cq, &mut wcs, 256).unwrap();
        for w in &wcs {
            assert_eq!(w.status, mrkit_soft::cq::WcStatus::Success);
        }
        done += k;
        outstanding -= k;
        if k == 0 {
            ctx.wait_cq(cq, Duration::from_millis(1)).unwrap();
        }
    }
    (n * size) as f64 / t.elapsed().as_secs_f64() / 1e9
}
