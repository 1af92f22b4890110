//! The rdma-core provider end to end through the drop-in library (mrkit API → rdma-core
//! provider → C ABI → drop-in → its own mrkit0), side by side with the embedded mrkit0: what
//! `query_mr` can and cannot know, memory windows, completion channels, queue pairs with the
//! ownership API, the pool and the cache on the provider's MRs, and a native QP connected to an
//! rdma-core QP. The registration rules with both providers' answers are one table in
//! `provider_rules.rs`.
mod providers_util;

use std::time::Duration;

use mrkit::cache::{CacheConfig, RegCache};
use mrkit::pool::{MrPool, PoolConfig};
use mrkit::qp::Owned;
use mrkit::{
    AccessFlags as A, ConnectOpts, Context, Errno, MrKind, MwType, ProtectionDomain, QpCap,
    QueuePair, WcStatus,
};
use mrkit_soft::mr::ReregFlags;
use providers_util::{both, native, populated, rdma_core};

const WAIT: Duration = Duration::from_secs(60);

#[test]
fn query_mr_reports_what_each_provider_knows() {
    for (provider, ctx) in both() {
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd
            .register_iova(populated(8192), 0x10_0000, A::LOCAL_WRITE | A::REMOTE_READ)
            .unwrap();
        let q = mr.query().unwrap();
        assert_eq!(
            (q.lkey, q.length, q.iova, q.pd),
            (mr.lkey(), 8192, 0x10_0000, pd.handle()),
            "{provider}"
        );
        assert_eq!(q.access, A::LOCAL_WRITE | A::REMOTE_READ, "{provider}");
        assert_eq!(q.kind, MrKind::Pinned, "{provider}");
        if provider == "rdma-core" {
            // Only the kernel knows these: marked unknown.
            assert_eq!((q.page_size, q.entries, q.pinned_bytes), (0, 0, 0));
            assert!(q.pin_path.is_none() && !q.pfns_known && q.reg_timing.is_none());
        } else {
            assert!(q.page_size >= 4096 && q.pin_path.is_some());
        }
        let odp = pd
            .register(populated(4096), A::LOCAL_WRITE | A::ON_DEMAND)
            .unwrap();
        assert_eq!(odp.query().unwrap().kind, MrKind::Odp, "{provider}");
        // advise_mr goes through the verbs_context extension on rdma-core.
        pd.advise(1, 1, &[(odp.lkey(), odp.info().iova, 4096)])
            .unwrap();
        let mut mr = mr;
        mr.set_access(A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
        assert_eq!(
            mr.query().unwrap().access,
            A::LOCAL_WRITE | A::REMOTE_WRITE,
            "{provider}"
        );
        // A re-registration that moves an MR (translation and rights at once): what it
        // returns and what the provider records afterwards agree, under the new lkey.
        let first = std::sync::Arc::new(populated(4096));
        let lkey = ctx
            .provider()
            .reg_mr(
                pd.handle(),
                mrkit_soft::UserMemory::owned(first),
                0x10_0000,
                A::LOCAL_WRITE | A::REMOTE_READ,
            )
            .unwrap()
            .lkey;
        let other = std::sync::Arc::new(populated(16384));
        let addr = other.addr();
        let moved = ctx
            .provider()
            .rereg_mr(
                lkey,
                ReregFlags::CHANGE_TRANSLATION | ReregFlags::CHANGE_ACCESS,
                0,
                mrkit_soft::UserMemory::owned(other),
                0x20_0000,
                A::LOCAL_WRITE,
            )
            .unwrap();
        let q = ctx.provider().query_mr(moved.lkey).unwrap();
        assert_eq!(
            (q.lkey, q.rkey, q.addr, q.length, q.iova, q.access, q.pd),
            (
                moved.lkey,
                moved.rkey,
                addr,
                16384,
                0x20_0000,
                A::LOCAL_WRITE,
                pd.handle()
            ),
            "{provider}"
        );
        assert_eq!((q.kind, q.writable), (MrKind::Pinned, true), "{provider}");
        if moved.lkey != lkey {
            assert!(ctx.provider().query_mr(lkey).is_err(), "{provider}");
        }
        ctx.provider().dereg_mr(moved.lkey).unwrap();
    }
}

#[test]
fn memory_windows_on_both_providers() {
    for (provider, ctx) in both() {
        let pd = ctx.alloc_pd().unwrap();
        for ty in [MwType::Type1, MwType::Type2] {
            let mw = pd.alloc_mw(ty).unwrap();
            assert_eq!(mw.mw_type(), ty, "{provider}");
            let info = ctx.provider().query_mw(mw.rkey()).unwrap();
            assert_eq!(
                (info.mw_type, info.pd, info.bound),
                (ty, pd.handle(), None),
                "{provider}"
            );
        }
    }
}

#[test]
fn completion_channels_on_both_providers() {
    for (provider, ctx) in both() {
        let pd = ctx.alloc_pd().unwrap();
        let dev = ctx.provider();
        let ch = dev.create_comp_channel().unwrap();
        let cq = dev.create_cq(16, Some(ch)).unwrap();
        let fd = dev.comp_channel_fd(ch).unwrap();
        assert_eq!(
            dev.get_cq_event(ch, Some(Duration::ZERO)).unwrap(),
            None,
            "{provider}"
        );
        assert_eq!(
            dev.destroy_comp_channel(ch).unwrap_err().errno(),
            Errno::EBUSY,
            "{provider}"
        );
        dev.req_notify_cq(cq, false).unwrap();
        // A completion on that CQ: a QP whose receive queue reports to it, flushed by ERR.
        let (qpn, _) = dev
            .create_qp(mrkit::provider::QpInitAttr {
                pd: pd.handle(),
                send_cq: cq,
                recv_cq: cq,
                cap: QpCap::default(),
                sq_sig_all: true,
            })
            .unwrap();
        let buf = pd.register(populated(64), A::LOCAL_WRITE).unwrap();
        let init = mrkit::provider::QpAttr {
            qp_state: mrkit::QpState::Init as u32,
            port_num: 1,
            ..Default::default()
        };
        use mrkit::provider::attr_mask as m;
        dev.modify_qp(
            qpn,
            &init,
            m::STATE | m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS,
        )
        .unwrap();
        dev.post_recv(
            qpn,
            &[mrkit::provider::RecvWr {
                wr_id: 7,
                sg_list: vec![mrkit::provider::Sge {
                    addr: buf.info().iova,
                    length: 64,
                    lkey: buf.lkey(),
                }],
            }],
        )
        .unwrap();
        let err = mrkit::provider::QpAttr {
            qp_state: mrkit::QpState::Err as u32,
            ..Default::default()
        };
        dev.modify_qp(qpn, &err, m::STATE).unwrap();
        // The channel's fd turns readable, and the event names the CQ.
        let mut pfd = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        let ts = rustix::event::Timespec {
            tv_sec: 60,
            tv_nsec: 0,
        };
        assert_eq!(
            rustix::event::poll(&mut pfd, Some(&ts)).unwrap(),
            1,
            "{provider}"
        );
        assert_eq!(
            dev.get_cq_event(ch, Some(WAIT)).unwrap(),
            Some(cq),
            "{provider}"
        );
        let mut wcs = Vec::new();
        let deadline = std::time::Instant::now() + WAIT;
        while wcs.is_empty() && std::time::Instant::now() < deadline {
            dev.poll_cq(cq, &mut wcs, 4).unwrap();
        }
        assert_eq!(
            (wcs[0].wr_id, wcs[0].status),
            (7, WcStatus::WrFlushErr),
            "{provider}"
        );
        dev.destroy_qp(qpn).unwrap();
        drop(buf);
        dev.destroy_cq(cq).unwrap();
        dev.destroy_comp_channel(ch).unwrap();
    }
}

fn mr(pd: &ProtectionDomain, len: usize, fill: u8) -> mrkit::MemoryRegion {
    let mut m = pd
        .register(
            populated(len),
            A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ,
        )
        .unwrap();
    m.as_mut_slice().fill(fill);
    m
}

/// WRITE, READ, SEND/RECV and the owned-buffer API between two QPs of `ctx`.
fn data_path(provider: &str, ctx: &Context) {
    let pd = ctx.alloc_pd().unwrap();
    let q1: QueuePair = QueuePair::new(&pd, QpCap::default()).unwrap();
    let q2: QueuePair = QueuePair::new(&pd, QpCap::default()).unwrap();
    QueuePair::connect(&q1, &q2, A::REMOTE_WRITE | A::REMOTE_READ).unwrap();
    let src = mr(&pd, 4096, 0x11);
    let mut dst = mr(&pd, 4096, 0);
    let wc = q1.write(&src, 0..8, dst.remote(0..8).unwrap()).unwrap();
    assert_eq!(wc.status, WcStatus::Success, "{provider}");
    assert_eq!(
        &dst.as_slice()[..9],
        &[0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0],
        "{provider}"
    );
    let remote = mr(&pd, 4096, 0x5a);
    let wc = q1
        .read(&mut dst, 0..4096, remote.remote(0..4096).unwrap())
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success, "{provider}");
    assert!(dst.as_slice().iter().all(|&b| b == 0x5a), "{provider}");
    // SEND/RECV with owned buffers: each comes back with its completion.
    let (qo1, qo2): (QueuePair, QueuePair) = (
        QueuePair::new(&pd, QpCap::default()).unwrap(),
        QueuePair::new(&pd, QpCap::default()).unwrap(),
    );
    QueuePair::connect(&qo1, &qo2, A::empty()).unwrap();
    let t = qo2.post_recv(mr(&pd, 4096, 0), 0..4096).unwrap();
    let _sent = qo1.post_send(mr(&pd, 4096, 0x77), 0..100).unwrap();
    let sent = qo1.wait(WAIT).unwrap();
    assert_eq!(sent.status(), WcStatus::Success, "{provider}");
    assert!(matches!(sent.buf, Owned::Mr(_)), "{provider}");
    let got = qo2.wait(WAIT).unwrap();
    assert_eq!(
        (got.wr_id(), got.status(), got.wc.byte_len),
        (t.wr_id(), WcStatus::Success, 100),
        "{provider}"
    );
    let back = got.buf.as_slice().unwrap();
    assert!(
        back[..100].iter().all(|&b| b == 0x77) && back[100] == 0,
        "{provider}"
    );
    // A remote access error is a completion status, the same on both.
    let bad = mrkit::RemoteSlice {
        addr: remote.info().iova,
        len: 8,
        rkey: remote.rkey() ^ 0x100,
    };
    let wc = q1.write(&src, 0..8, bad).unwrap();
    assert_eq!(wc.status, WcStatus::RemAccessErr, "{provider}");
}

#[test]
fn queue_pairs_on_both_providers() {
    for (provider, ctx) in both() {
        data_path(provider, &ctx);
    }
}

#[test]
fn a_native_qp_connects_to_an_rdma_core_qp() {
    let (cn, cr) = (native(), rdma_core());
    let (pn, pr) = (cn.alloc_pd().unwrap(), cr.alloc_pd().unwrap());
    let mut qn: QueuePair = QueuePair::new(&pn, QpCap::default()).unwrap();
    let mut qr: QueuePair = QueuePair::new(&pr, QpCap::default()).unwrap();
    let o = ConnectOpts::default();
    let (en, er) = (qn.endpoint().unwrap(), qr.endpoint().unwrap());
    assert_ne!(en.ip(), er.ip(), "two device copies, two addresses");
    qn.connect_to(&er, &o).unwrap();
    qr.connect_to(&en, &o).unwrap();
    let mut ln = mr(&pn, 4096, 0);
    let rr = mr(&pr, 4096, 0x42);
    let wc = qn
        .read(&mut ln, 0..4096, rr.remote(0..4096).unwrap())
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert!(ln.as_slice().iter().all(|&b| b == 0x42));
    let src = mr(&pr, 4096, 0x24);
    let wc = qr
        .write(&src, 0..4096, ln.remote(0..4096).unwrap())
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert!(ln.as_slice().iter().all(|&b| b == 0x24));
    // mrkit0's in-process node address means nothing to the drop-in's copy: refused, not
    // misrouted.
    let q3: QueuePair = QueuePair::new(&pr, QpCap::default()).unwrap();
    let q4: QueuePair = QueuePair::new(&pn, QpCap::default()).unwrap();
    assert_eq!(
        QueuePair::connect(&q3, &q4, A::empty())
            .unwrap_err()
            .errno(),
        Errno::EINVAL
    );
}

/// The pool carves the provider's MRs: slots' keys move data on both providers.
#[test]
fn pool_on_both_providers() {
    for (provider, ctx) in both() {
        let pd = ctx.alloc_pd().unwrap();
        let cfg = PoolConfig {
            chunk_size: 64 << 10,
            slot_size: 4096,
            initial_chunks: 1,
            max_chunks: 2,
            thp: false,
            magazine: 8,
            ..PoolConfig::default()
        };
        let pool = MrPool::new(&pd, cfg).unwrap();
        let mut held = Vec::new();
        for _ in 0..32 {
            held.push(pool.alloc().unwrap());
        }
        assert_eq!(
            pool.alloc().unwrap_err().errno(),
            Errno::ENOMEM,
            "{provider}"
        );
        let st = pool.stats();
        assert_eq!((st.total, st.in_use, st.chunks), (32, 32, 2), "{provider}");
        for (base, lkey, _) in pool.chunks() {
            let q = ctx.provider().query_mr(lkey).unwrap();
            assert_eq!((q.addr, q.length), (base, 64 << 10), "{provider}");
        }
        // A WRITE from slot 3 into a plain MR, by the slot's lkey.
        let q1: QueuePair = QueuePair::new(&pd, QpCap::default()).unwrap();
        let q2: QueuePair = QueuePair::new(&pd, QpCap::default()).unwrap();
        QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
        held[3].as_mut_slice().fill(0x33);
        let dst = mr(&pd, 4096, 0);
        let wc = q1
            .write(&held[3], 0..4096, dst.remote(0..4096).unwrap())
            .unwrap();
        assert_eq!(wc.status, WcStatus::Success, "{provider}");
        assert!(dst.as_slice().iter().all(|&b| b == 0x33), "{provider}");
        drop(q1);
        drop(held);
        assert_eq!(pool.stats().in_use, 0, "{provider}");
    }
}

/// The cache registers and hits on the provider's MRs; a hit moves data.
#[test]
fn cache_on_both_providers() {
    for (provider, ctx) in both() {
        let pd = ctx.alloc_pd().unwrap();
        let cache = RegCache::new(&pd, CacheConfig::default()).unwrap();
        let mut mem = vec![0u8; 64 << 10];
        mem[..4096].fill(0x61);
        let dst = mr(&pd, 4096, 0);
        let q1: QueuePair = QueuePair::new(&pd, QpCap::default()).unwrap();
        let q2: QueuePair = QueuePair::new(&pd, QpCap::default()).unwrap();
        QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
        let lkey = {
            let r = cache.get_ref(&mem[..4096], A::empty()).unwrap();
            let wc = q1.write(&r, 0..4096, dst.remote(0..4096).unwrap()).unwrap();
            assert_eq!(wc.status, WcStatus::Success, "{provider}");
            r.lkey()
        };
        assert!(dst.as_slice().iter().all(|&b| b == 0x61), "{provider}");
        let r = cache.get_ref(&mem[100..200], A::empty()).unwrap();
        assert_eq!(r.lkey(), lkey, "{provider}: a hit reuses the registration");
        let s = cache.stats();
        assert_eq!((s.misses, s.hits, s.registrations), (1, 1, 1), "{provider}");
        assert!(ctx.provider().query_mr(lkey).is_ok(), "{provider}");
    }
}

/// Pool slots exposed through type-1 windows: on rdma-core the provider binds them with
/// `ibv_bind_mw` on a QP of its own; a peer READs through the window's rkey, and the rkey dies
/// with the exposure.
#[test]
fn pool_windows_on_both_providers() {
    for (provider, ctx) in both() {
        let pd = ctx.alloc_pd().unwrap();
        let cfg = PoolConfig {
            chunk_size: 64 << 10,
            remote: A::REMOTE_READ,
            ..PoolConfig::default()
        };
        let pool = MrPool::new(&pd, cfg).unwrap();
        let mut s = pool.alloc().unwrap();
        s.as_mut_slice().fill(0x3c);
        let r = s.expose(A::REMOTE_READ).unwrap();
        assert_eq!((r.addr, r.len), (s.addr(), 4096), "{provider}");
        assert_ne!(r.rkey, pool.chunks()[0].2, "{provider}");
        // The window answers to its current rkey (the one the exposure hands out), with what
        // it is bound to: the provider made the bind and saw it complete.
        let info = ctx.provider().query_mw(r.rkey).unwrap();
        assert_eq!(info.rkey, r.rkey, "{provider}");
        let (_, addr, len, acc) = info.bound.unwrap_or_else(|| panic!("{provider}: unbound"));
        assert_eq!(
            (addr, len, acc),
            (s.addr(), 4096, A::REMOTE_READ),
            "{provider}"
        );
        let q1: QueuePair = QueuePair::new(&pd, QpCap::default()).unwrap();
        let q2: QueuePair = QueuePair::new(&pd, QpCap::default()).unwrap();
        QueuePair::connect(&q1, &q2, A::REMOTE_READ).unwrap();
        let mut dst = mr(&pd, 4096, 0);
        let wc = q1.read(&mut dst, 0..4096, r).unwrap();
        assert_eq!(wc.status, WcStatus::Success, "{provider}");
        assert!(dst.as_slice().iter().all(|&b| b == 0x3c), "{provider}");
        s.unexpose();
        let wc = q1.read(&mut dst, 0..8, r).unwrap();
        assert_eq!(
            wc.status,
            WcStatus::RemAccessErr,
            "{provider}: a dead window's rkey"
        );
    }
}

/// Posts the device refuses: the errno and the index of the refused request (`bad_wr`) reach
/// the caller through the rdma-core binding as they do natively — a single request (the
/// binding's one-struct path) and a chain whose second request has more SGEs than the QP
/// allows (the general path: the first request is posted and completes).
#[test]
fn refused_posts_on_both_providers() {
    use mrkit::provider::{send_flags, SendWr, Sge, WrOpcode};
    let mut answers = Vec::new();
    for (provider, ctx) in both() {
        let pd = ctx.alloc_pd().unwrap();
        let cap = QpCap {
            max_send_sge: 2,
            ..QpCap::default()
        };
        let fresh: QueuePair = QueuePair::new(&pd, cap).unwrap();
        let (q1, q2): (QueuePair, QueuePair) = (
            QueuePair::new(&pd, cap).unwrap(),
            QueuePair::new(&pd, cap).unwrap(),
        );
        QueuePair::connect(&q1, &q2, A::REMOTE_WRITE).unwrap();
        let src = mr(&pd, 4096, 0x33);
        let dst = mr(&pd, 4096, 0);
        let sge = Sge {
            addr: src.info().iova,
            length: 8,
            lkey: src.lkey(),
        };
        let write = |wr_id: u64, sges: usize| {
            let mut w = SendWr::new(wr_id, WrOpcode::RdmaWrite);
            w.sg_list = vec![sge; sges];
            w.remote_addr = dst.info().iova;
            w.rkey = dst.rkey();
            w
        };
        let dev = ctx.provider();
        // One request on a QP that was never connected (RESET).
        let e = dev
            .post_send(fresh.raw_handles().qpn, &[write(1, 1)])
            .unwrap_err();
        let reset = (e.bad_wr, e.error.errno());
        // A chain: the second request has 3 SGEs where the QP allows 2.
        let h = q1.raw_handles();
        let e = dev
            .post_send(h.qpn, &[write(2, 1), write(3, 3)])
            .unwrap_err();
        let chain = (e.bad_wr, e.error.errno());
        let mut wcs = Vec::new();
        let deadline = std::time::Instant::now() + WAIT;
        while wcs.is_empty() && std::time::Instant::now() < deadline {
            dev.poll_cq(h.send_cq, &mut wcs, 16).unwrap();
        }
        assert_eq!(
            wcs.len(),
            1,
            "{provider}: the first request of the chain completes"
        );
        assert_eq!(
            (wcs[0].wr_id, wcs[0].status),
            (2, WcStatus::Success),
            "{provider}"
        );
        assert_eq!(dst.as_slice()[..8], [0x33; 8], "{provider}");
        // A zero-length request (no SGE) through the one-struct path is accepted.
        let mut empty = write(4, 0);
        empty.flags = send_flags::SIGNALED;
        dev.post_send(h.qpn, &[empty]).unwrap();
        wcs.clear();
        while wcs.is_empty() && std::time::Instant::now() < deadline {
            dev.poll_cq(h.send_cq, &mut wcs, 16).unwrap();
        }
        assert_eq!(
            (wcs[0].wr_id, wcs[0].status),
            (4, WcStatus::Success),
            "{provider}"
        );
        answers.push((provider, reset, chain));
    }
    let (native, rdma_core) = (answers[0], answers[1]);
    assert_eq!(native.1 .0, 0, "{native:?}");
    assert_eq!(native.2 .0, 1, "{native:?}");
    assert_eq!(
        (native.1, native.2),
        (rdma_core.1, rdma_core.2),
        "{answers:?}"
    );
}
