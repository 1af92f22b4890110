//! Completions as futures (cargo feature `tokio`).
//!
//! A queue pair's two CQs report to one completion channel; the channel's descriptor (an
//! eventfd readable while events are queued) is registered with the tokio reactor
//! ([`tokio::io::unix::AsyncFd`]) the first time a future of the queue pair is polled. A
//! future polls the CQs, arms them (`req_notify_cq`), polls again — a completion that arrived
//! between the first poll and the arm is found there, so none is missed — and only then waits
//! for the descriptor to become readable. No thread per queue pair, no busy loop.
//!
//! Many futures may wait on one queue pair at once (share it with `Arc`): whoever reaps
//! completions wakes the others, and each completion goes to exactly one of them. A dropped
//! future loses nothing: the buffer stays with the queue pair until a later poll, wait or
//! future hands its completion out.
//!
//! The descriptor is bound to the runtime that first polled a future of the queue pair: use a
//! queue pair's futures from that runtime only.

use std::future::Future;
use std::os::fd::OwnedFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskCx, Poll, Waker};

use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::{handed_out, nothing_in_flight, Completion, QueuePair, Registered, State, Ticket};
use crate::{Errno, Error, Result};

/// The queue pair's completion channel registered with the runtime (created on first use).
#[derive(Debug, Default)]
pub(super) struct Reactor {
    fd: Mutex<Option<Arc<AsyncFd<OwnedFd>>>>,
}

impl Reactor {
    fn get<B: Registered>(&self, qp: &QueuePair<B>) -> Result<Arc<AsyncFd<OwnedFd>>> {
        let mut g = self.fd.lock();
        if let Some(a) = &*g {
            return Ok(a.clone());
        }
        let fd = qp.ctx.provider().comp_channel_fd(qp.channel)?;
        // SAFETY: the AsyncFd takes ownership of `fd` (an `OwnedFd`: open, closed only when
        // dropped), nothing else closes or replaces it, and `OwnedFd::as_raw_fd` always
        // returns that same descriptor.
        let registered = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) };
        let a = Arc::new(registered.map_err(|e| {
            Error::new(
                Errno::ENOMEM,
                format!("cannot register the completion channel with the runtime: {e}"),
            )
        })?);
        *g = Some(a.clone());
        Ok(a)
    }
}

impl<B: Registered> QueuePair<B> {
    /// The completion of the pipelined work request `ticket`, with its buffer, as a future.
    /// `ENOENT` when that completion was already handed out (by [`QueuePair::poll`], say).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
    /// let dst = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// let src = pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let t = q1.post_write(src, 0..64, dst.remote(0..64).unwrap()).unwrap();
    /// let c = q1.completion(t).await.unwrap();
    /// c.into_result().unwrap();
    /// # }
    /// ```
    pub fn completion(&self, ticket: Ticket) -> CompletionFuture<'_, B> {
        CompletionFuture {
            qp: self,
            want: Some(ticket.0),
            waiter: None,
        }
    }

    /// The next completion of any pipelined work request, as a future. `ENOENT` when none is
    /// in flight.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let (q1, q2) = (QueuePair::new(&pd, QpCap::default()).unwrap(), QueuePair::new(&pd, QpCap::default()).unwrap());
    /// # QueuePair::connect(&q1, &q2, A::empty()).unwrap();
    /// q2.post_recv(pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap(), 0..64).unwrap();
    /// q1.post_send(pd.register(Buffer::new(64).unwrap(), A::LOCAL_WRITE).unwrap(), 0..3).unwrap();
    /// let got = tokio::time::timeout(std::time::Duration::from_secs(10), q2.next_completion())
    ///     .await
    ///     .expect("in time")
    ///     .unwrap();
    /// assert_eq!(got.wc.byte_len, 3);
    /// # }
    /// ```
    pub fn next_completion(&self) -> CompletionFuture<'_, B> {
        CompletionFuture {
            qp: self,
            want: None,
            waiter: None,
        }
    }
}

/// A future of one completion ([`QueuePair::completion`], [`QueuePair::next_completion`]).
/// Dropping it before it is ready leaves the completion, and the buffer, with the queue pair.
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct CompletionFuture<'q, B: Registered> {
    qp: &'q QueuePair<B>,
    /// The wr_id wanted, or any pipelined completion.
    want: Option<u64>,
    /// This future's entry in the queue pair's waker list, once registered.
    waiter: Option<u64>,
}

impl<B: Registered> CompletionFuture<'_, B> {
    fn try_take(&self, st: &mut State<B>) -> Option<Result<Completion<B>>> {
        match self.want {
            Some(id) => {
                if let Some(c) = st.take_ticket(id) {
                    return Some(Ok(c));
                }
                if !st.inflight.contains_key(&id) {
                    return Some(Err(handed_out(id)));
                }
                None
            }
            None => {
                if let Some(c) = st.take_any() {
                    return Some(Ok(c));
                }
                if st.inflight.is_empty() {
                    return Some(Err(nothing_in_flight()));
                }
                None
            }
        }
    }

    fn register(&mut self, st: &mut State<B>, w: &Waker) {
        let id = *self.waiter.get_or_insert_with(|| {
            st.next_waiter += 1;
            st.next_waiter
        });
        match st.wakers.iter_mut().find(|(i, _)| *i == id) {
            Some((_, old)) => old.clone_from(w),
            None => st.wakers.push((id, w.clone())),
        }
    }

    fn unregister(&mut self, st: &mut State<B>) {
        if let Some(id) = self.waiter.take() {
            st.wakers.retain(|(i, _)| *i != id);
        }
    }

    fn poll_inner(&mut self, cx: &mut TaskCx<'_>) -> Poll<Result<Completion<B>>> {
        let qp = self.qp;
        let afd = qp.reactor.get(qp)?;
        loop {
            // Consume the channel's events (non-blocking): its descriptor stops being
            // readable, and the device learns that the application is about to wait.
            qp.drain_events()?;
            for arm in [false, true] {
                let mut st = qp.state.lock();
                if arm {
                    qp.arm(&mut st)?;
                }
                qp.reap(&mut st)?;
                if let Some(r) = self.try_take(&mut st) {
                    self.unregister(&mut st);
                    return Poll::Ready(r);
                }
                // Before the arm: whoever reaps our completion from now on wakes us.
                self.register(&mut st, cx.waker());
            }
            match afd.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(Err(Error::new(
                        Errno::ENOMEM,
                        format!("the runtime lost the completion channel: {e}"),
                    )))
                }
                // Clear, then go round: the drain at the top sees every event queued before
                // the clear, and one queued after it makes the descriptor readable again.
                Poll::Ready(Ok(mut g)) => g.clear_ready(),
            }
        }
    }
}

impl<B: Registered> Future for CompletionFuture<'_, B> {
    type Output = Result<Completion<B>>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Self::Output> {
        // Every field is Unpin.
        let this = self.get_mut();
        if let Poll::Ready(r) = this.poll_inner(cx) {
            if this.waiter.is_some() {
                let mut st = this.qp.state.lock();
                this.unregister(&mut st);
            }
            return Poll::Ready(r);
        }
        Poll::Pending
    }
}

impl<B: Registered> Drop for CompletionFuture<'_, B> {
    fn drop(&mut self) {
        if self.waiter.is_none() {
            return;
        }
        let mut st = self.qp.state.lock();
        self.unregister(&mut st);
        // This future's waker may have been the one the reactor would wake: let the other
        // waiters poll again, one of them registers itself with the reactor.
        for (_, w) in st.wakers.drain(..) {
            w.wake();
        }
    }
}
