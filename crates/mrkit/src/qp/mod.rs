//! Safe RC queue pairs, over any [`Provider`](crate::Provider) that implements the CQ/QP verbs.
//!
//! **One ownership story.** A [`QueuePair<B>`] carries buffers of one type `B`, anything
//! [`Registered`]: by default [`Owned`] (MRs, pool slots, lists of them), or a borrow such as
//! `&MemoryRegion` / `&mut MemoryRegion`, or a list `Vec<T>` of pieces posted as one
//! scatter/gather list. [`QueuePair::post_write`], [`QueuePair::post_send`],
//! [`QueuePair::post_read`] and [`QueuePair::post_recv`] take the buffer *by value* and return a
//! [`Ticket`]; the queue pair holds the buffer while the device may touch it, and its
//! [`Completion`] hands it back ([`QueuePair::poll`], [`QueuePair::wait`],
//! [`QueuePair::wait_all`], or, with the `tokio` feature, `QueuePair::completion(ticket).await`).
//! READ destinations and receive buffers must be [`DeviceWritable`] (owned, or `&mut`), never a
//! shared borrow. Every WR is signaled and an error flushes the rest, so every buffer comes
//! back. Dropping the queue pair destroys the QP first (after which the device never touches
//! its WRs' memory), then drops buffers still held. A borrowed `B` carries its lifetime in the
//! queue pair's type, so the queue pair cannot outlive memory it may still touch.
//!
//! Leaking a queue pair (`std::mem::forget`) ends its borrows without stopping the device, so
//! the borrowed bytes may then still change under the program, as bytes registered with remote
//! write rights always may; memory is never freed while registered (a [`MemoryRegion`]
//! deregisters before it frees its buffer).
//!
//! [`MemoryRegion`]: crate::MemoryRegion
//!
//! **Blocking one-WR calls** ([`QueuePair::write`], [`QueuePair::read`], [`QueuePair::send`],
//! [`QueuePair::recv`], [`QueuePair::fetch_add`], [`QueuePair::compare_swap`]) borrow the
//! memory (`&impl Registered`, or `&mut impl DeviceWritable` where the device writes) and return
//! only after that work request's completion, so the borrow outlives the device's use.
//!
//! **Completions are values**: the status is data ([`WorkCompletion::status`],
//! [`Completion::into_result`] turns it into an error); `Err` means the post itself was refused
//! (errno of `ibv_post_send`) or a wait ran out of time.
//!
//! **Timeouts.** [`QueuePair::wait`] and [`QueuePair::wait_all`] take one and fail with
//! `ETIMEDOUT`, leaving every buffer with the queue pair (a later wait or poll hands it back).
//! The blocking calls honour [`QueuePair::set_timeout`] (default 30 s): since the caller's
//! borrow must not end while the device may still use the memory, a blocking call that runs
//! out of time moves the QP to ERR (the IBA way to stop a work request: it is flushed), waits
//! for that flush completion, and then fails with `ETIMEDOUT`.
//!
//! A buffer in flight cannot be touched — it was moved:
//!
//! ```compile_fail
//! # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
//! # let c = Context::open(mrkit::DeviceConfig::rxe());
//! # let pd = c.alloc_pd().unwrap();
//! # let q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
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
//! # let q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
//! # let src = pd.register(Buffer::new(4096).unwrap(), A::REMOTE_READ).unwrap();
//! let dst = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
//! let _t = q1.post_read(dst, 0..4096, src.remote(0..4096).unwrap()).unwrap();
//! let first = dst.as_slice()[0]; // error: borrow of moved value `dst`
//! ```
//!
//! A borrowed buffer stays borrowed while the queue pair may use it:
//!
//! ```compile_fail
//! # use mrkit::{AccessFlags as A, Buffer, Context, MemoryRegion, QpCap, QueuePair};
//! # let c = Context::open(mrkit::DeviceConfig::rxe());
//! # let pd = c.alloc_pd().unwrap();
//! # let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # let src = pd.register(Buffer::new(4096).unwrap(), A::REMOTE_READ).unwrap();
//! let mut dst = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
//! let q1: QueuePair<&mut MemoryRegion> = QueuePair::new_typed(&pd, QpCap::default()).unwrap();
//! # QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
//! let _t = q1.post_read(&mut dst, 0..4096, src.remote(0..4096).unwrap()).unwrap();
//! dst.as_mut_slice()[0] = 1; // error: `dst` is mutably borrowed by the queue pair
//! ```
//!
//! A queue pair cannot outlive a buffer it borrows:
//!
//! ```compile_fail
//! # use mrkit::{AccessFlags as A, Buffer, Context, MemoryRegion, QpCap, QueuePair};
//! # let c = Context::open(mrkit::DeviceConfig::rxe());
//! # let pd = c.alloc_pd().unwrap();
//! # let dst = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
//! let q1: QueuePair<&MemoryRegion> = QueuePair::new_typed(&pd, QpCap::default()).unwrap();
//! {
//!     let src = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
//!     let _t = q1.post_write(&src, 0..4096, dst.remote(0..4096).unwrap());
//! } // error: `src` dropped here while still borrowed
//! drop(q1);
//! ```
//!
//! The device never writes through a shared borrow (a READ needs [`DeviceWritable`]):
//!
//! ```compile_fail
//! # use mrkit::{AccessFlags as A, Buffer, Context, MemoryRegion, QpCap, QueuePair};
//! # let c = Context::open(mrkit::DeviceConfig::rxe());
//! # let pd = c.alloc_pd().unwrap();
//! # let src = pd.register(Buffer::new(4096).unwrap(), A::REMOTE_READ).unwrap();
//! let dst = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
//! let q1: QueuePair<&MemoryRegion> = QueuePair::new_typed(&pd, QpCap::default()).unwrap();
//! let _t = q1.post_read(&dst, 0..4096, src.remote(0..4096).unwrap()); // error: not DeviceWritable
//! ```
//!
//! The blocking READ does not take a shared borrow either:
//!
//! ```compile_fail
//! # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
//! # let c = Context::open(mrkit::DeviceConfig::rxe());
//! # let pd = c.alloc_pd().unwrap();
//! # let q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # let src = pd.register(Buffer::new(4096).unwrap(), A::REMOTE_READ).unwrap();
//! let dst = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
//! q1.read(&dst, 0..4096, src.remote(0..4096).unwrap()).unwrap(); // error: `&MemoryRegion` is not DeviceWritable
//! ```
//!
//! The same programs with the buffer taken back from the completion compile and run:
//!
//! ```
//! # use mrkit::{AccessFlags as A, Buffer, Context, MemoryRegion, QpCap, QueuePair, WcStatus};
//! # use mrkit::qp::Owned;
//! # use std::time::Duration;
//! # let c = Context::open(mrkit::DeviceConfig::rxe());
//! # let pd = c.alloc_pd().unwrap();
//! # let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # let src = pd.register(Buffer::new(4096).unwrap(), A::REMOTE_READ).unwrap();
//! let q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
//! # QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
//! let dst = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
//! let t = q1.post_read(dst, 0..4096, src.remote(0..4096).unwrap()).unwrap();
//! let c = q1.wait(Duration::from_secs(10)).unwrap();
//! assert_eq!((c.wr_id(), c.status()), (t.wr_id(), WcStatus::Success));
//! let Owned::Mr(dst) = c.buf else { panic!() };
//! assert_eq!(dst.as_slice()[0], 0);
//!
//! // Borrowed: the completion hands the borrow back.
//! let mut dst2 = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
//! {
//!     let q3: QueuePair<&mut MemoryRegion> = QueuePair::new_typed(&pd, QpCap::default()).unwrap();
//!     let q4 = QueuePair::new(&pd, QpCap::default()).unwrap();
//!     QueuePair::connect(&q3, &q4, A::REMOTE_READ).unwrap();
//!     q3.post_read(&mut dst2, 0..4096, src.remote(0..4096).unwrap()).unwrap();
//!     let c = q3.wait(Duration::from_secs(10)).unwrap();
//!     c.buf.as_mut_slice()[0] = 9; // ours again
//! }
//! assert_eq!(dst2.as_slice()[0], 9);
//! ```

#[cfg(feature = "tokio")]
#[allow(unsafe_code)] // registering the completion channel's descriptor with tokio
mod async_io;
#[allow(unsafe_code)] // `unsafe impl Registered for Owned`
mod completion;
pub mod endpoint;
#[allow(unsafe_code)] // the `unsafe trait`s `Registered` / `DeviceWritable` and their impls
pub mod registered;
pub mod tcp;

use std::collections::{HashSet, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

pub use mrkit_soft::cq::{Wc as WorkCompletion, WcOpcode, WcStatus};
use mrkit_soft::qp::{attr_mask as m, AddressVector, QpAttr, QpCap, QpInitAttr, QpState};
use mrkit_soft::qp::{RecvWr, SendWr, Sge, WrOpcode};
use mrkit_soft::{AccessFlags, Errno, Error, Result};
use parking_lot::Mutex;

#[cfg(feature = "tokio")]
pub use async_io::CompletionFuture;
pub use completion::{Completion, CompletionError, Owned, PostRefused, Ticket, WcError};
pub use registered::{DeviceWritable, Registered};

use crate::verbs::{Context, LocalSlice, ProtectionDomain, RemoteSlice};

/// How long a blocking call waits for its completion unless [`QueuePair::set_timeout`] says
/// otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Longest single sleep on the completion channel: a waiter whose completion another thread
/// reaped (it consumed the channel's event) sees it after at most this long.
const WAIT_SLICE: Duration = Duration::from_millis(5);

/// Completions polled from a CQ at a time.
const POLL_BATCH: usize = 64;

/// The queue pair's book-keeping, under one lock.
#[derive(Debug)]
struct State<B> {
    next_id: u64,
    /// Buffers owned by pipelined WRs in flight, by wr_id. Dropped after the QP is destroyed.
    inflight: std::collections::HashMap<u64, B>,
    /// wr_ids of blocking calls in progress (their completions are theirs alone).
    blocking: HashSet<u64>,
    /// Completions reaped from the CQs, not yet handed out, in order of arrival.
    done: VecDeque<WorkCompletion>,
    /// Whether the send / receive CQ's arm is pending (armed, its event not yet taken).
    armed: [bool; 2],
    /// Async waiters to wake when completions are reaped (`async_io`).
    #[cfg(feature = "tokio")]
    wakers: Vec<(u64, std::task::Waker)>,
    #[cfg(feature = "tokio")]
    next_waiter: u64,
}

impl<B> State<B> {
    /// The completion of `id` when reaped.
    fn take_id(&mut self, id: u64) -> Option<WorkCompletion> {
        let i = self.done.iter().position(|w| w.wr_id == id)?;
        self.done.remove(i)
    }
    /// The completion (and buffer) of pipelined WR `id`, if reaped.
    fn take_ticket(&mut self, id: u64) -> Option<Completion<B>> {
        let wc = self.take_id(id)?;
        let buf = self.inflight.remove(&id)?;
        Some(Completion { wc, buf })
    }
    /// The oldest reaped completion of a pipelined WR.
    fn take_any(&mut self) -> Option<Completion<B>> {
        loop {
            let i = self
                .done
                .iter()
                .position(|w| !self.blocking.contains(&w.wr_id))?;
            let wc = self.done.remove(i)?;
            // Every completion not of a blocking call belongs to a pipelined WR whose buffer
            // is here; one that does not (a provider reporting a wr_id never posted) is
            // dropped rather than handed out without a buffer.
            match self.inflight.remove(&wc.wr_id) {
                Some(buf) => return Some(Completion { wc, buf }),
                None => tracing::warn!(wr_id = wc.wr_id, "completion of an unknown work request"),
            }
        }
    }
    /// Whether every pipelined WR's completion has been reaped.
    fn all_reaped(&self) -> bool {
        let reaped = self
            .done
            .iter()
            .filter(|w| self.inflight.contains_key(&w.wr_id))
            .count();
        reaped == self.inflight.len()
    }
}

/// The provider handles of a [`QueuePair`] ([`QueuePair::raw_handles`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawHandles {
    /// The QP number (`post_send`, `post_recv`, `modify_qp`).
    pub qpn: u32,
    /// The CQ of the send queue's completions.
    pub send_cq: u32,
    /// The CQ of the receive queue's completions.
    pub recv_cq: u32,
}

/// An RC queue pair with private send/receive CQs on a private completion channel, carrying
/// buffers of type `B` (see the [module docs](self)). Destroyed (with its CQs and channel) on
/// drop, before the buffers it still holds are dropped.
///
/// Methods take `&self`: a queue pair can be shared between threads (or async tasks) that post
/// and wait concurrently; each completion goes to exactly one caller.
///
/// ```
/// use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair, WcStatus};
/// let ctx = Context::open(mrkit::DeviceConfig::rxe());
/// let pd = ctx.alloc_pd().unwrap();
/// let q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
/// let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
/// QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
/// let mut src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
/// let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
/// src.as_mut_slice().fill(7);
/// let wc = q1.write(&src, 0..64, dst.remote(0..64).unwrap()).unwrap();
/// assert_eq!(wc.status, WcStatus::Success);
/// assert_eq!(dst.as_slice(), src.as_slice());
/// ```
#[derive(Debug)]
pub struct QueuePair<B: Registered = Owned> {
    ctx: Context,
    _pd: ProtectionDomain,
    qpn: u32,
    scq: u32,
    rcq: u32,
    channel: u32,
    timeout: Option<Duration>,
    state: Mutex<State<B>>,
    #[cfg(feature = "tokio")]
    reactor: async_io::Reactor,
}

impl QueuePair {
    /// Create an RC QP in `pd` carrying [`Owned`] buffers (the default), in RESET.
    /// `QueuePair::new_typed` creates one for another buffer type.
    ///
    /// ```
    /// # use mrkit::{Context, QpCap, QpState, QueuePair};
    /// let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = QueuePair::new(&pd, QpCap::default()).unwrap();
    /// assert_eq!(q.state().unwrap(), QpState::Reset);
    /// ```
    pub fn new(pd: &ProtectionDomain, cap: QpCap) -> Result<QueuePair> {
        QueuePair::new_typed(pd, cap)
    }
}

impl<B: Registered> QueuePair<B> {
    /// Create an RC QP in `pd` whose pipelined work requests carry `B` (e.g. `&'a
    /// MemoryRegion`, `&'a mut MemoryRegion`, a pool `Slot<'p>`, `Vec<MemoryRegion>`).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, MemoryRegion, QpCap, QueuePair};
    /// let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mr = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let q: QueuePair<&MemoryRegion> = QueuePair::new_typed(&pd, Default::default()).unwrap();
    /// # drop(q);
    /// ```
    pub fn new_typed(pd: &ProtectionDomain, cap: QpCap) -> Result<QueuePair<B>> {
        let ctx = pd.context().clone();
        let dev = ctx.provider().clone();
        let channel = dev.create_comp_channel()?;
        let undo_ch = |e: Error| {
            let _ = dev.destroy_comp_channel(channel);
            e
        };
        let scq = dev
            .create_cq(cap.max_send_wr.max(1) + 1, Some(channel))
            .map_err(undo_ch)?;
        let rcq = match dev.create_cq(cap.max_recv_wr.max(1) + 1, Some(channel)) {
            Ok(c) => c,
            Err(e) => {
                let _ = dev.destroy_cq(scq);
                return Err(undo_ch(e));
            }
        };
        let qpn = match dev.create_qp(QpInitAttr {
            pd: pd.handle(),
            send_cq: scq,
            recv_cq: rcq,
            cap,
            // This type's own work requests are signaled one by one (`SendWr::new`); leaving
            // `sq_sig_all` off lets a user of `raw_handles` post unsignaled ones.
            sq_sig_all: false,
        }) {
            Ok((qpn, _)) => qpn,
            Err(e) => {
                let _ = dev.destroy_cq(scq);
                let _ = dev.destroy_cq(rcq);
                return Err(undo_ch(e));
            }
        };
        Ok(QueuePair {
            ctx,
            _pd: pd.clone(),
            qpn,
            scq,
            rcq,
            channel,
            timeout: Some(DEFAULT_TIMEOUT),
            state: Mutex::new(State {
                next_id: 1,
                inflight: std::collections::HashMap::new(),
                blocking: HashSet::new(),
                done: VecDeque::new(),
                armed: [false; 2],
                #[cfg(feature = "tokio")]
                wakers: Vec::new(),
                #[cfg(feature = "tokio")]
                next_waiter: 0,
            }),
            #[cfg(feature = "tokio")]
            reactor: async_io::Reactor::default(),
        })
    }

    /// QP number.
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = mrkit::QueuePair::new(&pd, Default::default()).unwrap();
    /// assert!(q.qp_num() > 0);
    /// ```
    pub fn qp_num(&self) -> u32 {
        self.qpn
    }

    /// The provider handles of this queue pair (QP number, send and receive CQ), for code
    /// that drives the [`Provider`](crate::Provider) verbs on it directly, e.g. a benchmark's
    /// hot loop posting inline or unsignaled work requests (`post_send` / `post_recv` /
    /// `poll_cq` of [`Context::provider`]) on a queue pair connected by [`crate::tcp`] or
    /// [`QueuePair::connect_to`]. The QP is created with `sq_sig_all` off, so only work
    /// requests flagged `SIGNALED` complete. This type's own calls still work beside it,
    /// with two rules the caller keeps: completions it polls itself never reach this type
    /// (so it must not poll while this type has work requests in flight), and a completion
    /// of a raw work request that this type reaps is dropped (logged), so give raw work
    /// requests `wr_id`s of their own and do not mix the two while either has work in
    /// flight. The memory a raw work request names is the caller's to keep registered until
    /// its completion (the provider checks the keys, as a device does); dropping the queue
    /// pair destroys the QP before anything else.
    ///
    /// ```
    /// use mrkit::provider::{SendWr, Sge, WrOpcode};
    /// use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair, WcStatus};
    /// let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// let h = q1.raw_handles();
    /// let dev = pd.context().provider();
    /// let mut unsignaled = SendWr::new(7, WrOpcode::RdmaWrite).remote(dst.info().iova, dst.rkey());
    /// unsignaled.flags = 0;
    /// unsignaled.sg_list = vec![Sge { addr: src.info().iova, length: 64, lkey: src.lkey() }];
    /// let mut signaled = unsignaled.clone();
    /// signaled.wr_id = 8;
    /// signaled.flags = mrkit::provider::send_flags::SIGNALED;
    /// dev.post_send(h.qpn, &[unsignaled, signaled]).unwrap();
    /// let mut wcs = Vec::new();
    /// while wcs.is_empty() {
    ///     dev.poll_cq(h.send_cq, &mut wcs, 16).unwrap();
    /// }
    /// assert_eq!((wcs.len(), wcs[0].wr_id, wcs[0].status), (1, 8, WcStatus::Success));
    /// ```
    pub fn raw_handles(&self) -> RawHandles {
        RawHandles {
            qpn: self.qpn,
            send_cq: self.scq,
            recv_cq: self.rcq,
        }
    }

    /// The device context the queue pair lives on.
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = mrkit::QueuePair::new(&pd, Default::default()).unwrap();
    /// assert_eq!(q.context().name(), "mrkit0");
    /// ```
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Current state (`ibv_query_qp`).
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = mrkit::QueuePair::new(&pd, Default::default()).unwrap();
    /// assert_eq!(q.state().unwrap(), mrkit::QpState::Reset);
    /// ```
    pub fn state(&self) -> Result<QpState> {
        let a = self.ctx.provider().query_qp(self.qpn)?;
        QpState::from_u32(a.qp_state)
            .ok_or_else(|| Error::new(Errno::EINVAL, "the provider reported an unknown QP state"))
    }

    /// `ibv_modify_qp` on this QP: apply the fields of `attr` named by `mask`
    /// ([`attr_mask`](crate::provider::attr_mask)). Connecting to a peer of another process is
    /// RESET → INIT → RTR → RTS with the peer's QP number, PSN and GID (see
    /// [`QueuePair::connect`] for the in-process case).
    ///
    /// ```
    /// use mrkit::provider::{attr_mask as m, QpAttr};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = mrkit::QueuePair::new(&pd, Default::default()).unwrap();
    /// let init = QpAttr { qp_state: mrkit::QpState::Init as u32, port_num: 1, ..QpAttr::default() };
    /// q.modify_qp(&init, m::STATE | m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS).unwrap();
    /// // RESET → RTS directly is not a legal transition:
    /// let rts = QpAttr { qp_state: mrkit::QpState::Rts as u32, ..QpAttr::default() };
    /// assert_eq!(q.modify_qp(&rts, m::STATE).unwrap_err().errno(), mrkit::Errno::EINVAL);
    /// ```
    pub fn modify_qp(&self, attr: &QpAttr, mask: u32) -> Result<()> {
        self.ctx.provider().modify_qp(self.qpn, attr, mask)
    }

    /// Bring this QP from RESET to RTS against a peer QP `dest_qpn` reached by `av`, whose
    /// first PSN is `rq_psn`, with this side's first PSN `sq_psn` and `opts` (what the peer
    /// may do here, path MTU, ACK timeout, retries, outstanding READ/atomics each way): the
    /// three `modify_qp` calls of rc_pingpong / perftest — mrkit-soft's one sequence
    /// (`mrkit_soft::qp::connect::connect_qp`), run through this QP's provider.
    pub(crate) fn bring_up(
        &self,
        av: AddressVector,
        dest_qpn: u32,
        rq_psn: u32,
        sq_psn: u32,
        opts: &crate::ConnectOpts,
    ) -> Result<()> {
        use mrkit_soft::qp::connect::{connect_qp, ConnectOpts as Attrs, ConnectVerbs, RemoteQp};
        /// The provider as the connect sequence's verbs.
        struct Through<'a>(&'a dyn crate::Provider);
        impl ConnectVerbs for Through<'_> {
            fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: u32) -> Result<()> {
                self.0.modify_qp(qpn, attr, mask)
            }
            fn bind_udp_port(&self) -> Result<()> {
                Ok(()) // the provider's `modify_qp` binds what a GID address needs
            }
            fn node_id(&self) -> u64 {
                self.0.local_av().map_or(0, |av| av.dest_node)
            }
        }
        let remote = RemoteQp {
            qpn: dest_qpn,
            psn: rq_psn,
            ip: av.dgid,
            node: av.dest_node,
        };
        let attrs = Attrs {
            access: opts.access,
            path_mtu: opts.path_mtu.ibv(),
            sq_psn,
            timeout: opts.timeout,
            retry_cnt: opts.retry_cnt,
            rnr_retry: opts.rnr_retry,
            rd_atomic: opts.rd_atomic,
        };
        connect_qp(&Through(&**self.ctx.provider()), self.qpn, remote, attrs)
    }

    /// Connect two QPs of this process (same or different contexts, any provider) and move
    /// both to RTS. `access` is what each QP lets its peer do (REMOTE_WRITE/READ/ATOMIC), on
    /// top of the MR rights.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Context, QpState, QueuePair};
    /// let (c1, c2) = (Context::open(mrkit::DeviceConfig::rxe()), Context::open(mrkit::DeviceConfig::rxe()));
    /// let q1 = QueuePair::new(&c1.alloc_pd().unwrap(), Default::default()).unwrap();
    /// let q2 = QueuePair::new(&c2.alloc_pd().unwrap(), Default::default()).unwrap();
    /// QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
    /// assert_eq!(q1.state().unwrap(), QpState::Rts);
    /// ```
    pub fn connect<B2: Registered>(
        a: &QueuePair<B>,
        b: &QueuePair<B2>,
        access: AccessFlags,
    ) -> Result<()> {
        let opts = crate::ConnectOpts {
            access,
            ..crate::ConnectOpts::default()
        };
        let av_a = a.ctx.provider().local_av()?;
        let av_b = b.ctx.provider().local_av()?;
        a.bring_up(av_b, b.qpn, 0, 0, &opts)?;
        b.bring_up(av_a, a.qpn, 0, 0, &opts)
    }

    /// How long the blocking calls wait for their completion (`None`: forever). Default
    /// [`DEFAULT_TIMEOUT`]. A blocking call that runs out of time moves the QP to ERR (which
    /// flushes its work request), waits for that flush and fails with `ETIMEDOUT`.
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mut q = mrkit::QueuePair::new(&pd, Default::default()).unwrap();
    /// q.set_timeout(Some(std::time::Duration::from_secs(5)));
    /// assert_eq!(q.timeout(), Some(std::time::Duration::from_secs(5)));
    /// ```
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// The blocking calls' timeout.
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = mrkit::QueuePair::new(&pd, Default::default()).unwrap();
    /// assert_eq!(q.timeout(), Some(mrkit::qp::DEFAULT_TIMEOUT));
    /// ```
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    // ---- completion plumbing ----

    /// Move every completion queued in the CQs into `st.done`. Whether any arrived.
    fn reap(&self, st: &mut State<B>) -> Result<bool> {
        let dev = self.ctx.provider();
        let before = st.done.len();
        let mut v = Vec::with_capacity(POLL_BATCH);
        for cq in [self.scq, self.rcq] {
            loop {
                v.clear();
                let n = dev.poll_cq(cq, &mut v, POLL_BATCH)?;
                st.done.extend(v.drain(..));
                if n < POLL_BATCH {
                    break;
                }
            }
        }
        let got = st.done.len() > before;
        #[cfg(feature = "tokio")]
        if got {
            for (_, w) in st.wakers.drain(..) {
                w.wake();
            }
        }
        Ok(got)
    }

    /// Arm (one-shot) each CQ whose previous arm is not pending. An arm is pending from
    /// `req_notify_cq` until its event is taken from the channel ([`QueuePair::event_taken`]);
    /// arming only then keeps at most one event per CQ queued on the channel, however often
    /// waits arm and then find their completion without sleeping.
    fn arm(&self, st: &mut State<B>) -> Result<()> {
        let dev = self.ctx.provider();
        for (i, cq) in [self.scq, self.rcq].into_iter().enumerate() {
            if !st.armed[i] {
                dev.req_notify_cq(cq, false)?;
                st.armed[i] = true;
            }
        }
        Ok(())
    }

    /// The channel gave an event for CQ `cqn`: its arm is spent. Async waiters are woken, since
    /// one of them may be waiting on an arm that no longer exists (it re-arms when polled).
    fn event_taken(&self, cqn: u32) {
        let mut st = self.state.lock();
        if cqn == self.scq {
            st.armed[0] = false;
        }
        if cqn == self.rcq {
            st.armed[1] = false;
        }
        #[cfg(feature = "tokio")]
        for (_, w) in st.wakers.drain(..) {
            w.wake();
        }
    }

    /// Take every event queued on the channel without blocking.
    #[cfg(feature = "tokio")]
    fn drain_events(&self) -> Result<()> {
        let dev = self.ctx.provider();
        while let Some(cqn) = dev.get_cq_event(self.channel, Some(Duration::ZERO))? {
            self.event_taken(cqn);
        }
        Ok(())
    }

    /// Wait until `take` finds what it wants in the state (after reaping), or `deadline`
    /// passes (`Ok(None)`). Polls, arms the CQs, polls again (closing the race with a
    /// completion that arrived before the arm), then sleeps on the completion channel.
    fn block_until<T>(
        &self,
        deadline: Option<Instant>,
        mut take: impl FnMut(&mut State<B>) -> Result<Option<T>>,
    ) -> Result<Option<T>> {
        let dev = self.ctx.provider();
        loop {
            for arm in [false, true] {
                let mut st = self.state.lock();
                if arm {
                    self.arm(&mut st)?;
                }
                self.reap(&mut st)?;
                if let Some(t) = take(&mut st)? {
                    return Ok(Some(t));
                }
            }
            let slice = match deadline {
                None => WAIT_SLICE,
                Some(d) => {
                    let now = Instant::now();
                    if d <= now {
                        return Ok(None);
                    }
                    (d - now).min(WAIT_SLICE)
                }
            };
            if let Some(cqn) = dev.get_cq_event(self.channel, Some(slice))? {
                self.event_taken(cqn);
            }
        }
    }

    fn new_id(&self, st: &mut State<B>) -> u64 {
        let id = st.next_id;
        st.next_id += 1;
        id
    }

    /// Post one blocking WR (`recv`: a receive) over memory the caller borrows for the whole
    /// call, and wait for its own completion.
    fn exec(&self, sges: Vec<LocalSlice>, recv: bool, mut wr: SendWr) -> Result<WorkCompletion> {
        let id = {
            let mut st = self.state.lock();
            let id = self.new_id(&mut st);
            st.blocking.insert(id);
            id
        };
        let posted = if recv {
            let rwr = RecvWr {
                wr_id: id,
                sg_list: sges.iter().map(sge).collect(),
            };
            self.ctx.provider().post_recv(self.qpn, &[rwr])
        } else {
            wr.wr_id = id;
            wr.sg_list = sges.iter().map(sge).collect();
            self.ctx.provider().post_send(self.qpn, &[wr])
        };
        if let Err(e) = posted {
            self.state.lock().blocking.remove(&id);
            return Err(e.error);
        }
        let deadline = self.timeout.and_then(|t| Instant::now().checked_add(t));
        let own = |st: &mut State<B>| Ok(st.take_id(id));
        let res = match self.block_until(deadline, own) {
            Ok(Some(wc)) => Ok(wc),
            Ok(None) => {
                // The caller's borrow ends when we return, but the device may still use the
                // memory: stop the WR the IBA way (ERR flushes it), and return only once its
                // completion is in.
                self.stop_and_reap(id)?;
                Err(Error::new(
                    Errno::ETIMEDOUT,
                    format!(
                        "no completion within {:?}; the QP was moved to ERR to flush the work \
                         request (create a new QP, or move this one to RESET and reconnect)",
                        self.timeout.unwrap_or_default()
                    ),
                ))
            }
            Err(e) => {
                self.stop_and_reap(id)?;
                Err(e)
            }
        };
        self.state.lock().blocking.remove(&id);
        res
    }

    /// Move the QP to ERR and wait for WR `id`'s (flush) completion. If even that fails the
    /// QP is destroyed, after which the device no longer touches any WR's memory.
    fn stop_and_reap(&self, id: u64) -> Result<()> {
        let err = QpAttr {
            qp_state: QpState::Err as u32,
            ..QpAttr::default()
        };
        let stopped = self
            .modify_qp(&err, m::STATE)
            .and_then(|()| self.block_until(None, |st| Ok(st.take_id(id))));
        if let Err(e) = stopped {
            tracing::error!(error = %e, qpn = self.qpn, "cannot flush a timed-out work request: destroying the QP");
            if let Err(e2) = self.ctx.provider().destroy_qp(self.qpn) {
                // Neither flushed nor destroyed: the caller's memory could still be reached by
                // the device after we return. There is no safe way on.
                tracing::error!(error = %e2, qpn = self.qpn, "cannot destroy the QP either");
                std::process::abort();
            }
            return Err(e);
        }
        Ok(())
    }

    // ---- pipelined work requests ----

    /// Post one pipelined WR carrying `buf`: a send-queue WR with opcode `op`, or a receive
    /// (`op` `None`).
    fn post_owned(
        &self,
        op: Option<WrOpcode>,
        buf: B,
        range: Range<u64>,
        remote: Option<RemoteSlice>,
    ) -> std::result::Result<Ticket, Box<PostRefused<B>>> {
        let refuse = |error: Error, buf: B| Box::new(PostRefused { error, buf });
        let mut sl = Vec::with_capacity(1);
        if let Err(e) = buf.sges(range, &mut sl) {
            return Err(refuse(e, buf));
        }
        if let Some(r) = remote {
            if let Err(e) = check_remote(&sl, &r) {
                return Err(refuse(e, buf));
            }
        }
        let mut st = self.state.lock();
        let id = self.new_id(&mut st);
        let posted = if let Some(op) = op {
            let mut wr = SendWr::new(id, op);
            wr.sg_list = sl.iter().map(sge).collect();
            if let Some(r) = remote {
                wr = wr.remote(r.addr, r.rkey);
            }
            self.ctx.provider().post_send(self.qpn, &[wr])
        } else {
            let rwr = RecvWr {
                wr_id: id,
                sg_list: sl.iter().map(sge).collect(),
            };
            self.ctx.provider().post_recv(self.qpn, &[rwr])
        };
        if let Err(e) = posted {
            return Err(refuse(e.error, buf));
        }
        st.inflight.insert(id, buf);
        Ok(Ticket(id))
    }

    /// Pipelined RDMA WRITE of `buf[range]` to `remote`: `buf` is held by the queue pair until
    /// its completion hands it back. `EINVAL` (buffer handed back in [`PostRefused`]) for a
    /// range outside `buf` or longer than `remote`; `ENOMEM` when the send queue is full.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// let dst = pd.register(Buffer::new(8192).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// for i in 0..2u64 {
    ///     let mut src = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    ///     src.as_mut_slice().fill(i as u8 + 1);
    ///     q1.post_write(src, 0..4096, dst.remote(i * 4096..(i + 1) * 4096).unwrap()).unwrap();
    /// }
    /// let done = q1.wait_all(std::time::Duration::from_secs(10)).unwrap();
    /// assert_eq!(done.len(), 2);
    /// assert_eq!(dst.as_slice()[4096], 2);
    /// ```
    pub fn post_write(
        &self,
        buf: impl Into<B>,
        range: Range<u64>,
        remote: RemoteSlice,
    ) -> std::result::Result<Ticket, Box<PostRefused<B>>> {
        self.post_owned(Some(WrOpcode::RdmaWrite), buf.into(), range, Some(remote))
    }

    /// Pipelined SEND of `buf[range]` (the peer must have a receive posted, else RNR retries).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # use std::time::Duration;
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::empty()).unwrap();
    /// let rx = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// q2.post_recv(rx, 0..64).unwrap();
    /// let mut tx = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// tx.as_mut_slice()[..5].copy_from_slice(b"hello");
    /// q1.post_send(tx, 0..5).unwrap();
    /// let got = q2.wait(Duration::from_secs(10)).unwrap();
    /// assert_eq!(got.wc.byte_len, 5);
    /// assert_eq!(&got.buf.as_slice().unwrap()[..5], b"hello");
    /// q1.wait(Duration::from_secs(10)).unwrap().into_result().unwrap();
    /// ```
    pub fn post_send(
        &self,
        buf: impl Into<B>,
        range: Range<u64>,
    ) -> std::result::Result<Ticket, Box<PostRefused<B>>> {
        self.post_owned(Some(WrOpcode::Send), buf.into(), range, None)
    }

    /// Pipelined RDMA READ of `remote` into `buf[range]` (the MR needs LOCAL_WRITE, else the
    /// completion is `LOC_PROT_ERR`).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
    /// let mut src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// src.as_mut_slice()[3] = 3;
    /// let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let t = q1.post_read(dst, 0..64, src.remote(0..64).unwrap()).unwrap();
    /// let c = q1.wait(std::time::Duration::from_secs(10)).unwrap();
    /// assert_eq!(c.wr_id(), t.wr_id());
    /// assert_eq!(c.buf.as_slice().unwrap()[3], 3);
    /// ```
    pub fn post_read(
        &self,
        buf: impl Into<B>,
        range: Range<u64>,
        remote: RemoteSlice,
    ) -> std::result::Result<Ticket, Box<PostRefused<B>>>
    where
        B: DeviceWritable,
    {
        self.post_owned(Some(WrOpcode::RdmaRead), buf.into(), range, Some(remote))
    }

    /// Pipelined receive into `buf[range]`: the completion of the message that lands there
    /// hands `buf` back (`byte_len` bytes received). Post several to keep receives ahead of
    /// the peer's SENDs.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # use std::time::Duration;
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::empty()).unwrap();
    /// for _ in 0..4 {
    ///     let rx = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    ///     q2.post_recv(rx, 0..64).unwrap();
    /// }
    /// let tx = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// q1.send(&tx, 0..8).unwrap();
    /// assert_eq!(q2.wait(Duration::from_secs(10)).unwrap().wc.byte_len, 8);
    /// assert_eq!(q2.in_flight(), 3);
    /// ```
    pub fn post_recv(
        &self,
        buf: impl Into<B>,
        range: Range<u64>,
    ) -> std::result::Result<Ticket, Box<PostRefused<B>>>
    where
        B: DeviceWritable,
    {
        self.post_owned(None, buf.into(), range, None)
    }

    /// Pipelined WRs (sends and receives) whose completion has not been handed out.
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = mrkit::QueuePair::new(&pd, Default::default()).unwrap();
    /// assert_eq!(q.in_flight(), 0);
    /// ```
    pub fn in_flight(&self) -> usize {
        self.state.lock().inflight.len()
    }

    /// Completions of pipelined WRs available now (never blocks), each with its buffer back,
    /// in completion order.
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = mrkit::QueuePair::new(&pd, Default::default()).unwrap();
    /// assert!(q.poll().unwrap().is_empty());
    /// ```
    pub fn poll(&self) -> Result<Vec<Completion<B>>> {
        let mut st = self.state.lock();
        self.reap(&mut st)?;
        let mut out = Vec::new();
        while let Some(c) = st.take_any() {
            out.push(c);
        }
        Ok(out)
    }

    /// The next completion of a pipelined WR, waiting up to `timeout`. `ETIMEDOUT` when none
    /// arrived in time (the buffers stay with the queue pair; a later call hands them back);
    /// `ENOENT` when no pipelined WR is in flight.
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = mrkit::QueuePair::new(&pd, Default::default()).unwrap();
    /// let e = q.wait(std::time::Duration::from_millis(1)).unwrap_err();
    /// assert_eq!(e.errno(), mrkit::Errno::ENOENT);
    /// ```
    pub fn wait(&self, timeout: Duration) -> Result<Completion<B>> {
        let deadline = Instant::now().checked_add(timeout);
        let got = self.block_until(deadline, |st| {
            if let Some(c) = st.take_any() {
                return Ok(Some(c));
            }
            if st.inflight.is_empty() {
                return Err(nothing_in_flight());
            }
            Ok(None)
        })?;
        got.ok_or_else(|| timed_out(timeout))
    }

    /// The completion of the pipelined WR `ticket`, waiting up to `timeout` (`ETIMEDOUT`, the
    /// buffer staying with the queue pair); other completions met meanwhile stay for later.
    /// `ENOENT` when that completion was already handed out.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # use std::time::Duration;
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// let a = q1.post_write(pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap(), 0..64, dst.remote(0..64).unwrap()).unwrap();
    /// let b = q1.post_write(pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap(), 0..64, dst.remote(0..64).unwrap()).unwrap();
    /// assert_eq!(q1.wait_ticket(b, Duration::from_secs(10)).unwrap().wr_id(), b.wr_id());
    /// assert_eq!(q1.wait(Duration::from_secs(10)).unwrap().wr_id(), a.wr_id());
    /// ```
    pub fn wait_ticket(&self, ticket: Ticket, timeout: Duration) -> Result<Completion<B>> {
        let deadline = Instant::now().checked_add(timeout);
        let id = ticket.0;
        let got = self.block_until(deadline, |st| {
            if let Some(c) = st.take_ticket(id) {
                return Ok(Some(c));
            }
            if !st.inflight.contains_key(&id) {
                return Err(handed_out(id));
            }
            Ok(None)
        })?;
        got.ok_or_else(|| timed_out(timeout))
    }

    /// Wait up to `timeout` until every pipelined WR completed; their completions, in
    /// completion order. `ETIMEDOUT` when some did not complete in time: then nothing is
    /// handed out, every buffer stays with the queue pair.
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let q = mrkit::QueuePair::new(&pd, Default::default()).unwrap();
    /// assert!(q.wait_all(std::time::Duration::from_secs(1)).unwrap().is_empty());
    /// ```
    pub fn wait_all(&self, timeout: Duration) -> Result<Vec<Completion<B>>> {
        let deadline = Instant::now().checked_add(timeout);
        let got = self.block_until(deadline, |st| {
            if !st.all_reaped() {
                return Ok(None);
            }
            let mut out = Vec::with_capacity(st.inflight.len());
            while let Some(c) = st.take_any() {
                out.push(c);
            }
            Ok(Some(out))
        })?;
        got.ok_or_else(|| timed_out(timeout))
    }

    // ---- blocking one-WR calls ----

    /// RDMA WRITE `local[range]` to `remote`; returns when the WR completed (status in the
    /// completion).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair, WcStatus};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// assert_eq!(q1.write(&src, 0..64, dst.remote(0..64).unwrap()).unwrap().status, WcStatus::Success);
    /// ```
    pub fn write(
        &self,
        local: &impl Registered,
        range: Range<u64>,
        remote: RemoteSlice,
    ) -> Result<WorkCompletion> {
        let sl = sges_of(local, range)?;
        check_remote(&sl, &remote)?;
        self.exec(
            sl,
            false,
            SendWr::new(0, WrOpcode::RdmaWrite).remote(remote.addr, remote.rkey),
        )
    }

    /// RDMA READ `remote` into `local[range]` (the MR needs LOCAL_WRITE).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair, WcStatus};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
    /// let src = pd.register(Buffer::new(64).unwrap(), A::REMOTE_READ).unwrap();
    /// let mut dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// assert_eq!(q1.read(&mut dst, 0..64, src.remote(0..64).unwrap()).unwrap().status, WcStatus::Success);
    /// ```
    pub fn read(
        &self,
        local: &mut impl DeviceWritable,
        range: Range<u64>,
        remote: RemoteSlice,
    ) -> Result<WorkCompletion> {
        let sl = sges_of(&*local, range)?;
        check_remote(&sl, &remote)?;
        self.exec(
            sl,
            false,
            SendWr::new(0, WrOpcode::RdmaRead).remote(remote.addr, remote.rkey),
        )
    }

    /// Atomic fetch-and-add on the remote u64; the original value lands in `result[at..at+8]`.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_ATOMIC).unwrap();
    /// let counter = pd.register(Buffer::new(8).unwrap(), A::LOCAL_WRITE | A::REMOTE_ATOMIC).unwrap();
    /// let mut old = pd.register(Buffer::new(8).unwrap(), A::LOCAL_WRITE).unwrap();
    /// q1.fetch_add(&mut old, 0, counter.remote(0..8).unwrap(), 5).unwrap();
    /// q1.fetch_add(&mut old, 0, counter.remote(0..8).unwrap(), 1).unwrap();
    /// assert_eq!(old.as_slice(), 5u64.to_ne_bytes());
    /// ```
    pub fn fetch_add(
        &self,
        result: &mut impl DeviceWritable,
        at: u64,
        remote: RemoteSlice,
        add: u64,
    ) -> Result<WorkCompletion> {
        let sl = sges_of(&*result, at..at.checked_add(8).ok_or_else(overflow)?)?;
        check_remote(&sl, &remote)?;
        let mut wr = SendWr::new(0, WrOpcode::AtomicFetchAndAdd).remote(remote.addr, remote.rkey);
        wr.compare_add = add;
        self.exec(sl, false, wr)
    }

    /// Atomic compare-and-swap on the remote u64; the original value lands in
    /// `result[at..at+8]`.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_ATOMIC).unwrap();
    /// let word = pd.register(Buffer::new(8).unwrap(), A::LOCAL_WRITE | A::REMOTE_ATOMIC).unwrap();
    /// let mut old = pd.register(Buffer::new(8).unwrap(), A::LOCAL_WRITE).unwrap();
    /// q1.compare_swap(&mut old, 0, word.remote(0..8).unwrap(), 0, 42).unwrap();
    /// assert_eq!(word.as_slice(), 42u64.to_ne_bytes());
    /// ```
    pub fn compare_swap(
        &self,
        result: &mut impl DeviceWritable,
        at: u64,
        remote: RemoteSlice,
        compare: u64,
        swap: u64,
    ) -> Result<WorkCompletion> {
        let sl = sges_of(&*result, at..at.checked_add(8).ok_or_else(overflow)?)?;
        check_remote(&sl, &remote)?;
        let mut wr = SendWr::new(0, WrOpcode::AtomicCmpAndSwp).remote(remote.addr, remote.rkey);
        wr.compare_add = compare;
        wr.swap = swap;
        self.exec(sl, false, wr)
    }

    /// SEND `local[range]` (the peer must have a receive posted, else RNR retries).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::empty()).unwrap();
    /// # q2.post_recv(pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap(), 0..64).unwrap();
    /// let tx = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// q1.send(&tx, 0..16).unwrap();
    /// ```
    pub fn send(&self, local: &impl Registered, range: Range<u64>) -> Result<WorkCompletion> {
        let sl = sges_of(local, range)?;
        self.exec(sl, false, SendWr::new(0, WrOpcode::Send))
    }

    /// Post a receive into `local[range]` and wait for a message (or a flush).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::empty()).unwrap();
    /// let tx = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let sender = std::thread::spawn(move || { q1.send(&tx, 0..10).unwrap(); q1 });
    /// let mut rx = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// assert_eq!(q2.recv(&mut rx, 0..64).unwrap().byte_len, 10);
    /// sender.join().unwrap();
    /// ```
    pub fn recv(
        &self,
        local: &mut impl DeviceWritable,
        range: Range<u64>,
    ) -> Result<WorkCompletion> {
        let sl = sges_of(&*local, range)?;
        self.exec(sl, true, SendWr::new(0, WrOpcode::Send))
    }
}

fn sge(l: &LocalSlice) -> Sge {
    Sge {
        addr: l.addr,
        length: l.len,
        lkey: l.lkey,
    }
}

fn sges_of(local: &impl Registered, range: Range<u64>) -> Result<Vec<LocalSlice>> {
    let mut sl = Vec::with_capacity(1);
    local.sges(range, &mut sl)?;
    Ok(sl)
}

/// A local gather/scatter list longer than the remote slice it targets is refused (`EINVAL`)
/// rather than left to run into whatever follows the slice in the peer's MR.
fn check_remote(sl: &[LocalSlice], remote: &RemoteSlice) -> Result<()> {
    let total: u64 = sl.iter().map(|s| u64::from(s.len)).sum();
    if total > remote.len {
        return Err(Error::new(
            Errno::EINVAL,
            format!(
                "{total} bytes do not fit the remote slice of {} bytes",
                remote.len
            ),
        ));
    }
    Ok(())
}

fn overflow() -> Error {
    Error::new(Errno::EINVAL, "offset overflows")
}

fn nothing_in_flight() -> Error {
    Error::new(
        Errno::ENOENT,
        "no pipelined work request is in flight on this queue pair",
    )
}

fn handed_out(id: u64) -> Error {
    Error::new(
        Errno::ENOENT,
        format!("the completion of work request {id} was already handed out"),
    )
}

fn timed_out(t: Duration) -> Error {
    Error::new(
        Errno::ETIMEDOUT,
        format!("no completion within {t:?}; the buffers stay with the queue pair"),
    )
}

impl<B: Registered> Drop for QueuePair<B> {
    fn drop(&mut self) {
        // Destroy first: after destroy_qp returns the device never touches the QP's WRs, so
        // the buffers in `inflight` are dropped (as fields, after this) only once that holds.
        let dev = self.ctx.provider();
        if let Err(e) = dev.destroy_qp(self.qpn) {
            if !self.state.get_mut().inflight.is_empty() {
                // The device may still reach the buffers: leak them rather than free them.
                tracing::error!(error = %e, qpn = self.qpn, "destroy_qp failed: leaking the buffers in flight");
                std::mem::forget(std::mem::take(&mut self.state.get_mut().inflight));
            }
        }
        let _ = dev.destroy_cq(self.scq);
        let _ = dev.destroy_cq(self.rcq);
        let _ = dev.destroy_comp_channel(self.channel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Buffer;

    /// However many waits arm the CQs and then find their completion without sleeping, the
    /// channel never holds more than one event per CQ (no unbounded queue of stale events).
    #[test]
    fn stale_channel_events_stay_bounded() {
        let pd = Context::open(mrkit_soft::DeviceConfig::rxe())
            .alloc_pd()
            .unwrap();
        let q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
        let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
        QueuePair::connect(&q1, &q2, AccessFlags::REMOTE_WRITE).unwrap();
        let src = pd
            .register(Buffer::new(64).unwrap(), AccessFlags::LOCAL_WRITE)
            .unwrap();
        let dst = pd
            .register(
                Buffer::new(64).unwrap(),
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )
            .unwrap();
        for _ in 0..2000 {
            let wc = q1.write(&src, 0..64, dst.remote(0..64).unwrap()).unwrap();
            assert_eq!(wc.status, WcStatus::Success);
            // The pattern that leaves an arm behind: arm, then find the completion.
            q1.arm(&mut q1.state.lock()).unwrap();
        }
        let dev = q1.ctx.provider();
        let mut n = 0;
        while dev
            .get_cq_event(q1.channel, Some(Duration::ZERO))
            .unwrap()
            .is_some()
        {
            n += 1;
        }
        assert!(n <= 2, "{n} events queued on the channel");
    }
}
