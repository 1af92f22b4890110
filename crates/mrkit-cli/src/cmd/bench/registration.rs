//! Registration cost against buffer size (4 KiB pages and THP), beside the floors of the bare
//! pinning mechanisms (mlock+munlock, io_uring fixed buffers) on the same buffer.

use std::sync::Arc;
use std::time::Instant;

use mrkit::{AccessFlags, Buffer, BufferOptions, Context};
use mrkit_soft::mem::pin::{self, PinPath};
use mrkit_soft::UserMemory;

pub(super) fn median(v: &mut [u64]) -> u64 {
    if v.is_empty() {
        return 0;
    }
    v.sort_unstable();
    v[v.len() / 2]
}

pub(super) fn reps_for(size: u64) -> usize {
    ((1u64 << 30) / size).clamp(5, 200) as usize
}

pub(super) struct Point {
    pub(super) size: u64,
    pub(super) page: &'static str,
    pub(super) reg_ns: Option<u64>,
    pub(super) dereg_ns: Option<u64>,
    pub(super) page_size_seen: u64,
    pub(super) entries: u64,
    pub(super) error: Option<String>,
}

impl Point {
    /// A point of `size` bytes (4 KiB pages or THP) that could not be measured.
    pub(super) fn failed(size: u64, thp: bool, error: String) -> Point {
        Point {
            size,
            page: if thp { "thp" } else { "4k" },
            reg_ns: None,
            dereg_ns: None,
            page_size_seen: 0,
            entries: 0,
            error: Some(error),
        }
    }
}

pub(super) fn alloc(size: u64, thp: bool) -> Option<Buffer> {
    Buffer::with_options(
        size as usize,
        BufferOptions {
            thp,
            populate: true,
            offset: 0,
        },
    )
    .ok()
}

/// Median reg and dereg of `buf` on any device, through the provider (the generic API).
pub(super) fn reg_point(ctx: &Context, pd: u32, buf: &Arc<Buffer>, thp: bool) -> Point {
    let dev = ctx.provider();
    let size = buf.len() as u64;
    let mut regs = Vec::new();
    let mut deregs = Vec::new();
    let mut info = (0, 0);
    for _ in 0..reps_for(size) {
        // The MR holds a reference to the buffer until it is deregistered.
        let mem = UserMemory::owned(buf.clone());
        let t = Instant::now();
        let r = dev.reg_mr(pd, mem, buf.addr(), AccessFlags::LOCAL_WRITE);
        let reg = t.elapsed().as_nanos() as u64;
        match r {
            Ok(mr) => {
                info = (mr.page_size, mr.entries);
                let t = Instant::now();
                let _ = dev.dereg_mr(mr.lkey);
                deregs.push(t.elapsed().as_nanos() as u64);
                regs.push(reg);
            }
            Err(e) => return Point::failed(size, thp, e.to_string()),
        }
    }
    Point {
        size,
        page: if thp { "thp" } else { "4k" },
        reg_ns: Some(median(&mut regs)),
        dereg_ns: Some(median(&mut deregs)),
        page_size_seen: info.0,
        entries: info.1,
        error: None,
    }
}

pub(super) fn floor_point(path: PinPath, buf: &Buffer) -> Result<u64, String> {
    let size = buf.len() as u64;
    let mut v = Vec::new();
    for _ in 0..reps_for(size) {
        let t = Instant::now();
        let p = pin::pin_via(path, buf.addr(), size, true).map_err(|e| e.to_string())?;
        drop(p);
        v.push(t.elapsed().as_nanos() as u64);
    }
    Ok(median(&mut v))
}

/// One floor row: the size, its mlock+munlock median, and its io_uring median (None when
/// io_uring pinning is unavailable).
pub(super) type Floor = (u64, Result<u64, String>, Option<Result<u64, String>>);
