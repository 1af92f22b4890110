//! The UDP driver: RoCEv2 datagrams on port 4791 (configurable), with segmentation and receive
//! offload.
//!
//! * Each device instance binds its own address (`MRKIT_ADDR`, default: a distinct
//!   127.0.0.0/8 address per process and instance, so several processes on one host coexist)
//!   on port 4791; that address is its GID (IPv4-mapped, or IPv6).
//! * Sends leave from a socket bound to `(address, sport)` where `sport` is the QP's RoCEv2 UDP
//!   source port (`0xC000 | hash(qpn)`; beyond [`MAX_TX_SOCKETS`] distinct ports, QPs share
//!   existing ones), unconnected with `IP_PMTUDISC_PROBE`, so the kernel writes IP ID 0 with
//!   DF and the ICRC computed in advance is right (docs/roce.md §2.3).
//! * Runs of equally sized packets (the middle packets of a message) go out as one GSO send
//!   (`UDP_SEGMENT`); the kernel segments them. Receives use `recvmmsg` with `UDP_GRO`; a GRO
//!   batch is split back into datagrams by its stride.
//! * Everything one progress pass sends from one QP leaves in **one `sendmmsg`**: each GSO
//!   run is one message of the batch. (A message's first packet carries a RETH and is 16
//!   bytes longer than its middle packets, so it cannot share their GSO buffer; batching the
//!   runs keeps the system calls at about one per pass anyway.)
//! * The system calls themselves are in [`crate::net::sockio`], the link's only `unsafe` module.
//! * An optional [`FaultInjector`] sits on the send path.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

pub use crate::addr::{gid_of, ip_of_gid, parse_addr, ROCE_PORT};
use crate::net::sockio::{self, OutMsg, RecvMeta};

use crate::fault::{Corruptible, FaultConfig, FaultInjector, FaultStats};

/// Buffer size for one receive (a GRO batch of up to 64 × 4 KiB datagrams).
pub const RECV_BUF: usize = 64 * 4200;

/// Counts device instances of this process, so each gets its own default address.
/// Only ever incremented.
static INSTANCE: AtomicU32 = AtomicU32::new(0);

/// Candidate default addresses: 127.a.b.c derived from the pid and the instance number,
/// avoiding .0 and .255 octets and 127.0.0.1.
fn default_candidates() -> impl Iterator<Item = Ipv4Addr> {
    let pid = std::process::id();
    let inst = INSTANCE.fetch_add(1, Ordering::Relaxed);
    let mut h = (u64::from(pid) << 16 | u64::from(inst)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..64).map(move |_| {
        h = h
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let b = (h >> 40) as u32;
        let oct = |x: u32| (x % 253 + 1) as u8;
        Ipv4Addr::new(127, oct(b), oct(b >> 8), oct(b >> 16))
    })
}

/// Most send sockets (distinct UDP source ports) one device opens (`UdpPort::sport_for`).
pub const MAX_TX_SOCKETS: usize = 256;

/// One device's UDP endpoint.
pub struct UdpPort {
    local: SocketAddr,
    rx: UdpSocket,
    /// Segments one GSO send may carry (1: the kernel has no `UDP_SEGMENT`).
    max_gso_segments: usize,
    /// The receive socket has receive offload (`UDP_GRO`), which [`RecvBufs`] turns off
    /// while the traffic is request/response (see `RecvBufs::plain`).
    gro: bool,
    /// GRO is off on the receive socket (a copy of `RecvBufs::gro_off` for senders, written
    /// by the receiver when it switches). A hint: orders no other data.
    gro_is_off: AtomicBool,
    /// A sender switched GRO back on (`hold_gro`) because READ responses will arrive as GSO
    /// runs; the receiver takes note at its next pass. The sender's `set_gro` happens before
    /// its READ request leaves, so the responses find GRO on whatever the receiver knows; the
    /// flag orders no other data.
    gro_forced_on: AtomicBool,
    /// Send sockets by UDP source port (FxHash: the key is a port number we chose).
    tx: Mutex<HashMap<u16, UdpSocket, rustc_hash::FxBuildHasher>>,
    /// Once `MAX_TX_SOCKETS` send sockets exist: their ports, sorted, and no new ones
    /// ([`UdpPort::sport_for`]).
    tx_frozen: std::sync::OnceLock<Vec<u16>>,
    faults: Option<Mutex<FaultInjector<Outgoing>>>,
}

/// A datagram on its way through the fault injector.
#[derive(Debug, Clone)]
struct Outgoing {
    sport: u16,
    dst: SocketAddr,
    body: Vec<u8>,
}

impl Corruptible for Outgoing {
    fn flip_bit(&mut self, bit: u64) {
        self.body.flip_bit(bit);
    }
}

impl std::fmt::Debug for UdpPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdpPort")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

/// Datagrams a message becomes on the wire.
fn datagram_count(m: &OutMsg<'_>) -> usize {
    match m.segment {
        Some(seg) => m.bytes.len().div_ceil(usize::from(seg).max(1)),
        None => 1,
    }
}

/// A socket bound to `addr`, configured for RoCEv2 (see [`sockio::configure`]).
fn bind(addr: SocketAddr, gro: bool) -> io::Result<UdpSocket> {
    let s = UdpSocket::bind(addr)?;
    sockio::configure(&s, gro)?;
    Ok(s)
}

impl UdpPort {
    /// Bind `addr` (port 4791 unless given), or the configured / default address.
    pub fn bind(addr: Option<SocketAddr>, faults: Option<FaultConfig>) -> io::Result<UdpPort> {
        let rx = match addr {
            Some(a) => bind(a, true)?,
            None => {
                let mut last = None;
                let mut found = None;
                for ip in default_candidates() {
                    match bind(SocketAddr::new(IpAddr::V4(ip), ROCE_PORT), true) {
                        Ok(s) => {
                            found = Some(s);
                            break;
                        }
                        Err(e) => last = Some(e),
                    }
                }
                found.ok_or_else(|| last.unwrap_or_else(|| io::Error::other("no address")))?
            }
        };
        let local = rx.local_addr()?;
        let gro = sockio::set_gro(&rx, true).is_ok();
        sockio::set_recv_buffer(&rx, 32 << 20);
        let max_gso_segments = if sockio::gso_supported(&rx) {
            sockio::MAX_GSO_SEGMENTS
        } else {
            1
        };
        Ok(UdpPort {
            local,
            rx,
            max_gso_segments,
            gro,
            gro_is_off: AtomicBool::new(false),
            gro_forced_on: AtomicBool::new(false),
            tx: Mutex::new(HashMap::default()),
            tx_frozen: std::sync::OnceLock::new(),
            faults: faults
                .filter(|f| !f.is_clean())
                .map(|f| Mutex::new(FaultInjector::new(f))),
        })
    }

    /// The UDP source port of QP `qpn`'s packets: rxe's `0xC000 | hash(qpn)` (flow entropy
    /// for ECMP; receivers do not check it), each with its own unconnected send socket, for up
    /// to [`MAX_TX_SOCKETS`] distinct ports. Beyond that, a QP whose port has no socket shares
    /// one of the existing ports (the same one every time): 20,000 QPs used ~11,500 sockets per
    /// device before, and ran out of file descriptors.
    pub(crate) fn sport_for(&self, qpn: u32) -> u16 {
        let want = crate::wire::udp_sport_for_qpn(qpn);
        match self.tx_frozen.get() {
            None => want,
            Some(ports) if ports.binary_search(&want).is_ok() => want,
            Some(ports) => ports[usize::from(want) % ports.len()],
        }
    }

    /// Send sockets open (tests).
    pub fn tx_sockets(&self) -> usize {
        self.tx.lock().len()
    }

    /// The bound address (the device's GID and port).
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Maximum segments one GSO send may carry (1 without GSO support).
    pub fn max_gso_segments(&self) -> usize {
        self.max_gso_segments
    }

    /// Send `contents` from source port `sport` to `dst`. With `segment_size`, `contents` is a
    /// run of datagrams of that size (the last may be shorter) sent as one GSO buffer.
    pub fn send(
        &self,
        sport: u16,
        dst: SocketAddr,
        contents: &[u8],
        segment_size: Option<usize>,
    ) -> io::Result<()> {
        let segment = segment_size
            .filter(|&n| n < contents.len())
            .map(|n| u16::try_from(n).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput)))
            .transpose()?;
        let msg = OutMsg {
            dst,
            bytes: contents,
            segment,
        };
        match self.send_msgs(sport, &[msg]) {
            (_, Some(e)) => Err(e),
            _ => Ok(()),
        }
    }

    /// Send a batch of messages (datagrams or GSO runs) from source port `sport`, in order,
    /// with as few `sendmmsg` calls as the kernel allows. Returns how many datagrams left and
    /// the last error (a message the kernel refused is skipped; RC retransmission covers it,
    /// as it would a lost packet).
    pub(crate) fn send_msgs(&self, sport: u16, msgs: &[OutMsg<'_>]) -> (usize, Option<io::Error>) {
        if let Some(f) = &self.faults {
            // Faults act per datagram: split the runs and push each through the injector.
            let now = Instant::now();
            let mut inj = f.lock();
            for m in msgs {
                let seg = m.segment.map_or(m.bytes.len(), usize::from).max(1);
                for d in m.bytes.chunks(seg) {
                    inj.push(
                        now,
                        Outgoing {
                            sport,
                            dst: m.dst,
                            body: d.to_vec(),
                        },
                    );
                }
            }
            let sent = msgs.iter().map(datagram_count).sum();
            return (sent, self.release_faults(&mut inj, now).err());
        }
        self.send_msgs_now(sport, msgs)
    }

    /// [`send_msgs`](Self::send_msgs) past the fault injector.
    fn send_msgs_now(&self, sport: u16, msgs: &[OutMsg<'_>]) -> (usize, Option<io::Error>) {
        let mut tx = self.tx.lock();
        if let std::collections::hash_map::Entry::Vacant(v) = tx.entry(sport) {
            match bind(SocketAddr::new(self.local.ip(), sport), false) {
                Ok(sock) => {
                    v.insert(sock);
                }
                Err(e) => return (0, Some(e)),
            }
            if tx.len() >= MAX_TX_SOCKETS && self.tx_frozen.get().is_none() {
                let mut ports: Vec<u16> = tx.keys().copied().collect();
                ports.sort_unstable();
                let _ = self.tx_frozen.set(ports);
            }
        }
        let sock = tx.get(&sport).expect("just found or inserted");
        let (mut at, mut sent, mut err) = (0, 0, None);
        while at < msgs.len() {
            match sockio::send_batch(sock, &msgs[at..]) {
                Ok(k) => {
                    sent += msgs[at..at + k].iter().map(datagram_count).sum::<usize>();
                    at += k;
                }
                // Full send buffer: the peer is slow. Spin briefly (datagrams are never queued
                // in user space here; RC retransmission covers real loss).
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                // A refused or failed message (an earlier ICMP error, an oversized run): skip
                // it and go on with the rest.
                Err(e) => {
                    if e.kind() != io::ErrorKind::ConnectionRefused {
                        err = Some(e);
                    }
                    at += 1;
                }
            }
        }
        (sent, err)
    }

    fn release_faults(&self, inj: &mut FaultInjector<Outgoing>, now: Instant) -> io::Result<()> {
        while let Some(d) = inj.pop(now) {
            let tx = [OutMsg {
                dst: d.dst,
                bytes: &d.body,
                segment: None,
            }];
            // Released datagrams go out one by one: the injector reorders across flows.
            if let (_, Some(e)) = self.send_msgs_now(d.sport, &tx) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Release delayed datagrams that are due (call from the progress loop).
    pub fn tick(&self, now: Instant) -> io::Result<Option<Instant>> {
        let Some(f) = &self.faults else {
            return Ok(None);
        };
        let mut inj = f.lock();
        if inj.next_due().is_none() {
            inj.flush_held(now);
        }
        self.release_faults(&mut inj, now)?;
        Ok(inj.next_due())
    }

    /// Fault statistics (None without an injector).
    pub fn fault_stats(&self) -> Option<FaultStats> {
        self.faults.as_ref().map(|f| f.lock().stats())
    }

    /// Receive whatever is ready (non-blocking): calls `f(src, datagram)` for each datagram
    /// (GRO batches are split by their stride). [`Datagram::bytes`] reads it;
    /// [`Datagram::share`] hands out its buffer for packets to keep (buffers still referenced
    /// by packets from an earlier call are replaced, the others reused). Returns the number of
    /// datagrams.
    pub fn recv(
        &self,
        bufs: &mut RecvBufs,
        f: impl FnMut(SocketAddr, &mut Datagram<'_>),
    ) -> io::Result<usize> {
        self.recv_some(bufs, RECV_BATCH, usize::MAX, f)
    }

    /// As [`recv`](Self::recv), with at most `slots` (1..=`RECV_BATCH`) receive buffers per
    /// `recvmmsg` and at most `calls` calls.
    pub fn recv_some(
        &self,
        bufs: &mut RecvBufs,
        slots: usize,
        calls: usize,
        mut f: impl FnMut(SocketAddr, &mut Datagram<'_>),
    ) -> io::Result<usize> {
        let slots = slots.clamp(1, RECV_BATCH);
        if slots == 1 && bufs.plain && calls > 0 {
            return match sockio::recv_one(&self.rx, &mut bufs.slots[0])? {
                None => Ok(0),
                Some((addr, len)) => {
                    let mut handle = None;
                    f(addr, &mut Datagram::new(bufs, 0, &mut handle, 0, len, 0));
                    Ok(1)
                }
            };
        }
        let mut total = 0;
        for _ in 0..calls {
            let mut meta = [RecvMeta::default(); RECV_BATCH];
            let r = {
                // The slots are plain owned buffers: a (mostly empty) poll allocates nothing
                // and does no atomic operation.
                let mut it = bufs.slots.iter_mut().take(slots);
                let mut slices: [&mut [u8]; RECV_BATCH] =
                    std::array::from_fn(|_| match it.next() {
                        Some(b) => &mut b[..],
                        None => &mut [],
                    });
                sockio::recv_batch(&self.rx, &mut slices[..slots], &mut meta[..slots])
            };
            match r {
                Ok(n) => {
                    for (i, m) in meta.iter().enumerate().take(n) {
                        // Shared with packets (once per slot) only if a packet keeps a range.
                        let mut handle = None;
                        let stride = m.stride.max(1);
                        let mut off = 0;
                        let mut seg = 0;
                        while off < m.len {
                            let len = stride.min(m.len - off);
                            f(
                                m.addr,
                                &mut Datagram::new(bufs, i, &mut handle, off, len, seg),
                            );
                            off += len;
                            seg += 1;
                            total += 1;
                        }
                    }
                    if n < slots {
                        return Ok(total); // drained (0: nothing was ready)
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }

    /// The receive socket (to wait on it with poll()).
    pub fn rx_socket(&self) -> &UdpSocket {
        &self.rx
    }

    /// Make sure GRO is on before a READ request leaves whose responses come as GSO runs:
    /// with GRO off the kernel would cut them into datagrams whose IPv4 IDs the receiver
    /// cannot know, and a requester that loses READ responses waits for its retransmission
    /// timer. Costs a load when GRO is on; a system call the first time otherwise.
    fn hold_gro(&self) {
        if self.gro_is_off.load(Ordering::Relaxed)
            && !self.gro_forced_on.swap(true, Ordering::Relaxed)
        {
            let _ = sockio::set_gro(&self.rx, true);
        }
    }
}

/// One received datagram, lent to a receive callback ([`UdpPort::recv`]).
pub struct Datagram<'a> {
    bufs: &'a mut RecvBufs,
    slot: usize,
    /// The slot's buffer once shared with packets (its bytes moved into this handle).
    handle: &'a mut Option<std::sync::Arc<Vec<u8>>>,
    off: usize,
    len: usize,
    seg: usize,
}

impl<'a> Datagram<'a> {
    fn new(
        bufs: &'a mut RecvBufs,
        slot: usize,
        handle: &'a mut Option<std::sync::Arc<Vec<u8>>>,
        off: usize,
        len: usize,
        seg: usize,
    ) -> Datagram<'a> {
        Datagram {
            bufs,
            slot,
            handle,
            off,
            len,
            seg,
        }
    }

    /// The datagram's index within the receive offload batch it arrived in (0 for a
    /// datagram that arrived alone). An mrkit sender's GSO segment `k` carries IPv4 ID `k`.
    pub fn segment(&self) -> usize {
        self.seg
    }

    /// The datagram's bytes.
    pub fn bytes(&self) -> &[u8] {
        let buf = match &*self.handle {
            Some(h) => &h[..],
            None => &self.bufs.slots[self.slot][..],
        };
        &buf[self.off..self.off + self.len]
    }

    /// The buffer holding the datagram, for packets to keep a range of it, and the datagram's
    /// offset in it. The first call per receive slot trades the slot's buffer for a free one
    /// (see [`RecvBufs`]); short payloads are better copied ([`super::Payload::copied`]).
    pub fn share(&mut self) -> (&std::sync::Arc<Vec<u8>>, usize) {
        let (bufs, slot) = (&mut *self.bufs, self.slot);
        (
            self.handle.get_or_insert_with(|| bufs.share(slot)),
            self.off,
        )
    }
}

/// Datagram batches per `recvmmsg`.
const RECV_BATCH: usize = 8;

/// Spare receive buffers kept for reuse (each [`RECV_BUF`] bytes).
const SPARE_BUFS: usize = 64;

/// Receive buffers, shared with the packets that point into them and recycled when free.
///
/// The receive slots are plain owned buffers. A slot that received datagrams trades its
/// buffer for the buffer of a free shared handle (an `Arc` whose packets are all consumed;
/// the most recently freed one, still in the cache, so the kernel's copy into it, the largest
/// cost of a bandwidth receiver, runs at cache speed), and the handle, now holding the
/// received bytes, is shared with the packets. Nothing is allocated in the steady state, and
/// a poll that finds nothing does no atomic operation. (A fresh 262 KiB zeroed buffer per
/// receive costs an mmap, ~64 page faults, a memset and an munmap.)
pub struct RecvBufs {
    /// Receive slots, always writable.
    slots: Vec<Vec<u8>>,
    /// Shared handles: lent to packets, or free (only this list refers to them).
    lent: Vec<std::sync::Arc<Vec<u8>>>,
    /// The packets of one QP being collected by `poll_rx` (reused: no allocation per poll).
    run: Vec<super::Pkt>,
    /// Request/response traffic: one slot per receive (a plain `recvfrom` once GRO is off).
    /// Every further slot costs a failed dequeue when only one datagram is waiting
    /// (~0.15-0.25 µs per receive here, two per round trip). Set when a receive got one small
    /// datagram and fewer than [`BURST_RECEIVES`] receives in a row had found something
    /// without the application answering (posting a send) in between; cleared when data
    /// keeps coming (that many, a GRO batch, several or large datagrams), so bursts and
    /// streams take [`RX_SLOTS_PER_PASS`] again.
    single: bool,
    /// Receives in a row that found something with no send posted in between (saturating).
    busy: u8,
    /// Receive offload is off on the socket ([`RecvBufs::adapt_offload`]).
    gro_off: bool,
    /// Single-slot receives may use a plain `recvfrom` (~0.15 µs cheaper than a one-slot
    /// `recvmmsg`, twice per round trip): the socket has no GRO, or its GRO was turned off and
    /// a receive found the socket empty afterwards, so nothing queued can be a GRO batch.
    plain: bool,
    /// Receives in a row in single mode that got one small datagram.
    small_run: u32,
    /// A receive found a GSO segment of an mrkit sender cut apart from its batch (the
    /// kernel segments a GSO buffer that reaches the socket while its GRO is off, and the
    /// receiver can then no longer tell the segment's IPv4 ID): turn GRO back on at once, so
    /// that the retransmission arrives whole, and wait [`GRO_OFF_BACKOFF`] times longer
    /// before turning it off again.
    cut_run: bool,
    /// Single-mode receives of one small datagram in a row after which GRO goes off
    /// ([`GRO_OFF_AFTER`], times [`GRO_OFF_BACKOFF`] for every cut run seen).
    gro_off_after: u32,
}

/// Single-mode receives of one small datagram in a row after which receive offload is
/// turned off (request/response traffic has nothing to coalesce).
const GRO_OFF_AFTER: u32 = 64;

/// Factor by which the wait before GRO goes off grows each time a GSO run reached the socket
/// while GRO was off (each such run costs a retransmission): a device whose traffic mixes
/// request/response with bulk transfers soon keeps GRO on.
const GRO_OFF_BACKOFF: u32 = 64;

impl RecvBufs {
    /// Receive slots for the next pass: one for request/response traffic, else
    /// [`RX_SLOTS_PER_PASS`].
    fn slots_per_pass(&self) -> usize {
        if self.single {
            1
        } else {
            RX_SLOTS_PER_PASS
        }
    }

    /// Receive slots for a pass that may take one datagram at a time (`one_ok`) or must take
    /// a full batch (see `poll_rx`).
    fn slots_for(&self, one_ok: bool) -> usize {
        if one_ok {
            self.slots_per_pass()
        } else {
            RX_SLOTS_PER_PASS
        }
    }

    /// Adapt the receive mode and the socket's offload after a pass received `n` datagrams
    /// into `slots` slots (`small`: all below [`SMALL_DATAGRAM`]); `answered`: the
    /// application posted a send since the previous receive that found data.
    fn after_receive(
        &mut self,
        port: &UdpPort,
        n: usize,
        slots: usize,
        small: bool,
        answered: bool,
    ) {
        self.adapt_offload(port, n, slots, small);
        // A send posted since the last receive that found data: request/response, not a burst.
        let busy = if answered { 0 } else { self.busy };
        self.single = next_single(self.single, busy, n, small);
        self.busy = if n > 0 { busy.saturating_add(1) } else { 0 };
    }

    /// Follow the traffic with the socket's receive offload after a receive of `n` datagrams
    /// into `slots` slots (`small`: all below [`SMALL_DATAGRAM`]). GRO pays for streams (a
    /// 60 KiB GSO buffer arrives as one) and costs request/response traffic a one-slot
    /// `recvmmsg` (its control message) where a plain `recvfrom` would do. So: off after
    /// [`GRO_OFF_AFTER`] single-mode receives of one small datagram; on again at the first
    /// large datagram or full batch (a backlog, which a GSO sender's runs would fill). Plain
    /// receives start only once a receive found the socket empty with GRO off: a datagram
    /// queued before the switch may still be a GRO batch, which only `recvmmsg` can split.
    /// (A batch the kernel started queueing in the instant of the switch could still be taken
    /// whole by `recvfrom`: it fails its ICRC, is counted and dropped, and RC retransmits.)
    fn adapt_offload(&mut self, port: &UdpPort, n: usize, slots: usize, small: bool) {
        if !port.gro {
            self.plain = true;
            return;
        }
        self.note_forced_gro(port);
        if n == 0 {
            self.plain = self.gro_off;
            return;
        }
        let cut = std::mem::take(&mut self.cut_run);
        if cut && self.gro_off {
            // Once per run cut apart (its other segments, queued before GRO went back on,
            // are cut too but do not count again).
            self.gro_off_after = self.gro_off_after.saturating_mul(GRO_OFF_BACKOFF);
        }
        if !small || (slots > 1 && n >= slots) || cut {
            self.small_run = 0;
            if self.gro_off && sockio::set_gro(&port.rx, true).is_ok() {
                self.gro_off = false;
                self.plain = false;
                port.gro_is_off.store(false, Ordering::Relaxed);
            }
            return;
        }
        if slots == 1 && n == 1 {
            self.small_run = self.small_run.saturating_add(1);
        }
        if !self.gro_off
            && self.small_run >= self.gro_off_after
            && sockio::set_gro(&port.rx, false).is_ok()
        {
            self.gro_off = true;
            port.gro_is_off.store(true, Ordering::Relaxed);
        }
    }

    /// Take note of a sender's [`UdpPort::hold_gro`]: GRO is on, no plain receives, and the
    /// wait before it goes off again grows as after a cut run. (A receive whose decision to
    /// turn GRO off crossed the sender's switch may have turned it off again: switch it on
    /// once more.)
    fn note_forced_gro(&mut self, port: &UdpPort) {
        if port.gro_forced_on.load(Ordering::Relaxed)
            && port.gro_forced_on.swap(false, Ordering::Relaxed)
        {
            if self.gro_off {
                self.gro_off_after = self.gro_off_after.saturating_mul(GRO_OFF_BACKOFF);
            }
            let _ = sockio::set_gro(&port.rx, true);
            self.gro_off = false;
            self.plain = false;
            self.small_run = 0;
            port.gro_is_off.store(false, Ordering::Relaxed);
        }
    }

    /// Share what slot `i` received: returns a handle holding those bytes, and gives the slot
    /// the buffer of the most recently freed handle (or a new one).
    fn share(&mut self, i: usize) -> std::sync::Arc<Vec<u8>> {
        // Only this struct holds handles besides packets, and packets never make weak ones:
        // a strong count of 1 means free.
        let free = self
            .lent
            .iter()
            .rposition(|b| std::sync::Arc::strong_count(b) == 1);
        let mut handle = match free {
            Some(j) => self.lent.swap_remove(j),
            None => std::sync::Arc::new(vec![0u8; RECV_BUF]),
        };
        match std::sync::Arc::get_mut(&mut handle) {
            Some(spare) => std::mem::swap(spare, &mut self.slots[i]),
            None => {
                // Unreachable (the handle was free); stay correct anyway.
                let bytes = std::mem::replace(&mut self.slots[i], vec![0u8; RECV_BUF]);
                handle = std::sync::Arc::new(bytes);
            }
        }
        if self.lent.len() >= SPARE_BUFS {
            // Forget the handles of buffers still in use beyond the bound (they are freed
            // with their last packet).
            self.lent.retain(|b| std::sync::Arc::strong_count(b) == 1);
            self.lent.truncate(SPARE_BUFS - 1);
        }
        self.lent.push(handle.clone());
        handle
    }
}

impl std::fmt::Debug for RecvBufs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBufs")
            .field("buffers", &self.slots.len())
            .finish()
    }
}

impl Default for RecvBufs {
    fn default() -> Self {
        RecvBufs {
            slots: (0..RECV_BATCH).map(|_| vec![0u8; RECV_BUF]).collect(),
            lent: Vec::new(),
            run: Vec::new(),
            single: false,
            busy: 0,
            gro_off: false,
            plain: false,
            small_run: 0,
            cut_run: false,
            gro_off_after: GRO_OFF_AFTER,
        }
    }
}

/// The smallest path MTU (256): a READ of more bytes may be answered by several packets.
const MIN_PATH_MTU: u32 = 256;

/// A GSO send is one UDP datagram to the kernel: at most 65,507 bytes of payload in all.
const MAX_GSO_BYTES: usize = 65_507;

/// IPv4 flags word with DF set (what an unconnected `IP_PMTUDISC_PROBE` socket sends).
const IPV4_DF: u16 = 0x4000;

/// Serialise packets and send them on `port`. Consecutive packets of one QP to one
/// destination with equal length go out as one GSO send (when `gso` allows it); segment `k`
/// of such a send leaves with IPv4 identification `k` (the kernel numbers GSO segments), so
/// its ICRC is computed for that ID. A packet whose payload cannot be read from registered
/// memory is not sent: `gather_failed` hears of it (and that QP's later packets of this call
/// are dropped, as a NIC stops at the error).
pub(crate) fn send_pkts_on(
    port: &UdpPort,
    stats: &NetStats,
    gso: bool,
    gather_failed: &mut dyn FnMut(&super::Pkt),
    pkts: &[super::Pkt],
) {
    let local = port.local_addr();
    // READ responses of more than one packet come back as GSO runs: GRO must be on first.
    if pkts.iter().any(|p| {
        p.bth.opcode == crate::wire::Opcode::RdmaReadRequest
            && p.ext.reth.is_some_and(|r| r.dma_len > MIN_PATH_MTU)
    }) {
        port.hold_gro();
    }
    // With a fault injector every datagram leaves alone (ID 0), so none may be built as a
    // GSO segment: its ICRC would cover ID `k` and the receiver would drop it.
    let max_seg = if gso && port.faults.is_none() {
        port.max_gso_segments() // 1..=sockio::MAX_GSO_SEGMENTS
    } else {
        1
    };
    thread_local! {
        static SEND_BUF: std::cell::RefCell<(Vec<u8>, Vec<Run>)> = std::cell::RefCell::new(
            (Vec::with_capacity(MAX_GSO_BYTES), Vec::with_capacity(sockio::MAX_BATCH)),
        );
    }
    // At process exit (`crate::driver::at_exit`) this thread's buffer may already be destroyed.
    if SEND_BUF
        .try_with(|b| {
            let (buf, runs) = &mut *b.borrow_mut();
            send_runs(stats, gather_failed, port, local, max_seg, pkts, buf, runs)
        })
        .is_err()
    {
        send_runs(
            stats,
            gather_failed,
            port,
            local,
            max_seg,
            pkts,
            &mut Vec::new(),
            &mut Vec::new(),
        );
    }
}

/// One GSO run (or single datagram) serialised into the send buffer.
#[derive(Clone, Copy)]
struct Run {
    sport: u16,
    dst: SocketAddr,
    /// Byte range in the send buffer.
    start: usize,
    len: usize,
    /// Segment size when the run holds more than one datagram.
    seg: Option<u16>,
}

/// Serialised bytes after which the runs built so far are sent (bounds the buffer).
const FLUSH_BYTES: usize = 512 << 10;

#[allow(clippy::too_many_arguments)]
fn send_runs(
    stats: &NetStats,
    gather_failed: &mut dyn FnMut(&super::Pkt),
    port: &UdpPort,
    local: SocketAddr,
    max_seg: usize,
    pkts: &[super::Pkt],
    buf: &mut Vec<u8>,
    runs: &mut Vec<Run>,
) {
    // The runs built so far (this thread's table: no allocation or initialisation per send).
    runs.clear();
    // `buf[..used]` holds the runs built so far. The buffer only ever grows (zeroed once):
    // zeroing 64 KiB per message before overwriting it cost ~3 % of a bandwidth sender.
    let mut used = 0;
    let mut i = 0;
    // A QP one of whose packets could not be gathered (its registered memory is unreachable):
    // its later packets in this send are dropped, as a NIC stops at the error.
    let mut failed_qpn: Option<u32> = None;
    while i < pkts.len() {
        let first = &pkts[i];
        let Some(dst_ip) = first.dst_ip else {
            i += 1;
            continue;
        };
        if failed_qpn == Some(first.src_qpn) {
            i += 1;
            continue;
        }
        let dst = SocketAddr::new(dst_ip, ROCE_PORT);
        let sport = port.sport_for(first.src_qpn);
        let src = SocketAddr::new(local.ip(), sport);
        let base = crate::wire::IcrcInputs::from_socket_addrs(src, dst);
        if runs.len() == sockio::MAX_BATCH
            || used >= FLUSH_BYTES
            || runs.last().is_some_and(|r| r.sport != sport)
        {
            flush_runs(stats, port, runs, buf);
            runs.clear();
            used = 0;
        }
        let run_start = used;
        let mut seg_len = 0;
        let mut n = 0;
        let same_flow = |p: &super::Pkt| p.dst_ip == Some(dst_ip) && p.src_qpn == first.src_qpn;
        while i < pkts.len() && n < max_seg {
            let p = &pkts[i];
            if !same_flow(p) {
                break;
            }
            if n > 0 && !pkts.get(i + 1).is_some_and(same_flow) {
                // The flow's last packet of this send leaves alone, with ID 0, which every
                // receiver can check. A receiver whose GRO is off gets a GSO run cut into
                // datagrams whose IDs it cannot know and drops all but the first; this
                // packet, arriving right behind them, then shows the PSN gap and the
                // responder NAKs at once instead of the requester waiting for its timer.
                break;
            }
            let inputs = if base.is_ipv4() {
                base.with_ipv4_id(n as u16, IPV4_DF)
            } else {
                base
            };
            // Serialise straight into the send buffer: headers, payload copied once from
            // registered memory (or the inline bytes), pad, ICRC.
            let at = used;
            let plen = p.payload.len();
            let room = at + crate::wire::wire_len(p.bth.opcode, plen);
            if buf.len() < room {
                buf.resize(room, 0);
            }
            let frame = &mut buf[at..room];
            let built = crate::wire::emit_headers(frame, &p.bth, &p.ext, plen).and_then(|layout| {
                p.payload
                    .read(0, &mut frame[layout.payload_range()])
                    .map_err(|_| crate::wire::WireError::PayloadUnreachable)?;
                crate::wire::finish(frame, &layout, &inputs)
            });
            let dlen = match built {
                Ok(l) => l,
                Err(crate::wire::WireError::PayloadUnreachable) => {
                    // Not sent; the QP turns it into the error a NIC's failed gather gives.
                    gather_failed(p);
                    failed_qpn = Some(p.src_qpn);
                    i += 1;
                    break;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot serialise packet");
                    i += 1;
                    continue;
                }
            };
            if n > 0 && (dlen > seg_len || at + dlen - run_start > MAX_GSO_BYTES) {
                // Only the last segment may be shorter, and one send stays below 64 KiB:
                // leave this packet for the next run.
                break;
            }
            used = at + dlen;
            let shorter = n > 0 && dlen < seg_len;
            if n == 0 {
                seg_len = dlen;
            }
            n += 1;
            i += 1;
            if shorter {
                break;
            }
        }
        if n == 0 {
            continue;
        }
        runs.push(Run {
            sport,
            dst,
            start: run_start,
            len: used - run_start,
            // seg_len ≤ one datagram < 64 KiB
            seg: (n > 1).then_some(seg_len as u16),
        });
    }
    flush_runs(stats, port, runs, buf);
}

/// Send the runs (all from one source port) built in `buf`, and count them.
fn flush_runs(stats: &NetStats, port: &UdpPort, runs: &[Run], buf: &[u8]) {
    let Some(first) = runs.first() else {
        return;
    };
    let msg = |r: &Run| OutMsg {
        dst: r.dst,
        bytes: &buf[r.start..r.start + r.len],
        segment: r.seg,
    };
    let (sent, err) = if let [only] = runs {
        // One run (a request, a reply, an ACK): no table of messages to fill.
        port.send_msgs(first.sport, &[msg(only)])
    } else {
        let msgs: [OutMsg<'_>; sockio::MAX_BATCH] =
            std::array::from_fn(|i| msg(runs.get(i).unwrap_or(first)));
        port.send_msgs(first.sport, &msgs[..runs.len()])
    };
    if let Some(e) = err {
        stats
            .send_errors
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::debug!(error = %e, dst = %first.dst, "UDP send failed");
    }
    stats
        .tx_datagrams
        .fetch_add(sent as u64, std::sync::atomic::Ordering::Relaxed);
}

/// `recvmmsg` slots one progress pass receives (each a datagram or a GRO batch of up to
/// 64 KiB).
pub(crate) const RX_SLOTS_PER_PASS: usize = 4;

/// Receive ready datagrams (one bounded batch) on `port` and hand the packets on, grouped:
/// `lookup(qpn)` finds the destination QP of a packet (`None`: the packet is dropped and
/// counted as [`DatagramDrop::UnknownQp`]), and `deliver(qp, packets)` takes each run of
/// consecutive packets for one QP. Returns how many datagrams arrived. `one_ok`: the pass may
/// take one datagram at a time in request/response mode ([`RecvBufs::slots_per_pass`]);
/// otherwise it takes a full batch (the progress pass decides). `node` is the receiving
/// device's node id, `mode` its IPv4 ICRC mode; `answered` is the device's "a send was posted
/// since the last receive" flag (taken here after a receive that found something).
#[allow(clippy::too_many_arguments)]
pub(crate) fn poll_rx<Q>(
    port: &UdpPort,
    bufs: &mut RecvBufs,
    one_ok: bool,
    node: u64,
    mode: super::Ipv4IcrcMode,
    st: &NetStats,
    answered: &AtomicBool,
    mut lookup: impl FnMut(u32) -> Option<Q>,
    mut deliver: impl FnMut(Q, &mut Vec<super::Pkt>),
) -> usize {
    use std::sync::atomic::Ordering::Relaxed;
    let local = port.local_addr();
    // Consecutive packets for one QP (a GRO batch is one flow) are handed over together:
    // one QP lookup and one hand-over per run instead of per packet.
    let mut cur: Option<(u32, Q)> = None;
    let mut run = std::mem::take(&mut bufs.run);
    let mut dropped = 0u64;
    let mut received = 0u64;
    // One bounded receive per progress pass: the QPs then run and send their ACKs before
    // the next batch is taken. Draining the socket first would let a receiver that fell
    // behind take a sender's whole window at once and acknowledge it only at the end, and
    // the two sides would then take turns instead of overlapping.
    // Before receiving: a sender may have switched GRO back on (a READ request left), and
    // then no receive may be a plain one.
    bufs.note_forced_gro(port);
    let slots = bufs.slots_for(one_ok);
    let mut small = true;
    let mut cut_run = false;
    let r = port.recv_some(bufs, slots, 1, |src, d| {
        small &= d.len < SMALL_DATAGRAM;
        received += 1;
        let parsed = super::Pkt::parse_wire(d.bytes(), src, local, node, d.seg, mode);
        let parsed = parsed.map(|(mut p, at)| {
            p.payload = if at.len() <= super::SMALL_PAYLOAD {
                super::Payload::copied(&d.bytes()[at])
            } else {
                // Long payloads stay in the receive buffer (no copy, no allocation).
                let (buf, base) = d.share();
                super::Payload::Shared(buf.clone(), base + at.start, at.len())
            };
            p
        });
        match parsed {
            Ok(p) => {
                let qpn = p.bth.dest_qpn;
                if cur.as_ref().map_or(true, |(n, _)| *n != qpn) {
                    if let Some((_, q)) = cur.take() {
                        deliver(q, &mut run);
                    }
                    cur = lookup(qpn).map(|q| (qpn, q));
                }
                if cur.is_some() {
                    run.push(p);
                } else {
                    dropped += 1;
                }
            }
            Err(why) => cut_run |= st.dropped(why, 1),
        }
    });
    bufs.cut_run |= cut_run;
    if let Some((_, q)) = cur {
        deliver(q, &mut run);
    }
    run.clear();
    bufs.run = run;
    if dropped > 0 {
        st.dropped(super::DatagramDrop::UnknownQp, dropped);
    }
    if received > 0 {
        // One writer at a time: this runs under the device's receive lock (`bufs` lives in
        // it), so a load and a store count without a locked read-modify-write.
        let n = st.rx_datagrams.load(Relaxed);
        st.rx_datagrams.store(n + received, Relaxed);
    }
    match r {
        Ok(n) => {
            // Load first: the flag is usually already clear, and a swap is a locked RMW.
            let answered = n > 0 && answered.load(Relaxed) && answered.swap(false, Relaxed);
            bufs.after_receive(port, n, slots, small, answered);
            n
        }
        Err(e) => {
            tracing::debug!(error = %e, "UDP receive failed");
            0
        }
    }
}

/// Receives in a row that found something, with no send posted in between, from which on a
/// single-slot receiver takes batches again. Two, not one: request/response traffic brings
/// the peer's message and, right behind it, the delayed ACK of this side's last message
/// (`caller_thread::ACK_DELAY_MAX`: a held ACK leaves after the application's next packets), and
/// each is taken by its own pass. Counting only receives with no reply in between keeps a
/// fast peer's reply, already queued behind that ACK, from looking like a burst (taking the
/// echo's receives in batches of four cost ~0.4 µs per 8-byte SEND round trip).
const BURST_RECEIVES: u8 = 2;

/// The receive mode after a receive of `n` datagrams (`small`: all below [`SMALL_DATAGRAM`])
/// that followed `busy` receives in a row which found something.
fn next_single(single: bool, busy: u8, n: usize, small: bool) -> bool {
    if n == 0 {
        single // nothing arrived: keep the mode
    } else {
        n == 1 && small && busy < BURST_RECEIVES
    }
}

/// A datagram below this size is request/response traffic (an ACK, a short message), not
/// part of a bulk transfer (see `RecvBufs::single`).
const SMALL_DATAGRAM: usize = 1024;

/// Link counters of a device. Independent relaxed counters.
///
/// Every dropped datagram is counted here and, for `mrkit stat`, in the process-wide
/// [`crate::stats::rx_drops`].
#[derive(Debug, Default)]
pub struct NetStats {
    /// Datagrams sent.
    pub tx_datagrams: AtomicU64,
    /// Send errors.
    pub send_errors: AtomicU64,
    /// Datagrams received. Written only under the device's receive lock (one writer: a
    /// load and a store, no locked read-modify-write).
    pub rx_datagrams: AtomicU64,
    /// Dropped: malformed (truncated, bad version, unknown opcode, bad pad ...).
    pub rx_malformed: AtomicU64,
    /// Dropped: the ICRC matches no IPv4 identification at all (a corrupted packet).
    pub rx_bad_icrc: AtomicU64,
    /// Dropped: the ICRC does not match the IPv4 identification expected, but another one,
    /// and not one an mrkit sender's GSO segment carries: a foreign peer's packet, which
    /// `MRKIT_ICRC_IPV4=solve` accepts (or, with probability 2^-15, a corrupted one).
    pub rx_icrc_foreign_id: AtomicU64,
    /// Dropped: the ICRC matches ID 1..63 with DF, an mrkit sender's GSO segment that
    /// reached the socket cut apart from its batch (queued while the socket's receive offload
    /// was off), whose ID the receiver cannot know; RC retransmits it.
    pub rx_icrc_cut_run: AtomicU64,
    /// Dropped: no such QP.
    pub rx_unknown_qp: AtomicU64,
    /// Dropped: the source address is not the QP's remote address.
    pub rx_drop_src_addr: AtomicU64,
    /// Dropped: the P_Key does not match the QP's (what hardware counts in the port's
    /// `bad_pkey_cntr`).
    pub rx_drop_pkey: AtomicU64,
    /// Dropped: the QP's state does not take the packet (RESET, INIT, ERR; a request before
    /// RTR, a response before RTS).
    pub rx_drop_qp_state: AtomicU64,
}

/// A copy of [`NetStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStatsSnapshot {
    /// Datagrams sent.
    pub tx_datagrams: u64,
    /// Send errors.
    pub send_errors: u64,
    /// Datagrams received.
    pub rx_datagrams: u64,
    /// Dropped as malformed.
    pub rx_malformed: u64,
    /// Dropped for a bad ICRC (no IPv4 ID matches).
    pub rx_bad_icrc: u64,
    /// Dropped: the ICRC matches a foreign IPv4 identification.
    pub rx_icrc_foreign_id: u64,
    /// Dropped: a GSO segment cut apart from its batch.
    pub rx_icrc_cut_run: u64,
    /// Dropped for an unknown QP.
    pub rx_unknown_qp: u64,
    /// Dropped: wrong source address.
    pub rx_drop_src_addr: u64,
    /// Dropped: wrong P_Key.
    pub rx_drop_pkey: u64,
    /// Dropped: the QP's state.
    pub rx_drop_qp_state: u64,
}

/// GSO segments one send may carry on Linux: a mismatching ID below this with DF is taken
/// for an mrkit sender's cut-apart GSO segment.
const GSO_SEGMENTS_MAX: u16 = sockio::MAX_GSO_SEGMENTS as u16;

impl NetStats {
    /// Copy the counters.
    pub fn snapshot(&self) -> NetStatsSnapshot {
        use std::sync::atomic::Ordering::Relaxed;
        NetStatsSnapshot {
            tx_datagrams: self.tx_datagrams.load(Relaxed),
            send_errors: self.send_errors.load(Relaxed),
            rx_datagrams: self.rx_datagrams.load(Relaxed),
            rx_malformed: self.rx_malformed.load(Relaxed),
            rx_bad_icrc: self.rx_bad_icrc.load(Relaxed),
            rx_icrc_foreign_id: self.rx_icrc_foreign_id.load(Relaxed),
            rx_icrc_cut_run: self.rx_icrc_cut_run.load(Relaxed),
            rx_unknown_qp: self.rx_unknown_qp.load(Relaxed),
            rx_drop_src_addr: self.rx_drop_src_addr.load(Relaxed),
            rx_drop_pkey: self.rx_drop_pkey.load(Relaxed),
            rx_drop_qp_state: self.rx_drop_qp_state.load(Relaxed),
        }
    }

    /// The counter of one kind of drop.
    fn counter(&self, k: crate::stats::RxDrop) -> &AtomicU64 {
        use crate::stats::RxDrop;
        match k {
            RxDrop::Malformed => &self.rx_malformed,
            RxDrop::BadIcrc => &self.rx_bad_icrc,
            RxDrop::IcrcForeignId => &self.rx_icrc_foreign_id,
            RxDrop::IcrcCutRun => &self.rx_icrc_cut_run,
            RxDrop::UnknownQp => &self.rx_unknown_qp,
            RxDrop::SrcAddr => &self.rx_drop_src_addr,
            RxDrop::Pkey => &self.rx_drop_pkey,
            RxDrop::QpState => &self.rx_drop_qp_state,
        }
    }

    /// Count `n` packets dropped for `k`, here and process-wide.
    pub(crate) fn count(&self, k: crate::stats::RxDrop, n: u64) {
        self.counter(k).fetch_add(n, Ordering::Relaxed);
        crate::stats::rx_drops().add(k, n);
    }

    /// Count `n` datagrams the receive path dropped for `why`. Returns whether they were GSO
    /// segments cut apart from their batch (the receiver then turns GRO back on).
    pub(crate) fn dropped(&self, why: super::DatagramDrop, n: u64) -> bool {
        use super::DatagramDrop;
        use crate::stats::RxDrop;
        match why {
            DatagramDrop::Malformed => self.count(RxDrop::Malformed, n),
            DatagramDrop::BadIcrc => self.count(RxDrop::BadIcrc, n),
            DatagramDrop::IcrcIpv4Id { id, df } => {
                if df && (1..GSO_SEGMENTS_MAX).contains(&id) {
                    self.count(RxDrop::IcrcCutRun, n);
                    return true;
                }
                self.count(RxDrop::IcrcForeignId, n);
            }
            DatagramDrop::UnknownQp => self.count(RxDrop::UnknownQp, n),
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pair(faults: Option<FaultConfig>) -> (UdpPort, UdpPort) {
        let a = UdpPort::bind(None, faults).unwrap();
        let b = UdpPort::bind(None, None).unwrap();
        assert_ne!(
            a.local_addr(),
            b.local_addr(),
            "each instance gets its own address"
        );
        (a, b)
    }

    fn recv_n(p: &UdpPort, n: usize) -> Vec<(SocketAddr, Vec<u8>)> {
        let mut bufs = RecvBufs::default();
        let mut got = Vec::new();
        let end = Instant::now() + Duration::from_secs(5);
        while got.len() < n && Instant::now() < end {
            p.recv(&mut bufs, |src, d| got.push((src, d.bytes().to_vec())))
                .unwrap();
        }
        got
    }

    #[test]
    fn gso_run_arrives_as_datagrams() {
        let (a, b) = pair(None);
        let mut run = Vec::new();
        for i in 0..8u8 {
            run.extend(std::iter::repeat_n(i, 1000));
        }
        run.extend(std::iter::repeat_n(9u8, 300)); // shorter last segment
        a.send(0xC123, b.local_addr(), &run, Some(1000)).unwrap();
        let got = recv_n(&b, 9);
        assert_eq!(got.len(), 9);
        for (i, (src, d)) in got.iter().enumerate() {
            assert_eq!(src.ip(), a.local_addr().ip());
            assert_eq!(src.port(), 0xC123, "sent from the QP's source port");
            let want = if i == 8 { 9 } else { i as u8 };
            assert!(
                d.iter().all(|x| *x == want),
                "datagram {i}: len {} first {:?}",
                d.len(),
                &d[..4]
            );
        }
        assert_eq!(got[8].1.len(), 300);
    }

    /// A steady stream reuses a couple of receive buffers (cache-hot, no allocation) instead
    /// of allocating one per receive or cycling through many.
    #[test]
    fn receive_buffers_are_recycled() {
        let (a, b) = pair(None);
        let mut bufs = RecvBufs::default();
        let mut seen = std::collections::HashSet::new();
        for i in 0..20u8 {
            a.send(0xC001, b.local_addr(), &[i; 100], None).unwrap();
            let mut got = None;
            let end = Instant::now() + Duration::from_secs(5);
            while got.is_none() && Instant::now() < end {
                b.recv(&mut bufs, |_, d| {
                    assert_eq!(d.bytes(), &[i; 100][..]);
                    let (buf, off) = d.share();
                    assert_eq!(&buf[off..off + 100], &[i; 100][..]);
                    // A packet referring to the buffer.
                    got = Some(buf.clone());
                    // The slot traded its buffer: the datagram is read from the shared one.
                    assert_eq!(d.bytes(), &[i; 100][..]);
                })
                .unwrap();
            }
            let buf = got.expect("the datagram arrives");
            seen.insert(std::sync::Arc::as_ptr(&buf) as usize);
            // the packet is consumed here
        }
        assert!(
            seen.len() <= 2,
            "{} distinct buffers for 20 receives",
            seen.len()
        );
    }

    /// A message the kernel refuses (here: an IPv6 destination on an IPv4 socket) is skipped
    /// and reported; the messages before and after it still leave, in order.
    #[test]
    fn a_refused_message_in_a_batch_is_skipped_and_reported() {
        let (a, b) = pair(None);
        let bad: SocketAddr = "[::1]:4791".parse().unwrap();
        let msgs = [
            OutMsg {
                dst: b.local_addr(),
                bytes: b"first",
                segment: None,
            },
            OutMsg {
                dst: bad,
                bytes: b"refused",
                segment: None,
            },
            OutMsg {
                dst: b.local_addr(),
                bytes: b"third",
                segment: None,
            },
        ];
        let (sent, err) = a.send_msgs(0xC002, &msgs);
        assert_eq!(sent, 2);
        assert!(err.is_some(), "the refused message is reported");
        let got: Vec<Vec<u8>> = recv_n(&b, 2).into_iter().map(|(_, d)| d).collect();
        assert_eq!(got, vec![b"first".to_vec(), b"third".to_vec()]);
    }

    #[test]
    fn receive_mode_follows_the_traffic() {
        // (single, receives in a row that found something, n, small) -> single
        let table = [
            ((false, 0, 1, true), true),  // a lone small datagram after an empty poll
            ((true, 0, 0, true), true),   // empty polls keep the mode
            ((true, 1, 1, true), true),   // a message, then the ACK that trails it
            ((true, 2, 1, true), false),  // data in three receives in a row: a burst
            ((true, 0, 1, false), false), // a large datagram: bulk transfer
            ((true, 0, 3, true), false),  // several (a GRO batch or a full batch)
            ((false, 0, 0, true), false), // empty polls keep the mode
            ((false, 2, 1, true), false), // still busy
            ((false, 5, 1, true), false), // still busy
        ];
        for ((single, busy, n, small), want) in table {
            assert_eq!(
                next_single(single, busy, n, small),
                want,
                "{single} {busy} {n} {small}"
            );
        }
    }

    /// A fast peer's reply queued right behind the delayed ACK of this side's last message
    /// keeps one-slot receives as long as the application answers in between; the same
    /// receives with no answer are a burst.
    #[test]
    fn replies_in_between_keep_request_response_receives_single() {
        let (_a, b) = pair(None);
        // (datagrams received, application answered since the last receive that found data)
        let echo = [
            (1, false),
            (1, true),
            (1, false),
            (1, true),
            (1, false),
            (1, true),
        ];
        let mut bufs = RecvBufs::default();
        bufs.after_receive(&b, 0, RX_SLOTS_PER_PASS, true, false);
        for (i, (n, answered)) in echo.into_iter().enumerate() {
            bufs.after_receive(&b, n, bufs.slots_per_pass(), true, answered);
            assert!(bufs.single, "echo receive {i}: one slot");
        }
        let mut bufs = RecvBufs::default();
        bufs.after_receive(&b, 0, RX_SLOTS_PER_PASS, true, false);
        let stream = [(1, true), (1, false), (1, false)];
        for (n, answered) in stream {
            bufs.after_receive(&b, n, bufs.slots_per_pass(), true, answered);
        }
        assert!(
            !bufs.single,
            "three receives in a row without an answer: a burst"
        );
    }

    #[test]
    fn a_pass_that_must_not_leave_datagrams_takes_a_full_batch() {
        let (_a, b) = pair(None);
        let mut bufs = RecvBufs::default();
        bufs.after_receive(&b, 0, RX_SLOTS_PER_PASS, true, false);
        bufs.after_receive(&b, 1, RX_SLOTS_PER_PASS, true, true);
        assert!(bufs.single);
        // (one at a time allowed, slots)
        for (one_ok, slots) in [(true, 1), (false, RX_SLOTS_PER_PASS)] {
            assert_eq!(bufs.slots_for(one_ok), slots, "one at a time: {one_ok}");
        }
    }

    /// Request/response traffic turns receive offload off and then receives with plain
    /// `recvfrom`; a stream turns it back on, and a GSO run sent while it was off still
    /// arrives whole, in order, datagram by datagram.
    #[test]
    fn receive_offload_follows_the_traffic() {
        let (a, b) = pair(None);
        assert!(b.gro, "this kernel has UDP_GRO");
        let mut bufs = RecvBufs::default();
        // One receive pass as poll_rx makes it; returns the datagrams.
        let pass = |bufs: &mut RecvBufs| -> Vec<Vec<u8>> {
            let slots = bufs.slots_per_pass();
            let mut got = Vec::new();
            let n = b
                .recv_some(bufs, slots, 1, |_, d| got.push(d.bytes().to_vec()))
                .unwrap();
            let small = got.iter().all(|d| d.len() < SMALL_DATAGRAM);
            bufs.after_receive(&b, n, slots, small, false);
            got
        };
        let until_some = |bufs: &mut RecvBufs| -> Vec<Vec<u8>> {
            let end = Instant::now() + Duration::from_secs(5);
            loop {
                let got = pass(bufs);
                if !got.is_empty() || Instant::now() > end {
                    return got;
                }
            }
        };
        assert!(pass(&mut bufs).is_empty());
        for i in 0..GRO_OFF_AFTER + 1 {
            assert!(
                !bufs.plain,
                "no plain receive before an empty one with GRO off"
            );
            a.send(0xC003, b.local_addr(), &[i as u8; 60], None)
                .unwrap();
            assert_eq!(until_some(&mut bufs), vec![vec![i as u8; 60]]);
            assert!(bufs.single, "request/response: one slot");
            assert!(pass(&mut bufs).is_empty()); // the reply's turn
        }
        assert!(
            bufs.gro_off,
            "GRO is off after a run of single small datagrams"
        );
        assert!(
            bufs.plain,
            "the socket was empty with GRO off: plain receives"
        );
        a.send(0xC003, b.local_addr(), b"plain", None).unwrap();
        assert_eq!(until_some(&mut bufs), vec![b"plain".to_vec()]);
        assert!(pass(&mut bufs).is_empty());
        // A stream starts: a GSO run of four large datagrams.
        let run: Vec<u8> = (0..4u8).flat_map(|k| [k; 1200]).collect();
        a.send(0xC003, b.local_addr(), &run, Some(1200)).unwrap();
        let mut got = until_some(&mut bufs);
        assert!(
            !bufs.gro_off && !bufs.plain,
            "a large datagram turns GRO back on"
        );
        while got.len() < 4 {
            got.extend(until_some(&mut bufs));
        }
        assert_eq!(got, (0..4u8).map(|k| vec![k; 1200]).collect::<Vec<_>>());
        // With GRO on again, the next run arrives as one GRO batch, split by its stride.
        a.send(0xC003, b.local_addr(), &run, Some(1200)).unwrap();
        let mut got = until_some(&mut bufs);
        while got.len() < 4 {
            got.extend(until_some(&mut bufs));
        }
        assert_eq!(got, (0..4u8).map(|k| vec![k; 1200]).collect::<Vec<_>>());
    }

    /// A GSO run that reaches a socket whose GRO is off is cut into datagrams whose IPv4 IDs
    /// (1, 2, ...) the receiver cannot know: the exact check takes the first (ID 0) and drops
    /// the others as cut-run segments, which turns GRO back on (and makes the wait before it
    /// goes off again 64 times longer); the same run sent again arrives as one batch, and
    /// every segment passes the check for its index.
    #[test]
    fn a_run_cut_apart_by_gro_off_is_counted_and_turns_gro_back_on() {
        use crate::wire::{Aeth, IcrcInputs, Opcode, PacketBuilder, IPV4_FLAGS_DF};
        let (a, b) = pair(None);
        let stats = NetStats::default();
        let mut bufs = RecvBufs::default();
        // One receive pass as poll_rx makes it: parse every datagram at its batch index and
        // count what is dropped. Returns (ok, dropped) verdicts in order.
        let pass = |bufs: &mut RecvBufs| -> Vec<Result<(), super::super::DatagramDrop>> {
            let slots = bufs.slots_per_pass();
            let mut got = Vec::new();
            let mut cut = false;
            let local = b.local_addr();
            let n = b
                .recv_some(bufs, slots, 1, |src, d| {
                    let r = super::super::Pkt::parse_wire(
                        d.bytes(),
                        src,
                        local,
                        0,
                        d.segment(),
                        super::super::Ipv4IcrcMode::Exact,
                    )
                    .map(|_| ());
                    if let Err(why) = r {
                        cut |= stats.dropped(why, 1);
                    }
                    got.push(r);
                })
                .unwrap();
            bufs.cut_run |= cut;
            bufs.after_receive(&b, n, slots, true, false);
            got
        };
        let until_some = |bufs: &mut RecvBufs| {
            let end = Instant::now() + Duration::from_secs(5);
            let mut got = Vec::new();
            while got.len() < 3 && Instant::now() < end {
                got.extend(pass(bufs));
            }
            got
        };
        // Request/response traffic turns GRO off.
        let sport = 0xC003;
        let src = SocketAddr::new(a.local_addr().ip(), sport);
        let inputs = IcrcInputs::from_socket_addrs(src, b.local_addr());
        let ack = |psn: u32, id: u16| {
            PacketBuilder::new(Opcode::Acknowledge, 0x42, psn)
                .aeth(Aeth::ack(psn))
                .to_vec(&[], &inputs.with_ipv4_id(id, IPV4_FLAGS_DF))
                .unwrap()
        };
        assert!(pass(&mut bufs).is_empty());
        for i in 0..GRO_OFF_AFTER + 1 {
            a.send(sport, b.local_addr(), &ack(i, 0), None).unwrap();
            let end = Instant::now() + Duration::from_secs(5);
            let mut got = pass(&mut bufs);
            while got.is_empty() && Instant::now() < end {
                got = pass(&mut bufs);
            }
            assert_eq!(got, vec![Ok(())]);
            assert!(pass(&mut bufs).is_empty());
        }
        assert!(bufs.gro_off, "GRO is off after request/response traffic");
        // A run of three ACKs, segment k computed for ID k as an mrkit sender does.
        let run: Vec<u8> = (0..3u16).flat_map(|k| ack(100 + u32::from(k), k)).collect();
        a.send(sport, b.local_addr(), &run, Some(20)).unwrap();
        let got = until_some(&mut bufs);
        use super::super::DatagramDrop::IcrcIpv4Id;
        assert_eq!(
            got,
            vec![
                Ok(()),
                Err(IcrcIpv4Id { id: 1, df: true }),
                Err(IcrcIpv4Id { id: 2, df: true })
            ]
        );
        assert_eq!(stats.snapshot().rx_icrc_cut_run, 2);
        assert_eq!(stats.snapshot().rx_bad_icrc, 0);
        assert!(!bufs.gro_off, "a cut run turns GRO back on");
        assert_eq!(bufs.gro_off_after, GRO_OFF_AFTER * GRO_OFF_BACKOFF);
        // With GRO on, the run arrives whole and each segment checks against its index.
        assert!(pass(&mut bufs).is_empty());
        a.send(sport, b.local_addr(), &run, Some(20)).unwrap();
        assert_eq!(until_some(&mut bufs), vec![Ok(()), Ok(()), Ok(())]);
    }

    #[test]
    fn faults_apply_per_datagram() {
        let cfg = FaultConfig::parse("loss=0.5,seed=1").unwrap();
        let (a, b) = pair(Some(cfg));
        for i in 0..200u8 {
            a.send(0xC001, b.local_addr(), &[i; 64], None).unwrap();
        }
        a.tick(Instant::now()).unwrap();
        let st = a.fault_stats().unwrap();
        assert_eq!(st.offered, 200);
        let got = recv_n(&b, 200 - st.dropped as usize);
        assert_eq!(got.len() as u64, 200 - st.dropped);
    }

    #[test]
    fn gid_round_trip_and_addr_parsing() {
        let ip: IpAddr = "127.1.2.3".parse().unwrap();
        let g = gid_of(ip);
        assert_eq!(&g[10..12], &[0xff, 0xff]);
        assert_eq!(ip_of_gid(g), ip);
        assert_eq!(parse_addr("127.0.0.5").unwrap().port(), ROCE_PORT);
        assert_eq!(parse_addr("[::1]:5000").unwrap().port(), 5000);
        assert!(parse_addr("nope").is_err());
    }
}
