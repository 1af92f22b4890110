//! RLIMIT_MEMLOCK accounting, tested in child processes that drop CAP_IPC_LOCK (root has it,
//! which bypasses the limit). The parent re-runs this test binary under
//! `setpriv --bounding-set=-ipc_lock` and `prlimit --memlock=…`, selecting one child test.
mod providers_util;

use std::process::Command;

use mrkit::{AccessFlags as A, Buffer, BufferOptions, DeviceConfig, Errno};
use mrkit_soft::Context;

const CHILD: &str = "MRKIT_MEMLOCK_CHILD";

/// Run `test` of this binary in a child without CAP_IPC_LOCK and with RLIMIT_MEMLOCK = `limit`.
fn run_child(test: &str, limit: u64) {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("setpriv")
        .args(["--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--"])
        .arg("prlimit")
        .arg(format!("--memlock={limit}:{limit}"))
        .arg(&exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("setpriv and prlimit (util-linux) must be installed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "child {test} failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("1 passed"),
        "child {test} ran nothing:\n{stdout}\n{stderr}"
    );
}

fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

fn no_cap_ipc_lock() {
    assert!(
        !mrkit_soft::mem::account::has_cap_ipc_lock(),
        "child still has CAP_IPC_LOCK"
    );
}

#[test]
fn memlock_budget_enforced_without_cap_ipc_lock() {
    if providers_util::needs_native("drives mrkit-soft directly and reads its pin accounting") {
        return;
    }
    run_child("child_budget", 64 << 10);
}

#[test]
fn child_budget() {
    if !in_child() {
        return;
    }
    no_cap_ipc_lock();
    assert_eq!(mrkit_soft::mem::account::memlock_limit(), 64 << 10);
    let ctx = Context::open(DeviceConfig::rxe());
    let pd = ctx.alloc_pd().unwrap();
    let buf = Buffer::with_options(
        1 << 20,
        BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .unwrap();
    // 16 KiB fits in 64 KiB.
    let small = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 16 << 10) },
            A::LOCAL_WRITE,
        )
        .unwrap();
    // 1 MiB does not.
    let e = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 1 << 20) },
            A::LOCAL_WRITE,
        )
        .unwrap_err();
    assert_eq!(e.errno(), Errno::ENOMEM, "{e}");
    assert!(e.to_string().contains("RLIMIT_MEMLOCK"), "{e}");
    // Overlaps count twice: 3 more 16 KiB registrations of the same pages fill 64 KiB exactly...
    let more: Vec<u32> = (0..3)
        .map(|_| {
            // SAFETY: test memory: it stays allocated while any work request can reach this MR.
            ctx.reg_mr_va(
                pd,
                unsafe { mrkit_soft::UserMemory::new(buf.addr(), 16 << 10) },
                A::LOCAL_WRITE,
            )
            .unwrap()
            .lkey
        })
        .collect();
    // ...and the next page is one too many.
    assert_eq!(
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        ctx.reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
            A::LOCAL_WRITE
        )
        .unwrap_err()
        .errno(),
        Errno::ENOMEM
    );
    // Dereg returns the budget.
    ctx.dereg_mr(small.lkey).unwrap();
    let again = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 16 << 10) },
            A::LOCAL_WRITE,
        )
        .unwrap();
    for k in more.into_iter().chain([again.lkey]) {
        ctx.dereg_mr(k).unwrap();
    }
    assert_eq!(mrkit_soft::mem::account::pinned_pages(), 0);
    // ODP registrations are not charged.
    let odp = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 1 << 20) },
            A::ON_DEMAND | A::LOCAL_WRITE,
        )
        .unwrap();
    ctx.dereg_mr(odp.lkey).unwrap();
}

#[test]
fn memlock_zero_is_eperm() {
    if providers_util::needs_native("drives mrkit-soft directly and reads its pin accounting") {
        return;
    }
    run_child("child_zero", 0);
}

#[test]
fn child_zero() {
    if !in_child() {
        return;
    }
    no_cap_ipc_lock();
    let ctx = Context::open(DeviceConfig::rxe());
    let pd = ctx.alloc_pd().unwrap();
    let buf = Buffer::with_options(
        4096,
        BufferOptions {
            populate: true,
            ..Default::default()
        },
    )
    .unwrap();
    let e = ctx
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
            A::LOCAL_WRITE,
        )
        .unwrap_err();
    assert_eq!(e.errno(), Errno::EPERM, "{e}");
    // Rule order: length 0 comes after the EPERM check, so it is EPERM too.
    assert_eq!(
        // SAFETY: test memory: it stays allocated while any work request can reach this MR.
        ctx.reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 0) },
            A::LOCAL_WRITE
        )
        .unwrap_err()
        .errno(),
        Errno::EPERM
    );
    // ODP does not pin and is allowed.
    // SAFETY: test memory: it stays allocated while any work request can reach this MR.
    let odp = ctx
        .reg_mr_va(
            pd,
            unsafe { mrkit_soft::UserMemory::new(buf.addr(), 4096) },
            A::ON_DEMAND,
        )
        .unwrap();
    ctx.dereg_mr(odp.lkey).unwrap();
}
