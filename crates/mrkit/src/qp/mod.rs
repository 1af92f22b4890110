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
//! **Pipelining: ownership moves into the work request.** [`QueuePair::post_write`],
//! [`QueuePair::post_read`] and [`QueuePair::post_send`] take an [`Owned`] registered buffer
//! *by value* (a [`MemoryRegion`] or a pool [`OwnedSlot`]) and return a [`Ticket`]; the buffer
//! is held by the queue pair while the device may touch it and comes back with its completion
//! from [`QueuePair::poll`] / [`QueuePair::wait_all`]. Every WR is signaled and an error
//! flushes the rest, so every buffer comes back. Dropping the queue pair destroys the QP first
//! (after which the device never touches its WRs' memory), then frees buffers still held.
//!
//! A buffer in flight cannot be touched — it was moved:
//!
//! ```compile_fail
//! # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
//! # let c = Context::open(mrkit::DeviceConfig::rxe());
//! # let pd = c.alloc_pd().unwrap();
//! # let mut q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
//! # let dst = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
//! let mut src = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
//! let _t = q1.post_write(src, 0..4096, dst.remote(0..4096).unwrap()).unwrap();
//! src.as_mut_slice()[0] = 1; // error: `src` was moved into the work request
//! ```
//!
//! Nor can it be read back before its completion returned it:
//!
//! ```compile_fail
//! # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
//! # let c = Context::open(mrkit::DeviceConfig::rxe());
//! # let pd = c.alloc_pd().unwrap();
//! # let mut q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
//! # let src = pd.register(Buffer::new(4096).unwrap(), A::REMOTE_READ).unwrap();
//! let dst = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
//! let _t = q1.post_read(dst, 0..4096, src.remote(0..4096).unwrap()).unwrap();
//! let first = dst.as_slice()[0]; // error: borrow of moved value `dst`
//! ```
//!
//! The same program with the buffer taken back from the completion compiles and runs:
//!
//! ```
//! # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair, WcStatus};
//! # use mrkit::qp::Owned;
//! # let c = Context::open(mrkit::DeviceConfig::rxe());
//! # let pd = c.alloc_pd().unwrap();
//! # let mut q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
//! # let src = pd.register(Buffer::new(4096).unwrap(), A::REMOTE_READ).unwrap();
//! let dst = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
//! let t = q1.post_read(dst, 0..4096, src.remote(0..4096).unwrap()).unwrap();
//! let (wc, buf) = q1.wait_all().unwrap().pop().unwrap();
//! assert_eq!((wc.wr_id, wc.status), (t.wr_id(), WcStatus::Success));
//! let Some(Owned::Mr(dst)) = buf else { panic!() };
//! assert_eq!(dst.as_slice()[0], 0);
//! ```

pub mod endpoint;
pub mod registered;
pub mod tcp;

use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

pub use mrkit_soft::cq::{Wc as WorkCompletion, WcOpcode, WcStatus};
use mrkit_soft::qp::{rc_connect, QpCap, QpInitAttr, QpState, RecvWr, SendWr, Sge, WrOpcode};
use mrkit_soft::{AccessFlags, Errno, Error, Result};

use crate::pool::OwnedSlot;
use crate::verbs::{LocalSlice, MemoryRegion, ProtectionDomain, RemoteSlice};

/// A registered buffer a pipelined work request owns until its completion.
#[derive(Debug)]
pub enum Owned {
    /// A whole memory region.
    Mr(MemoryRegion),
    /// A slot of an [`MrPool`](crate::pool::MrPool) (keeps its pool alive).
    Slot(OwnedSlot),
}

impl Owned {
    fn local(&self, range: Range<u64>) -> Result<LocalSlice> {
        match self {
            Owned::Mr(m) => m.local(range),
            Owned::Slot(s) => s.local(range),
        }
    }
    /// The bytes (only reachable once the buffer is back from its completion).
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Owned::Mr(m) => m.as_slice(),
            Owned::Slot(s) => s.as_slice(),
        }
    }
    /// Mutable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Owned::Mr(m) => m.as_mut_slice(),
            Owned::Slot(s) => s.as_mut_slice(),
        }
    }
}

impl From<MemoryRegion> for Owned {
    fn from(m: MemoryRegion) -> Owned {
        Owned::Mr(m)
    }
}

impl From<OwnedSlot> for Owned {
    fn from(s: OwnedSlot) -> Owned {
        Owned::Slot(s)
    }
}

/// Names a pipelined work request; its completion carries [`Ticket::wr_id`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "the completion with this ticket's wr_id hands the buffer back"]
pub struct Ticket(u64);

impl Ticket {
    /// The `wr_id` of the completion.
    pub fn wr_id(self) -> u64 {
        self.0
    }
}

/// A refused post: the errno and the buffer, handed back untouched.
#[derive(Debug)]
pub struct PostRefused {
    /// Why (errno of `ibv_post_send`).
    pub error: Error,
    /// The buffer.
    pub buf: Owned,
}

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
    next_id: u64,
    /// Buffers owned by WRs in flight, by wr_id. Dropped after the QP is destroyed.
    inflight: HashMap<u64, Owned>,
    /// Pipelined completions met while a blocking call waited for its own.
    ready: Vec<(WorkCompletion, Option<Owned>)>,
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
            next_id: 1,
            inflight: HashMap::new(),
            ready: Vec::new(),
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

    fn exec(&mut self, mut wr: SendWr) -> Result<WorkCompletion> {
        let id = self.next_id;
        self.next_id += 1;
        wr.wr_id = id;
        self.dev.post_send(self.qpn, &[wr]).map_err(|e| e.error)?;
        loop {
            let wc = self.wait(self.cq)?;
            if wc.wr_id == id {
                return Ok(wc);
            }
            let b = self.inflight.remove(&wc.wr_id);
            self.ready.push((wc, b));
        }
    }

    fn post_owned(
        &mut self,
        op: WrOpcode,
        buf: Owned,
        range: Range<u64>,
        remote: Option<RemoteSlice>,
    ) -> std::result::Result<Ticket, Box<PostRefused>> {
        let l = match buf.local(range) {
            Ok(l) => l,
            Err(error) => return Err(Box::new(PostRefused { error, buf })),
        };
        let id = self.next_id;
        let mut wr = SendWr::new(id, op).sge(l.addr, l.len, l.lkey);
        if let Some(r) = remote {
            wr = wr.remote(r.addr, r.rkey);
        }
        if let Err(e) = self.dev.post_send(self.qpn, &[wr]) {
            return Err(Box::new(PostRefused {
                error: e.error,
                buf,
            }));
        }
        self.next_id += 1;
        self.inflight.insert(id, buf);
        Ok(Ticket(id))
    }

    /// Pipelined RDMA WRITE of `buf[range]` to `remote`: `buf` is owned by the WR until its
    /// completion hands it back ([`QueuePair::poll`]). ENOMEM when the send queue is full.
    pub fn post_write(
        &mut self,
        buf: impl Into<Owned>,
        range: Range<u64>,
        remote: RemoteSlice,
    ) -> std::result::Result<Ticket, Box<PostRefused>> {
        self.post_owned(WrOpcode::RdmaWrite, buf.into(), range, Some(remote))
    }

    /// Pipelined RDMA READ of `remote` into `buf[range]` (needs LOCAL_WRITE).
    pub fn post_read(
        &mut self,
        buf: impl Into<Owned>,
        range: Range<u64>,
        remote: RemoteSlice,
    ) -> std::result::Result<Ticket, Box<PostRefused>> {
        self.post_owned(WrOpcode::RdmaRead, buf.into(), range, Some(remote))
    }

    /// Pipelined SEND of `buf[range]`.
    pub fn post_send(
        &mut self,
        buf: impl Into<Owned>,
        range: Range<u64>,
    ) -> std::result::Result<Ticket, Box<PostRefused>> {
        self.post_owned(WrOpcode::Send, buf.into(), range, None)
    }

    /// Pipelined WRs not yet completed.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Completions of pipelined WRs available now, each with its buffer back.
    pub fn poll(&mut self) -> Result<Vec<(WorkCompletion, Option<Owned>)>> {
        let mut out = std::mem::take(&mut self.ready);
        let mut v = Vec::new();
        self.dev.poll_cq(self.cq, &mut v, 256)?;
        for wc in v {
            let b = self.inflight.remove(&wc.wr_id);
            out.push((wc, b));
        }
        Ok(out)
    }

    /// Wait until every pipelined WR completed; returns their completions and buffers.
    pub fn wait_all(&mut self) -> Result<Vec<(WorkCompletion, Option<Owned>)>> {
        let mut out = self.poll()?;
        while !self.inflight.is_empty() {
            let wc = self.wait(self.cq)?;
            let b = self.inflight.remove(&wc.wr_id);
            out.push((wc, b));
        }
        Ok(out)
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
        // Destroy first: after destroy_qp returns the device never touches the QP's WRs, so
        // the buffers in `inflight` are freed (as fields, after this) only once that holds.
        let _ = self.dev.destroy_qp(self.qpn);
        let _ = self.dev.destroy_cq(self.cq);
        let _ = self.dev.destroy_cq(self.rcq);
    }
}
