//! Connecting queue pairs of two processes over a TCP side channel, the way perftest and
//! `ibv_rc_pingpong` exchange their endpoints.
//!
//! The server binds a [`Listener`] and calls [`Listener::accept`]; the client calls
//! [`connect`]. Each returns a [`Connection`]: a [`QueuePair`] in RTS connected to the peer's,
//! plus the peer's *private data*, an application blob of at most [`MAX_PRIVATE_DATA`] bytes
//! (as RDMA-CM's private data), e.g. a [`RemoteSlice`](crate::RemoteSlice) the peer may READ.
//!
//! ```
//! use mrkit::tcp::{self, HandshakeOpts, Listener};
//! use mrkit::{Context, QpCap, QpState};
//! let listener = Listener::bind("127.0.0.1:0").unwrap();
//! let addr = listener.local_addr().unwrap();
//! let server = std::thread::spawn(move || {
//!     let pd = Context::open_default().unwrap().alloc_pd().unwrap();
//!     let opts = HandshakeOpts { private_data: b"hello from the server".to_vec(), ..Default::default() };
//!     let c = listener.accept(&pd, QpCap::default(), &opts).unwrap();
//!     assert_eq!(c.private_data, b"hi");
//! });
//! let pd = Context::open_default().unwrap().alloc_pd().unwrap();
//! let opts = HandshakeOpts { private_data: b"hi".to_vec(), ..Default::default() };
//! let c = tcp::connect(addr, &pd, QpCap::default(), &opts).unwrap();
//! assert_eq!(c.private_data, b"hello from the server");
//! assert_eq!(c.qp.state().unwrap(), QpState::Rts);
//! server.join().unwrap();
//! ```
//!
//! # Addresses (`MRKIT_ADDR`)
//!
//! The TCP address is only the side channel; RDMA traffic goes between the two devices'
//! RoCEv2 addresses, which the endpoints carry as GIDs. On `mrkit0` that is the address its
//! UDP link binds (port 4791): `MRKIT_ADDR` (`ip` or `ip:port`, read by
//! [`Context::open_default`](crate::Context::open_default); a program that builds its own
//! [`DeviceConfig`](crate::DeviceConfig) sets `DeviceConfig::udp_addr`), or by default a
//! `127.x.y.z` derived from the process id. So two processes **on one host** need no setup; processes on
//! **two hosts** (or network namespaces) must each set `MRKIT_ADDR` to their own address on
//! the link between them (e.g. `MRKIT_ADDR=192.0.2.1` and `MRKIT_ADDR=192.0.2.2`), and UDP
//! port 4791 must be reachable. A wildcard such as `0.0.0.0` is refused (EADDRNOTAVAIL): a
//! peer could not reach it. Two processes on one host cannot share one address.
//!
//! # The handshake
//!
//! Messages are an 8-byte header (magic `MRKC`, version 1, kind, body length as a big-endian
//! `u16`) and a body: `HELLO` (the sender's 48-byte [`Endpoint`] and its private data),
//! `READY` (empty) or `REJECT` (a reason, UTF-8).
//!
//! 1. client → server: `HELLO`;
//! 2. the server creates its QP, connects it (RTS), server → client: `HELLO`;
//! 3. the client connects its QP (RTS), client → server: `READY`;
//! 4. server → client: `READY`.
//!
//! A server that must check what a client asks for before it spends anything on it (memory
//! sized by the request, a QP) splits [`Listener::accept`] into [`Listener::accept_stream`]
//! and [`accept_on`], whose admission check sees the client's HELLO before step 2 and
//! answers with the server's private data or a `REJECT` reason.
//!
//! So when either side returns, the peer's QP is past RTR and may be sent to. Every read and
//! the accept itself have deadlines ([`HandshakeOpts`]); a peer that sends garbage, too much
//! (a body over 256 bytes is never read), nothing, or hangs up mid-handshake ends that
//! handshake with a [`ConnectError`], and the QP made for it is destroyed. The side that finds
//! the fault sends `REJECT` with the reason where it can, so a well-behaved peer gets a clear
//! error. A [`Listener`] serves the next client after a failed one.
//!
//! A peer decides where this side's QP sends: a hostile client can name any GID. As with
//! perftest, the side channel is not authenticated; run it on a network you trust, or check
//! [`Connection::remote`] and [`Connection::peer`] before posting.
#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::{Errno, Error, QpCap};

use super::endpoint::{ConnectOpts, Endpoint};
use super::QueuePair;
use crate::verbs::ProtectionDomain;

/// Most bytes of private data a handshake carries each way (RDMA-CM carries 56 to 196).
pub const MAX_PRIVATE_DATA: usize = 256;

/// Options of a handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandshakeOpts {
    /// Attributes of the RDMA connection.
    pub connect: ConnectOpts,
    /// Sent to the peer (at most [`MAX_PRIVATE_DATA`] bytes).
    pub private_data: Vec<u8>,
    /// The whole handshake (TCP connect included, for [`connect`]; from the TCP accept, for
    /// [`Listener::accept`]) must end within this. Default 10 s.
    pub timeout: Duration,
    /// How long [`Listener::accept`] waits for a client to connect (`None`: forever).
    /// Default 60 s.
    pub accept_timeout: Option<Duration>,
}

impl Default for HandshakeOpts {
    fn default() -> Self {
        HandshakeOpts {
            connect: ConnectOpts::default(),
            private_data: Vec::new(),
            timeout: Duration::from_secs(10),
            accept_timeout: Some(Duration::from_secs(60)),
        }
    }
}

/// A queue pair connected to a peer's, and what the peer sent with it.
#[derive(Debug)]
pub struct Connection {
    /// In RTS, connected to the peer's QP, which is in RTR or RTS.
    pub qp: QueuePair,
    /// The peer's private data.
    pub private_data: Vec<u8>,
    /// The peer's endpoint (its QP number, PSN, GID).
    pub remote: Endpoint,
    /// The peer's side-channel address.
    pub peer: SocketAddr,
    /// The side channel, still open (blocking, no timeouts): the application may use it,
    /// e.g. to learn that the peer is done (it reads end-of-file once the peer closes).
    pub stream: TcpStream,
}

/// Why a handshake failed. No QP is left behind by a failed handshake.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The side channel failed (connection refused, reset, ...).
    #[error("{during}: {source}")]
    Io {
        /// What the handshake was doing.
        during: &'static str,
        /// The socket error.
        #[source]
        source: io::Error,
    },
    /// The deadline passed ([`HandshakeOpts::timeout`] or [`HandshakeOpts::accept_timeout`]).
    #[error("{during}: timed out after {after:?}")]
    TimedOut {
        /// What the handshake was waiting for.
        during: &'static str,
        /// The deadline.
        after: Duration,
    },
    /// The peer closed (or reset) the side channel before the handshake ended.
    #[error("{during}: the peer closed the connection")]
    Closed {
        /// What the handshake was waiting for.
        during: &'static str,
    },
    /// The peer sent something that is not this handshake.
    #[error("{during}: the peer broke the mrkit handshake: {reason}")]
    Protocol {
        /// What the handshake was waiting for.
        during: &'static str,
        /// What was wrong.
        reason: String,
    },
    /// The peer refused the connection (it sent `REJECT`) with this reason.
    #[error("the peer refused the connection: {0}")]
    Rejected(String),
    /// This side refused the peer's HELLO (the admission check of [`accept_on`]) for this
    /// reason, which the peer received in a `REJECT`.
    #[error("the client was refused: {0}")]
    Refused(String),
    /// This side could not make or connect its QP, or an option is invalid.
    #[error(transparent)]
    Local(#[from] Error),
}

impl ConnectError {
    /// Whether the deadline passed.
    ///
    /// ```
    /// use std::time::Duration;
    /// use mrkit::tcp::{HandshakeOpts, Listener};
    /// let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let listener = Listener::bind("127.0.0.1:0").unwrap();
    /// let opts = HandshakeOpts { accept_timeout: Some(Duration::from_millis(10)), ..Default::default() };
    /// let err = listener.accept(&pd, Default::default(), &opts).unwrap_err(); // no client came
    /// assert!(err.is_timeout());
    /// ```
    pub fn is_timeout(&self) -> bool {
        matches!(self, ConnectError::TimedOut { .. })
    }
}

/// A TCP listener that accepts RDMA connections.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
}

impl Listener {
    /// Listen on `addr` (port 0: any free port, see [`Listener::local_addr`]).
    ///
    /// ```
    /// use mrkit::tcp::Listener;
    /// let listener = Listener::bind("127.0.0.1:0").unwrap();
    /// let taken = listener.local_addr().unwrap();
    /// let again = Listener::bind(taken).unwrap_err(); // one listener per address
    /// assert_eq!(again.kind(), std::io::ErrorKind::AddrInUse);
    /// ```
    pub fn bind(addr: impl ToSocketAddrs) -> io::Result<Listener> {
        let inner = TcpListener::bind(addr)?;
        // Non-blocking, so accept can wait with a deadline (poll) instead of forever.
        inner.set_nonblocking(true)?;
        Ok(Listener { inner })
    }

    /// The address clients connect to (with the port the system chose for port 0).
    ///
    /// ```
    /// let listener = mrkit::tcp::Listener::bind("127.0.0.1:0").unwrap();
    /// let addr = listener.local_addr().unwrap(); // give this to the clients
    /// assert!(addr.ip().is_loopback() && addr.port() != 0);
    /// ```
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// Wait for one client (at most `opts.accept_timeout`) and run the handshake with it
    /// (at most `opts.timeout`): a QP in `pd` with `cap`, connected to the client's.
    ///
    /// A failed handshake is this client's error; the listener is unaffected and the next
    /// call serves the next client:
    ///
    /// ```no_run
    /// # use mrkit::tcp::{HandshakeOpts, Listener};
    /// # let pd = mrkit::Context::open_default().unwrap().alloc_pd().unwrap();
    /// let listener = Listener::bind("127.0.0.1:7471").unwrap();
    /// let opts = HandshakeOpts { accept_timeout: None, ..Default::default() };
    /// loop {
    ///     match listener.accept(&pd, Default::default(), &opts) {
    ///         Ok(conn) => { /* serve conn.qp */ }
    ///         Err(e) => eprintln!("client refused: {e}"),
    ///     }
    /// }
    /// ```
    pub fn accept(
        &self,
        pd: &ProtectionDomain,
        cap: QpCap,
        opts: &HandshakeOpts,
    ) -> Result<Connection, ConnectError> {
        check_private(opts)?;
        let (stream, _) = self.accept_stream(opts.accept_timeout)?;
        let private = opts.private_data.clone();
        accept_on(stream, pd, cap, opts, |_, _| Ok(private))
    }

    /// Wait for one client's TCP connection (at most `timeout`; `None`: forever), without
    /// the handshake: [`accept_on`] runs it. For a server that logs or limits its clients by
    /// address before it spends anything on them; [`Listener::accept`] does both steps.
    ///
    /// ```
    /// use std::time::Duration;
    /// let listener = mrkit::tcp::Listener::bind("127.0.0.1:0").unwrap();
    /// let err = listener.accept_stream(Some(Duration::from_millis(10))).unwrap_err();
    /// assert!(err.is_timeout()); // no client came
    /// ```
    pub fn accept_stream(
        &self,
        timeout: Option<Duration>,
    ) -> Result<(TcpStream, SocketAddr), ConnectError> {
        use rustix::event::{poll, PollFd, PollFlags, Timespec};
        const DURING: &str = "waiting for a client";
        let end = timeout.map(|t| Instant::now() + t);
        loop {
            match self.inner.accept() {
                Ok(x) => return Ok(x),
                // A client that reset before we took it: wait for the next.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::Interrupted
                            | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(source) => {
                    return Err(ConnectError::Io {
                        during: DURING,
                        source,
                    })
                }
            }
            let left = match end {
                None => None,
                Some(end) => {
                    let left = end.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(ConnectError::TimedOut {
                            during: DURING,
                            after: timeout.unwrap_or_default(),
                        });
                    }
                    // Over ~292 years does not fit a Timespec: wait forever instead.
                    Timespec::try_from(left).ok()
                }
            };
            let mut fds = [PollFd::new(&self.inner, PollFlags::IN)];
            match poll(&mut fds, left.as_ref()) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    return Err(ConnectError::Io {
                        during: DURING,
                        source: e.into(),
                    })
                }
            }
        }
    }
}

/// Connect to the [`Listener`] at `addr` and run the handshake (at most `opts.timeout`,
/// TCP connect included): a QP in `pd` with `cap`, connected to the server's.
///
/// A host name in `addr` is resolved first by the system resolver, whose time the deadline
/// does not bound; pass a socket address to avoid it.
///
/// A client that READs a value the server offers: the server, another process, listens on
/// port 7471 and sends as private data the [`RemoteSlice`](crate::RemoteSlice) it lets the
/// client read (the module example runs both sides in one process).
///
/// ```no_run
/// use std::time::Duration;
/// use mrkit::tcp::{self, HandshakeOpts};
/// use mrkit::{AccessFlags, Buffer, Context, QpCap, RemoteSlice, WcError};
///
/// fn main() -> Result<(), Box<dyn std::error::Error>> {
///     // `open_default`: `MRKIT_ADDR` names this host's address on the link to the server.
///     let pd = Context::open_default()?.alloc_pd()?;
///     let opts = HandshakeOpts { timeout: Duration::from_secs(5), ..Default::default() };
///     let conn = tcp::connect("127.0.0.1:7471", &pd, QpCap::default(), &opts)?;
///     let value = RemoteSlice::from_bytes(&conn.private_data)?;
///     let mut dst = pd.register(Buffer::new(value.len as usize)?, AccessFlags::LOCAL_WRITE)?;
///     WcError::check(conn.qp.read(&mut dst, 0..value.len, value)?)?;
///     println!("{} bytes from {}: {:?}", value.len, conn.peer, dst.as_slice());
///     Ok(())
/// }
/// ```
pub fn connect(
    addr: impl ToSocketAddrs,
    pd: &ProtectionDomain,
    cap: QpCap,
    opts: &HandshakeOpts,
) -> Result<Connection, ConnectError> {
    check_private(opts)?;
    let start = Instant::now();
    let addrs = addr.to_socket_addrs().map_err(|source| ConnectError::Io {
        during: "resolving the server's address",
        source,
    })?;
    const DURING: &str = "connecting to the server";
    let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
    let mut stream = None;
    for a in addrs {
        let left = opts.timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(ConnectError::TimedOut {
                during: DURING,
                after: opts.timeout,
            });
        }
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e,
        }
    }
    let Some(stream) = stream else {
        if last.kind() == io::ErrorKind::TimedOut {
            return Err(ConnectError::TimedOut {
                during: DURING,
                after: opts.timeout,
            });
        }
        return Err(ConnectError::Io {
            during: DURING,
            source: last,
        });
    };
    let peer = stream.peer_addr().map_err(|source| ConnectError::Io {
        during: DURING,
        source,
    })?;
    let left = opts.timeout.saturating_sub(start.elapsed());
    let mut s = Side::new(stream, left)?;
    s.total = opts.timeout;
    let res = s.client(pd, cap, opts);
    s.finish(res, peer)
}

/// The server's side of the handshake on a client's side-channel `stream` (from
/// [`Listener::accept_stream`]), with an admission check: `admit` gets the client's endpoint
/// and private data **before** this side creates anything for it (no QP yet; the caller's
/// `pd` is all there is), and answers with this side's private data (at most
/// [`MAX_PRIVATE_DATA`] bytes; `opts.private_data` is not used) or a reason to refuse the
/// client, which the client receives in a `REJECT` ([`ConnectError::Refused`] here). A
/// server that sizes its memory by what a client asks for allocates it in `admit`, once the
/// request is known to be within its limits.
///
/// ```
/// use mrkit::tcp::{self, ConnectError, HandshakeOpts, Listener};
/// use mrkit::{Context, DeviceConfig, QpCap};
/// let listener = Listener::bind("127.0.0.1:0").unwrap();
/// let addr = listener.local_addr().unwrap();
/// let client = std::thread::spawn(move || {
///     let pd = Context::open(DeviceConfig::rxe()).alloc_pd().unwrap();
///     let opts = HandshakeOpts { private_data: b"size=1TiB".to_vec(), ..Default::default() };
///     tcp::connect(addr, &pd, QpCap::default(), &opts).unwrap_err()
/// });
/// let server = Context::open(DeviceConfig::rxe());
/// let pd = server.alloc_pd().unwrap();
/// let (stream, _) = listener.accept_stream(None).unwrap();
/// let err = tcp::accept_on(stream, &pd, QpCap::default(), &HandshakeOpts::default(), |_, asked| {
///     assert_eq!(server.soft().unwrap().resource_counts().qps, 0); // nothing made for it yet
///     if asked == b"size=1TiB" { Err("too large".to_string()) } else { Ok(Vec::new()) }
/// })
/// .unwrap_err();
/// assert!(matches!(err, ConnectError::Refused(_)));
/// assert_eq!(server.soft().unwrap().resource_counts().qps, 0);
/// let seen_by_client = client.join().unwrap();
/// assert!(matches!(seen_by_client, ConnectError::Rejected(r) if r.contains("too large")));
/// ```
pub fn accept_on(
    stream: TcpStream,
    pd: &ProtectionDomain,
    cap: QpCap,
    opts: &HandshakeOpts,
    admit: impl FnOnce(&Endpoint, &[u8]) -> std::result::Result<Vec<u8>, String>,
) -> Result<Connection, ConnectError> {
    let peer = stream.peer_addr().map_err(|source| ConnectError::Io {
        during: "accepting a client",
        source,
    })?;
    let mut s = Side::new(stream, opts.timeout)?;
    let res = s.serve(pd, cap, opts, admit);
    s.finish(res, peer)
}

fn check_private(opts: &HandshakeOpts) -> Result<(), ConnectError> {
    if opts.private_data.len() > MAX_PRIVATE_DATA {
        return Err(ConnectError::Local(Error::new(
            Errno::EINVAL,
            format!(
                "{} bytes of private data; a handshake carries at most {MAX_PRIVATE_DATA}",
                opts.private_data.len()
            ),
        )));
    }
    Ok(())
}

const MAGIC: [u8; 4] = *b"MRKC";
const VERSION: u8 = 1;
const HELLO: u8 = 1;
const READY: u8 = 2;
const REJECT: u8 = 3;

/// A message received.
enum Msg {
    Hello(Endpoint, Vec<u8>),
    Ready,
    Reject(String),
}

impl Msg {
    fn name(&self) -> &'static str {
        match self {
            Msg::Hello(..) => "HELLO",
            Msg::Ready => "READY",
            Msg::Reject(_) => "REJECT",
        }
    }
}

/// One side of a handshake: the stream and its deadline.
struct Side {
    stream: TcpStream,
    end: Instant,
    /// The deadline as configured (for messages).
    total: Duration,
    /// Whether a REJECT may still tell the peer why we give up.
    may_reject: bool,
}

/// The handshake's outcome before the side channel is handed over.
struct Done {
    qp: QueuePair,
    remote: Endpoint,
    private_data: Vec<u8>,
}

impl Side {
    fn new(stream: TcpStream, timeout: Duration) -> Result<Side, ConnectError> {
        let io = |source| ConnectError::Io {
            during: "setting up the side channel",
            source,
        };
        stream.set_nonblocking(false).map_err(io)?;
        stream.set_nodelay(true).map_err(io)?;
        Ok(Side {
            stream,
            end: Instant::now() + timeout,
            total: timeout,
            may_reject: true,
        })
    }

    fn left(&self, during: &'static str) -> Result<Duration, ConnectError> {
        let left = self.end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ConnectError::TimedOut {
                during,
                after: self.total,
            });
        }
        Ok(left)
    }

    fn read_full(&mut self, buf: &mut [u8], during: &'static str) -> Result<(), ConnectError> {
        let mut got = 0;
        while got < buf.len() {
            // Each read waits at most until the deadline: a peer trickling bytes cannot
            // stretch the handshake beyond it.
            let left = self.left(during)?;
            if let Err(source) = self.stream.set_read_timeout(Some(left)) {
                return Err(ConnectError::Io { during, source });
            }
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => {
                    self.may_reject = false;
                    return Err(ConnectError::Closed { during });
                }
                Ok(n) => got += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) if hung_up(&e) => {
                    self.may_reject = false;
                    return Err(ConnectError::Closed { during });
                }
                Err(source) => {
                    self.may_reject = false;
                    return Err(ConnectError::Io { during, source });
                }
            }
        }
        Ok(())
    }

    fn send(
        &mut self,
        kind: u8,
        parts: &[&[u8]],
        during: &'static str,
    ) -> Result<(), ConnectError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let body_len = if kind == HELLO {
            len - Endpoint::LEN
        } else {
            len
        };
        let mut msg = Vec::with_capacity(8 + len);
        msg.extend_from_slice(&MAGIC);
        msg.push(VERSION);
        msg.push(kind);
        // Bounded by MAX_PRIVATE_DATA (checked before the handshake, or by the caller).
        msg.extend_from_slice(&(body_len as u16).to_be_bytes());
        for p in parts {
            msg.extend_from_slice(p);
        }
        let left = self.left(during)?;
        let res = self
            .stream
            .set_write_timeout(Some(left))
            .and_then(|()| self.stream.write_all(&msg));
        match res {
            Ok(()) => Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Err(ConnectError::TimedOut {
                    during,
                    after: self.total,
                })
            }
            Err(e) if hung_up(&e) => {
                self.may_reject = false;
                Err(ConnectError::Closed { during })
            }
            Err(source) => {
                self.may_reject = false;
                Err(ConnectError::Io { during, source })
            }
        }
    }

    fn recv(&mut self, during: &'static str) -> Result<Msg, ConnectError> {
        let proto = |reason: String| ConnectError::Protocol { during, reason };
        let mut h = [0u8; 8];
        self.read_full(&mut h, during)?;
        if h[0..4] != MAGIC {
            return Err(proto(format!(
                "it sent {:02x?}, not an mrkit handshake message",
                &h[0..4]
            )));
        }
        if h[4] != VERSION {
            return Err(proto(format!(
                "handshake version {} is not supported (this side speaks {VERSION})",
                h[4]
            )));
        }
        let len = usize::from(u16::from_be_bytes([h[6], h[7]]));
        if len > MAX_PRIVATE_DATA {
            return Err(proto(format!(
                "it announces a {len}-byte body; at most {MAX_PRIVATE_DATA} are accepted"
            )));
        }
        match h[5] {
            HELLO => {
                let mut ep = [0u8; Endpoint::LEN];
                self.read_full(&mut ep, during)?;
                let ep = Endpoint::from_bytes(&ep)
                    .map_err(|e| proto(format!("its endpoint is invalid: {}", e.cause())))?;
                let mut private = vec![0u8; len];
                self.read_full(&mut private, during)?;
                Ok(Msg::Hello(ep, private))
            }
            READY if len == 0 => Ok(Msg::Ready),
            READY => Err(proto(format!("READY with a {len}-byte body"))),
            REJECT => {
                let mut r = vec![0u8; len];
                self.read_full(&mut r, during)?;
                self.may_reject = false;
                Ok(Msg::Reject(String::from_utf8_lossy(&r).into_owned()))
            }
            k => Err(proto(format!("unknown message kind {k}"))),
        }
    }

    /// Receive `want`; a REJECT becomes [`ConnectError::Rejected`].
    fn expect(&mut self, want: u8, during: &'static str) -> Result<Msg, ConnectError> {
        let m = self.recv(during)?;
        match (&m, want) {
            (Msg::Reject(r), _) => Err(ConnectError::Rejected(r.clone())),
            (Msg::Hello(..), HELLO) | (Msg::Ready, READY) => Ok(m),
            _ => Err(ConnectError::Protocol {
                during,
                reason: format!("it sent {} out of turn", m.name()),
            }),
        }
    }

    fn hello(
        &mut self,
        ep: &Endpoint,
        private: &[u8],
        during: &'static str,
    ) -> Result<(), ConnectError> {
        self.send(HELLO, &[&ep.to_bytes(), private], during)
    }

    fn serve(
        &mut self,
        pd: &ProtectionDomain,
        cap: QpCap,
        opts: &HandshakeOpts,
        admit: impl FnOnce(&Endpoint, &[u8]) -> std::result::Result<Vec<u8>, String>,
    ) -> Result<Done, ConnectError> {
        let Msg::Hello(remote, private_data) =
            self.expect(HELLO, "waiting for the client's HELLO")?
        else {
            unreachable!("expect returns the kind asked for")
        };
        // Nothing is made for a client before its HELLO is admitted.
        let ours = admit(&remote, &private_data).map_err(ConnectError::Refused)?;
        check_private(&HandshakeOpts {
            private_data: ours.clone(),
            ..HandshakeOpts::default()
        })?;
        let mut qp = QueuePair::new(pd, cap)?;
        let ep = qp.endpoint_for(&opts.connect)?;
        qp.connect_to(&remote, &opts.connect)?;
        self.hello(&ep, &ours, "sending the server's HELLO")?;
        self.expect(READY, "waiting for the client's READY")?;
        self.send(READY, &[], "sending the server's READY")?;
        Ok(Done {
            qp,
            remote,
            private_data,
        })
    }

    fn client(
        &mut self,
        pd: &ProtectionDomain,
        cap: QpCap,
        opts: &HandshakeOpts,
    ) -> Result<Done, ConnectError> {
        let mut qp = QueuePair::new(pd, cap)?;
        let ep = qp.endpoint_for(&opts.connect)?;
        self.hello(&ep, &opts.private_data, "sending the client's HELLO")?;
        let Msg::Hello(remote, private_data) =
            self.expect(HELLO, "waiting for the server's HELLO")?
        else {
            unreachable!("expect returns the kind asked for")
        };
        qp.connect_to(&remote, &opts.connect)?;
        self.send(READY, &[], "sending the client's READY")?;
        self.expect(READY, "waiting for the server's READY")?;
        Ok(Done {
            qp,
            remote,
            private_data,
        })
    }

    /// Hand over the side channel, or tell the peer why not (`REJECT`, best effort).
    fn finish(
        mut self,
        res: Result<Done, ConnectError>,
        peer: SocketAddr,
    ) -> Result<Connection, ConnectError> {
        match res {
            Ok(d) => {
                let io = |source| ConnectError::Io {
                    during: "handing over the side channel",
                    source,
                };
                self.stream.set_read_timeout(None).map_err(io)?;
                self.stream.set_write_timeout(None).map_err(io)?;
                Ok(Connection {
                    qp: d.qp,
                    private_data: d.private_data,
                    remote: d.remote,
                    peer,
                    stream: self.stream,
                })
            }
            Err(e) => {
                if self.may_reject && !matches!(e, ConnectError::Rejected(_)) {
                    // Give the REJECT a moment even when the deadline has passed: it is
                    // one small write into an empty socket buffer.
                    self.end = self.end.max(Instant::now() + Duration::from_millis(100));
                    let mut why = e.to_string();
                    truncate(&mut why, MAX_PRIVATE_DATA);
                    let _ = self.send(REJECT, &[why.as_bytes()], "sending REJECT");
                }
                Err(e)
            }
        }
    }
}

/// Whether `e` says the peer went away (closed with data unread, or reset).
fn hung_up(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

/// Cut `s` to at most `max` bytes on a character boundary.
fn truncate(s: &mut String, max: usize) {
    if s.len() > max {
        let mut at = max;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
}
