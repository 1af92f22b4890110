//! `mrkit perf`: a perftest-like pair over RoCEv2/UDP on mrkit0.
//!
//! The server listens on TCP (default port 18515) for the out-of-band exchange (QPN, PSN, GID,
//! buffer address, rkey), as perftest does, then serves one client at a time. The client runs
//! the operation with a window of outstanding work requests, verifies the data, and prints
//! bandwidth, message rate and round-trip latency (JSON keys `op`, `size`, `bw_mbps`,
//! `msg_rate`, `lat_us_p50`, `lat_us_p99`, `errors`).
//!
//! The server treats every client as hostile: it listens on the device's own address unless
//! told otherwise (`--listen`), reads exchange lines of bounded length with a timeout, checks
//! every field of a client's hello before allocating anything, and tears each client down in
//! order when it finishes or fails: QP (no further access), then MR (deregistered: the old
//! rkey is refused from then on), then the buffer, CQ and PD. The buffer is owned by its MR
//! (`mrkit::MemoryRegion`), so it cannot be freed while registered.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use mrkit_soft::cq::{Wc, WcOpcode, WcStatus};
use mrkit_soft::qp::connect::{connect_qp, ConnectOpts, RemoteQp};
use mrkit_soft::qp::{send_flags, QpCap, QpInitAttr, RecvWr, SendWr, Sge, WrOpcode};
use mrkit_soft::{AccessFlags, Context, DeviceConfig};
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
    /// TCP address the server listens on (default: the device's own address, never every
    /// interface unless asked, e.g. `--listen 0.0.0.0`).
    #[arg(long, value_name = "IP")]
    listen: Option<IpAddr>,
    /// Largest message size a client may ask the server for.
    #[arg(long, default_value = "16MiB", value_parser = parse_size)]
    max_size: u64,
    /// Seconds the server waits for each exchange line of a client before dropping it (the
    /// verdict after the measurement may take up to the client's own 300 s limit).
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    client_timeout: f64,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    mrkit_soft::device::parse_size(s).ok_or_else(|| format!("`{s}` is not a size"))
}

/// Out-of-band exchange message.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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

/// One connection's resources. Dropping it tears them down in order: the QP first (the device
/// stops processing it), then the MR (deregistered: every later access with its keys is
/// refused), then the buffer the MR owns, the CQ and the PD.
struct Side {
    ctx: Context,
    cq: u32,
    qp: u32,
    /// Owns the buffer: it is freed only after deregistration.
    mr: mrkit::MemoryRegion,
}

impl Side {
    fn buf(&self) -> &[u8] {
        self.mr.as_slice()
    }
    fn buf_mut(&mut self) -> &mut [u8] {
        self.mr.as_mut_slice()
    }
    fn iova(&self) -> u64 {
        self.mr.info().iova
    }
    fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        // QP before MR: no work request of this connection can reach the memory afterwards
        // (deregistration below would wait for one in flight anyway).
        if let Err(e) = self.ctx.destroy_qp(self.qp) {
            tracing::warn!(error = %e, qp = self.qp, "destroy_qp failed");
        }
        if let Err(e) = self.ctx.destroy_cq(self.cq) {
            tracing::warn!(error = %e, cq = self.cq, "destroy_cq failed");
        }
        // Then the field `mr` drops: dereg, then the buffer is unmapped, then the PD (held by
        // the MR) is deallocated.
    }
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
    side_on(open_device(addr)?, len, |_| {})
}

/// Resources for one connection on an opened device; `fill` writes the buffer's initial
/// contents before it is registered. On an error, whatever was created is released again.
fn side_on(ctx: Context, len: usize, fill: impl FnOnce(&mut [u8])) -> anyhow::Result<Side> {
    // The safe API: the MR owns its buffer and the PD is released with its last user.
    let dev = mrkit::Context::from_provider(std::sync::Arc::new(ctx.clone()));
    let pd = dev.alloc_pd()?;
    let mut buf = mrkit::Buffer::new(len.max(64))?;
    fill(buf.as_mut_slice());
    let mr = pd.register(
        buf,
        AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC,
    )?;
    let cq = ctx.create_cq(8192, None)?;
    let qp = ctx.create_qp(QpInitAttr {
        pd: pd.handle(),
        send_cq: cq,
        recv_cq: cq,
        cap: QpCap {
            max_send_wr: 1024,
            max_recv_wr: 1024,
            ..QpCap::default()
        },
        sq_sig_all: false,
    });
    let qp = match qp {
        Ok((qp, _)) => qp,
        Err(e) => {
            let _ = ctx.destroy_cq(cq);
            return Err(e.into());
        }
    };
    Ok(Side { ctx, cq, qp, mr })
}

fn send_line<T: Serialize>(s: &mut TcpStream, v: &T) -> anyhow::Result<()> {
    let mut line = serde_json::to_string(v)?;
    line.push('\n');
    s.write_all(line.as_bytes())?;
    Ok(())
}

/// Longest exchange line accepted (a hello is about 150 bytes).
const MAX_LINE: u64 = 4096;

fn read_line<T: for<'de> Deserialize<'de>>(r: &mut BufReader<TcpStream>) -> anyhow::Result<T> {
    let mut line = Vec::new();
    // Bounded: a peer sending an endless line cannot make us buffer it.
    let n = match r.by_ref().take(MAX_LINE + 1).read_until(b'\n', &mut line) {
        Ok(n) => n,
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            let t = r
                .get_ref()
                .read_timeout()
                .ok()
                .flatten()
                .unwrap_or_default();
            anyhow::bail!(
                "timed out: the peer sent no complete line for {} s",
                t.as_secs_f64()
            );
        }
        Err(e) => return Err(e.into()),
    };
    if n == 0 {
        anyhow::bail!("peer closed the exchange connection");
    }
    if !line.ends_with(b"\n") {
        if n as u64 > MAX_LINE {
            anyhow::bail!("exchange line longer than {MAX_LINE} bytes");
        }
        anyhow::bail!("peer closed the exchange connection mid-line");
    }
    Ok(serde_json::from_slice(line.trim_ascii())?)
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
        addr: side.iova(),
        rkey: side.mr.rkey(),
        len: side.buf().len() as u64,
        op,
        size,
        seed,
    })
}

fn recv_wr(side: &Side, id: u64, off: u64, len: u64) -> RecvWr {
    RecvWr {
        wr_id: id,
        sg_list: vec![Sge {
            addr: side.iova() + off,
            length: len as u32,
            lkey: side.lkey(),
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
        w.inline_data = side.buf()[off as usize..(off + len) as usize].to_vec();
        return w;
    }
    w.sg_list = vec![Sge {
        addr: side.iova() + off,
        length: len as u32,
        lkey: side.lkey(),
    }];
    w
}

/// Limits the server applies to what clients ask for.
#[derive(Debug, Clone, Copy)]
struct ServerLimits {
    max_size: u64,
    timeout: Duration,
}

/// Echo round trips a SEND client may ask for (the client takes at most 10 000 samples).
const MAX_ECHO: u32 = 10_000;
/// Messages of a SEND client's bandwidth phase.
const MAX_BULK: u32 = 10_000_000;
/// How long the server waits for a client's verdict after the exchange: the client's own
/// limit for its measurement.
const VERDICT_TIMEOUT: Duration = Duration::from_secs(300);

/// Check a client's hello before anything is allocated for it.
fn validate_hello(h: &Hello, ours: IpAddr, lim: &ServerLimits) -> anyhow::Result<()> {
    if h.size == 0 || h.size > lim.max_size {
        anyhow::bail!(
            "size {} outside 1 ..= {} (--max-size)",
            h.size,
            lim.max_size
        );
    }
    if h.op == Op::Atomic && h.size != 8 {
        anyhow::bail!("atomic size must be 8, not {}", h.size);
    }
    // 24-bit QP numbers; 0 and 1 are the special QPs.
    if !(2..=0xff_ffff).contains(&h.qpn) {
        anyhow::bail!("qpn {:#x} is not a 24-bit RC QP number", h.qpn);
    }
    if h.psn > 0xff_ffff {
        anyhow::bail!("psn {:#x} is not 24 bits", h.psn);
    }
    let unicast = match h.ip {
        IpAddr::V4(v) => !(v.is_unspecified() || v.is_multicast() || v.is_broadcast()),
        IpAddr::V6(v) => !(v.is_unspecified() || v.is_multicast()),
    };
    if !unicast || h.ip.is_ipv4() != ours.is_ipv4() {
        anyhow::bail!("address {} is not a unicast peer for {ours}", h.ip);
    }
    // The client's buffer: never used by the server, but it must describe a real range.
    if h.len < h.size || h.addr.checked_add(h.len).is_none() {
        anyhow::bail!(
            "buffer {:#x}+{} cannot hold {} bytes",
            h.addr,
            h.len,
            h.size
        );
    }
    Ok(())
}

/// Server: serve clients one at a time.
fn serve(a: &PerfArgs) -> anyhow::Result<()> {
    if !(a.client_timeout > 0.0 && a.client_timeout.is_finite()) {
        anyhow::bail!("--client-timeout needs a positive number of seconds");
    }
    let lim = ServerLimits {
        max_size: a.max_size.max(1),
        timeout: Duration::try_from_secs_f64(a.client_timeout)?,
    };
    // One device for all clients (its UDP address stays bound); resources per client.
    let dev = open_device(a.addr.as_deref())?;
    let ours = dev.udp_port()?.local_addr().ip();
    let listener = TcpListener::bind(SocketAddr::new(a.listen.unwrap_or(ours), a.port))?;
    eprintln!("mrkit perf: server listening on {}", listener.local_addr()?);
    let mut served = 0;
    for conn in listener.incoming() {
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                // E.g. a connection reset before accept, or out of descriptors: not fatal.
                eprintln!("mrkit perf: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let who = conn
            .peer_addr()
            .map_or_else(|_| "?".to_string(), |p| p.to_string());
        if let Err(e) = serve_one(&dev, conn, ours, &lim) {
            eprintln!("mrkit perf: client {who} failed: {e:#}");
        }
        // Every resource of the client is gone by now (see `Side`).
        let r = dev.resource_counts();
        eprintln!(
            "mrkit perf: client {who} done; live: pd {} mr {} qp {} cq {} mw {}, pinned {} B, \
             memlock {} pages",
            r.pds,
            r.mrs,
            r.qps,
            r.cqs,
            r.mws,
            dev.stats().pinned_bytes,
            mrkit_soft::mem::account::pinned_pages()
        );
        served += 1;
        if a.count != 0 && served >= a.count {
            break;
        }
    }
    Ok(())
}

fn serve_one(
    dev: &Context,
    conn: TcpStream,
    ours: IpAddr,
    lim: &ServerLimits,
) -> anyhow::Result<()> {
    conn.set_nodelay(true)?;
    // A silent or stalled client is dropped after the timeout instead of blocking the server.
    conn.set_read_timeout(Some(lim.timeout))?;
    conn.set_write_timeout(Some(lim.timeout))?;
    let mut w = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    let peer: Hello = read_line(&mut r)?;
    validate_hello(&peer, ours, lim)?;
    // size ≤ --max-size: checked anyway, so an absurd --max-size cannot wrap.
    let len = peer
        .size
        .max(8)
        .checked_mul(2)
        .and_then(|l| usize::try_from(l).ok())
        .ok_or_else(|| anyhow::anyhow!("size {} is too large", peer.size))?;
    let side = side_on(dev.clone(), len, |b| pattern(peer.seed, b))?;
    let me = hello(&side, peer.op, peer.size, peer.seed)?;
    connect(&side, &peer)?;
    let size = peer.size;
    if peer.op == Op::Send {
        let wrs: Vec<RecvWr> = (0..512).map(|i| recv_wr(&side, i, 0, size)).collect();
        side.ctx.post_recv(side.qp, &wrs)?;
    }
    send_line(&mut w, &me)?;
    let mut errors = 0u64;
    if peer.op == Op::Send {
        // Echo phase (latency), then receive phase (bandwidth); the client tells the count.
        let (echo, bulk): (u32, u32) = read_line(&mut r)?;
        if echo > MAX_ECHO || bulk > MAX_BULK {
            anyhow::bail!(
                "asked for {echo} echoes and {bulk} messages (at most {MAX_ECHO} and {MAX_BULK})"
            );
        }
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
            if bad || (i + 1 == bulk && side.buf()[..size as usize] != expect[..]) {
                errors += 1;
            }
            side.ctx
                .post_recv(side.qp, &[recv_wr(&side, 2000 + u64::from(i), 0, size)])?;
        }
        errors += c.errors;
    }
    // Wait for the client's verdict (it measures meanwhile); reply with our error count.
    r.get_ref().set_read_timeout(Some(VERDICT_TIMEOUT))?;
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
        listen: None,
        max_size: 16 << 20,
        client_timeout: 10.0,
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
    let len = size
        .checked_mul(2)
        .and_then(|l| usize::try_from(l).ok())
        .ok_or_else(|| anyhow::anyhow!("size {size} is too large"))?;
    let mut side = open_side(a.addr.as_deref(), len)?;
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
            wr.sg_list[0].addr = side.iova() + size; // result lands in the second half
        }
        if a.op == Op::Read {
            wr.sg_list[0].addr = side.iova() + size;
        }
        wr
    };
    pattern(seed.wrapping_add(1), &mut side.buf_mut()[..size as usize]);
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
            let (lo, hi) = side.buf().split_at(size as usize);
            if wcs[0].status != WcStatus::Success || lo != &hi[..size as usize] {
                errors += 1;
            }
        }
        Op::Read => {
            let mut expect = vec![0u8; size as usize];
            pattern(seed, &mut expect);
            if side.buf()[size as usize..(2 * size) as usize] != expect[..] {
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
            let now = u64::from_ne_bytes(side.buf()[size as usize..size as usize + 8].try_into()?);
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
pub fn run(a: PerfArgs, dev: &super::device::Selected) -> u8 {
    if let Err(code) = dev.require_embedded("perf") {
        return code;
    }
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
