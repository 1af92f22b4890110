//! The data path through unmodified Debian binaries, server and client as two processes with
//! distinct device addresses (`MRKIT_ADDR`): `ibv_rc_pingpong -g 0` (ibverbs-utils; with its
//! `-c` buffer check, with and without completion events), the seven perftest tools
//! (perftest package), and `ibv_rc_pingpong` across two network namespaces (root only; SKIP
//! otherwise, failure if `MRKIT_REQUIRE_NETNS=1`).
//!
//! Each pair gets its own TCP port and its own 127.0.N.x addresses, so these tests can run in
//! parallel with the others. The numbers are parsed and printed as a table (`--nocapture`).

mod common;

use common::lib_dir;
use mrkit_testsupport::{Netns, ADDR_A, ADDR_B};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The tools busy-wait (perftest's latency tests spin on memory), and on a 2-vCPU machine two
/// pairs of spinning processes starve each other's progress threads: run one pair at a time.
static ONE_PAIR_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serialize() -> std::sync::MutexGuard<'static, ()> {
    ONE_PAIR_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn bin(name: &str, pkg: &str) -> PathBuf {
    let p = Path::new("/usr/bin").join(name);
    assert!(
        p.exists(),
        "{} missing: apt-get install {pkg} (scripts/test.sh installs it)",
        p.display()
    );
    p
}

struct Kill(Option<Child>);
impl Drop for Kill {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `prefix` (e.g. `ip netns exec X`) + program, with our library and `MRKIT_ADDR`.
fn command(prefix: &[&str], prog: &Path, addr: &str, args: &[String]) -> Command {
    let mut c = if prefix.is_empty() {
        Command::new(prog)
    } else {
        let mut c = Command::new(prefix[0]);
        c.args(&prefix[1..]).arg(prog);
        c
    };
    c.args(args)
        .env("LD_LIBRARY_PATH", lib_dir())
        .env("MRKIT_ADDR", addr)
        .stdin(Stdio::null());
    c
}

/// Wait until something listens on TCP `port` (in the namespace `prefix` runs in).
fn wait_listen(prefix: &[&str], port: u16, server: &mut Child) {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let mut c = if prefix.is_empty() {
            Command::new("ss")
        } else {
            let mut c = Command::new(prefix[0]);
            c.args(&prefix[1..]).arg("ss");
            c
        };
        let probe = c
            .args(["-ltnH", "sport", "=", &format!(":{port}")])
            .output()
            .expect("run ss (iproute2)");
        if String::from_utf8_lossy(&probe.stdout).contains(&format!(":{port}")) {
            return;
        }
        if let Ok(Some(st)) = server.try_wait() {
            panic!("server exited before listening: {st}");
        }
        assert!(Instant::now() < end, "server did not listen on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_timeout(c: Child, limit: Duration) -> Output {
    mrkit_testsupport::output_within(c, limit).unwrap_or_else(|o| {
        panic!(
            "timed out after {limit:?}:\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Run `prog` as server (address `srv`) and client (address `cli`, connecting to `connect`),
/// both with `args`; returns (server output, client output); both must exit 0.
#[allow(clippy::too_many_arguments)]
fn pair(
    prog: &Path,
    args: &[String],
    port: u16,
    srv: &str,
    cli: &str,
    connect: &str,
    srv_prefix: &[&str],
    cli_prefix: &[&str],
) -> (String, String) {
    let server = command(srv_prefix, prog, srv, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn server");
    let mut server = Kill(Some(server));
    wait_listen(srv_prefix, port, server.0.as_mut().expect("server"));
    let mut cargs = args.to_vec();
    cargs.push(connect.to_string());
    let client = command(cli_prefix, prog, cli, &cargs)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn client");
    let co = wait_timeout(client, Duration::from_secs(60));
    let so = wait_timeout(server.0.take().expect("server"), Duration::from_secs(20));
    let (st, ct) = (text(&so), text(&co));
    assert!(
        co.status.success() && so.status.success(),
        "{} {args:?}: server {} / client {}\n--- server:\n{st}\n--- client:\n{ct}",
        prog.display(),
        so.status,
        co.status
    );
    (st, ct)
}

/// The two numbers of rc_pingpong's summary: (Mbit/s, usec/iter).
fn pingpong_numbers(out: &str) -> (f64, f64) {
    let bw = out
        .lines()
        .find(|l| l.contains("bytes in"))
        .and_then(|l| l.split('=').nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no 'bytes in' line:\n{out}"));
    let lat = out
        .lines()
        .find(|l| l.contains("usec/iter"))
        .and_then(|l| l.split('=').nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no 'usec/iter' line:\n{out}"));
    (bw, lat)
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

#[test]
fn rc_pingpong_two_processes() {
    let _one = serialize();
    let prog = bin("ibv_rc_pingpong", "ibverbs-utils");
    let mut rows = Vec::new();
    for (i, extra) in [
        &["-c"][..],
        &["-c", "-e"][..],
        &["-c", "-s", "60000", "-n", "200"][..],
    ]
    .iter()
    .enumerate()
    {
        let port = 18620 + i as u16;
        let mut args = s(&["-g", "0", "-n", "500", "-p", &port.to_string()]);
        args.extend(s(extra));
        let (st, ct) = pair(
            &prog,
            &args,
            port,
            "127.0.61.2",
            "127.0.61.3",
            "127.0.61.2",
            &[],
            &[],
        );
        // Both sides print their summary; the GID line shows the device addresses.
        assert!(
            ct.contains("GID ::ffff:127.0.61.3") && ct.contains("GID ::ffff:127.0.61.2"),
            "{ct}"
        );
        let (sb, sl) = pingpong_numbers(&st);
        let (cb, cl) = pingpong_numbers(&ct);
        assert!(sb > 0.0 && cb > 0.0 && sl > 0.0 && cl > 0.0);
        rows.push(format!(
            "ibv_rc_pingpong {:<28} client {cb:>9.2} Mbit/s {cl:>8.2} usec/iter | server {sb:>9.2} Mbit/s",
            args[4..].join(" ")
        ));
    }
    eprintln!("{}", rows.join("\n"));
}

/// perftest's result row: the first line after the `#bytes` header.
fn perftest_row(out: &str) -> Vec<f64> {
    let mut lines = out
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("#bytes"));
    lines.next();
    let row = lines
        .next()
        .unwrap_or_else(|| panic!("no perftest result row:\n{out}"));
    row.split_whitespace()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("bad number {v:?} in {row:?}"))
        })
        .collect()
}

#[test]
fn perftest_seven_tools_two_processes() {
    let _one = serialize();
    let tools = [
        "ib_write_bw",
        "ib_read_bw",
        "ib_send_bw",
        "ib_atomic_bw",
        "ib_write_lat",
        "ib_read_lat",
        "ib_send_lat",
    ];
    let mut table = vec![format!(
        "{:<13} {:>7} {:>6} | {:>12} {:>12} {:>9} | {:>9} {:>9} {:>9}",
        "tool",
        "bytes",
        "iters",
        "BWpeak MB/s",
        "BWavg MB/s",
        "Mpps",
        "t_min us",
        "t_typ us",
        "t_avg us"
    )];
    for (i, t) in tools.iter().enumerate() {
        let prog = bin(t, "perftest");
        let port = 18630 + i as u16;
        // -F: no "cpu MHz" check (VMs); -x 0: GID index 0 (the device address).
        let args = s(&[
            "-d",
            "mrkit0",
            "-x",
            "0",
            "-n",
            "1000",
            "-F",
            "-p",
            &port.to_string(),
        ]);
        let (st, ct) = pair(
            &prog,
            &args,
            port,
            "127.0.62.2",
            "127.0.62.3",
            "127.0.62.2",
            &[],
            &[],
        );
        let r = perftest_row(&ct);
        if t.ends_with("_bw") {
            // #bytes #iterations BW-peak BW-average MsgRate
            assert_eq!(r.len(), 5, "{ct}");
            assert!(
                r[3] > 0.0 && r[4] > 0.0,
                "{t}: implausible numbers {r:?}\n{ct}"
            );
            table.push(format!(
                "{t:<13} {:>7} {:>6} | {:>12.2} {:>12.2} {:>9.6} |",
                r[0], r[1], r[2], r[3], r[4]
            ));
        } else {
            // #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9%
            assert!(r.len() >= 6, "{ct}");
            assert!(
                r[2] > 0.0 && r[2] <= r[4] && r[4] <= r[3],
                "{t}: implausible {r:?}\n{ct}"
            );
            table.push(format!(
                "{t:<13} {:>7} {:>6} | {:>12} {:>12} {:>9} | {:>9.2} {:>9.2} {:>9.2}",
                r[0], r[1], "", "", "", r[2], r[4], r[5]
            ));
        }
        assert!(
            !st.contains("Couldn't") && !ct.contains("Couldn't"),
            "{st}\n{ct}"
        );
    }
    eprintln!(
        "perftest (two processes, 127.0.62.2 <- 127.0.62.3):\n{}",
        table.join("\n")
    );
}

#[test]
fn rc_pingpong_two_namespaces() {
    let _one = serialize();
    let Some(ns) = Netns::for_test("rc_pingpong_two_namespaces", "v") else {
        return;
    };
    let prog = bin("ibv_rc_pingpong", "ibverbs-utils");
    let (pa, pb) = (ns.exec_a(), ns.exec_b());
    // veth MTU 1500 → active MTU 1024 (rxe rule: ≤ 1500 − 80), rc_pingpong's default -m.
    let args = s(&["-g", "0", "-c", "-n", "500", "-p", "18640"]);
    let (st, ct) = pair(&prog, &args, 18640, ADDR_A, ADDR_B, ADDR_A, &pa, &pb);
    assert!(
        ct.contains("GID ::ffff:192.0.2.2") && ct.contains("GID ::ffff:192.0.2.1"),
        "{ct}"
    );
    let (cb, cl) = pingpong_numbers(&ct);
    let (sb, _) = pingpong_numbers(&st);
    eprintln!(
        "ibv_rc_pingpong across namespaces (192.0.2.1 <- 192.0.2.2): client {cb:.2} Mbit/s \
         {cl:.2} usec/iter, server {sb:.2} Mbit/s"
    );
    // The device reports the veth's MTU as rxe would.
    let devinfo = command(&pa, Path::new("/usr/bin/ibv_devinfo"), ADDR_A, &[])
        .output()
        .expect("ibv_devinfo");
    let d = text(&devinfo);
    assert!(d.contains("active_mtu:\t\t1024 (3)"), "{d}");
}
