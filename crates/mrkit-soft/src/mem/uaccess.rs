//! Copies that survive a fault, like the kernel's `copy_from_user` with its exception table.
//!
//! The device copies packet data through the process's virtual addresses. If the application
//! `mprotect`s or `munmap`s registered memory, a plain copy would take a SIGSEGV (or SIGBUS)
//! and the process would die from a packet. Instead:
//!
//! * x86-64: [`copy`] is a `rep movsb` at a known address (a few lines of `global_asm!`). A
//!   SIGSEGV/SIGBUS handler, installed once per process ([`install`], `SA_SIGINFO |
//!   SA_ONSTACK`), checks the faulting instruction pointer: if it is that instruction, it
//!   moves it to a fixup label and the copy returns the number of bytes it did not copy. Every
//!   other fault goes to the handler that was installed before (Rust's stack-overflow handler,
//!   an application's), or, if there was none, the default action is restored and the
//!   faulting instruction runs again, so an ordinary crash still crashes with the usual signal.
//!   The fault-free path costs nothing extra: the same `rep movsb` a `memcpy` of this size
//!   would run.
//! * Other architectures: `process_vm_readv` on the process itself (the kernel copies and
//!   reports EFAULT instead of signalling), a syscall per copy.
//!
//! [`proc_mem`] is the slow path for a copy that faulted on memory that is still mapped
//! (`PROT_READ`, `PROT_NONE`): `/proc/self/mem` reaches the frames mapped at the address
//! regardless of the protection (`FOLL_FORCE`), as a NIC's DMA ignores CPU page protections.
//!
//! Limitation: the handler must stay installed. A library that later replaces the SIGSEGV
//! handler without chaining to the previous one brings the old behaviour back (a fault in a
//! copy then kills the process as before).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, Ordering};
#[cfg(target_arch = "x86_64")]
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
std::arch::global_asm!(
    ".pushsection .text.mrkit_uaccess,\"ax\",@progbits",
    ".p2align 4",
    // usize mrkit_uaccess_copy_fwd(u8 *dst, const u8 *src, usize len): bytes NOT copied.
    ".globl mrkit_uaccess_copy_fwd",
    ".hidden mrkit_uaccess_copy_fwd",
    ".type mrkit_uaccess_copy_fwd,@function",
    "mrkit_uaccess_copy_fwd:",
    "mov rcx, rdx",
    ".globl mrkit_uaccess_insn_fwd",
    ".hidden mrkit_uaccess_insn_fwd",
    "mrkit_uaccess_insn_fwd:",
    "rep movsb",
    "xor eax, eax",
    "ret",
    ".size mrkit_uaccess_copy_fwd, . - mrkit_uaccess_copy_fwd",
    ".p2align 4",
    // The same, copying from the last byte down (overlap with dst > src); DF is cleared again
    // on both exits, as the ABI requires.
    ".globl mrkit_uaccess_copy_bwd",
    ".hidden mrkit_uaccess_copy_bwd",
    ".type mrkit_uaccess_copy_bwd,@function",
    "mrkit_uaccess_copy_bwd:",
    "lea rsi, [rsi + rdx - 1]",
    "lea rdi, [rdi + rdx - 1]",
    "mov rcx, rdx",
    "std",
    ".globl mrkit_uaccess_insn_bwd",
    ".hidden mrkit_uaccess_insn_bwd",
    "mrkit_uaccess_insn_bwd:",
    "rep movsb",
    "cld",
    "xor eax, eax",
    "ret",
    // Where the signal handler resumes a faulted copy: RCX holds the bytes not copied.
    ".globl mrkit_uaccess_fixup",
    ".hidden mrkit_uaccess_fixup",
    "mrkit_uaccess_fixup:",
    "cld",
    "mov rax, rcx",
    "ret",
    ".size mrkit_uaccess_copy_bwd, . - mrkit_uaccess_copy_bwd",
    ".p2align 4",
    // usize mrkit_uaccess_get8(const u64 *src, u64 *out): one 8-byte load (single-copy atomic
    // when aligned); 0, or 8 if it faulted (RCX, returned by the fixup).
    ".globl mrkit_uaccess_get8",
    ".hidden mrkit_uaccess_get8",
    ".type mrkit_uaccess_get8,@function",
    "mrkit_uaccess_get8:",
    "mov ecx, 8",
    ".globl mrkit_uaccess_insn_get8",
    ".hidden mrkit_uaccess_insn_get8",
    "mrkit_uaccess_insn_get8:",
    "mov rax, qword ptr [rdi]",
    "mov qword ptr [rsi], rax",
    "xor eax, eax",
    "ret",
    ".size mrkit_uaccess_get8, . - mrkit_uaccess_get8",
    ".p2align 4",
    // usize mrkit_uaccess_put8(u64 *dst, u64 value): one 8-byte store; 0, or 8 if it faulted.
    ".globl mrkit_uaccess_put8",
    ".hidden mrkit_uaccess_put8",
    ".type mrkit_uaccess_put8,@function",
    "mrkit_uaccess_put8:",
    "mov ecx, 8",
    ".globl mrkit_uaccess_insn_put8",
    ".hidden mrkit_uaccess_insn_put8",
    "mrkit_uaccess_insn_put8:",
    "mov qword ptr [rdi], rsi",
    "xor eax, eax",
    "ret",
    ".size mrkit_uaccess_put8, . - mrkit_uaccess_put8",
    ".popsection",
);

#[cfg(target_arch = "x86_64")]
extern "C" {
    fn mrkit_uaccess_copy_fwd(dst: *mut u8, src: *const u8, len: usize) -> usize;
    fn mrkit_uaccess_copy_bwd(dst: *mut u8, src: *const u8, len: usize) -> usize;
    fn mrkit_uaccess_get8(src: *const u64, out: *mut u64) -> usize;
    fn mrkit_uaccess_put8(dst: *mut u64, value: u64) -> usize;
    static mrkit_uaccess_insn_fwd: u8;
    static mrkit_uaccess_insn_bwd: u8;
    static mrkit_uaccess_insn_get8: u8;
    static mrkit_uaccess_insn_put8: u8;
    static mrkit_uaccess_fixup: u8;
}

/// One 8-byte load from `p` (a single access when aligned, as a NIC's 8-byte DMA read);
/// `None` if it faulted.
///
/// # Safety
/// As [`copy`] for the 8 bytes at `p`.
pub(crate) unsafe fn get8(p: *const u64) -> Option<u64> {
    install();
    #[cfg(target_arch = "x86_64")]
    {
        let mut v = 0u64;
        // SAFETY: caller contract; a fault returns through the fixup.
        (unsafe { mrkit_uaccess_get8(p, &mut v) } == 0).then_some(v)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let mut v = [0u8; 8];
        // SAFETY: forwarded contract.
        (unsafe { raw_copy(v.as_mut_ptr(), p.cast(), 8, false) } == 0)
            .then(|| u64::from_ne_bytes(v))
    }
}

/// One 8-byte store of `v` at `p`; false if it faulted (nothing was written).
///
/// # Safety
/// As [`copy`] for the 8 bytes at `p`.
pub(crate) unsafe fn put8(p: *mut u64, v: u64) -> bool {
    install();
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: caller contract; a fault returns through the fixup.
        unsafe { mrkit_uaccess_put8(p, v) == 0 }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let b = v.to_ne_bytes();
        // SAFETY: forwarded contract.
        unsafe { raw_copy(p.cast(), b.as_ptr(), 8, false) == 0 }
    }
}

/// Which part of a copy is left after a fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Left {
    /// Everything was copied.
    Nothing,
    /// The copy ran forwards and stopped: bytes `[at, len)` are not copied.
    Tail { at: usize },
    /// The copy ran backwards and stopped: bytes `[0, n)` are not copied.
    Head { n: usize },
}

/// Copy `len` bytes from `src` to `dst` (they may overlap, as `memmove`), stopping at the first
/// byte that faults instead of taking the signal. The bytes not yet copied are untouched on
/// both sides except for the ones already overwritten by the overlap (never a byte still to be
/// read).
///
/// # Safety
/// `[src, src + len)` and `[dst, dst + len)` must be ranges the caller may access: registered
/// memory kept registered (pinned) for the call, or memory it owns. They may be unmapped or
/// protected behind the caller's back; that is what the recovery is for.
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) -> Left {
    if len == 0 {
        return Left::Nothing;
    }
    install();
    let backwards = (dst as usize) > (src as usize) && (dst as usize) - (src as usize) < len;
    // SAFETY: caller contract; a fault inside the copy returns through the fixup.
    let left = unsafe { raw_copy(dst, src, len, backwards) };
    match (left, backwards) {
        (0, _) => Left::Nothing,
        (n, false) => Left::Tail {
            at: len - n.min(len),
        },
        (n, true) => Left::Head { n: n.min(len) },
    }
}

/// # Safety
/// As [`copy`].
#[cfg(target_arch = "x86_64")]
unsafe fn raw_copy(dst: *mut u8, src: *const u8, len: usize, backwards: bool) -> usize {
    // SAFETY: the asm routines take (dst, src, len) in the C ABI and touch nothing else; a
    // fault resumes at the fixup, which returns the count left (handler below).
    unsafe {
        if backwards {
            mrkit_uaccess_copy_bwd(dst, src, len)
        } else {
            mrkit_uaccess_copy_fwd(dst, src, len)
        }
    }
}

/// # Safety
/// As [`copy`].
#[cfg(not(target_arch = "x86_64"))]
unsafe fn raw_copy(dst: *mut u8, src: *const u8, len: usize, backwards: bool) -> usize {
    if backwards {
        // Overlapping: through a bounce buffer (the kernel copies page by page forwards).
        let mut tmp = vec![0u8; len];
        // SAFETY: forwarded contract; tmp is ours.
        let left = unsafe { raw_copy(tmp.as_mut_ptr(), src, len, false) };
        if left != 0 {
            return len;
        }
        // SAFETY: as above.
        return if unsafe { raw_copy(dst, tmp.as_ptr(), len, false) } == 0 {
            0
        } else {
            len
        };
    }
    let local = libc::iovec {
        iov_base: dst.cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: src as *mut c_void,
        iov_len: len,
    };
    // SAFETY: the kernel copies between our own ranges and reports faults as EFAULT.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    if n < 0 {
        len
    } else {
        len - (n as usize).min(len)
    }
}

/// Move bytes through `/proc/self/mem`: the frames mapped at `addr` now, whatever their
/// protection (the kernel's `FOLL_FORCE`; a private mapping's own pages are written in place).
/// Fails (EIO/EFAULT) where nothing is mapped, and for writes into a read-only shared mapping.
pub(crate) fn proc_mem(addr: u64, dma: super::pin::Dma<'_>) -> std::io::Result<()> {
    use super::pin::Dma;
    let f = rustix::fs::open(
        "/proc/self/mem",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    let mut done = 0usize;
    match dma {
        Dma::ToFrames(b) => {
            while done < b.len() {
                match rustix::io::pwrite(&f, &b[done..], addr + done as u64)? {
                    0 => return Err(std::io::Error::from_raw_os_error(libc::EIO)),
                    n => done += n,
                }
            }
        }
        Dma::FromFrames(b) => {
            while done < b.len() {
                match rustix::io::pread(&f, &mut b[done..], addr + done as u64)? {
                    0 => return Err(std::io::Error::from_raw_os_error(libc::EIO)),
                    n => done += n,
                }
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The signal handler.

/// The SIGSEGV and SIGBUS dispositions found when the handler was installed.
#[cfg(target_arch = "x86_64")]
struct Previous {
    segv: libc::sigaction,
    bus: libc::sigaction,
}
// SAFETY: plain data (handler addresses, flags, a signal set), written once before publication
// and only read afterwards.
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for Previous {}
// SAFETY: as above.
#[cfg(target_arch = "x86_64")]
unsafe impl Send for Previous {}

#[cfg(target_arch = "x86_64")]
static PREVIOUS: OnceLock<Previous> = OnceLock::new();

/// 0: not installed, 1: being installed, 2: installed. Orders nothing else: the handler reads
/// [`PREVIOUS`] through its own acquire load.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Install the fault handler for SIGSEGV and SIGBUS once per process (a forked child inherits
/// it). Cheap after the first call (one relaxed load). While another thread is installing it,
/// a caller proceeds without waiting (the window is a few syscalls long).
pub(crate) fn install() {
    if STATE.load(Ordering::Relaxed) == 2 {
        return;
    }
    if STATE
        .compare_exchange(0, 1, Ordering::Relaxed, Ordering::Relaxed)
        .is_err()
    {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: sigaction with a zeroed struct as the query result and a handler that only
        // reads its own statics and the signal context (async-signal-safe).
        unsafe {
            let mut segv: libc::sigaction = std::mem::zeroed();
            let mut bus: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut segv) != 0
                || libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut bus) != 0
            {
                tracing::warn!(
                    "sigaction query failed: copies into registered memory are unprotected"
                );
                return;
            }
            let _ = PREVIOUS.set(Previous { segv, bus });
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_fault as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut act.sa_mask);
            if libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut()) != 0
                || libc::sigaction(libc::SIGBUS, &act, std::ptr::null_mut()) != 0
            {
                tracing::warn!("sigaction failed: copies into registered memory are unprotected");
            }
        }
    }
    STATE.store(2, Ordering::Relaxed);
}

#[cfg(target_arch = "x86_64")]
extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, uctx: *mut c_void) {
    // SAFETY: the kernel passes a valid ucontext for an SA_SIGINFO handler; only the saved RIP
    // is read and, for a fault of our copy instruction, redirected to its fixup. Taking the
    // addresses of the asm labels reads nothing.
    unsafe {
        let uc = uctx.cast::<libc::ucontext_t>();
        let rip = &mut (*uc).uc_mcontext.gregs[libc::REG_RIP as usize];
        let at = *rip as usize;
        if at == std::ptr::addr_of!(mrkit_uaccess_insn_fwd) as usize
            || at == std::ptr::addr_of!(mrkit_uaccess_insn_bwd) as usize
            || at == std::ptr::addr_of!(mrkit_uaccess_insn_get8) as usize
            || at == std::ptr::addr_of!(mrkit_uaccess_insn_put8) as usize
        {
            *rip = std::ptr::addr_of!(mrkit_uaccess_fixup) as usize as libc::greg_t;
            return;
        }
        chain(sig, info, uctx);
    }
}

/// Hand a fault that is not ours to the disposition found at installation.
///
/// # Safety
/// Called from the signal handler with its arguments.
#[cfg(target_arch = "x86_64")]
unsafe fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, uctx: *mut c_void) {
    let prev = PREVIOUS
        .get()
        .map(|p| if sig == libc::SIGBUS { p.bus } else { p.segv });
    match prev {
        Some(a) if a.sa_sigaction != libc::SIG_DFL && a.sa_sigaction != libc::SIG_IGN => {
            if a.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: an SA_SIGINFO handler has this signature.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut c_void) =
                    unsafe { std::mem::transmute(a.sa_sigaction) };
                f(sig, info, uctx);
            } else {
                // SAFETY: a plain handler has this signature.
                let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(a.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // No handler before ours (or SIG_IGN, meaningless for a fault): restore the
            // default; returning re-runs the faulting instruction, which now ends the process
            // with the usual signal (and core dump).
            // SAFETY: sigaction with a zeroed struct naming SIG_DFL (async-signal-safe).
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::test_util::Map;

    fn protect(addr: u64, len: u64, prot: libc::c_int) {
        // SAFETY: changing the protection of a test mapping nothing else references.
        assert_eq!(
            unsafe { libc::mprotect(addr as *mut _, len as usize, prot) },
            0
        );
    }

    #[test]
    fn copies_like_memmove_without_faults() {
        for len in [0usize, 1, 7, 64, 4096, 70_000] {
            let src: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let mut dst = vec![0u8; len];
            // SAFETY: both ranges are ours.
            assert_eq!(
                unsafe { copy(dst.as_mut_ptr(), src.as_ptr(), len) },
                Left::Nothing
            );
            assert_eq!(dst, src);
        }
        // Overlap both ways, as memmove.
        let orig: Vec<u8> = (0..100u8).collect();
        let mut v = orig.clone();
        // SAFETY: inside v.
        assert_eq!(
            unsafe { copy(v.as_mut_ptr().add(10), v.as_ptr(), 80) },
            Left::Nothing
        );
        assert_eq!(&v[10..90], &orig[..80]);
        let mut v = orig.clone();
        // SAFETY: inside v.
        assert_eq!(
            unsafe { copy(v.as_mut_ptr(), v.as_ptr().add(10), 80) },
            Left::Nothing
        );
        assert_eq!(&v[..80], &orig[10..90]);
    }

    #[test]
    fn a_fault_returns_what_is_left() {
        let ps = 4096u64;
        let m = Map::new(2 * ps);
        let src = vec![0x5au8; 2 * ps as usize];
        protect(m.addr + ps, ps, libc::PROT_READ);
        // Forwards into [page 0 rw | page 1 ro]: stops at page 1.
        // SAFETY: the mapping is ours; the fault is recovered.
        let left = unsafe { copy(m.addr as *mut u8, src.as_ptr(), 2 * ps as usize) };
        assert_eq!(left, Left::Tail { at: ps as usize });
        // SAFETY: page 0 is readable.
        assert_eq!(unsafe { *(m.addr as *const u8) }, 0x5a);
        // Reading a PROT_NONE page.
        protect(m.addr + ps, ps, libc::PROT_NONE);
        let mut out = vec![0u8; 16];
        // SAFETY: as above.
        let left = unsafe { copy(out.as_mut_ptr(), (m.addr + ps) as *const u8, 16) };
        assert_eq!(left, Left::Tail { at: 0 });
        // Backwards (overlapping, dst > src), faulting on the first byte it writes.
        // SAFETY: as above.
        let left = unsafe {
            copy(
                (m.addr + ps - 24) as *mut u8,
                (m.addr + ps - 32) as *const u8,
                16,
            )
        };
        assert_eq!(left, Left::Nothing, "both in page 0");
        // SAFETY: as above.
        let left = unsafe { copy((m.addr + ps) as *mut u8, (m.addr + ps - 8) as *const u8, 16) };
        assert_eq!(left, Left::Head { n: 16 });
        protect(m.addr + ps, ps, libc::PROT_READ | libc::PROT_WRITE);
    }

    #[test]
    fn eight_byte_accesses_recover() {
        let ps = 4096u64;
        let m = Map::new(ps);
        let p = (m.addr + 64) as *mut u64;
        // SAFETY: inside our mapping.
        unsafe {
            assert!(put8(p, 0x1122_3344_5566_7788));
            assert_eq!(get8(p), Some(0x1122_3344_5566_7788));
        }
        protect(m.addr, ps, libc::PROT_READ);
        // SAFETY: as above; the store faults and is recovered.
        unsafe {
            assert!(!put8(p, 1));
            assert_eq!(get8(p), Some(0x1122_3344_5566_7788));
        }
        protect(m.addr, ps, libc::PROT_NONE);
        // SAFETY: as above.
        assert_eq!(unsafe { get8(p) }, None);
        protect(m.addr, ps, libc::PROT_READ | libc::PROT_WRITE);
    }

    #[test]
    fn proc_mem_reaches_protected_pages() {
        let ps = 4096u64;
        let m = Map::new(ps);
        protect(m.addr, ps, libc::PROT_NONE);
        proc_mem(
            m.addr + 100,
            super::super::pin::Dma::ToFrames(b"through the frames"),
        )
        .unwrap();
        let mut back = [0u8; 18];
        proc_mem(m.addr + 100, super::super::pin::Dma::FromFrames(&mut back)).unwrap();
        assert_eq!(&back, b"through the frames");
        protect(m.addr, ps, libc::PROT_READ);
        // SAFETY: readable again.
        let seen = unsafe { std::slice::from_raw_parts((m.addr + 100) as *const u8, 18) };
        assert_eq!(seen, b"through the frames");
    }

    /// A fault that is not a copy's still kills the process with SIGSEGV (the handler chains
    /// to the default action).
    #[test]
    fn other_faults_still_crash() {
        install();
        // SAFETY: the child faults on purpose and is reaped below.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: a deliberate write to address 8 (never mapped).
            unsafe { std::ptr::write_volatile(8 as *mut u8, 1) };
            // SAFETY: not reached.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0);
        let mut status = 0;
        // SAFETY: reaping our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFSIGNALED(status), "status {status:#x}");
        assert_eq!(libc::WTERMSIG(status), libc::SIGSEGV);
    }
}
