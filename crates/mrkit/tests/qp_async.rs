//! Completions as futures (feature `tokio`): many concurrent awaits over two queue pairs on a
//! current-thread and on a multi-thread runtime, dropped futures that lose nothing, timeouts.
#![cfg(feature = "tokio")]
mod providers_util;

use std::sync::Arc;
use std::time::Duration;

use mrkit::{AccessFlags as A, Buffer, MemoryRegion, ProtectionDomain, QpCap, QueuePair};

/// Bound on every await that must finish (generous: the machine is shared).
const WAIT: Duration = Duration::from_secs(60);

fn mr(pd: &ProtectionDomain, len: usize, fill: u8) -> MemoryRegion {
    let mut m = pd
        .register(
            Buffer::new(len).unwrap(),
            A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ,
        )
        .unwrap();
    m.as_mut_slice().fill(fill);
    m
}

fn setup() -> (ProtectionDomain, Arc<QueuePair>, Arc<QueuePair>) {
    let c1 = providers_util::open();
    let pd = c1.alloc_pd().unwrap();
    let q1 = QueuePair::new(&pd, QpCap::default()).unwrap();
    let q2 = QueuePair::new(&pd, QpCap::default()).unwrap();
    QueuePair::connect(&q1, &q2, A::REMOTE_WRITE | A::REMOTE_READ).unwrap();
    (pd, Arc::new(q1), Arc::new(q2))
}

/// 32 receivers await their own receive's completion on q2 while 32 senders SEND on q1 and 32
/// writers WRITE on q1, each awaiting its own completion: every future resolves, with its own
/// buffer.
async fn many_concurrent_awaits() {
    const N: usize = 32;
    let (pd, q1, q2) = setup();
    let dst = Arc::new(mr(&pd, N * 64, 0));
    let mut tasks = Vec::new();
    let mut tickets = Vec::new();
    for _ in 0..N {
        tickets.push(q2.post_recv(mr(&pd, 64, 0), 0..64).unwrap());
    }
    for t in tickets {
        let q2 = q2.clone();
        tasks.push(tokio::spawn(async move {
            let c = q2.completion(t).await.unwrap();
            assert_eq!(c.wr_id(), t.wr_id());
            let (wc, buf) = c.into_result().unwrap();
            // The sender put its index in the first byte and sent index+1 bytes.
            let i = buf.as_slice().unwrap()[0] as usize;
            assert_eq!(wc.byte_len as usize, i + 1);
        }));
    }
    for i in 0..N {
        let (q1, pd, dst) = (q1.clone(), pd.clone(), dst.clone());
        tasks.push(tokio::spawn(async move {
            let t = q1
                .post_send(mr(&pd, 64, i as u8), 0..(i as u64 + 1))
                .unwrap();
            q1.completion(t).await.unwrap().into_result().unwrap();
            let r = dst.remote((i * 64) as u64..((i + 1) * 64) as u64).unwrap();
            let t = q1.post_write(mr(&pd, 64, i as u8 + 1), 0..64, r).unwrap();
            let c = q1.completion(t).await.unwrap();
            assert_eq!(c.buf.as_slice().unwrap()[0], i as u8 + 1);
            c.into_result().unwrap();
        }));
    }
    for t in tasks {
        tokio::time::timeout(WAIT, t)
            .await
            .expect("in time")
            .unwrap();
    }
    for i in 0..N {
        assert!(dst.as_slice()[i * 64..(i + 1) * 64]
            .iter()
            .all(|&b| b == i as u8 + 1));
    }
    assert_eq!((q1.in_flight(), q2.in_flight()), (0, 0));
}

#[test]
fn many_concurrent_awaits_on_a_current_thread_runtime() {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(many_concurrent_awaits());
}

#[test]
fn many_concurrent_awaits_on_a_multi_thread_runtime() {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(many_concurrent_awaits());
}

/// A future dropped before its completion (here by `tokio::time::timeout`) loses nothing: the
/// buffer stays with the queue pair and the next poll hands it back.
#[tokio::test(flavor = "current_thread")]
async fn a_dropped_future_leaves_the_buffer_with_the_queue_pair() {
    let (pd, q1, q2) = setup();
    let t = q2.post_recv(mr(&pd, 64, 0), 0..64).unwrap();
    let r = tokio::time::timeout(Duration::from_millis(30), q2.completion(t)).await;
    assert!(r.is_err(), "nothing was sent: the await times out");
    assert_eq!(q2.in_flight(), 1);
    let r = tokio::time::timeout(Duration::from_millis(30), q2.next_completion()).await;
    assert!(r.is_err());
    let tx = mr(&pd, 64, 0x3c);
    q1.send(&tx, 0..64).unwrap();
    // Not awaited: a blocking poll picks it up.
    let deadline = std::time::Instant::now() + WAIT;
    let c = loop {
        if let Some(c) = q2.poll().unwrap().pop() {
            break c;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "completion never came"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    assert_eq!(c.wr_id(), t.wr_id());
    assert!(c.buf.as_slice().unwrap().iter().all(|&b| b == 0x3c));
    // Its ticket's future now says the completion was handed out, and does not hang.
    let e = tokio::time::timeout(WAIT, q2.completion(t))
        .await
        .expect("in time")
        .unwrap_err();
    assert_eq!(e.errno(), mrkit::Errno::ENOENT);
}

/// Several tasks wait on one queue pair; one of them is cancelled while waiting (it may be the
/// one the reactor would have woken). The others still get every completion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_one_waiter_does_not_strand_the_others() {
    let (pd, q1, q2) = setup();
    for _ in 0..4 {
        let _ = q2.post_recv(mr(&pd, 64, 0), 0..64).unwrap();
    }
    let mut waiters = Vec::new();
    for _ in 0..4 {
        let q2 = q2.clone();
        waiters.push(tokio::spawn(async move {
            q2.next_completion().await.unwrap().into_result().unwrap();
        }));
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let last = waiters.pop().unwrap();
    last.abort();
    let _ = last.await;
    let tx = mr(&pd, 64, 1);
    for _ in 0..3 {
        q1.send(&tx, 0..8).unwrap();
    }
    for w in waiters {
        tokio::time::timeout(WAIT, w)
            .await
            .expect("in time")
            .unwrap();
    }
    // The fourth receive is still held, and comes back with the fourth message.
    assert_eq!(q2.in_flight(), 1);
    q1.send(&tx, 0..8).unwrap();
    tokio::time::timeout(WAIT, q2.next_completion())
        .await
        .expect("in time")
        .unwrap()
        .into_result()
        .unwrap();
}

/// Waiting is not spinning: a future waiting 200 ms for a message that never comes is polled
/// a handful of times, not thousands.
#[tokio::test(flavor = "current_thread")]
async fn an_idle_await_does_not_busy_poll() {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context as Cx, Poll};

    struct Counting<'a, F>(Pin<Box<F>>, &'a AtomicUsize);
    impl<F: Future> Future for Counting<'_, F> {
        type Output = F::Output;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Cx<'_>) -> Poll<F::Output> {
            self.1.fetch_add(1, Ordering::Relaxed);
            self.0.as_mut().poll(cx)
        }
    }
    let (pd, _q1, q2) = setup();
    let _ = q2.post_recv(mr(&pd, 64, 0), 0..64).unwrap();
    let polls = AtomicUsize::new(0);
    let fut = Counting(Box::pin(q2.next_completion()), &polls);
    assert!(tokio::time::timeout(Duration::from_millis(200), fut)
        .await
        .is_err());
    let n = polls.load(Ordering::Relaxed);
    assert!(n <= 10, "polled {n} times while idle");
}
