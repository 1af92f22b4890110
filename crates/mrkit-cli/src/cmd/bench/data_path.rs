//! The in-process data path: two mrkit0 instances on the loopback link, one RC QP each,
//! WRITE/READ bandwidth and 8-byte round trips beside memcpy over the same arenas.

use std::sync::Arc;
use std::time::Instant;

use mrkit::AccessFlags;
use mrkit_soft::qp::QpCap;
use mrkit_soft::testkit::Host;
use mrkit_soft::{Context, DeviceConfig, UserMemory};
use serde_json::{json, Value};

/// Sizes of the data-path bandwidth points.
pub(super) const DP_SIZES: [usize; 3] = [4096, 65536, 1 << 20];
/// DRAM-resident arenas: offsets rotate across this many bytes, far beyond the LLC.
pub(super) const DP_ARENA: usize = 64 << 20;

/// One side of the in-process pair: its device, PD, CQ and QP (the test kit's host).
pub(super) type DpSide = Host;

pub(super) fn dp_side(sig_all: bool) -> Result<DpSide, String> {
    let cap = QpCap {
        max_send_wr: 512,
        ..QpCap::default()
    };
    Host::new(Context::open(DeviceConfig::rxe()), 4096, cap, sig_all).map_err(|e| e.to_string())
}

/// Wait for `want` completions on `side`'s CQ (error on a failed completion or after 10 s).
pub(super) fn dp_reap(
    side: &DpSide,
    wcs: &mut Vec<mrkit_soft::cq::Wc>,
    max: usize,
) -> Result<usize, String> {
    wcs.clear();
    let k = side
        .ctx
        .poll_cq(side.cq, wcs, max)
        .map_err(|e| e.to_string())?;
    for w in wcs.iter() {
        if w.status != mrkit_soft::cq::WcStatus::Success {
            return Err(format!("completion {:?}", w.status));
        }
    }
    Ok(k)
}

/// Bandwidth (GB/s, 10^9 B/s) of `op` at `size`, `total` bytes, rotating over the arenas.
pub(super) fn dp_bw(
    a: &DpSide,
    op: mrkit_soft::qp::WrOpcode,
    local: &mrkit_soft::MrInfo,
    remote: &mrkit_soft::MrInfo,
    size: usize,
    total: usize,
) -> Result<f64, String> {
    use mrkit_soft::qp::SendWr;
    let slots = DP_ARENA / size;
    let n = (total / size).max(64);
    let depth = ((16usize << 20) / size).clamp(4, 256);
    let mut wcs = Vec::with_capacity(256);
    let (mut posted, mut done, mut outstanding) = (0usize, 0usize, 0usize);
    let t = Instant::now();
    let deadline = t + std::time::Duration::from_secs(30);
    while done < n {
        while posted < n && outstanding < depth {
            let off = ((posted * 7919) % slots * size) as u64;
            let wr = SendWr::new(posted as u64, op)
                .sge(local.iova + off, size as u32, local.lkey)
                .remote(remote.iova + off, remote.rkey);
            a.ctx
                .post_send(a.qp, &[wr])
                .map_err(|e| format!("post_send: {e:?}"))?;
            posted += 1;
            outstanding += 1;
        }
        let k = dp_reap(a, &mut wcs, 256)?;
        done += k;
        outstanding -= k;
        if k == 0 {
            if Instant::now() > deadline {
                return Err("timed out waiting for completions".into());
            }
            let _ = a.ctx.wait_cq(a.cq, std::time::Duration::from_millis(1));
        }
    }
    Ok((n * size) as f64 / t.elapsed().as_secs_f64() / 1e9)
}

/// Round trips of one 8-byte `op` at a time (post, spin on the CQ): (p50, p99) in µs.
pub(super) fn dp_lat(
    a: &DpSide,
    op: mrkit_soft::qp::WrOpcode,
    local: &mrkit_soft::MrInfo,
    remote: &mrkit_soft::MrInfo,
    iters: usize,
) -> Result<(f64, f64), String> {
    use mrkit_soft::qp::SendWr;
    let mut wcs = Vec::with_capacity(4);
    let mut v = Vec::with_capacity(iters);
    for i in 0..iters {
        let off = ((i * 4096) % (DP_ARENA - 8)) as u64;
        let wr = SendWr::new(i as u64, op)
            .sge(local.iova + off, 8, local.lkey)
            .remote(remote.iova + off, remote.rkey);
        let t = Instant::now();
        a.ctx
            .post_send(a.qp, &[wr])
            .map_err(|e| format!("post_send: {e:?}"))?;
        while dp_reap(a, &mut wcs, 1)? == 0 {
            if t.elapsed() > std::time::Duration::from_secs(5) {
                return Err("timed out waiting for a completion".into());
            }
            std::hint::spin_loop();
        }
        v.push(t.elapsed().as_nanos() as u64);
    }
    v.sort_unstable();
    let q = |p: f64| v[((v.len() - 1) as f64 * p) as usize] as f64 / 1e3;
    Ok((q(0.5), q(0.99)))
}

/// memcpy of `size` over the same arenas and rotation (GB/s).
pub(super) fn dp_memcpy(src: &[u8], dst: &mut [u8], size: usize, total: usize) -> f64 {
    let slots = DP_ARENA / size;
    let n = (total / size).max(64);
    let t = Instant::now();
    for i in 0..n {
        let off = ((i * 7919) % slots) * size;
        dst[off..off + size].copy_from_slice(std::hint::black_box(&src[off..off + size]));
    }
    std::hint::black_box(&dst);
    (n * size) as f64 / t.elapsed().as_secs_f64() / 1e9
}

/// In-process WRITE/READ: two mrkit0 instances on the loopback link, one RC QP each, beside
/// memcpy over the same DRAM-resident arenas in the same run.
pub(super) fn data_path_in_process(quick: bool) -> Value {
    use mrkit_soft::qp::{rc_connect, WrOpcode};
    let run = || -> Result<Value, String> {
        let a = dp_side(true)?;
        let b = dp_side(false)?;
        let full = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        rc_connect(&a.ctx, a.qp, &b.ctx, b.qp, full, 5).map_err(|e| e.to_string())?;
        // The MRs own the arenas (kept alive until deregistered); the memcpy baseline copies
        // from the local arena into an unregistered one of the same size (both DRAM-resident).
        let la = Arc::new(vec![0x5au8; DP_ARENA]);
        let mut rb = vec![0u8; DP_ARENA];
        let ml = a
            .ctx
            .reg_mr_va(a.pd, UserMemory::owned(la.clone()), full)
            .map_err(|e| e.to_string())?;
        let mr = b
            .ctx
            .reg_mr_va(b.pd, UserMemory::owned(Arc::new(vec![0u8; DP_ARENA])), full)
            .map_err(|e| e.to_string())?;
        let total = if quick { 64usize << 20 } else { 512 << 20 };
        let iters = if quick { 2000 } else { 20000 };
        let mut bw = Vec::new();
        let mut result = Ok(());
        for &size in &DP_SIZES {
            let mc = dp_memcpy(&la, &mut rb, size, total);
            for (name, op) in [("write", WrOpcode::RdmaWrite), ("read", WrOpcode::RdmaRead)] {
                match dp_bw(&a, op, &ml, &mr, size, total) {
                    Ok(g) => bw.push(json!({
                        "op": name, "size": size, "bytes": (total / size).max(64) * size,
                        "gbps": g, "memcpy_gbps": mc, "ratio_to_memcpy": g / mc,
                    })),
                    Err(e) => {
                        result = Err(format!("{name} {size} B: {e}"));
                        break;
                    }
                }
            }
            if result.is_err() {
                break;
            }
        }
        let mut lat = Vec::new();
        if result.is_ok() {
            for (name, op) in [("write", WrOpcode::RdmaWrite), ("read", WrOpcode::RdmaRead)] {
                match dp_lat(&a, op, &ml, &mr, iters) {
                    Ok((p50, p99)) => lat.push(json!({
                        "op": name, "size": 8, "iters": iters, "lat_us_p50": p50, "lat_us_p99": p99,
                    })),
                    Err(e) => {
                        result = Err(format!("{name} 8 B latency: {e}"));
                        break;
                    }
                }
            }
        }
        let t = Instant::now();
        for i in 0..iters {
            let off = (i * 4096) % (DP_ARENA - 8);
            rb[off..off + 8].copy_from_slice(std::hint::black_box(&la[off..off + 8]));
        }
        let memcpy_8b_ns = t.elapsed().as_nanos() as f64 / iters as f64;
        let _ = a.ctx.dereg_mr(ml.lkey);
        let _ = b.ctx.dereg_mr(mr.lkey);
        drop((a, b));
        Ok(json!({
            "link": "loopback (two mrkit0 instances in this process, one RC QP each, MTU 4096)",
            "arena_bytes": DP_ARENA,
            "bandwidth": bw,
            "latency": lat,
            "memcpy_8b_ns": memcpy_8b_ns,
            "error": result.err(),
        }))
    };
    run().unwrap_or_else(|e| json!({"bandwidth": [], "latency": [], "error": e}))
}
