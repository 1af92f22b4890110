//! Two real processes connected through `mrkit::tcp`: a key-value GET over RDMA READ, a peer
//! that dies after connecting (the survivor's READ ends in RETRY_EXC_ERR under both status
//! models), and the GET between two network namespaces.
//!
//! The other process is this test binary run again with `MRKIT_CONNECT_ROLE` set: it runs
//! only [`child_process_entry_point`], which plays the role.
mod providers_util;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use mrkit::tcp::{self, Connection, HandshakeOpts, Listener};
use mrkit::{
    AccessFlags as A, Buffer, Context, DeviceConfig, QpCap, RemoteSlice, StatusModel, WcStatus,
};

const ROLE: &str = "MRKIT_CONNECT_ROLE";
const SLOT: u64 = 64;
const KEYS: [(&str, &str); 3] = [
    ("apple", "red"),
    ("banana", "yellow"),
    ("cherry", "dark red"),
];

/// The table the server exposes: one 64-byte slot per key (key 32 bytes, value 32 bytes).
fn slot_of(key: &str) -> Option<u64> {
    KEYS.iter().position(|(k, _)| *k == key).map(|i| i as u64)
}

/// Server roles: listen on `MRKIT_CONNECT_BIND`, print `PORT <n>`, accept one client with the
/// table's `RemoteSlice` as private data; then `kv-server` serves until the client hangs up
/// and `idle-server` waits to be killed.
fn server(idle: bool) {
    let pd = Context::open_default().unwrap().alloc_pd().unwrap();
    let len = KEYS.len() * SLOT as usize;
    let mut table = pd
        .register(Buffer::new(len).unwrap(), A::REMOTE_READ)
        .unwrap();
    for (i, (k, v)) in KEYS.iter().enumerate() {
        let s = &mut table.as_mut_slice()[i * SLOT as usize..];
        s[..k.len()].copy_from_slice(k.as_bytes());
        s[32..32 + v.len()].copy_from_slice(v.as_bytes());
    }
    let bind = std::env::var("MRKIT_CONNECT_BIND").unwrap_or("127.0.0.1:0".into());
    let listener = Listener::bind(bind).unwrap();
    println!("PORT {}", listener.local_addr().unwrap().port());
    let opts = HandshakeOpts {
        private_data: table.remote(0..len as u64).unwrap().to_bytes().to_vec(),
        accept_timeout: Some(Duration::from_secs(60)),
        ..Default::default()
    };
    let mut c = listener.accept(&pd, QpCap::default(), &opts).unwrap();
    println!("CONNECTED");
    if idle {
        std::thread::sleep(Duration::from_secs(120)); // killed long before
    }
    let _ = c.stream.read(&mut [0u8; 1]);
}

/// GET `key` over the connection: READ its slot.
fn get(pd: &mrkit::ProtectionDomain, c: &mut Connection, key: &str) -> Option<String> {
    let table = RemoteSlice::from_bytes(&c.private_data).unwrap();
    let slot = slot_of(key)?;
    let mut buf = pd
        .register(Buffer::new(SLOT as usize).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    let remote = RemoteSlice {
        addr: table.addr + slot * SLOT,
        len: SLOT,
        rkey: table.rkey,
    };
    let wc = c.qp.read(&mut buf, 0..SLOT, remote).unwrap();
    assert_eq!(wc.status, WcStatus::Success);
    let b = buf.as_slice();
    assert_eq!(&b[..key.len()], key.as_bytes());
    let v = &b[32..64];
    let end = v.iter().position(|&c| c == 0).unwrap_or(32);
    Some(String::from_utf8_lossy(&v[..end]).into_owned())
}

/// Client role: connect to `MRKIT_CONNECT_SERVER` and print `GOT <key>=<value>` per key.
fn client() {
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let server = std::env::var("MRKIT_CONNECT_SERVER").unwrap();
    let mut c = tcp::connect(server, &pd, QpCap::default(), &HandshakeOpts::default()).unwrap();
    for (k, _) in KEYS {
        println!("GOT {k}={}", get(&pd, &mut c, k).unwrap());
    }
    println!("VIA {} -> {}", c.qp.endpoint().unwrap().ip(), c.remote.ip());
}

/// Not a test: the entry point of the child processes (does nothing without `MRKIT_CONNECT_ROLE`).
#[test]
fn child_process_entry_point() {
    match std::env::var(ROLE).as_deref() {
        Ok("kv-server") => server(false),
        Ok("idle-server") => server(true),
        Ok("kv-client") => client(),
        Ok(r) => panic!("unknown role {r}"),
        Err(_) => {}
    }
}

/// A child process, killed (if still running) and reaped on drop; its stdout lines arrive on
/// a channel.
struct Kid {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Kid {
    /// This test binary as `role`, run through `prefix` (e.g. `ip netns exec a`).
    fn spawn(prefix: &[&str], role: &str, env: &[(&str, &str)]) -> Kid {
        let exe = std::env::current_exe().unwrap();
        let exe = exe.to_str().unwrap();
        let mut argv: Vec<&str> = prefix.to_vec();
        argv.extend([exe, "--exact", "child_process_entry_point", "--nocapture"]);
        let mut child = Command::new(argv[0])
            .args(&argv[1..])
            .env(ROLE, role)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    return;
                }
            }
        });
        Kid { child, lines }
    }

    /// The next stdout line starting with `prefix` (the rest of it), within 60 s.
    fn expect(&self, prefix: &str) -> String {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let left = end.saturating_duration_since(Instant::now());
            let l = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("the child never printed {prefix}"));
            if let Some(rest) = l.strip_prefix(prefix) {
                return rest.to_string();
            }
        }
    }

    /// Wait (at most 60 s) for the child to exit; whether it succeeded.
    fn wait(mut self) -> bool {
        let end = Instant::now() + Duration::from_secs(60);
        while Instant::now() < end {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the child did not exit");
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn kv_get_between_two_processes() {
    let kid = Kid::spawn(&[], "kv-server", &[]);
    let port = kid.expect("PORT ");
    let ctx = Context::open_default().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mut c = tcp::connect(
        format!("127.0.0.1:{port}"),
        &pd,
        QpCap::default(),
        &HandshakeOpts::default(),
    )
    .unwrap();
    for (k, v) in KEYS {
        assert_eq!(get(&pd, &mut c, k).as_deref(), Some(v));
    }
    assert_eq!(get(&pd, &mut c, "durian"), None);
    // Two processes, two RoCEv2 addresses: the READs went over UDP.
    assert_ne!(c.remote.ip(), c.qp.endpoint().unwrap().ip());
    if !providers_util::needs_native("counts mrkit-soft's UDP datagrams") {
        assert!(ctx.soft().unwrap().net_stats().tx_datagrams > 0);
    }
    drop(c); // the server sees the side channel close and exits
    assert!(kid.wait(), "the server failed");
}

/// Connect to an idle server child, kill it, then READ from it with the default options on a
/// device with `model`: the status and how long the READ took.
fn read_after_the_peer_died(model: StatusModel) -> Option<(WcStatus, Duration)> {
    // The default model (hardware) is the drop-in's too; the other one (rxe) needs a device
    // of its own.
    let ctx = if model == StatusModel::default() {
        providers_util::open()
    } else {
        providers_util::open_with(
            DeviceConfig::from_env().unwrap().status_model(model),
            &[("MRKIT_STATUS_MODEL", "rxe")],
        )?
    };
    let mut kid = Kid::spawn(&[], "idle-server", &[]);
    let port = kid.expect("PORT ");
    let pd = ctx.alloc_pd().unwrap();
    let c = tcp::connect(
        format!("127.0.0.1:{port}"),
        &pd,
        QpCap::default(),
        &HandshakeOpts::default(),
    )
    .unwrap();
    kid.expect("CONNECTED");
    let table = RemoteSlice::from_bytes(&c.private_data).unwrap();
    let mut buf = pd
        .register(Buffer::new(64).unwrap(), A::LOCAL_WRITE)
        .unwrap();
    // Alive: the READ works.
    let wc = c.qp.read(&mut buf, 0..5, table).unwrap();
    assert_eq!(
        (wc.status, &buf.as_slice()[..5]),
        (WcStatus::Success, &b"apple"[..])
    );
    kid.child.kill().unwrap();
    kid.child.wait().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let t = Instant::now();
        let wc = c.qp.read(&mut buf, 0..5, table).unwrap();
        let _ = tx.send((wc.status, t.elapsed()));
    });
    Some(
        rx.recv_timeout(Duration::from_secs(30))
            .expect("a READ from a dead peer must end (RETRY_EXC_ERR), not hang"),
    )
}

#[test]
fn a_peer_that_dies_ends_reads_with_retry_exc_err_hardware_model() {
    let Some((st, took)) = read_after_the_peer_died(StatusModel::Hardware) else {
        return;
    };
    eprintln!("hardware model: {st:?} after {took:?}");
    assert_eq!(st, WcStatus::RetryExcErr);
}

#[test]
fn a_peer_that_dies_ends_reads_with_retry_exc_err_rxe_model() {
    let Some((st, took)) = read_after_the_peer_died(StatusModel::Rxe) else {
        return;
    };
    eprintln!("rxe model: {st:?} after {took:?}");
    assert_eq!(st, WcStatus::RetryExcErr);
}

#[test]
fn kv_get_across_network_namespaces() {
    use mrkit_testsupport::{Netns, ADDR_A, ADDR_B};
    let Some(ns) = Netns::for_test("kv_get_across_network_namespaces", "cn") else {
        return;
    };
    let bind = format!("{ADDR_A}:0");
    let server = Kid::spawn(
        &ns.exec_a(),
        "kv-server",
        &[("MRKIT_ADDR", ADDR_A), ("MRKIT_CONNECT_BIND", &bind)],
    );
    let port = server.expect("PORT ");
    let target = format!("{ADDR_A}:{port}");
    let client = Kid::spawn(
        &ns.exec_b(),
        "kv-client",
        &[("MRKIT_ADDR", ADDR_B), ("MRKIT_CONNECT_SERVER", &target)],
    );
    for (k, v) in KEYS {
        assert_eq!(client.expect("GOT "), format!("{k}={v}"));
    }
    assert_eq!(client.expect("VIA "), format!("{ADDR_B} -> {ADDR_A}"));
    assert!(client.wait(), "the client failed");
    assert!(server.wait(), "the server failed");
}
