//! `mrkit bench transport`: two-process RoCEv2/UDP numbers beside their floors, in one run.
//!
//! * floors: raw UDP streams between two threads with segmentation offload (60 KiB
//!   `UDP_SEGMENT` sends of 4 KiB datagrams), received **without** receive offload (one 4 KiB
//!   datagram per `recvmmsg` slot: the docs/floors.md §2 anchor, ~3.3 GB/s there, and the floor the
//!   issue's "with segmentation offload" names) and **with** `UDP_GRO` (the whole 60 KiB in one
//!   slot: no per-datagram work at all on loopback, so roughly twice as fast; the device's own
//!   receiver uses GRO); the GRO stream again with the least work a faithful RoCE stream adds
//!   (the sender copies each payload out of a buffer and computes its ICRC, the receiver checks
//!   it and copies the payload into a buffer: a ceiling for any software RoCE device here);
//!   and a spinning raw UDP ping-pong of 8 bytes, measured right before the latency runs;
//! * mrkit0: `mrkit perf --server` in a child process and the client here: WRITE and READ
//!   bandwidth at 4 KiB, 64 KiB and 1 MiB, 8-byte WRITE and SEND round trips;
//! * UCX: `ucx_perftest` over its tcp transport (put_bw 64 KiB, am_lat 8 B) when installed.
//!
//! On another device (`--device NAME`, e.g. `rdma-core:mlx5_0`) the `mrkit perf` runs are the
//! same (the server child on that device, listening on 127.0.0.1; the clients here on one
//! context of it); the floors, the ceiling, the ratios and UCX describe mrkit0's software
//! transport and are reported as `"mrkit0 only: <reason>"` in their place.
//!
//! Ratios: bandwidth ÷ each raw stream, latency ÷ raw ping-pong. The floors use the same raw
//! system calls as the device (`mrkit_soft::sockio`).

use std::net::{SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mrkit_soft::sockio::{self, OutMsg, RecvMeta};
use serde_json::json;

use super::device::Selected;
use super::perf::{run_client_embedded, run_client_with, Op};
use crate::exit;

fn udp_pair(a: &str, b: &str) -> std::io::Result<(UdpSocket, UdpSocket)> {
    let s = UdpSocket::bind(a)?;
    let r = UdpSocket::bind(b)?;
    Ok((s, r))
}

/// What a raw stream does besides sending and receiving.
#[derive(Clone, Copy, PartialEq, Eq)]
enum StreamWork {
    /// Nothing: the kernel's cost alone.
    None,
    /// Per datagram, what RoCE cannot skip: the sender copies the payload out of a source
    /// buffer (the MR) and computes the ICRC (`mrkit_soft::wire::IcrcInputs`, as the device);
    /// the receiver recomputes and compares it and copies the payload into a destination
    /// buffer. No headers, no protocol, no ACKs.
    CopyAndIcrc,
}

/// Raw UDP stream: 60 KiB GSO sends of `seg`-byte datagrams, received with or without
/// `UDP_GRO`; returns MB/s received.
fn raw_stream(seg: usize, gro: bool, work: StreamWork, dur: Duration) -> std::io::Result<f64> {
    let (tx, rx) = udp_pair("127.77.0.1:0", "127.77.0.2:0")?;
    let dst = rx.local_addr()?;
    sockio::configure(&tx, false)?;
    sockio::configure(&rx, gro)?;
    sockio::set_recv_buffer(&rx, 8 << 20);
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let per = (60 * 1024 / seg).max(1);
    let segment = (per > 1).then(|| u16::try_from(seg).unwrap_or(u16::MAX));
    let icrc = mrkit_soft::wire::IcrcInputs::from_socket_addrs(tx.local_addr()?, dst);
    const MR: usize = 1 << 20;
    let payload = seg.saturating_sub(mrkit_soft::wire::ICRC_LEN).max(1);
    let sender = std::thread::spawn(move || {
        let mut buf = vec![0x5au8; seg * per];
        let source: Vec<u8> = (0..MR).map(|i| i as u8).collect();
        let mut at = 0;
        loop {
            if work == StreamWork::CopyAndIcrc {
                for d in buf.chunks_mut(seg) {
                    let (body, crc) = d.split_at_mut(payload.min(d.len()));
                    if at + body.len() > MR {
                        at = 0;
                    }
                    body.copy_from_slice(&source[at..at + body.len()]);
                    at += body.len();
                    let c = icrc.compute(body).to_le_bytes();
                    crc.copy_from_slice(&c[..crc.len()]);
                }
            }
            let msg = [OutMsg {
                dst,
                bytes: &buf,
                segment,
            }];
            loop {
                if stop2.load(Ordering::Relaxed) {
                    return;
                }
                if sockio::send_batch(&tx, &msg).is_ok() {
                    break;
                }
                std::thread::yield_now(); // full socket buffer
            }
        }
    });
    // 64 slots of one GRO batch each, or of one datagram each (as docs/floors.md's udp.c).
    let slot = if gro { 64 * 1024 } else { seg };
    let mut storage: Vec<Vec<u8>> = (0..64).map(|_| vec![0u8; slot]).collect();
    let mut slices: Vec<&mut [u8]> = storage.iter_mut().map(|b| &mut b[..]).collect();
    let mut meta = [RecvMeta::default(); 64];
    let mut mr = vec![0u8; MR];
    let (mut at, mut bad) = (0, 0u64);
    let t0 = Instant::now();
    let mut bytes = 0u64;
    while t0.elapsed() < dur {
        if let Ok(n) = sockio::recv_batch_n::<64>(&rx, &mut slices, &mut meta) {
            bytes += meta[..n].iter().map(|m| m.len as u64).sum::<u64>();
            if work == StreamWork::CopyAndIcrc {
                for (slot, m) in slices.iter().zip(&meta[..n]) {
                    for d in slot[..m.len].chunks(m.stride.max(1)) {
                        let (body, crc) = d.split_at(payload.min(d.len()));
                        let c = icrc.compute(body).to_le_bytes();
                        bad += u64::from(crc != &c[..crc.len()]);
                        if at + body.len() > MR {
                            at = 0;
                        }
                        mr[at..at + body.len()].copy_from_slice(body);
                        at += body.len();
                    }
                }
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let _ = sender.join();
    if bad > 0 {
        return Err(std::io::Error::other(format!(
            "{bad} datagrams of the raw stream failed their ICRC"
        )));
    }
    Ok(bytes as f64 / secs / 1e6)
}

/// Spinning raw UDP ping-pong of `size` bytes; returns the median RTT in µs. `connected`:
/// both sockets `connect`ed, `send`/`recv` without addresses (the kernel skips the route
/// lookup and the source address; a faster floor, but one a RoCE device cannot use: its
/// receive socket serves every peer, and a connected send socket gets per-socket IP IDs,
/// which the ICRC covers and the sender cannot know).
fn raw_pingpong(size: usize, iters: usize, connected: bool) -> std::io::Result<f64> {
    let (a, b) = udp_pair("127.77.0.3:0", "127.77.0.4:0")?;
    let (aa, ba) = (a.local_addr()?, b.local_addr()?);
    a.set_nonblocking(true)?;
    b.set_nonblocking(true)?;
    if connected {
        a.connect(ba)?;
        b.connect(aa)?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while !stop2.load(Ordering::Relaxed) {
            if connected {
                if let Ok(n) = b.recv(&mut buf) {
                    let _ = b.send(&buf[..n]);
                }
            } else if let Ok((n, _)) = b.recv_from(&mut buf) {
                let _ = b.send_to(&buf[..n], aa);
            }
        }
    });
    let msg = vec![1u8; size];
    let mut buf = [0u8; 2048];
    let mut rtts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        if connected {
            a.send(&msg)?;
        } else {
            a.send_to(&msg, ba)?;
        }
        loop {
            let got = if connected {
                a.recv(&mut buf).is_ok()
            } else {
                a.recv_from(&mut buf).is_ok()
            };
            if got {
                break;
            }
            if t.elapsed() > Duration::from_secs(1) {
                break; // lost: count as a 1 s sample rather than hang
            }
        }
        rtts.push(t.elapsed().as_secs_f64() * 1e6);
    }
    stop.store(true, Ordering::Relaxed);
    let _ = echo.join();
    rtts.sort_by(|x, y| x.partial_cmp(y).unwrap_or(std::cmp::Ordering::Equal));
    Ok(rtts[rtts.len() / 2])
}

/// `ucx_perftest` over tcp, if installed: (test, size) → value reported on its "Final" line.
fn ucx(test: &str, size: usize, iters: usize) -> Option<f64> {
    let port = "13337";
    let mut server = Command::new("ucx_perftest")
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", "lo")
        .args(["-p", port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    std::thread::sleep(Duration::from_millis(300));
    let out = Command::new("ucx_perftest")
        .env("UCX_TLS", "tcp")
        .env("UCX_NET_DEVICES", "lo")
        .args([
            "127.0.0.1",
            "-p",
            port,
            "-t",
            test,
            "-s",
            &size.to_string(),
            "-n",
            &iters.to_string(),
        ])
        .output();
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.ok()?.stdout).into_owned();
    // The last numeric table row: columns are iterations, latency (typical, avg, overall),
    // bandwidth MB/s (avg, overall), message rate (avg, overall).
    let row: Vec<f64> = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with("Final") || l.split_whitespace().count() >= 8)?
        .split_whitespace()
        .filter_map(|w| w.parse::<f64>().ok())
        .collect();
    match test {
        t if t.ends_with("_lat") => row.get(2).copied(), // avg latency, µs (1-way)
        _ => row.get(5).copied().map(|mib| mib * 1.048_576), // overall MB/s → 10^6 B/s
    }
}

/// Entry point.
pub fn run(json_out: bool, quick: bool, dev: &Selected) -> u8 {
    // mrkit0: each run opens its own device; another device: one context for every run.
    let ctx = if dev.is_embedded() {
        None
    } else {
        match dev.open("bench transport") {
            Ok(c) => Some(c),
            Err(code) => return code,
        }
    };
    match run_inner(quick, dev, ctx.as_ref()) {
        Ok(v) => {
            if json_out {
                println!("{}", serde_json::to_string_pretty(&v).expect("json"));
            } else {
                print_table(&v);
            }
            exit::OK
        }
        Err(e) => {
            eprintln!("mrkit bench transport: {e:#}");
            exit::VERB_FAILED
        }
    }
}

/// Why the floors are not measured on a device other than mrkit0.
const FLOORS_MRKIT0_ONLY: &str = "mrkit0 only: the raw UDP streams and ping-pong are the kernel \
     paths mrkit0's software RoCE runs on (the floor of its transport); another device's \
     transport does not use them";
/// Why the copy-and-ICRC ceiling is not measured on another device.
const CEILING_MRKIT0_ONLY: &str = "mrkit0 only: the payload copies and ICRC a software RoCE \
     device does per packet (a NIC does them in hardware)";
/// Why UCX over TCP is not run beside another device.
const UCX_MRKIT0_ONLY: &str = "mrkit0 only: UCX over TCP is the software transport mrkit0 is \
     compared with; on a NIC compare with perftest (ib_write_bw, ib_write_lat)";

/// Latency rounds of `bench transport --quick` and of the full run.
const LAT_ROUNDS_QUICK: usize = 5;
const LAT_ROUNDS: usize = 9;

fn median(mut v: Vec<f64>) -> f64 {
    super::perf::percentile(&mut v, 0.5)
}

/// The perf server child: killed, reaped and its log removed however the run ends.
/// The server child and its stderr log (a private temporary file, removed on drop).
struct ServerGuard(std::process::Child, tempfile::NamedTempFile);

impl Drop for ServerGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run_inner(
    quick: bool,
    dev: &Selected,
    ctx: Option<&mrkit::Context>,
) -> anyhow::Result<serde_json::Value> {
    let embedded = ctx.is_none();
    let dur = Duration::from_millis(if quick { 300 } else { 1500 });
    let only = |why: &str| json!(why);
    let (gso, gso_gro, gso_gro_work) = if embedded {
        (
            json!(raw_stream(4096, false, StreamWork::None, dur)?),
            json!(raw_stream(4096, true, StreamWork::None, dur)?),
            json!(raw_stream(4096, true, StreamWork::CopyAndIcrc, dur)?),
        )
    } else {
        (
            only(FLOORS_MRKIT0_ONLY),
            only(FLOORS_MRKIT0_ONLY),
            only(CEILING_MRKIT0_ONLY),
        )
    };
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    // Addresses of our own (127.78.<pid>.x): two benchmark runs at once (two users, a test
    // beside a manual run) must not fight over one UDP port 4791.
    let net = (std::process::id() % 250 + 1) as u8;
    let server_ip = if embedded {
        std::net::Ipv4Addr::new(127, 78, net, 1)
    } else {
        std::net::Ipv4Addr::LOCALHOST
    };
    let server_addr = server_ip.to_string();
    let server_addr = server_addr.as_str();
    let exe = std::env::current_exe()?;
    // mkstemp (O_EXCL, mode 0600): a file planted under a predictable name by another user
    // is never opened, let alone truncated.
    let server_log = tempfile::Builder::new()
        .prefix("mrkit-bench-server-")
        .suffix(".log")
        .tempfile()?;
    let sizes: &[u64] = &[4096, 65536, 1 << 20];
    let lat_rounds = if quick { LAT_ROUNDS_QUICK } else { LAT_ROUNDS };
    // + the latency rounds (a WRITE and a SEND run each), the start-up probe and the warm-up
    let runs = sizes.len() * 2 + 2 * lat_rounds + 2;
    let mut server = Command::new(exe);
    server
        .args(["perf", "--server", "--device", dev.name(), "--port"])
        .arg(port.to_string())
        .args(["--count", &runs.to_string()]);
    if embedded {
        server.args(["--addr", server_addr]);
    } else {
        // Another device's address is its GID: listen on loopback. The drop-in libibverbs
        // must not inherit this process's MRKIT_ADDR (both devices would claim it; without
        // it each picks its own 127.x.y.z).
        server
            .args(["--listen", server_addr])
            .env_remove("MRKIT_ADDR");
    }
    let server = server
        .stdout(Stdio::null())
        .stderr(Stdio::from(server_log.as_file().try_clone()?))
        .spawn()?;
    let mut server = ServerGuard(server, server_log);
    let end = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(SocketAddr::from((server_ip, port))).is_err() {
        if let Some(st) = server.0.try_wait()? {
            let err = std::fs::read_to_string(server.1.path()).unwrap_or_default();
            anyhow::bail!("perf server exited ({st}): {}", err.trim());
        }
        if Instant::now() >= end {
            anyhow::bail!("perf server did not start within 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The probe connection above was one of the counted clients: serve it.
    let mut rows = Vec::new();
    // On mrkit0 each run opens its own device: give each its own address (a closed device's
    // socket may linger for a moment).
    let next = std::cell::Cell::new(2u8);
    let one = |op: Op, size: u64, iters: u32| -> anyhow::Result<serde_json::Value> {
        let r = match ctx {
            Some(ctx) => run_client_with(ctx, server_addr, port, op, size, iters, 32)?,
            None => {
                let ip = format!("127.78.{net}.{}", next.get());
                next.set(next.get() + 1);
                run_client_embedded(server_addr, port, Some(&ip), op, size, iters, 32)?
            }
        };
        // A run with a failed completion or wrong data measured something else: no number.
        if r.errors != 0 {
            anyhow::bail!("{op:?} {size} B: {} errors (completion or data)", r.errors);
        }
        Ok(serde_json::to_value(r)?)
    };
    let _ = one(Op::Write, 8, 20); // warm-up (and the connection the probe consumed)
    for &op in &[Op::Write, Op::Read] {
        for &size in sizes {
            let iters = if quick {
                (64 << 20) / size.max(1)
            } else {
                (512 << 20) / size.max(1)
            };
            let v = one(op, size, iters.clamp(200, 20000) as u32)?;
            rows.push(v);
        }
    }
    // Latency in rounds, each the floor and both round trips back to back: this VM drifts
    // between a fast and a slow state for tens to hundreds of milliseconds at a time (every
    // system call and instruction ~30-40 % slower; the raw ping-pong alone reads 3.9-5.3 µs
    // over a minute), so a floor measured once may come from another state than the run it
    // divides. Each ratio is taken within its round; the report gives their median and range.
    // iters / 4 round trips per run (see `mrkit perf`): 5,000, or 1,000 with `--quick`.
    let lat_iters = if quick { 4_000 } else { 20_000 };
    let mut rounds = Vec::new();
    for _ in 0..lat_rounds {
        let mut round = json!({});
        if embedded {
            round["floor_us"] = json!(raw_pingpong(8, 5_000, false)?);
            round["floor_connected_us"] = json!(raw_pingpong(8, 5_000, true)?);
        }
        round["write"] = one(Op::Write, 8, lat_iters)?;
        round["send"] = one(Op::Send, 8, lat_iters)?;
        rounds.push(round);
    }
    let floor_median = |k: &str| median(rounds.iter().filter_map(|r| r[k].as_f64()).collect());
    let (pp, pp_connected) = if embedded {
        (
            json!(floor_median("floor_us")),
            json!(floor_median("floor_connected_us")),
        )
    } else {
        (only(FLOORS_MRKIT0_ONLY), only(FLOORS_MRKIT0_ONLY))
    };
    let lat = |k: &str| -> serde_json::Value {
        let p50 = |r: &serde_json::Value| r[k]["lat_us_p50"].as_f64().unwrap_or(0.0);
        let ratios_to = |floor: &str| -> Vec<f64> {
            rounds
                .iter()
                .map(|r| p50(r) / r[floor].as_f64().unwrap_or(1.0).max(1e-9))
                .collect()
        };
        // The run whose p50 is the median one, with the ratios of all rounds.
        let mut by_p50: Vec<&serde_json::Value> = rounds.iter().collect();
        by_p50.sort_by(|a, b| p50(a).total_cmp(&p50(b)));
        let mut row = by_p50[by_p50.len() / 2][k].clone();
        if !embedded {
            for key in [
                "ratio_to_floor_median",
                "ratio_to_floor_min",
                "ratio_to_floor_max",
                "ratio_to_connected_floor_median",
            ] {
                row[key] = only(FLOORS_MRKIT0_ONLY);
            }
            return row;
        }
        let ratios = ratios_to("floor_us");
        row["ratio_to_floor_median"] = json!(median(ratios.clone()));
        row["ratio_to_floor_min"] = json!(ratios.iter().copied().fold(f64::MAX, f64::min));
        row["ratio_to_floor_max"] = json!(ratios.iter().copied().fold(0.0, f64::max));
        row["ratio_to_connected_floor_median"] = json!(median(ratios_to("floor_connected_us")));
        row
    };
    let (wlat, slat) = (lat("write"), lat("send"));
    drop(server);
    let (ucx_bw, ucx_am_lat) = if embedded {
        (
            json!(ucx("ucp_put_bw", 65536, if quick { 2000 } else { 20000 })),
            json!(ucx("ucp_am_lat", 8, if quick { 20000 } else { 100000 })),
        )
    } else {
        (only(UCX_MRKIT0_ONLY), only(UCX_MRKIT0_ONLY))
    };
    Ok(json!({
        "device": dev.name(),
        "raw_udp_gso_mbps": gso,
        "raw_udp_gso_gro_mbps": gso_gro,
        "raw_udp_gso_gro_copy_icrc_mbps": gso_gro_work,
        "raw_udp_pingpong_rtt_us": pp,
        "raw_udp_pingpong_connected_rtt_us": pp_connected,
        "mrkit": rows,
        "write_lat": wlat,
        "send_lat": slat,
        "latency_rounds": rounds,
        "ucx_tcp_put_bw_64k_mbps": ucx_bw,
        "ucx_tcp_am_lat_8b_us_one_way": ucx_am_lat,
    }))
}

fn print_table(v: &serde_json::Value) {
    if !v["raw_udp_gso_mbps"].is_number() {
        return print_table_device(v);
    }
    let gso = v["raw_udp_gso_mbps"].as_f64().unwrap_or(0.0);
    let gro = v["raw_udp_gso_gro_mbps"].as_f64().unwrap_or(0.0);
    let work = v["raw_udp_gso_gro_copy_icrc_mbps"].as_f64().unwrap_or(0.0);
    let pp = v["raw_udp_pingpong_rtt_us"].as_f64().unwrap_or(0.0);
    let ppc = v["raw_udp_pingpong_connected_rtt_us"]
        .as_f64()
        .unwrap_or(0.0);
    println!(
        "floors: raw UDP stream, 4 KiB datagrams in 60 KiB GSO sends: {gso:.0} MB/s received one \
         datagram per slot (docs/floors.md §2), {gro:.0} MB/s with UDP_GRO, {work:.0} MB/s with UDP_GRO \
         plus the payload copies and ICRC of RoCE (a ceiling); raw UDP ping-pong 8 B RTT \
         {pp:.1} µs ({ppc:.1} µs over connected sockets, a path RoCE's ICRC rules out)"
    );
    println!(
        "{:>6} {:>8} | {:>10} {:>6} {:>8} {:>8} | {:>10} {:>10}",
        "op", "size", "MB/s", "÷GSO", "÷GSO+GRO", "÷ceiling", "RTT p50", "RTT p99"
    );
    for r in v["mrkit"].as_array().into_iter().flatten() {
        let bw = r["bw_mbps"].as_f64().unwrap_or(0.0);
        println!(
            "{:>6} {:>8} | {:>10.0} {:>6.2} {:>8.2} {:>8.2} | {:>8.1}µs {:>8.1}µs",
            r["op"].as_str().unwrap_or("?"),
            r["size"],
            bw,
            bw / gso.max(1e-9),
            bw / gro.max(1e-9),
            bw / work.max(1e-9),
            r["lat_us_p50"].as_f64().unwrap_or(0.0),
            r["lat_us_p99"].as_f64().unwrap_or(0.0)
        );
    }
    for k in ["write_lat", "send_lat"] {
        let l = v[k]["lat_us_p50"].as_f64().unwrap_or(0.0);
        let r = |q: &str| v[k][q].as_f64().unwrap_or(l / pp.max(1e-9));
        println!(
            "{k:>10} 8 B RTT p50 {l:.1} µs = {:.2}x raw UDP ping-pong (median of per-round \
             ratios; rounds {:.2}-{:.2}x; {:.2}x the connected-socket ping-pong)",
            r("ratio_to_floor_median"),
            r("ratio_to_floor_min"),
            r("ratio_to_floor_max"),
            r("ratio_to_connected_floor_median"),
        );
    }
    match (
        v["ucx_tcp_put_bw_64k_mbps"].as_f64(),
        v["ucx_tcp_am_lat_8b_us_one_way"].as_f64(),
    ) {
        (Some(bw), Some(l)) => {
            println!("UCX tcp: put_bw 64 KiB {bw:.0} MB/s, am_lat 8 B {l:.1} µs one way")
        }
        _ => {
            println!("UCX: ucx_perftest not installed (apt-get install ucx-utils) or not parsable")
        }
    }
}

/// The table of a device other than mrkit0: its figures, and why the rest is not there.
fn print_table_device(v: &serde_json::Value) {
    let s = |k: &str| v[k].as_str().unwrap_or("").to_string();
    println!("device {}", s("device"));
    println!("floors and ratios: {}", s("raw_udp_gso_mbps"));
    println!("ceiling: {}", s("raw_udp_gso_gro_copy_icrc_mbps"));
    println!(
        "{:>6} {:>8} | {:>10} {:>12} | {:>10} {:>10}",
        "op", "size", "MB/s", "msg/s", "RTT p50", "RTT p99"
    );
    for r in v["mrkit"].as_array().into_iter().flatten() {
        println!(
            "{:>6} {:>8} | {:>10.0} {:>12.0} | {:>8.1}µs {:>8.1}µs",
            r["op"].as_str().unwrap_or("?"),
            r["size"],
            r["bw_mbps"].as_f64().unwrap_or(0.0),
            r["msg_rate"].as_f64().unwrap_or(0.0),
            r["lat_us_p50"].as_f64().unwrap_or(0.0),
            r["lat_us_p99"].as_f64().unwrap_or(0.0)
        );
    }
    for k in ["write_lat", "send_lat"] {
        println!(
            "{k:>10} 8 B RTT p50 {:.1} µs p99 {:.1} µs",
            v[k]["lat_us_p50"].as_f64().unwrap_or(0.0),
            v[k]["lat_us_p99"].as_f64().unwrap_or(0.0)
        );
    }
    println!("UCX: {}", s("ucx_tcp_put_bw_64k_mbps"));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ceiling stream checks every datagram's ICRC on arrival (a miscomputed or misplaced
    /// ICRC, or a GRO batch split at the wrong stride, fails the run) and moves data.
    #[test]
    fn copy_and_icrc_stream_verifies_what_it_receives() {
        // With receive offload (GRO batches split by their stride) and without.
        for gro in [true, false] {
            let mbps = raw_stream(
                4096,
                gro,
                StreamWork::CopyAndIcrc,
                Duration::from_millis(150),
            )
            .unwrap();
            assert!(mbps > 0.0, "gro {gro}: {mbps}");
        }
    }
}
