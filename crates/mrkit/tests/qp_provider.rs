//! `QueuePair` runs over the provider interface alone: a provider that is not the embedded
//! device (here a wrapper that forwards every verb to `mrkit0` but answers `soft()` with
//! `None`, as a hardware provider would) carries the whole data path, blocking and pipelined.
mod providers_util;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use mrkit::provider::{AddressVector, PostError, QpAttr, QpInitAttr, RecvWr, SendWr, Wc};
use mrkit::{
    AccessFlags as A, Buffer, Context, DeviceAttr, MrInfo, Provider, QpCap, QpState, QueuePair,
    Result, WcStatus,
};
use mrkit_soft::UserMemory;

#[derive(Debug)]
struct Forward(mrkit_soft::Context);

impl Provider for Forward {
    fn name(&self) -> &str {
        "forward0"
    }
    fn query_device(&self) -> DeviceAttr {
        self.0.query_device()
    }
    fn alloc_pd(&self) -> Result<u32> {
        self.0.alloc_pd()
    }
    fn dealloc_pd(&self, pd: u32) -> Result<()> {
        self.0.dealloc_pd(pd)
    }
    fn reg_mr(&self, pd: u32, mem: UserMemory, iova: u64, access: A) -> Result<MrInfo> {
        self.0.reg_mr(pd, mem, iova, access)
    }
    fn dereg_mr(&self, lkey: u32) -> Result<()> {
        self.0.dereg_mr(lkey)
    }
    fn query_mr(&self, lkey: u32) -> Result<MrInfo> {
        self.0.query_mr(lkey)
    }
    fn create_comp_channel(&self) -> Result<u32> {
        Provider::create_comp_channel(&self.0)
    }
    fn destroy_comp_channel(&self, ch: u32) -> Result<()> {
        Provider::destroy_comp_channel(&self.0, ch)
    }
    fn comp_channel_fd(&self, ch: u32) -> Result<OwnedFd> {
        Provider::comp_channel_fd(&self.0, ch)
    }
    fn get_cq_event(&self, ch: u32, t: Option<Duration>) -> Result<Option<u32>> {
        Provider::get_cq_event(&self.0, ch, t)
    }
    fn create_cq(&self, cqe: u32, ch: Option<u32>) -> Result<u32> {
        Provider::create_cq(&self.0, cqe, ch)
    }
    fn destroy_cq(&self, cq: u32) -> Result<()> {
        Provider::destroy_cq(&self.0, cq)
    }
    fn poll_cq(&self, cq: u32, out: &mut Vec<Wc>, max: usize) -> Result<usize> {
        Provider::poll_cq(&self.0, cq, out, max)
    }
    fn req_notify_cq(&self, cq: u32, sol: bool) -> Result<()> {
        Provider::req_notify_cq(&self.0, cq, sol)
    }
    fn create_qp(&self, init: QpInitAttr) -> Result<(u32, QpCap)> {
        Provider::create_qp(&self.0, init)
    }
    fn destroy_qp(&self, qpn: u32) -> Result<()> {
        Provider::destroy_qp(&self.0, qpn)
    }
    fn modify_qp(&self, qpn: u32, attr: &QpAttr, mask: u32) -> Result<()> {
        Provider::modify_qp(&self.0, qpn, attr, mask)
    }
    fn query_qp(&self, qpn: u32) -> Result<QpAttr> {
        Provider::query_qp(&self.0, qpn)
    }
    fn post_send(&self, qpn: u32, wrs: &[SendWr]) -> std::result::Result<(), PostError> {
        Provider::post_send(&self.0, qpn, wrs)
    }
    fn post_recv(&self, qpn: u32, wrs: &[RecvWr]) -> std::result::Result<(), PostError> {
        Provider::post_recv(&self.0, qpn, wrs)
    }
    fn local_av(&self) -> Result<AddressVector> {
        Provider::local_av(&self.0)
    }
    // `soft()` keeps its default: None.
}

fn forward_ctx() -> Context {
    Context::from_provider(Arc::new(Forward(mrkit_soft::Context::open(
        mrkit::DeviceConfig::rxe(),
    ))))
}

#[test]
fn queue_pair_runs_on_a_provider_that_is_not_the_embedded_device() {
    if providers_util::needs_native(
        "a Provider of its own over mrkit-soft, or a device with its own UDP address",
    ) {
        return;
    }
    let (c1, c2) = (forward_ctx(), forward_ctx());
    assert!(c1.soft().is_none());
    let (p1, p2) = (c1.alloc_pd().unwrap(), c2.alloc_pd().unwrap());
    let q1 = QueuePair::new(&p1, QpCap::default()).unwrap();
    let q2 = QueuePair::new(&p2, QpCap::default()).unwrap();
    QueuePair::connect(&q1, &q2, A::REMOTE_WRITE | A::REMOTE_READ).unwrap();
    assert_eq!(q1.state().unwrap(), QpState::Rts);
    let mut src = p1
        .register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    src.as_mut_slice().fill(0x5a);
    let dst = p2
        .register(
            Buffer::new(4096).unwrap(),
            A::LOCAL_WRITE | A::REMOTE_WRITE | A::REMOTE_READ,
        )
        .unwrap();
    let wc = q1
        .write(&src, 0..4096, dst.remote(0..4096).unwrap())
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert!(dst.as_slice().iter().all(|&b| b == 0x5a));
    // Pipelined, with the buffer back.
    let back = p1
        .register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    let t = q1
        .post_read(back, 0..4096, dst.remote(0..4096).unwrap())
        .unwrap();
    let c = q1.wait(Duration::from_secs(60)).unwrap();
    assert_eq!(c.wr_id(), t.wr_id());
    let (_, buf) = c.into_result().unwrap();
    assert!(buf.as_slice().unwrap().iter().all(|&b| b == 0x5a));
    // SEND/RECV.
    let rx = p2
        .register(Buffer::new(64).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    let _ = q2.post_recv(rx, 0..64).unwrap();
    q1.send(&src, 0..10).unwrap();
    assert_eq!(q2.wait(Duration::from_secs(60)).unwrap().wc.byte_len, 10);
}

/// A provider without the QP verbs gets EOPNOTSUPP, not a panic.
#[test]
fn a_provider_without_queue_pairs_says_eopnotsupp() {
    if providers_util::needs_native(
        "a Provider of its own over mrkit-soft, or a device with its own UDP address",
    ) {
        return;
    }
    #[derive(Debug)]
    struct RegOnly(mrkit_soft::Context);
    impl Provider for RegOnly {
        fn name(&self) -> &str {
            "regonly0"
        }
        fn query_device(&self) -> DeviceAttr {
            self.0.query_device()
        }
        fn alloc_pd(&self) -> Result<u32> {
            self.0.alloc_pd()
        }
        fn dealloc_pd(&self, pd: u32) -> Result<()> {
            self.0.dealloc_pd(pd)
        }
        fn reg_mr(&self, pd: u32, mem: UserMemory, iova: u64, access: A) -> Result<MrInfo> {
            self.0.reg_mr(pd, mem, iova, access)
        }
        fn dereg_mr(&self, lkey: u32) -> Result<()> {
            self.0.dereg_mr(lkey)
        }
    }
    let c = Context::from_provider(Arc::new(RegOnly(mrkit_soft::Context::open(
        mrkit::DeviceConfig::rxe(),
    ))));
    let pd = c.alloc_pd().unwrap();
    let e = QueuePair::new(&pd, QpCap::default()).unwrap_err();
    assert_eq!(e.errno(), mrkit::Errno::EOPNOTSUPP);
}

/// `QueuePair::modify_qp` drives RESET → INIT → RTR → RTS against a peer named by GID (the
/// RoCEv2 UDP link on 127.0.0.0/8), as a two-process connect does after exchanging QP number,
/// PSN and GID: the provider binds its UDP port before the peer's traffic can arrive.
#[test]
fn modify_qp_connects_over_the_udp_link_by_gid() {
    if providers_util::needs_native(
        "a Provider of its own over mrkit-soft, or a device with its own UDP address",
    ) {
        return;
    }
    use mrkit::provider::{attr_mask as m, AddressVector};
    let ip = |first: u8| -> std::net::IpAddr {
        mrkit_testsupport::loopback_addr(first).parse().unwrap()
    };
    let open = |ip| Context::open(mrkit::DeviceConfig::rxe().udp_addr((ip, 4791).into()));
    let (ip1, ip2) = (ip(41), ip(42));
    let (c1, c2) = (open(ip1), open(ip2));
    let (p1, p2) = (c1.alloc_pd().unwrap(), c2.alloc_pd().unwrap());
    let q1 = QueuePair::new(&p1, QpCap::default()).unwrap();
    let q2 = QueuePair::new(&p2, QpCap::default()).unwrap();
    // What each side would send the other: QP number, first PSN, GID (as its IP address).
    // Nothing has bound either device's UDP port yet: modify_qp must, before RTR.
    assert!(c1.soft().unwrap().udp_addr().is_none());
    let (e1, e2) = ((q1.qp_num(), 100, ip1), (q2.qp_num(), 200, ip2));
    for (q, me, peer) in [(&q1, e1, e2), (&q2, e2, e1)] {
        let mut at = QpAttr {
            qp_state: QpState::Init as u32,
            qp_access_flags: A::REMOTE_WRITE,
            port_num: 1,
            ..QpAttr::default()
        };
        q.modify_qp(&at, m::STATE | m::PKEY_INDEX | m::PORT | m::ACCESS_FLAGS)
            .unwrap();
        at.qp_state = QpState::Rtr as u32;
        at.ah_attr = AddressVector {
            dest_node: 0,
            dgid: Some(peer.2),
            port_num: 1,
        };
        at.dest_qp_num = peer.0;
        at.rq_psn = peer.1;
        q.modify_qp(
            &at,
            m::STATE
                | m::AV
                | m::PATH_MTU
                | m::DEST_QPN
                | m::RQ_PSN
                | m::MAX_DEST_RD_ATOMIC
                | m::MIN_RNR_TIMER,
        )
        .unwrap();
        at.qp_state = QpState::Rts as u32;
        at.sq_psn = me.1;
        q.modify_qp(
            &at,
            m::STATE | m::TIMEOUT | m::RETRY_CNT | m::RNR_RETRY | m::SQ_PSN | m::MAX_QP_RD_ATOMIC,
        )
        .unwrap();
    }
    let mut src = p1
        .register(Buffer::new(8192).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    src.as_mut_slice().fill(0xc3);
    let dst = p2
        .register(Buffer::new(8192).unwrap(), A::LOCAL_WRITE | A::REMOTE_WRITE)
        .unwrap();
    let wc = q1
        .write(&src, 0..8192, dst.remote(0..8192).unwrap())
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert!(dst.as_slice().iter().all(|&b| b == 0xc3));
    assert!(
        c1.soft().unwrap().net_stats().tx_datagrams > 0,
        "it went over UDP"
    );
    let gid = std::net::Ipv6Addr::from(c2.provider().query_gid().unwrap());
    assert_eq!(gid.to_ipv4_mapped().map(std::net::IpAddr::V4), Some(ip2));
}
