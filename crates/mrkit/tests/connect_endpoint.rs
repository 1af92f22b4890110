//! Endpoints and `QueuePair::connect_to` in one process: the binary and serde forms
//! (round trip, hostile bytes), connecting over the loopback link and over RoCEv2/UDP, the
//! QP left in RESET by a failed connect, and a dead peer noticed with the default options.
mod providers_util;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mrkit::{
    AccessFlags as A, Buffer, ConnectOpts, DeviceConfig, Endpoint, Errno, Mtu, QpCap, QpState,
    QueuePair, RemoteSlice, StatusModel, WcStatus,
};
use proptest::prelude::*;

fn mtu() -> impl Strategy<Value = Mtu> {
    prop_oneof![
        Just(Mtu::B256),
        Just(Mtu::B512),
        Just(Mtu::B1024),
        Just(Mtu::B2048),
        Just(Mtu::B4096)
    ]
}

fn unicast_ip() -> impl Strategy<Value = std::net::IpAddr> {
    prop_oneof![
        (1u8..=223, any::<[u8; 3]>()).prop_map(|(a, r)| [a, r[0], r[1], r[2]].into()),
        // Global unicast IPv6 (2000::/3), never IPv4-mapped.
        any::<[u16; 8]>().prop_map(|mut s| {
            s[0] = 0x2000 | (s[0] & 0x1fff);
            std::net::Ipv6Addr::from(s).into()
        }),
    ]
}

proptest! {
    #[test]
    fn endpoint_round_trips(qpn in 2u32..=0xFF_FFFE, psn in 0u32..=0xFF_FFFF, ip in unicast_ip(), mtu in mtu()) {
        let ep = Endpoint::new(qpn, psn, ip, mtu).unwrap();
        prop_assert_eq!(Endpoint::from_bytes(&ep.to_bytes()).unwrap(), ep);
        let json = serde_json::to_string(&ep).unwrap();
        prop_assert_eq!(serde_json::from_str::<Endpoint>(&json).unwrap(), ep);
        prop_assert_eq!((ep.qp_num(), ep.psn(), ep.ip(), ep.mtu()), (qpn, psn, ip, mtu));
    }

    #[test]
    fn hostile_bytes_are_einval_never_a_panic(b in proptest::collection::vec(any::<u8>(), 0..100)) {
        if let Err(e) = Endpoint::from_bytes(&b) {
            prop_assert_eq!(e.errno(), Errno::EINVAL);
        }
    }

    #[test]
    fn one_bad_field_is_einval(qpn in 2u32..=0xFF_FFFE, byte in 0usize..Endpoint::LEN, v in any::<u8>()) {
        let good = Endpoint::new(qpn, 5, "127.0.0.9".parse().unwrap(), Mtu::B4096).unwrap().to_bytes();
        let mut b = good;
        b[byte] = v;
        match Endpoint::from_bytes(&b) {
            Ok(e) => prop_assert_eq!(e.to_bytes(), b), // a value that is still valid
            Err(e) => prop_assert_eq!(e.errno(), Errno::EINVAL),
        }
    }

    #[test]
    fn remote_slice_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..40)) {
        match RemoteSlice::from_bytes(&b) {
            Ok(r) => prop_assert!(r.addr.checked_add(r.len).is_some()),
            Err(e) => prop_assert_eq!(e.errno(), Errno::EINVAL),
        }
    }
}

#[test]
fn malformed_endpoints_name_the_fault() {
    let good = Endpoint::new(0x11, 0x22, "127.0.0.9".parse().unwrap(), Mtu::B1024)
        .unwrap()
        .to_bytes();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("47 bytes", good[..47].to_vec()),
        ("49 bytes", [&good[..], &[0]].concat()),
        ("empty", vec![]),
        ("magic", {
            let mut b = good.to_vec();
            b[0] = b'X';
            b
        }),
        ("version", {
            let mut b = good.to_vec();
            b[4] = 2;
            b
        }),
        ("mtu 0", {
            let mut b = good.to_vec();
            b[5] = 0;
            b
        }),
        ("mtu 6", {
            let mut b = good.to_vec();
            b[5] = 6;
            b
        }),
        ("reserved", {
            let mut b = good.to_vec();
            b[7] = 1;
            b
        }),
        ("qpn 1", {
            let mut b = good.to_vec();
            b[8..12].copy_from_slice(&1u32.to_be_bytes());
            b
        }),
        ("qpn 2^24", {
            let mut b = good.to_vec();
            b[8..12].copy_from_slice(&(1u32 << 24).to_be_bytes());
            b
        }),
        ("multicast qpn", {
            let mut b = good.to_vec();
            b[8..12].copy_from_slice(&0xFF_FFFFu32.to_be_bytes());
            b
        }),
        ("psn 2^24", {
            let mut b = good.to_vec();
            b[12..16].copy_from_slice(&(1u32 << 24).to_be_bytes());
            b
        }),
        ("gid ::", {
            let mut b = good.to_vec();
            b[16..32].fill(0);
            b
        }),
        ("gid 0.0.0.0", {
            let mut b = good.to_vec();
            b[28..32].fill(0);
            b
        }),
        ("gid broadcast", {
            let mut b = good.to_vec();
            b[28..32].fill(255);
            b
        }),
        ("gid multicast", {
            let mut b = good.to_vec();
            b[28] = 224;
            b
        }),
    ];
    for (what, b) in cases {
        let e = Endpoint::from_bytes(&b).expect_err(what);
        assert_eq!(e.errno(), Errno::EINVAL, "{what}: {e}");
    }
    // serde input goes through the same checks.
    let bad = r#"{"qpn":1,"psn":0,"gid":"::ffff:127.0.0.1","mtu":"B4096"}"#;
    assert!(serde_json::from_str::<Endpoint>(bad).is_err());
    let bad = r#"{"qpn":17,"psn":0,"gid":"::","mtu":"B4096"}"#;
    assert!(serde_json::from_str::<Endpoint>(bad).is_err());
}

fn mr(pd: &mrkit::ProtectionDomain, fill: u8) -> mrkit::MemoryRegion {
    let mut m = pd
        .register(
            Buffer::new(8192).unwrap(),
            A::LOCAL_WRITE | A::REMOTE_READ | A::REMOTE_WRITE,
        )
        .unwrap();
    m.as_mut_slice().fill(fill);
    m
}

/// Two devices of one process; `strip` sends each endpoint without its loopback part, so
/// the QPs talk over RoCEv2/UDP (as two processes would).
fn read_between_two_devices(strip: bool) {
    let (c1, c2) = (providers_util::open(), providers_util::open());
    let (p1, p2) = (c1.alloc_pd().unwrap(), c2.alloc_pd().unwrap());
    let mut q1 = QueuePair::new(&p1, QpCap::default()).unwrap();
    let mut q2 = QueuePair::new(&p2, QpCap::default()).unwrap();
    let o1 = ConnectOpts {
        path_mtu: Mtu::B1024,
        ..Default::default()
    };
    let o2 = ConnectOpts::default();
    let wire = |e: Endpoint| {
        let e = if strip {
            Endpoint::new(e.qp_num(), e.psn(), e.ip(), e.mtu()).unwrap()
        } else {
            e
        };
        Endpoint::from_bytes(&e.to_bytes()).unwrap()
    };
    let (e1, e2) = (
        wire(q1.endpoint_for(&o1).unwrap()),
        wire(q2.endpoint_for(&o2).unwrap()),
    );
    q1.connect_to(&e2, &o1).unwrap();
    q2.connect_to(&e1, &o2).unwrap();
    let mut local = mr(&p1, 0);
    let remote = mr(&p2, 0x5a);
    // 8 KiB at the smaller MTU (1024): 8 packets, on both sides' agreed path MTU.
    let wc = q1
        .read(&mut local, 0..8192, remote.remote(0..8192).unwrap())
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert!(local.as_slice().iter().all(|&b| b == 0x5a));
    // Over UDP the READ request left as a datagram; over the loopback link none did.
    if !providers_util::needs_native("counts mrkit-soft's UDP datagrams") {
        let tx = c1.soft().unwrap().net_stats().tx_datagrams;
        assert_eq!(tx > 0, strip, "datagrams sent: {tx}");
    }
}

#[test]
fn connect_over_the_loopback_link() {
    if providers_util::needs_native(
        "mrkit0's in-process loopback link (an rdma-core QP connects over RoCEv2 only)",
    ) {
        return;
    }
    read_between_two_devices(false);
}

#[test]
fn connect_over_udp() {
    read_between_two_devices(true);
}

#[test]
fn connect_twice_is_einval_and_keeps_the_connection() {
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    let mut a = QueuePair::new(&pd, QpCap::default()).unwrap();
    let mut b = QueuePair::new(&pd, QpCap::default()).unwrap();
    let o = ConnectOpts::default();
    a.connect_to(&b.endpoint().unwrap(), &o).unwrap();
    b.connect_to(&a.endpoint().unwrap(), &o).unwrap();
    let e = a.connect_to(&b.endpoint().unwrap(), &o).unwrap_err();
    assert_eq!(e.errno(), Errno::EINVAL);
    assert_eq!(a.state().unwrap(), QpState::Rts);
    let mut local = mr(&pd, 0);
    let remote = mr(&pd, 7);
    let wc = a
        .read(&mut local, 0..64, remote.remote(0..64).unwrap())
        .unwrap();
    assert_eq!((wc.status, local.as_slice()[63]), (WcStatus::Success, 7));
}

#[test]
fn a_failed_connect_leaves_the_qp_in_reset_and_it_can_connect_again() {
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    let mut a = QueuePair::new(&pd, QpCap::default()).unwrap();
    let mut b = QueuePair::new(&pd, QpCap::default()).unwrap();
    // More outstanding READs than the device allows: refused at RTR (INIT went through).
    let huge = ConnectOpts {
        rd_atomic: u32::MAX,
        ..Default::default()
    };
    let e = a.connect_to(&b.endpoint().unwrap(), &huge).unwrap_err();
    assert_eq!(e.errno(), Errno::EINVAL, "{e}");
    assert_eq!(a.state().unwrap(), QpState::Reset);
    // Options out of range never reach the device.
    let bad = ConnectOpts {
        retry_cnt: 8,
        ..Default::default()
    };
    assert_eq!(
        a.connect_to(&b.endpoint().unwrap(), &bad)
            .unwrap_err()
            .errno(),
        Errno::EINVAL
    );
    let o = ConnectOpts::default();
    a.connect_to(&b.endpoint().unwrap(), &o).unwrap();
    b.connect_to(&a.endpoint().unwrap(), &o).unwrap();
    assert_eq!(a.state().unwrap(), QpState::Rts);
}

#[test]
fn an_explicit_psn_travels_in_the_endpoint() {
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    let mut a = QueuePair::new(&pd, QpCap::default()).unwrap();
    let mut b = QueuePair::new(&pd, QpCap::default()).unwrap();
    let oa = ConnectOpts {
        psn: Some(0xFF_FFF0), // wraps within the first message
        ..Default::default()
    };
    let ob = ConnectOpts {
        psn: Some(3),
        ..Default::default()
    };
    let (ea, eb) = (a.endpoint_for(&oa).unwrap(), b.endpoint_for(&ob).unwrap());
    assert_eq!((ea.psn(), eb.psn()), (0xFF_FFF0, 3));
    a.connect_to(&eb, &oa).unwrap();
    b.connect_to(&ea, &ob).unwrap();
    let src = mr(&pd, 0x33);
    let dst = mr(&pd, 0);
    let wc = a
        .write(&src, 0..8192, dst.remote(0..8192).unwrap())
        .unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert!(dst.as_slice().iter().all(|&b| b == 0x33));
    // A peer that was told the wrong PSN drops everything: the write cannot complete well.
    let mut c = QueuePair::new(&pd, QpCap::default()).unwrap();
    let mut d = QueuePair::new(&pd, QpCap::default()).unwrap();
    let ec = c.endpoint().unwrap().with_psn(100).unwrap(); // c will start at its own PSN
    let quick = ConnectOpts {
        timeout: 10,
        retry_cnt: 1,
        ..Default::default()
    };
    c.connect_to(&d.endpoint_for(&quick).unwrap(), &quick)
        .unwrap();
    d.connect_to(&ec, &quick).unwrap();
    let wc = c.write(&src, 0..64, dst.remote(0..64).unwrap()).unwrap();
    assert_ne!(wc.status, WcStatus::Success);
}

/// READ from a peer QP that is gone, with the default options, on a device with `model`:
/// the completion status and how long it took.
fn read_from_a_dead_peer(model: StatusModel) -> Option<(WcStatus, Duration)> {
    // The default model (hardware) is the drop-in's too; the other one (rxe) needs a device
    // of its own.
    let c1 = if model == StatusModel::default() {
        providers_util::open()
    } else {
        providers_util::open_with(
            DeviceConfig::rxe().status_model(model),
            &[("MRKIT_STATUS_MODEL", "rxe")],
        )?
    };
    let c2 = providers_util::open();
    let (p1, p2) = (c1.alloc_pd().unwrap(), c2.alloc_pd().unwrap());
    let mut q1 = QueuePair::new(&p1, QpCap::default()).unwrap();
    let mut q2 = QueuePair::new(&p2, QpCap::default()).unwrap();
    let o = ConnectOpts::default();
    let (e1, e2) = (q1.endpoint().unwrap(), q2.endpoint().unwrap());
    q1.connect_to(&e2, &o).unwrap();
    q2.connect_to(&e1, &o).unwrap();
    let remote = mr(&p2, 1).remote(0..64).unwrap();
    drop(q2); // the peer's QP is destroyed: nothing answers any more
    let mut local = mr(&p1, 0);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let t = Instant::now();
        let wc = q1.read(&mut local, 0..64, remote).unwrap();
        let _ = tx.send((wc.status, t.elapsed()));
    });
    Some(
        rx.recv_timeout(Duration::from_secs(30))
            .expect("a READ to a dead peer must end (RETRY_EXC_ERR), not hang"),
    )
}

#[test]
fn default_opts_end_a_dead_peer_in_the_hardware_model() {
    let Some((st, took)) = read_from_a_dead_peer(StatusModel::Hardware) else {
        return;
    };
    eprintln!("hardware model: {st:?} after {took:?}");
    assert_eq!(st, WcStatus::RetryExcErr);
}

#[test]
fn default_opts_end_a_dead_peer_in_the_rxe_model() {
    // With retry_cnt 7 (the old default) the rxe model resends forever: this hung.
    let Some((st, took)) = read_from_a_dead_peer(StatusModel::Rxe) else {
        return;
    };
    eprintln!("rxe model: {st:?} after {took:?}");
    assert_eq!(st, WcStatus::RetryExcErr);
}

#[test]
fn a_wildcard_device_address_cannot_be_an_endpoint() {
    // MRKIT_ADDR=0.0.0.0 (here through the builder, on a free port): bound, but unreachable.
    let cfg = DeviceConfig::rxe().udp_addr("0.0.0.0:0".parse().unwrap());
    let Some(ctx) = providers_util::open_with(cfg, &[("MRKIT_ADDR", "0.0.0.0:0")]) else {
        return;
    };
    let pd = ctx.alloc_pd().unwrap();
    let qp = QueuePair::new(&pd, QpCap::default()).unwrap();
    let e = qp.endpoint().unwrap_err();
    assert_eq!(e.errno(), Errno::EADDRNOTAVAIL, "{e}");
    assert!(e.to_string().contains("MRKIT_ADDR"), "{e}");
}
