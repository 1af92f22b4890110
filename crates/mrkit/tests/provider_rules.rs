//! Every registration, window and data-path rule of `docs/registration.md` and
//! `docs/semantics.md` as ONE table, with the answer of each provider: the embedded mrkit0 and
//! the rdma-core provider over the project's drop-in `libibverbs.so` (which a ConnectX would
//! give the same errno / completion status as). A row whose answers differ says so in its two
//! columns, and why in its note.
//!
//! Rows that need device limits or a process without CAP_IPC_LOCK (`max_mr`, `max_mr_size`,
//! translation capacity, ODP capability, RLIMIT_MEMLOCK) run in a child process: this test
//! binary again, with the `MRKIT_*` variables that both devices read when they open (mrkit0
//! through `Context::open_default`, the drop-in's device at its first `ibv_open_device`), and
//! for memlock under `setpriv --bounding-set=-ipc_lock prlimit --memlock=…`.
//!
//! The whole table is printed (`--nocapture`) and every disagreement with a column fails the
//! test, listed.
mod providers_util;

use std::process::Command;

use providers_util::populated;
use std::time::Duration;

use mrkit::{
    AccessFlags as A, BindInfo, Context, Errno, MemoryRegion, MwType, ProtectionDomain, QpCap,
    QueuePair, RemoteSlice, WcStatus,
};

/// What a provider answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// The verb succeeded (or the work request completed with SUCCESS).
    Ok,
    /// The verb failed with this errno.
    Err(Errno),
    /// The work request completed with this status.
    Wc(WcStatus),
}
use Answer::{Err as E, Ok as OK, Wc};

/// How a row runs.
#[derive(Clone, Copy)]
enum Setup {
    /// In this process, on the provider's default device.
    Here,
    /// In a child with these `MRKIT_*` variables, and `Some(limit)`: without CAP_IPC_LOCK and
    /// with RLIMIT_MEMLOCK = limit.
    Child(&'static [(&'static str, &'static str)], Option<u64>),
}

struct Row {
    rule: &'static str,
    /// Where the rule is written down.
    doc: &'static str,
    setup: Setup,
    run: fn(&Fix) -> Answer,
    mrkit: Answer,
    rdma_core: Answer,
}

/// Per provider: its context, a PD and the test's memory.
struct Fix {
    ctx: Context,
    pd: ProtectionDomain,
    rw: Mapping,
    ro: Mapping,
    none: Mapping,
}

/// An anonymous mapping with `prot`, unmapped on drop.
struct Mapping(u64, usize);
impl Mapping {
    fn new(len: usize, prot: rustix::mm::ProtFlags) -> Mapping {
        // SAFETY: a fresh private anonymous mapping at an address the kernel chooses.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                prot,
                rustix::mm::MapFlags::PRIVATE | rustix::mm::MapFlags::POPULATE,
            )
        }
        .unwrap();
        Mapping(p as u64, len)
    }
}
impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once (every MR on it is gone by now).
        unsafe { rustix::mm::munmap(self.0 as *mut _, self.1) }.unwrap();
    }
}

fn fix(ctx: Context) -> Fix {
    use rustix::mm::ProtFlags as P;
    Fix {
        pd: ctx.alloc_pd().unwrap(),
        ctx,
        rw: Mapping::new(16 << 20, P::READ | P::WRITE),
        ro: Mapping::new(4096, P::READ),
        // Mapped but inaccessible (an unmapped hole could be reused by another thread).
        none: Mapping::new(4096, P::empty()),
    }
}

fn answer<T>(r: mrkit::Result<T>) -> Answer {
    match r {
        Ok(_) => OK,
        Err(e) => E(e.errno()),
    }
}

/// Register `[addr, addr+len)` at `iova` in the fixture's PD; dropped at once.
fn reg(f: &Fix, addr: u64, len: u64, iova: u64, access: A) -> Answer {
    // SAFETY: the fixture's mappings outlive every MR made here (each is dropped at once);
    // what cannot be registered must fail.
    answer(unsafe { f.pd.register_raw(addr, len, iova, access) })
}

fn mr(pd: &ProtectionDomain, len: usize, access: A) -> MemoryRegion {
    pd.register(populated(len), access).unwrap()
}

const ALL_REMOTE: A = A::REMOTE_WRITE
    .union(A::REMOTE_READ)
    .union(A::REMOTE_ATOMIC)
    .union(A::LOCAL_WRITE);

/// Two connected QPs of the fixture's PD, allowing every remote operation.
fn pair(f: &Fix) -> (QueuePair, QueuePair) {
    let mut q1 = QueuePair::new(&f.pd, QpCap::default()).unwrap();
    let q2 = QueuePair::new(&f.pd, QpCap::default()).unwrap();
    QueuePair::connect(
        &q1,
        &q2,
        A::REMOTE_WRITE | A::REMOTE_READ | A::REMOTE_ATOMIC,
    )
    .unwrap();
    q1.set_timeout(Some(Duration::from_secs(60)));
    (q1, q2)
}

fn wc(r: mrkit::Result<mrkit::WorkCompletion>) -> Answer {
    match r {
        Ok(w) if w.status == WcStatus::Success => OK,
        Ok(w) => Wc(w.status),
        Err(e) => E(e.errno()),
    }
}

/// An RDMA WRITE of 64 bytes from a fresh local MR to `remote`.
fn write_to(f: &Fix, remote: RemoteSlice) -> Answer {
    let (q1, _q2) = pair(f);
    let src = mr(&f.pd, 4096, A::LOCAL_WRITE);
    wc(q1.write(&src, 0..64, remote))
}

/// A type-1 window of the fixture's PD bound to `[off, off+len)` of `m` with `access`.
fn bind(f: &Fix, m: &MemoryRegion, off: u64, len: u64, access: A) -> mrkit::Result<u32> {
    let mw = f.pd.alloc_mw(MwType::Type1)?;
    let rkey = mw.rkey();
    let r = f.ctx.provider().bind_mw(
        f.pd.handle(),
        0,
        rkey,
        rkey as u8,
        BindInfo {
            mr_lkey: m.lkey(),
            addr: m.info().iova + off,
            length: len,
            access,
        },
    );
    std::mem::forget(mw); // dealloc'd with the PD's context (the row's fixture)
    r
}

fn rereg(f: &Fix, m: &MemoryRegion, flags: u32, access: A) -> Answer {
    answer(f.ctx.provider().rereg_mr(
        m.lkey(),
        flags,
        f.pd.handle(),
        mrkit_soft::UserMemory::empty_at(0),
        0,
        access,
    ))
}

const CHANGE_TRANSLATION: u32 = 0x1;
const CHANGE_PD: u32 = 0x2;
const CHANGE_ACCESS: u32 = 0x4;

fn rows() -> Vec<Row> {
    use Errno::*;
    use Setup::*;
    let here = |rule, doc, run: fn(&Fix) -> Answer, both| Row {
        rule,
        doc,
        setup: Here,
        run,
        mrkit: both,
        rdma_core: both,
    };
    let child = |rule, doc, env, memlock, run: fn(&Fix) -> Answer, both| Row {
        rule,
        doc,
        setup: Child(env, memlock),
        run,
        mrkit: both,
        rdma_core: both,
    };
    vec![
        // ---- access flags (semantics §1.2, registration "access rights") ----
        here(
            "LOCAL_WRITE",
            "semantics §1.2",
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::LOCAL_WRITE),
            OK,
        ),
        here(
            "no rights at all (local read only)",
            "semantics §1.2",
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::empty()),
            OK,
        ),
        here(
            "REMOTE_WRITE without LOCAL_WRITE",
            "semantics §1.2",
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::REMOTE_WRITE),
            E(EINVAL),
        ),
        here(
            "REMOTE_ATOMIC without LOCAL_WRITE",
            "semantics §1.2",
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::REMOTE_ATOMIC),
            E(EINVAL),
        ),
        here(
            "REMOTE_READ alone",
            "semantics §1.2",
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::REMOTE_READ),
            OK,
        ),
        here(
            "unknown access bit 10",
            "semantics §1.2",
            |f| {
                reg(
                    f,
                    f.rw.0,
                    4096,
                    f.rw.0,
                    A::LOCAL_WRITE | A::from_bits_retain(0x400),
                )
            },
            E(EINVAL),
        ),
        here(
            "unknown access bit 31",
            "semantics §1.2",
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::from_bits_retain(1 << 31)),
            E(EINVAL),
        ),
        here(
            "RELAXED_ORDERING (optional range) accepted",
            "semantics §1.2",
            |f| {
                reg(
                    f,
                    f.rw.0,
                    4096,
                    f.rw.0,
                    A::LOCAL_WRITE | A::RELAXED_ORDERING,
                )
            },
            OK,
        ),
        here(
            "another optional bit accepted",
            "semantics §1.2",
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::from_bits_retain(0x0020_0000)),
            OK,
        ),
        here(
            "FLUSH_GLOBAL (no FLUSH on this device)",
            "semantics §1.2",
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::FLUSH_GLOBAL),
            E(EOPNOTSUPP),
        ),
        // ---- ranges (semantics §2.1) ----
        here(
            "zero length",
            "semantics §2.1",
            |f| reg(f, f.rw.0, 0, f.rw.0, A::LOCAL_WRITE),
            E(EINVAL),
        ),
        here(
            "addr + length wraps the address space",
            "semantics §2.1",
            |f| reg(f, f.rw.0, u64::MAX - f.rw.0 + 2, f.rw.0, A::LOCAL_WRITE),
            E(EINVAL),
        ),
        here(
            "iova not at the address's page offset",
            "semantics §2.2",
            |f| reg(f, f.rw.0, 4096, f.rw.0 + 1, A::LOCAL_WRITE),
            E(EINVAL),
        ),
        here(
            "sub-page range, iova elsewhere at the same offset",
            "semantics §2.2",
            |f| {
                reg(
                    f,
                    f.rw.0 + 100,
                    1000,
                    0x1_0000_0064,
                    A::LOCAL_WRITE | A::REMOTE_READ,
                )
            },
            OK,
        ),
        here(
            "inaccessible (PROT_NONE) memory",
            "semantics §2.1",
            |f| reg(f, f.none.0, 4096, f.none.0, A::LOCAL_WRITE),
            E(EFAULT),
        ),
        here(
            "read-only memory, writable MR",
            "registration: Pinning",
            |f| reg(f, f.ro.0, 4096, f.ro.0, A::LOCAL_WRITE),
            E(EFAULT),
        ),
        here(
            "read-only memory, REMOTE_READ MR",
            "registration: Pinning",
            |f| reg(f, f.ro.0, 4096, f.ro.0, A::REMOTE_READ),
            OK,
        ),
        // ---- objects ----
        here(
            "reg_mr on an unknown PD",
            "semantics §2.1",
            |f| {
                // SAFETY: the mapping outlives the attempt, which must fail (no such PD).
                let mem = unsafe { mrkit_soft::UserMemory::new(f.rw.0, 4096) };
                answer(f.ctx.provider().reg_mr(0xdead, mem, f.rw.0, A::LOCAL_WRITE))
            },
            E(EINVAL),
        ),
        here(
            "dereg of an unknown key",
            "semantics §3.2",
            |f| answer(f.ctx.provider().dereg_mr(0xdead_beef)),
            E(EINVAL),
        ),
        here(
            "dereg of a deregistered key",
            "semantics §3.2",
            |f| {
                let k = mr(&f.pd, 4096, A::LOCAL_WRITE).lkey(); // dropped: deregistered
                answer(f.ctx.provider().dereg_mr(k))
            },
            E(EINVAL),
        ),
        here(
            "dealloc_pd while an MR uses it",
            "semantics §3.2",
            |f| {
                let pd = f.ctx.alloc_pd().unwrap();
                let _m = mr(&pd, 4096, A::LOCAL_WRITE);
                answer(f.ctx.provider().dealloc_pd(pd.handle()))
            },
            E(EBUSY),
        ),
        // ---- ODP (semantics §7, registration "on-demand paging") ----
        here(
            "ON_DEMAND",
            "semantics §7.1",
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::LOCAL_WRITE | A::ON_DEMAND),
            OK,
        ),
        here(
            "advise_mr PREFETCH_WRITE on an ODP MR",
            "semantics §7.3",
            |f| {
                let m = mr(&f.pd, 4096, A::LOCAL_WRITE | A::ON_DEMAND);
                answer(f.pd.advise(1, 1, &[(m.lkey(), m.info().iova, 4096)]))
            },
            OK,
        ),
        child(
            "ON_DEMAND on a device without ODP",
            "semantics §1.2, §7.1",
            &[("MRKIT_ODP", "0")],
            None,
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::LOCAL_WRITE | A::ON_DEMAND),
            E(EOPNOTSUPP),
        ),
        // ---- limits (registration "limits") ----
        child(
            "max_mr: one MR more than the device allows",
            "semantics §2.3",
            &[("MRKIT_MAX_MR", "3")],
            None,
            |f| {
                let _held: Vec<_> = (0..3).map(|_| mr(&f.pd, 4096, A::LOCAL_WRITE)).collect();
                reg(f, f.rw.0, 4096, f.rw.0, A::LOCAL_WRITE)
            },
            E(ENOMEM),
        ),
        child(
            "max_mr_size: one byte past it",
            "semantics §2.3",
            &[("MRKIT_MAX_MR_SIZE", "65536")],
            None,
            |f| reg(f, f.rw.0, 65537, f.rw.0, A::LOCAL_WRITE),
            E(EINVAL),
        ),
        child(
            "translation capacity: 4 MiB of 4 KiB pages with 2^9 entries",
            "registration: Translation",
            &[("MRKIT_LOG_NUM_MTT", "9")],
            None,
            |f| {
                // Small pages whatever the THP mode, so the MR needs 1024 entries: no page is
                // touched before the advice.
                use rustix::mm::{Advice, MapFlags, ProtFlags};
                let len = 4 << 20;
                // SAFETY: a fresh private anonymous mapping, ours until the end of this row.
                let p = unsafe {
                    rustix::mm::mmap_anonymous(
                        std::ptr::null_mut(),
                        len,
                        ProtFlags::READ | ProtFlags::WRITE,
                        MapFlags::PRIVATE,
                    )
                }
                .unwrap();
                let small = Mapping(p as u64, len);
                // SAFETY: our own mapping.
                unsafe { rustix::mm::madvise(p, len, Advice::LinuxNoHugepage) }.unwrap();
                for o in (0..len).step_by(4096) {
                    // SAFETY: our own writable mapping, inside its length.
                    unsafe { p.cast::<u8>().add(o).write(1) };
                }
                reg(f, small.0, len as u64, small.0, A::LOCAL_WRITE)
            },
            E(ENOMEM),
        ),
        child(
            "RLIMIT_MEMLOCK 64 KiB without CAP_IPC_LOCK: pinning 1 MiB",
            "registration: Pinning",
            &[],
            Some(64 << 10),
            |f| reg(f, f.rw.0, 1 << 20, f.rw.0, A::LOCAL_WRITE),
            E(ENOMEM),
        ),
        child(
            "RLIMIT_MEMLOCK 64 KiB: 16 KiB fits",
            "registration: Pinning",
            &[],
            Some(64 << 10),
            |f| reg(f, f.rw.0, 16 << 10, f.rw.0, A::LOCAL_WRITE),
            OK,
        ),
        child(
            "RLIMIT_MEMLOCK 64 KiB: ODP pins nothing",
            "registration: Pinning",
            &[],
            Some(64 << 10),
            |f| reg(f, f.rw.0, 1 << 20, f.rw.0, A::LOCAL_WRITE | A::ON_DEMAND),
            OK,
        ),
        child(
            "RLIMIT_MEMLOCK 0 without CAP_IPC_LOCK",
            "registration: Pinning",
            &[],
            Some(0),
            |f| reg(f, f.rw.0, 4096, f.rw.0, A::LOCAL_WRITE),
            E(EPERM),
        ),
        // ---- rereg (semantics §4.2) ----
        here(
            "rereg with no flags",
            "semantics §4.1, §4.2",
            |f| {
                let m = mr(&f.pd, 4096, A::LOCAL_WRITE);
                rereg(f, &m, 0, A::LOCAL_WRITE)
            },
            E(EINVAL),
        ),
        here(
            "rereg with an unknown flag",
            "semantics §4.1",
            |f| {
                let m = mr(&f.pd, 4096, A::LOCAL_WRITE);
                rereg(f, &m, 0x8, A::LOCAL_WRITE)
            },
            E(EINVAL),
        ),
        here(
            "rereg ACCESS to REMOTE_WRITE without LOCAL_WRITE",
            "semantics §4.2",
            |f| {
                let m = mr(&f.pd, 4096, A::LOCAL_WRITE);
                rereg(f, &m, CHANGE_ACCESS, A::REMOTE_WRITE)
            },
            E(EINVAL),
        ),
        here(
            "rereg ACCESS in place",
            "semantics §4.2",
            |f| {
                let m = mr(&f.pd, 4096, A::LOCAL_WRITE);
                rereg(f, &m, CHANGE_ACCESS, A::LOCAL_WRITE | A::REMOTE_READ)
            },
            OK,
        ),
        here(
            "rereg PD in place",
            "semantics §4.2",
            |f| {
                let m = mr(&f.pd, 4096, A::LOCAL_WRITE);
                let pd2 = f.ctx.alloc_pd().unwrap();
                let r = answer(f.ctx.provider().rereg_mr(
                    m.lkey(),
                    CHANGE_PD,
                    pd2.handle(),
                    mrkit_soft::UserMemory::empty_at(0),
                    0,
                    A::empty(),
                ));
                // Back, so the MR and the PD drop in order.
                f.ctx
                    .provider()
                    .rereg_mr(
                        m.lkey(),
                        CHANGE_PD,
                        f.pd.handle(),
                        mrkit_soft::UserMemory::empty_at(0),
                        0,
                        A::empty(),
                    )
                    .unwrap();
                r
            },
            OK,
        ),
        here(
            "rereg read-only pin to writable without TRANSLATION",
            "semantics §4.3",
            |f| {
                // SAFETY: the read-only mapping outlives the MR (dropped at the end of this row).
                let m = unsafe { f.pd.register_raw(f.ro.0, 4096, f.ro.0, A::REMOTE_READ) }.unwrap();
                answer(f.ctx.provider().rereg_mr(
                    m.lkey(),
                    CHANGE_ACCESS,
                    f.pd.handle(),
                    mrkit_soft::UserMemory::empty_at(0),
                    0,
                    A::LOCAL_WRITE,
                ))
            },
            E(EACCES),
        ),
        here(
            "rereg TRANSLATION with length 0",
            "semantics §4.1",
            |f| {
                let m = mr(&f.pd, 4096, A::LOCAL_WRITE);
                rereg(f, &m, CHANGE_TRANSLATION, A::LOCAL_WRITE)
            },
            E(EINVAL),
        ),
        // ---- windows (semantics §5) ----
        here(
            "bind a type-1 window inside the MR",
            "semantics §5.2",
            |f| {
                let m = mr(&f.pd, 8192, ALL_REMOTE | A::MW_BIND);
                let r = answer(bind(f, &m, 0, 4096, A::REMOTE_READ));
                std::mem::forget(m); // a bound window's MR cannot be deregistered
                r
            },
            OK,
        ),
        here(
            "bind a window past the MR's end",
            "semantics §5.2",
            |f| {
                let m = mr(&f.pd, 8192, ALL_REMOTE | A::MW_BIND);
                answer(bind(f, &m, 4096, 8192, A::REMOTE_READ))
            },
            E(EINVAL),
        ),
        here(
            "bind a window on an MR without MW_BIND",
            "semantics §5.2",
            |f| {
                let m = mr(&f.pd, 8192, ALL_REMOTE);
                answer(bind(f, &m, 0, 4096, A::REMOTE_READ))
            },
            E(EINVAL),
        ),
        here(
            "dereg of an MR with a bound window",
            "semantics §3.2, §10",
            |f| {
                let m = mr(&f.pd, 8192, ALL_REMOTE | A::MW_BIND);
                bind(f, &m, 0, 4096, A::REMOTE_READ).unwrap();
                let r = answer(f.ctx.provider().dereg_mr(m.lkey()));
                std::mem::forget(m); // still registered: its buffer must stay
                r
            },
            E(EINVAL),
        ),
        // ---- data path (semantics §6) ----
        here(
            "WRITE with a stale rkey",
            "semantics §6.4",
            |f| {
                let remote = mr(&f.pd, 4096, ALL_REMOTE).remote(0..64).unwrap(); // MR dropped
                write_to(f, remote)
            },
            Wc(WcStatus::RemAccessErr),
        ),
        here(
            "WRITE to an MR without REMOTE_WRITE",
            "semantics §6.4",
            |f| {
                let dst = mr(&f.pd, 4096, A::LOCAL_WRITE | A::REMOTE_READ);
                write_to(f, dst.remote(0..64).unwrap())
            },
            Wc(WcStatus::RemAccessErr),
        ),
        here(
            "WRITE past the end of the remote MR",
            "semantics §6.4",
            |f| {
                let dst = mr(&f.pd, 4096, ALL_REMOTE);
                let mut r = dst.remote(0..64).unwrap();
                r.addr += 4096 - 32;
                write_to(f, r)
            },
            Wc(WcStatus::RemAccessErr),
        ),
        here(
            "WRITE with an rkey of another PD",
            "semantics §6.4",
            |f| {
                let pd2 = f.ctx.alloc_pd().unwrap();
                let dst = mr(&pd2, 4096, ALL_REMOTE);
                write_to(f, dst.remote(0..64).unwrap())
            },
            Wc(WcStatus::RemAccessErr),
        ),
        here(
            "READ into a local MR without LOCAL_WRITE",
            "semantics §6.3",
            |f| {
                let (q1, _q2) = pair(f);
                let src = mr(&f.pd, 4096, ALL_REMOTE);
                let mut dst = mr(&f.pd, 4096, A::REMOTE_READ);
                wc(q1.read(&mut dst, 0..64, src.remote(0..64).unwrap()))
            },
            Wc(WcStatus::LocProtErr),
        ),
        here(
            "WRITE whose gather list has a stale lkey",
            "semantics §6.3, §9",
            |f| {
                let (q1, _q2) = pair(f);
                let dst = mr(&f.pd, 4096, ALL_REMOTE);
                let src =
                    providers_util::KeySlice(mr(&f.pd, 4096, A::LOCAL_WRITE).local(0..64).unwrap());
                wc(q1.write(&src, 0..64, dst.remote(0..64).unwrap()))
            },
            Wc(WcStatus::LocProtErr),
        ),
        here(
            "SEND larger than the posted receive (the sender's status)",
            "semantics §6.4, §9",
            |f| {
                let (q1, q2) = pair(f);
                let src = mr(&f.pd, 4096, A::LOCAL_WRITE);
                let rbuf = mr(&f.pd, 4096, A::LOCAL_WRITE);
                let _t = q2.post_recv(rbuf, 0..64).map_err(|_| ()).unwrap();
                wc(q1.send(&src, 0..128))
            },
            Wc(WcStatus::RemInvReqErr),
        ),
        here(
            "READ through a window's rkey after it is unbound",
            "semantics §5.3, §6.4",
            |f| {
                let (q1, _q2) = pair(f);
                let m = mr(&f.pd, 8192, ALL_REMOTE | A::MW_BIND);
                let mw = f.pd.alloc_mw(MwType::Type1).unwrap();
                let r0 = mw.rkey();
                let info = BindInfo {
                    mr_lkey: m.lkey(),
                    addr: m.info().iova,
                    length: 4096,
                    access: A::REMOTE_READ,
                };
                let rkey = f
                    .ctx
                    .provider()
                    .bind_mw(f.pd.handle(), 0, r0, r0 as u8, info)
                    .unwrap();
                let mut dst = mr(&f.pd, 4096, A::LOCAL_WRITE);
                let remote = RemoteSlice {
                    addr: m.info().iova,
                    len: 64,
                    rkey,
                };
                assert_eq!(
                    wc(q1.read(&mut dst, 0..64, remote)),
                    OK,
                    "a bound window reads"
                );
                drop(mw); // dealloc unbinds
                wc(q1.read(&mut dst, 0..64, remote))
            },
            Wc(WcStatus::RemAccessErr),
        ),
    ]
}

const ROW_ENV: &str = "MRKIT_RULE_ROW";
const PROVIDER_ENV: &str = "MRKIT_RULE_PROVIDER";
const TEST: &str = "every_rule_on_both_providers";

fn open(provider: &str) -> Context {
    match provider {
        // In a child: the MRKIT_* limits of the row apply (as they do to the drop-in).
        "mrkit" => Context::open_default().unwrap(),
        _ => providers_util::rdma_core(),
    }
}

/// Run row `i` on `provider` in a child process; its answer.
fn in_child(i: usize, provider: &str, env: &[(&str, &str)], memlock: Option<u64>) -> String {
    let exe = std::env::current_exe().unwrap();
    let mut c = match memlock {
        Some(limit) => {
            let mut c = Command::new("setpriv");
            c.args([
                "--inh-caps=-ipc_lock",
                "--bounding-set=-ipc_lock",
                "--",
                "prlimit",
            ])
            .arg(format!("--memlock={limit}:{limit}"))
            .arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    c.args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROW_ENV, i.to_string())
        .env(PROVIDER_ENV, provider)
        .env_remove(mrkit::DEVICE_ENV)
        .env("MRKIT_STAT", "0");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c
        .output()
        .expect("run the child (setpriv, prlimit: util-linux)");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    text.lines()
        .find_map(|l| l.split_once("RULE-ANSWER ").map(|(_, a)| a.trim()))
        .map(str::to_string)
        .unwrap_or_else(|| format!("no answer from the child: {text}"))
}

#[test]
fn every_rule_on_both_providers() {
    let rows = rows();
    // The child: one row on one provider.
    if let Ok(i) = std::env::var(ROW_ENV) {
        let row = &rows[i.parse::<usize>().unwrap()];
        let provider = std::env::var(PROVIDER_ENV).unwrap();
        let f = fix(open(&provider));
        println!("RULE-ANSWER {:?}", (row.run)(&f));
        return;
    }
    let mut table = vec![format!(
        "{:<58} {:<24} {:<20} {:<20}",
        "rule", "documented in", "mrkit0", "rdma-core (drop-in)"
    )];
    let mut wrong = Vec::new();
    let fixtures = [
        ("mrkit", fix(providers_util::native())),
        ("rdma-core", fix(providers_util::rdma_core())),
    ];
    for (i, row) in rows.iter().enumerate() {
        let mut got = Vec::new();
        for (provider, f) in &fixtures {
            let want = if *provider == "mrkit" {
                row.mrkit
            } else {
                row.rdma_core
            };
            let a = match row.setup {
                Setup::Here => format!("{:?}", (row.run)(f)),
                Setup::Child(env, memlock) => in_child(i, provider, env, memlock),
            };
            if a != format!("{want:?}") {
                wrong.push(format!("{provider}: {}: got {a}, want {want:?}", row.rule));
            }
            got.push(a);
        }
        table.push(format!(
            "{:<58} {:<24} {:<20} {:<20}",
            row.rule, row.doc, got[0], got[1]
        ));
    }
    println!("{}", table.join("\n"));
    assert!(
        wrong.is_empty(),
        "disagreements:\n{}\n\n{}",
        wrong.join("\n"),
        table.join("\n")
    );
}
