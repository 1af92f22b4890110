//! The CQ verbs of the device: completion channels, create / resize / destroy CQ, poll (with
//! progress on an empty poll), wait, arm, and the per-thread last-used CQ lookup.
#![forbid(unsafe_code)]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Context;
use crate::cq::{CompChannel, CqObject, Wc};
use crate::error::{err, Result};

impl Context {
    pub(crate) fn cq(&self, cqn: u32) -> Result<Arc<CqObject>> {
        self.dev
            .dp
            .cqs
            .read()
            .get(&cqn)
            .cloned()
            .ok_or_else(|| err!(EINVAL, "CQ {cqn} does not exist"))
    }

    /// `ibv_create_comp_channel`.
    pub fn create_comp_channel(&self) -> u32 {
        let n = self.dev.dp.next_ch.fetch_add(1, Ordering::Relaxed);
        self.dev.dp.channels.write().insert(n, Arc::default());
        n
    }

    /// Completion channel `channel`, EINVAL for an unknown one.
    fn channel(&self, channel: u32) -> Result<Arc<CompChannel>> {
        self.dev
            .dp
            .channels
            .read()
            .get(&channel)
            .cloned()
            .ok_or_else(|| err!(EINVAL, "completion channel {channel} does not exist"))
    }

    /// `ibv_get_cq_event`: block until an armed CQ of this channel fires; returns its number.
    pub fn get_cq_event(&self, channel: u32, timeout: Option<Duration>) -> Result<Option<u32>> {
        let ch = self.channel(channel)?;
        self.dev.dp.app_blocks();
        // About to block: held ACKs must not wait for this thread.
        self.flush_acks(None);
        Ok(ch.get_event(timeout))
    }

    /// `ibv_destroy_comp_channel`: EBUSY while a CQ reports to it, EINVAL for an unknown one.
    pub fn destroy_comp_channel(&self, channel: u32) -> Result<()> {
        let mut g = self.dev.dp.channels.write();
        let ch = g
            .get(&channel)
            .ok_or_else(|| err!(EINVAL, "completion channel {channel} does not exist"))?;
        let users = self
            .dev
            .dp
            .cqs
            .read()
            .values()
            .filter(|cq| cq.channel.as_ref().is_some_and(|c| Arc::ptr_eq(c, ch)))
            .count();
        if users > 0 {
            return Err(err!(
                EBUSY,
                "completion channel {channel} is used by {users} CQ(s); destroy them first"
            ));
        }
        g.remove(&channel);
        Ok(())
    }

    /// A pollable descriptor of completion channel `channel` (a duplicate, owned by the
    /// caller): readable while the channel holds events, for `poll`/`epoll`/async runtimes.
    /// Drain the events with [`Context::get_cq_event`] (timeout zero does not block).
    pub fn comp_channel_fd(&self, channel: u32) -> Result<rustix::fd::OwnedFd> {
        let ch = self.channel(channel)?;
        ch.fd()
            .map_err(|e| err!(ENOMEM, "no descriptor for the completion channel: {e}"))
    }

    /// `ibv_create_cq`: `cqe` in 1..=max_cqe (EINVAL otherwise); optional channel.
    pub fn create_cq(&self, cqe: u32, channel: Option<u32>) -> Result<u32> {
        let max = self.dev.core.config.attr().max_cqe;
        if cqe == 0 || cqe > max {
            return Err(err!(EINVAL, "cqe {cqe} must be in 1..={max}"));
        }
        let ch = match channel {
            Some(c) => Some(
                self.dev
                    .dp
                    .channels
                    .read()
                    .get(&c)
                    .cloned()
                    .ok_or_else(|| err!(EINVAL, "completion channel {c} does not exist"))?,
            ),
            None => None,
        };
        if self.dev.dp.cqs.read().len() as u32 >= self.dev.core.config.attr().max_cq {
            return Err(err!(ENOMEM, "max_cq CQs exist"));
        }
        let n = self.dev.dp.next_cqn.fetch_add(1, Ordering::Relaxed);
        self.dev
            .dp
            .cqs
            .write()
            .insert(n, Arc::new(CqObject::new(n, cqe as usize, ch)));
        Ok(n)
    }

    /// `ibv_resize_cq`: EINVAL below the number of queued completions or above max_cqe.
    pub fn resize_cq(&self, cqn: u32, cqe: u32) -> Result<()> {
        let max = self.dev.core.config.attr().max_cqe;
        if cqe == 0 || cqe > max {
            return Err(err!(EINVAL, "cqe {cqe} must be in 1..={max}"));
        }
        self.cq(cqn)?.resize(cqe as usize).map_err(|have| {
            err!(
                EINVAL,
                "CQ {cqn} holds {have} completions; poll before shrinking to {cqe}"
            )
        })
    }

    /// `ibv_destroy_cq`: EBUSY while a QP uses it.
    pub fn destroy_cq(&self, cqn: u32) -> Result<()> {
        let mut g = self.dev.dp.cqs.write();
        let cq = g
            .get(&cqn)
            .ok_or_else(|| err!(EINVAL, "CQ {cqn} does not exist"))?;
        let users = cq.users.load(Ordering::Acquire);
        if users > 0 {
            return Err(err!(
                EBUSY,
                "CQ {cqn} is used by {users} QP(s); destroy them first"
            ));
        }
        if let Some(cq) = g.remove(&cqn) {
            cq.destroyed.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Run `f` on CQ `cqn`, through this thread's last-used CQ cache (`last_used.rs`: no
    /// table lock per poll; a destroyed CQ's memory stays with the threads that polled it
    /// last until they poll another CQ or exit).
    fn with_cq<R>(&self, cqn: u32, f: impl FnOnce(&CqObject) -> R) -> Result<R> {
        thread_local! {
            static LAST_CQ: crate::last_used::Slot<CqObject> = const { std::cell::RefCell::new(None) };
        }
        let dp = &self.dev.dp;
        crate::last_used::with_cached(
            &LAST_CQ,
            dp.node_id,
            cqn,
            || dp.cqs.read().get(&cqn).cloned(),
            |cq| f(cq),
        )
        .ok_or_else(|| err!(EINVAL, "CQ {cqn} does not exist"))
    }

    /// `ibv_poll_cq`: append up to `max` completions to `out`; returns how many.
    /// On an empty CQ (and without manual progress) it first runs the device's progress
    /// inline once (progress-on-poll, `driver/caller_thread.rs`).
    pub fn poll_cq(&self, cqn: u32, out: &mut Vec<Wc>, max: usize) -> Result<usize> {
        let poll = |out: &mut Vec<Wc>| self.with_cq(cqn, |cq| cq.poll(out, max));
        let n = poll(out)?;
        if n == 0 && max > 0 && !self.dev.dp.manual() {
            let now = Instant::now();
            self.dev.dp.note_app_poll(now);
            if self.progress_on_poll(now) {
                return poll(out);
            }
        }
        Ok(n)
    }

    /// Block until the CQ holds a completion or `timeout` passes.
    pub fn wait_cq(&self, cqn: u32, timeout: Duration) -> Result<bool> {
        self.dev.dp.app_blocks();
        // About to block: held ACKs must not wait for this thread.
        self.flush_acks(None);
        Ok(self.cq(cqn)?.wait_nonempty(Instant::now() + timeout))
    }

    /// `ibv_req_notify_cq` (one-shot; solicited-only fires on solicited or error completions).
    pub fn req_notify_cq(&self, cqn: u32, solicited_only: bool) -> Result<()> {
        self.cq(cqn)?.arm(solicited_only);
        Ok(())
    }

    /// Whether the CQ overflowed (CQ error).
    pub fn cq_overflowed(&self, cqn: u32) -> Result<bool> {
        Ok(self.cq(cqn)?.overflowed())
    }

    /// `(queued completions, capacity)`.
    pub fn cq_len(&self, cqn: u32) -> Result<(usize, usize)> {
        Ok(self.cq(cqn)?.len_cap())
    }
}
