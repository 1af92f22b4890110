//! Path MTU, timers and UDP source-port selection (docs/roce.md §3.5, §3.7, §4).

use core::time::Duration;

use super::error::WireError;
use super::QPN_MASK;

/// IB path MTU (payload bytes per packet; headers do not count).
///
/// ```
/// use mrkit_soft::wire::Mtu;
/// assert_eq!(Mtu::from_enum(3).unwrap().bytes(), 1024);
/// assert_eq!(Mtu::from_bytes(4096).unwrap(), Mtu::Mtu4096);
/// assert_eq!(Mtu::largest_for_netdev(1500), Some(Mtu::Mtu1024));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Mtu {
    /// 256 bytes (enum 1).
    Mtu256 = 1,
    /// 512 bytes (enum 2).
    Mtu512 = 2,
    /// 1024 bytes (enum 3).
    Mtu1024 = 3,
    /// 2048 bytes (enum 4).
    Mtu2048 = 4,
    /// 4096 bytes (enum 5).
    Mtu4096 = 5,
}

impl Mtu {
    /// All values, smallest first.
    pub const ALL: [Mtu; 5] = [
        Mtu::Mtu256,
        Mtu::Mtu512,
        Mtu::Mtu1024,
        Mtu::Mtu2048,
        Mtu::Mtu4096,
    ];

    /// Payload bytes per packet.
    pub const fn bytes(self) -> usize {
        128usize << (self as u8)
    }

    /// The IB enum value (1..=5, `ibv_mtu`).
    pub const fn to_enum(self) -> u8 {
        self as u8
    }

    /// From the IB enum value (1..=5).
    pub const fn from_enum(v: u8) -> Result<Mtu, WireError> {
        match v {
            1 => Ok(Mtu::Mtu256),
            2 => Ok(Mtu::Mtu512),
            3 => Ok(Mtu::Mtu1024),
            4 => Ok(Mtu::Mtu2048),
            5 => Ok(Mtu::Mtu4096),
            _ => Err(WireError::InvalidMtu(v as u32)),
        }
    }

    /// From a byte count that is exactly one of the five sizes.
    pub const fn from_bytes(b: usize) -> Result<Mtu, WireError> {
        match b {
            256 => Ok(Mtu::Mtu256),
            512 => Ok(Mtu::Mtu512),
            1024 => Ok(Mtu::Mtu1024),
            2048 => Ok(Mtu::Mtu2048),
            4096 => Ok(Mtu::Mtu4096),
            _ => Err(WireError::InvalidMtu(if b > u32::MAX as usize {
                u32::MAX
            } else {
                b as u32
            })),
        }
    }

    /// rxe's active MTU for a network device MTU: the largest IB MTU `<= netdev_mtu - 80`.
    pub const fn largest_for_netdev(netdev_mtu: usize) -> Option<Mtu> {
        let room = netdev_mtu.saturating_sub(RXE_MAX_HDR_LENGTH);
        let mut i = Mtu::ALL.len();
        while i > 0 {
            i -= 1;
            if Mtu::ALL[i].bytes() <= room {
                return Some(Mtu::ALL[i]);
            }
        }
        None
    }

    /// Number of packets a message of `len` bytes takes (`max(1, ceil(len / mtu))`), which is also
    /// the number of PSNs a READ of `len` bytes reserves.
    pub const fn packets_for(self, len: u64) -> u64 {
        let m = self.bytes() as u64;
        if len == 0 {
            1
        } else {
            len.div_ceil(m)
        }
    }
}

/// rxe's worst-case header overhead used to derive the MTU from the netdev MTU.
pub const RXE_MAX_HDR_LENGTH: usize = 80;

/// RNR timer table (docs/roce.md §3.7), in microseconds, indexed by the 5-bit code.
pub const RNR_TIMER_US: [u32; 32] = [
    655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560, 3_840,
    5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
    245_760, 327_680, 491_520,
];

/// The delay an RNR NAK timer code (or `min_rnr_timer`) stands for. Only the low 5 bits are used.
///
/// ```
/// use mrkit_soft::wire::rnr_timer_to_duration;
/// use std::time::Duration;
/// assert_eq!(rnr_timer_to_duration(0), Duration::from_micros(655_360));
/// assert_eq!(rnr_timer_to_duration(14), Duration::from_micros(1_280));
/// ```
pub const fn rnr_timer_to_duration(code: u8) -> Duration {
    Duration::from_micros(RNR_TIMER_US[(code & 0x1F) as usize] as u64)
}

/// The smallest RNR timer code whose delay is at least `d` (code 0, the longest, if none).
pub fn duration_to_rnr_timer(d: Duration) -> u8 {
    (1u8..32)
        .find(|&c| rnr_timer_to_duration(c) >= d)
        .unwrap_or(0)
}

/// The local ACK timeout `4.096 µs × 2^t` (`t` clamped to 31), or `None` for `t == 0`,
/// which rxe treats as "no retransmit timer" (IBA: infinite).
///
/// ```
/// use mrkit_soft::wire::local_ack_timeout;
/// use std::time::Duration;
/// assert_eq!(local_ack_timeout(0), None);
/// assert_eq!(local_ack_timeout(1), Some(Duration::from_nanos(8192)));
/// assert_eq!(local_ack_timeout(14).unwrap().as_millis(), 67);
/// ```
pub const fn local_ack_timeout(t: u8) -> Option<Duration> {
    if t == 0 {
        None
    } else {
        let t = if t > 31 { 31 } else { t };
        Some(Duration::from_nanos(4096u64 << t))
    }
}

/// UDP source port rxe assigns when a QP is created:
/// `0xC000 + (hash_32(qpn, 14) & 0x3FFF)` with `hash_32(v, 14) = (v * 0x61C88647) >> 18`.
///
/// ```
/// use mrkit_soft::wire::udp_sport_for_qpn;
/// let p = udp_sport_for_qpn(0x11);
/// assert!(p >= 0xC000);
/// ```
pub const fn udp_sport_for_qpn(qpn: u32) -> u16 {
    let h = (qpn & QPN_MASK).wrapping_mul(0x61C8_8647) >> 18;
    0xC000 | (h & 0x3FFF) as u16
}

/// The symmetric flow label rdma-core/kernel derive from two QPNs when the GRH has none:
/// `v = lqpn * rqpn; v ^= v >> 20; v ^= v >> 40; v & 0xFFFFF`.
pub const fn flow_label_from_qpns(lqpn: u32, rqpn: u32) -> u32 {
    let mut v = (lqpn as u64) * (rqpn as u64);
    v ^= v >> 20;
    v ^= v >> 40;
    (v & 0xF_FFFF) as u32
}

/// `rdma_get_udp_sport`: UDP source port from a flow label (or, when it is 0, from the QPNs).
/// Used by rxe when modify-QP sets an address vector with a GRH.
///
/// ```
/// use mrkit_soft::wire::udp_sport_from_flow_label;
/// // symmetric: both ends agree
/// assert_eq!(udp_sport_from_flow_label(0, 17, 18), udp_sport_from_flow_label(0, 18, 17));
/// ```
pub const fn udp_sport_from_flow_label(flow_label: u32, lqpn: u32, rqpn: u32) -> u16 {
    let fl = if flow_label == 0 {
        flow_label_from_qpns(lqpn, rqpn)
    } else {
        flow_label & 0xF_FFFF
    };
    (((fl & 0x3FFF) ^ ((fl & 0xF_C000) >> 14)) | 0xC000) as u16
}
