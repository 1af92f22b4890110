//! Several QPs on several threads share one CQ: no lost or duplicate completion.
mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::init;
use mrkit_soft::cq::WcStatus;
use mrkit_soft::qp::{rc_connect, SendWr, WrOpcode};
use mrkit_soft::{AccessFlags as A, Context, DeviceConfig, Errno};

#[test]
fn shared_cq_many_threads() {
    const QPS: u64 = 4;
    const PER: u64 = 2000;
    let a = Context::open(DeviceConfig::rxe());
    let b = Context::open(DeviceConfig::rxe());
    let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let cq = a.create_cq(8192, None).unwrap();
    let cqb = b.create_cq(16, None).unwrap();
    let src = vec![1u8; 1 << 16];
    let mut dst = vec![0u8; 1 << 16];
    let ms = a
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pa,
            unsafe { mrkit_soft::UserMemory::new(src.as_ptr() as u64, 1 << 16) },
            A::empty(),
        )
        .unwrap();
    let md = b
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pb,
            unsafe { mrkit_soft::UserMemory::new(dst.as_mut_ptr() as u64, 1 << 16) },
            A::LOCAL_WRITE | A::REMOTE_WRITE,
        )
        .unwrap();
    let mut threads = Vec::new();
    for t in 0..QPS {
        let (qa, _) = a.create_qp(init(pa, cq, true)).unwrap();
        let (qb, _) = b.create_qp(init(pb, cqb, true)).unwrap();
        rc_connect(&a, qa, &b, qb, A::REMOTE_WRITE, 3).unwrap();
        let a = a.clone();
        threads.push(std::thread::spawn(move || {
            for i in 0..PER {
                let len = 1 + ((i * 37) % 5000) as u32;
                let wr = SendWr::new(t << 32 | i, WrOpcode::RdmaWrite)
                    .sge(ms.iova, len, ms.lkey)
                    .remote(md.iova + (t << 12), md.rkey);
                loop {
                    match a.post_send(qa, std::slice::from_ref(&wr)) {
                        Ok(()) => break,
                        Err(e) if e.error.errno() == Errno::ENOMEM => std::thread::yield_now(),
                        Err(e) => panic!("{e}"),
                    }
                }
            }
        }));
    }
    let mut seen = HashSet::new();
    let mut v = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while (seen.len() as u64) < QPS * PER {
        v.clear();
        a.poll_cq(cq, &mut v, 256).unwrap();
        for w in &v {
            assert_eq!(w.status, WcStatus::Success);
            assert!(seen.insert(w.wr_id), "duplicate completion {:#x}", w.wr_id);
        }
        if v.is_empty() {
            a.wait_cq(cq, Duration::from_millis(5)).unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "lost completions: {} of {}",
            seen.len(),
            QPS * PER
        );
    }
    for t in threads {
        t.join().unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    v.clear();
    assert_eq!(a.poll_cq(cq, &mut v, 16).unwrap(), 0, "extra completions");
    assert!(!a.cq_overflowed(cq).unwrap());
}
