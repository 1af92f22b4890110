//! `mrkit perf`: a perftest-like pair over RoCEv2/UDP on mrkit0.
//!
//! The server listens on TCP (default port 18515) for the out-of-band exchange (QPN, PSN, GID,
//! buffer address, rkey), as perftest does, then serves one client at a time. The client runs
//! the operation with a window of outstanding work requests, verifies the data, and prints
//! bandwidth, message rate and round-trip latency (JSON keys `op`, `size`, `bw_mbps`,
//! `msg_rate`, `lat_us_p50`, `lat_us_p99`, `errors`).

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use mrkit_soft::cq::{Wc, WcOpcode, WcStatus};
use mrkit_soft::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
use mrkit_soft::qp::{send_flags, QpCap, QpInitAttr, RecvWr, SendWr, Sge, WrOpcode};
use mrkit_soft::{AccessFlags, Context, DeviceConfig, MrInfo};
use serde::{Deserialize, Serialize};

use crate::exit;

/// Operation to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// RDMA WRITE.
    Write,
    /// RDMA READ.
    Read,
    /// SEND / RECV (the server echoes for latency).
    Send,
    /// FETCH_AND_ADD.
    Atomic,
}

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  mrkit perf --server --addr 127.0.0.2\n  mrkit perf --client 127.0.0.2 --op write --size 64KiB --iters 2000 --json\n  MRKIT_FAULTS=loss=1% mrkit perf --client 127.0.0.2 --op read --size 4096"
)]
pub struct PerfArgs {
    /// Run the server (passive side).
    #[arg(long, conflicts_with = "client")]
    server: bool,
    /// Run the client against the server at this address.
    #[arg(long, value_name = "ADDR")]
    client: Option<String>,
    /// Our device address (RoCEv2 GID): default MRKIT_ADDR or a distinct 127.x.y.z.
    #[arg(long)]
    addr: Option<String>,
    /// TCP port of the out-of-band exchange.
    #[arg(long, default_value_t = 18515)]
    port: u16,
    /// Operation (client).
    #[arg(long, value_enum, default_value_t = Op::Write)]
    op: Op,
    /// Message size (client): 8, 4096, 64KiB, 1MiB.
    #[arg(long, default_value = "65536", value_parser = parse_size)]
    size: u64,
    /// Messages in the bandwidth phase (client).
    #[arg(long, default_value_t = 1000)]
    iters: u32,
    /// Outstanding work requests in the bandwidth phase.
    #[arg(long, default_value_t = 32)]
    window: u32,
    /// Path MTU in bytes (256 … 4096).
    #[arg(long, default_value_t = 4096)]
    mtu: u32,
    /// Serve this many clients, then exit (server; 0 = forever).
    #[arg(long, default_value_t = 0)]
    count: u32,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    mrkit_soft::device::parse_size(s).ok_or_else(|| format!("`{s}` is not a size"))
}

/// Out-of-band exchange message.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Hello {
    ip: IpAddr,
    qpn: u32,
    psn: u32,
    addr: u64,
    rkey: u32,
    len: u64,
    op: Op,
    size: u64,
    seed: u8,
}

/// The JSON result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PerfResult {
    /// Operation.
    pub op: Op,
    /// Message size.
    pub size: u64,
    /// Bandwidth in MB/s (10^6 B/s).
    pub bw_mbps: f64,
    /// Messages per second.
    pub msg_rate: f64,
    /// Median round trip (µs) with one message outstanding.
    pub lat_us_p50: f64,
    /// 99th percentile round trip (µs).
    pub lat_us_p99: f64,
    /// Completion errors plus data verification mismatches.
    pub errors: u64,
}

struct Side {
    ctx: Context,
    cq: u32,
    qp: u32,
    mr: MrInfo,
    buf: Vec<u8>,
}

fn mtu_enum(bytes: u32) -> u8 {
    match bytes {
        0..=256 => 1,
        257..=512 => 2,
        513..=1024 => 3,
        1025..=2048 => 4,
        _ => 5,
    }
}

fn open_device(addr: Option<&str>) -> anyhow::Result<Context> {
    let mut cfg = DeviceConfig::from_env().map_err(anyhow::Error::msg)?;
    if let Some(a) = addr {
        cfg = cfg.udp_addr(mrkit_soft::net::udp::parse_addr(a).map_err(anyhow::Error::msg)?);
    }
    let ctx = Context::open(cfg);
    ctx.udp_port()?;
    Ok(ctx)
}

fn open_side(addr: Option<&str>, len: usize) -> anyhow::Result<Side> {
    side_on(open_device(addr)?, len)
}

/// Resources for one connection on an opened device.
fn side_on(ctx: Context, len: usize) -> anyhow::Result<Side> {
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(8192, None)?;
    let (qp, _) = ctx.create_qp(QpInitAttr {
        pd,
        send_cq: cq,
        recv_cq: cq,
        cap: QpCap {
            max_send_wr: 1024,
            max_recv_wr: 1024,
            ..QpCap::default()
        },
        sq_sig_all: false,
    })?;
    let buf = vec![0u8; len.max(64)];
    let mr = ctx.reg_mr_va(
        pd,
        buf.as_ptr() as u64,
        buf.len() as u64,
        AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC,
    )?;
    Ok(Side {
        ctx,
        cq,
        qp,
        mr,
        buf,
    })
}

fn send_line<T: Serialize>(s: &mut TcpStream, v: &T) -> anyhow::Result<()> {
    let mut line = serde_json::to_string(v)?;
    line.push('\n');
    s.write_all(line.as_bytes())?;
    Ok(())
}

fn read_line<T: for<'de> Deserialize<'de>>(r: &mut BufReader<TcpStream>) -> anyhow::Result<T> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        anyhow::bail!("peer closed the exchange connection");
    }
    Ok(serde_json::from_str(line.trim())?)
}

fn pattern(seed: u8, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(13).wrapping_add(seed);
    }
}

fn poll_n(side: &Side, n: usize, out: &mut Vec<Wc>, deadline: Instant) -> anyhow::Result<()> {
    let start = out.len();
    let mut polls = 0u32;
    while out.len() - start < n {
        let want = n - (out.len() - start);
        side.ctx.poll_cq(side.cq, out, want)?;
        // The clock is read every 256 empty polls, not every poll: a clock read costs ~25 ns
        // in this VM, and the spinning loop's period is how late a completion is noticed.
        polls = polls.wrapping_add(1);
        if polls % 256 == 0 && Instant::now() > deadline {
            anyhow::bail!("timed out waiting for completions");
        }
    }
    Ok(())
}

/// Signaled SENDs of the echo phase whose completions may stay unpolled before the next post
/// waits for one (bounds the send queue; perftest's `ib_send_lat` reaps its send completions
/// in batches the same way, outside the measured round trip).
const MAX_UNREAPED_SENDS: u32 = 32;

/// Completions of one side's echo loop. SEND and RECV completions share the CQ with no order
/// between them: a SEND's completion needs the peer's ACK, which may travel with or behind
/// the peer's next message (delayed ACKs), or be lost and resent. So a receive completion
/// seen while reaping sends is kept for later, and send completions seen while waiting for a
/// receive are counted (`sends` is the number still unpolled).
#[derive(Default)]
struct EchoCompletions {
    early: std::collections::VecDeque<Wc>,
    sends: u32,
    errors: u64,
    wcs: Vec<Wc>,
}

impl EchoCompletions {
    fn take_send(&mut self, wc: &Wc) {
        self.sends = self.sends.saturating_sub(1);
        self.errors += u64::from(wc.status != WcStatus::Success);
    }

    /// The CQ's next completion.
    fn poll_one(&mut self, side: &Side, deadline: Instant) -> anyhow::Result<Wc> {
        self.wcs.clear();
        poll_n(side, 1, &mut self.wcs, deadline)?;
        Ok(self.wcs[0])
    }

    /// The next receive completion: one kept earlier, else the CQ's next one that is not a
    /// send completion.
    fn next_recv(&mut self, side: &Side, deadline: Instant) -> anyhow::Result<Wc> {
        if let Some(wc) = self.early.pop_front() {
            return Ok(wc);
        }
        loop {
            let wc = self.poll_one(side, deadline)?;
            if wc.opcode != WcOpcode::Send {
                return Ok(wc);
            }
            self.take_send(&wc);
        }
    }

    /// Poll until at most `left` sends are unpolled.
    fn reap_sends(&mut self, side: &Side, left: u32, deadline: Instant) -> anyhow::Result<()> {
        while self.sends > left {
            let wc = self.poll_one(side, deadline)?;
            if wc.opcode == WcOpcode::Send {
                self.take_send(&wc);
            } else {
                self.early.push_back(wc);
            }
        }
        Ok(())
    }
}

fn connect(side: &Side, peer: &Hello) -> anyhow::Result<()> {
    connect_qp(
        &side.ctx,
        side.qp,
        RemoteQp {
            qpn: peer.qpn,
            psn: peer.psn,
            ip: Some(peer.ip),
            node: 0,
        },
        ConnectOpts {
            path_mtu: side_mtu(),
            // perftest's 14 (≈ 67 ms): retry_cnt 7 is seven retries, and with 12 (≈ 17 ms) a
            // peer kept off the CPU for ~130 ms on a loaded 2-vCPU machine ended the run.
            timeout: 14,
            ..ConnectOpts::default()
        },
    )?;
    Ok(())
}

thread_local! {
    static MTU: std::cell::Cell<u8> = const { std::cell::Cell::new(5) };
}
fn side_mtu() -> u8 {
    MTU.with(|m| m.get())
}

fn hello(side: &Side, op: Op, size: u64, seed: u8) -> anyhow::Result<Hello> {
    Ok(Hello {
        ip: side.ctx.udp_port()?.local_addr().ip(),
        qpn: side.qp,
        psn: 0,
        addr: side.mr.iova,
        rkey: side.mr.rkey,
        len: side.buf.len() as u64,
        op,
        size,
        seed,
    })
}

fn recv_wr(side: &Side, id: u64, off: u64, len: u64) -> RecvWr {
    RecvWr {
        wr_id: id,
        sg_list: vec![Sge {
            addr: side.mr.iova + off,
            length: len as u32,
            lkey: side.mr.lkey,
        }],
    }
}

/// The server echoes each message's first (at most) this many bytes.
const ECHO_MAX: u64 = 8;

/// Messages up to this size are posted inline (`IBV_SEND_INLINE`: copied at post time, as
/// perftest's latency tests post theirs); within the QP's default `max_inline_data`.
const INLINE_MAX: u64 = 64;

fn send_wr(side: &Side, id: u64, op: WrOpcode, off: u64, len: u64, signaled: bool) -> SendWr {
    let mut w = SendWr::new(id, op);
    if !signaled {
        w.flags = 0;
    }
    if matches!(op, WrOpcode::Send | WrOpcode::RdmaWrite) && len <= INLINE_MAX {
        // Inline: the bytes travel in the WR (copied here as `ibv_post_send` copies them).
        w.flags |= send_flags::INLINE;
        w.inline_data = side.buf[off as usize..(off + len) as usize].to_vec();
        return w;
    }
    w.sg_list = vec![Sge {
        addr: side.mr.iova + off,
        length: len as u32,
        lkey: side.mr.lkey,
    }];
    w
}

/// Server: serve clients one at a time.
fn serve(a: &PerfArgs) -> anyhow::Result<()> {
    let tcp_ip = match &a.addr {
        Some(s) => mrkit_soft::net::udp::parse_addr(s)
            .map_err(anyhow::Error::msg)?
            .ip(),
        None => IpAddr::from([0, 0, 0, 0]),
    };
    let listener = TcpListener::bind(SocketAddr::new(tcp_ip, a.port))?;
    eprintln!("mrkit perf: server listening on {}", listener.local_addr()?);
    // One device for all clients (its UDP address stays bound); resources per client.
    let dev = open_device(a.addr.as_deref())?;
    let mut served = 0;
    for conn in listener.incoming() {
        let conn = conn?;
        if let Err(e) = serve_one(&dev, conn) {
            eprintln!("mrkit perf: client failed: {e:#}");
        }
        served += 1;
        if a.count != 0 && served >= a.count {
            break;
        }
    }
    Ok(())
}

fn serve_one(dev: &Context, conn: TcpStream) -> anyhow::Result<()> {
    conn.set_nodelay(true)?;
    let mut w = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    let peer: Hello = read_line(&mut r)?;
    let len = (peer.size.max(8) * 2) as usize;
    let mut side = side_on(dev.clone(), len)?;
    pattern(peer.seed, &mut side.buf);
    let me = hello(&side, peer.op, peer.size, peer.seed)?;
    connect(&side, &peer)?;
    let size = peer.size.max(1);
    if peer.op == Op::Send {
        let wrs: Vec<RecvWr> = (0..512).map(|i| recv_wr(&side, i, 0, size)).collect();
        side.ctx.post_recv(side.qp, &wrs)?;
    }
    send_line(&mut w, &me)?;
    let mut errors = 0u64;
    if peer.op == Op::Send {
        // Echo phase (latency), then receive phase (bandwidth); the client tells the count.
        let (echo, bulk): (u32, u32) = read_line(&mut r)?;
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut c = EchoCompletions::default();
        // The reply is prepared once and posted with a new wr_id each time, as perftest
        // prepares its work requests (its bytes, at offset `size`, never change).
        let mut reply = send_wr(&side, 0, WrOpcode::Send, size, size.min(ECHO_MAX), true);
        for i in 0..echo {
            let wc = c.next_recv(&side, deadline)?;
            c.errors += u64::from(wc.status != WcStatus::Success || u64::from(wc.byte_len) != size);
            // Reply first, then replace the consumed receive (512 are posted: the next
            // message cannot find the queue empty), as a latency-minded server would.
            c.reap_sends(&side, MAX_UNREAPED_SENDS - 1, deadline)?;
            reply.wr_id = u64::from(i);
            side.ctx.post_send(side.qp, std::slice::from_ref(&reply))?;
            c.sends += 1;
            side.ctx
                .post_recv(side.qp, &[recv_wr(&side, 1000 + u64::from(i), 0, size)])?;
        }
        // Every reply completed before the receive phase.
        c.reap_sends(&side, 0, deadline)?;
        let mut expect = vec![0u8; size as usize];
        pattern(peer.seed.wrapping_add(1), &mut expect);
        for i in 0..bulk {
            let wc = c.next_recv(&side, deadline)?;
            let bad = wc.status != WcStatus::Success || u64::from(wc.byte_len) != size;
            // The last message is checked byte for byte (earlier ones share the buffer).
            if bad || (i + 1 == bulk && side.buf[..size as usize] != expect[..]) {
                errors += 1;
            }
            side.ctx
                .post_recv(side.qp, &[recv_wr(&side, 2000 + u64::from(i), 0, size)])?;
        }
        errors += c.errors;
    }
    // Wait for the client's verdict; reply with our error count.
    let _done: String = read_line(&mut r)?;
    send_line(&mut w, &errors)?;
    Ok(())
}

pub(crate) fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let i = ((v.len() as f64 - 1.0) * q).round() as usize;
    v[i]
}

/// Client: one measurement with explicit parameters (used by `mrkit bench transport`).
pub fn run_client_with(
    server: &str,
    port: u16,
    addr: Option<&str>,
    op: Op,
    size: u64,
    iters: u32,
    window: u32,
) -> anyhow::Result<PerfResult> {
    let a = PerfArgs {
        server: false,
        client: Some(server.to_string()),
        addr: addr.map(str::to_string),
        port,
        op,
        size,
        iters,
        window,
        mtu: 4096,
        count: 0,
        json: true,
    };
    run_client(&a, server)
}

/// Client: run one measurement.
pub fn run_client(a: &PerfArgs, server: &str) -> anyhow::Result<PerfResult> {
    let size = a.size.max(if a.op == Op::Atomic { 8 } else { 1 });
    let size = if a.op == Op::Atomic { 8 } else { size };
    let tcp = mrkit_soft::net::udp::parse_addr(server).map_err(anyhow::Error::msg)?;
    let conn = TcpStream::connect(SocketAddr::new(tcp.ip(), a.port))?;
    conn.set_nodelay(true)?;
    let mut w = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    let seed = 0x5a;
    let mut side = open_side(a.addr.as_deref(), (size * 2) as usize)?;
    send_line(&mut w, &hello(&side, a.op, size, seed)?)?;
    let peer: Hello = read_line(&mut r)?;
    connect(&side, &peer)?;
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut errors = 0u64;
    let mut wcs: Vec<Wc> = Vec::new();
    let opcode = match a.op {
        Op::Write => WrOpcode::RdmaWrite,
        Op::Read => WrOpcode::RdmaRead,
        Op::Send => WrOpcode::Send,
        Op::Atomic => WrOpcode::AtomicFetchAndAdd,
    };
    let make = |side: &Side, id: u64, signaled: bool| -> SendWr {
        let mut wr = send_wr(side, id, opcode, 0, size, signaled);
        wr.remote_addr = peer.addr;
        wr.rkey = peer.rkey;
        if a.op == Op::Atomic {
            wr.compare_add = 1;
            wr.sg_list[0].addr = side.mr.iova + size; // result lands in the second half
        }
        if a.op == Op::Read {
            wr.sg_list[0].addr = side.mr.iova + size;
        }
        wr
    };
    pattern(seed.wrapping_add(1), &mut side.buf[..size as usize]);
    // Latency phase: one outstanding message, iters/4 samples (at least 20).
    let samples = (a.iters / 4).clamp(20, 10_000);
    if a.op == Op::Send {
        let recvs: Vec<RecvWr> = (0..64)
            .map(|i| recv_wr(&side, 5000 + i, size, size))
            .collect();
        side.ctx.post_recv(side.qp, &recvs)?;
        send_line(&mut w, &(samples, a.iters))?;
    }
    let mut lat = Vec::with_capacity(samples as usize);
    let mut echo = EchoCompletions::default();
    for i in 0..samples {
        // The work request is built before the clock starts, as perftest's latency tests
        // prepare theirs: the round trip is post → completion. For SEND it is post → the
        // echo's receive completion, as perftest's ib_send_lat measures it; the SEND's own
        // (signaled) completion is reaped whenever the CQ shows it, outside the timed span.
        let wr = [make(&side, u64::from(i), true)];
        if a.op == Op::Send {
            echo.reap_sends(&side, MAX_UNREAPED_SENDS - 1, deadline)?;
        }
        let t = Instant::now();
        side.ctx.post_send(side.qp, &wr)?;
        if a.op == Op::Send {
            echo.sends += 1;
            let wc = echo.next_recv(&side, deadline)?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            echo.errors += u64::from(
                wc.status != WcStatus::Success || u64::from(wc.byte_len) != size.min(ECHO_MAX),
            );
            side.ctx
                .post_recv(side.qp, &[recv_wr(&side, 6000 + u64::from(i), size, size)])?;
        } else {
            wcs.clear();
            poll_n(&side, 1, &mut wcs, deadline)?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            errors += wcs.iter().filter(|w| w.status != WcStatus::Success).count() as u64;
        }
    }
    // Every SEND of the latency phase completed (and was counted) before the bandwidth phase.
    echo.reap_sends(&side, 0, deadline)?;
    errors += echo.errors;
    // Bandwidth phase: keep `window` WRs outstanding, signal every 8th.
    let window = a.window.clamp(1, 512);
    let sig_every = 8u32.min(window);
    let t0 = Instant::now();
    let mut posted = 0u32;
    let mut completed = 0u32;
    let mut signaled_outstanding = 0u32;
    while completed < a.iters {
        while posted < a.iters && posted - completed < window {
            let sig = (posted + 1) % sig_every == 0 || posted + 1 == a.iters;
            side.ctx
                .post_send(side.qp, &[make(&side, u64::from(posted), sig)])?;
            posted += 1;
            if sig {
                signaled_outstanding += 1;
            }
        }
        wcs.clear();
        side.ctx.poll_cq(side.cq, &mut wcs, 64)?;
        for wc in &wcs {
            if wc.status != WcStatus::Success {
                anyhow::bail!("completion error {:?} (wr {})", wc.status, wc.wr_id);
            }
            // A signaled completion retires every WR up to it (RC completes in order).
            completed = (wc.wr_id as u32 + 1).max(completed);
            signaled_outstanding -= 1;
        }
        if Instant::now() > deadline {
            anyhow::bail!("bandwidth phase timed out");
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let _ = signaled_outstanding;
    // Verify.
    match a.op {
        Op::Write => {
            // READ the remote buffer back and compare with what we wrote.
            let mut rd = send_wr(&side, 9_999_999, WrOpcode::RdmaRead, size, size, true);
            rd.remote_addr = peer.addr;
            rd.rkey = peer.rkey;
            side.ctx.post_send(side.qp, &[rd])?;
            wcs.clear();
            poll_n(&side, 1, &mut wcs, deadline)?;
            let (lo, hi) = side.buf.split_at(size as usize);
            if wcs[0].status != WcStatus::Success || lo != &hi[..size as usize] {
                errors += 1;
            }
        }
        Op::Read => {
            let mut expect = vec![0u8; size as usize];
            pattern(seed, &mut expect);
            if side.buf[size as usize..(2 * size) as usize] != expect[..] {
                errors += 1;
            }
        }
        Op::Atomic => {
            // The counter went up by one per FETCH_AND_ADD: samples + iters in all.
            let mut rd = send_wr(&side, 9_999_998, WrOpcode::RdmaRead, size, 8, true);
            rd.remote_addr = peer.addr;
            rd.rkey = peer.rkey;
            side.ctx.post_send(side.qp, &[rd])?;
            wcs.clear();
            poll_n(&side, 1, &mut wcs, deadline)?;
            let mut init = [0u8; 8];
            pattern(seed, &mut init);
            let start = u64::from_ne_bytes(init);
            let now = u64::from_ne_bytes(side.buf[size as usize..size as usize + 8].try_into()?);
            if now.wrapping_sub(start) != u64::from(samples) + u64::from(a.iters) {
                errors += 1;
            }
        }
        Op::Send => {}
    }
    send_line(&mut w, &"done")?;
    let peer_errors: u64 = read_line(&mut r)?;
    errors += peer_errors;
    let bytes = u64::from(a.iters) * size;
    let p50 = percentile(&mut lat, 0.5);
    let p99 = percentile(&mut lat, 0.99);
    drop(side);
    Ok(PerfResult {
        op: a.op,
        size,
        bw_mbps: bytes as f64 / secs / 1e6,
        msg_rate: f64::from(a.iters) / secs,
        lat_us_p50: p50,
        lat_us_p99: p99,
        errors,
    })
}

/// Entry point.
pub fn run(a: PerfArgs) -> u8 {
    MTU.with(|m| m.set(mtu_enum(a.mtu)));
    if a.server {
        return match serve(&a) {
            Ok(()) => exit::OK,
            Err(e) => {
                eprintln!("mrkit perf: {e:#}");
                exit::VERB_FAILED
            }
        };
    }
    let Some(server) = a.client.clone() else {
        eprintln!("mrkit perf: give --server or --client ADDR");
        return exit::USAGE;
    };
    match run_client(&a, &server) {
        Ok(res) => {
            if a.json {
                println!("{}", serde_json::to_string(&res).expect("json"));
            } else {
                println!(
                    "{:?} {} B: {:.1} MB/s, {:.0} msg/s, RTT p50 {:.1} µs p99 {:.1} µs, errors {}",
                    res.op,
                    res.size,
                    res.bw_mbps,
                    res.msg_rate,
                    res.lat_us_p50,
                    res.lat_us_p99,
                    res.errors
                );
            }
            if res.errors == 0 {
                exit::OK
            } else {
                exit::VERB_FAILED
            }
        }
        Err(e) => {
            eprintln!("mrkit perf: {e:#}");
            exit::VERB_FAILED
        }
    }
}
