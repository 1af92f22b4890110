//! The TCP handshake (`mrkit::tcp`) in one process: private data both ways, and hostile or
//! broken peers on either side — garbage, too much, nothing, a trickle, a hang-up mid-way,
//! a refusal — each a clear error, no QP left behind, and the listener serving on.
mod providers_util;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mrkit::tcp::{self, ConnectError, Connection, HandshakeOpts, Listener, MAX_PRIVATE_DATA};
use mrkit::{
    AccessFlags as A, Buffer, ConnectOpts, Context, Endpoint, Errno, Mtu, QpCap, QpState,
    RemoteSlice, WcStatus,
};

fn qps(ctx: &Context) -> usize {
    ctx.soft().unwrap().resource_counts().qps
}

/// A handshake message as the wire carries it.
fn msg(kind: u8, body: &[u8], announced: u16) -> Vec<u8> {
    let mut m = b"MRKC".to_vec();
    m.push(1);
    m.push(kind);
    m.extend_from_slice(&announced.to_be_bytes());
    m.extend_from_slice(body);
    m
}

fn fake_hello() -> Vec<u8> {
    let ep = Endpoint::new(0x20, 1, "127.0.0.9".parse().unwrap(), Mtu::B4096).unwrap();
    msg(1, &ep.to_bytes(), 0)
}

fn quick() -> HandshakeOpts {
    HandshakeOpts {
        // Short, so the silent and trickling peers end quickly; long enough for a good
        // handshake on a loaded machine.
        timeout: Duration::from_secs(1),
        accept_timeout: Some(Duration::from_secs(20)),
        ..Default::default()
    }
}

#[test]
fn handshake_carries_private_data_and_the_qps_work() {
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let sctx = providers_util::open();
    let spd = sctx.alloc_pd().unwrap();
    let mut table = spd
        .register(Buffer::new(4096).unwrap(), A::REMOTE_READ)
        .unwrap();
    table.as_mut_slice()[..5].copy_from_slice(b"value");
    let slice = table.remote(0..4096).unwrap();
    let server = std::thread::spawn(move || {
        let opts = HandshakeOpts {
            private_data: slice.to_bytes().to_vec(),
            ..Default::default()
        };
        let mut c = listener.accept(&spd, QpCap::default(), &opts).unwrap();
        assert_eq!(c.private_data, b"client");
        assert_eq!(c.qp.state().unwrap(), QpState::Rts);
        // Serve until the client hangs up.
        let mut b = [0u8; 1];
        assert_eq!(c.stream.read(&mut b).unwrap(), 0);
        drop(table);
    });
    let cctx = providers_util::open();
    let cpd = cctx.alloc_pd().unwrap();
    let opts = HandshakeOpts {
        private_data: b"client".to_vec(),
        ..Default::default()
    };
    let c = tcp::connect(addr, &cpd, QpCap::default(), &opts).unwrap();
    assert_eq!(c.peer, addr);
    let remote = RemoteSlice::from_bytes(&c.private_data).unwrap();
    let mut local = cpd
        .register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    let wc = c.qp.read(&mut local, 0..5, remote).unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    assert_eq!(&local.as_slice()[..5], b"value");
    drop(c);
    server.join().unwrap();
}

/// A listener serving `n` clients on a thread; each result comes back on the channel (a
/// connection is kept until the test ends).
fn serve(
    n: usize,
    opts: HandshakeOpts,
) -> (
    SocketAddr,
    Context,
    mpsc::Receiver<Result<Connection, ConnectError>>,
) {
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for _ in 0..n {
            let r = listener.accept(&pd, QpCap::default(), &opts);
            if tx.send(r).is_err() {
                return;
            }
        }
    });
    (addr, ctx, rx)
}

fn next(rx: &mpsc::Receiver<Result<Connection, ConnectError>>) -> Result<Connection, ConnectError> {
    rx.recv_timeout(Duration::from_secs(20))
        .expect("the server answers within its deadline")
}

/// What a raw client reads back until the server closes (at most 1 KiB, 5 s).
fn read_reply(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut out = Vec::new();
    let mut b = [0u8; 1024];
    while let Ok(n) = s.read(&mut b) {
        if n == 0 || out.len() > 1024 {
            break;
        }
        out.extend_from_slice(&b[..n]);
    }
    out
}

/// A REJECT's reason, if `reply` is one.
fn reject_reason(reply: &[u8]) -> Option<String> {
    (reply.len() >= 8 && reply[..4] == *b"MRKC" && reply[5] == 3)
        .then(|| String::from_utf8_lossy(&reply[8..]).into_owned())
}

#[test]
fn bad_clients_get_clear_errors_and_the_listener_serves_on() {
    if providers_util::needs_native("counts mrkit-soft's QPs (no QP left behind)") {
        return;
    }
    let (addr, ctx, rx) = serve(9, quick());
    let connect = || TcpStream::connect(addr).unwrap();

    // Garbage: refused at once, with a REJECT that says why.
    let mut s = connect();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let e = next(&rx).unwrap_err();
    assert!(matches!(e, ConnectError::Protocol { .. }), "{e}");
    assert!(e.to_string().contains("not an mrkit handshake"), "{e}");
    let why = reject_reason(&read_reply(&mut s)).expect("a REJECT");
    assert!(why.contains("not an mrkit handshake"), "{why}");
    assert_eq!(qps(&ctx), 0);

    // Too much: a body over 256 bytes is refused from its header, never read.
    let mut s = connect();
    let mut big = msg(1, &[0u8; 48], u16::MAX);
    big.extend(std::iter::repeat_n(7u8, 60_000));
    let _ = s.write_all(&big); // the server may close before all of it is sent
    let e = next(&rx).unwrap_err();
    assert!(e.to_string().contains("at most 256"), "{e}");
    assert_eq!(qps(&ctx), 0);

    // Nothing at all: the handshake deadline.
    let t = Instant::now();
    let _s = connect();
    let e = next(&rx).unwrap_err();
    assert!(e.is_timeout(), "{e}");
    eprintln!("silent client refused after {:?}", t.elapsed());

    // A trickle (one byte of a valid HELLO every 50 ms): the deadline is for the whole
    // handshake, not for each read.
    let mut s = connect();
    let hello = fake_hello();
    let trickle = std::thread::spawn(move || {
        for b in hello {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let e = next(&rx).unwrap_err();
    assert!(e.is_timeout(), "{e}");
    trickle.join().unwrap();
    assert_eq!(qps(&ctx), 0);

    // A hang-up after its HELLO: the server had made and connected a QP; it is destroyed.
    let mut s = connect();
    s.write_all(&fake_hello()).unwrap();
    let mut h = [0u8; 8];
    s.read_exact(&mut h).unwrap(); // the server's HELLO: its QP exists now
    assert_eq!(&h[..4], b"MRKC");
    drop(s);
    let e = next(&rx).unwrap_err();
    assert!(matches!(e, ConnectError::Closed { .. }), "{e}");
    assert_eq!(qps(&ctx), 0, "the QP made for the client is gone");

    // Another version of the handshake: refused with the reason.
    let mut s = connect();
    let mut v2 = fake_hello();
    v2[4] = 2;
    s.write_all(&v2).unwrap();
    let e = next(&rx).unwrap_err();
    assert!(e.to_string().contains("version 2"), "{e}");
    let why = reject_reason(&read_reply(&mut s)).expect("a REJECT");
    assert!(why.contains("version 2"), "{why}");

    // Out of turn: READY first.
    let mut s = connect();
    s.write_all(&msg(2, &[], 0)).unwrap();
    let e = next(&rx).unwrap_err();
    assert!(e.to_string().contains("out of turn"), "{e}");

    // An invalid endpoint (QP number 1).
    let mut s = connect();
    let mut bad = fake_hello();
    bad[8 + 8..8 + 12].copy_from_slice(&1u32.to_be_bytes());
    s.write_all(&bad).unwrap();
    let e = next(&rx).unwrap_err();
    assert!(e.to_string().contains("endpoint is invalid"), "{e}");
    assert_eq!(qps(&ctx), 0);

    // And a good client is served.
    let cctx = providers_util::open();
    let cpd = cctx.alloc_pd().unwrap();
    let c = tcp::connect(addr, &cpd, QpCap::default(), &HandshakeOpts::default()).unwrap();
    let sc = next(&rx).unwrap();
    assert_eq!(sc.remote.qp_num(), c.qp.qp_num());
    assert_eq!(c.remote.qp_num(), sc.qp.qp_num());
    assert_eq!(qps(&ctx), 1);
}

/// A raw server on a thread: accepts one client and runs `f` on it.
fn raw_server(f: impl FnOnce(TcpStream) + Send + 'static) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        f(s)
    });
    addr
}

#[test]
fn bad_servers_give_the_client_clear_errors_and_leave_no_qp() {
    if providers_util::needs_native("counts mrkit-soft's QPs (no QP left behind)") {
        return;
    }
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    let go = |addr: SocketAddr| tcp::connect(addr, &pd, QpCap::default(), &quick()).unwrap_err();

    // Nobody listening.
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let e = go(dead);
    assert!(matches!(e, ConnectError::Io { .. }), "{e}");

    // A server that never answers.
    let addr = raw_server(|s| {
        std::thread::sleep(Duration::from_secs(10));
        drop(s)
    });
    let t = Instant::now();
    let e = go(addr);
    assert!(e.is_timeout(), "{e}");
    // The 1 s deadline, not the server, ended it (the server holds on for 10 s).
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    assert_eq!(qps(&ctx), 0);

    // A server that answers garbage.
    let addr = raw_server(|mut s| {
        let _ = s.write_all(b"SSH-2.0-OpenSSH_9.2\r\n");
        std::thread::sleep(Duration::from_millis(500));
    });
    let e = go(addr);
    assert!(matches!(e, ConnectError::Protocol { .. }), "{e}");
    assert_eq!(qps(&ctx), 0);

    // A server that hangs up after its HELLO, before READY.
    let addr = raw_server(|mut s| {
        let mut h = [0u8; 8 + 48];
        s.read_exact(&mut h).unwrap();
        s.write_all(&fake_hello()).unwrap();
        let mut r = [0u8; 8];
        let _ = s.read_exact(&mut r); // the client's READY
    });
    let e = go(addr);
    assert!(matches!(e, ConnectError::Closed { .. }), "{e}");
    assert_eq!(qps(&ctx), 0);

    // A server that refuses (its options are invalid): the client learns why.
    let (addr, sctx, rx) = serve(
        1,
        HandshakeOpts {
            connect: ConnectOpts {
                retry_cnt: 8,
                ..Default::default()
            },
            ..quick()
        },
    );
    let e = go(addr);
    match &e {
        ConnectError::Rejected(why) => assert!(why.contains("retry_cnt 8"), "{why}"),
        e => panic!("expected a refusal, got {e}"),
    }
    let se = next(&rx).unwrap_err();
    assert!(
        matches!(&se, ConnectError::Local(l) if l.errno() == Errno::EINVAL),
        "{se}"
    );
    assert_eq!((qps(&ctx), qps(&sctx)), (0, 0));

    // Too much private data: refused before anything is sent.
    let big = HandshakeOpts {
        private_data: vec![0; MAX_PRIVATE_DATA + 1],
        ..quick()
    };
    let e = tcp::connect(dead, &pd, QpCap::default(), &big).unwrap_err();
    assert!(
        matches!(&e, ConnectError::Local(l) if l.errno() == Errno::EINVAL),
        "{e}"
    );
}

#[test]
fn accept_waits_at_most_its_timeout() {
    let listener = Listener::bind("127.0.0.1:0").unwrap();
    let pd = providers_util::open().alloc_pd().unwrap();
    let opts = HandshakeOpts {
        accept_timeout: Some(Duration::from_millis(200)),
        ..Default::default()
    };
    let e = listener.accept(&pd, QpCap::default(), &opts).unwrap_err();
    assert!(e.is_timeout(), "{e}");
    // Private data at the limit is fine.
    let (addr, _sctx, rx) = serve(1, HandshakeOpts::default());
    let full = HandshakeOpts {
        private_data: vec![0xab; MAX_PRIVATE_DATA],
        ..Default::default()
    };
    let c = tcp::connect(addr, &pd, QpCap::default(), &full).unwrap();
    let s = next(&rx).unwrap();
    assert_eq!(s.private_data, vec![0xab; MAX_PRIVATE_DATA]);
    assert!(c.private_data.is_empty());
}
