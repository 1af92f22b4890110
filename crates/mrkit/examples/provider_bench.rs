//! What the rdma-core provider's binding costs: the same verbs in one run on the rdma-core
//! provider over the drop-in `libibverbs.so` and on the drop-in called directly through its C
//! ABI (the floor under the provider: the binding's own cost is provider minus direct), with
//! the embedded mrkit0 (native) for reference.
//!
//! ```text
//! cargo run --release -p mrkit --example provider_bench [-- OPS_PER_BLOCK [BLOCKS]]
//! ```
//!
//! Method, so that one run on a quiet machine answers the question: both paths use the same
//! PD, buffer, MR, QP and CQ (two QPs of one device differ by ~20 ns a post, as much as the
//! difference measured). Each operation is measured in BLOCKS blocks (default 101) of
//! OPS_PER_BLOCK operations (default 200; polls 5x that), provider and direct alternating block
//! by block with the order flipped every block; each operation is timed alone and a block
//! reports the mean of its middle half (see `mid_mean_each`), so the few operations a shared machine stretches by milliseconds do not
//! count. Printed per operation: the median block of each path and the median of the
//! per-block differences with their 10th..90th percentiles. The clock reads cost the same on
//! both paths and cancel in the difference; the clock steps in 10 ns here.
//!
//! The drop-in is `MRKIT_RDMA_CORE_LIB` if set, else the `libibverbs.so` cargo built next to
//! this example (`mrkit-ibverbs` is a dev-dependency of `mrkit`). Measured: reg+dereg of
//! 4 KiB, posting an 8-byte RDMA WRITE, an empty poll; then the binding alone, with the
//! library's `post_send` and `poll_cq` replaced by stubs that return at once (rows "post
//! (stub)", "poll (stub)": what the provider's own instructions cost, warm, without the
//! drop-in's system calls); for reference also a post+poll round trip and a registration-cache
//! hit on each path.
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

/// The interquartile mean over `n` iterations of `f`, each timed alone (`f` returns the ns it
/// measured): robust like a median against the few operations a shared machine stretches by
/// milliseconds, but not stepped like the clock. Clocks here step in 10 ns (the vDSO clock, and
/// the time-stamp counter itself, which advances 26 ticks at a time), as coarse as the budget
/// measured; the median of such a sample is a multiple of 10 ns, while the mean of its middle
/// half resolves finer wherever the operation's own jitter spans a step. The clock reads are
/// the same on every path, so they cancel in a difference.
fn mid_mean_each(n: u32, mut f: impl FnMut() -> u64) -> f64 {
    let mut v: Vec<f64> = (0..n).map(|_| f() as f64).collect();
    v.sort_by(f64::total_cmp);
    let mid = &v[v.len() / 4..v.len() - v.len() / 4];
    mid.iter().sum::<f64>() / mid.len() as f64
}

/// ns of `f`.
fn timed(f: impl FnOnce()) -> u64 {
    let t = Instant::now();
    f();
    t.elapsed().as_nanos() as u64
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

/// One way of running the verbs: each method runs `n` operations and returns ns per
/// operation.
trait Path {
    /// reg+dereg of 4 KiB.
    fn reg(&mut self, n: u32) -> f64;
    /// Posting an 8-byte RDMA WRITE (each post timed alone; its completion is awaited
    /// untimed).
    fn post(&mut self, n: u32) -> f64;
    /// An empty poll (16 entries asked).
    fn poll(&mut self, n: u32) -> f64;
    /// post + poll until the completion.
    fn round_trip(&mut self, n: u32) -> f64;
    /// A registration-cache hit (`f64::NAN` where there is no cache).
    fn cache_hit(&mut self, _n: u32) -> f64 {
        f64::NAN
    }
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
        // deregistered (with the QP destroyed) by `main` before the path drops.
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
    fn reg(&mut self, n: u32) -> f64 {
        let (dev, pd, addr) = (self.dev, self.pd, self.buf.addr());
        mid_mean_each(n, || {
            timed(|| {
                // SAFETY: `buf` outlives the registration (deregistered at once).
                let mem = unsafe { UserMemory::new(addr, 4096) };
                let mr = dev.reg_mr(pd, mem, addr, A::LOCAL_WRITE).unwrap();
                dev.dereg_mr(mr.lkey).unwrap();
            })
        })
    }
    fn post(&mut self, n: u32) -> f64 {
        mid_mean_each(n, || {
            let ns = timed(|| {
                self.dev
                    .post_send(self.qpn, std::slice::from_ref(&self.wr))
                    .unwrap()
            });
            self.wait();
            ns
        })
    }
    fn poll(&mut self, n: u32) -> f64 {
        let (dev, cq, out) = (self.dev, self.cq, &mut self.out);
        mid_mean_each(n, || {
            out.clear();
            timed(|| assert_eq!(dev.poll_cq(cq, out, 16).unwrap(), 0))
        })
    }
    fn round_trip(&mut self, n: u32) -> f64 {
        let t = Instant::now();
        for _ in 0..n {
            self.dev
                .post_send(self.qpn, std::slice::from_ref(&self.wr))
                .unwrap();
            self.wait();
        }
        t.elapsed().as_nanos() as f64 / f64::from(n)
    }
    fn cache_hit(&mut self, n: u32) -> f64 {
        let (cache, mem) = (&self.cache, &self.mem);
        time(n, || {
            let r = cache.get_ref(&mem[..4096], A::empty()).unwrap();
            std::hint::black_box(r.lkey());
        })
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
    addr: u64,
    sge: Box<ibv_sge>,
    wr: Box<ibv_send_wr>,
}

impl DirectPath {
    /// The direct path over the provider path `pp`'s own PD, buffer, MR, QP and CQ: both
    /// paths post on the same QP and poll the same CQ (two QPs of one device differ by some
    /// 20 ns a post, more than the difference to measure).
    fn new(p: &RdmaCoreProvider, pp: &ProviderPath<'_>, lkey: u32, rkey: u32) -> DirectPath {
        // SAFETY: the library the provider loaded (dlopen returns that copy), kept loaded by
        // `_lib`; the symbol types are the v44 prototypes.
        let lib = unsafe { libloading::Library::new(p.library().path()) }.unwrap();
        // SAFETY: as above.
        let reg_mr: RegFn = *unsafe { lib.get::<RegFn>(b"ibv_reg_mr_iova2\0") }.unwrap();
        // SAFETY: as above.
        let dereg_mr: DeregFn = *unsafe { lib.get::<DeregFn>(b"ibv_dereg_mr\0") }.unwrap();
        let addr = pp.buf.addr();
        // SAFETY: live context; the ops table as the header's inline ibv_post_send/ibv_poll_cq.
        let ops = unsafe { (*p.raw_context().cast::<ibv_context>()).ops };
        let mut sge = Box::new(ibv_sge {
            addr,
            length: 8,
            lkey,
        });
        let wr = Box::new(ibv_send_wr {
            wr_id: 1,
            next: std::ptr::null_mut(),
            sg_list: &mut *sge,
            num_sge: 1,
            opcode: IBV_WR_RDMA_WRITE,
            send_flags: 2,
            imm_data: 0,
            wr: [addr + 2048, u64::from(rkey), 0, 0],
            qp_type: 0,
            _pad: 0,
            bind_mw: [0; 6],
        });
        DirectPath {
            reg_mr,
            dereg_mr,
            post_send: ops.post_send.unwrap(),
            poll_cq: ops.poll_cq.unwrap(),
            pd: p.raw_pd(pp.pd).unwrap().cast(),
            qp: p.raw_qp(pp.qpn).unwrap(),
            cq: p.raw_cq(pp.cq).unwrap(),
            addr,
            sge,
            wr,
            _lib: lib,
        }
    }
    fn post_one(&mut self) {
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
    fn poll_c(&self, wc: &mut [ibv_wc; 16]) -> i32 {
        // SAFETY: live CQ; room for 16 entries.
        unsafe { (self.poll_cq)(self.cq, 16, wc.as_mut_ptr().cast()) }
    }
}

impl Path for DirectPath {
    fn reg(&mut self, n: u32) -> f64 {
        let (reg_mr, dereg_mr, pd, addr) = (self.reg_mr, self.dereg_mr, self.pd, self.addr);
        let _ = &self.sge;
        mid_mean_each(n, || {
            timed(|| {
                // SAFETY: a live PD; `buf` outlives the MR, deregistered at once.
                unsafe {
                    let mr = reg_mr(pd, addr as *mut c_void, 4096, addr, 1);
                    assert!(!mr.is_null());
                    assert_eq!(dereg_mr(mr), 0);
                }
            })
        })
    }
    fn post(&mut self, n: u32) -> f64 {
        let mut wc = [ibv_wc::default(); 16];
        mid_mean_each(n, || {
            let ns = timed(|| self.post_one());
            while self.poll_c(&mut wc) == 0 {}
            assert_eq!(wc[0].status, 0);
            ns
        })
    }
    fn poll(&mut self, n: u32) -> f64 {
        let mut wc = [ibv_wc::default(); 16];
        mid_mean_each(n, || timed(|| assert_eq!(self.poll_c(&mut wc), 0)))
    }
    fn round_trip(&mut self, n: u32) -> f64 {
        let mut wc = [ibv_wc::default(); 16];
        let t = Instant::now();
        for _ in 0..n {
            self.post_one();
            while self.poll_c(&mut wc) == 0 {}
        }
        t.elapsed().as_nanos() as f64 / f64::from(n)
    }
}

/// `v`'s quantile `q` (0..=1), nearest rank.
fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// One operation measured in `blocks` blocks of `n`, alternating the provider and the direct
/// path block by block (the order flips every block, so a drift or a disturbance hits both
/// alike); per block, the binding's cost is provider minus direct.
struct Compare {
    provider: Vec<f64>,
    direct: Vec<f64>,
    diff: Vec<f64>,
}

/// `blocks` blocks of `run(true)` (the provider) and `run(false)` (the direct path), the order
/// flipped every block.
fn alternate(blocks: u32, mut run: impl FnMut(bool) -> f64) -> Compare {
    let mut c = Compare {
        provider: Vec::new(),
        direct: Vec::new(),
        diff: Vec::new(),
    };
    for b in 0..blocks {
        let (p, d) = if b % 2 == 0 {
            let p = run(true);
            (p, run(false))
        } else {
            let d = run(false);
            (run(true), d)
        };
        c.provider.push(p);
        c.direct.push(d);
        c.diff.push(p - d);
    }
    c
}

/// One line of the comparison table.
fn print_row(name: &str, c: &Compare) {
    println!(
        "{name:<14} {:>14.0} {:>14.0} {:>+12.1} {:>+10.1} .. {:<+9.1}",
        quantile(&c.direct, 0.5),
        quantile(&c.provider, 0.5),
        quantile(&c.diff, 0.5),
        quantile(&c.diff, 0.1),
        quantile(&c.diff, 0.9),
    );
}

/// A `post_send` that takes the work request and does nothing else (it reads the id, as a
/// library must read the request).
unsafe extern "C" fn stub_post(_qp: *mut c_void, wr: *mut c_void, _bad: *mut *mut c_void) -> i32 {
    // SAFETY: the caller passes a valid `ibv_send_wr`.
    std::hint::black_box(unsafe { (*wr.cast::<ibv_send_wr>()).wr_id });
    0
}

/// A `poll_cq` that finds nothing.
unsafe extern "C" fn stub_poll(_cq: *mut c_void, _n: i32, _wc: *mut c_void) -> i32 {
    0
}

/// The binding alone: the context's `post_send` and `poll_cq` replaced by stubs that return at
/// once, so that the drop-in's own work (a post's wake-up system call, ~4 µs here; a poll's
/// receive system call), whose variance exceeds the binding's cost, drops out of the
/// difference. Timed in batches of 1,000 calls (the clock's resolution is ~10 ns), provider
/// and direct alternating block by block; the original ops are back before this returns.
fn binding_alone(
    rc: &RdmaCoreProvider,
    pr: &mut ProviderPath<'_>,
    pd: &mut DirectPath,
    blocks: u32,
) {
    const BATCH: u32 = 1000;
    let ctx = rc.raw_context().cast::<ibv_context>();
    // SAFETY: the drop-in's live context. Only this thread calls its ops (the drop-in's
    // progress thread does not use the table), so swapping them here races with nothing.
    let saved = unsafe { (*ctx).ops };
    // SAFETY: as above.
    unsafe {
        (*ctx).ops.post_send = Some(stub_post);
        (*ctx).ops.poll_cq = Some(stub_poll);
    }
    let (dev, qpn, cq) = (pr.dev, pr.qpn, pr.cq);
    let post = alternate(blocks, |provider| {
        if provider {
            time(BATCH, || {
                dev.post_send(qpn, std::slice::from_ref(&pr.wr)).unwrap()
            })
        } else {
            // What a C program's inline `ibv_post_send` does: the QP's context's op.
            let qp = std::hint::black_box(pd.qp.cast::<ibv_qp>());
            time(BATCH, || {
                let mut bad = std::ptr::null_mut();
                // SAFETY: a live QP; the stub reads the request only.
                let r = unsafe {
                    let op = (*(*qp).context).ops.post_send.unwrap();
                    op(
                        qp.cast(),
                        (&mut *pd.wr as *mut ibv_send_wr).cast(),
                        &mut bad,
                    )
                };
                assert_eq!(r, 0);
            })
        }
    });
    print_row("post (stub)", &post);
    let mut wc = [ibv_wc::default(); 16];
    let poll = alternate(blocks, |provider| {
        if provider {
            time(BATCH, || {
                pr.out.clear();
                assert_eq!(dev.poll_cq(cq, &mut pr.out, 16).unwrap(), 0);
            })
        } else {
            // What a C program's inline `ibv_poll_cq` does: the CQ's context's op.
            let cq = std::hint::black_box(pd.cq.cast::<ibv_cq>());
            time(BATCH, || {
                // SAFETY: a live CQ; room for 16 entries.
                let n = unsafe {
                    let op = (*(*cq).context).ops.poll_cq.unwrap();
                    op(cq.cast(), 16, wc.as_mut_ptr().cast())
                };
                assert_eq!(n, 0);
            })
        }
    });
    print_row("poll (stub)", &poll);
    // SAFETY: as above: the library's own ops back.
    unsafe { (*ctx).ops = saved };
}

fn main() {
    let n: u32 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let rounds: u32 = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(101);
    let path = drop_in();
    let lib = library_at(&path).unwrap_or_else(|e| panic!("{e}"));
    let rc = Arc::new(RdmaCoreProvider::open(lib, "mrkit0").unwrap());
    let rc_ctx = Context::from_provider(rc.clone());
    let native = Arc::new(mrkit_soft::Context::open(DeviceConfig::rxe()));
    let native_ctx = Context::from_provider(native.clone());

    let (mut pn, n_qp, n_mr) = ProviderPath::new(&*native, &native_ctx);
    let (mut pr, r_qp, r_mr) = ProviderPath::new(&*rc, &rc_ctx);
    let mut pd = DirectPath::new(&rc, &pr, r_mr, pr.wr.rkey);
    let blocks = rounds;
    println!(
        "rdma-core provider over {path}: {blocks} blocks of {n} operations per path, provider \
         and direct C ABI alternating block by block; ns per operation"
    );
    println!(
        "{:<14} {:>14} {:>14} {:>12} {:>22}",
        "operation", "direct (med)", "provider (med)", "binding", "binding p10..p90"
    );
    type Op<'o> = (&'static str, u32, Box<dyn FnMut(&mut dyn Path) -> f64 + 'o>);
    let ops: Vec<Op> = vec![
        (
            "reg+dereg 4K",
            n,
            Box::new(move |p: &mut dyn Path| p.reg(n)),
        ),
        ("post", n, Box::new(move |p: &mut dyn Path| p.post(n))),
        (
            "poll empty",
            n * 5,
            Box::new(move |p: &mut dyn Path| p.poll(n * 5)),
        ),
    ];
    for (name, _, mut op) in ops {
        let c = alternate(
            blocks,
            |provider| {
                if provider {
                    op(&mut pr)
                } else {
                    op(&mut pd)
                }
            },
        );
        print_row(name, &c);
    }
    binding_alone(&rc, &mut pr, &mut pd, blocks);
    // For reference: the embedded mrkit0 on its own (no C ABI), the round trip, the cache.
    let k = blocks.min(10);
    let med = |p: &mut dyn Path, f: &dyn Fn(&mut dyn Path) -> f64| {
        quantile(&(0..k).map(|_| f(p)).collect::<Vec<_>>(), 0.5)
    };
    for (label, p) in [
        ("native mrkit0", &mut pn as &mut dyn Path),
        ("rdma-core provider", &mut pr),
        ("direct C ABI", &mut pd),
    ] {
        let reg = med(p, &|p| p.reg(n));
        let rt = med(p, &|p| p.round_trip(n));
        let hit = med(p, &|p| p.cache_hit(n));
        let hit = if hit.is_finite() {
            format!("{hit:.0}")
        } else {
            "n/a".into()
        };
        println!(
            "{label:<20} reg+dereg {reg:>6.0}  post+poll {rt:>7.0}  cache hit {hit:>4} (medians of {k} rounds)"
        );
    }
    // Tear down in order: QPs and CQs, then the MRs over the paths' buffers.
    for (dev, qp, cq, mr) in [
        (&*native as &dyn Provider, n_qp, pn.cq, n_mr),
        (&*rc, r_qp, pr.cq, r_mr),
    ] {
        dev.destroy_qp(qp).unwrap();
        dev.destroy_cq(cq).unwrap();
        dev.dereg_mr(mr).unwrap();
    }
    drop((pn, pr, pd));
}
