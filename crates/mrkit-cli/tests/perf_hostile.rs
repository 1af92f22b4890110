//! `mrkit perf --server` against hostile and careless clients: malformed handshakes and
//! out-of-range hellos, endless and oversized messages, silent clients, clients that vanish
//! mid-exchange, many sequential clients (every resource torn down: the server reports its
//! live objects after each), and a WRITE to a finished client's old rkey (refused with a
//! remote access error).
//!
//! Each test runs with the server on the embedded mrkit0 and again on the drop-in's mrkit0
//! through the rdma-core provider (`--device rdma-core:mrkit0`) where the server's answers do
//! not depend on mrkit0's own object counts. The RDMA clients here are built in-process with
//! the safe `mrkit` API (`mrkit::tcp` and a `QueuePair`) on either device.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mrkit::tcp::{self, HandshakeOpts};
use mrkit::{AccessFlags, ConnectOpts, Endpoint, Mtu, QpCap, RemoteSlice, WcStatus};
use serde_json::{json, Value};

mod support;
use support::{drop_in_dir, Dev};

struct Server {
    child: Child,
    /// The server's stderr, in a private temporary directory (removed on drop).
    log: PathBuf,
    _scratch: tempfile::TempDir,
    addr: String,
    port: u16,
    dev: Dev,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(dev: Dev, dir: &Path, role: u8, extra: &[&str]) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = addr(role);
        let scratch = tempfile::Builder::new()
            .prefix("mrkit-perf-hostile-")
            .tempdir()
            .unwrap();
        let log = scratch.path().join(format!("server-{role}.log"));
        let mut c = Command::new(env!("CARGO_BIN_EXE_mrkit"));
        c.args(["perf", "--server", "--port", &port.to_string()])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        dev.apply(&mut c, &addr, dir);
        let child = c.spawn().unwrap();
        let mut s = Server {
            child,
            log,
            _scratch: scratch,
            addr,
            port,
            dev,
        };
        let end = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(s.sock()).is_err() {
            assert!(
                s.child.try_wait().unwrap().is_none(),
                "server exited: {}",
                s.stderr()
            );
            assert!(Instant::now() < end, "server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        // That probe connection was a client too.
        s.wait_done(1);
        s
    }

    fn sock(&self) -> SocketAddr {
        SocketAddr::new(self.addr.parse().unwrap(), self.port)
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn done_lines(&self) -> Vec<String> {
        self.stderr()
            .lines()
            .filter(|l| l.contains(" done; live: "))
            .map(str::to_string)
            .collect()
    }

    /// Wait until `n` clients finished; the server must still run.
    fn wait_done(&mut self, n: usize) {
        let end = Instant::now() + Duration::from_secs(60);
        while self.done_lines().len() < n {
            assert!(
                self.child.try_wait().unwrap().is_none(),
                "server died: {}",
                self.stderr()
            );
            assert!(Instant::now() < end, "server stuck: {}", self.stderr());
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "{}",
            self.stderr()
        );
    }

    /// Every finished client left nothing behind (mrkit0 counts its objects; the drop-in's
    /// device, behind the C ABI, does not report them to the server).
    fn assert_all_torn_down(&self) {
        for l in self.done_lines() {
            let want = match self.dev {
                Dev::Native => "live: pd 0 mr 0 qp 0 cq 0 mw 0, pinned 0 B, memlock 0 pages",
                Dev::DropIn => "live: not counted by mrkit0 (mrkit0 counts its objects)",
            };
            assert!(l.ends_with(want), "{l}");
        }
    }
}

/// Distinct 127.x.y.z addresses per test process and role.
fn addr(role: u8) -> String {
    mrkit_testsupport::loopback_addr(150 + role)
}

/// Send raw bytes as a client and return what the server answered before closing.
fn raw_client(s: &Server, bytes: &[u8]) -> Vec<u8> {
    let mut c = TcpStream::connect(s.sock()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = c.write_all(bytes);
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    out
}

/// A handshake message as `mrkit::tcp` frames it: magic, version 1, kind, body length.
fn frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut m = b"MRKC".to_vec();
    m.extend_from_slice(&[1, kind]);
    m.extend_from_slice(&(body.len() as u16).to_be_bytes());
    m.extend_from_slice(body);
    m
}

/// A client HELLO with endpoint bytes `ep` and private data `private`.
fn hello_msg(ep: &[u8], private: &[u8]) -> Vec<u8> {
    let mut m = frame(1, private);
    m.truncate(8);
    m.extend_from_slice(ep);
    m.extend_from_slice(private);
    m
}

/// A well-formed endpoint of a QP that does not exist.
fn some_endpoint() -> [u8; 48] {
    Endpoint::new(77, 0, "127.0.0.9".parse().unwrap(), Mtu::B4096)
        .unwrap()
        .to_bytes()
}

/// Whether the server's whole answer is one REJECT (never a HELLO).
fn is_reject(answer: &[u8]) -> bool {
    answer.len() >= 8 && answer[0..4] == *b"MRKC" && answer[5] == 3
}

/// An in-process RDMA client of the server.
struct Peer {
    conn: tcp::Connection,
    mr: mrkit::MemoryRegion,
    reader: BufReader<TcpStream>,
    /// The server's hello.
    server: Value,
}

impl Peer {
    fn connect(s: &Server, ctx: &mrkit::Context, size: u64) -> Peer {
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd
            .register(
                mrkit::Buffer::new(2 * size as usize).unwrap(),
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .unwrap();
        let hello = json!({
            "addr": mr.info().iova, "rkey": mr.rkey(),
            "len": 2 * size, "op": "write", "size": size, "seed": 7,
        });
        let opts = HandshakeOpts {
            // A refused WRITE completes at once (NAK); an unanswered one after 4 tries of
            // 67 ms (7 would retry forever).
            connect: ConnectOpts {
                timeout: 14,
                retry_cnt: 3,
                ..ConnectOpts::default()
            },
            private_data: hello.to_string().into_bytes(),
            timeout: Duration::from_secs(30),
            ..HandshakeOpts::default()
        };
        let conn = tcp::connect(s.sock(), &pd, QpCap::default(), &opts).unwrap();
        let server: Value = serde_json::from_slice(&conn.private_data).unwrap();
        conn.stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut reader = BufReader::new(conn.stream.try_clone().unwrap());
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "\"ready\"");
        Peer {
            conn,
            mr,
            reader,
            server,
        }
    }

    /// One signaled WRITE of `len` bytes from our buffer to `(raddr, rkey)`; its status.
    fn write(&self, raddr: u64, rkey: u32, len: u32) -> WcStatus {
        let remote = RemoteSlice {
            addr: raddr,
            len: u64::from(len),
            rkey,
        };
        self.conn
            .qp
            .write(&self.mr, 0..u64::from(len), remote)
            .unwrap()
            .status
    }

    fn server_buf(&self) -> (u64, u32) {
        (
            self.server["addr"].as_u64().unwrap(),
            self.server["rkey"].as_u64().unwrap() as u32,
        )
    }

    /// Finish the exchange: our verdict, the server's error count.
    fn finish(mut self) -> u64 {
        writeln!(self.conn.stream, "\"done\"").unwrap();
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        line.trim().parse().unwrap()
    }
}

/// A client device on `dev` at an address of `role` (offset `n`) for the native mrkit0.
fn device(dev: Dev, dir: &Path, role: u8, n: u8) -> mrkit::Context {
    let a = addr(role);
    let mut parts: Vec<u8> = a.split('.').map(|p| p.parse().unwrap()).collect();
    parts[3] = parts[3].wrapping_add(n).max(1);
    let ip = format!("{}.{}.{}.{}", parts[0], parts[1], parts[2], parts[3]);
    dev.open(&ip, dir)
}

/// The private data of a client's hello (`mrkit perf`'s JSON).
fn hello(size: Value) -> Value {
    json!({"addr": 4096, "rkey": 5, "len": 8192, "op": "write", "size": size, "seed": 1})
}

fn server_survives_hostile_clients(dev: Dev, role: u8) {
    let dir = drop_in_dir();
    let mut s = Server::start(dev, dir.path(), role, &["--client-timeout", "1"]);
    let mut n = 1;
    let ep = some_endpoint();
    let with = |private: Value| hello_msg(&ep, private.to_string().as_bytes());
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"this is not json\n".to_vec()),
        ("empty line", b"\n".to_vec()),
        ("endless line", vec![b'{'; 1 << 20]),
        ("sends nothing", Vec::new()),
        ("version 2", {
            let mut m = hello_msg(&ep, b"{}");
            m[4] = 2;
            m
        }),
        ("READY first", frame(2, b"")),
        ("unknown kind", frame(9, b"")),
        ("300-byte body", hello_msg(&ep, &[b' '; 300])),
        ("huge size", with(hello(json!(u64::MAX)))),
        ("size 2^40", with(hello(json!(1u64 << 40)))),
        ("zero size", with(hello(json!(0)))),
        ("negative size", with(hello(json!(-1)))),
        (
            "size overflows u64",
            hello_msg(&ep, b"{\"size\": 18446744073709551616}"),
        ),
        ("float size", with(hello(json!(1.5)))),
        ("not json", hello_msg(&ep, b"this is not json")),
        ("no private data", hello_msg(&ep, b"")),
        ("unknown field", {
            let mut h = hello(json!(64));
            h["extra"] = json!(1);
            with(h)
        }),
        ("absurd SEND counts", {
            let mut h = hello(json!(64));
            h["op"] = json!("send");
            h["echo"] = json!(u32::MAX);
            h["bulk"] = json!(u32::MAX);
            with(h)
        }),
        ("IPv6 peer of an IPv4 server", {
            let v6 = Endpoint::new(77, 0, "::1".parse().unwrap(), Mtu::B4096).unwrap();
            hello_msg(&v6.to_bytes(), hello(json!(64)).to_string().as_bytes())
        }),
    ];
    for (field, bad) in [
        ("len", json!(0)),
        ("addr", json!(u64::MAX)),
        ("seed", json!(300)),
        ("op", json!("erase")),
    ] {
        let mut h = hello(json!(64));
        h[field] = bad;
        cases.push(("bad field", with(h)));
    }
    let mut atomic = hello(json!(4096));
    atomic["op"] = json!("atomic");
    cases.push(("atomic of 4096 bytes", with(atomic)));
    // Endpoints out of range: QP number 0 and 2^24, a 25-bit PSN, unusable GIDs.
    let mut bad_eps: Vec<[u8; 48]> = Vec::new();
    for qpn in [0u32, 1 << 24] {
        let mut e = ep;
        e[8..12].copy_from_slice(&qpn.to_be_bytes());
        bad_eps.push(e);
    }
    let mut e = ep;
    e[12..16].copy_from_slice(&(1u32 << 24).to_be_bytes());
    bad_eps.push(e);
    for ip in ["0.0.0.0", "224.0.0.1"] {
        let mut e = ep;
        let v4: std::net::Ipv4Addr = ip.parse().unwrap();
        e[16..32].copy_from_slice(&v4.to_ipv6_mapped().octets());
        bad_eps.push(e);
    }
    for e in &bad_eps {
        cases.push((
            "bad endpoint",
            hello_msg(e, hello(json!(64)).to_string().as_bytes()),
        ));
    }
    for (what, bytes) in &cases {
        let answer = raw_client(&s, bytes);
        n += 1;
        s.wait_done(n);
        // The server refuses with a REJECT (or closes before the client could read it, when
        // it hung up on unread bytes): never a HELLO, never a QP for this client.
        assert!(
            answer.is_empty() || is_reject(&answer),
            "{what}: server answered {answer:?}"
        );
    }
    let err = s.stderr();
    for want in [
        "size 18446744073709551615 outside 1 ..=",
        "not an mrkit handshake message",
        "announces a 300-byte body",
        "asked for 4294967295 echoes",
        "atomic size must be 8",
        "unknown field",
        "version 2 is not supported",
        "out of turn",
        "is not a unicast peer",
    ] {
        assert!(err.contains(want), "{want:?} missing: {err}");
    }

    // A REJECT carries the reason to a client that follows the handshake.
    let ctx = device(dev, dir.path(), role, 1);
    let pd = ctx.alloc_pd().unwrap();
    let opts = HandshakeOpts {
        private_data: hello(json!(1u64 << 40)).to_string().into_bytes(),
        ..HandshakeOpts::default()
    };
    let e = tcp::connect(s.sock(), &pd, QpCap::default(), &opts).unwrap_err();
    assert!(
        matches!(&e, tcp::ConnectError::Rejected(r) if r.contains("outside 1 ..=")),
        "{e}"
    );
    n += 1;
    s.wait_done(n);

    // A silent client: dropped after --client-timeout, the next client is served.
    let t = Instant::now();
    let mut silent = TcpStream::connect(s.sock()).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut answer = Vec::new();
    let _ = silent.read_to_end(&mut answer);
    assert!(
        is_reject(&answer),
        "the server refuses a silent client: {answer:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(20));
    n += 1;
    s.wait_done(n);
    assert!(s.stderr().contains("timed out after 1s"), "{}", s.stderr());

    // A valid hello, then the client vanishes (resources were allocated: torn down).
    let p = Peer::connect(&s, &ctx, 4096);
    drop(p);
    n += 1;
    s.wait_done(n);

    // Still serving: a real client measures with verified data.
    let mut c = Command::new(env!("CARGO_BIN_EXE_mrkit"));
    c.args(["perf", "--client", &s.addr, "--port", &s.port.to_string()])
        .args(["--op", "write", "--size", "4096", "--iters", "50", "--json"]);
    dev.apply(&mut c, &addr(role + 5), dir.path());
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["errors"], 0);
    n += 1;
    s.wait_done(n);
    s.assert_all_torn_down();
}

#[test]
fn server_survives_hostile_clients_mrkit0() {
    server_survives_hostile_clients(Dev::Native, 0);
}

#[test]
fn server_survives_hostile_clients_rdma_core() {
    server_survives_hostile_clients(Dev::DropIn, 10);
}

/// 50 sequential clients on `client`: after each, the server (on mrkit0, which counts them)
/// holds no PD, MR, QP, CQ or pinned page.
fn server_objects_stay_flat_across_clients(client: Dev, role: u8) {
    let dir = drop_in_dir();
    let mut s = Server::start(Dev::Native, dir.path(), role, &[]);
    let ctx = device(client, dir.path(), role, 1);
    for i in 0..50u32 {
        let p = Peer::connect(&s, &ctx, 4096);
        let (raddr, rkey) = p.server_buf();
        assert_eq!(p.write(raddr, rkey, 4096), WcStatus::Success, "client {i}");
        assert_eq!(p.finish(), 0);
        s.wait_done(2 + i as usize);
    }
    let lines = s.done_lines();
    assert_eq!(lines.len(), 51);
    s.assert_all_torn_down();
    // Our side released everything too (where the device counts: mrkit0 in this process).
    if let Some(soft) = ctx.soft() {
        let r = soft.resource_counts();
        assert_eq!((r.pds, r.mrs, r.qps, r.cqs), (0, 0, 0, 0));
    }
}

#[test]
fn server_objects_stay_flat_across_clients_mrkit0() {
    server_objects_stay_flat_across_clients(Dev::Native, 1);
}

#[test]
fn server_objects_stay_flat_across_rdma_core_clients() {
    server_objects_stay_flat_across_clients(Dev::DropIn, 11);
}

/// A WRITE to the rkey of a client that finished is refused, never lands: through the
/// finished client's own QP (the server destroyed its end: the packets find no QP and the
/// requester gives up, as with hardware) and through a new connection (remote access error).
fn old_rkey_of_a_finished_client_is_refused(dev: Dev, role: u8) {
    let dir = drop_in_dir();
    let mut s = Server::start(dev, dir.path(), role, &[]);
    let ctx = device(dev, dir.path(), role, 1);
    let mut first = Peer::connect(&s, &ctx, 1 << 20);
    let (old_addr, old_rkey) = first.server_buf();
    assert_eq!(first.write(old_addr, old_rkey, 4096), WcStatus::Success);
    writeln!(first.conn.stream, "\"done\"").unwrap();
    let mut line = String::new();
    first.reader.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "0");
    s.wait_done(2);
    // The finished client keeps writing through its still-connected QP.
    assert_eq!(
        first.write(old_addr, old_rkey, 4096),
        WcStatus::RetryExcErr,
        "the server's QP of a finished client must be gone"
    );
    // A new connection (new server QP) aims at the first client's buffer and key.
    let second = Peer::connect(&s, &ctx, 1 << 20);
    assert_eq!(
        second.write(old_addr, old_rkey, 4096),
        WcStatus::RemAccessErr,
        "the old rkey must be dead"
    );
    drop(second);
    s.wait_done(3);
    // The server is alive and serves the next client normally.
    let third = Peer::connect(&s, &ctx, 4096);
    let (a, k) = third.server_buf();
    assert_eq!(third.write(a, k, 4096), WcStatus::Success);
    assert_eq!(third.finish(), 0);
    s.wait_done(4);
    s.assert_all_torn_down();
    drop(first);
}

#[test]
fn old_rkey_of_a_finished_client_is_refused_mrkit0() {
    old_rkey_of_a_finished_client_is_refused(Dev::Native, 2);
}

#[test]
fn old_rkey_of_a_finished_client_is_refused_rdma_core() {
    old_rkey_of_a_finished_client_is_refused(Dev::DropIn, 12);
}

/// By default the server listens on the device's address only, not on every interface.
fn server_binds_the_device_address_by_default(dev: Dev, role: u8) {
    let dir = drop_in_dir();
    let s = Server::start(dev, dir.path(), role, &["--count", "2"]);
    let err = s.stderr();
    assert!(
        err.contains(&format!("server listening on {}:{}", s.addr, s.port)),
        "{err}"
    );
    // Another local address on the same port is not served.
    assert!(TcpStream::connect(("127.0.0.1", s.port)).is_err());
}

#[test]
fn server_binds_the_device_address_by_default_mrkit0() {
    server_binds_the_device_address_by_default(Dev::Native, 3);
}

#[test]
fn server_binds_the_device_address_by_default_rdma_core() {
    server_binds_the_device_address_by_default(Dev::DropIn, 13);
}
