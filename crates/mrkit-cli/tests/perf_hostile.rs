//! `mrkit perf --server` against hostile and careless clients: malformed and out-of-range
//! hellos, endless lines, silent clients, clients that vanish mid-exchange, many sequential
//! clients (every resource torn down: the server reports its live objects after each), and a
//! WRITE to a finished client's old rkey (refused with a remote access error).
//!
//! The RDMA clients here are built in-process on mrkit0 (`mrkit_soft` for the QP, the safe
//! `mrkit` API for the buffer).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mrkit_soft::cq::{Wc, WcStatus};
use mrkit_soft::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
use mrkit_soft::qp::{QpCap, QpInitAttr, SendWr, Sge, WrOpcode};
use mrkit_soft::{AccessFlags, Context, DeviceConfig};
use serde_json::{json, Value};

struct Server {
    child: Child,
    log: PathBuf,
    addr: String,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

impl Server {
    fn start(role: u8, extra: &[&str]) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = addr(role);
        let log = std::env::temp_dir().join(format!(
            "mrkit-perf-hostile-{}-{role}.log",
            std::process::id()
        ));
        let child = Command::new(env!("CARGO_BIN_EXE_mrkit"))
            .args([
                "perf",
                "--server",
                "--addr",
                &addr,
                "--port",
                &port.to_string(),
            ])
            .args(extra)
            .env_remove("MRKIT_ADDR")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut s = Server {
            child,
            log,
            addr,
            port,
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

    /// Every finished client left nothing behind.
    fn assert_all_torn_down(&self) {
        for l in self.done_lines() {
            assert!(
                l.ends_with("live: pd 0 mr 0 qp 0 cq 0 mw 0, pinned 0 B, memlock 0 pages"),
                "{l}"
            );
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

/// An in-process RDMA client of the server.
struct Peer {
    ctx: Context,
    cq: u32,
    qp: u32,
    mr: mrkit::MemoryRegion,
    conn: TcpStream,
    reader: BufReader<TcpStream>,
    /// The server's hello.
    server: Value,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.ctx.destroy_qp(self.qp);
        let _ = self.ctx.destroy_cq(self.cq);
    }
}

impl Peer {
    fn connect(s: &Server, ctx: &Context, size: u64) -> Peer {
        let dev = mrkit::Context::from_provider(Arc::new(ctx.clone()));
        let pd = dev.alloc_pd().unwrap();
        let mr = pd
            .register(
                mrkit::Buffer::new(2 * size as usize).unwrap(),
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            )
            .unwrap();
        let cq = ctx.create_cq(64, None).unwrap();
        let (qp, _) = ctx
            .create_qp(QpInitAttr {
                pd: pd.handle(),
                send_cq: cq,
                recv_cq: cq,
                cap: QpCap::default(),
                sq_sig_all: false,
            })
            .unwrap();
        let conn = TcpStream::connect(s.sock()).unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut reader = BufReader::new(conn.try_clone().unwrap());
        let hello = json!({
            "ip": ctx.udp_port().unwrap().local_addr().ip(),
            "qpn": qp, "psn": 0, "addr": mr.info().iova, "rkey": mr.rkey(),
            "len": 2 * size, "op": "write", "size": size, "seed": 7,
        });
        let mut w = conn.try_clone().unwrap();
        writeln!(w, "{hello}").unwrap();
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let server: Value = serde_json::from_str(&line).unwrap();
        connect_qp(
            ctx,
            qp,
            RemoteQp {
                qpn: server["qpn"].as_u64().unwrap() as u32,
                psn: server["psn"].as_u64().unwrap() as u32,
                ip: Some(server["ip"].as_str().unwrap().parse::<IpAddr>().unwrap()),
                node: 0,
            },
            // A refused WRITE completes at once (NAK); an unanswered one after 4 tries of
            // 67 ms (7 would retry forever).
            ConnectOpts {
                retry_cnt: 3,
                ..ConnectOpts::default()
            },
        )
        .unwrap();
        Peer {
            ctx: ctx.clone(),
            cq,
            qp,
            mr,
            conn,
            reader,
            server,
        }
    }

    /// One signaled WRITE of `len` bytes from our buffer to `(raddr, rkey)`; its status.
    fn write(&self, raddr: u64, rkey: u32, len: u32) -> WcStatus {
        let mut wr = SendWr::new(1, WrOpcode::RdmaWrite);
        wr.sg_list = vec![Sge {
            addr: self.mr.info().iova,
            length: len,
            lkey: self.mr.lkey(),
        }];
        wr.remote_addr = raddr;
        wr.rkey = rkey;
        self.ctx.post_send(self.qp, &[wr]).unwrap();
        let mut wcs: Vec<Wc> = Vec::new();
        let end = Instant::now() + Duration::from_secs(30);
        while wcs.is_empty() {
            self.ctx.poll_cq(self.cq, &mut wcs, 1).unwrap();
            assert!(Instant::now() < end, "no completion");
            std::thread::yield_now();
        }
        wcs[0].status
    }

    fn server_buf(&self) -> (u64, u32) {
        (
            self.server["addr"].as_u64().unwrap(),
            self.server["rkey"].as_u64().unwrap() as u32,
        )
    }

    /// Finish the exchange: our verdict, the server's error count.
    fn finish(mut self) -> u64 {
        writeln!(self.conn, "\"done\"").unwrap();
        let mut line = String::new();
        self.reader.read_line(&mut line).unwrap();
        line.trim().parse().unwrap()
    }
}

fn device(role: u8, n: u8) -> Context {
    let a = addr(role);
    let mut parts: Vec<u8> = a.split('.').map(|p| p.parse().unwrap()).collect();
    parts[3] = parts[3].wrapping_add(n).max(1);
    let ip = format!("{}.{}.{}.{}", parts[0], parts[1], parts[2], parts[3]);
    let cfg = DeviceConfig::default().udp_addr(mrkit_soft::net::udp::parse_addr(&ip).unwrap());
    let ctx = Context::open(cfg);
    ctx.udp_port().unwrap();
    ctx
}

fn hello(size: Value) -> Value {
    json!({"ip": "127.0.0.9", "qpn": 77, "psn": 0, "addr": 4096, "rkey": 5, "len": 8192,
           "op": "write", "size": size, "seed": 1})
}

#[test]
fn server_survives_hostile_clients() {
    let mut s = Server::start(0, &["--client-timeout", "1"]);
    let mut n = 1;
    let line = |v: Value| format!("{v}\n").into_bytes();
    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"this is not json\n".to_vec()),
        ("empty line", b"\n".to_vec()),
        ("huge size", line(hello(json!(u64::MAX)))),
        ("size 2^40", line(hello(json!(1u64 << 40)))),
        ("zero size", line(hello(json!(0)))),
        ("negative size", line(hello(json!(-1)))),
        (
            "size overflows u64",
            b"{\"size\": 18446744073709551616}\n".to_vec(),
        ),
        ("float size", line(hello(json!(1.5)))),
        ("endless line", vec![b'{'; 1 << 20]),
        ("unknown field", {
            let mut h = hello(json!(64));
            h["extra"] = json!(1);
            line(h)
        }),
        ("closes at once", Vec::new()),
    ];
    for (field, bad) in [
        ("qpn", json!(0)),
        ("qpn", json!(1u64 << 24)),
        ("qpn", json!(-5)),
        ("psn", json!(1u64 << 24)),
        ("ip", json!("0.0.0.0")),
        ("ip", json!("224.0.0.1")),
        ("ip", json!("::1")),
        ("len", json!(0)),
        ("addr", json!(u64::MAX)),
        ("seed", json!(300)),
        ("op", json!("erase")),
    ] {
        let mut h = hello(json!(64));
        h[field] = bad;
        cases.push(("bad field", line(h)));
    }
    let mut atomic = hello(json!(4096));
    atomic["op"] = json!("atomic");
    cases.push(("atomic of 4096 bytes", line(atomic)));
    for (what, bytes) in &cases {
        let answer = raw_client(&s, bytes);
        n += 1;
        s.wait_done(n);
        assert!(answer.is_empty(), "{what}: server answered {answer:?}");
    }
    let err = s.stderr();
    assert!(
        err.contains("size 18446744073709551615 outside 1 ..="),
        "{err}"
    );
    assert!(
        err.contains("exchange line longer than 4096 bytes"),
        "{err}"
    );

    // A silent client: dropped after --client-timeout, the next client is served.
    let t = Instant::now();
    let mut silent = TcpStream::connect(s.sock()).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut buf = [0u8; 1];
    let got = silent.read(&mut buf).ok();
    assert_eq!(got, Some(0), "the server closes a silent client");
    assert!(t.elapsed() < Duration::from_secs(20));
    n += 1;
    s.wait_done(n);
    assert!(
        s.stderr().contains("sent no complete line for 1 s"),
        "{}",
        s.stderr()
    );

    // A valid hello, then the client vanishes (resources were allocated: torn down).
    let ctx = device(0, 1);
    let p = Peer::connect(&s, &ctx, 4096);
    drop(p);
    n += 1;
    s.wait_done(n);
    // A SEND client asking for absurd counts.
    let mut c = TcpStream::connect(s.sock()).unwrap();
    let mut h = hello(json!(64));
    h["op"] = json!("send");
    h["ip"] = json!(ctx.udp_port().unwrap().local_addr().ip());
    writeln!(c, "{h}").unwrap();
    writeln!(c, "[4294967295, 4294967295]").unwrap();
    drop(c);
    n += 1;
    s.wait_done(n);

    // Still serving: a real client measures with verified data.
    let o = Command::new(env!("CARGO_BIN_EXE_mrkit"))
        .args(["perf", "--client", &s.addr, "--addr", &addr(5)])
        .args([
            "--port",
            &s.port.to_string(),
            "--op",
            "write",
            "--size",
            "4096",
        ])
        .args(["--iters", "50", "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["errors"], 0);
    n += 1;
    s.wait_done(n);
    s.assert_all_torn_down();
}

/// 50 sequential clients: after each, the server holds no PD, MR, QP, CQ or pinned page.
#[test]
fn server_objects_stay_flat_across_clients() {
    let mut s = Server::start(1, &[]);
    let ctx = device(1, 1);
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
    // Our side released everything too.
    let r = ctx.resource_counts();
    assert_eq!((r.pds, r.mrs, r.qps, r.cqs), (0, 0, 0, 0));
}

/// A WRITE to the rkey of a client that finished is refused, never lands: through the
/// finished client's own QP (the server destroyed its end: the packets find no QP and the
/// requester gives up, as with hardware) and through a new connection (remote access error).
#[test]
fn old_rkey_of_a_finished_client_is_refused() {
    let mut s = Server::start(2, &[]);
    let ctx = device(2, 1);
    let mut first = Peer::connect(&s, &ctx, 1 << 20);
    let (old_addr, old_rkey) = first.server_buf();
    assert_eq!(first.write(old_addr, old_rkey, 4096), WcStatus::Success);
    writeln!(first.conn, "\"done\"").unwrap();
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

/// By default the server listens on the device's address only, not on every interface.
#[test]
fn server_binds_the_device_address_by_default() {
    let s = Server::start(3, &["--count", "2"]);
    let err = s.stderr();
    assert!(
        err.contains(&format!("server listening on {}:{}", s.addr, s.port)),
        "{err}"
    );
    // Another local address on the same port is not served.
    assert!(TcpStream::connect(("127.0.0.1", s.port)).is_err());
}
