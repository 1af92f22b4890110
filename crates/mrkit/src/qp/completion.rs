//! What a pipelined work request carries and gives back: [`Owned`] (the default kind),
//! [`Ticket`], [`Completion`], and the errors [`PostRefused`], [`WcError`],
//! [`CompletionError`].

use std::fmt;
use std::ops::Range;

use super::registered::{DeviceWritable, Registered};
use super::{WcStatus, WorkCompletion};
use crate::cache::{BounceBuffer, RegOwned};
use crate::pool::OwnedSlot;
use crate::verbs::{LocalSlice, MemoryRegion};
use crate::Buffer;
use crate::{Error, Result};

/// The owned kinds of registered memory, as one type: the default buffer type of a
/// [`QueuePair`](crate::QueuePair), so one queue pair carries MRs, pool slots and lists of
/// them side by side.
///
/// Other owned kinds join through `From` impls (the pool's `OwnedSlot` below; the
/// registration cache and the bounce buffers add theirs as variants next to these).
///
/// ```
/// use mrkit::{AccessFlags as A, Buffer, Context, Owned, Registered};
/// let ctx = Context::open(mrkit::DeviceConfig::rxe());
/// let pd = ctx.alloc_pd().unwrap();
/// let a = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
/// let b = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
/// // Two MRs as one scatter/gather list of 8 KiB.
/// let list = Owned::from(vec![Owned::from(a), Owned::from(b)]);
/// assert_eq!(list.len(), 8192);
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Owned {
    /// A whole memory region.
    Mr(MemoryRegion),
    /// A slot of an [`MrPool`](crate::pool::MrPool) (keeps its pool alive).
    Slot(OwnedSlot),
    /// A registration-cache handle over owned memory
    /// ([`RegCache::get_owned`](crate::cache::RegCache::get_owned)).
    Cached(RegOwned<Buffer>),
    /// Pool slots standing in for memory the cache could not register
    /// ([`RegCache::get_or_bounce_raw`](crate::cache::RegCache::get_or_bounce_raw)); copy in and out
    /// with [`BounceBuffer::copy_in`] / [`BounceBuffer::copy_out`].
    Bounce(BounceBuffer),
    /// Several pieces posted as one scatter/gather list (their concatenation).
    List(Vec<Owned>),
}

impl Owned {
    /// The bytes of a single piece (`None` for a [`Owned::List`], whose pieces have them, and
    /// for the cache's kinds: a cached buffer is shared through its `Arc`, a bounce buffer is
    /// read with [`BounceBuffer::copy_out`]).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, Owned};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let o = Owned::from(pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap());
    /// assert_eq!(o.as_slice().unwrap().len(), 64);
    /// ```
    pub fn as_slice(&self) -> Option<&[u8]> {
        match self {
            Owned::Mr(m) => Some(m.as_slice()),
            Owned::Slot(s) => Some(s.as_slice()),
            Owned::Cached(_) | Owned::Bounce(_) | Owned::List(_) => None,
        }
    }
    /// Mutable bytes of a single piece (`None` for a list).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, Owned};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mut o = Owned::from(pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap());
    /// o.as_mut_slice().unwrap()[0] = 1;
    /// ```
    pub fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        match self {
            Owned::Mr(m) => Some(m.as_mut_slice()),
            Owned::Slot(s) => Some(s.as_mut_slice()),
            Owned::Cached(_) | Owned::Bounce(_) | Owned::List(_) => None,
        }
    }
}

// SAFETY: every variant owns its memory: the MR owns its buffer, a slot keeps its pool (and
// so the chunk's registration and mapping) alive and is exclusively owned, a cache handle holds
// its buffer's `Arc` and its registration, a bounce buffer owns its slots, and a list owns its
// pieces. The slices come from the registrations with their lkeys.
unsafe impl Registered for Owned {
    fn len(&self) -> u64 {
        match self {
            Owned::Mr(m) => Registered::len(m),
            Owned::Slot(s) => Registered::len(s),
            Owned::Cached(h) => Registered::len(h),
            Owned::Bounce(b) => Registered::len(b),
            Owned::List(v) => Registered::len(v),
        }
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        match self {
            Owned::Mr(m) => m.sges(range, out),
            Owned::Slot(s) => s.sges(range, out),
            Owned::Cached(h) => h.sges(range, out),
            Owned::Bounce(b) => b.sges(range, out),
            Owned::List(v) => v.sges(range, out),
        }
    }
}
// SAFETY: owned values: nothing else references the bytes while a work request holds them.
unsafe impl DeviceWritable for Owned {}

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

impl From<RegOwned<Buffer>> for Owned {
    fn from(h: RegOwned<Buffer>) -> Owned {
        Owned::Cached(h)
    }
}

impl From<BounceBuffer> for Owned {
    fn from(b: BounceBuffer) -> Owned {
        Owned::Bounce(b)
    }
}

impl From<Vec<Owned>> for Owned {
    fn from(v: Vec<Owned>) -> Owned {
        Owned::List(v)
    }
}

/// Names a pipelined work request; its completion carries [`Ticket::wr_id`].
///
/// ```
/// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
/// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
/// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
/// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
/// # let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
/// let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
/// let t = q1.post_write(src, 0..64, dst.remote(0..64).unwrap()).unwrap();
/// let c = q1.wait(std::time::Duration::from_secs(10)).unwrap();
/// assert_eq!(c.wr_id(), t.wr_id());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "the completion with this ticket's wr_id hands the buffer back"]
pub struct Ticket(pub(crate) u64);

impl Ticket {
    /// The `wr_id` of the completion: the key to match completions, which may come in any
    /// order across queues, to what the application posted.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # use std::collections::HashMap;
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// # let dst = pd.register(Buffer::new(128).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// let mut pending = HashMap::new();
    /// for (i, block) in ["first", "second"].into_iter().enumerate() {
    ///     let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    ///     let at = dst.remote(i as u64 * 64..(i as u64 + 1) * 64).unwrap();
    ///     let t = q1.post_write(src, 0..64, at).unwrap();
    ///     pending.insert(t.wr_id(), block);
    /// }
    /// for c in q1.wait_all(std::time::Duration::from_secs(10)).unwrap() {
    ///     assert!(pending.remove(&c.wr_id()).is_some());
    /// }
    /// assert!(pending.is_empty());
    /// ```
    pub fn wr_id(self) -> u64 {
        self.0
    }
}

/// A work completion with the buffer its work request carried, handed back.
///
/// The status is data; [`Completion::result`] / [`Completion::into_result`] turn a
/// non-success status into an error (that still gives the buffer back).
///
/// ```
/// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
/// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
/// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
/// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
/// # let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
/// let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
/// let mut bad = dst.remote(0..64).unwrap();
/// bad.rkey ^= 0x100; // a key the peer never issued
/// q1.post_write(src, 0..64, bad).unwrap();
/// let c = q1.wait(std::time::Duration::from_secs(10)).unwrap();
/// let err = c.into_result().unwrap_err();
/// assert_eq!(err.wc.status, mrkit::WcStatus::RemAccessErr);
/// let _src_again = err.buf; // the buffer is never lost
/// ```
#[derive(Debug)]
pub struct Completion<B> {
    /// The work completion.
    pub wc: WorkCompletion,
    /// The buffer the work request carried.
    pub buf: B,
}

impl<B> Completion<B> {
    /// The work request's id (its [`Ticket::wr_id`]).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// # let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// # let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let t = q1.post_write(src, 0..64, dst.remote(0..64).unwrap()).unwrap();
    /// let c = q1.wait(std::time::Duration::from_secs(10)).unwrap();
    /// assert_eq!(c.wr_id(), t.wr_id());
    /// ```
    pub fn wr_id(&self) -> u64 {
        self.wc.wr_id
    }
    /// The completion status.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// # let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// # let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let t = q1.post_write(src, 0..64, dst.remote(0..64).unwrap()).unwrap();
    /// let c = q1.wait(std::time::Duration::from_secs(10)).unwrap();
    /// assert_eq!(c.status(), mrkit::WcStatus::Success);
    /// ```
    pub fn status(&self) -> WcStatus {
        self.wc.status
    }
    /// `Ok(&wc)` for a successful completion, else the status as an error.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// # let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// # let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let t = q1.post_write(src, 0..64, dst.remote(0..64).unwrap()).unwrap();
    /// let c = q1.wait(std::time::Duration::from_secs(10)).unwrap();
    /// assert_eq!(c.result().unwrap().byte_len, 64);
    /// ```
    pub fn result(&self) -> std::result::Result<&WorkCompletion, WcError> {
        match self.wc.status {
            WcStatus::Success => Ok(&self.wc),
            _ => Err(WcError { wc: self.wc }),
        }
    }
    /// The completion and the buffer, or an error carrying both.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// # let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// # let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let t = q1.post_write(src, 0..64, dst.remote(0..64).unwrap()).unwrap();
    /// let c = q1.wait(std::time::Duration::from_secs(10)).unwrap();
    /// let (wc, buf) = c.into_result().unwrap();
    /// assert_eq!((wc.wr_id, buf.as_slice().unwrap().len()), (t.wr_id(), 64));
    /// ```
    pub fn into_result(self) -> std::result::Result<(WorkCompletion, B), CompletionError<B>> {
        match self.wc.status {
            WcStatus::Success => Ok((self.wc, self.buf)),
            _ => Err(CompletionError {
                wc: self.wc,
                buf: self.buf,
            }),
        }
    }
    /// The buffer, whatever the status.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// # let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// # let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let t = q1.post_write(src, 0..64, dst.remote(0..64).unwrap()).unwrap();
    /// let c = q1.wait(std::time::Duration::from_secs(10)).unwrap();
    /// let mrkit::Owned::Mr(src) = c.into_buf() else { unreachable!() };
    /// assert_eq!(src.info().length, 64);
    /// ```
    pub fn into_buf(self) -> B {
        self.buf
    }
}

fn describe(wc: &WorkCompletion, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    write!(
        f,
        "work request {} ({:?}) completed with {} (vendor error {:#x})",
        wc.wr_id,
        wc.opcode,
        wc.status.name(),
        wc.vendor_err
    )
}

/// A completion whose status is not `SUCCESS`, as an error.
///
/// ```
/// use mrkit::qp::WcError;
/// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
/// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
/// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
/// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
/// # let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
/// # let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
/// fn put(q: &QueuePair, src: &mrkit::MemoryRegion, dst: mrkit::RemoteSlice)
///     -> Result<(), Box<dyn std::error::Error>> {
///     WcError::check(q.write(src, 0..64, dst)?)?;
///     Ok(())
/// }
/// put(&q1, &src, dst.remote(0..64).unwrap()).unwrap();
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WcError {
    /// The completion.
    pub wc: WorkCompletion,
}

impl WcError {
    /// `Ok(wc)` for a successful completion, else the error.
    ///
    /// ```
    /// use mrkit::qp::WcError;
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair, WcStatus};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// # let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// # let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let good = dst.remote(0..64).unwrap();
    /// assert!(WcError::check(q1.write(&src, 0..64, good).unwrap()).is_ok());
    /// // A wrong rkey: the peer refuses the WRITE, and the completion says so.
    /// let bad = mrkit::RemoteSlice { rkey: good.rkey ^ 1, ..good };
    /// let err = WcError::check(q1.write(&src, 0..64, bad).unwrap()).unwrap_err();
    /// assert_eq!(err.wc.status, WcStatus::RemAccessErr);
    /// ```
    pub fn check(wc: WorkCompletion) -> std::result::Result<WorkCompletion, WcError> {
        match wc.status {
            WcStatus::Success => Ok(wc),
            _ => Err(WcError { wc }),
        }
    }
}

impl fmt::Display for WcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        describe(&self.wc, f)
    }
}

impl std::error::Error for WcError {}

/// A completion with a non-success status and the buffer its work request carried.
///
/// ```
/// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
/// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
/// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
/// # QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
/// # let src = pd.register(Buffer::new(64).unwrap(), A::REMOTE_READ).unwrap();
/// // A READ into an MR without LOCAL_WRITE: the device refuses to write it.
/// let dst = pd.register(Buffer::new(64).unwrap(), A::empty()).unwrap();
/// q1.post_read(dst, 0..64, src.remote(0..64).unwrap()).unwrap();
/// let err = q1.wait(std::time::Duration::from_secs(10)).unwrap().into_result().unwrap_err();
/// assert_eq!(err.wc.status, mrkit::WcStatus::LocProtErr);
/// let boxed: Box<dyn std::error::Error> = Box::new(err); // implements std::error::Error
/// assert!(boxed.to_string().contains("LOC_PROT_ERR"));
/// ```
#[derive(Debug)]
pub struct CompletionError<B> {
    /// The completion.
    pub wc: WorkCompletion,
    /// The buffer, handed back.
    pub buf: B,
}

impl<B> fmt::Display for CompletionError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        describe(&self.wc, f)
    }
}

impl<B: fmt::Debug> std::error::Error for CompletionError<B> {}

/// A refused post: the errno (of `ibv_post_send`/`ibv_post_recv`, or `EINVAL` for a range
/// outside the buffer) and the buffer, handed back untouched.
///
/// ```
/// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
/// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
/// let q = QueuePair::new(&pd, QpCap::default()).unwrap(); // RESET: posting is refused
/// let mr = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
/// let refused = q.post_send(mr, 0..64).unwrap_err();
/// assert_eq!(refused.error.errno(), mrkit::Errno::EINVAL);
/// let _mr = refused.buf; // untouched, still registered
/// // Or with `?`, through `std::error::Error`:
/// fn post(q: &QueuePair, mr: mrkit::MemoryRegion) -> Result<(), Box<dyn std::error::Error>> {
///     q.post_send(mr, 0..64)?;
///     Ok(())
/// }
/// ```
#[derive(Debug)]
pub struct PostRefused<B = Owned> {
    /// Why.
    pub error: Error,
    /// The buffer.
    pub buf: B,
}

impl<B> fmt::Display for PostRefused<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "post refused: {}", self.error)
    }
}

impl<B: fmt::Debug> std::error::Error for PostRefused<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<B> From<Box<PostRefused<B>>> for Error {
    /// The errno and message (the buffer is dropped).
    fn from(p: Box<PostRefused<B>>) -> Error {
        p.error
    }
}
