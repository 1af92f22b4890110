//! Addresses of the RoCEv2 link: the UDP port, GIDs as IP addresses, and the `MRKIT_ADDR`
//! syntax. A leaf: the configuration parses addresses with it, the link and the verbs convert
//! GIDs with it.
#![forbid(unsafe_code)]

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// The RoCEv2 UDP port.
pub const ROCE_PORT: u16 = 4791;

/// A GID as 16 bytes: `::ffff:a.b.c.d` for IPv4.
pub fn gid_of(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The IP address a GID names (IPv4-mapped GIDs are IPv4).
pub fn ip_of_gid(gid: [u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(gid);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}

/// Parse `127.0.0.5`, `127.0.0.5:4791`, `::1`, `[::1]:4791`.
pub fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    if let Ok(sa) = s.parse::<SocketAddr>() {
        return Ok(sa);
    }
    s.parse::<IpAddr>()
        .map(|ip| SocketAddr::new(ip, ROCE_PORT))
        .map_err(|_| format!("`{s}` is not an IP address (or ip:port)"))
}
