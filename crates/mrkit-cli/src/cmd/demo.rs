//! `mrkit demo`: a guided run on the embedded device: registration, data movement between two
//! endpoints (WRITE, READ, FETCH_AND_ADD), the classic mistakes with their real errors, and a
//! short pool-vs-per-message comparison.

use std::time::{Duration, Instant};

use clap::Args;
use std::sync::Arc;

use mrkit::{AccessFlags, Buffer, BufferOptions, Context, DeviceConfig};
use mrkit_soft::mr::KeyUse;
use mrkit_soft::UserMemory;

use crate::exit;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Skip the pauses between steps (kept for scripts; the demo never waits for input).
    #[arg(long)]
    quiet: bool,
}

fn step(n: &mut u32, title: &str) {
    *n += 1;
    let n = *n;
    crate::outln!("\n== {n}. {title}");
}

fn show<T>(what: &str, r: mrkit::Result<T>) -> Option<T> {
    match r {
        Ok(v) => {
            crate::outln!("   {what}: ok");
            Some(v)
        }
        Err(e) => {
            crate::outln!("   {what}: {e}");
            None
        }
    }
}

pub fn run(_a: DemoArgs, dev: &super::device::Selected) -> u8 {
    let ctx = match dev.open("demo") {
        Ok(c) => c,
        Err(code) => return code,
    };
    match run_inner(ctx, dev.name()) {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("mrkit demo: unexpected failure: {e}");
            exit::VERB_FAILED
        }
    }
}

/// Registrations and failures of the whole run, from the process-wide counters of every
/// `mrkit0` instance (`mrkit_soft::stats::process()`), not one context's.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Successful registrations.
    pub registrations: u64,
    /// Failed registrations.
    pub failures: u64,
}

impl Tally {
    /// The process-wide counters of the embedded device now.
    pub fn embedded_now() -> Tally {
        let st = mrkit_soft::stats::process().snapshot();
        Tally {
            registrations: st.registrations,
            failures: st.failures.iter().map(|(_, c)| c).sum(),
        }
    }

    /// What happened between `self` (earlier) and `later`.
    pub fn since(self, later: Tally) -> Tally {
        Tally {
            registrations: later.registrations.saturating_sub(self.registrations),
            failures: later.failures.saturating_sub(self.failures),
        }
    }
}

fn run_inner(ctx: Context, selected: &str) -> mrkit::Result<()> {
    let start = Tally::embedded_now();
    // Another device counts its own registrations (mrkit0 is in the process-wide tally).
    let other = |ctx: &Context| {
        ctx.soft()
            .is_none()
            .then(|| ctx.provider().registration_counts())
            .flatten()
    };
    let start_other = other(&ctx);
    let attr = ctx.query_device();
    crate::outln!(
        "mrkit demo: memory registration on {} ({})",
        ctx.name(),
        if ctx.soft().is_some() {
            "a software RDMA device; no NIC needed"
        } else {
            "the selected device; the device-limit steps run on embedded mrkit0 instances"
        }
    );
    // libibverbs does not report a translation capacity: 0 means unknown, not 2^0.
    let mtt = if ctx.soft().is_some() || attr.log_num_mtt != 0 {
        format!("2^{}", attr.log_num_mtt)
    } else {
        "not reported".to_string()
    };
    crate::outln!(
        "   max_mr {}  max_mr_size {:#x}  translation entries {mtt}  ODP caps {:#x}",
        attr.max_mr,
        attr.max_mr_size,
        attr.odp_general_caps
    );

    let mut n = 0;
    step(
        &mut n,
        "Register 64 KiB for remote writes: pinned pages, translation, keys",
    );
    let pd = ctx.alloc_pd()?;
    let buf = buffer(64 << 10)?;
    let mr = pd.register(buf, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let i = mr.info();
    crate::outln!(
        "   lkey {:#010x} = rkey {:#010x}  ({} pages of {} B, pinned through {})",
        i.lkey,
        i.rkey,
        i.entries,
        i.page_size,
        i.pin_path.map(|p| p.name()).unwrap_or("-")
    );
    crate::outln!(
        "   key = (index << 8) | generation: a deregistered key never matches a later MR"
    );

    move_data(&ctx, &mut n)?;

    step(&mut n, "Classic mistake: REMOTE_WRITE without LOCAL_WRITE");
    show(
        "register(REMOTE_WRITE)",
        pd.register(Buffer::new(4096).expect("alloc"), AccessFlags::REMOTE_WRITE),
    );

    step(
        &mut n,
        "Classic mistake: a writable registration of a read-only mapping",
    );
    let readonly = || {
        let mut ro = buffer(8192).expect("alloc");
        ro.make_readonly().expect("mprotect");
        ro
    };
    show(
        "register(read-only buffer, LOCAL_WRITE)",
        pd.register(readonly(), AccessFlags::LOCAL_WRITE),
    );
    if let Some(mr_ro) = show(
        "register(read-only buffer, REMOTE_READ)",
        pd.register(readonly(), AccessFlags::REMOTE_READ),
    ) {
        crate::outln!(
            "   pinned through {} (io_uring always pins writable)",
            mr_ro.info().pin_path.map(|p| p.name()).unwrap_or("-")
        );
        let mut mr_ro = mr_ro;
        show(
            "rereg to LOCAL_WRITE without a new translation",
            mr_ro.set_access(AccessFlags::LOCAL_WRITE),
        );
    }

    step(&mut n, "Using a key after dereg: the device refuses it");
    let stale = mr.lkey();
    let iova = mr.info().iova;
    drop(mr);
    match ctx.soft() {
        Some(soft) => match soft.check_access(stale, pd.handle(), AccessFlags::REMOTE_WRITE, iova, 8, KeyUse::Remote, 0) {
            Ok(_) => crate::outln!("   BUG: stale key accepted"),
            Err(d) => crate::outln!("   remote WRITE with stale rkey {stale:#010x}: refused ({d:?}) -> IBV_WC_REM_ACCESS_ERR"),
        },
        None => crate::outln!("   (the key check is shown on mrkit0 only: a remote WRITE with stale rkey {stale:#010x} completes with IBV_WC_REM_ACCESS_ERR)"),
    }

    step(
        &mut n,
        "A NIC with max_mr = 1000 (the seed's ConnectX-5 default)",
    );
    let small = mrkit_soft::Context::open(DeviceConfig::rxe().max_mr(1000));
    let spd = small.alloc_pd()?;
    // Each MR holds a reference to the page until it is deregistered.
    let page = Arc::new(buffer(4096).expect("alloc"));
    let mut keys = Vec::new();
    for _ in 0..1000 {
        keys.push(
            small
                .reg_mr_va(
                    spd,
                    UserMemory::owned(page.clone()),
                    AccessFlags::LOCAL_WRITE,
                )?
                .lkey,
        );
    }
    crate::outln!("   1000 registrations of the same page: ok (each pins it again)");
    show(
        "registration 1001",
        small.reg_mr_va(
            spd,
            UserMemory::owned(page.clone()),
            AccessFlags::LOCAL_WRITE,
        ),
    );
    for k in keys {
        small.dereg_mr(k)?;
    }

    step(
        &mut n,
        "Translation capacity: 2^9 entries, 4 MiB of 4 KiB pages vs THP",
    );
    let tiny = Context::open(DeviceConfig::rxe().log_num_mtt(9));
    let tpd = tiny.alloc_pd()?;
    let small_pages = buffer(4 << 20).expect("alloc");
    show(
        "4 MiB of 4 KiB pages (1024 entries)",
        tpd.register(small_pages, AccessFlags::LOCAL_WRITE),
    );
    let huge = Buffer::with_options(
        4 << 20,
        BufferOptions {
            thp: true,
            populate: true,
            ..Default::default()
        },
    )
    .expect("alloc");
    if let Some(m) = show(
        "4 MiB backed by THP",
        tpd.register(huge, AccessFlags::LOCAL_WRITE),
    ) {
        crate::outln!(
            "   {} entries of {} B",
            m.info().entries,
            m.info().page_size
        );
    }

    step(&mut n, "Deallocating a PD that still has MRs");
    let raw = Context::open(DeviceConfig::rxe());
    let s = raw.soft().expect("embedded");
    let p = s.alloc_pd()?;
    let b = Arc::new(buffer(4096).expect("alloc"));
    let m = s.reg_mr_va(p, UserMemory::owned(b), AccessFlags::empty())?;
    show("dealloc_pd with a live MR", s.dealloc_pd(p));
    s.dereg_mr(m.lkey)?;
    show("dealloc_pd after dereg", s.dealloc_pd(p));

    pool_vs_per_message(&ctx, &mut n)?;

    // The whole run: every mrkit0 instance the demo opened. Another device's registrations
    // are counted by its own driver, not here: say so rather than print a partial number as
    // the total.
    let mut run = start.since(Tally::embedded_now());
    let note = match (start_other, other(&ctx)) {
        (Some(a), Some(b)) => {
            run.registrations += b.registrations.saturating_sub(a.registrations);
            run.failures += b.failures.saturating_sub(a.failures);
            format!(" (on {selected} and the embedded mrkit0 instances)")
        }
        _ if ctx.soft().is_some() => String::new(),
        _ => format!(" (on the embedded mrkit0 instances; {selected} keeps no count)"),
    };
    crate::outln!(
        "\nstatistics of this run: {} registrations, {} failures, peak pinned {} bytes{}",
        run.registrations,
        run.failures,
        mrkit_soft::stats::process().snapshot().pinned_bytes_peak,
        note
    );
    Ok(())
}

fn err(e: impl std::fmt::Display) -> mrkit::Error {
    mrkit::Error::new(mrkit::Errno::EINVAL, e.to_string())
}

fn buffer(len: usize) -> mrkit::Result<Buffer> {
    Buffer::with_options(
        len,
        BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .map_err(|e| mrkit::Error::new(mrkit::Errno::ENOMEM, e.to_string()))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b.split(|c| *c == 0).next().unwrap_or(b)).into_owned()
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[off..off + 8]);
    u64::from_ne_bytes(w)
}

/// Two endpoints on the selected device (each its own PD and RC QP, connected to each other
/// through the generic API): WRITE, READ, FETCH_AND_ADD, and a WRITE the remote MR does not
/// allow.
fn move_data(ctx: &Context, n: &mut u32) -> mrkit::Result<()> {
    use mrkit::{QpCap, QueuePair, WcStatus};
    step(
        n,
        "Move data between two endpoints: RDMA WRITE, READ and FETCH_AND_ADD",
    );
    let (pd_a, pd_b) = (ctx.alloc_pd()?, ctx.alloc_pd()?);
    let qa = QueuePair::new(&pd_a, QpCap::default())?;
    let qb = QueuePair::new(&pd_b, QpCap::default())?;
    let remote = AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC;
    QueuePair::connect(&qa, &qb, remote)?;
    crate::outln!(
        "   endpoint A: QP {:#x}; endpoint B: QP {:#x} (RC on {}, each with its own PD, connected to each other)",
        qa.qp_num(),
        qb.qp_num(),
        ctx.name()
    );
    // Each MR owns its buffer (freed only after deregistration).
    let mut am = pd_a.register(buffer(16 << 10)?, AccessFlags::LOCAL_WRITE)?;
    let mut bm = pd_b.register(buffer(16 << 10)?, remote)?;
    crate::outln!(
        "   A registers 16 KiB LOCAL_WRITE (lkey {:#010x}); B registers 16 KiB LOCAL_WRITE|REMOTE_WRITE|REMOTE_READ|REMOTE_ATOMIC and sends A its address {:#x} and rkey {:#010x}",
        am.lkey(),
        bm.info().iova,
        bm.rkey()
    );

    let msg = b"hello from A, written by RDMA WRITE";
    let len = msg.len() as u64;
    am.as_mut_slice()[..msg.len()].copy_from_slice(msg);
    let wc = qa.write(&am, 0..len, bm.remote(0..len)?)?;
    crate::outln!(
        "   WRITE {} B A -> B: completion {}; B's memory now reads \"{}\" (B's CPU did nothing)",
        msg.len(),
        wc.status.name(),
        text(&bm.as_slice()[..64])
    );

    let reply = b"B's data, fetched by RDMA READ";
    let rlen = reply.len() as u64;
    bm.as_mut_slice()[4096..4096 + reply.len()].copy_from_slice(reply);
    let wc = qa.read(&mut am, 4096..4096 + rlen, bm.remote(4096..4096 + rlen)?)?;
    crate::outln!(
        "   READ {} B B -> A: completion {}; A's memory now reads \"{}\"",
        reply.len(),
        wc.status.name(),
        text(&am.as_slice()[4096..4096 + 64])
    );

    bm.as_mut_slice()[8192..8200].copy_from_slice(&41u64.to_ne_bytes());
    let wc = qa.fetch_add(&mut am, 8192, bm.remote(8192..8200)?, 1)?;
    crate::outln!(
        "   FETCH_AND_ADD(+1) on B's counter: completion {}; A received the old value {}, B's counter is now {}",
        wc.status.name(),
        u64_at(am.as_slice(), 8192),
        u64_at(bm.as_slice(), 8192)
    );

    crate::outln!("\n   Classic mistake: WRITE to an MR registered without REMOTE_WRITE");
    let cm = pd_b.register(buffer(4096)?, AccessFlags::LOCAL_WRITE)?;
    // B hands out (address, rkey) of an MR without remote rights: only the responder's key
    // check can refuse the WRITE.
    let wc = qa.write(&am, 0..8, cm.remote(0..8)?)?;
    crate::outln!(
        "   WRITE with B's rkey {:#010x} (LOCAL_WRITE only): completion {}{}",
        cm.rkey(),
        wc.status.name(),
        if wc.status == WcStatus::RemAccessErr {
            " (IBV_WC_REM_ACCESS_ERR: the responder's key check refused it)"
        } else {
            " (unexpected)"
        }
    );
    if let Ok(st) = qa.state() {
        crate::outln!("   A's QP is now in state {st:?}: an RC error is fatal to the connection");
    }
    // QPs first, then the MRs (deregistered, then their buffers freed), then the PDs.
    drop((qa, qb));
    drop((am, bm, cm));
    Ok(())
}

/// 2000 messages of 4 KiB: reg/dereg per message vs slots of an MR pool.
fn pool_vs_per_message(ctx: &Context, n: &mut u32) -> mrkit::Result<()> {
    use mrkit::pool::{MrPool, PoolConfig};
    const MESSAGES: usize = 2000;
    step(
        n,
        "Pool vs per-message registration: 2000 messages of 4 KiB",
    );
    let pd = ctx.alloc_pd()?;
    let dev = ctx.provider();
    // Each MR holds a reference to the buffer until it is deregistered: between messages the
    // buffer is ours alone again and can be written.
    let mut buf = Arc::new(buffer(1 << 20)?);
    let msg = [0x5au8; 4096];
    let t = Instant::now();
    for i in 0..MESSAGES {
        let off = (i % 256) * 4096;
        Arc::get_mut(&mut buf)
            .ok_or_else(|| err("buffer still registered"))?
            .as_mut_slice()[off..off + 4096]
            .copy_from_slice(&msg);
        let mem = UserMemory::owned_range(buf.clone(), off as u64, 4096)
            .ok_or_else(|| err("range outside the buffer"))?;
        let iova = buf.addr() + off as u64;
        let mr = dev.reg_mr(
            pd.handle(),
            mem,
            iova,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )?;
        dev.dereg_mr(mr.lkey)?;
    }
    let per = t.elapsed();
    let pool = MrPool::new(
        &pd,
        PoolConfig {
            chunk_size: 4 << 20,
            ..PoolConfig::default()
        },
    )?;
    drop(pool.alloc()?); // the first chunk is registered once, here
    let t = Instant::now();
    for _ in 0..MESSAGES {
        let mut s = pool.alloc()?;
        s.as_mut_slice()[..4096].copy_from_slice(&msg);
        std::hint::black_box(s.lkey());
    }
    let pooled = t.elapsed();
    let ns = |d: Duration| d.as_nanos() as f64 / MESSAGES as f64;
    crate::outln!(
        "   {:<34} {:>7.2} ms total, {:>8.0} ns per message",
        "per-message reg_mr + dereg_mr:",
        per.as_secs_f64() * 1e3,
        ns(per)
    );
    crate::outln!(
        "   {:<34} {:>7.2} ms total, {:>8.0} ns per message",
        "MrPool slot (alloc, copy, free):",
        pooled.as_secs_f64() * 1e3,
        ns(pooled)
    );
    crate::outln!(
        "   the pool is {:.0}x faster: register once, reuse the keys (`mrkit bench` measures more)",
        per.as_secs_f64() / pooled.as_secs_f64().max(1e-9)
    );
    Ok(())
}
