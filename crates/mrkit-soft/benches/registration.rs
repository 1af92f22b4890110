//! Registration cost beside its floor, in the same run.
//!
//! For each size (4 KiB … 1 GiB), backing (4 KiB pages vs THP) and residency (resident vs
//! fresh: MADV_DONTNEED before every iteration, so pages must be faulted in), it times:
//! * `reg+dereg`: `Context::reg_mr` + `dereg_mr` on mrkit0 (validation, accounting, pin,
//!   page walk, DONTFORK, keys, stats);
//! * floor `pin`: the kernel long-term pin alone (io_uring fixed buffer register + unregister)
//!   plus the batched pagemap walk — what any registration must do;
//! * `mlock`: mlock + munlock of the same range (the other kernel floor).
//!
//! `cargo bench -p mrkit-soft --bench registration` prints a table (and `--json` a JSON line
//! per row). Under `cargo test` (no `--bench` argument) it runs one tiny row as a smoke test.

use std::time::{Duration, Instant};

use mrkit_soft::mem::pin::{pin_via, PinPath};
use mrkit_soft::mem::translate;
use mrkit_soft::{AccessFlags, Context, DeviceConfig};
use rustix::mm::{self, Advice, MapFlags, ProtFlags};

struct Region {
    raw: usize,
    map_len: usize,
    base: *mut u8,
    len: usize,
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the whole mapping is ours and nothing refers to it any more.
        unsafe { mm::munmap(self.raw as *mut _, self.map_len).expect("munmap") };
    }
}

impl Region {
    fn new(len: usize, thp: bool) -> Region {
        let huge = 2 << 20;
        let map_len = len + if thp { huge } else { 0 };
        // SAFETY: fresh anonymous mapping.
        let raw = unsafe {
            mm::mmap_anonymous(
                std::ptr::null_mut(),
                map_len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
            .expect("mmap")
        } as usize;
        let base = if thp {
            (raw + huge - 1) & !(huge - 1)
        } else {
            raw
        };
        if thp {
            // SAFETY: inside our mapping.
            unsafe { mm::madvise(base as *mut _, len, Advice::LinuxHugepage).expect("madvise") };
        }
        let r = Region {
            raw,
            map_len,
            base: base as *mut u8,
            len,
        };
        r.touch();
        r
    }
    fn touch(&self) {
        for off in (0..self.len).step_by(4096) {
            // SAFETY: inside our writable mapping.
            unsafe { self.base.add(off).write_volatile(1) };
        }
    }
    fn drop_pages(&self) {
        // SAFETY: inside our mapping; contents are disposable.
        unsafe {
            mm::madvise(self.base as *mut _, self.len, Advice::LinuxDontNeed).expect("dontneed")
        };
    }
    fn addr(&self) -> u64 {
        self.base as u64
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let json = std::env::args().any(|a| a == "--json");
    let quick = std::env::var("MRKIT_BENCH_QUICK").is_ok() || !bench;
    let sizes: &[usize] = if !bench {
        &[4096]
    } else if quick {
        &[4 << 10, 64 << 10, 2 << 20, 64 << 20]
    } else {
        &[4 << 10, 64 << 10, 2 << 20, 64 << 20, 1 << 30]
    };
    let dontfork = std::env::var("MRKIT_DONTFORK")
        .map(|v| v != "0")
        .unwrap_or(false);
    let ctx = Context::open(DeviceConfig::rxe().dontfork(dontfork));
    let pd = ctx.alloc_pd().unwrap();
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    if !json {
        println!(
            "{:>9} {:>5} {:>8} | {:>12} {:>12} {:>7} {:>9} | {:>12} | path",
            "size", "pages", "resident", "reg+dereg us", "floor us", "ratio", "over us", "mlock us"
        );
    }
    for &size in sizes {
        for thp in [false, true] {
            if thp && size < (2 << 20) {
                continue;
            }
            for fresh in [false, true] {
                let iters: u32 = if !bench {
                    2
                } else {
                    ((256u64 << 20) / size as u64).clamp(3, 20_000) as u32
                };
                let iters = if fresh { iters.min(200) } else { iters };
                let r = Region::new(size, thp);
                // Warm up every path once.
                // SAFETY: test memory: it stays allocated while any work request can reach this MR.
                let m = ctx
                    .reg_mr_va(
                        pd,
                        unsafe { mrkit_soft::UserMemory::new(r.addr(), size as u64) },
                        access,
                    )
                    .unwrap();
                let path = m.pin_path.unwrap();
                let page = m.page_size;
                ctx.dereg_mr(m.lkey).unwrap();
                // Interleave the three measurements (alternating their order) so that drift and
                // VM-cold effects hit them equally.
                let (mut reg, mut floor, mut ml) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
                let ml_iters = iters.min(2000);
                for i in 0..iters {
                    let mut run = |which: u32| {
                        if which == 2 && i >= ml_iters {
                            return;
                        }
                        if fresh {
                            r.drop_pages();
                        }
                        let t = Instant::now();
                        match which {
                            0 => {
                                // SAFETY: test memory: it stays allocated while any work request can reach this MR.
                                let m = ctx
                                    .reg_mr_va(
                                        pd,
                                        unsafe {
                                            mrkit_soft::UserMemory::new(r.addr(), size as u64)
                                        },
                                        access,
                                    )
                                    .unwrap();
                                ctx.dereg_mr(m.lkey).unwrap();
                            }
                            1 => {
                                let p = pin_via(path, r.addr(), size as u64, true).unwrap();
                                let w = translate::walk(r.addr(), size as u64).unwrap();
                                std::hint::black_box(&w);
                                drop(p);
                            }
                            _ => {
                                drop(pin_via(PinPath::Mlock, r.addr(), size as u64, true).unwrap())
                            }
                        }
                        let d = t.elapsed();
                        match which {
                            0 => reg += d,
                            1 => floor += d,
                            _ => ml += d,
                        }
                    };
                    let order = if i % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
                    for w in order {
                        run(w);
                    }
                }
                let (reg, floor, ml) = (reg / iters, floor / iters, ml / ml_iters);
                let ratio = us(reg) / us(floor);
                let over = us(reg) - us(floor);
                let pages = if page > 4096 { "THP" } else { "4K" };
                if json {
                    println!(
                        "{{\"size\":{size},\"pages\":\"{pages}\",\"resident\":{},\"reg_dereg_us\":{:.3},\"floor_us\":{:.3},\"ratio\":{:.3},\"over_us\":{:.3},\"mlock_us\":{:.3},\"path\":\"{}\"}}",
                        !fresh, us(reg), us(floor), ratio, over, us(ml), path.name()
                    );
                } else {
                    println!(
                        "{:>9} {:>5} {:>8} | {:>12.2} {:>12.2} {:>7.3} {:>9.2} | {:>12.2} | {}",
                        size,
                        pages,
                        if fresh { "fresh" } else { "yes" },
                        us(reg),
                        us(floor),
                        ratio,
                        over,
                        us(ml),
                        path.name()
                    );
                }
                drop(r);
            }
        }
    }
}
