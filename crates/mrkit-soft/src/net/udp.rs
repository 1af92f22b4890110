//! The device's UDP port: RoCEv2 datagrams on port 4791 (configurable), with segmentation and
//! receive offload. This file owns the sockets (bind, per-QP source ports, sends, receives);
//! the serialiser is `net/send.rs`, the receive buffers and receive pass `net/recv.rs`, the
//! counters `net/stats.rs`.
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
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

pub use crate::addr::{gid_of, ip_of_gid, parse_addr, ROCE_PORT};
use crate::net::sockio::{self, OutMsg, RecvMeta};

use super::recv::RECV_BATCH;
pub(crate) use super::recv::{poll_rx, RX_SLOTS_PER_PASS};
pub use super::recv::{Datagram, RecvBufs};
pub(crate) use super::send::send_pkts_on;
pub use super::stats::{NetStats, NetStatsSnapshot};

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
    pub(super) local: SocketAddr,
    pub(super) rx: UdpSocket,
    /// Segments one GSO send may carry (1: the kernel has no `UDP_SEGMENT`).
    pub(super) max_gso_segments: usize,
    /// The receive socket has receive offload (`UDP_GRO`), which [`RecvBufs`] turns off
    /// while the traffic is request/response (see `RecvBufs::plain`).
    pub(super) gro: bool,
    /// GRO is off on the receive socket (a copy of `RecvBufs::gro_off` for senders, written
    /// by the receiver when it switches). A hint: orders no other data.
    pub(super) gro_is_off: AtomicBool,
    /// A sender switched GRO back on (`hold_gro`) because READ responses will arrive as GSO
    /// runs; the receiver takes note at its next pass. The sender's `set_gro` happens before
    /// its READ request leaves, so the responses find GRO on whatever the receiver knows; the
    /// flag orders no other data.
    pub(super) gro_forced_on: AtomicBool,
    /// Send sockets by UDP source port (FxHash: the key is a port number we chose).
    pub(super) tx: Mutex<HashMap<u16, UdpSocket, rustc_hash::FxBuildHasher>>,
    /// Once `MAX_TX_SOCKETS` send sockets exist: their ports, sorted, and no new ones
    /// ([`UdpPort::sport_for`]).
    pub(super) tx_frozen: std::sync::OnceLock<Vec<u16>>,
    pub(super) faults: Option<Mutex<FaultInjector<Outgoing>>>,
}

/// A datagram on its way through the fault injector.
#[derive(Debug, Clone)]
pub(super) struct Outgoing {
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
pub(super) fn datagram_count(m: &OutMsg<'_>) -> usize {
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
    pub(super) fn hold_gro(&self) {
        if self.gro_is_off.load(Ordering::Relaxed)
            && !self.gro_forced_on.swap(true, Ordering::Relaxed)
        {
            let _ = sockio::set_gro(&self.rx, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::recv::{next_single, GRO_OFF_AFTER, GRO_OFF_BACKOFF, SMALL_DATAGRAM};
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
