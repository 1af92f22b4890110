//! Registered memory the application `mprotect`s or `munmap`s while it is registered: no packet
//! may kill the process, and the bytes go where a NIC's DMA would put them (the pinned frames),
//! or, where no frame is left (mlock pins after munmap), the operation fails with the status a
//! NIC gives for a DMA it cannot do (never a success with bytes that did not move).
//!
//! Each case damages a registered range on both hosts (the target of a remote WRITE, READ and
//! atomic, and the source of a local SEND gather), runs the operations, and checks the bytes
//! through the frames: the same address after restoring the protection, a second mapping of the
//! same memfd pages, or an RDMA READ back.
mod common;

use std::time::{Duration, Instant};

use common::{all, connect, ctx, host_with, Host};
use mrkit_soft::cq::{Wc, WcStatus};
use mrkit_soft::driver::loopback::drive_until_idle;
use mrkit_soft::mem::pin::{set_pin_mode, PinMode, PinPath};
use mrkit_soft::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
use mrkit_soft::qp::{QpState, RecvWr, SendWr, Sge, WrOpcode};
use mrkit_soft::UserMemory;

/// The pin mode is process-wide: the cases run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

const PS: usize = 4096;
const LEN: usize = 3 * PS;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Damage {
    ReadOnly,
    NoAccess,
    Unmap,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Backing {
    /// Private anonymous memory.
    Anon,
    /// A memfd mapped twice (shared): the second mapping shows the frames.
    Memfd,
}

/// `LEN` bytes of memory and, for a memfd, a second mapping of the same pages.
struct Region {
    addr: u64,
    alias: Option<u64>,
    unmapped: bool,
}

/// Where the next region goes: far below the addresses the kernel hands out top-down, so that
/// no later mapping (a receive buffer of the UDP path, say) fills the hole `munmap` leaves.
/// The device copies through virtual addresses: memory mapped into the hole afterwards would
/// be what it reaches (documented in `copy.rs`), not the pinned frames this test checks.
static NEXT_AT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x1000_0000_0000);

fn map(backing: Backing) -> Region {
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let at = NEXT_AT.fetch_add(1 << 20, std::sync::atomic::Ordering::Relaxed) as *mut libc::c_void;
    let fixed = libc::MAP_FIXED_NOREPLACE;
    // SAFETY: fresh mappings of our own (anonymous, or of a memfd created here).
    unsafe {
        match backing {
            Backing::Anon => {
                let p = libc::mmap(
                    at,
                    LEN,
                    rw,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
                    -1,
                    0,
                );
                assert_eq!(p, at);
                Region {
                    addr: p as u64,
                    alias: None,
                    unmapped: false,
                }
            }
            Backing::Memfd => {
                let fd = libc::memfd_create(c"mrkit-protected".as_ptr(), libc::MFD_CLOEXEC);
                assert!(fd >= 0);
                assert_eq!(libc::ftruncate(fd, LEN as i64), 0);
                let p = libc::mmap(at, LEN, rw, libc::MAP_SHARED | fixed, fd, 0);
                let q = libc::mmap(std::ptr::null_mut(), LEN, rw, libc::MAP_SHARED, fd, 0);
                libc::close(fd);
                assert!(p == at && q != libc::MAP_FAILED);
                Region {
                    addr: p as u64,
                    alias: Some(q as u64),
                    unmapped: false,
                }
            }
        }
    }
}

impl Region {
    fn fill(&self, f: impl Fn(usize) -> u8) {
        for i in 0..LEN {
            // SAFETY: inside our read-write mapping.
            unsafe { *((self.addr as usize + i) as *mut u8) = f(i) };
        }
    }

    fn damage(&mut self, d: Damage) {
        // SAFETY: our own mapping; the device copes with it (what this test checks).
        let rc = unsafe {
            match d {
                Damage::ReadOnly => libc::mprotect(self.addr as *mut _, LEN, libc::PROT_READ),
                Damage::NoAccess => libc::mprotect(self.addr as *mut _, LEN, libc::PROT_NONE),
                Damage::Unmap => libc::munmap(self.addr as *mut _, LEN),
            }
        };
        assert_eq!(rc, 0);
        self.unmapped = d == Damage::Unmap;
    }

    /// The bytes in the frames, if the test can see them: the alias mapping, or the original
    /// one made readable again.
    fn frames(&self) -> Option<Vec<u8>> {
        let at = match (self.alias, self.unmapped) {
            (Some(a), _) => a,
            (None, false) => {
                // SAFETY: restoring access to our own mapping.
                let rc = unsafe {
                    libc::mprotect(self.addr as *mut _, LEN, libc::PROT_READ | libc::PROT_WRITE)
                };
                assert_eq!(rc, 0);
                self.addr
            }
            (None, true) => return None,
        };
        // SAFETY: a readable mapping of LEN bytes.
        Some(unsafe { std::slice::from_raw_parts(at as *const u8, LEN) }.to_vec())
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mappings (munmap of an unmapped range is harmless).
        unsafe {
            libc::munmap(self.addr as *mut _, LEN);
            if let Some(a) = self.alias {
                libc::munmap(a as *mut _, LEN);
            }
        }
    }
}

/// Two connected hosts: on the loopback link (manual progress) or over UDP (threads).
fn hosts(udp: bool) -> (Host, Host) {
    let a = host_with(ctx(!udp), 64, false);
    let b = host_with(ctx(!udp), 64, false);
    if udp {
        let opts = ConnectOpts::default();
        for (x, y) in [(&a, &b), (&b, &a)] {
            let remote = RemoteQp {
                qpn: y.qp,
                psn: opts.sq_psn,
                ip: Some(y.ctx.udp_port().unwrap().local_addr().ip()),
                node: 0,
            };
            connect_qp(&x.ctx, x.qp, remote, opts).unwrap();
        }
    } else {
        connect(&a, &b, all(), 3);
    }
    (a, b)
}

fn completion(h: &Host, other: &Host, udp: bool) -> Wc {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut v = Vec::new();
    loop {
        if !udp {
            drive_until_idle(&[&h.ctx, &other.ctx]);
        }
        if h.ctx.poll_cq(h.cq, &mut v, 1).unwrap() == 1 {
            return v[0];
        }
        assert!(Instant::now() < deadline, "no completion");
        if udp {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
}

/// Register `[addr, addr + len)` with every access right on `h`.
///
/// # Safety
/// The range must stay allocated until the MR is deregistered (it may be protected or unmapped
/// behind the device's back: that is what these tests do to it).
unsafe fn reg_at(h: &Host, addr: u64, len: usize) -> mrkit_soft::mr::MrInfo {
    // SAFETY: forwarded to the caller.
    let mem = unsafe { UserMemory::new(addr, len as u64) };
    h.ctx.reg_mr_va(h.pd, mem, all()).unwrap()
}

fn pat(seed: u8) -> impl Fn(usize) -> u8 {
    move |i| (i as u8).wrapping_mul(31).wrapping_add(seed)
}

fn run(damage: Damage, backing: Backing, mode: PinMode, udp: bool) {
    if damage == Damage::Unmap && mode == PinMode::Mlock {
        for op in Op::ALL {
            unreachable(op, backing, udp);
        }
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    set_pin_mode(mode);
    let (a, b) = hosts(udp);
    // Target on b (WRITE / READ / atomic), SEND source on a.
    let mut tb = map(backing);
    let mut ta = map(backing);
    tb.fill(pat(1));
    ta.fill(pat(2));
    // SAFETY (all five registrations): the mappings and vectors outlive the MRs, which this
    // function deregisters (by dropping the hosts) before it returns; damaging a mapping while
    // it is registered is what the test is about.
    let mb = unsafe { reg_at(&b, tb.addr, LEN) };
    let ma = unsafe { reg_at(&a, ta.addr, LEN) };
    let path = mb.pin_path.expect("pinned");
    assert!(
        damage != Damage::Unmap || path == PinPath::IoUring,
        "unmapped mlock pins are the `unreachable` cases"
    );
    println!("{damage:?} {backing:?} {mode:?} udp={udp}: pinned via {path:?}");
    // Plain buffers on a: the WRITE source and the READ destination.
    let src: Vec<u8> = (0..LEN).map(pat(3)).collect();
    let mut back = vec![0u8; LEN];
    let msrc = unsafe { reg_at(&a, src.as_ptr() as u64, LEN) };
    let mback = unsafe { reg_at(&a, back.as_mut_ptr() as u64, LEN) };
    let mut rbuf = vec![0u8; LEN];
    let mrbuf = unsafe { reg_at(&b, rbuf.as_mut_ptr() as u64, LEN) };

    tb.damage(damage);
    ta.damage(damage);

    // Remote WRITE of 5000 bytes at offset 100 (across pages) into the damaged target.
    let wr = SendWr::new(1, WrOpcode::RdmaWrite)
        .sge(msrc.iova, 5000, msrc.lkey)
        .remote(mb.iova + 100, mb.rkey);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(completion(&a, &b, udp).status, WcStatus::Success);
    let mut want: Vec<u8> = (0..LEN).map(pat(1)).collect();
    want[100..5100].copy_from_slice(&src[..5000]);

    // Remote atomic on the damaged target: fetch-and-add 5 at offset 8192.
    let mut wr = SendWr::new(2, WrOpcode::AtomicFetchAndAdd)
        .sge(mback.iova, 8, mback.lkey)
        .remote(mb.iova + 8192, mb.rkey);
    wr.compare_add = 5;
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    let wc = completion(&a, &b, udp);
    assert_eq!((wc.wr_id, wc.status), (2, WcStatus::Success));
    let orig = u64::from_ne_bytes(want[8192..8200].try_into().unwrap());
    let fetched = u64::from_ne_bytes(back[..8].try_into().unwrap());
    assert_eq!(fetched, orig, "atomic read the frames");
    want[8192..8200].copy_from_slice(&(orig + 5).to_ne_bytes());

    // Remote READ of the whole damaged target.
    let wr = SendWr::new(3, WrOpcode::RdmaRead)
        .sge(mback.iova, LEN as u32, mback.lkey)
        .remote(mb.iova, mb.rkey);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(completion(&a, &b, udp).status, WcStatus::Success);
    assert!(back == want, "READ returned the frames' bytes");

    // SEND gathered from the damaged range on a.
    b.ctx
        .post_recv(
            b.qp,
            &[RecvWr {
                wr_id: 9,
                sg_list: vec![Sge {
                    addr: mrbuf.iova,
                    length: LEN as u32,
                    lkey: mrbuf.lkey,
                }],
            }],
        )
        .unwrap();
    let wr = SendWr::new(4, WrOpcode::Send).sge(ma.iova + 10, 6000, ma.lkey);
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    assert_eq!(completion(&a, &b, udp).status, WcStatus::Success);
    let wc = completion(&b, &a, udp);
    assert_eq!((wc.status, wc.byte_len), (WcStatus::Success, 6000));
    let sent: Vec<u8> = (0..LEN).map(pat(2)).collect();
    assert!(
        rbuf[..6000] == sent[10..6010],
        "SEND gathered the frames' bytes"
    );

    // The frames themselves, where the test can look at them.
    if let Some(frames) = tb.frames() {
        assert!(frames == want, "the bytes landed in the registered frames");
    }

    for k in [mb.lkey, mrbuf.lkey] {
        b.ctx.dereg_mr(k).unwrap();
    }
    for k in [ma.lkey, msrc.lkey, mback.lkey] {
        a.ctx.dereg_mr(k).unwrap();
    }
    set_pin_mode(PinMode::Auto);
}

/// One operation on memory no frame is left behind (mlock-pinned, then unmapped).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    /// Remote WRITE into it (responder placement), five packets.
    WriteTarget,
    /// The same in one packet (its placement is the last one before the ACK).
    WriteTargetOne,
    /// Remote fetch-and-add on it.
    AtomicTarget,
    /// Remote READ of it (responder source).
    ReadSource,
    /// SEND into a receive buffer in it.
    SendTarget,
    /// SEND gathered from it (requester source).
    SendSource,
    /// RDMA WRITE gathered from it.
    WriteSource,
    /// RDMA READ into it (requester scatter).
    ReadDest,
    /// A good WRITE and, posted with it, a SEND gathered from it: the SEND still reports
    /// LOC_PROT_ERR (the WRITE succeeds, or is flushed if the error came first).
    SendSourceBehindWrite,
}

impl Op {
    const ALL: [Op; 9] = [
        Op::WriteTarget,
        Op::WriteTargetOne,
        Op::AtomicTarget,
        Op::ReadSource,
        Op::SendTarget,
        Op::SendSource,
        Op::WriteSource,
        Op::ReadDest,
        Op::SendSourceBehindWrite,
    ];
}

/// Wait (bounded) until `h`'s QP is in `want`.
fn wait_state(h: &Host, other: &Host, udp: bool, want: QpState) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if !udp {
            drive_until_idle(&[&h.ctx, &other.ctx]);
        }
        let st = h.ctx.qp_state(h.qp).unwrap();
        if st == want {
            return;
        }
        assert!(Instant::now() < deadline, "QP in {st:?}, want {want:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// An operation on unreachable registered memory fails with the status a NIC gives for a DMA
/// it cannot do: the responder's memory → NAK remote access error (REM_ACCESS_ERR at the
/// requester, responder QP → ERR; a SEND's receive buffer: the receive completes with
/// LOC_PROT_ERR and the requester gets REM_OP_ERR); the requester's own memory →
/// LOC_PROT_ERR, requester QP → ERR, the responder untouched. No byte lands anywhere.
fn unreachable(op: Op, backing: Backing, udp: bool) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    set_pin_mode(PinMode::Mlock);
    let (a, b) = hosts(udp);
    let mut tb = map(backing);
    let mut ta = map(backing);
    tb.fill(pat(1));
    ta.fill(pat(2));
    // SAFETY (all registrations): the mappings and vectors outlive the MRs, deregistered
    // below; damaging a mapping while it is registered is what the test is about.
    let mb = unsafe { reg_at(&b, tb.addr, LEN) };
    let ma = unsafe { reg_at(&a, ta.addr, LEN) };
    assert_eq!(mb.pin_path, Some(PinPath::Mlock));
    assert_eq!(ma.pin_path, Some(PinPath::Mlock));
    println!("{op:?} {backing:?} udp={udp}");
    let src: Vec<u8> = (0..LEN).map(pat(3)).collect();
    let back = vec![0u8; LEN];
    let msrc = unsafe { reg_at(&a, src.as_ptr() as u64, LEN) };
    let mback = unsafe { reg_at(&a, back.as_ptr() as u64, LEN) };
    let rbuf: Vec<u8> = (0..LEN).map(pat(4)).collect();
    let mrbuf = unsafe { reg_at(&b, rbuf.as_ptr() as u64, LEN) };
    tb.damage(Damage::Unmap);
    ta.damage(Damage::Unmap);
    let recv = |addr: u64, lkey: u32| {
        b.ctx
            .post_recv(
                b.qp,
                &[RecvWr {
                    wr_id: 9,
                    sg_list: vec![Sge {
                        addr,
                        length: LEN as u32,
                        lkey,
                    }],
                }],
            )
            .unwrap();
    };
    // (work request, requester status, responder receive status, responder QP state)
    let (wr, want_a, want_b_recv, want_b) = match op {
        Op::WriteTarget => (
            SendWr::new(1, WrOpcode::RdmaWrite)
                .sge(msrc.iova, 5000, msrc.lkey)
                .remote(mb.iova + 100, mb.rkey),
            WcStatus::RemAccessErr,
            None,
            QpState::Err,
        ),
        Op::WriteTargetOne => (
            SendWr::new(1, WrOpcode::RdmaWrite)
                .sge(msrc.iova, 1000, msrc.lkey)
                .remote(mb.iova + 100, mb.rkey),
            WcStatus::RemAccessErr,
            None,
            QpState::Err,
        ),
        Op::AtomicTarget => {
            let mut wr = SendWr::new(2, WrOpcode::AtomicFetchAndAdd)
                .sge(mback.iova, 8, mback.lkey)
                .remote(mb.iova + 8192, mb.rkey);
            wr.compare_add = 5;
            (wr, WcStatus::RemAccessErr, None, QpState::Err)
        }
        Op::ReadSource => (
            SendWr::new(3, WrOpcode::RdmaRead)
                .sge(mback.iova, LEN as u32, mback.lkey)
                .remote(mb.iova, mb.rkey),
            WcStatus::RemAccessErr,
            None,
            QpState::Err,
        ),
        Op::SendTarget => {
            recv(mb.iova, mb.lkey);
            (
                SendWr::new(4, WrOpcode::Send).sge(msrc.iova, 6000, msrc.lkey),
                WcStatus::RemOpErr,
                Some(WcStatus::LocProtErr),
                QpState::Err,
            )
        }
        Op::SendSource => {
            recv(mrbuf.iova, mrbuf.lkey);
            (
                SendWr::new(5, WrOpcode::Send).sge(ma.iova + 10, 6000, ma.lkey),
                WcStatus::LocProtErr,
                None,
                QpState::Rts,
            )
        }
        Op::WriteSource => (
            SendWr::new(6, WrOpcode::RdmaWrite)
                .sge(ma.iova + 10, 5000, ma.lkey)
                .remote(mrbuf.iova, mrbuf.rkey),
            WcStatus::LocProtErr,
            None,
            QpState::Rts,
        ),
        Op::SendSourceBehindWrite => {
            recv(mrbuf.iova, mrbuf.lkey);
            let w = SendWr::new(11, WrOpcode::RdmaWrite)
                .sge(msrc.iova, 3000, msrc.lkey)
                .remote(mrbuf.iova + (LEN - 3000) as u64, mrbuf.rkey);
            a.ctx.post_send(a.qp, &[w]).unwrap();
            (
                SendWr::new(5, WrOpcode::Send).sge(ma.iova + 10, 6000, ma.lkey),
                WcStatus::LocProtErr,
                None,
                QpState::Rts,
            )
        }
        Op::ReadDest => (
            SendWr::new(7, WrOpcode::RdmaRead)
                .sge(ma.iova, LEN as u32, ma.lkey)
                .remote(mrbuf.iova, mrbuf.rkey),
            WcStatus::LocProtErr,
            None,
            QpState::Rts,
        ),
    };
    a.ctx.post_send(a.qp, &[wr]).unwrap();
    let mut wc = completion(&a, &b, udp);
    // Whether the good WRITE posted first completed (its bytes then landed for sure).
    let mut write_done = false;
    if op == Op::SendSourceBehindWrite {
        assert_eq!(wc.wr_id, 11);
        assert!(
            matches!(wc.status, WcStatus::Success | WcStatus::WrFlushErr),
            "{wc:?}"
        );
        println!("the WRITE before: {:?}", wc.status);
        write_done = wc.status == WcStatus::Success;
        wc = completion(&a, &b, udp);
        assert_eq!(wc.wr_id, 5);
    }
    assert_eq!(wc.status, want_a, "{op:?}: requester completion {wc:?}");
    assert_eq!(a.ctx.qp_state(a.qp).unwrap(), QpState::Err);
    wait_state(&b, &a, udp, want_b);
    if let Some(st) = want_b_recv {
        let wc = completion(&b, &a, udp);
        assert_eq!((wc.wr_id, wc.status), (9, st), "{op:?}: receive completion");
    } else if want_b == QpState::Rts {
        // Nothing reached the responder: no completion there, its receive stays posted.
        if udp {
            std::thread::sleep(Duration::from_millis(50));
        } else {
            drive_until_idle(&[&a.ctx, &b.ctx]);
        }
        let mut v = Vec::new();
        assert_eq!(b.ctx.poll_cq(b.cq, &mut v, 4).unwrap(), 0, "{op:?}: {v:?}");
    }
    // No byte landed: the plain buffers and the frames the test can see are as they were.
    // (The good WRITE of `SendSourceBehindWrite` was sent before the SEND: it lands in the
    // last 3000 bytes, for sure once it completed.)
    let want_rbuf: Vec<u8> = (0..LEN).map(pat(4)).collect();
    let (head, tail) = rbuf.split_at(LEN - 3000);
    assert!(
        head == &want_rbuf[..LEN - 3000],
        "{op:?}: the responder's buffer is untouched"
    );
    if op != Op::SendSourceBehindWrite {
        assert!(tail == &want_rbuf[LEN - 3000..], "{op:?}: untouched");
    } else if write_done {
        assert!(tail == &src[..3000], "the good WRITE landed");
    }
    if op != Op::AtomicTarget {
        assert!(back.iter().all(|&x| x == 0), "{op:?}: nothing read");
    }
    if let Some(frames) = tb.frames() {
        let orig: Vec<u8> = (0..LEN).map(pat(1)).collect();
        assert!(frames == orig, "{op:?}: nothing written to the frames");
    }
    for k in [mb.lkey, mrbuf.lkey] {
        b.ctx.dereg_mr(k).unwrap();
    }
    for k in [ma.lkey, msrc.lkey, mback.lkey] {
        a.ctx.dereg_mr(k).unwrap();
    }
    set_pin_mode(PinMode::Auto);
}

#[test]
fn read_only_anon() {
    run(Damage::ReadOnly, Backing::Anon, PinMode::Auto, false);
}

#[test]
fn no_access_anon() {
    run(Damage::NoAccess, Backing::Anon, PinMode::Auto, false);
}

#[test]
fn unmapped_anon_io_uring() {
    run(Damage::Unmap, Backing::Anon, PinMode::Auto, false);
}

#[test]
fn unmapped_memfd_seen_through_a_second_mapping() {
    run(Damage::Unmap, Backing::Memfd, PinMode::Auto, false);
}

#[test]
fn read_only_memfd() {
    run(Damage::ReadOnly, Backing::Memfd, PinMode::Auto, false);
}

#[test]
fn no_access_memfd() {
    run(Damage::NoAccess, Backing::Memfd, PinMode::Auto, false);
}

#[test]
fn read_only_mlock() {
    run(Damage::ReadOnly, Backing::Anon, PinMode::Mlock, false);
}

#[test]
fn no_access_mlock() {
    run(Damage::NoAccess, Backing::Anon, PinMode::Mlock, false);
}

#[test]
fn unmapped_mlock_memfd() {
    run(Damage::Unmap, Backing::Memfd, PinMode::Mlock, false);
}

#[test]
fn unmapped_mlock_anon_fails_each_operation() {
    run(Damage::Unmap, Backing::Anon, PinMode::Mlock, false);
}

#[test]
fn over_udp_unmapped_mlock_fails_each_operation() {
    run(Damage::Unmap, Backing::Anon, PinMode::Mlock, true);
    run(Damage::Unmap, Backing::Memfd, PinMode::Mlock, true);
}

#[test]
fn over_udp_no_access_and_unmapped() {
    run(Damage::NoAccess, Backing::Anon, PinMode::Auto, true);
    run(Damage::Unmap, Backing::Memfd, PinMode::Auto, true);
}
