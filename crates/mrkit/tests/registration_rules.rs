//! The registration rules of mrkit0, table-driven, each errno in its order
//! (`docs/semantics.md` §1.2, §2.1, §4, §5).
mod providers_util;

use mrkit::{AccessFlags as A, Buffer, BufferOptions, DeviceConfig, Errno};
use mrkit_soft::mr::{AccessDenied, KeyUse, ReregFlags};
use mrkit_soft::mw::BindInfo;
use mrkit_soft::{Context, MwType, StatusModel};

fn populated(len: usize) -> Buffer {
    Buffer::with_options(
        len,
        BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .unwrap()
}

struct Case {
    name: &'static str,
    cfg: fn() -> DeviceConfig,
    /// (addr, len, iova, access) from the buffer's address.
    input: fn(u64) -> (u64, u64, u64, A),
    bad_pd: bool,
    expect: Result<(), (Errno, &'static str)>,
}

fn rxe() -> DeviceConfig {
    DeviceConfig::rxe()
}

#[test]
fn validation_order_table() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let cases = [
        Case {
            name: "iova offset mismatch beats everything",
            cfg: rxe,
            input: |a| (a, 4096, a + 1, A::REMOTE_WRITE | A::from_bits_retain(0x400)),
            bad_pd: true,
            expect: Err((Errno::EINVAL, "offset")),
        },
        Case {
            name: "REMOTE_WRITE without LOCAL_WRITE",
            cfg: rxe,
            input: |a| (a, 4096, a, A::REMOTE_WRITE | A::from_bits_retain(0x400)),
            bad_pd: true,
            expect: Err((Errno::EINVAL, "REMOTE_WRITE requires LOCAL_WRITE")),
        },
        Case {
            name: "REMOTE_ATOMIC without LOCAL_WRITE",
            cfg: rxe,
            input: |a| (a, 4096, a, A::REMOTE_ATOMIC),
            bad_pd: false,
            expect: Err((Errno::EINVAL, "REMOTE_ATOMIC requires LOCAL_WRITE")),
        },
        Case {
            name: "unknown bit 10 beats ODP cap",
            cfg: || rxe().odp_caps(0),
            input: |a| (a, 4096, a, A::from_bits_retain(0x400) | A::ON_DEMAND),
            bad_pd: true,
            expect: Err((Errno::EINVAL, "unknown access bits")),
        },
        Case {
            name: "bit 30",
            cfg: rxe,
            input: |a| (a, 4096, a, A::from_bits_retain(1 << 30)),
            bad_pd: false,
            expect: Err((Errno::EINVAL, "unknown access bits")),
        },
        Case {
            name: "bit 31",
            cfg: rxe,
            input: |a| (a, 4096, a, A::from_bits_retain(1 << 31)),
            bad_pd: false,
            expect: Err((Errno::EINVAL, "unknown access bits")),
        },
        Case {
            name: "RELAXED_ORDERING accepted",
            cfg: rxe,
            input: |a| (a, 4096, a, A::LOCAL_WRITE | A::RELAXED_ORDERING),
            bad_pd: false,
            expect: Ok(()),
        },
        Case {
            name: "other optional bit accepted",
            cfg: rxe,
            input: |a| (a, 4096, a, A::from_bits_retain(0x0020_0000)),
            bad_pd: false,
            expect: Ok(()),
        },
        Case {
            name: "ON_DEMAND without ODP beats bad PD",
            cfg: || rxe().odp_caps(0),
            input: |a| (a, 4096, a, A::ON_DEMAND),
            bad_pd: true,
            expect: Err((Errno::EOPNOTSUPP, "ODP")),
        },
        Case {
            name: "FLUSH_GLOBAL unsupported",
            cfg: rxe,
            input: |a| (a, 4096, a, A::FLUSH_GLOBAL),
            bad_pd: true,
            expect: Err((Errno::EOPNOTSUPP, "FLUSH")),
        },
        Case {
            name: "bad PD",
            cfg: rxe,
            input: |a| (a, 0, a, A::LOCAL_WRITE),
            bad_pd: true,
            expect: Err((Errno::EINVAL, "PD")),
        },
        Case {
            name: "rxe model rejects ZERO_BASED",
            cfg: || rxe().status_model(StatusModel::Rxe),
            input: |a| (a, 1 << 62, a, A::ZERO_BASED),
            bad_pd: false,
            expect: Err((Errno::EOPNOTSUPP, "ZERO_BASED")),
        },
        Case {
            name: "hardware model accepts ZERO_BASED",
            cfg: rxe,
            input: |a| (a, 4096, a, A::ZERO_BASED | A::REMOTE_READ),
            bad_pd: false,
            expect: Ok(()),
        },
        Case {
            name: "length > max_mr_size",
            cfg: || rxe().max_mr_size(1 << 20),
            input: |a| (a, (1 << 20) + 1, a, A::LOCAL_WRITE),
            bad_pd: false,
            expect: Err((Errno::EINVAL, "max_mr_size")),
        },
        Case {
            name: "addr + length wraps",
            cfg: rxe,
            input: |a| (a, u64::MAX - a + 1, a, A::LOCAL_WRITE),
            bad_pd: false,
            expect: Err((Errno::EINVAL, "wraps")),
        },
        Case {
            name: "ODP addr + length wraps: EOVERFLOW",
            cfg: rxe,
            input: |a| (a, u64::MAX - 10, a, A::ON_DEMAND),
            bad_pd: false,
            expect: Err((Errno::EOVERFLOW, "wraps")),
        },
        Case {
            name: "length 0",
            cfg: rxe,
            input: |a| (a, 0, a, A::LOCAL_WRITE),
            bad_pd: false,
            expect: Err((Errno::EINVAL, "length 0")),
        },
        Case {
            name: "unaligned length 0 too",
            cfg: rxe,
            input: |a| (a + 5, 0, a + 5, A::LOCAL_WRITE),
            bad_pd: false,
            expect: Err((Errno::EINVAL, "length 0")),
        },
        Case {
            name: "unmapped range",
            cfg: rxe,
            input: |_| (0x1000, 8192, 0x1000, A::LOCAL_WRITE),
            bad_pd: false,
            expect: Err((Errno::EFAULT, "")),
        },
        Case {
            name: "access 0 is legal",
            cfg: rxe,
            input: |a| (a, 4096, a, A::empty()),
            bad_pd: false,
            expect: Ok(()),
        },
        Case {
            name: "MW_BIND alone is legal",
            cfg: rxe,
            input: |a| (a, 4096, a, A::MW_BIND),
            bad_pd: false,
            expect: Ok(()),
        },
        Case {
            name: "unaligned addr with matching iova",
            cfg: rxe,
            input: |a| (a + 100, 1000, 0x7000_0000_0064, A::LOCAL_WRITE),
            bad_pd: false,
            expect: Ok(()),
        },
    ];
    let buf = populated(64 << 10);
    for c in cases {
        let ctx = Context::open((c.cfg)());
        let pd = ctx.alloc_pd().unwrap();
        let (addr, len, iova, access) = (c.input)(buf.addr());
        let pd_arg = if c.bad_pd { pd ^ 0x5500 } else { pd };
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        let r = ctx.reg_mr(
            pd_arg,
            unsafe { mrkit_soft::UserMemory::new(addr, len) },
            iova,
            access,
        );
        match (&r, &c.expect) {
            (Ok(info), Ok(())) => {
                assert_eq!(info.lkey, info.rkey, "{}", c.name);
                ctx.dereg_mr(info.lkey).unwrap();
            }
            (Err(e), Err((errno, needle))) => {
                assert_eq!(e.errno(), *errno, "{}: {e}", c.name);
                assert!(
                    e.to_string().contains(needle),
                    "{}: `{e}` lacks `{needle}`",
                    c.name
                );
            }
            _ => panic!("{}: got {r:?}, expected {:?}", c.name, c.expect),
        }
        assert_eq!(ctx.stats().pinned_bytes, 0, "{}", c.name);
    }
}

#[test]
fn zero_based_mr_starts_at_zero() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let buf = populated(8192);
    let mr = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 8192) },
            A::ZERO_BASED | A::REMOTE_READ,
        )
        .unwrap();
    assert_eq!(mr.iova, 0);
    let g = ctx
        .check_access(mr.rkey, pd, A::REMOTE_READ, 4096, 4096, KeyUse::Remote, 0)
        .unwrap();
    assert_eq!(g.va, buf.addr() + 4096);
    assert_eq!(
        ctx.check_access(mr.rkey, pd, A::REMOTE_READ, 4096, 4097, KeyUse::Remote, 0)
            .unwrap_err(),
        AccessDenied::OutOfRange
    );
}

#[test]
fn read_only_mappings() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let mut ro = populated(16 << 10);
    ro.make_readonly().unwrap();
    for access in [
        A::LOCAL_WRITE,
        A::LOCAL_WRITE | A::REMOTE_WRITE,
        A::MW_BIND,
        A::LOCAL_WRITE | A::REMOTE_ATOMIC,
    ] {
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        let e = ctx
            .reg_mr_va(
                pd,
                unsafe { mrkit_soft::UserMemory::new(ro.addr(), 16 << 10) },
                access,
            )
            .unwrap_err();
        assert_eq!(e.errno(), Errno::EFAULT, "{access:?}: {e}");
    }
    for access in [A::empty(), A::REMOTE_READ] {
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        let mr = ctx
            .reg_mr_va(
                pd,
                unsafe { mrkit_soft::UserMemory::new(ro.addr(), 16 << 10) },
                access,
            )
            .unwrap();
        assert!(!mr.writable);
        assert_eq!(
            mr.pin_path,
            Some(mrkit_soft::mem::pin::PinPath::Mlock),
            "read-only mappings pin through mlock"
        );
        // Upgrading to writable in place: EACCES (CVE-2026-52908 rule); the MR stays valid.
        let e = ctx
            .rereg_mr(
                mr.lkey,
                ReregFlags::CHANGE_ACCESS,
                0,
                mrkit_soft::UserMemory::empty_at(0),
                0,
                A::LOCAL_WRITE,
            )
            .unwrap_err();
        assert_eq!(e.errno(), Errno::EACCES);
        assert!(ctx.query_mr(mr.lkey).is_ok());
        ctx.dereg_mr(mr.lkey).unwrap();
    }
}

#[test]
fn max_mr_1001st_registration_fails_with_enomem() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe().max_mr(1000));
    let pd = ctx.alloc_pd().unwrap();
    let buf = populated(4096);
    let keys: Vec<u32> = (0..1000)
        .map(|_| {
            // SAFETY: test memory: it stays allocated while any work request can reach this MR.
            ctx.reg_mr_va(
                pd,
                unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
                A::LOCAL_WRITE,
            )
            .unwrap()
            .lkey
        })
        .collect();
    let e = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
            A::LOCAL_WRITE,
        )
        .unwrap_err();
    assert_eq!(e.errno(), Errno::ENOMEM);
    assert!(e.to_string().contains("max_mr (1000)"), "{e}");
    // Nothing leaked by the failed attempt: pinned bytes are exactly 1000 pages.
    assert_eq!(ctx.stats().pinned_bytes, 1000 * 4096);
    ctx.dereg_mr(keys[500]).unwrap();
    let k = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
            A::LOCAL_WRITE,
        )
        .unwrap()
        .lkey;
    for k in keys.iter().copied().filter(|k| *k != keys[500]).chain([k]) {
        ctx.dereg_mr(k).unwrap();
    }
    assert_eq!(ctx.stats().pinned_bytes, 0);
    assert_eq!(ctx.stats().failures_of(Errno::ENOMEM), 1);
}

fn thp_enabled() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| !s.contains("[never]"))
        .unwrap_or(false)
}

#[test]
fn translation_capacity_and_thp() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    // 2^9 = 512 entries: 4 MiB of 4 KiB pages needs 1024, the same size in THP needs 2.
    let ctx = Context::open(rxe().log_num_mtt(9));
    let pd = ctx.alloc_pd().unwrap();
    let small = populated(4 << 20);
    let e = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(small.addr(), 4 << 20) },
            A::LOCAL_WRITE,
        )
        .unwrap_err();
    assert_eq!(e.errno(), Errno::ENOMEM);
    assert!(e.to_string().contains("translation"), "{e}");
    assert_eq!(
        ctx.stats().pinned_bytes,
        0,
        "failed registration must unpin"
    );
    if !thp_enabled() {
        eprintln!("SKIP part: transparent huge pages are disabled on this machine");
        return;
    }
    let huge = Buffer::with_options(
        4 << 20,
        BufferOptions {
            thp: true,
            populate: true,
            offset: 0,
        },
    )
    .unwrap();
    // SAFETY: test memory: it stays allocated while any work request can reach this MR.
    let mr = ctx.reg_mr_va(
        pd,
        unsafe { mrkit_soft::UserMemory::new(huge.addr(), 4 << 20) },
        A::LOCAL_WRITE,
    );
    let mr = mr.expect("THP-backed 4 MiB needs 2 entries and must fit in 512");
    assert_eq!(mr.page_size, 2 << 20);
    assert_eq!(mr.entries, 2);
    ctx.dereg_mr(mr.lkey).unwrap();
}

#[test]
fn pd_dealloc_busy_and_usecounts() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let buf = populated(4096);
    // SAFETY: test memory: it stays allocated while any work request can reach this MR.
    let mr = ctx
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
            A::empty(),
        )
        .unwrap();
    let mw = ctx.alloc_mw(pd, MwType::Type2).unwrap();
    assert_eq!(ctx.dealloc_pd(pd).unwrap_err().errno(), Errno::EBUSY);
    ctx.dereg_mr(mr.lkey).unwrap();
    assert_eq!(ctx.dealloc_pd(pd).unwrap_err().errno(), Errno::EBUSY);
    ctx.dealloc_mw(mw).unwrap();
    ctx.dealloc_pd(pd).unwrap();
    assert_eq!(ctx.dealloc_pd(pd).unwrap_err().errno(), Errno::EINVAL);
    let small = Context::open(rxe().max_pd(2));
    small.alloc_pd().unwrap();
    small.alloc_pd().unwrap();
    assert_eq!(small.alloc_pd().unwrap_err().errno(), Errno::ENOMEM);
}

#[test]
fn lookup_predicate() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let pd2 = ctx.alloc_pd().unwrap();
    let buf = populated(8192);
    let mr = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 8192) },
            A::LOCAL_WRITE | A::REMOTE_READ,
        )
        .unwrap();
    let a = buf.addr();
    type Row = (u32, u32, A, u64, u64, Result<(), AccessDenied>);
    let cases: [Row; 8] = [
        (mr.rkey, pd, A::REMOTE_READ, a, 8192, Ok(())),
        (
            mr.rkey ^ 1,
            pd,
            A::REMOTE_READ,
            a,
            8,
            Err(AccessDenied::NoSuchKey),
        ),
        (
            mr.rkey,
            pd2,
            A::REMOTE_READ,
            a,
            8,
            Err(AccessDenied::WrongPd),
        ),
        (
            mr.rkey,
            pd,
            A::REMOTE_WRITE,
            a,
            8,
            Err(AccessDenied::MissingRights {
                need: A::REMOTE_WRITE,
                have: A::LOCAL_WRITE | A::REMOTE_READ,
            }),
        ),
        (
            mr.rkey,
            pd,
            A::REMOTE_READ,
            a + 8192 - 7,
            8,
            Err(AccessDenied::OutOfRange),
        ),
        (
            mr.rkey,
            pd,
            A::REMOTE_READ,
            a - 1,
            8,
            Err(AccessDenied::OutOfRange),
        ),
        (
            mr.rkey,
            pd,
            A::REMOTE_READ,
            u64::MAX - 3,
            8,
            Err(AccessDenied::OutOfRange),
        ),
        (
            mr.rkey,
            pd,
            A::REMOTE_READ | A::REMOTE_ATOMIC,
            a,
            8,
            Err(AccessDenied::MissingRights {
                need: A::REMOTE_READ | A::REMOTE_ATOMIC,
                have: A::LOCAL_WRITE | A::REMOTE_READ,
            }),
        ),
    ];
    for (i, (key, p, need, iova, len, want)) in cases.into_iter().enumerate() {
        let got = ctx
            .check_access(key, p, need, iova, len, KeyUse::Remote, 0)
            .map(|_| ());
        assert_eq!(got, want, "case {i}");
    }
    ctx.dereg_mr(mr.lkey).unwrap();
    assert_eq!(
        ctx.check_access(mr.rkey, pd, A::REMOTE_READ, a, 8, KeyUse::Remote, 0)
            .unwrap_err(),
        AccessDenied::NoSuchKey
    );
}

#[test]
fn stale_keys_never_match_across_thousands_of_cycles() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let buf = populated(4096);
    let mut dead = std::collections::HashSet::new();
    // SAFETY: test memory: it stays allocated while any work request can reach this MR.
    let live = ctx
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
            A::REMOTE_READ,
        )
        .unwrap();
    for _ in 0..5000 {
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        let mr = ctx
            .reg_mr_va(
                pd,
                unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
                A::REMOTE_READ,
            )
            .unwrap();
        assert!(!dead.contains(&mr.lkey), "key {:#x} reissued", mr.lkey);
        assert_ne!(mr.lkey, live.lkey);
        ctx.dereg_mr(mr.lkey).unwrap();
        dead.insert(mr.lkey);
    }
    for k in &dead {
        assert!(ctx
            .check_access(*k, pd, A::REMOTE_READ, buf.addr(), 8, KeyUse::Remote, 0)
            .is_err());
        assert_eq!(ctx.dereg_mr(*k).unwrap_err().errno(), Errno::EINVAL);
    }
    assert!(ctx
        .check_access(
            live.lkey,
            pd,
            A::REMOTE_READ,
            buf.addr(),
            8,
            KeyUse::Remote,
            0
        )
        .is_ok());
}

#[test]
fn concurrent_registrations() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let buf = populated(1 << 20);
    let addr = buf.addr();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let ctx = ctx.clone();
            s.spawn(move || {
                for i in 0..300u64 {
                    let off = ((t * 300 + i) % 250) * 4096;
                    let mr = ctx
                        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
                        .reg_mr_va(
                            pd,
                            unsafe { mrkit_soft::UserMemory::new(addr + off, 8192) },
                            A::LOCAL_WRITE | A::REMOTE_WRITE,
                        )
                        .unwrap();
                    let g = ctx
                        .check_access(
                            mr.rkey,
                            pd,
                            A::REMOTE_WRITE,
                            addr + off,
                            8192,
                            KeyUse::Remote,
                            0,
                        )
                        .unwrap();
                    assert_eq!(g.va, addr + off);
                    drop(g);
                    ctx.dereg_mr(mr.lkey).unwrap();
                }
            });
        }
    });
    let st = ctx.stats();
    assert_eq!(st.registrations, 2400);
    assert_eq!(st.deregistrations, 2400);
    assert_eq!(st.mrs_live, 0);
    assert_eq!(st.pinned_bytes, 0);
    assert_eq!(st.mtt_used, 0);
}

#[test]
fn overlapping_registrations_do_not_unpin_each_other() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let buf = populated(1 << 20);
    let a = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 1 << 20) },
            A::LOCAL_WRITE,
        )
        .unwrap();
    let b = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr() + 4096, 64 << 10) },
            A::LOCAL_WRITE,
        )
        .unwrap();
    assert_eq!(
        ctx.stats().pinned_bytes,
        (1 << 20) + (64 << 10),
        "overlaps are counted twice, as pinned_vm"
    );
    ctx.dereg_mr(a.lkey).unwrap();
    let st = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib = |k: &str| -> u64 {
        st.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    assert!(
        kib("VmPin:") + kib("VmLck:") >= 64,
        "b's pages must still be pinned: {st}"
    );
    assert!(ctx
        .check_access(
            b.lkey,
            pd,
            A::LOCAL_WRITE,
            b.iova,
            64 << 10,
            KeyUse::Local,
            0
        )
        .is_ok());
    ctx.dereg_mr(b.lkey).unwrap();
}

#[test]
fn rereg_rules() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let pd2 = ctx.alloc_pd().unwrap();
    let buf = populated(64 << 10);
    // SAFETY: test memory: it stays allocated while any work request can reach this MR.
    let mr = ctx
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 8192) },
            A::LOCAL_WRITE,
        )
        .unwrap();
    let k = mr.lkey;
    let cases: [(u32, u32, u64, u64, A, Errno); 7] = [
        (0, pd, 0, 0, A::empty(), Errno::EINVAL),
        // libibverbs' check (EINVAL) comes before the kernel's (EOPNOTSUPP).
        (0x8, pd, 0, 0, A::empty(), Errno::EINVAL),
        (
            ReregFlags::CHANGE_PD,
            pd,
            0,
            0,
            A::LOCAL_WRITE,
            Errno::EINVAL,
        ),
        (
            ReregFlags::CHANGE_TRANSLATION,
            pd,
            0,
            4096,
            A::empty(),
            Errno::EINVAL,
        ),
        (
            ReregFlags::CHANGE_ACCESS,
            pd,
            0,
            0,
            A::REMOTE_WRITE,
            Errno::EINVAL,
        ),
        (
            ReregFlags::CHANGE_ACCESS,
            pd,
            0,
            0,
            A::FLUSH_GLOBAL,
            Errno::EOPNOTSUPP,
        ),
        (
            ReregFlags::CHANGE_PD,
            0xdead00,
            0,
            0,
            A::empty(),
            Errno::EINVAL,
        ),
    ];
    for (i, (flags, p, addr, len, acc, want)) in cases.into_iter().enumerate() {
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        let e = ctx
            .rereg_mr(
                k,
                flags,
                p,
                unsafe { mrkit_soft::UserMemory::new(addr, len) },
                addr,
                acc,
            )
            .unwrap_err();
        assert_eq!(e.errno(), want, "case {i}: {e}");
        assert!(ctx.query_mr(k).is_ok(), "case {i}: old MR must stay valid");
    }
    // Page-offset mismatch on TRANSLATION.
    let e = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .rereg_mr(
            k,
            ReregFlags::CHANGE_TRANSLATION,
            0,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
            buf.addr() + 1,
            A::empty(),
        )
        .unwrap_err();
    assert_eq!(e.errno(), Errno::EINVAL);
    // PD and ACCESS change in place: keys stay.
    let i = ctx
        .rereg_mr(
            k,
            ReregFlags::CHANGE_PD | ReregFlags::CHANGE_ACCESS,
            pd2,
            mrkit_soft::UserMemory::empty_at(0),
            0,
            A::LOCAL_WRITE | A::REMOTE_READ,
        )
        .unwrap();
    assert_eq!((i.lkey, i.pd), (k, pd2));
    assert!(ctx
        .check_access(k, pd2, A::REMOTE_READ, buf.addr(), 8, KeyUse::Remote, 0)
        .is_ok());
    assert_eq!(
        ctx.check_access(k, pd, A::REMOTE_READ, buf.addr(), 8, KeyUse::Remote, 0)
            .unwrap_err(),
        AccessDenied::WrongPd
    );
    ctx.dealloc_pd(pd).unwrap(); // the MR moved away
                                 // TRANSLATION: new keys, new range.
    let j = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .rereg_mr(
            k,
            ReregFlags::CHANGE_TRANSLATION,
            0,
            unsafe { mrkit_soft::UserMemory::new(buf.addr() + 8192, 16384) },
            buf.addr() + 8192,
            A::empty(),
        )
        .unwrap();
    assert_ne!(j.lkey, k);
    assert_eq!(j.length, 16384);
    assert!(ctx.query_mr(k).is_err());
    ctx.dereg_mr(j.lkey).unwrap();
    assert_eq!(ctx.stats().pinned_bytes, 0);
}

#[test]
fn memory_windows() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let pd2 = ctx.alloc_pd().unwrap();
    let buf = populated(64 << 10);
    let a = buf.addr();
    let mr = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(a, 64 << 10) },
            A::LOCAL_WRITE | A::MW_BIND,
        )
        .unwrap();
    // SAFETY: test memory: it stays allocated while any work request can reach this MR.
    let mr_nobind = ctx
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(a, 4096) },
            A::LOCAL_WRITE,
        )
        .unwrap();
    // SAFETY: test memory: it stays allocated while any work request can reach this MR.
    let mr_ro = ctx
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(a, 4096) },
            A::MW_BIND,
        )
        .unwrap();
    let mr_pd2 = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd2,
            unsafe { mrkit_soft::UserMemory::new(a, 4096) },
            A::LOCAL_WRITE | A::MW_BIND,
        )
        .unwrap();
    let w1 = ctx.alloc_mw(pd, MwType::Type1).unwrap();
    let w2 = ctx.alloc_mw(pd, MwType::Type2).unwrap();
    assert!(w1 & 0x8000_0000 != 0, "window keys live in their own range");
    let bi = |k: u32, addr: u64, length: u64, access: A| BindInfo {
        mr_lkey: k,
        addr,
        length,
        access,
    };
    // Bind failures (each is IBV_WC_MW_BIND_ERR on the data path).
    let bad: [(u32, u32, BindInfo); 7] = [
        (pd, w1, bi(mr_nobind.lkey, a, 4096, A::REMOTE_READ)), // MR lacks MW_BIND
        (pd, w1, bi(mr_ro.lkey, a, 4096, A::REMOTE_WRITE)), // window write needs LOCAL_WRITE on MR
        (pd, w1, bi(mr.lkey, a + 4096, 64 << 10, A::REMOTE_READ)), // outside MR
        (pd, w1, bi(mr.lkey, u64::MAX - 10, 100, A::REMOTE_READ)), // wraps
        (pd, w1, bi(mr_pd2.lkey, a, 4096, A::REMOTE_READ)), // MR in another PD (rxe misses this)
        (pd2, w1, bi(mr.lkey, a, 4096, A::REMOTE_READ)),    // QP PD != MW PD
        (pd, w1, bi(mr.lkey, a, 4096, A::REMOTE_READ | A::ZERO_BASED)), // type 1 zero-based
    ];
    for (i, (qp_pd, w, info)) in bad.into_iter().enumerate() {
        assert_eq!(
            ctx.bind_mw(qp_pd, 7, w, 1, info).unwrap_err().errno(),
            Errno::EINVAL,
            "bad bind {i}"
        );
    }
    // A good type-1 bind of [a+4096, a+8192) with REMOTE_WRITE; the MR itself has no remote rights.
    let k1 = ctx
        .bind_mw(
            pd,
            7,
            w1,
            0x42,
            bi(mr.lkey, a + 4096, 4096, A::REMOTE_WRITE),
        )
        .unwrap();
    assert_eq!(k1 & 0xff, 0x42);
    let g = ctx
        .check_access(k1, pd, A::REMOTE_WRITE, a + 4096, 4096, KeyUse::Remote, 99)
        .unwrap();
    assert_eq!(g.va, a + 4096);
    drop(g);
    // Window bounds are enforced (rxe checks only the MR's).
    assert_eq!(
        ctx.check_access(k1, pd, A::REMOTE_WRITE, a, 8, KeyUse::Remote, 0)
            .unwrap_err(),
        AccessDenied::OutOfRange
    );
    assert_eq!(
        ctx.check_access(k1, pd, A::REMOTE_WRITE, a + 8192 - 4, 8, KeyUse::Remote, 0)
            .unwrap_err(),
        AccessDenied::OutOfRange
    );
    assert!(matches!(
        ctx.check_access(k1, pd, A::REMOTE_READ, a + 4096, 8, KeyUse::Remote, 0)
            .unwrap_err(),
        AccessDenied::MissingRights { .. }
    ));
    assert_eq!(
        ctx.check_access(w1, pd, A::REMOTE_WRITE, a + 4096, 8, KeyUse::Remote, 0)
            .unwrap_err(),
        AccessDenied::NoSuchKey,
        "old rkey is dead after bind"
    );
    assert_eq!(
        ctx.check_access(k1, pd, A::REMOTE_WRITE, a + 4096, 8, KeyUse::Local, 0)
            .unwrap_err(),
        AccessDenied::NoSuchKey,
        "windows are remote-only"
    );
    // Dereg with a bound window: EINVAL.
    assert_eq!(ctx.dereg_mr(mr.lkey).unwrap_err().errno(), Errno::EINVAL);
    // Type 1 cannot be invalidated; type 2 binds to a QP, zero based.
    assert_eq!(
        ctx.invalidate_rkey(pd, 7, k1).unwrap_err().errno(),
        Errno::EINVAL
    );
    let k2 = ctx
        .bind_mw(
            pd,
            7,
            w2,
            9,
            bi(mr.lkey, a, 8192, A::REMOTE_READ | A::ZERO_BASED),
        )
        .unwrap();
    let g = ctx
        .check_access(k2, pd, A::REMOTE_READ, 100, 8, KeyUse::Remote, 7)
        .unwrap();
    assert_eq!(g.va, a + 100);
    drop(g);
    assert_eq!(
        ctx.check_access(k2, pd, A::REMOTE_READ, 100, 8, KeyUse::Remote, 8)
            .unwrap_err(),
        AccessDenied::WrongQp
    );
    assert_eq!(
        ctx.check_access(k2, pd, A::REMOTE_READ, 8190, 8, KeyUse::Remote, 7)
            .unwrap_err(),
        AccessDenied::OutOfRange
    );
    // Re-binding a bound type-2 window fails; invalidation by another QP fails; by the owner works.
    assert!(ctx
        .bind_mw(pd, 7, k2, 10, bi(mr.lkey, a, 4096, A::REMOTE_READ))
        .is_err());
    assert!(ctx.invalidate_rkey(pd, 8, k2).is_err());
    ctx.invalidate_rkey(pd, 7, k2).unwrap();
    assert!(
        ctx.invalidate_rkey(pd, 7, k2).is_err(),
        "invalidating an unbound window is an error"
    );
    assert!(ctx
        .check_access(k2, pd, A::REMOTE_READ, 100, 8, KeyUse::Remote, 7)
        .is_err());
    assert!(
        ctx.invalidate_rkey(pd, 7, mr.lkey).is_err(),
        "ordinary MRs cannot be invalidated"
    );
    // Type-1 unbind (length 0), then dereg works.
    let k1b = ctx
        .bind_mw(pd, 7, k1, 0x43, bi(0, 0, 0, A::empty()))
        .unwrap();
    assert!(ctx
        .check_access(k1b, pd, A::REMOTE_WRITE, a + 4096, 8, KeyUse::Remote, 0)
        .is_err());
    ctx.dereg_mr(mr.lkey).unwrap();
    ctx.dealloc_mw(k1b).unwrap();
    ctx.dealloc_mw(k2).unwrap();
    for k in [mr_nobind.lkey, mr_ro.lkey, mr_pd2.lkey] {
        ctx.dereg_mr(k).unwrap();
    }
    ctx.dealloc_pd(pd).unwrap();
}

#[test]
fn dealloc_mw_unbinds() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let buf = populated(8192);
    let mr = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 8192) },
            A::LOCAL_WRITE | A::MW_BIND,
        )
        .unwrap();
    let w = ctx.alloc_mw(pd, MwType::Type1).unwrap();
    let k = ctx
        .bind_mw(
            pd,
            1,
            w,
            5,
            BindInfo {
                mr_lkey: mr.lkey,
                addr: buf.addr(),
                length: 8192,
                access: A::REMOTE_READ,
            },
        )
        .unwrap();
    assert_eq!(ctx.query_mr(mr.lkey).unwrap().bound_mws, 1);
    ctx.dealloc_mw(k).unwrap();
    assert_eq!(ctx.query_mr(mr.lkey).unwrap().bound_mws, 0);
    ctx.dereg_mr(mr.lkey).unwrap();
    let small = Context::open(rxe().max_mw(1));
    let p = small.alloc_pd().unwrap();
    small.alloc_mw(p, MwType::Type1).unwrap();
    assert_eq!(
        small.alloc_mw(p, MwType::Type2).unwrap_err().errno(),
        Errno::ENOMEM
    );
}

#[test]
fn on_demand_paging() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    // Not populated: nothing is resident until the device touches it.
    let buf = Buffer::new(1 << 20).unwrap();
    let mr = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 1 << 20) },
            A::ON_DEMAND | A::LOCAL_WRITE | A::REMOTE_WRITE,
        )
        .unwrap();
    assert_eq!(mr.pinned_bytes, 0, "ODP pins nothing");
    assert_eq!(mr.pin_path, None);
    let before = mrkit_soft::mem::fault::present_pages(buf.addr(), 1 << 20).unwrap();
    assert!(
        before.iter().all(|p| !p),
        "nothing resident before the first access"
    );
    let g = ctx
        .check_access(
            mr.rkey,
            pd,
            A::REMOTE_WRITE,
            buf.addr() + 8192,
            4096,
            KeyUse::Remote,
            0,
        )
        .unwrap();
    drop(g);
    let after = mrkit_soft::mem::fault::present_pages(buf.addr(), 1 << 20).unwrap();
    assert!(after[2], "the accessed page was faulted in");
    assert!(!after[100], "untouched pages stay out");
    // advise_mr prefetch.
    ctx.advise_mr(pd, 1, 1, &[(mr.lkey, buf.addr() + (512 << 10), 64 << 10)])
        .unwrap();
    let after = mrkit_soft::mem::fault::present_pages(buf.addr(), 1 << 20).unwrap();
    assert!(after[128] && after[143]);
    assert_eq!(
        ctx.advise_mr(pd, 7, 0, &[]).unwrap_err().errno(),
        Errno::EOPNOTSUPP
    );
    ctx.dereg_mr(mr.lkey).unwrap();

    // Implicit ODP: the whole address space.
    let imp = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr(
            pd,
            unsafe { mrkit_soft::UserMemory::new(0, u64::MAX) },
            0,
            A::ON_DEMAND | A::LOCAL_WRITE,
        )
        .unwrap();
    let other = Buffer::new(8192).unwrap();
    let g = ctx
        .check_access(
            imp.lkey,
            pd,
            A::LOCAL_WRITE,
            other.addr(),
            8192,
            KeyUse::Local,
            0,
        )
        .unwrap();
    assert_eq!(g.va, other.addr());
    drop(g);
    assert_eq!(
        ctx.check_access(imp.lkey, pd, A::LOCAL_WRITE, 0x1000, 8, KeyUse::Local, 0)
            .unwrap_err(),
        AccessDenied::Fault,
        "an unmapped address faults"
    );
    ctx.dereg_mr(imp.lkey).unwrap();
    let no_implicit = Context::open(rxe().odp_caps(1));
    let p = no_implicit.alloc_pd().unwrap();
    assert_eq!(
        no_implicit
            // SAFETY: test memory: it stays allocated while any work request can reach this MR.
            .reg_mr(
                p,
                unsafe { mrkit_soft::UserMemory::new(0, u64::MAX) },
                0,
                A::ON_DEMAND
            )
            .unwrap_err()
            .errno(),
        Errno::EINVAL
    );
}

#[test]
fn dereg_waits_for_in_flight_access() {
    if providers_util::needs_native("mrkit-soft's own rule table (validation order, key internals); provider_rules.rs has the rules on both providers") {
        return;
    }
    let ctx = Context::open(rxe());
    let pd = ctx.alloc_pd().unwrap();
    let buf = populated(4096);
    // SAFETY: test memory: it stays allocated while any work request can reach this MR.
    let mr = ctx
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
            A::LOCAL_WRITE,
        )
        .unwrap();
    let g = ctx
        .check_access(
            mr.lkey,
            pd,
            A::LOCAL_WRITE,
            buf.addr(),
            4096,
            KeyUse::Local,
            0,
        )
        .unwrap();
    let c2 = ctx.clone();
    let h = std::thread::spawn(move || c2.dereg_mr(mr.lkey));
    std::thread::sleep(std::time::Duration::from_millis(30));
    assert!(
        !h.is_finished(),
        "dereg returned while an access was in flight"
    );
    assert!(
        ctx.check_access(mr.lkey, pd, A::LOCAL_WRITE, buf.addr(), 8, KeyUse::Local, 0)
            .is_err(),
        "key unpublished first"
    );
    drop(g);
    h.join().unwrap().unwrap();
    assert_eq!(ctx.stats().pinned_bytes, 0);
}
