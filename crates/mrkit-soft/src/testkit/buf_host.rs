//! Registered buffers the test itself reads and writes while the device may use them: the
//! `unsafe` registration contract (`UserMemory::new`) kept in one small module. A [`BufHost`]
//! owns its buffer and deregisters before freeing it; [`reg`] and [`buf_mr`] register a
//! caller's bytes and pass the contract on.

use crate::mr::MrInfo;
use crate::qp::Sge;
use crate::{AccessFlags as A, Context, UserMemory};

use super::host::{all, Host};

/// Register `buf` on `h` with all rights.
///
/// # Safety
///
/// Nothing may access the MR once `buf` is freed or moved: the caller posts no work request
/// over it after that, and no peer outside the test knows its keys (the tests' hosts talk only
/// to each other), so an MR left registered until the device is dropped is never used.
pub unsafe fn reg(h: &Host, buf: &mut [u8]) -> MrInfo {
    // SAFETY: the caller guarantees no access reaches the range once `buf` is gone (above).
    let mem = unsafe { UserMemory::new(buf.as_mut_ptr() as u64, buf.len() as u64) };
    h.ctx.reg_mr_va(h.pd, mem, all()).unwrap()
}

/// `len` bytes of `fill` registered on `h` with all rights: the bytes (the MR is valid while
/// they live: bind them to a name, not `_`) and the MR.
///
/// # Safety
///
/// As for [`reg`]: nothing accesses the MR once the returned bytes are dropped.
pub unsafe fn buf_mr(h: &Host, fill: u8, len: usize) -> (Vec<u8>, MrInfo) {
    let mut buf = vec![fill; len];
    // SAFETY: passed on to our caller; the vector's heap buffer does not move with the Vec.
    let mr = unsafe { reg(h, &mut buf) };
    (buf, mr)
}

// ---------------------------------------------------------------------------------------------
// Hosts with one registered buffer (the UDP tests).

/// A host that owns a buffer registered as one MR.
#[derive(Debug)]
pub struct BufHost {
    /// The device instance.
    pub ctx: Context,
    /// Its PD.
    pub pd: u32,
    /// The QP's send and receive CQ.
    pub cq: u32,
    /// The RC QP.
    pub qp: u32,
    /// The registered bytes (never resized: the MR covers exactly them).
    pub buf: Vec<u8>,
    /// The MR over `buf`.
    pub mr: MrInfo,
}

impl Host {
    /// Add a zeroed buffer of `len` bytes registered with `access`.
    pub fn with_buf(self, len: usize, access: A) -> BufHost {
        let Host { ctx, pd, cq, qp } = self;
        let buf = vec![0u8; len];
        // SAFETY: `BufHost` owns `buf` and deregisters the MR before freeing it (its `Drop`);
        // its users never resize `buf`.
        let mem = unsafe { UserMemory::new(buf.as_ptr() as u64, len as u64) };
        let mr = ctx.reg_mr_va(pd, mem, access).unwrap();
        BufHost {
            ctx,
            pd,
            cq,
            qp,
            buf,
            mr,
        }
    }
}

impl Drop for BufHost {
    /// Deregister the MR before its buffer is freed: `dereg_mr` waits until no packet uses the
    /// memory any more. Without it a progress pass still running (the peer retransmitting a
    /// READ, a WRITE arriving late) read or wrote the freed buffer: a crash seen in the UDP
    /// tests once peers kept retrying after the end of a test. If deregistration fails the
    /// buffer is leaked, never freed under a live MR.
    fn drop(&mut self) {
        if self.ctx.dereg_mr(self.mr.lkey).is_err() {
            std::mem::forget(std::mem::take(&mut self.buf));
        }
    }
}

impl BufHost {
    /// One SGE of `len` bytes at offset `off` of the buffer.
    pub fn sge(&self, off: u64, len: u32) -> Vec<Sge> {
        vec![Sge {
            addr: self.mr.iova + off,
            length: len,
            lkey: self.mr.lkey,
        }]
    }
}
