//! `mrkit reg`: register one buffer and show what the device made of it.

use clap::Args;
use mrkit::{AccessFlags, Buffer, BufferOptions};
use serde_json::json;

use crate::exit;

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  mrkit reg --size 64KiB --access local-write,remote-read\n  mrkit reg --size 8MiB --thp --access local-write --json\n  mrkit reg --size 4096 --readonly --access local-write   # EFAULT\n  mrkit reg --size 1GiB --access remote-write            # EINVAL: needs local-write\n  mrkit reg --size 64KiB --device rdma-core:mlx5_0"
)]
pub struct RegArgs {
    /// Buffer size: 4096, 64KiB, 8MiB, 1GiB.
    #[arg(long, value_parser = parse_size)]
    size: u64,
    /// Comma-separated rights: local-write, remote-write, remote-read, remote-atomic, mw-bind,
    /// zero-based, on-demand, relaxed-ordering (or 0xHEX).
    #[arg(long, default_value = "local-write")]
    access: String,
    /// Start the registration this many bytes into the first page.
    #[arg(long, default_value_t = 0)]
    offset: usize,
    /// Register with this iova instead of the buffer address.
    #[arg(long, value_parser = parse_size)]
    iova: Option<u64>,
    /// Back the buffer with transparent huge pages (2 MiB aligned, MADV_HUGEPAGE, touched).
    #[arg(long)]
    thp: bool,
    /// Register on demand (adds on-demand to the access list).
    #[arg(long)]
    odp: bool,
    /// Make the buffer read-only (mprotect) before registering.
    #[arg(long)]
    readonly: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    mrkit_soft::device::parse_size(s)
        .ok_or_else(|| format!("`{s}` is not a size (4096, 64KiB, 8MiB, 1GiB, 0x1000)"))
}

pub fn run(a: RegArgs, dev: &super::device::Selected) -> u8 {
    let mut access = match AccessFlags::parse_list(&a.access) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("mrkit reg: {e}");
            return exit::USAGE;
        }
    };
    if a.odp {
        access |= AccessFlags::ON_DEMAND;
    }
    let ctx = match dev.open("reg") {
        Ok(c) => c,
        Err(code) => return code,
    };
    let len = match usize::try_from(a.size) {
        Ok(l) => l,
        Err(_) => {
            eprintln!("mrkit reg: size too large for this machine");
            return exit::USAGE;
        }
    };
    let mut buf = match Buffer::with_options(
        len,
        BufferOptions {
            thp: a.thp,
            populate: !a.odp,
            offset: a.offset,
        },
    ) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("mrkit reg: cannot allocate {} bytes: {e}", a.size);
            return exit::VERB_FAILED;
        }
    };
    if a.readonly {
        if let Err(e) = buf.make_readonly() {
            eprintln!("mrkit reg: mprotect: {e}");
            return exit::VERB_FAILED;
        }
    }
    let pd = match ctx.alloc_pd() {
        Ok(p) => p,
        Err(e) => return fail(&a, &e),
    };
    let iova = a.iova.unwrap_or(buf.addr());
    let addr = buf.addr();
    match pd.register_iova(buf, iova, access) {
        Ok(mr) => {
            let i = mr.info();
            if a.json {
                let v = json!({
                    "ok": true,
                    "device": ctx.name(),
                    "addr": format!("{:#x}", addr),
                    "length": i.length,
                    "iova": format!("{:#x}", i.iova),
                    "lkey": format!("{:#x}", i.lkey),
                    "rkey": format!("{:#x}", i.rkey),
                    "access": i.access.names(),
                    "kind": format!("{:?}", i.kind),
                    "pin_path": i.pin_path.map(|p| p.name()),
                    "page_size": i.page_size,
                    "page_count": i.entries,
                    "pinned_bytes": i.pinned_bytes,
                    "pfns_known": i.pfns_known,
                    "timing_ns": i.reg_timing.map(mrkit::stat_export::timing_json),
                });
                println!("{}", serde_json::to_string_pretty(&v).expect("json"));
            } else {
                println!("registered {} on {}", super::human(i.length), ctx.name());
                println!("  addr        {addr:#x}");
                println!("  iova        {:#x}", i.iova);
                println!("  lkey        {:#010x}", i.lkey);
                println!("  rkey        {:#010x}", i.rkey);
                println!("  access      {}", i.access.names().join(" | "));
                println!("  kind        {:?}", i.kind);
                println!(
                    "  pinned by   {}",
                    i.pin_path
                        .map(|p| p.name())
                        .unwrap_or("nothing (on demand)")
                );
                println!("  page size   {}", super::human(i.page_size));
                println!("  page count  {} translation entries", i.entries);
                println!("  pinned      {}", super::human(i.pinned_bytes));
                if let Some(t) = i.reg_timing {
                    let us = |ns: u64| format!("{:.1} µs", ns as f64 / 1e3);
                    println!("  took        {}", us(t.total_ns));
                    println!("    accounting  {}", us(t.accounting_ns));
                    println!("    pin         {}", us(t.pin_ns));
                    println!("    walk        {}", us(t.walk_ns));
                    println!("    translation {}", us(t.translation_ns));
                    println!("    key         {}", us(t.key_ns));
                }
                println!(
                    "  frames      {}",
                    if i.pfns_known {
                        "read from /proc/self/pagemap"
                    } else {
                        "hidden (needs CAP_SYS_ADMIN)"
                    }
                );
            }
            exit::OK
        }
        Err(e) => fail(&a, &e),
    }
}

fn fail(a: &RegArgs, e: &mrkit::Error) -> u8 {
    if a.json {
        let v = json!({
            "ok": false,
            "errno": e.errno().name(),
            "errno_value": e.errno().raw(),
            "message": e.cause(),
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    } else {
        eprintln!("mrkit reg: {e}");
    }
    exit::VERB_FAILED
}
