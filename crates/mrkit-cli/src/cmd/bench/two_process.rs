//! The two-process data path over RoCEv2/UDP: `mrkit bench transport` in a child (full run),
//! or `mrkit perf --server` in a child with this process as the client (`--quick`).

use std::time::Instant;

use serde_json::{json, Value};

use super::child::{helper_command, kill_group};
use super::data_path::DP_SIZES;

/// Two-process WRITE/READ over RoCEv2/UDP.
///
/// Full run: `mrkit bench transport --json` in a child process (which runs `mrkit perf --server`
/// in a grandchild and the clients itself, beside raw UDP floors and UCX). `--quick`: the same
/// server with this process as the client and fewer messages per point (`bench transport
/// --quick` alone takes about 30 s, mostly in its one-outstanding latency passes).
pub(super) fn data_path_two_process(quick: bool) -> Value {
    use std::process::Stdio;
    let full = || -> Result<Value, String> {
        let mut c = helper_command(&["bench", "transport", "--json"])?;
        if quick {
            c.arg("--quick");
        }
        let mut child = c
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start `mrkit bench transport`: {e}"))?;
        let mut so = child.stdout.take().ok_or("no stdout")?;
        let mut se = child.stderr.take().ok_or("no stderr")?;
        let ro = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut so, &mut s);
            s
        });
        let re = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut se, &mut s);
            s
        });
        let limit = std::time::Duration::from_secs(if quick { 45 } else { 600 });
        let t = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
                break Some(s);
            }
            if t.elapsed() > limit {
                kill_group(&mut child);
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let out = ro.join().unwrap_or_default();
        let err = re.join().unwrap_or_default();
        match status {
            None => Err(format!("timed out after {} s", limit.as_secs())),
            Some(s) if !s.success() => Err(format!(
                "`mrkit bench transport` failed ({s}): {}",
                err.trim()
            )),
            Some(_) => serde_json::from_str::<Value>(&out)
                .map_err(|e| format!("unparsable `mrkit bench transport --json` output: {e}")),
        }
    };
    let (client, result) = if quick {
        ("this process as the client", two_process_light())
    } else {
        ("a client", full())
    };
    match result {
        Ok(v) => json!({
            "transport": format!("RoCEv2/UDP between two processes (`mrkit perf --server` and {client}), loopback addresses"),
            "result": v,
            "error": null,
        }),
        Err(e) => {
            json!({"transport": "RoCEv2/UDP between two processes", "result": null, "error": e})
        }
    }
}

/// `--quick` two-process run: `mrkit perf --server` in a child, the clients here.
pub(super) fn two_process_light() -> Result<Value, String> {
    use crate::cmd::perf::{run_client_embedded, Op};
    use std::process::Stdio;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    // Addresses of this run alone (two bench runs at once on one host must not collide on
    // their RoCEv2 ports): 127.79.<pid-derived>.<1 = server, 2.. = clients>.
    let net = (std::process::id() % 250 + 1) as u8;
    let server_ip = std::net::Ipv4Addr::new(127, 79, net, 1);
    let server_addr = server_ip.to_string();
    let server_addr = server_addr.as_str();
    // Each bandwidth point, two latency runs, the start-up probe and the warm-up.
    let runs = DP_SIZES.len() * 2 + 2 + 2;
    let server = helper_command(&["perf", "--server", "--addr", server_addr, "--port"])?
        .arg(port.to_string())
        .args(["--count", &runs.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start `mrkit perf --server`: {e}"))?;
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            kill_group(&mut self.0);
        }
    }
    let _server = Reap(server);
    let end = Instant::now() + std::time::Duration::from_secs(10);
    while std::net::TcpStream::connect(std::net::SocketAddr::from((server_ip, port))).is_err() {
        if Instant::now() > end {
            return Err("perf server did not start".into());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let next = std::cell::Cell::new(2u8);
    let one = |op: Op, size: u64, iters: u32| -> Result<Value, String> {
        let ip = format!("127.79.{net}.{}", next.get());
        next.set(next.get() + 1);
        let r = run_client_embedded(server_addr, port, Some(&ip), op, size, iters, 32)
            .map_err(|e| format!("{op:?} {size} B: {e:#}"))?;
        serde_json::to_value(r).map_err(|e| e.to_string())
    };
    let _ = one(Op::Write, 8, 20); // warm-up (and the connection the probe consumed)
    let mut rows = Vec::new();
    for op in [Op::Write, Op::Read] {
        for &size in &DP_SIZES {
            let iters = ((16u64 << 20) / size as u64).clamp(200, 2000) as u32;
            rows.push(one(op, size as u64, iters)?);
        }
    }
    let wlat = one(Op::Write, 8, 500)?;
    let slat = one(Op::Send, 8, 500)?;
    Ok(json!({
        "raw_udp_gso_mbps": null,
        "raw_udp_gso_gro_mbps": null,
        "raw_udp_gso_gro_copy_icrc_mbps": null,
        "raw_udp_pingpong_rtt_us": null,
        "mrkit": rows,
        "write_lat": wlat,
        "send_lat": slat,
        "ucx_tcp_put_bw_64k_mbps": null,
        "ucx_tcp_am_lat_8b_us_one_way": null,
    }))
}
