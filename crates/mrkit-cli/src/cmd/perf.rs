//! `mrkit perf`: a perftest-like pair on any device (mrkit0 by default, or `--device NAME`:
//! an rdma-core device such as `rdma-core:mlx5_0`).
//!
//! The server listens on TCP (default port 18515) for the out-of-band exchange, as perftest
//! does, then serves one client at a time. The exchange is mrkit's TCP handshake
//! (`mrkit::tcp`: each side's QP endpoint plus private data, here a JSON [`Hello`] with the
//! buffer address, rkey, operation and size), followed by a few JSON lines on the same socket
//! ("ready", the client's "done", the server's error count). The client runs the operation
//! with a window of outstanding work requests, verifies the data, and prints bandwidth,
//! message rate and round-trip latency (JSON keys `op`, `size`, `bw_mbps`, `msg_rate`,
//! `lat_us_p50`, `lat_us_p99`, `errors`). Queue pairs are `mrkit::QueuePair`s connected by
//! the handshake; the measured loops post and poll through the device's `Provider` verbs on
//! their handles (inline and unsignaled work requests, as perftest posts them).
//!
//! The server treats every client as hostile: it listens on the device's own address unless
//! told otherwise (`--listen`), bounds the handshake and every later line by a deadline and
//! a length, checks every field of a client's hello before it creates a queue pair or
//! registers memory for it, and tears each client down in order when it finishes or fails:
//! QP (no further access), then MR (deregistered: the old rkey is refused from then on), then
//! the buffer and the PD. The buffer is owned by its MR (`mrkit::MemoryRegion`), so it cannot
//! be freed while registered.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use mrkit::provider::{send_flags, RecvWr, SendWr, Sge, WrOpcode};
use mrkit::tcp::{self, HandshakeOpts, Listener};
use mrkit::{
    AccessFlags, ConnectOpts, Context, DeviceConfig, Endpoint, MemoryRegion, Mtu, ProtectionDomain,
    Provider, QpCap, QueuePair, RawHandles, WcStatus, WorkCompletion as Wc,
};
use serde::{Deserialize, Serialize};

use super::device::Selected;
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
    after_help = "Examples:\n  mrkit perf --server --addr 127.0.0.2\n  mrkit perf --client 127.0.0.2 --op write --size 64KiB --iters 2000 --json\n  MRKIT_FAULTS=loss=1% mrkit perf --client 127.0.0.2 --op read --size 4096\n  mrkit perf --server --device rdma-core:mlx5_0\n  mrkit perf --client 192.0.2.1 --device rdma-core:mlx5_0 --op send --size 8"
)]
pub struct PerfArgs {
    /// Run the server (passive side).
    #[arg(long, conflicts_with = "client")]
    server: bool,
    /// Run the client against the server at this address.
    #[arg(long, value_name = "ADDR")]
    client: Option<String>,
    /// mrkit0's device address (RoCEv2 GID): default MRKIT_ADDR or a distinct 127.x.y.z.
    /// Another device's address is its GID and cannot be set here.
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

/// What each side sends as the handshake's private data (at most 256 bytes of JSON): its
/// buffer, and what the client asks for (the server echoes the request with its own buffer).
/// The QP number, PSN and GID travel in the handshake's endpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Hello {
    addr: u64,
    rkey: u32,
    len: u64,
    op: Op,
    size: u64,
    seed: u8,
    /// SEND: round trips of the echo (latency) phase.
    #[serde(default)]
    echo: u32,
    /// SEND: messages of the receive (bandwidth) phase.
    #[serde(default)]
    bulk: u32,
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

/// One connection's resources. Dropping it tears them down in field order: the queue pair
/// first (QP destroyed: the device stops processing it; then its CQs), then the MR
/// (deregistered: every later access with its keys is refused), then the buffer the MR owns
/// and the PD (held by the MR).
struct Side {
    /// Connected by the handshake; the loops drive it through `dev` on `h`. Held for its
    /// place in the drop order.
    _qp: QueuePair,
    /// Owns the buffer: it is freed only after deregistration.
    mr: MemoryRegion,
    dev: Arc<dyn Provider>,
    h: RawHandles,
}

impl Side {
    fn new(qp: QueuePair, mr: MemoryRegion) -> Side {
        let dev = qp.context().provider().clone();
        let h = qp.raw_handles();
        Side {
            _qp: qp,
            mr,
            dev,
            h,
        }
    }
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
    fn post_send(&self, wrs: &[SendWr]) -> anyhow::Result<()> {
        self.dev.post_send(self.h.qpn, wrs).map_err(|e| e.error)?;
        Ok(())
    }
    fn post_recv(&self, wrs: &[RecvWr]) -> anyhow::Result<()> {
        self.dev.post_recv(self.h.qpn, wrs).map_err(|e| e.error)?;
        Ok(())
    }
}

fn mtu_of(bytes: u32) -> Mtu {
    match bytes {
        0..=256 => Mtu::B256,
        257..=512 => Mtu::B512,
        513..=1024 => Mtu::B1024,
        1025..=2048 => Mtu::B2048,
        _ => Mtu::B4096,
    }
}

/// The connection's attributes: perftest's ACK timeout 14 (≈ 67 ms) and seven retries (with
/// 12, ≈ 17 ms, a peer kept off the CPU for ~130 ms on a loaded 2-vCPU machine ended the run).
fn connect_opts(mtu: u32) -> ConnectOpts {
    ConnectOpts {
        path_mtu: mtu_of(mtu),
        timeout: 14,
        retry_cnt: 7,
        ..ConnectOpts::default()
    }
}

/// Work requests each queue may hold (the server keeps 512 receives posted; the client's
/// window is at most 512).
fn qp_cap() -> QpCap {
    QpCap {
        max_send_wr: 1024,
        max_recv_wr: 1024,
        ..QpCap::default()
    }
}

/// mrkit0 with `MRKIT_*` and `--addr`, its RoCEv2 address bound at once (a taken address
/// fails here).
pub(crate) fn open_embedded(addr: Option<&str>) -> anyhow::Result<Context> {
    let mut cfg = DeviceConfig::from_env().map_err(anyhow::Error::msg)?;
    if let Some(a) = addr {
        cfg = cfg.udp_addr(mrkit_soft::net::udp::parse_addr(a).map_err(anyhow::Error::msg)?);
    }
    let ctx = Context::open(cfg);
    device_ip(&ctx)?;
    Ok(ctx)
}

/// The device's RoCEv2 address: its GID (port 1, index 0) as an IP address.
fn device_ip(ctx: &Context) -> anyhow::Result<IpAddr> {
    let gid = std::net::Ipv6Addr::from(ctx.provider().query_gid()?);
    Ok(match gid.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(gid),
    })
}

/// A registered buffer for one connection; `fill` writes its initial contents before it is
/// registered.
fn register(
    pd: &ProtectionDomain,
    len: usize,
    fill: impl FnOnce(&mut [u8]),
) -> anyhow::Result<MemoryRegion> {
    let mut buf = mrkit::Buffer::new(len.max(64))?;
    fill(buf.as_mut_slice());
    Ok(pd.register(
        buf,
        AccessFlags::LOCAL_WRITE
            | AccessFlags::REMOTE_WRITE
            | AccessFlags::REMOTE_READ
            | AccessFlags::REMOTE_ATOMIC,
    )?)
}

fn send_line<T: Serialize>(s: &mut TcpStream, v: &T) -> anyhow::Result<()> {
    let mut line = serde_json::to_string(v)?;
    line.push('\n');
    s.write_all(line.as_bytes())?;
    Ok(())
}

/// Longest line accepted after the handshake (the longest is a number or a word).
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

/// The side channel after the handshake: writer and bounded reader, both with `timeout`.
fn split(
    stream: TcpStream,
    timeout: Duration,
) -> anyhow::Result<(TcpStream, BufReader<TcpStream>)> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let w = stream.try_clone()?;
    Ok((w, BufReader::new(stream)))
}

fn pattern(seed: u8, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(13).wrapping_add(seed);
    }
}

/// Poll `cq` until `n` more completions are in `out`.
fn poll_n(
    side: &Side,
    cq: u32,
    n: usize,
    out: &mut Vec<Wc>,
    deadline: Instant,
) -> anyhow::Result<()> {
    let start = out.len();
    let mut polls = 0u32;
    while out.len() - start < n {
        let want = n - (out.len() - start);
        side.dev.poll_cq(cq, out, want)?;
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

/// Completions of one side's echo loop. A SEND's completion needs the peer's ACK, which may
/// travel with or behind the peer's next message (delayed ACKs), or be lost and resent; it
/// arrives on the send CQ, receives on the receive CQ, so the loop waits on the receive CQ
/// alone and reaps send completions in batches (`sends` is the number still unpolled).
#[derive(Default)]
struct EchoCompletions {
    sends: u32,
    errors: u64,
    wcs: Vec<Wc>,
}

impl EchoCompletions {
    /// The next receive completion.
    fn next_recv(&mut self, side: &Side, deadline: Instant) -> anyhow::Result<Wc> {
        self.wcs.clear();
        poll_n(side, side.h.recv_cq, 1, &mut self.wcs, deadline)?;
        Ok(self.wcs[0])
    }

    /// Poll until at most `left` sends are unpolled.
    fn reap_sends(&mut self, side: &Side, left: u32, deadline: Instant) -> anyhow::Result<()> {
        if self.sends <= left {
            return Ok(());
        }
        self.wcs.clear();
        poll_n(
            side,
            side.h.send_cq,
            (self.sends - left) as usize,
            &mut self.wcs,
            deadline,
        )?;
        self.sends = left;
        self.errors += self
            .wcs
            .iter()
            .filter(|w| w.status != WcStatus::Success)
            .count() as u64;
        Ok(())
    }
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

/// Check a client's hello (its endpoint `ep` and request `h`) before anything is allocated
/// for it. The endpoint's QP number, PSN and address were checked by the handshake (a
/// 24-bit RC QP number, a 24-bit PSN, a unicast GID).
fn validate_hello(
    h: &Hello,
    ep: &Endpoint,
    ours: IpAddr,
    lim: &ServerLimits,
) -> anyhow::Result<()> {
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
    if ep.ip().is_ipv4() != ours.is_ipv4() {
        anyhow::bail!("address {} is not a unicast peer for {ours}", ep.ip());
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
    if h.op == Op::Send && (h.echo > MAX_ECHO || h.bulk > MAX_BULK) {
        anyhow::bail!(
            "asked for {} echoes and {} messages (at most {MAX_ECHO} and {MAX_BULK})",
            h.echo,
            h.bulk
        );
    }
    Ok(())
}

/// What a server reports after each client: the device's live objects on mrkit0, where the
/// device counts them (every one of the client's must be gone).
fn live_objects(ctx: &Context) -> String {
    match ctx.soft() {
        Some(dev) => {
            let r = dev.resource_counts();
            format!(
                "pd {} mr {} qp {} cq {} mw {}, pinned {} B, memlock {} pages",
                r.pds,
                r.mrs,
                r.qps,
                r.cqs,
                r.mws,
                dev.stats().pinned_bytes,
                mrkit_soft::mem::account::pinned_pages()
            )
        }
        None => format!("not counted by {} (mrkit0 counts its objects)", ctx.name()),
    }
}

/// Server: serve clients one at a time.
fn serve(a: &PerfArgs, ctx: &Context) -> anyhow::Result<()> {
    if !(a.client_timeout > 0.0 && a.client_timeout.is_finite()) {
        anyhow::bail!("--client-timeout needs a positive number of seconds");
    }
    let lim = ServerLimits {
        max_size: a.max_size.max(1),
        timeout: Duration::try_from_secs_f64(a.client_timeout)?,
    };
    // One device for all clients (its address stays bound); resources per client.
    let ours = device_ip(ctx)?;
    let at = SocketAddr::new(a.listen.unwrap_or(ours), a.port);
    let listener = Listener::bind(at).map_err(|e| {
        let hint = if a.listen.is_none() {
            " (the device's address, its GID; --listen IP chooses another)"
        } else {
            ""
        };
        anyhow::anyhow!("cannot listen on {at}{hint}: {e}")
    })?;
    eprintln!("mrkit perf: server listening on {}", listener.local_addr()?);
    let mut served = 0;
    loop {
        let (conn, who) = match listener.accept_stream(None) {
            Ok(c) => c,
            Err(e) => {
                // E.g. out of descriptors: not fatal.
                eprintln!("mrkit perf: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if let Err(e) = serve_one(ctx, conn, ours, &lim, a.mtu) {
            eprintln!("mrkit perf: client {who} failed: {e:#}");
        }
        // Every resource of the client is gone by now (see `Side`).
        eprintln!("mrkit perf: client {who} done; live: {}", live_objects(ctx));
        served += 1;
        if a.count != 0 && served >= a.count {
            break;
        }
    }
    Ok(())
}

fn serve_one(
    ctx: &Context,
    conn: TcpStream,
    ours: IpAddr,
    lim: &ServerLimits,
    mtu: u32,
) -> anyhow::Result<()> {
    // A PD holds no memory; the MR and the QP are made only for an admitted hello.
    let pd = ctx.alloc_pd()?;
    let mut admitted: Option<(Hello, MemoryRegion)> = None;
    let opts = HandshakeOpts {
        connect: connect_opts(mtu),
        // A silent or stalled client is dropped after the timeout instead of blocking us.
        timeout: lim.timeout,
        accept_timeout: None,
        private_data: Vec::new(),
    };
    let c = tcp::accept_on(conn, &pd, qp_cap(), &opts, |ep, private| {
        let admit = || -> anyhow::Result<(Vec<u8>, Hello, MemoryRegion)> {
            let peer: Hello = serde_json::from_slice(private)
                .map_err(|e| anyhow::anyhow!("the client's hello is not valid: {e}"))?;
            validate_hello(&peer, ep, ours, lim)?;
            // size ≤ --max-size: checked anyway, so an absurd --max-size cannot wrap.
            let len = peer
                .size
                .max(8)
                .checked_mul(2)
                .and_then(|l| usize::try_from(l).ok())
                .ok_or_else(|| anyhow::anyhow!("size {} is too large", peer.size))?;
            let mr = register(&pd, len, |b| pattern(peer.seed, b))?;
            let me = Hello {
                addr: mr.info().iova,
                rkey: mr.rkey(),
                len: mr.as_slice().len() as u64,
                ..peer.clone()
            };
            Ok((serde_json::to_vec(&me)?, peer, mr))
        };
        match admit() {
            Ok((bytes, peer, mr)) => {
                admitted = Some((peer, mr));
                Ok(bytes)
            }
            Err(e) => Err(format!("{e:#}")),
        }
    })?;
    let Some((peer, mr)) = admitted else {
        anyhow::bail!("the handshake ended without an admitted hello");
    };
    let side = Side::new(c.qp, mr);
    let (mut w, mut r) = split(c.stream, lim.timeout)?;
    let size = peer.size;
    if peer.op == Op::Send {
        let wrs: Vec<RecvWr> = (0..512).map(|i| recv_wr(&side, i, 0, size)).collect();
        side.post_recv(&wrs)?;
    }
    // The receives are posted: the client may start.
    send_line(&mut w, &"ready")?;
    let mut errors = 0u64;
    if peer.op == Op::Send {
        // Echo phase (latency), then receive phase (bandwidth); the hello gave the counts.
        let (echo, bulk) = (peer.echo, peer.bulk);
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
            side.post_send(std::slice::from_ref(&reply))?;
            c.sends += 1;
            side.post_recv(&[recv_wr(&side, 1000 + u64::from(i), 0, size)])?;
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
            side.post_recv(&[recv_wr(&side, 2000 + u64::from(i), 0, size)])?;
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

/// Client: one measurement with explicit parameters on `ctx` (used by `mrkit bench
/// transport`).
pub fn run_client_with(
    ctx: &Context,
    server: &str,
    port: u16,
    op: Op,
    size: u64,
    iters: u32,
    window: u32,
) -> anyhow::Result<PerfResult> {
    let a = PerfArgs {
        server: false,
        client: Some(server.to_string()),
        addr: None,
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
    run_client(&a, server, ctx)
}

/// Client: one measurement on a fresh mrkit0 at `addr` (used by the benches: each run its
/// own device and address, as a separate `mrkit perf --client` would have).
pub fn run_client_embedded(
    server: &str,
    port: u16,
    addr: Option<&str>,
    op: Op,
    size: u64,
    iters: u32,
    window: u32,
) -> anyhow::Result<PerfResult> {
    let ctx = open_embedded(addr)?;
    run_client_with(&ctx, server, port, op, size, iters, window)
}

/// Client: run one measurement on `ctx`.
pub fn run_client(a: &PerfArgs, server: &str, ctx: &Context) -> anyhow::Result<PerfResult> {
    let size = a.size.max(if a.op == Op::Atomic { 8 } else { 1 });
    let size = if a.op == Op::Atomic { 8 } else { size };
    let tcp_ip = mrkit_soft::net::udp::parse_addr(server)
        .map_err(anyhow::Error::msg)?
        .ip();
    let seed = 0x5a;
    let len = size
        .checked_mul(2)
        .and_then(|l| usize::try_from(l).ok())
        .ok_or_else(|| anyhow::anyhow!("size {size} is too large"))?;
    // Latency phase: one outstanding message, iters/4 samples (at least 20).
    let samples = (a.iters / 4).clamp(20, 10_000);
    let pd = ctx.alloc_pd()?;
    let mr = register(&pd, len, |_| {})?;
    let hello = Hello {
        addr: mr.info().iova,
        rkey: mr.rkey(),
        len: mr.as_slice().len() as u64,
        op: a.op,
        size,
        seed,
        echo: if a.op == Op::Send { samples } else { 0 },
        bulk: if a.op == Op::Send { a.iters } else { 0 },
    };
    let opts = HandshakeOpts {
        connect: connect_opts(a.mtu),
        private_data: serde_json::to_vec(&hello)?,
        ..HandshakeOpts::default()
    };
    let c = tcp::connect(SocketAddr::new(tcp_ip, a.port), &pd, qp_cap(), &opts)?;
    let peer: Hello = serde_json::from_slice(&c.private_data)
        .map_err(|e| anyhow::anyhow!("the server's hello is not valid: {e}"))?;
    if peer.len < size || peer.addr.checked_add(peer.len).is_none() {
        anyhow::bail!(
            "the server's buffer {:#x}+{} cannot hold {size} bytes",
            peer.addr,
            peer.len
        );
    }
    let mut side = Side::new(c.qp, mr);
    let (mut w, mut r) = split(c.stream, Duration::from_secs(30))?;
    let _ready: String = read_line(&mut r)?;
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
    if a.op == Op::Send {
        let recvs: Vec<RecvWr> = (0..64)
            .map(|i| recv_wr(&side, 5000 + i, size, size))
            .collect();
        side.post_recv(&recvs)?;
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
        side.post_send(&wr)?;
        if a.op == Op::Send {
            echo.sends += 1;
            let wc = echo.next_recv(&side, deadline)?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            echo.errors += u64::from(
                wc.status != WcStatus::Success || u64::from(wc.byte_len) != size.min(ECHO_MAX),
            );
            side.post_recv(&[recv_wr(&side, 6000 + u64::from(i), size, size)])?;
        } else {
            wcs.clear();
            poll_n(&side, side.h.send_cq, 1, &mut wcs, deadline)?;
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
    while completed < a.iters {
        while posted < a.iters && posted - completed < window {
            let sig = (posted + 1) % sig_every == 0 || posted + 1 == a.iters;
            side.post_send(&[make(&side, u64::from(posted), sig)])?;
            posted += 1;
        }
        wcs.clear();
        side.dev.poll_cq(side.h.send_cq, &mut wcs, 64)?;
        for wc in &wcs {
            if wc.status != WcStatus::Success {
                anyhow::bail!("completion error {:?} (wr {})", wc.status, wc.wr_id);
            }
            // A signaled completion retires every WR up to it (RC completes in order).
            completed = (wc.wr_id as u32 + 1).max(completed);
        }
        if Instant::now() > deadline {
            anyhow::bail!("bandwidth phase timed out");
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    // Verify.
    match a.op {
        Op::Write => {
            // READ the remote buffer back and compare with what we wrote.
            let mut rd = send_wr(&side, 9_999_999, WrOpcode::RdmaRead, size, size, true);
            rd.remote_addr = peer.addr;
            rd.rkey = peer.rkey;
            side.post_send(&[rd])?;
            wcs.clear();
            poll_n(&side, side.h.send_cq, 1, &mut wcs, deadline)?;
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
            side.post_send(&[rd])?;
            wcs.clear();
            poll_n(&side, side.h.send_cq, 1, &mut wcs, deadline)?;
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
    r.get_ref().set_read_timeout(Some(VERDICT_TIMEOUT))?;
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
pub fn run(a: PerfArgs, dev: &Selected) -> u8 {
    if !a.server && a.client.is_none() {
        eprintln!("mrkit perf: give --server or --client ADDR");
        return exit::USAGE;
    }
    let ctx = if dev.is_embedded() {
        match open_embedded(a.addr.as_deref()) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("mrkit perf: {e:#}");
                return exit::VERB_FAILED;
            }
        }
    } else {
        // A device other than mrkit0 has its address in its GID table.
        if a.addr.is_some() {
            eprintln!(
                "mrkit perf: --addr sets mrkit0's RoCEv2 address; the address of {} is its GID \
                 (for the drop-in libibverbs, set MRKIT_ADDR in its environment)",
                dev.name()
            );
            return exit::USAGE;
        }
        match dev.open("perf") {
            Ok(c) => c,
            Err(code) => return code,
        }
    };
    if a.server {
        return match serve(&a, &ctx) {
            Ok(()) => exit::OK,
            Err(e) => {
                eprintln!("mrkit perf: {e:#}");
                exit::VERB_FAILED
            }
        };
    }
    let server = a.client.clone().unwrap_or_default();
    match run_client(&a, &server, &ctx) {
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
