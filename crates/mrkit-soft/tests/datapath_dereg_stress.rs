//! Dereg while WRITEs stream in: after dereg returns, no byte of that memory is written.
//! The target region sits between PROT_NONE guard pages, with canary bytes just outside the
//! registered range.
mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::init_cap;
use mrkit_soft::cq::WcStatus;
use mrkit_soft::qp::{rc_connect, QpCap, SendWr, WrOpcode};
use mrkit_soft::{AccessFlags as A, Context, DeviceConfig};
use rustix::mm::{mmap_anonymous, mprotect, MapFlags, MprotectFlags, ProtFlags};

#[test]
fn no_byte_touched_after_dereg() {
    for round in 0..5 {
        run(round);
    }
}

fn run(round: u64) {
    let page = 4096usize;
    let region = 256 * 1024;
    let total = region + 2 * page;
    // SAFETY: fresh anonymous mapping owned by this test, never unmapped (leaked on purpose
    // so a stray late write could only hit this test's memory).
    let base = unsafe {
        mmap_anonymous(
            std::ptr::null_mut(),
            total,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE,
        )
    }
    .unwrap() as *mut u8;
    unsafe {
        mprotect(base.cast(), page, MprotectFlags::empty()).unwrap();
        mprotect(base.add(page + region).cast(), page, MprotectFlags::empty()).unwrap();
    }
    let mem = unsafe { std::slice::from_raw_parts_mut(base.add(page), region) };
    mem.fill(0xC5); // canaries everywhere, registered range is [64, region-64)
    let reg_off = 64usize;
    let reg_len = region - 128;

    let a = Context::open(DeviceConfig::rxe());
    let b = Context::open(DeviceConfig::rxe());
    let (pa, pb) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let (ca, cb) = (
        a.create_cq(4096, None).unwrap(),
        b.create_cq(16, None).unwrap(),
    );
    let cap = QpCap {
        max_send_wr: 256,
        ..QpCap::default()
    };
    let (qa, _) = a.create_qp(init_cap(pa, ca, cap, true)).unwrap();
    let (qb, _) = b.create_qp(init_cap(pb, cb, cap, false)).unwrap();
    rc_connect(&a, qa, &b, qb, A::REMOTE_WRITE, 5).unwrap();
    let src = vec![0xAAu8; 16 * 1024];
    let ms = a
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pa,
            unsafe { mrkit_soft::UserMemory::new(src.as_ptr() as u64, src.len() as u64) },
            A::empty(),
        )
        .unwrap();
    let mt = b
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pb,
            unsafe {
                mrkit_soft::UserMemory::new(mem.as_ptr() as u64 + reg_off as u64, reg_len as u64)
            },
            A::LOCAL_WRITE | A::REMOTE_WRITE,
        )
        .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    // Set by the streamer once a WRITE completes with an error (the dereg took effect).
    let failed = Arc::new(AtomicBool::new(false));
    // Set by the streamer once a WRITE completed successfully (the stream is flowing).
    let landed = Arc::new(AtomicBool::new(false));
    let (a2, stop2, failed2, landed2) = (a.clone(), stop.clone(), failed.clone(), landed.clone());
    let (iova, rkey, lkey, siova) = (mt.iova, mt.rkey, ms.lkey, ms.iova);
    let streamer = std::thread::spawn(move || {
        let mut statuses = Vec::new();
        let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ round;
        let mut wcs = Vec::new();
        let mut outstanding = 0usize;
        while !stop2.load(Ordering::Relaxed) {
            while outstanding < 64 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let len = 1 + (seed % 16384) as u32;
                let off = (seed >> 20) % (reg_len as u64 - u64::from(len) + 1);
                let wr = SendWr::new(seed, WrOpcode::RdmaWrite)
                    .sge(siova, len, lkey)
                    .remote(iova + off, rkey);
                a2.post_send(qa, &[wr]).unwrap();
                outstanding += 1;
            }
            wcs.clear();
            let n = a2.poll_cq(ca, &mut wcs, 64).unwrap();
            outstanding -= n;
            statuses.extend(wcs.iter().map(|w| w.status));
            if wcs.iter().any(|w| w.status != WcStatus::Success) {
                failed2.store(true, Ordering::Relaxed);
            } else if n > 0 {
                landed2.store(true, Ordering::Relaxed);
            }
            if n == 0 {
                std::thread::yield_now();
            }
        }
        statuses
    });
    // Deregister mid-stream: once WRITEs are landing (on a loaded 2-vCPU machine the first
    // completion can take far longer than the usual few milliseconds), plus a little more.
    let t = Instant::now();
    while !landed.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(10));
    b.dereg_mr(mt.lkey).unwrap();
    // From here on the device must never touch the memory: overwrite it with a pattern.
    mem[reg_off..reg_off + reg_len].fill(0x3C);
    // Watch for at least 60 ms, and until the stream has seen the dereg take effect (on a
    // loaded 2-vCPU machine the progress threads may not run for a while; up to 10 s).
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(60)
        || (!failed.load(Ordering::Relaxed) && t.elapsed() < Duration::from_secs(10))
    {
        std::thread::sleep(Duration::from_millis(5));
        assert!(
            mem[reg_off..reg_off + reg_len].iter().all(|&x| x == 0x3C),
            "write after dereg"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let statuses = streamer.join().unwrap();
    assert!(mem[..reg_off].iter().all(|&x| x == 0xC5), "front canary");
    assert!(
        mem[reg_off + reg_len..].iter().all(|&x| x == 0xC5),
        "back canary"
    );
    assert!(
        statuses.contains(&WcStatus::Success),
        "some writes landed before dereg"
    );
    let first_err = statuses.iter().find(|s| **s != WcStatus::Success).copied();
    assert_eq!(
        first_err,
        Some(WcStatus::RemAccessErr),
        "round {round}: {statuses:?}"
    );
    assert!(statuses
        .iter()
        .skip_while(|s| **s == WcStatus::Success)
        .skip(1)
        .all(|s| *s == WcStatus::WrFlushErr));
}
