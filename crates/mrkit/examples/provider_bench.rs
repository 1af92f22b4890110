//! What the rdma-core provider's binding costs: the same verbs side by side in one run, on
//! the embedded mrkit0 (native), on the rdma-core provider over the drop-in `libibverbs.so`,
//! and on the drop-in called directly through its C ABI (the floor under the provider: the
//! binding's own cost is provider minus direct).
//!
//! ```text
//! cargo run --release -p mrkit --example provider_bench [-- ITERATIONS]
//! ```
//!
//! The drop-in is `MRKIT_RDMA_CORE_LIB` if set, else the `libibverbs.so` cargo built next to
//! this example (`mrkit-ibverbs` is a dev-dependency of `mrkit`). Measured: reg+dereg of
//! 4 KiB, posting an 8-byte RDMA WRITE, an empty poll, a post+poll round trip, and a
//! registration-cache hit.
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use mrkit::cache::{CacheConfig, RegCache};
use mrkit::provider::{attr_mask as m, AddressVector, QpAttr, QpInitAttr, SendWr, Wc, WrOpcode};
use mrkit::rdma_core::{library_at, RdmaCoreProvider};
use mrkit::{AccessFlags as A, Buffer, Context, DeviceConfig, Provider, QpCap, QpState};
use mrkit_soft::UserMemory;
use mrkit_verbs_abi::*;

fn drop_in() -> String {
    if let Ok(p) = std::env::var(mrkit::rdma_core::LIB_ENV) {
        return p;
    }
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().unwrap().parent().unwrap();
    profile
        .join("deps")
        .join("libibverbs.so")
        .display()
        .to_string()
}

/// ns per iteration of `f` over `n` iterations.
fn time(n: u32, mut f: impl FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed().as_nanos() as f64 / f64::from(n)
}

/// A CQ and an RC QP connected to itself over RoCEv2 (its own GID), through the provider.
fn self_qp(dev: &dyn Provider, pd: u32) -> (u32, u32) {
    let cq = dev.create_cq(256, None).unwrap();
    let (qpn, _) = dev
        .create_qp(QpInitAttr {
            pd,
            send_cq: cq,
            recv_cq: cq,
            cap: QpCap::default(),
            sq_sig_all: true,
        })
        .unwrap();
    let gid = dev.query_gid().unwrap();
    let ip = std::net::Ipv6Addr::from(gid).to_ipv4_mapped().map_or_else(
        || std::net::IpAddr::V6(std::net::Ipv6Addr::from(gid)),
        std::net::IpAddr::V4,
    );
    let init = QpAttr {
        qp_state: QpState::Init as u32,
        port_num: 1,
        qp_access_flags: A::REMOTE_WRITE,
        ..QpAttr::default()
    };
    dev.modify_qp(
        qpn,
        &init,
        m::STATE | m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS,
    )
    .unwrap();
    let rtr = QpAttr {
        qp_state: QpState::Rtr as u32,
        ah_attr: AddressVector {
            dest_node: 0,
            dgid: Some(ip),
            port_num: 1,
        },
        path_mtu: 5,
        dest_qp_num: qpn,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
        ..QpAttr::default()
    };
    let rtr_mask = m::STATE | m::AV | m::PATH_MTU | m::DEST_QPN | m::RQ_PSN;
    dev.modify_qp(
        qpn,
        &rtr,
        rtr_mask | m::MAX_DEST_RD_ATOMIC | m::MIN_RNR_TIMER,
    )
    .unwrap();
    let rts = QpAttr {
        qp_state: QpState::Rts as u32,
        max_rd_atomic: 1,
        ..QpAttr::default()
    };
    let rts_mask = m::STATE | m::TIMEOUT | m::RETRY_CNT | m::RNR_RETRY | m::SQ_PSN;
    dev.modify_qp(qpn, &rts, rts_mask | m::MAX_QP_RD_ATOMIC)
        .unwrap();
    (cq, qpn)
}

/// Per-operation times of one path (ns).
#[derive(Clone, Copy)]
struct Row {
    reg: f64,
    post: f64,
    poll_empty: f64,
    round_trip: f64,
    cache_hit: f64,
}

impl Row {
    const INF: Row = Row {
        reg: f64::INFINITY,
        post: f64::INFINITY,
        poll_empty: f64::INFINITY,
        round_trip: f64::INFINITY,
        cache_hit: f64::INFINITY,
    };
    /// The fastest of each column: the least disturbed round on a shared machine.
    fn min(self, o: Row) -> Row {
        Row {
            reg: self.reg.min(o.reg),
            post: self.post.min(o.post),
            poll_empty: self.poll_empty.min(o.poll_empty),
            round_trip: self.round_trip.min(o.round_trip),
            cache_hit: self.cache_hit.min(o.cache_hit),
        }
    }
}

/// One way of running the verbs.
trait Path {
    /// One round of `n` of each operation.
    fn round(&mut self, n: u32) -> Row;
}

struct ProviderPath<'a> {
    dev: &'a dyn Provider,
    pd: u32,
    buf: Buffer,
    cq: u32,
    qpn: u32,
    wr: SendWr,
    out: Vec<Wc>,
    cache: RegCache,
    mem: Vec<u8>,
}

impl<'a> ProviderPath<'a> {
    fn new(dev: &'a dyn Provider, ctx: &Context) -> (ProviderPath<'a>, u32, u32) {
        let pd = dev.alloc_pd().unwrap();
        let buf = Buffer::new(4096).unwrap();
        // SAFETY: `buf` lives in the returned path, which deregisters nothing: the MR is
        // deregistered (with the QP destroyed) by `finish` before the path drops.
        let mem = unsafe { UserMemory::new(buf.addr(), 4096) };
        let mr = dev
            .reg_mr(pd, mem, buf.addr(), A::LOCAL_WRITE | A::REMOTE_WRITE)
            .unwrap();
        let (cq, qpn) = self_qp(dev, pd);
        let wr = SendWr::new(1, WrOpcode::RdmaWrite)
            .sge(buf.addr(), 8, mr.lkey)
            .remote(buf.addr() + 2048, mr.rkey);
        let spd = ctx.alloc_pd().unwrap();
        let cache = RegCache::new(&spd, CacheConfig::default()).unwrap();
        let mem = vec![0u8; 64 << 10];
        drop(cache.get_ref(&mem[..4096], A::empty()).unwrap());
        (
            ProviderPath {
                dev,
                pd,
                buf,
                cq,
                qpn,
                wr,
                out: Vec::with_capacity(16),
                cache,
                mem,
            },
            qpn,
            mr.lkey,
        )
    }
    fn wait(&mut self) {
        self.out.clear();
        while self.dev.poll_cq(self.cq, &mut self.out, 16).unwrap() == 0 {}
        assert_eq!(self.out[0].status, mrkit::WcStatus::Success);
    }
}

impl Path for ProviderPath<'_> {
    fn round(&mut self, n: u32) -> Row {
        let (dev, pd, addr) = (self.dev, self.pd, self.buf.addr());
        let reg = time(n, || {
            // SAFETY: `buf` outlives the registration (deregistered at once).
            let mem = unsafe { UserMemory::new(addr, 4096) };
            let mr = dev.reg_mr(pd, mem, addr, A::LOCAL_WRITE).unwrap();
            dev.dereg_mr(mr.lkey).unwrap();
        });
        let qpn = self.qpn;
        let mut post = 0u128;
        for _ in 0..n {
            let t = Instant::now();
            dev.post_send(qpn, std::slice::from_ref(&self.wr)).unwrap();
            post += t.elapsed().as_nanos();
            self.wait();
        }
        let (cq, out) = (self.cq, &mut self.out);
        let poll_empty = time(n, || {
            out.clear();
            assert_eq!(dev.poll_cq(cq, out, 16).unwrap(), 0);
        });
        let t = Instant::now();
        for _ in 0..n {
            dev.post_send(qpn, std::slice::from_ref(&self.wr)).unwrap();
            self.wait();
        }
        let round_trip = t.elapsed().as_nanos() as f64 / f64::from(n);
        let (cache, mem) = (&self.cache, &self.mem);
        let cache_hit = time(n, || {
            let r = cache.get_ref(&mem[..4096], A::empty()).unwrap();
            std::hint::black_box(r.lkey());
        });
        Row {
            reg,
            post: post as f64 / f64::from(n),
            poll_empty,
            round_trip,
            cache_hit,
        }
    }
}

type RegFn = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, u32) -> *mut ibv_mr;
type DeregFn = unsafe extern "C" fn(*mut ibv_mr) -> i32;
type PostFnT = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut *mut c_void) -> i32;
type PollFnT = unsafe extern "C" fn(*mut c_void, i32, *mut c_void) -> i32;

/// The same verbs on the same device, called through the C ABI without the provider.
struct DirectPath {
    _lib: libloading::Library,
    reg_mr: RegFn,
    dereg_mr: DeregFn,
    post_send: PostFnT,
    poll_cq: PollFnT,
    pd: *mut ibv_pd,
    qp: *mut c_void,
    cq: *mut c_void,
    buf: Buffer,
    sge: Box<ibv_sge>,
    wr: Box<ibv_send_wr>,
}

impl DirectPath {
    fn new(p: &RdmaCoreProvider) -> (DirectPath, u32, u32, u32) {
        // SAFETY: the library the provider loaded (dlopen returns that copy), kept loaded by
        // `_lib`; the symbol types are the v44 prototypes.
        let lib = unsafe { libloading::Library::new(p.library().path()) }.unwrap();
        // SAFETY: as above.
        let reg_mr: RegFn = *unsafe { lib.get::<RegFn>(b"ibv_reg_mr_iova2\0") }.unwrap();
        // SAFETY: as above.
        let dereg_mr: DeregFn = *unsafe { lib.get::<DeregFn>(b"ibv_dereg_mr\0") }.unwrap();
        let pd = p.alloc_pd().unwrap();
        let buf = Buffer::new(4096).unwrap();
        // SAFETY: `buf` lives in the path; the MR is deregistered by `main` before it drops.
        let mem = unsafe { UserMemory::new(buf.addr(), 4096) };
        let mr = p
            .reg_mr(pd, mem, buf.addr(), A::LOCAL_WRITE | A::REMOTE_WRITE)
            .unwrap();
        let (cq, qpn) = self_qp(p, pd);
        // SAFETY: live context; the ops table as the header's inline ibv_post_send/ibv_poll_cq.
        let ops = unsafe { (*p.raw_context().cast::<ibv_context>()).ops };
        let mut sge = Box::new(ibv_sge {
            addr: buf.addr(),
            length: 8,
            lkey: mr.lkey,
        });
        let wr = Box::new(ibv_send_wr {
            wr_id: 1,
            next: std::ptr::null_mut(),
            sg_list: &mut *sge,
            num_sge: 1,
            opcode: IBV_WR_RDMA_WRITE,
            send_flags: 2,
            imm_data: 0,
            wr: [buf.addr() + 2048, u64::from(mr.rkey), 0, 0],
            qp_type: 0,
            _pad: 0,
            bind_mw: [0; 6],
        });
        let path = DirectPath {
            reg_mr,
            dereg_mr,
            post_send: ops.post_send.unwrap(),
            poll_cq: ops.poll_cq.unwrap(),
            pd: p.raw_pd(pd).unwrap().cast(),
            qp: p.raw_qp(qpn).unwrap(),
            cq: p.raw_cq(cq).unwrap(),
            buf,
            sge,
            wr,
            _lib: lib,
        };
        (path, cq, qpn, mr.lkey)
    }
    fn post(&mut self) {
        let mut bad = std::ptr::null_mut();
        // SAFETY: live QP; `wr` and its SGE valid for the call.
        let r = unsafe {
            (self.post_send)(
                self.qp,
                (&mut *self.wr as *mut ibv_send_wr).cast(),
                &mut bad,
            )
        };
        assert_eq!(r, 0);
    }
    fn poll(&self, wc: &mut [ibv_wc; 16]) -> i32 {
        // SAFETY: live CQ; room for 16 entries.
        unsafe { (self.poll_cq)(self.cq, 16, wc.as_mut_ptr().cast()) }
    }
}

impl Path for DirectPath {
    fn round(&mut self, n: u32) -> Row {
        let (reg_mr, dereg_mr, pd, addr) = (self.reg_mr, self.dereg_mr, self.pd, self.buf.addr());
        let _ = &self.sge;
        let reg = time(n, || {
            // SAFETY: a live PD; `buf` outlives the MR, deregistered at once.
            unsafe {
                let mr = reg_mr(pd, addr as *mut c_void, 4096, addr, 1);
                assert!(!mr.is_null());
                assert_eq!(dereg_mr(mr), 0);
            }
        });
        let mut wc = [ibv_wc::default(); 16];
        let mut post = 0u128;
        for _ in 0..n {
            let t = Instant::now();
            self.post();
            post += t.elapsed().as_nanos();
            while self.poll(&mut wc) == 0 {}
            assert_eq!(wc[0].status, 0);
        }
        let poll_empty = time(n, || assert_eq!(self.poll(&mut wc), 0));
        let t = Instant::now();
        for _ in 0..n {
            self.post();
            while self.poll(&mut wc) == 0 {}
        }
        let round_trip = t.elapsed().as_nanos() as f64 / f64::from(n);
        Row {
            reg,
            post: post as f64 / f64::from(n),
            poll_empty,
            round_trip,
            cache_hit: f64::NAN,
        }
    }
}

fn main() {
    let n: u32 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1000);
    let rounds: u32 = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let path = drop_in();
    let lib = library_at(&path).unwrap_or_else(|e| panic!("{e}"));
    let rc = Arc::new(RdmaCoreProvider::open(lib, "mrkit0").unwrap());
    let rc_ctx = Context::from_provider(rc.clone());
    let native = Arc::new(mrkit_soft::Context::open(DeviceConfig::rxe()));
    let native_ctx = Context::from_provider(native.clone());

    let (mut pn, n_qp, n_mr) = ProviderPath::new(&*native, &native_ctx);
    let (mut pr, r_qp, r_mr) = ProviderPath::new(&*rc, &rc_ctx);
    let (mut pd, d_cq, d_qp, d_mr) = DirectPath::new(&rc);
    let mut best = [Row::INF; 3];
    let mut diffs: [Vec<f64>; 3] = Default::default();
    // Rounds alternate between the paths, so a disturbance hits all of them alike; each
    // column keeps its fastest round, and the binding's cost is also taken as the median of
    // the per-round differences (provider minus direct, each pair measured back to back).
    for _ in 0..rounds {
        best[0] = best[0].min(pn.round(n));
        let (p, d) = (pr.round(n), pd.round(n));
        diffs[0].push(p.reg - d.reg);
        diffs[1].push(p.post - d.post);
        diffs[2].push(p.poll_empty - d.poll_empty);
        best[1] = best[1].min(p);
        best[2] = best[2].min(d);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "rdma-core provider over {path}: {rounds} alternating rounds of {n}, fastest round; ns per operation"
    );
    println!(
        "{:<24} {:>14} {:>10} {:>12} {:>12} {:>10}",
        "path", "reg+dereg 4K", "post", "poll empty", "post+poll", "cache hit"
    );
    for (name, r) in [
        "native mrkit0",
        "rdma-core provider",
        "drop-in, direct C ABI",
    ]
    .iter()
    .zip(&best)
    {
        let hit = if r.cache_hit.is_finite() {
            format!("{:.0}", r.cache_hit)
        } else {
            "n/a".into()
        };
        println!(
            "{name:<24} {:>14.0} {:>10.0} {:>12.0} {:>12.0} {hit:>10}",
            r.reg, r.post, r.poll_empty, r.round_trip
        );
    }
    let (p, d) = (&best[1], &best[2]);
    println!(
        "binding (provider - direct), fastest rounds: reg+dereg {:+.0} ns, post {:+.0} ns, poll {:+.0} ns",
        p.reg - d.reg,
        p.post - d.post,
        p.poll_empty - d.poll_empty
    );
    println!(
        "binding (provider - direct), median of paired rounds: reg+dereg {:+.0} ns, post {:+.0} ns, poll {:+.0} ns",
        median(&mut diffs[0]),
        median(&mut diffs[1]),
        median(&mut diffs[2])
    );
    // Tear down in order: QPs and CQs, then the MRs over the paths' buffers.
    for (dev, qp, cq, mr) in [
        (&*native as &dyn Provider, n_qp, pn.cq, n_mr),
        (&*rc, r_qp, pr.cq, r_mr),
    ] {
        dev.destroy_qp(qp).unwrap();
        dev.destroy_cq(cq).unwrap();
        dev.dereg_mr(mr).unwrap();
    }
    rc.destroy_qp(d_qp).unwrap();
    rc.destroy_cq(d_cq).unwrap();
    rc.dereg_mr(d_mr).unwrap();
    drop((pn, pr, pd));
}
