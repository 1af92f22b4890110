//! Safe RC queue pairs over `mrkit0`.
//!
//! **Buffer-ownership design: blocking, borrow-scoped work requests.** Every data operation
//! (`write`, `read`, `fetch_add`, `compare_swap`, `send`, `recv`) borrows the memory regions it
//! uses — `&MemoryRegion` where the device only reads, `&mut MemoryRegion` where it writes —
//! posts one signaled WR on a QP whose send and receive CQs are private to this handle, and
//! waits for *that* completion before returning. An error completion moves the QP to ERR and
//! flushes everything else, and since at most one WR is outstanding at a time, the borrow
//! always outlives the device's use of the buffer: no buffer can be freed or reused while the
//! device may still touch it. Completions are values: the status is data
//! ([`WorkCompletion::status`]), never an `Err`; `Err` means the post itself was refused
//! (errno of `ibv_post_send`).
//!
//! Pipelining (many WRs in flight) is available on the raw device
//! ([`mrkit_soft::Context::post_send`]) for code that manages buffer lifetimes itself.

use std::ops::Range;
use std::time::Duration;

pub use mrkit_soft::cq::{Wc as WorkCompletion, WcOpcode, WcStatus};
use mrkit_soft::qp::{rc_connect, QpCap, QpInitAttr, QpState, RecvWr, SendWr, Sge, WrOpcode};
use mrkit_soft::{AccessFlags, Errno, Error, Result};

use crate::verbs::{MemoryRegion, ProtectionDomain, RemoteSlice};

fn soft(pd: &ProtectionDomain) -> Result<mrkit_soft::Context> {
    pd.context().soft().cloned().ok_or_else(|| {
        Error::new(
            Errno::EOPNOTSUPP,
            "queue pairs need the embedded mrkit0 device",
        )
    })
}

/// An RC queue pair with private send/receive CQs. Destroyed (with its CQs) on drop.
#[derive(Debug)]
pub struct QueuePair {
    dev: mrkit_soft::Context,
    _pd: ProtectionDomain,
    qpn: u32,
    cq: u32,
    rcq: u32,
}

impl QueuePair {
    /// Create an RC QP in `pd`.
    pub fn new(pd: &ProtectionDomain, cap: QpCap) -> Result<QueuePair> {
        let dev = soft(pd)?;
        let cq = dev.create_cq(cap.max_send_wr.max(1) + 1, None)?;
        let rcq = dev.create_cq(cap.max_recv_wr.max(1) + 1, None)?;
        let (qpn, _) = dev.create_qp(QpInitAttr {
            pd: pd.handle(),
            send_cq: cq,
            recv_cq: rcq,
            cap,
            sq_sig_all: true,
        })?;
        Ok(QueuePair {
            dev,
            _pd: pd.clone(),
            qpn,
            cq,
            rcq,
        })
    }

    /// QP number.
    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// Current state.
    pub fn state(&self) -> Result<QpState> {
        self.dev.qp_state(self.qpn)
    }

    /// Connect two QPs (same or different contexts) and move both to RTS. `access` is what
    /// each QP lets its peer do (REMOTE_WRITE/READ/ATOMIC), on top of the MR rights.
    pub fn connect(a: &QueuePair, b: &QueuePair, access: AccessFlags) -> Result<()> {
        rc_connect(&a.dev, a.qpn, &b.dev, b.qpn, access, 5)
    }

    fn wait(&self, cq: u32) -> Result<WorkCompletion> {
        let mut v = Vec::with_capacity(1);
        loop {
            if self.dev.poll_cq(cq, &mut v, 1)? == 1 {
                return Ok(v[0]);
            }
            self.dev.wait_cq(cq, Duration::from_millis(10))?;
        }
    }

    fn exec(&mut self, wr: SendWr) -> Result<WorkCompletion> {
        self.dev.post_send(self.qpn, &[wr]).map_err(|e| e.error)?;
        self.wait(self.cq)
    }

    /// RDMA WRITE `local[range]` to `remote`.
    pub fn write(
        &mut self,
        local: &MemoryRegion,
        range: Range<u64>,
        remote: RemoteSlice,
    ) -> Result<WorkCompletion> {
        let l = local.local(range)?;
        self.exec(
            SendWr::new(0, WrOpcode::RdmaWrite)
                .sge(l.addr, l.len, l.lkey)
                .remote(remote.addr, remote.rkey),
        )
    }

    /// RDMA READ `remote` into `local[range]` (needs LOCAL_WRITE on `local`).
    pub fn read(
        &mut self,
        local: &mut MemoryRegion,
        range: Range<u64>,
        remote: RemoteSlice,
    ) -> Result<WorkCompletion> {
        let l = local.local(range)?;
        self.exec(
            SendWr::new(0, WrOpcode::RdmaRead)
                .sge(l.addr, l.len, l.lkey)
                .remote(remote.addr, remote.rkey),
        )
    }

    /// Atomic fetch-and-add on the remote u64; the original value lands in `result[at..at+8]`.
    pub fn fetch_add(
        &mut self,
        result: &mut MemoryRegion,
        at: u64,
        remote: RemoteSlice,
        add: u64,
    ) -> Result<WorkCompletion> {
        let l = result.local(at..at + 8)?;
        let mut wr = SendWr::new(0, WrOpcode::AtomicFetchAndAdd)
            .sge(l.addr, 8, l.lkey)
            .remote(remote.addr, remote.rkey);
        wr.compare_add = add;
        self.exec(wr)
    }

    /// Atomic compare-and-swap on the remote u64; the original value lands in `result[at..at+8]`.
    pub fn compare_swap(
        &mut self,
        result: &mut MemoryRegion,
        at: u64,
        remote: RemoteSlice,
        compare: u64,
        swap: u64,
    ) -> Result<WorkCompletion> {
        let l = result.local(at..at + 8)?;
        let mut wr = SendWr::new(0, WrOpcode::AtomicCmpAndSwp)
            .sge(l.addr, 8, l.lkey)
            .remote(remote.addr, remote.rkey);
        wr.compare_add = compare;
        wr.swap = swap;
        self.exec(wr)
    }

    /// SEND `local[range]` (the peer must have a receive posted, else RNR retries).
    pub fn send(&mut self, local: &MemoryRegion, range: Range<u64>) -> Result<WorkCompletion> {
        let l = local.local(range)?;
        self.exec(SendWr::new(0, WrOpcode::Send).sge(l.addr, l.len, l.lkey))
    }

    /// Post a receive into `local[range]` and wait for a message (or a flush).
    pub fn recv(&mut self, local: &mut MemoryRegion, range: Range<u64>) -> Result<WorkCompletion> {
        let l = local.local(range)?;
        self.dev
            .post_recv(
                self.qpn,
                &[RecvWr {
                    wr_id: 0,
                    sg_list: vec![Sge {
                        addr: l.addr,
                        length: l.len,
                        lkey: l.lkey,
                    }],
                }],
            )
            .map_err(|e| e.error)?;
        self.wait(self.rcq)
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        let _ = self.dev.destroy_qp(self.qpn);
        let _ = self.dev.destroy_cq(self.cq);
        let _ = self.dev.destroy_cq(self.rcq);
    }
}
