//! Receiving on the device's UDP port: the receive buffers and their adaptive mode (one
//! datagram at a time for request/response traffic, full GRO batches for bulk), the datagrams
//! lent to a receive callback, and one bounded receive pass that parses datagrams into packets
//! and hands them on grouped by destination QP ([`poll_rx`]).
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};

use super::sockio;
use super::stats::NetStats;
use super::udp::UdpPort;
use super::udp::RECV_BUF;

/// One received datagram, lent to a receive callback ([`UdpPort::recv`]).
pub struct Datagram<'a> {
    pub(super) bufs: &'a mut RecvBufs,
    pub(super) slot: usize,
    /// The slot's buffer once shared with packets (its bytes moved into this handle).
    pub(super) handle: &'a mut Option<std::sync::Arc<Vec<u8>>>,
    pub(super) off: usize,
    pub(super) len: usize,
    pub(super) seg: usize,
}

impl<'a> Datagram<'a> {
    pub(super) fn new(
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
pub(super) const RECV_BATCH: usize = 8;

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
    pub(super) slots: Vec<Vec<u8>>,
    /// Shared handles: lent to packets, or free (only this list refers to them).
    pub(super) lent: Vec<std::sync::Arc<Vec<u8>>>,
    /// The packets of one QP being collected by `poll_rx` (reused: no allocation per poll).
    pub(super) run: Vec<super::Pkt>,
    /// Request/response traffic: one slot per receive (a plain `recvfrom` once GRO is off).
    /// Every further slot costs a failed dequeue when only one datagram is waiting
    /// (~0.15-0.25 µs per receive here, two per round trip). Set when a receive got one small
    /// datagram and fewer than [`BURST_RECEIVES`] receives in a row had found something
    /// without the application answering (posting a send) in between; cleared when data
    /// keeps coming (that many, a GRO batch, several or large datagrams), so bursts and
    /// streams take [`RX_SLOTS_PER_PASS`] again.
    pub(super) single: bool,
    /// Receives in a row that found something with no send posted in between (saturating).
    pub(super) busy: u8,
    /// Receive offload is off on the socket ([`RecvBufs::adapt_offload`]).
    pub(super) gro_off: bool,
    /// Single-slot receives may use a plain `recvfrom` (~0.15 µs cheaper than a one-slot
    /// `recvmmsg`, twice per round trip): the socket has no GRO, or its GRO was turned off and
    /// a receive found the socket empty afterwards, so nothing queued can be a GRO batch.
    pub(super) plain: bool,
    /// Receives in a row in single mode that got one small datagram.
    pub(super) small_run: u32,
    /// A receive found a GSO segment of an mrkit sender cut apart from its batch (the
    /// kernel segments a GSO buffer that reaches the socket while its GRO is off, and the
    /// receiver can then no longer tell the segment's IPv4 ID): turn GRO back on at once, so
    /// that the retransmission arrives whole, and wait [`GRO_OFF_BACKOFF`] times longer
    /// before turning it off again.
    pub(super) cut_run: bool,
    /// Single-mode receives of one small datagram in a row after which GRO goes off
    /// ([`GRO_OFF_AFTER`], times [`GRO_OFF_BACKOFF`] for every cut run seen).
    pub(super) gro_off_after: u32,
}

/// Single-mode receives of one small datagram in a row after which receive offload is
/// turned off (request/response traffic has nothing to coalesce).
pub(super) const GRO_OFF_AFTER: u32 = 64;

/// Factor by which the wait before GRO goes off grows each time a GSO run reached the socket
/// while GRO was off (each such run costs a retransmission): a device whose traffic mixes
/// request/response with bulk transfers soon keeps GRO on.
pub(super) const GRO_OFF_BACKOFF: u32 = 64;

impl RecvBufs {
    /// Receive slots for the next pass: one for request/response traffic, else
    /// [`RX_SLOTS_PER_PASS`].
    pub(super) fn slots_per_pass(&self) -> usize {
        if self.single {
            1
        } else {
            RX_SLOTS_PER_PASS
        }
    }

    /// Receive slots for a pass that may take one datagram at a time (`one_ok`) or must take
    /// a full batch (see `poll_rx`).
    pub(super) fn slots_for(&self, one_ok: bool) -> usize {
        if one_ok {
            self.slots_per_pass()
        } else {
            RX_SLOTS_PER_PASS
        }
    }

    /// Adapt the receive mode and the socket's offload after a pass received `n` datagrams
    /// into `slots` slots (`small`: all below [`SMALL_DATAGRAM`]); `answered`: the
    /// application posted a send since the previous receive that found data.
    pub(super) fn after_receive(
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
                if cur.as_ref().is_none_or(|(n, _)| *n != qpn) {
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
/// (`held_acks::ACK_DELAY_MAX`: a held ACK leaves after the application's next packets), and
/// each is taken by its own pass. Counting only receives with no reply in between keeps a
/// fast peer's reply, already queued behind that ACK, from looking like a burst (taking the
/// echo's receives in batches of four cost ~0.4 µs per 8-byte SEND round trip).
const BURST_RECEIVES: u8 = 2;

/// The receive mode after a receive of `n` datagrams (`small`: all below [`SMALL_DATAGRAM`])
/// that followed `busy` receives in a row which found something.
pub(super) fn next_single(single: bool, busy: u8, n: usize, small: bool) -> bool {
    if n == 0 {
        single // nothing arrived: keep the mode
    } else {
        n == 1 && small && busy < BURST_RECEIVES
    }
}

/// A datagram below this size is request/response traffic (an ACK, a short message), not
/// part of a bulk transfer (see `RecvBufs::single`).
pub(super) const SMALL_DATAGRAM: usize = 1024;
