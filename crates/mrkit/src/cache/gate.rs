//! The gate between a cache's background users and its last user.
//!
//! The idle scanner and the statistics exporter reach a cache through a weak reference: a
//! cache they kept alive would outlive its users. But upgrading that reference for a pass is
//! not enough: if the last user drops the cache during the pass, the background thread holds
//! the last strong reference and the cache is torn down — its registrations deregistered —
//! on *that* thread, a moment after its user moved on (a program that checks its device
//! right after the drop sees the MRs still there).
//!
//! So a background pass takes its strong reference only under the cache's [`Gate`] and lets
//! go of it before leaving, and the drop of the last user handle ([`User`], shared by the
//! clones of a `RegCache`) closes the gate first, waiting for a pass in progress. Its own
//! reference is then the last one: the cache is torn down on the thread that dropped it.
//! (The exception: a last user dropped *by* a background pass — drop code of an owned
//! buffer run by a retirement — is torn down on that thread, as it must be; the gate is
//! reentrant so that this case does not deadlock.)

use std::cell::Cell;
use std::sync::{Arc, Weak};

use parking_lot::ReentrantMutex;

use super::{Inner, RegCache};

/// Closed (true) once the cache's last user is gone.
#[derive(Debug, Default)]
pub(super) struct Gate(ReentrantMutex<Cell<bool>>);

impl Gate {
    /// Run `f` on the cache while it has users, holding a strong reference only inside the
    /// gate. `None` once the cache is gone or closing.
    pub(super) fn with<R>(&self, cache: &Weak<Inner>, f: impl FnOnce(&RegCache) -> R) -> Option<R> {
        let closed = self.0.lock();
        if closed.get() {
            return None;
        }
        let inner = cache.upgrade()?;
        let view = RegCache {
            user: None,
            id: inner.id,
            inner,
        };
        let r = f(&view);
        // Not the last reference: the last user's drop waits at `close` for this pass.
        drop(view);
        drop(closed);
        Some(r)
    }

    /// No pass starts any more; waits for the one in progress.
    fn close(&self) {
        self.0.lock().set(true);
    }

    /// Whether the cache's users are all gone.
    pub(super) fn is_closed(&self) -> bool {
        self.0.lock().get()
    }
}

/// The users' share of a cache: its drop (the last user's) closes the gate.
#[derive(Debug)]
pub(super) struct User {
    pub(super) gate: Arc<Gate>,
}

impl Drop for User {
    fn drop(&mut self) {
        self.gate.close();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};

    use crate::cache::{CacheConfig, RegCache};
    use crate::{AccessFlags, Buffer, Context};

    /// A background pass in progress when the last user drops the cache: the drop waits for
    /// the pass, then tears the cache down itself (its registration is gone when it returns);
    /// later passes find the gate closed.
    #[test]
    fn the_last_user_tears_down_after_a_pass_in_progress() {
        // Makes leases: not while the slab-counting tests run.
        let _serial = crate::cache::lease::tests::SERIAL.lock();
        let ctx = Context::open_default().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
        let buf = Buffer::new(4096).unwrap();
        drop(cache.get_ref(buf.as_slice(), AccessFlags::empty()).unwrap());
        let live = || ctx.soft().unwrap().stats().mrs_live;
        assert_eq!(live(), 1);
        let (weak, gate) = (Arc::downgrade(&cache.inner), cache.inner.gate.clone());
        let (entered, pass) = (mpsc::channel(), Duration::from_millis(100));
        let bg = std::thread::spawn(move || {
            let ran = gate.with(&weak, |c| {
                entered.0.send(()).unwrap();
                std::thread::sleep(pass);
                c.len()
            });
            (ran, gate.with(&weak, |c| c.len()))
        });
        entered.1.recv().unwrap();
        let t0 = Instant::now();
        drop(cache);
        // Waited for the pass, and released the registration on this thread.
        assert!(
            t0.elapsed() >= pass / 2,
            "the drop did not wait for the pass"
        );
        assert_eq!(live(), 0, "registration left to the background thread");
        assert_eq!(bg.join().unwrap(), (Some(1), None));
    }
}
