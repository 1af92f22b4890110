//! The one module of the data path allowed `unsafe`: moving bytes into and out of registered
//! memory.
//!
//! Every function takes an [`MrGuard`] (the proof returned by
//! [`Context::check_access`](crate::driver::Context::check_access)) plus an offset and a length inside
//! the guard's checked range, and asserts `offset + len <= guard.len` before touching memory.
//! While the guard lives the MR cannot finish deregistration (dereg drains guards), so the
//! pages stay pinned; after dereg returns no guard exists and no function here can reach that
//! memory. Copies behave as `memmove`, so overlapping source and destination (a QP writing
//! into the MR it reads from) are fine.
//!
//! # Protected or unmapped registered memory
//!
//! The application may `mprotect` or `munmap` registered memory while it is registered; a NIC
//! keeps reading and writing the pinned frames regardless. The copies here never fault the
//! process: they are fault-recovering (`mem::uaccess`: a fault inside the copy resumes at a
//! fixup instead of raising SIGSEGV/SIGBUS), and the part a fault stopped is finished the way
//! a NIC's DMA would, through the frames:
//!
//! 1. io_uring-pinned MRs (the default for writable memory): through the kernel's references
//!    to the pinned pages (`IORING_OP_READ_FIXED` / `WRITE_FIXED` via a pipe). Works after
//!    `mprotect(PROT_READ)`, `PROT_NONE` and `munmap`: the bytes land in (or come from) the
//!    pinned frames, as on hardware.
//! 2. Otherwise (mlock-pinned MRs, or if step 1 fails): `/proc/self/mem`, which reaches the
//!    frames still mapped at the address whatever their protection.
//! 3. If neither reaches the frames (an mlock-pinned range that was unmapped: mlock holds no
//!    page reference, so its frames went back to the kernel with the mapping), the copy fails
//!    with [`Unreachable`] naming the side it could not reach, and the caller turns it into the
//!    error a NIC reports for a DMA it cannot do: the responder NAKs with a remote access
//!    error (a SEND's receive buffer: the receive completes with LOC_PROT_ERR and the NAK is
//!    a remote operational error; QP → ERR), the requester completes the WQE with
//!    LOC_PROT_ERR (QP → ERR)
//!    (`docs/datapath.md`, "Protected or unmapped registered memory"). No byte is invented:
//!    a read never hands out zeros for memory it could not reach, and a write that did not
//!    land is never acknowledged.
//!
//! The fault-free path costs what the copy costs (a `rep movsb`); only a copy that faulted
//! pays the syscalls of the slow path.

use crate::mem::pin::{Dma, PinPath};
use crate::mem::uaccess::{self, Left};
use crate::mr::MrGuard;
use parking_lot::Mutex;

fn span(g: &MrGuard, off: u64, len: usize) -> *mut u8 {
    let end = off.checked_add(len as u64).expect("copy range overflows");
    assert!(
        end <= g.len,
        "copy outside the checked range ({off}+{len} > {})",
        g.len
    );
    (g.va + off) as *mut u8
}

/// A copy could not reach registered memory: the range is unmapped and its pin holds no page
/// reference (mlock path), so no frame is left to move the bytes to or from (module docs).
/// Names the side that failed; the caller reports the error a NIC gives for that side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unreachable {
    /// The source (memory read from) could not be read.
    Src,
    /// The destination (memory written to) could not be written.
    Dst,
}

/// Set when the slow path could not reach an MR's frames (logged once). Relaxed: it orders
/// nothing, it only keeps the warning to one line per process.
static UNREACHABLE_WARNED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The slow path of a faulted copy: move `dma` to/from the frames of `g`'s MR at `va` (inside
/// the guard's checked range), pin by pin, as a NIC's DMA would (module docs). Returns whether
/// every byte was moved; when not, the operation must fail (the bytes not moved are unknown).
fn through_frames(g: &MrGuard, va: u64, mut dma: Dma<'_>) -> bool {
    let len = match &dma {
        Dma::ToFrames(b) => b.len(),
        Dma::FromFrames(b) => b.len(),
    } as u64;
    let ok = g.mr().with_pins(|pins| {
        let mut done = 0u64;
        let mut all = true;
        while done < len {
            let at = va + done;
            // The pin holding `at` (pins of one MR are consecutive pieces of its range), and the
            // bytes of this transfer inside it.
            let pin = pins
                .iter()
                .find(|p| p.start() <= at && at - p.start() < p.len());
            let n = pin.map_or(len - done, |p| (p.start() + p.len() - at).min(len - done));
            let (lo, hi) = (done as usize, (done + n) as usize);
            let piece = match &mut dma {
                Dma::ToFrames(b) => Dma::ToFrames(&b[lo..hi]),
                Dma::FromFrames(b) => Dma::FromFrames(&mut b[lo..hi]),
            };
            let moved = match pin {
                Some(p) if p.path() == PinPath::IoUring => match p.dma(at, piece) {
                    Ok(()) => true,
                    Err(_) => {
                        let piece = match &mut dma {
                            Dma::ToFrames(b) => Dma::ToFrames(&b[lo..hi]),
                            Dma::FromFrames(b) => Dma::FromFrames(&mut b[lo..hi]),
                        };
                        uaccess::proc_mem(at, piece).is_ok()
                    }
                },
                _ => uaccess::proc_mem(at, piece).is_ok(),
            };
            if !moved {
                all = false;
                break;
            }
            done += n;
        }
        all
    });
    if !ok && !UNREACHABLE_WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            "registered memory at {va:#x} (+{len}) is unmapped and its pin holds no page \
             reference (mlock path): operations on it fail (remote access / local protection \
             errors); deregister memory before unmapping it"
        );
    }
    ok
}

/// Copy `data` into registered memory at `p` (inside `g`'s checked range), finishing through
/// the frames if the copy faults.
fn write_guarded(g: &MrGuard, p: *mut u8, data: &[u8]) -> Result<(), Unreachable> {
    // SAFETY: [p, p + len) lies inside the range check_access validated against the MR and the
    // guard keeps the MR registered (pinned) for the duration of the copy; `data` is a slice.
    let left = unsafe { uaccess::copy(p, data.as_ptr(), data.len()) };
    let ok = match left {
        Left::Nothing => true,
        Left::Tail { at } => through_frames(g, p as u64 + at as u64, Dma::ToFrames(&data[at..])),
        Left::Head { n } => through_frames(g, p as u64, Dma::ToFrames(&data[..n])),
    };
    ok.then_some(()).ok_or(Unreachable::Dst)
}

/// Copy registered memory at `p` (inside `g`'s checked range) into `out`, finishing through
/// the frames if the copy faults.
fn read_guarded(g: &MrGuard, p: *const u8, out: &mut [u8]) -> Result<(), Unreachable> {
    // SAFETY: as in `write_guarded`, with the registered range as the source.
    let left = unsafe { uaccess::copy(out.as_mut_ptr(), p, out.len()) };
    let ok = match left {
        Left::Nothing => true,
        Left::Tail { at } => {
            through_frames(g, p as u64 + at as u64, Dma::FromFrames(&mut out[at..]))
        }
        Left::Head { n } => through_frames(g, p as u64, Dma::FromFrames(&mut out[..n])),
    };
    ok.then_some(()).ok_or(Unreachable::Src)
}

/// Copy `src.len()` bytes from a slice into registered memory at `dst.va + off`.
/// `Err(Unreachable::Dst)`: the memory could not be reached (module docs); some of the bytes
/// may have landed.
pub(crate) fn write_from(dst: &MrGuard, off: u64, src: &[u8]) -> Result<(), Unreachable> {
    if src.is_empty() {
        return Ok(());
    }
    let p = span(dst, off, src.len());
    write_guarded(dst, p, src)
}

/// Copy registered memory at `src.va + off` into a slice. `Err(Unreachable::Src)`: the memory
/// could not be reached; the contents of `dst` are then unspecified and must not be used.
pub(crate) fn read_into(src: &MrGuard, off: u64, dst: &mut [u8]) -> Result<(), Unreachable> {
    if dst.is_empty() {
        return Ok(());
    }
    let p = span(src, off, dst.len());
    read_guarded(src, p, dst)
}

/// Copy `len` bytes between two registered ranges; the error names the side that could not
/// be reached (the destination may then hold part of the bytes).
pub(crate) fn mem_to_mem(
    dst: &MrGuard,
    doff: u64,
    src: &MrGuard,
    soff: u64,
    len: usize,
) -> Result<(), Unreachable> {
    if len == 0 {
        return Ok(());
    }
    let d = span(dst, doff, len);
    let s = span(src, soff, len);
    // SAFETY: both ranges were validated by check_access and are kept registered by their
    // guards; the copy tolerates overlap and faults.
    let left = unsafe { uaccess::copy(d, s, len) };
    let (lo, hi) = match left {
        Left::Nothing => return Ok(()),
        Left::Tail { at } => (at, len),
        Left::Head { n } => (0, n),
    };
    // The rest through a bounce buffer: the source bytes not copied yet are intact (a memmove
    // only overwrites source bytes it has read already).
    let mut tmp = vec![0u8; hi - lo];
    // SAFETY: offsets inside the validated ranges.
    read_guarded(src, unsafe { s.add(lo) }, &mut tmp)?;
    // SAFETY: as above.
    write_guarded(dst, unsafe { d.add(lo) }, &tmp)
}

/// Copy a batch of `(dst guard, dst offset, src guard, src offset, len)` pieces, in order,
/// with **one copy per run of pieces that are contiguous on both sides** (the loopback
/// responder's coalesced WRITE placement: 4 KiB packets of one message become one large copy).
/// Every piece is bounds-checked against its own guard exactly as [`mem_to_mem`]; a run is the
/// union of adjacent ranges each covered by a live guard, so it is covered too. Runs whose
/// source and destination overlap are not merged (piecewise order would matter). A run that
/// faults is redone piece by piece through [`mem_to_mem`] (its ranges do not overlap, so
/// copying a piece again is harmless).
///
/// Stops at the first piece that cannot be reached and returns its index and side (the
/// pieces after it are not copied; the ones before it are).
pub(crate) fn mem_to_mem_batch(
    items: &[(&MrGuard, u64, &MrGuard, u64, usize)],
) -> Result<(), (usize, Unreachable)> {
    let mut i = 0;
    while i < items.len() {
        let (dg, doff, sg, soff, len) = items[i];
        let d0 = span(dg, doff, len) as usize;
        let s0 = span(sg, soff, len) as usize;
        let mut run = len;
        let mut j = i + 1;
        while j < items.len() {
            let (dg2, doff2, sg2, soff2, len2) = items[j];
            let d = span(dg2, doff2, len2) as usize;
            let s = span(sg2, soff2, len2) as usize;
            let total = run + len2;
            let disjoint = d0 + total <= s0 || s0 + total <= d0;
            if d != d0 + run || s != s0 + run || !disjoint {
                break;
            }
            run = total;
            j += 1;
        }
        if j == i + 1 {
            mem_to_mem(dg, doff, sg, soff, len).map_err(|u| (i, u))?;
        } else if run > 0 {
            // SAFETY: [d0, d0+run) is the union of the adjacent destination pieces i..j and
            // [s0, s0+run) of the adjacent source pieces, each validated by `span` against a
            // guard that is alive for this call (the guards keep their MRs registered and
            // pinned); the two unions do not overlap (checked above).
            let left = unsafe { uaccess::copy(d0 as *mut u8, s0 as *const u8, run) };
            if left != Left::Nothing {
                for (k, &(dg, doff, sg, soff, len)) in items.iter().enumerate().take(j).skip(i) {
                    mem_to_mem(dg, doff, sg, soff, len).map_err(|u| (k, u))?;
                }
            }
        }
        i = j;
    }
    Ok(())
}

/// One lock for every atomic the device executes (IBV_ATOMIC_HCA: atomic with respect to
/// other device atomics, as rxe's global spinlock). Process-wide so that two device
/// instances in one process (loopback "hosts") targeting the same memory stay atomic; one per
/// process so that a forked child never waits for a lock a parent thread held at `fork`.
static ATOMIC_LOCK: crate::mem::PerProcess<Mutex<()>> = crate::mem::PerProcess::new();

/// Atomic operation on a native-endian u64.
#[derive(Debug, Clone, Copy)]
pub(crate) enum AtomicOp {
    CmpSwap { compare: u64, swap: u64 },
    FetchAdd { add: u64 },
}

/// Execute an atomic at `g.va` (8 bytes, 8-aligned: checked by the caller and asserted here).
/// Returns the original value, or `Unreachable::Dst` if the target could not be reached (then
/// nothing was written).
pub(crate) fn atomic(g: &MrGuard, op: AtomicOp) -> Result<u64, Unreachable> {
    let p = span(g, 0, 8) as *mut u64;
    assert!(p as usize % 8 == 0, "atomic target must be 8-byte aligned");
    let _l = ATOMIC_LOCK.get_or_init(|| Mutex::new(())).lock();
    // One 8-byte load and one 8-byte store under the lock, as before with volatile accesses,
    // but fault-recovering: a protected or unmapped target goes through the frames.
    // SAFETY: 8 aligned bytes inside the checked range; the guard keeps them registered.
    let orig = match unsafe { uaccess::get8(p) } {
        Some(v) => v,
        None => {
            let mut b = [0u8; 8];
            if !through_frames(g, p as u64, Dma::FromFrames(&mut b)) {
                return Err(Unreachable::Dst);
            }
            u64::from_ne_bytes(b)
        }
    };
    let new = match op {
        AtomicOp::CmpSwap { compare, swap } => (orig == compare).then_some(swap),
        AtomicOp::FetchAdd { add } => Some(orig.wrapping_add(add)),
    };
    if let Some(v) = new {
        // SAFETY: as above.
        if !unsafe { uaccess::put8(p, v) }
            && !through_frames(g, p as u64, Dma::ToFrames(&v.to_ne_bytes()))
        {
            return Err(Unreachable::Dst);
        }
    }
    Ok(orig)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mr::KeyUse;
    use crate::{AccessFlags as A, Context, DeviceConfig, UserMemory};

    const PS: u64 = 4096;

    /// A guard over `len` bytes at `va` of MR `key` (no rights needed: the test copies both
    /// ways through it).
    fn guard(ctx: &Context, pd: u32, key: u32, va: u64, len: u64) -> MrGuard {
        ctx.check_access(key, pd, A::empty(), va, len, KeyUse::Local, 0)
            .unwrap()
    }

    /// Memory no frame is left behind (mlock-pinned, then unmapped): every copy reports the
    /// side it could not reach instead of inventing bytes (reads used to return zeros and
    /// writes were dropped, both as successes); reachable memory still copies.
    #[test]
    fn unreachable_memory_is_an_error_naming_its_side() {
        let ctx = Context::open(DeviceConfig::rxe());
        let pd = ctx.alloc_pd().unwrap();
        // A read-only mapping pins through mlock (io_uring refuses it), far below the
        // addresses the kernel hands out, so nothing is mapped into the hole afterwards.
        let at = 0x1800_0000_0000u64 as *mut libc::c_void;
        // SAFETY: a fresh anonymous mapping of our own at an address nothing else uses.
        let p = unsafe {
            libc::mmap(
                at,
                2 * PS as usize,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        assert_eq!(p, at);
        // SAFETY: the mapping stays reserved until the MR is deregistered (it is unmapped
        // behind the device's back, which is what this test is about).
        let mr = ctx
            .reg_mr_va(
                pd,
                unsafe { UserMemory::new(at as u64, 2 * PS) },
                A::empty(),
            )
            .unwrap();
        assert_eq!(mr.pin_path, Some(crate::mem::pin::PinPath::Mlock));
        let ok_mem = std::sync::Arc::new(vec![7u8; 2 * PS as usize]);
        let ok = ctx
            .reg_mr_va(pd, UserMemory::owned(ok_mem.clone()), A::LOCAL_WRITE)
            .unwrap();
        let ok_va = ok_mem.as_ptr() as u64;
        let gone = guard(&ctx, pd, mr.lkey, at as u64, 2 * PS);
        let fine = guard(&ctx, pd, ok.lkey, ok_va, 2 * PS);
        // While mapped (read-only), reads reach it.
        let mut buf = vec![1u8; 100];
        assert_eq!(read_into(&gone, 10, &mut buf), Ok(()));
        assert!(buf.iter().all(|&x| x == 0));
        // SAFETY: unmapping our own mapping (registered: that is the point).
        assert_eq!(unsafe { libc::munmap(at, 2 * PS as usize) }, 0);

        assert_eq!(read_into(&gone, 10, &mut buf), Err(Unreachable::Src));
        assert_eq!(write_from(&gone, PS - 8, &[9u8; 64]), Err(Unreachable::Dst));
        assert_eq!(mem_to_mem(&fine, 0, &gone, 0, 300), Err(Unreachable::Src));
        assert_eq!(mem_to_mem(&gone, 0, &fine, 0, 300), Err(Unreachable::Dst));
        assert_eq!(
            atomic(&gone, AtomicOp::FetchAdd { add: 1 }),
            Err(Unreachable::Dst)
        );
        // A batch stops at the first piece that fails and names it; the pieces before it
        // were copied.
        let src = guard(&ctx, pd, ok.lkey, ok_va + PS, PS);
        let items = [
            (&fine, 0, &src, 0, 16),
            (&gone, 64, &fine, 64, 16),
            (&fine, 32, &src, 32, 16),
        ];
        assert_eq!(mem_to_mem_batch(&items), Err((1, Unreachable::Dst)));
        // Reachable memory still copies, and the fault-free batch is Ok.
        assert_eq!(write_from(&fine, 0, &[3u8; 8]), Ok(()));
        assert_eq!(
            atomic(&fine, AtomicOp::FetchAdd { add: 1 }),
            Ok(0x0303_0303_0303_0303)
        );
        assert_eq!(mem_to_mem_batch(&items[..1]), Ok(()));
        drop((gone, fine, src));
        ctx.dereg_mr(mr.lkey).unwrap();
        ctx.dereg_mr(ok.lkey).unwrap();
    }

    /// Deferred placements (`Out::flush_copies`): a failed WRITE placement is recorded with its
    /// PSN and side, the responder's later placements are not done (their packets come after
    /// the error), and the requester's READ placements around it still land.
    #[test]
    fn a_failed_deferred_placement_stops_its_owner_only() {
        use crate::pkt::Payload;
        use crate::qp::{CopyOwner, Out};
        let ctx = Context::open(DeviceConfig::rxe());
        let pd = ctx.alloc_pd().unwrap();
        let at = 0x1800_0010_0000u64 as *mut libc::c_void;
        // SAFETY: as in the test above.
        let p = unsafe {
            libc::mmap(
                at,
                PS as usize,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        assert_eq!(p, at);
        // SAFETY: as in the test above.
        let mr = ctx
            .reg_mr_va(pd, unsafe { UserMemory::new(at as u64, PS) }, A::empty())
            .unwrap();
        // SAFETY: as in the test above.
        assert_eq!(unsafe { libc::munmap(at, PS as usize) }, 0);
        let src_mem = std::sync::Arc::new((0..PS).map(|i| i as u8).collect::<Vec<u8>>());
        let dst_mem = std::sync::Arc::new(vec![0u8; PS as usize]);
        let src = ctx
            .reg_mr_va(pd, UserMemory::owned(src_mem.clone()), A::empty())
            .unwrap();
        let dst = ctx
            .reg_mr_va(pd, UserMemory::owned(dst_mem.clone()), A::LOCAL_WRITE)
            .unwrap();
        let (s0, d0) = (src_mem.as_ptr() as u64, dst_mem.as_ptr() as u64);
        let piece = |off: u64| Payload::Mem(vec![(guard(&ctx, pd, src.lkey, s0 + off, 16), 0, 16)]);
        let to = |off: u64| guard(&ctx, pd, dst.lkey, d0 + off, 16);
        let mut out = Out::default();
        let mut place = |g: MrGuard, p: Payload, o: CopyOwner| out.place(g, p, o).unwrap();
        place(to(0), piece(0), CopyOwner::Resp { psn: 1 });
        place(to(16), piece(16), CopyOwner::Req { psn: 7 });
        place(
            guard(&ctx, pd, mr.lkey, at as u64, 16),
            piece(32),
            CopyOwner::Resp { psn: 2 },
        );
        place(to(48), piece(48), CopyOwner::Req { psn: 8 });
        place(to(64), piece(64), CopyOwner::Resp { psn: 3 });
        out.flush_copies();
        assert_eq!(out.resp_fault, Some((2, Unreachable::Dst)));
        assert_eq!(out.req_fault, None);
        assert!(out.copies.is_empty());
        assert_eq!(&dst_mem[..32], &src_mem[..32], "placed before the failure");
        assert_eq!(
            &dst_mem[48..64],
            &src_mem[48..64],
            "the other owner's placement"
        );
        assert!(
            dst_mem[64..80].iter().all(|&x| x == 0),
            "not placed after it"
        );
        drop(out);
        for k in [mr.lkey, src.lkey, dst.lkey] {
            ctx.dereg_mr(k).unwrap();
        }
    }
}
