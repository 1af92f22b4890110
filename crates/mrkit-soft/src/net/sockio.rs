//! The one module of the UDP link allowed `unsafe`: socket options, batched sends with
//! segmentation offload (`sendmmsg` + `UDP_SEGMENT`) and batched receives with receive offload
//! (`recvmmsg` + `UDP_GRO`), as raw Linux system calls.
//!
//! Why not a crate: `quinn-udp` (used before) sends one buffer per call, and its receive path
//! enables `SO_TIMESTAMPNS`, `IP_PKTINFO` and `IP_RECVTOS` (three control messages the kernel
//! builds for every datagram, none of which the device uses), zeroes its headers on every
//! call and goes through glibc's cancellation-point wrappers. On this link every microsecond
//! of a round trip counts (docs/floors.md §2: the spinning UDP round trip is ~5 µs), so the device
//! talks to the kernel directly; rustix has no `UDP_SEGMENT` / `UDP_GRO` control messages.
//!
//! Every `unsafe` block below passes pointers to buffers that live across the call (stack
//! arrays or slices borrowed for the call) with lengths taken from those same buffers, and
//! reads back only what the kernel reports it wrote (`msg_len`, `msg_namelen`,
//! `msg_controllen`).
//!
//! The send sockets are deliberately **unconnected** with `IP_PMTUDISC_PROBE`: the kernel
//! then writes IPv4 identification 0 with DF (GSO segment `k` gets identification `k`), which
//! the ICRC covers and the device computes in advance (docs/roce.md §2.3). A connected socket
//! would number datagrams from a per-socket counter the device cannot know.

use std::io;
use std::mem::{size_of, zeroed, MaybeUninit};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::AsRawFd;

/// Most datagrams (or GSO buffers) one `sendmmsg` / `recvmmsg` call carries.
pub const MAX_BATCH: usize = 16;

/// Largest number of segments one GSO send may carry (the kernel's `UDP_MAX_SEGMENTS` is 64
/// on older kernels, 128 since 5.x: the smaller bound works everywhere).
pub const MAX_GSO_SEGMENTS: usize = 64;

/// Control-message space for one `UDP_SEGMENT` (u16) or `UDP_GRO` (int) message:
/// `CMSG_SPACE(4)` = 24 bytes on 64-bit Linux; 32 leaves room.
const CMSG_BUF: usize = 32;

/// A control-message buffer aligned like `cmsghdr`.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct CmsgBuf([u8; CMSG_BUF]);

fn setsockopt_int(sock: &UdpSocket, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: `value` is a live int and its size is passed; the fd is owned by `sock`.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            level,
            name,
            (&value as *const i32).cast(),
            size_of::<i32>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Configure a RoCEv2 socket: no fragmentation and DF set (`IP_PMTUDISC_PROBE`, plus
/// `IPV6_DONTFRAG` on IPv6), non-blocking, and with `gro` receive offload (`UDP_GRO`) when
/// the kernel has it. Returns whether GRO is on.
///
/// ```
/// let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// let gro = mrkit_soft::sockio::configure(&s, true).unwrap();
/// assert!(gro || !mrkit_soft::sockio::gso_supported(&s)); // GRO came with GSO (Linux ≥ 5.0)
/// ```
pub fn configure(sock: &UdpSocket, gro: bool) -> io::Result<bool> {
    sock.set_nonblocking(true)?;
    let v6 = sock.local_addr()?.is_ipv6();
    if v6 {
        setsockopt_int(
            sock,
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_PROBE,
        )?;
        setsockopt_int(sock, libc::IPPROTO_IPV6, libc::IPV6_DONTFRAG, 1)?;
        // IPv4-mapped peers on a dual-stack socket.
        let _ = setsockopt_int(
            sock,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_PROBE,
        );
    } else {
        setsockopt_int(
            sock,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_PROBE,
        )?;
    }
    Ok(gro && setsockopt_int(sock, libc::SOL_UDP, libc::UDP_GRO, 1).is_ok())
}

/// Turn receive offload (`UDP_GRO`) on or off. The kernel decides per datagram *when it
/// queues it*: with GRO off, a GSO buffer from a local sender is cut into datagrams on
/// arrival; with GRO on it is queued whole and only a receive that asks for control messages
/// ([`recv_batch`]) learns its segment size. A datagram queued before a switch keeps the form
/// it was queued in.
///
/// ```
/// let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// if mrkit_soft::sockio::set_gro(&s, true).is_ok() {
///     mrkit_soft::sockio::set_gro(&s, false).unwrap();
/// }
/// ```
pub fn set_gro(sock: &UdpSocket, on: bool) -> io::Result<()> {
    setsockopt_int(sock, libc::SOL_UDP, libc::UDP_GRO, i32::from(on))
}

/// Whether the kernel segments GSO sends (`UDP_SEGMENT`, Linux ≥ 4.18): setting the socket's
/// default segment size to 0 (= off) is accepted only where it exists.
///
/// ```
/// let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// let segments = if mrkit_soft::sockio::gso_supported(&s) { 64 } else { 1 };
/// assert!(segments >= 1);
/// ```
pub fn gso_supported(sock: &UdpSocket) -> bool {
    setsockopt_int(sock, libc::SOL_UDP, libc::UDP_SEGMENT, 0).is_ok()
}

/// Ask for a receive buffer of `bytes` (`SO_RCVBUFFORCE` when privileged, else `SO_RCVBUF`,
/// which the kernel caps at `net.core.rmem_max`).
///
/// ```
/// let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// mrkit_soft::sockio::set_recv_buffer(&s, 8 << 20);
/// ```
pub fn set_recv_buffer(sock: &UdpSocket, bytes: usize) {
    let v = i32::try_from(bytes).unwrap_or(i32::MAX);
    if setsockopt_int(sock, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, v).is_err() {
        let _ = setsockopt_int(sock, libc::SOL_SOCKET, libc::SO_RCVBUF, v);
    }
}

/// One outgoing UDP payload: a datagram, or with `segment` a GSO buffer the kernel cuts into
/// datagrams of `segment` bytes (the last may be shorter).
#[derive(Debug, Clone, Copy)]
pub struct OutMsg<'a> {
    /// Destination.
    pub dst: SocketAddr,
    /// The bytes (at most 65,507 in all).
    pub bytes: &'a [u8],
    /// GSO segment size, or `None` for a single datagram.
    pub segment: Option<u16>,
}

/// A `sockaddr_in` / `sockaddr_in6` for `addr`, and its length.
fn sockaddr_of(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid (AF_UNSPEC) value.
    let mut st: libc::sockaddr_storage = unsafe { zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut st as *mut libc::sockaddr_storage).cast(), sin) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&mut st as *mut libc::sockaddr_storage).cast(), sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (st, len as libc::socklen_t)
}

/// The address the kernel wrote into `st` (`None` for a family other than IPv4/IPv6).
fn socket_addr_of(st: &libc::sockaddr_storage, len: libc::socklen_t) -> Option<SocketAddr> {
    let len = len as usize;
    match i32::from(st.ss_family) {
        libc::AF_INET if len >= size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family says the storage holds a sockaddr_in, and it is long enough.
            let sin: &libc::sockaddr_in = unsafe { &*(st as *const libc::sockaddr_storage).cast() };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 if len >= size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6: &libc::sockaddr_in6 =
                unsafe { &*(st as *const libc::sockaddr_storage).cast() };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                u32::from_be(sin6.sin6_flowinfo),
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// The per-message buffers of one `sendmmsg` / `recvmmsg` call: addresses, one iovec each,
/// control buffers and the headers pointing at them. Only the headers (and control buffers)
/// of the messages in use are initialised: a batch is usually one message, and clearing all
/// of them cost more than the rest of the set-up.
struct Batch<const N: usize> {
    names: [MaybeUninit<libc::sockaddr_storage>; N],
    iovs: [MaybeUninit<libc::iovec>; N],
    ctrl: [MaybeUninit<CmsgBuf>; N],
    hdrs: [MaybeUninit<libc::mmsghdr>; N],
}

impl<const N: usize> Batch<N> {
    fn new() -> Self {
        Batch {
            names: [MaybeUninit::uninit(); N],
            iovs: [MaybeUninit::uninit(); N],
            ctrl: [MaybeUninit::uninit(); N],
            hdrs: [MaybeUninit::uninit(); N],
        }
    }

    /// Initialise message `i`: its iovec `iov`, its address buffer (holding `name` if given,
    /// else room for the kernel to write one) and its header; returns the header.
    fn message(
        &mut self,
        i: usize,
        iov: libc::iovec,
        name: Option<(libc::sockaddr_storage, libc::socklen_t)>,
    ) -> &mut libc::msghdr {
        let namelen = match name {
            Some((st, len)) => {
                self.names[i].write(st);
                len
            }
            None => {
                // SAFETY: plain old data; all-zero is AF_UNSPEC (the kernel writes over it).
                self.names[i].write(unsafe { zeroed() });
                size_of::<libc::sockaddr_storage>() as libc::socklen_t
            }
        };
        self.iovs[i].write(iov);
        // SAFETY: mmsghdr is plain old data; all-zero means "no name, no iovec, no control".
        let h = &mut self.hdrs[i].write(unsafe { zeroed() }).msg_hdr;
        h.msg_name = self.names[i].as_mut_ptr().cast();
        h.msg_namelen = namelen;
        h.msg_iov = self.iovs[i].as_mut_ptr();
        h.msg_iovlen = 1;
        h
    }

    /// Message `i`'s header and its control buffer, cleared.
    fn control(&mut self, i: usize) -> (&mut libc::msghdr, &mut CmsgBuf) {
        // SAFETY: callers initialise header `i` with `message` first.
        let h = unsafe { &mut self.hdrs[i].assume_init_mut().msg_hdr };
        (h, self.ctrl[i].write(CmsgBuf([0; CMSG_BUF])))
    }

    /// Header `i` and its address buffer, initialised by `message`.
    ///
    /// # Safety
    /// `message(i, ..)` must have been called.
    unsafe fn header(&self, i: usize) -> (&libc::mmsghdr, &libc::sockaddr_storage) {
        // SAFETY: the caller's promise (`message` writes both).
        unsafe {
            (
                self.hdrs[i].assume_init_ref(),
                self.names[i].assume_init_ref(),
            )
        }
    }

    /// `sendmmsg` / `recvmmsg` (`nr`) over the first `n` messages, retried on EINTR, as a raw
    /// system call (glibc's wrappers add cancellation-point bookkeeping). Returns how many
    /// messages went, or the errno.
    ///
    /// # Safety
    /// Messages `0..n` must have been initialised with `message`, and every buffer their
    /// iovecs and control pointers name must be valid (for reading, or for writing with
    /// `recvmmsg`) for its length until the call returns.
    unsafe fn call(&mut self, nr: libc::c_long, sock: &UdpSocket, n: usize) -> Result<usize, i32> {
        loop {
            // SAFETY: the caller's promise; the extra timeout argument (NULL) is read by
            // recvmmsg only.
            let r = unsafe {
                libc::syscall(
                    nr,
                    sock.as_raw_fd(),
                    self.hdrs.as_mut_ptr().cast::<libc::mmsghdr>(),
                    n as libc::c_uint,
                    libc::MSG_DONTWAIT,
                    std::ptr::null_mut::<libc::timespec>(),
                )
            };
            if r >= 0 {
                return Ok(r as usize);
            }
            // SAFETY: reads this thread's errno.
            let errno = unsafe { *libc::__errno_location() };
            if errno != libc::EINTR {
                return Err(errno);
            }
        }
    }
}

/// Send up to [`MAX_BATCH`] messages with one `sendmmsg`. Returns how many the kernel took
/// (a prefix of `msgs`; fewer than all when the send buffer filled or message `n` failed, in
/// which case the next call reports that message's error). `WouldBlock` when not even the
/// first fits.
///
/// ```
/// use mrkit_soft::sockio::{configure, send_batch, OutMsg};
/// let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// configure(&a, false).unwrap();
/// let run = vec![7u8; 3000]; // three datagrams of 1000 bytes, segmented by the kernel
/// let msgs = [
///     OutMsg { dst: b.local_addr().unwrap(), bytes: &run, segment: Some(1000) },
///     OutMsg { dst: b.local_addr().unwrap(), bytes: b"last", segment: None },
/// ];
/// assert_eq!(send_batch(&a, &msgs).unwrap(), 2);
/// ```
pub fn send_batch(sock: &UdpSocket, msgs: &[OutMsg<'_>]) -> io::Result<usize> {
    let n = msgs.len().min(MAX_BATCH);
    if n == 0 {
        return Ok(0);
    }
    if let [OutMsg {
        dst,
        bytes,
        segment: None,
    }] = msgs
    {
        // One plain datagram (a request or ACK of request/response traffic): `sendto`, which
        // copies no message header or iovec array from user space (~0.15 µs less than a
        // one-message `sendmmsg` per send here, measured in C beside the kernel's calls).
        return send_one(sock, bytes, dst).map(|_| 1);
    }
    let mut b = Batch::<MAX_BATCH>::new();
    for (i, m) in msgs.iter().take(n).enumerate() {
        let iov = libc::iovec {
            iov_base: m.bytes.as_ptr() as *mut libc::c_void,
            iov_len: m.bytes.len(),
        };
        b.message(i, iov, Some(sockaddr_of(&m.dst)));
        if let Some(seg) = m.segment {
            let (h, buf) = b.control(i);
            h.msg_control = buf.0.as_mut_ptr().cast();
            // SAFETY: CMSG_SPACE/CMSG_LEN are pure size computations.
            let space = unsafe { libc::CMSG_SPACE(size_of::<u16>() as u32) } as usize;
            debug_assert!(space <= CMSG_BUF);
            h.msg_controllen = space as _;
            // SAFETY: msg_control points at `space` bytes of the control buffer, aligned for
            // cmsghdr, so CMSG_FIRSTHDR is non-null and the header plus a u16 payload fit.
            unsafe {
                let c = libc::CMSG_FIRSTHDR(h);
                (*c).cmsg_level = libc::SOL_UDP;
                (*c).cmsg_type = libc::UDP_SEGMENT;
                (*c).cmsg_len = libc::CMSG_LEN(size_of::<u16>() as u32) as _;
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), seg);
            }
        }
    }
    // SAFETY: messages 0..n are initialised; each iovec covers a borrowed slice of exactly its
    // length and each control pointer its buffer in `b`, all alive across the call.
    unsafe { b.call(libc::SYS_sendmmsg, sock, n) }.map_err(io::Error::from_raw_os_error)
}

/// Send one datagram with a raw `sendto`; returns the bytes sent (`WouldBlock` when the
/// send buffer is full).
///
/// ```
/// use mrkit_soft::sockio::{configure, send_one};
/// let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// configure(&a, false).unwrap();
/// assert_eq!(send_one(&a, b"ping", &b.local_addr().unwrap()).unwrap(), 4);
/// let mut buf = [0u8; 8];
/// b.set_nonblocking(false).unwrap();
/// assert_eq!(b.recv(&mut buf).unwrap(), 4);
/// ```
pub fn send_one(sock: &UdpSocket, bytes: &[u8], dst: &SocketAddr) -> io::Result<usize> {
    let (name, namelen) = sockaddr_of(dst);
    loop {
        // SAFETY: `bytes` is a live slice of the length passed, `name` a live address of
        // `namelen` bytes; the fd is owned by `sock`.
        let r = unsafe {
            libc::syscall(
                libc::SYS_sendto,
                sock.as_raw_fd(),
                bytes.as_ptr(),
                bytes.len(),
                libc::MSG_DONTWAIT,
                (&name as *const libc::sockaddr_storage).cast::<libc::sockaddr>(),
                namelen,
            )
        };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// What one receive slot got.
#[derive(Debug, Clone, Copy)]
pub struct RecvMeta {
    /// Sender.
    pub addr: SocketAddr,
    /// Bytes received in the slot.
    pub len: usize,
    /// Size of each datagram in a GRO batch (`len` when the slot holds one datagram).
    pub stride: usize,
}

impl Default for RecvMeta {
    fn default() -> Self {
        RecvMeta {
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            len: 0,
            stride: 0,
        }
    }
}

/// Receive into up to [`MAX_BATCH`] buffers with one non-blocking `recvmmsg`; fills `meta[i]`
/// for each slot `i` that received and returns how many did: 0 when none was ready (no
/// `io::Error` is built for the common empty poll of a spinning receiver).
/// A slot whose sender is not IPv4/IPv6 is reported with the unspecified address.
///
/// ```
/// use mrkit_soft::sockio::{configure, recv_batch, send_batch, OutMsg, RecvMeta};
/// let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// configure(&a, false).unwrap();
/// configure(&b, true).unwrap();
/// let msg = OutMsg { dst: b.local_addr().unwrap(), bytes: b"ping", segment: None };
/// assert_eq!(send_batch(&a, &[msg]).unwrap(), 1);
/// let mut buf = [0u8; 64];
/// let mut meta = [RecvMeta::default(); 1];
/// let n = loop {
///     match recv_batch(&b, &mut [&mut buf[..]], &mut meta).unwrap() {
///         0 => std::thread::yield_now(), // nothing yet
///         n => break n,
///     }
/// };
/// assert_eq!((n, &buf[..meta[0].len]), (1, &b"ping"[..]));
/// ```
pub fn recv_batch(
    sock: &UdpSocket,
    bufs: &mut [&mut [u8]],
    meta: &mut [RecvMeta],
) -> io::Result<usize> {
    recv_batch_n::<MAX_BATCH>(sock, bufs, meta)
}

/// [`recv_batch`] with up to `N` slots per call (a larger batch for a receiver that takes
/// many small datagrams, such as a benchmark floor without receive offload).
///
/// ```
/// use mrkit_soft::sockio::{recv_batch_n, RecvMeta};
/// let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// s.set_nonblocking(true).unwrap();
/// let mut storage = vec![vec![0u8; 4096]; 64];
/// let mut bufs: Vec<&mut [u8]> = storage.iter_mut().map(|b| &mut b[..]).collect();
/// let mut meta = [RecvMeta::default(); 64];
/// assert_eq!(recv_batch_n::<64>(&s, &mut bufs, &mut meta).unwrap(), 0); // nothing sent yet
/// ```
pub fn recv_batch_n<const N: usize>(
    sock: &UdpSocket,
    bufs: &mut [&mut [u8]],
    meta: &mut [RecvMeta],
) -> io::Result<usize> {
    let n = bufs.len().min(meta.len()).min(N);
    if n == 0 {
        return Ok(0);
    }
    let mut b = Batch::<N>::new();
    for (i, buf) in bufs.iter_mut().take(n).enumerate() {
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        b.message(i, iov, None);
        let (h, ctrl) = b.control(i);
        h.msg_control = ctrl.0.as_mut_ptr().cast();
        h.msg_controllen = CMSG_BUF as _;
    }
    // SAFETY: messages 0..n are initialised; each iovec covers a live mutable slice of
    // exactly its length, each name and control pointer a buffer in `b` of the length given.
    let got = match unsafe { b.call(libc::SYS_recvmmsg, sock, n) } {
        Ok(got) => got,
        Err(e) if e == libc::EAGAIN || e == libc::EWOULDBLOCK => return Ok(0),
        Err(e) => return Err(io::Error::from_raw_os_error(e)),
    };
    for i in 0..got.min(n) {
        // SAFETY: initialised above (i < n); the kernel wrote `msg_namelen` bytes of address
        // into the (zeroed) name buffer and never reports more than its size.
        let (hdr, name) = unsafe { b.header(i) };
        let h = &hdr.msg_hdr;
        let len = (hdr.msg_len as usize).min(bufs[i].len());
        let addr = socket_addr_of(name, h.msg_namelen)
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let mut stride = len;
        // `msg_controllen` is a size_t with glibc and a socklen_t with musl.
        #[allow(clippy::unnecessary_cast)]
        let controllen = h.msg_controllen as usize;
        if controllen >= size_of::<libc::cmsghdr>() {
            // SAFETY: the kernel wrote `msg_controllen` (≤ CMSG_BUF) bytes of control messages
            // into message i's control buffer; CMSG_FIRSTHDR/NXTHDR stay within that length,
            // and a UDP_GRO message carries one int.
            unsafe {
                let mut c = libc::CMSG_FIRSTHDR(h);
                while !c.is_null() {
                    if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == libc::UDP_GRO {
                        let s = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<i32>());
                        if s > 0 {
                            stride = s as usize;
                        }
                    }
                    c = libc::CMSG_NXTHDR(h, c);
                }
            }
        }
        meta[i] = RecvMeta { addr, len, stride };
    }
    Ok(got.min(n))
}

/// Receive one datagram with a raw non-blocking `recvfrom`: its sender and length, or `None`
/// when nothing is ready. Cheaper than a one-slot [`recv_batch`] (no message header or iovec
/// array copied in, ~0.15 µs per receive here) but blind to receive offload: on a socket with
/// `UDP_GRO` on, a GRO batch would arrive as one buffer of unknown stride. Use it only on a
/// socket whose GRO is off and which held no datagram when it was turned off ([`set_gro`]).
/// A datagram longer than `buf` is truncated to it; a sender that is not IPv4/IPv6 is
/// reported as the unspecified address.
///
/// ```
/// use mrkit_soft::sockio::{recv_one, send_one};
/// let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// let mut buf = [0u8; 64];
/// assert_eq!(recv_one(&b, &mut buf).unwrap(), None); // nothing sent yet
/// send_one(&a, b"pong", &b.local_addr().unwrap()).unwrap();
/// let (from, len) = loop {
///     if let Some(got) = recv_one(&b, &mut buf).unwrap() {
///         break got;
///     }
/// };
/// assert_eq!((from, &buf[..len]), (a.local_addr().unwrap(), &b"pong"[..]));
/// ```
pub fn recv_one(sock: &UdpSocket, buf: &mut [u8]) -> io::Result<Option<(SocketAddr, usize)>> {
    // SAFETY: plain old data; all-zero is AF_UNSPEC (the kernel writes over it).
    let mut name: libc::sockaddr_storage = unsafe { zeroed() };
    loop {
        let mut namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: `buf` is a live mutable slice of the length passed; `name` and `namelen`
        // are live and `namelen` holds `name`'s size; the fd is owned by `sock`.
        let r = unsafe {
            libc::syscall(
                libc::SYS_recvfrom,
                sock.as_raw_fd(),
                buf.as_mut_ptr(),
                buf.len(),
                libc::MSG_DONTWAIT,
                (&mut name as *mut libc::sockaddr_storage).cast::<libc::sockaddr>(),
                &mut namelen as *mut libc::socklen_t,
            )
        };
        if r >= 0 {
            let addr = socket_addr_of(&name, namelen)
                .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
            return Ok(Some((addr, (r as usize).min(buf.len()))));
        }
        // SAFETY: reads this thread's errno.
        let errno = unsafe { *libc::__errno_location() };
        match errno {
            libc::EINTR => continue,
            e if e == libc::EAGAIN || e == libc::EWOULDBLOCK => return Ok(None),
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    }
}

/// MTU of the network interface holding `ip` (getifaddrs + `/sys/class/net/<if>/mtu`); `None`
/// when no interface holds it. The active-MTU rule of the port (`ibv_query_port`) needs it.
pub fn netdev_mtu(ip: std::net::IpAddr) -> Option<u32> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills ifap on success; freed with freeifaddrs below.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return None;
    }
    let mut name = None;
    let mut p = ifap;
    while !p.is_null() {
        // SAFETY: p is an element of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr of the family it names.
            let a = unsafe { sockaddr_ip(ifa.ifa_addr) };
            if a == Some(ip) {
                // SAFETY: ifa_name is a NUL-terminated string.
                name = Some(
                    unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
                        .to_string_lossy()
                        .into_owned(),
                );
                break;
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(ifap) };
    let name = name?;
    std::fs::read_to_string(format!("/sys/class/net/{name}/mtu"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// # Safety
/// `sa` points to a valid sockaddr.
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<std::net::IpAddr> {
    // SAFETY: caller contract; the family tells the real type.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let s = &*sa.cast::<libc::sockaddr_in>();
                Some(std::net::IpAddr::from(
                    u32::from_be(s.sin_addr.s_addr).to_be_bytes(),
                ))
            }
            libc::AF_INET6 => {
                let s = &*sa.cast::<libc::sockaddr_in6>();
                Some(std::net::IpAddr::from(s.sin6_addr.s6_addr))
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (UdpSocket, UdpSocket) {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        configure(&a, true).unwrap();
        configure(&b, true).unwrap();
        (a, b)
    }

    fn recv_all(s: &UdpSocket, want: usize) -> Vec<(SocketAddr, Vec<u8>)> {
        let mut out = Vec::new();
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut storage = vec![vec![0u8; 65536]; 4];
        while out.len() < want && std::time::Instant::now() < end {
            let mut bufs: Vec<&mut [u8]> = storage.iter_mut().map(|b| &mut b[..]).collect();
            let mut meta = [RecvMeta::default(); 4];
            match recv_batch(s, &mut bufs, &mut meta) {
                Ok(0) => std::thread::yield_now(),
                Ok(k) => {
                    for (i, m) in meta.iter().take(k).enumerate() {
                        for c in bufs[i][..m.len].chunks(m.stride) {
                            out.push((m.addr, c.to_vec()));
                        }
                    }
                }
                Err(e) => panic!("{e}"),
            }
        }
        out
    }

    #[test]
    fn batch_of_gso_runs_and_single_datagrams_arrives_in_order() {
        let (a, b) = pair();
        assert!(gso_supported(&a), "this kernel has UDP_SEGMENT");
        let dst = b.local_addr().unwrap();
        let run: Vec<u8> = (0..1000u32).map(|i| (i / 300) as u8).collect(); // 300,300,300,100
        let single = vec![7u8; 50];
        let msgs = [
            OutMsg {
                dst,
                bytes: &run,
                segment: Some(300),
            },
            OutMsg {
                dst,
                bytes: &single,
                segment: None,
            },
        ];
        assert_eq!(send_batch(&a, &msgs).unwrap(), 2);
        let got = recv_all(&b, 5);
        let lens: Vec<usize> = got.iter().map(|(_, d)| d.len()).collect();
        assert_eq!(lens, [300, 300, 300, 100, 50]);
        assert!(got[..4]
            .iter()
            .enumerate()
            .all(|(k, (_, d))| d.iter().all(|&x| x == k as u8)));
        assert!(got[4].1.iter().all(|&x| x == 7));
        assert!(got.iter().all(|(s, _)| *s == a.local_addr().unwrap()));
    }

    /// With GRO off a GSO run is cut into datagrams on arrival, so plain `recvfrom` sees each
    /// on its own; with GRO on, `recvmmsg` gets it whole with its stride.
    #[test]
    fn gro_switch_decides_how_a_gso_run_is_queued() {
        let (a, b) = pair();
        let dst = b.local_addr().unwrap();
        let run: Vec<u8> = (0..3u8).flat_map(|k| [k; 500]).collect();
        let msg = [OutMsg {
            dst,
            bytes: &run,
            segment: Some(500),
        }];
        set_gro(&b, false).unwrap();
        assert_eq!(send_batch(&a, &msg).unwrap(), 1);
        let mut buf = [0u8; 2048];
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut got = Vec::new();
        while got.len() < 3 && std::time::Instant::now() < end {
            if let Some((from, len)) = recv_one(&b, &mut buf).unwrap() {
                assert_eq!(from, a.local_addr().unwrap());
                got.push(buf[..len].to_vec());
            }
        }
        assert_eq!(got, (0..3u8).map(|k| vec![k; 500]).collect::<Vec<_>>());
        assert_eq!(recv_one(&b, &mut buf).unwrap(), None);
        set_gro(&b, true).unwrap();
        assert_eq!(send_batch(&a, &msg).unwrap(), 1);
        let mut storage = vec![0u8; 4096];
        let mut meta = [RecvMeta::default(); 1];
        let n = loop {
            match recv_batch(&b, &mut [&mut storage[..]], &mut meta).unwrap() {
                0 if std::time::Instant::now() < end => std::thread::yield_now(),
                n => break n,
            }
        };
        assert_eq!(
            (n, meta[0].len, meta[0].stride),
            (1, 1500, 500),
            "one GRO batch"
        );
    }

    #[test]
    fn empty_socket_receives_nothing_and_empty_batches_are_no_ops() {
        let (a, b) = pair();
        let mut buf = [0u8; 64];
        let mut bufs: [&mut [u8]; 1] = [&mut buf];
        let mut meta = [RecvMeta::default(); 1];
        assert_eq!(recv_batch(&b, &mut bufs, &mut meta).unwrap(), 0);
        assert_eq!(send_batch(&a, &[]).unwrap(), 0);
        assert_eq!(recv_batch(&b, &mut [], &mut meta).unwrap(), 0);
    }

    #[test]
    fn ipv6_round_trip() {
        let Ok(a) = UdpSocket::bind("[::1]:0") else {
            eprintln!(
                "SKIP sockio::tests::ipv6_round_trip: no IPv6 loopback (::1) on this machine"
            );
            return;
        };
        let b = UdpSocket::bind("[::1]:0").unwrap();
        configure(&a, true).unwrap();
        configure(&b, true).unwrap();
        let dst = b.local_addr().unwrap();
        let data = [1u8, 2, 3];
        let msgs = [OutMsg {
            dst,
            bytes: &data,
            segment: None,
        }];
        assert_eq!(send_batch(&a, &msgs).unwrap(), 1);
        let got = recv_all(&b, 1);
        assert_eq!(got, vec![(a.local_addr().unwrap(), data.to_vec())]);
    }
}
