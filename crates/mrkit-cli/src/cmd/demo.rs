//! `mrkit demo`: a guided run on the embedded device.

use clap::Args;
use mrkit::{AccessFlags, Buffer, BufferOptions, Context, DeviceConfig};
use mrkit_soft::mr::KeyUse;

use crate::exit;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Skip the pauses between steps (kept for scripts; the demo never waits for input).
    #[arg(long)]
    quiet: bool,
}

fn step(n: u32, title: &str) {
    println!("\n== {n}. {title}");
}

fn show<T>(what: &str, r: mrkit::Result<T>) -> Option<T> {
    match r {
        Ok(v) => {
            println!("   {what}: ok");
            Some(v)
        }
        Err(e) => {
            println!("   {what}: {e}");
            None
        }
    }
}

pub fn run(_a: DemoArgs) -> u8 {
    match run_inner() {
        Ok(()) => exit::OK,
        Err(e) => {
            eprintln!("mrkit demo: unexpected failure: {e}");
            exit::VERB_FAILED
        }
    }
}

fn run_inner() -> mrkit::Result<()> {
    let ctx = Context::open_default()?;
    let attr = ctx.query_device();
    println!(
        "mrkit demo: memory registration on {} (a software RDMA device; no NIC needed)",
        ctx.name()
    );
    println!(
        "   max_mr {}  max_mr_size {:#x}  translation entries 2^{}  ODP caps {:#x}",
        attr.max_mr, attr.max_mr_size, attr.log_num_mtt, attr.odp_general_caps
    );

    step(
        1,
        "Register 64 KiB for remote writes: pinned pages, translation, keys",
    );
    let pd = ctx.alloc_pd()?;
    let buf = Buffer::with_options(
        64 << 10,
        BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .map_err(|e| mrkit::Error::new(mrkit::Errno::ENOMEM, e.to_string()))?;
    let mr = pd.register(buf, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    let i = mr.info();
    println!(
        "   lkey {:#010x} = rkey {:#010x}  ({} pages of {} B, pinned through {})",
        i.lkey,
        i.rkey,
        i.entries,
        i.page_size,
        i.pin_path.map(|p| p.name()).unwrap_or("-")
    );
    println!("   key = (index << 8) | generation: a deregistered key never matches a later MR");

    step(2, "Classic mistake: REMOTE_WRITE without LOCAL_WRITE");
    show(
        "register(REMOTE_WRITE)",
        pd.register(Buffer::new(4096).expect("alloc"), AccessFlags::REMOTE_WRITE),
    );

    step(
        3,
        "Classic mistake: a writable registration of a read-only mapping",
    );
    let mut ro = Buffer::with_options(
        8192,
        BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .expect("alloc");
    ro.make_readonly().expect("mprotect");
    show(
        "register(read-only buffer, LOCAL_WRITE)",
        pd.register(ro, AccessFlags::LOCAL_WRITE),
    );
    let mut ro = Buffer::with_options(
        8192,
        BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .expect("alloc");
    ro.make_readonly().expect("mprotect");
    if let Some(mr_ro) = show(
        "register(read-only buffer, REMOTE_READ)",
        pd.register(ro, AccessFlags::REMOTE_READ),
    ) {
        println!(
            "   pinned through {} (io_uring always pins writable)",
            mr_ro.info().pin_path.map(|p| p.name()).unwrap_or("-")
        );
        let mut mr_ro = mr_ro;
        show(
            "rereg to LOCAL_WRITE without a new translation",
            mr_ro.set_access(AccessFlags::LOCAL_WRITE),
        );
    }

    step(4, "Using a key after dereg: the device refuses it");
    let soft = ctx.soft().expect("embedded device");
    let stale = mr.lkey();
    let iova = mr.info().iova;
    drop(mr);
    match soft.check_access(stale, pd.handle(), AccessFlags::REMOTE_WRITE, iova, 8, KeyUse::Remote, 0) {
        Ok(_) => println!("   BUG: stale key accepted"),
        Err(d) => println!("   remote WRITE with stale rkey {stale:#010x}: refused ({d:?}) -> IBV_WC_REM_ACCESS_ERR"),
    }

    step(
        5,
        "A NIC with max_mr = 1000 (the seed's ConnectX-5 default)",
    );
    let small = mrkit_soft::Context::open(DeviceConfig::rxe().max_mr(1000));
    let spd = small.alloc_pd()?;
    let page = Buffer::with_options(
        4096,
        BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .expect("alloc");
    let mut keys = Vec::new();
    for _ in 0..1000 {
        keys.push(
            small
                .reg_mr_va(spd, page.addr(), 4096, AccessFlags::LOCAL_WRITE)?
                .lkey,
        );
    }
    println!("   1000 registrations of the same page: ok (each pins it again)");
    show(
        "registration 1001",
        small.reg_mr_va(spd, page.addr(), 4096, AccessFlags::LOCAL_WRITE),
    );
    for k in keys {
        small.dereg_mr(k)?;
    }

    step(
        6,
        "Translation capacity: 2^9 entries, 4 MiB of 4 KiB pages vs THP",
    );
    let tiny = Context::open(DeviceConfig::rxe().log_num_mtt(9));
    let tpd = tiny.alloc_pd()?;
    let small_pages = Buffer::with_options(
        4 << 20,
        BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .expect("alloc");
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
        println!(
            "   {} entries of {} B",
            m.info().entries,
            m.info().page_size
        );
    }

    step(7, "Deallocating a PD that still has MRs");
    let raw = Context::open(DeviceConfig::rxe());
    let s = raw.soft().expect("embedded");
    let p = s.alloc_pd()?;
    let b = Buffer::with_options(
        4096,
        BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .expect("alloc");
    let m = s.reg_mr_va(p, b.addr(), 4096, AccessFlags::empty())?;
    show("dealloc_pd with a live MR", s.dealloc_pd(p));
    s.dereg_mr(m.lkey)?;
    show("dealloc_pd after dereg", s.dealloc_pd(p));

    let st = soft.stats();
    println!(
        "\nstatistics of this run: {} registrations, {} failures, peak pinned {} bytes",
        st.registrations,
        st.failures.iter().map(|(_, c)| c).sum::<u64>(),
        st.pinned_bytes_peak
    );
    Ok(())
}
