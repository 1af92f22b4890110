//! Unit tests and property tests of the wire module.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use proptest::prelude::*;

use super::*;

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

// docs/roce.md §2.2 test vectors (whole IP packets).
const V1_CNP_CX4: &str = "45c2003c718c400040119161 0a001101 0a001201 000012b700280000 8100ffff4000011800000000 00000000000000000000000000000000 82fd002a";
const V2_WRITE_ONLY_V4: &str = "450000480000400040113ca37f0000017f000001c12412b70034fe470a10ffff00000011800abcde00007f0012345000000012340000000b68656c6c6f20526f43452100f64ef899";
const V3_ACK_V4: &str = "450000300000400040113cbb7f0000017f000001c12412b7001cfe2f1100ffff00000012000abcde1f00000113283cd5";
const V4_WRITE_ONLY_V6: &str = "600eb4c0003411400000000000000000000000000000000100000000000000000000000000000001c12712b7003400470a10ffff00000011800abcde00007f0012345000000012340000000b68656c6c6f20526f4345210017d5604c";
/// scapy's UC SEND ONLY example (test/contrib/roce.uts), rebuilt from its field values; scapy
/// reports the ICRC as 0x78f353f3 (big-endian reading of the wire bytes).
const V5_SCAPY_UC: &str = "45010040047840004011b4d5c0a80007c0a80007c00012b7002caca2 2460ffff000000d300cf1710 4630818be28935d90e9a95505401be885e500000 78f353f3";

const ALL_VECTORS: [&str; 5] = [
    V1_CNP_CX4,
    V2_WRITE_ONLY_V4,
    V3_ACK_V4,
    V4_WRITE_ONLY_V6,
    V5_SCAPY_UC,
];

fn lo4() -> IcrcInputs {
    IcrcInputs::ipv4(
        Ipv4Addr::LOCALHOST,
        Ipv4Addr::LOCALHOST,
        0xc124,
        ROCE_V2_UDP_PORT,
    )
}

// ---------------------------------------------------------------- opcode table

#[test]
fn opcode_table_consistent() {
    for op in Opcode::ALL {
        let row = OPCODE_TABLE[op.as_u8() as usize].expect("row for every variant");
        assert_eq!(row.opcode, op);
        assert_eq!(Opcode::from_u8(op.as_u8()), Ok(op));
        assert_eq!(op.info().header_len, BTH_LEN + ext_len(op.headers()));
        assert_eq!(u8::from(op), op.as_u8());
        assert_eq!(op.to_string(), row.name);
        let f = op.flags();
        if !f.contains(OpFlags::CNP) {
            assert!(
                f.contains(OpFlags::REQUEST) ^ f.contains(OpFlags::RESPONSE),
                "{op:?}"
            );
            let pos = [
                OpFlags::FIRST,
                OpFlags::MIDDLE,
                OpFlags::LAST,
                OpFlags::ONLY,
            ];
            assert_eq!(pos.iter().filter(|p| f.contains(**p)).count(), 1, "{op:?}");
        }
    }
    let n = (0..=255u8)
        .filter(|&b| OPCODE_TABLE[b as usize].is_some())
        .count();
    assert_eq!(n, Opcode::ALL.len());
}

#[test]
fn opcode_header_lengths_match_reference() {
    use Opcode::*;
    let want = [
        (SendFirst, 12),
        (SendMiddle, 12),
        (SendLast, 12),
        (SendLastWithImmediate, 16),
        (SendOnly, 12),
        (SendOnlyWithImmediate, 16),
        (RdmaWriteFirst, 28),
        (RdmaWriteMiddle, 12),
        (RdmaWriteLast, 12),
        (RdmaWriteLastWithImmediate, 16),
        (RdmaWriteOnly, 28),
        (RdmaWriteOnlyWithImmediate, 32),
        (RdmaReadRequest, 28),
        (RdmaReadResponseFirst, 16),
        (RdmaReadResponseMiddle, 12),
        (RdmaReadResponseLast, 16),
        (RdmaReadResponseOnly, 16),
        (Acknowledge, 16),
        (AtomicAcknowledge, 24),
        (CompareSwap, 40),
        (FetchAdd, 40),
        (SendLastWithInvalidate, 16),
        (SendOnlyWithInvalidate, 16),
        (Cnp, 28),
    ];
    assert_eq!(want.len(), Opcode::ALL.len());
    for (op, len) in want {
        assert_eq!(op.header_len(), len, "{op:?}");
    }
    let needs_wqe: Vec<Opcode> = Opcode::ALL
        .into_iter()
        .filter(|o| o.flags().contains(OpFlags::NEEDS_RECV_WQE))
        .collect();
    assert_eq!(
        needs_wqe,
        [
            SendFirst,
            SendOnly,
            SendOnlyWithImmediate,
            RdmaWriteLastWithImmediate,
            RdmaWriteOnlyWithImmediate,
            SendOnlyWithInvalidate
        ]
    );
}

#[test]
fn opcode_errors() {
    assert_eq!(Opcode::from_u8(0x15), Err(WireError::UnknownOpcode(0x15)));
    assert_eq!(
        Opcode::from_u8(0x1C),
        Err(WireError::UnsupportedOpcode(0x1C))
    );
    assert_eq!(
        Opcode::from_u8(0x1D),
        Err(WireError::UnsupportedOpcode(0x1D))
    );
    assert_eq!(Opcode::from_u8(0x18), Err(WireError::UnknownOpcode(0x18)));
    assert_eq!(
        Opcode::from_u8(0x24),
        Err(WireError::UnsupportedOpcode(0x24))
    ); // UC SEND ONLY
    assert_eq!(
        Opcode::from_u8(0x64),
        Err(WireError::UnsupportedOpcode(0x64))
    ); // UD SEND ONLY
    assert_eq!(Opcode::from_u8(0x80), Err(WireError::UnknownOpcode(0x80)));
    assert_eq!(Opcode::from_u8(0x81), Ok(Opcode::Cnp));
    assert_eq!(Opcode::try_from(0x11u8), Ok(Opcode::Acknowledge));
}

// ---------------------------------------------------------------- ICRC vectors

#[test]
fn icrc_vectors_check() {
    for (i, v) in ALL_VECTORS.iter().enumerate() {
        let pkt = hex(v);
        assert_eq!(check_icrc_ip_packet(&pkt), Ok(()), "vector {}", i + 1);
    }
    assert!(check_icrc_ipv4_packet(&hex(V2_WRITE_ONLY_V4)).is_ok());
    assert!(check_icrc_ipv6_packet(&hex(V4_WRITE_ONLY_V6)).is_ok());
    assert_eq!(
        check_icrc_ipv4_packet(&hex(V4_WRITE_ONLY_V6)),
        Err(WireError::BadIpHeader("not IPv4"))
    );
    assert_eq!(
        check_icrc_ipv6_packet(&hex(V2_WRITE_ONLY_V4)),
        Err(WireError::BadIpHeader("not IPv6"))
    );
}

#[test]
fn icrc_wire_bytes_and_values() {
    // CRC value 0x99F84EF6 is sent as f6 4e f8 99 (docs/roce.md §2.2).
    let pkt = hex(V2_WRITE_ONLY_V4);
    let (inputs, payload) = split_ip_packet(&pkt).unwrap();
    let p = Packet::parse(payload).unwrap();
    assert_eq!(p.icrc(), 0x99F8_4EF6);
    assert_eq!(inputs.compute(&payload[..payload.len() - 4]), 0x99F8_4EF6);
    // The seed: zlib.crc32(b'\xff'*8) == 0x2144DF1C == !0xDEBB20E3.
    assert_eq!(crc32fast::hash(&[0xFF; 8]), 0x2144_DF1C);
    assert_eq!(!0x2144_DF1Cu32, 0xDEBB_20E3);
}

#[test]
fn icrc_for_udp_payload_matches_vectors() {
    let lo4 = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let lo6 = IpAddr::V6(Ipv6Addr::LOCALHOST);
    for (v, ip, sport) in [
        (V2_WRITE_ONLY_V4, lo4, 0xc124),
        (V3_ACK_V4, lo4, 0xc124),
        (V4_WRITE_ONLY_V6, lo6, 0xc127),
    ] {
        let pkt = hex(v);
        let (_, payload) = split_ip_packet(&pkt).unwrap();
        let (body, icrc) = payload.split_at(payload.len() - 4);
        assert_eq!(
            icrc_for_udp_payload(ip, ip, sport, 4791, body).to_le_bytes(),
            icrc
        );
    }
    // A dual-stack socket reports IPv4 peers as ::ffff:a.b.c.d; that is still IPv4 on the wire.
    let mapped = IpAddr::V6(Ipv4Addr::LOCALHOST.to_ipv6_mapped());
    let pkt = hex(V3_ACK_V4);
    let (_, payload) = split_ip_packet(&pkt).unwrap();
    let (body, icrc) = payload.split_at(payload.len() - 4);
    assert_eq!(
        icrc_for_udp_payload(mapped, lo4, 0xc124, 4791, body).to_le_bytes(),
        icrc
    );
    let sa = std::net::SocketAddr::new(mapped, 0xc124);
    let da = std::net::SocketAddr::new(lo4, 4791);
    assert!(IcrcInputs::from_socket_addrs(sa, da)
        .verify(payload)
        .is_ok());
}

#[test]
fn vectors_rebuild_byte_identical() {
    // Vector 2 / 4: RDMA WRITE ONLY, QP 0x11, PSN 0x0abcde, AckReq, RETH, "hello RoCE!".
    let write = PacketBuilder::new(Opcode::RdmaWriteOnly, 0x11, 0x0abcde)
        .ack_req(true)
        .reth(Reth {
            va: 0x7f00_1234_5000,
            rkey: 0x1234,
            dma_len: 11,
        });
    let v4 = write.to_vec(b"hello RoCE!", &lo4()).unwrap();
    assert_eq!(v4, split_ip_packet(&hex(V2_WRITE_ONLY_V4)).unwrap().1);
    let in6 = IcrcInputs::ipv6(Ipv6Addr::LOCALHOST, Ipv6Addr::LOCALHOST, 0xc127, 4791);
    let v6 = write.to_vec(b"hello RoCE!", &in6).unwrap();
    assert_eq!(v6, split_ip_packet(&hex(V4_WRITE_ONLY_V6)).unwrap().1);
    // Vector 3: ACK syndrome 0x1F MSN 1, QP 0x12.
    let ack = PacketBuilder::new(Opcode::Acknowledge, 0x12, 0x0abcde)
        .aeth(Aeth::ack(1))
        .to_vec(&[], &lo4())
        .unwrap();
    assert_eq!(ack, split_ip_packet(&hex(V3_ACK_V4)).unwrap().1);
    // Vector 1: CNP with BECN, QP 0x000118, from 10.0.17.1 to 10.0.18.1, sport 0, IP ID 0x718c.
    let cnp_in = IcrcInputs::ipv4(
        Ipv4Addr::new(10, 0, 17, 1),
        Ipv4Addr::new(10, 0, 18, 1),
        0,
        4791,
    )
    .with_ipv4_id(0x718c, IPV4_FLAGS_DF);
    let cnp = PacketBuilder::new(Opcode::Cnp, 0x118, 0)
        .becn(true)
        .to_vec(&[], &cnp_in)
        .unwrap();
    assert_eq!(cnp, split_ip_packet(&hex(V1_CNP_CX4)).unwrap().1);
}

#[test]
fn vectors_parse() {
    let pkt = hex(V1_CNP_CX4);
    let (inputs, payload) = split_ip_packet(&pkt).unwrap();
    let p = Packet::parse_verified(payload, &inputs).unwrap();
    assert_eq!(p.opcode(), Opcode::Cnp);
    assert!(p.bth.becn && !p.bth.fecn);
    assert_eq!(p.bth.dest_qpn, 0x118);
    assert!(p.payload.is_empty());

    let pkt = hex(V3_ACK_V4);
    let (inputs, payload) = split_ip_packet(&pkt).unwrap();
    let p = Packet::parse_verified(payload, &inputs).unwrap();
    assert_eq!(p.opcode(), Opcode::Acknowledge);
    assert_eq!(
        p.ext.aeth,
        Some(Aeth {
            syndrome: 0x1f,
            msn: 1
        })
    );
    assert_eq!(p.bth.dest_qpn, 0x12);
    assert_eq!(p.psn(), 703_710);

    let pkt = hex(V4_WRITE_ONLY_V6);
    let (inputs, payload) = split_ip_packet(&pkt).unwrap();
    assert!(!inputs.is_ipv4());
    let p = Packet::parse_verified(payload, &inputs).unwrap();
    assert_eq!(p.payload, b"hello RoCE!");
    assert_eq!(p.pad(), &[0]);

    // UC is not ours, but its ICRC still checks (above).
    let pkt = hex(V5_SCAPY_UC);
    let (_, payload) = split_ip_packet(&pkt).unwrap();
    assert_eq!(
        Packet::parse(payload),
        Err(WireError::UnsupportedOpcode(0x24))
    );
}

#[test]
fn ipv4_id_solver_recovers_foreign_id() {
    let pkt = hex(V1_CNP_CX4);
    let (inputs, payload) = split_ip_packet(&pkt).unwrap();
    // A UDP socket does not see ID/flags: the naive check fails ...
    let naive = inputs.with_ipv4_id(0, IPV4_FLAGS_DF);
    assert!(matches!(
        naive.verify(payload),
        Err(WireError::BadIcrc { .. })
    ));
    // ... and the solver recovers them.
    let solver = Ipv4IdSolver::new(payload.len());
    assert_eq!(solver.datagram_len(), payload.len());
    assert_eq!(solver.solve(&naive, payload), Ok((0x718c, true)));
    // Our own packets: ID 0 with DF.
    let pkt = hex(V2_WRITE_ONLY_V4);
    let (inputs, payload) = split_ip_packet(&pkt).unwrap();
    assert_eq!(
        Ipv4IdSolver::new(payload.len()).solve(&inputs, payload),
        Ok((0, true))
    );
    // A corrupted payload is rejected (this flip is not absorbed by the ID bits).
    let mut bad = payload.to_vec();
    bad[20] ^= 0x01;
    assert!(matches!(
        Ipv4IdSolver::new(bad.len()).solve(&inputs, &bad),
        Err(WireError::BadIcrc { .. })
    ));
    // Wrong length or family.
    assert!(Ipv4IdSolver::new(8).solve(&inputs, payload).is_err());
    let v6 = IcrcInputs::ipv6(Ipv6Addr::LOCALHOST, Ipv6Addr::LOCALHOST, 1, 2);
    assert!(Ipv4IdSolver::new(payload.len())
        .solve(&v6, payload)
        .is_err());
}

#[test]
fn bit_flips_change_icrc_verdict() {
    for v in ALL_VECTORS {
        let pkt = hex(v);
        let v4 = pkt[0] >> 4 == 4;
        let ip_len = if v4 { 20 } else { 40 };
        // Masked bytes of the whole IP packet: IPv4 TOS, TTL, checksum; IPv6 TC/flow label
        // (low nibble of byte 0 .. byte 3) and hop limit; UDP checksum; BTH byte 4.
        let masked = |i: usize, bit: u8| -> bool {
            if v4 {
                if [1, 8, 10, 11].contains(&i) {
                    return true;
                }
            } else if (i == 0 && bit < 4) || (1..=3).contains(&i) || i == 7 {
                return true;
            }
            i == ip_len + 6 || i == ip_len + 7 || i == ip_len + 8 + 4
        };
        for i in 0..pkt.len() {
            for bit in 0..8u8 {
                let mut p = pkt.clone();
                p[i] ^= 1 << bit;
                let r = check_icrc_ip_packet(&p);
                if masked(i, bit) {
                    assert_eq!(r, Ok(()), "masked byte {i} bit {bit}");
                } else {
                    assert!(r.is_err(), "flip at byte {i} bit {bit} not detected");
                }
            }
        }
    }
}

// ---------------------------------------------------------------- parse errors

#[test]
fn truncated_prefixes_never_pass() {
    let mut datagrams: Vec<Vec<u8>> = ALL_VECTORS[..4]
        .iter()
        .map(|v| split_ip_packet(&hex(v)).unwrap().1.to_vec())
        .collect();
    for op in Opcode::ALL {
        datagrams.push(sample(op, 37).to_vec(&payload_for(op, 37), &lo4()).unwrap());
    }
    for d in &datagrams {
        let full = Packet::parse(d).unwrap();
        let min = full.info().header_len + ICRC_LEN;
        for n in 0..d.len() {
            let prefix = &d[..n];
            let r = Packet::parse(prefix);
            if n < min {
                assert!(
                    matches!(r, Err(WireError::Truncated { .. })) || (n < BTH_LEN && r.is_err()),
                    "len {n}: {r:?}"
                );
            }
            // Anything that still parses structurally must fail the ICRC.
            assert!(Packet::parse_verified(prefix, &lo4()).is_err());
            fuzz_parse(prefix);
        }
    }
}

#[test]
fn parse_errors() {
    let good = sample(Opcode::SendOnly, 5)
        .to_vec(b"hello", &lo4())
        .unwrap();
    assert!(Packet::parse(&good).is_ok());

    let mut d = good.clone();
    d[1] |= 0x01; // TVer 1
    assert_eq!(Packet::parse(&d), Err(WireError::BadVersion(1)));

    let mut d = good.clone();
    d.push(0);
    assert_eq!(
        Packet::parse(&d),
        Err(WireError::Misaligned(good.len() + 1))
    );

    // pad count larger than the data area
    let ack = sample(Opcode::SendOnly, 0).to_vec(&[], &lo4()).unwrap();
    let mut d = ack.clone();
    d[1] |= 0x30;
    assert_eq!(
        Packet::parse(&d),
        Err(WireError::BadPad {
            pad: 3,
            data_len: 0
        })
    );

    // payload on an ACK
    let mut d = sample(Opcode::Acknowledge, 0).to_vec(&[], &lo4()).unwrap();
    d.splice(16..16, [0u8; 4]);
    assert_eq!(
        Packet::parse(&d),
        Err(WireError::PayloadNotAllowed {
            opcode: Opcode::Acknowledge,
            len: 4
        })
    );
    // pad on an ACK
    let mut d = sample(Opcode::Acknowledge, 0).to_vec(&[], &lo4()).unwrap();
    d[1] |= 0x10;
    assert_eq!(
        Packet::parse(&d),
        Err(WireError::BadPad {
            pad: 1,
            data_len: 0
        })
    );

    let mut d = good.clone();
    d[0] = 0x15;
    assert_eq!(Packet::parse(&d), Err(WireError::UnknownOpcode(0x15)));

    assert_eq!(
        Packet::parse(&[]),
        Err(WireError::Truncated {
            needed: 12,
            available: 0
        })
    );

    // ICRC mismatch reports both values
    let mut d = good.clone();
    let n = d.len();
    d[n - 1] ^= 0x80;
    match Packet::parse_verified(&d, &lo4()) {
        Err(WireError::BadIcrc { expected, found }) => assert_eq!(expected ^ found, 0x8000_0000),
        r => panic!("{r:?}"),
    }
}

#[test]
fn builder_errors() {
    let mut buf = [0u8; 64];
    // missing RETH
    let b = PacketBuilder::new(Opcode::RdmaWriteOnly, 1, 1);
    assert_eq!(
        b.build(&[], &lo4(), &mut buf),
        Err(WireError::HeaderMismatch(Opcode::RdmaWriteOnly))
    );
    // extra AETH
    let b = PacketBuilder::new(Opcode::SendOnly, 1, 1).aeth(Aeth::ack(0));
    assert_eq!(
        b.build(&[], &lo4(), &mut buf),
        Err(WireError::HeaderMismatch(Opcode::SendOnly))
    );
    // payload where none is allowed
    let b = PacketBuilder::new(Opcode::Acknowledge, 1, 1).aeth(Aeth::ack(0));
    assert_eq!(
        b.build(&[1], &lo4(), &mut buf),
        Err(WireError::PayloadNotAllowed {
            opcode: Opcode::Acknowledge,
            len: 1
        })
    );
    // buffer too small
    let b = PacketBuilder::new(Opcode::SendOnly, 1, 1);
    assert_eq!(
        b.build(&[0; 60], &lo4(), &mut buf),
        Err(WireError::BufferTooSmall {
            needed: 76,
            available: 64
        })
    );
    // exact fit
    assert_eq!(b.build(&[0; 48], &lo4(), &mut buf), Ok(64));
}

#[test]
fn zero_copy_build_matches_build() {
    let b = sample(Opcode::RdmaWriteOnlyWithImmediate, 7);
    let payload = payload_for(Opcode::RdmaWriteOnlyWithImmediate, 7);
    let mut out = [0xAAu8; 128];
    let layout = emit_headers(&mut out, &b.bth, &b.ext, payload.len()).unwrap();
    assert_eq!(
        layout,
        Layout {
            header_len: 32,
            payload_len: 7,
            pad: 1,
            total_len: 44
        }
    );
    out[layout.payload_range()].copy_from_slice(&payload);
    let n = finish(&mut out, &layout, &lo4()).unwrap();
    assert_eq!(&out[..n], &b.to_vec(&payload, &lo4()).unwrap()[..]);
    assert_eq!(out[39], 0, "pad zeroed");
}

/// The UDP sender serialises into a reused buffer without clearing it: headers, payload, pad
/// and ICRC must overwrite every byte of the frame, for every opcode and pad length.
#[test]
fn zero_copy_build_into_a_dirty_buffer_matches_build_for_every_opcode() {
    for op in Opcode::ALL {
        for len in [0usize, 1, 2, 3, 5, 256] {
            let b = sample(op, len);
            let payload = payload_for(op, len);
            let want = b.to_vec(&payload, &lo4()).unwrap();
            let mut out = vec![0xFFu8; wire_len(op, payload.len())];
            let layout = emit_headers(&mut out, &b.bth, &b.ext, payload.len()).unwrap();
            out[layout.payload_range()].copy_from_slice(&payload);
            let n = finish(&mut out, &layout, &lo4()).unwrap();
            assert_eq!(n, out.len(), "{op:?} {len}");
            assert_eq!(out, want, "{op:?} {len}: a stale byte survived");
        }
    }
}

#[test]
fn payload_len_rules() {
    let m = Mtu::Mtu1024;
    use Opcode::*;
    assert!(check_payload_len(SendFirst, 1024, m).is_ok());
    assert!(check_payload_len(SendFirst, 1020, m).is_err());
    assert!(check_payload_len(RdmaReadResponseMiddle, 1024, m).is_ok());
    assert!(check_payload_len(SendLast, 0, m).is_err());
    assert!(check_payload_len(SendLast, 1, m).is_ok());
    assert!(check_payload_len(RdmaWriteLast, 1025, m).is_err());
    assert!(check_payload_len(SendOnly, 0, m).is_ok());
    assert!(check_payload_len(RdmaWriteOnlyWithImmediate, 1024, m).is_ok());
    assert!(check_payload_len(RdmaReadResponseOnly, 0, m).is_ok());
    assert!(check_payload_len(RdmaReadRequest, 0, m).is_ok());
    assert_eq!(
        check_payload_len(SendOnly, 1025, m),
        Err(WireError::PayloadLength {
            opcode: SendOnly,
            len: 1025,
            mtu: 1024
        })
    );
    let p = sample(SendMiddle, 256).to_vec(&[7; 256], &lo4()).unwrap();
    let v = Packet::parse(&p).unwrap();
    assert!(v.check_payload_len(Mtu::Mtu256).is_ok());
    assert!(v.check_payload_len(Mtu::Mtu512).is_err());
}

// ---------------------------------------------------------------- round trips

/// A builder with representative header values for `op` (payload length `len` used for RETH).
fn sample(op: Opcode, len: usize) -> PacketBuilder {
    let mut b = PacketBuilder::new(op, 0x00AB_CDEF, 0x00FF_FFFE).pkey(0x8001);
    let h = op.headers();
    if h.contains(HeaderSet::RETH) {
        b = b.reth(Reth {
            va: 0xDEAD_BEEF_0000_1000,
            rkey: 0x1234_5678,
            dma_len: len as u32,
        });
    }
    if h.contains(HeaderSet::AETH) {
        b = b.aeth(Aeth::nak(NakCode::RemoteAccessError, 0x00AB_CDEF));
    }
    if h.contains(HeaderSet::ATOMIC_ETH) {
        b = b.atomic_eth(AtomicEth {
            va: 0x1000,
            rkey: 7,
            swap_add: u64::MAX,
            compare: 0x0102_0304_0506_0708,
        });
    }
    if h.contains(HeaderSet::ATOMIC_ACK_ETH) {
        b = b.atomic_ack_eth(AtomicAckEth {
            orig: 0x8877_6655_4433_2211,
        });
    }
    if h.contains(HeaderSet::IMMDT) {
        b = b.immdt(ImmDt(0xCAFE_F00D));
    }
    if h.contains(HeaderSet::IETH) {
        b = b.ieth(Ieth { rkey: 0x0BAD_CAFE });
    }
    b.se(op.info().ends_message()).ack_req(true)
}

fn payload_for(op: Opcode, len: usize) -> Vec<u8> {
    if op.info().has_payload() {
        (0..len).map(|i| i as u8).collect()
    } else {
        Vec::new()
    }
}

#[test]
fn round_trip_every_opcode() {
    let in6 = IcrcInputs::ipv6(
        "fe80::1".parse().unwrap(),
        "fe80::2".parse().unwrap(),
        0xC001,
        4791,
    );
    for op in Opcode::ALL {
        for len in [0usize, 1, 2, 3, 4, 5, 255, 256, 1024, 4096] {
            let payload = payload_for(op, len);
            for inputs in [lo4(), in6] {
                let b = sample(op, len);
                let d = b.to_vec(&payload, &inputs).unwrap();
                assert_eq!(d.len(), wire_len(op, payload.len()));
                assert_eq!(d.len() % 4, 0);
                let p = Packet::parse_verified(&d, &inputs)
                    .unwrap_or_else(|e| panic!("{op:?} {len}: {e}"));
                assert_eq!(
                    p.bth,
                    Bth {
                        pad_count: pad_for(payload.len()),
                        ..b.bth
                    }
                );
                assert_eq!(p.ext, b.ext);
                assert_eq!(p.payload, &payload[..]);
                assert_eq!(p.opcode(), op);
                assert_eq!(p.datagram(), &d[..]);
                assert_eq!(p.to_builder().to_vec(p.payload, &inputs).unwrap(), d);
                assert_eq!(d[0], op.as_u8());
                fuzz_parse(&d);
            }
        }
    }
}

#[test]
fn aeth_syndromes() {
    assert_eq!(Aeth::ack(5).to_bytes(), [0x1F, 0, 0, 5]);
    assert_eq!(
        Aeth::ack_with_credit(3, 0x0100_0001).to_bytes(),
        [0x03, 0, 0, 1]
    );
    assert_eq!(
        Aeth::ack_with_credit(3, 0).kind(),
        Syndrome::Ack { credit: 3 }
    );
    assert_eq!(Aeth::rnr_nak(0x1F, 0).syndrome, 0x3F);
    assert_eq!(Aeth::rnr_nak(12, 0).kind(), Syndrome::RnrNak { timer: 12 });
    let codes = [
        (NakCode::PsnSequenceError, 0x60),
        (NakCode::InvalidRequest, 0x61),
        (NakCode::RemoteAccessError, 0x62),
        (NakCode::RemoteOperationalError, 0x63),
        (NakCode::InvalidRdRequest, 0x64),
    ];
    for (c, s) in codes {
        assert_eq!(Aeth::nak(c, 0).syndrome, s);
        assert_eq!(Syndrome::from_byte(s), Syndrome::Nak(c));
        assert!(!Aeth::nak(c, 0).is_ack());
    }
    assert_eq!(
        Syndrome::from_byte(0x65),
        Syndrome::Nak(NakCode::Reserved(5))
    );
    assert_eq!(Syndrome::from_byte(0x40), Syndrome::Reserved(0x40));
    assert_eq!(Syndrome::from_byte(0x80), Syndrome::Reserved(0x80));
    for b in 0..=255u8 {
        assert_eq!(Syndrome::from_byte(b).to_byte(), b);
    }
    assert!(Aeth::ack(0).is_ack());
    assert_eq!(ack_credit_count(0), Some(0));
    assert_eq!(ack_credit_count(ACK_NO_CREDIT_INFO), None);
}

#[test]
fn psn_arithmetic() {
    assert_eq!(psn_add(PSN_MASK, 1), 0);
    assert_eq!(psn_add(PSN_MASK, 2), 1);
    assert_eq!(psn_sub(0, 1), PSN_MASK);
    assert_eq!(psn_diff(0, PSN_MASK), 1);
    assert_eq!(psn_diff(PSN_MASK, 0), -1);
    assert_eq!(psn_diff(0x80_0000, 0), -0x80_0000);
    assert_eq!(psn_diff(0x7F_FFFF, 0), 0x7F_FFFF);
    assert_eq!(psn_cmp(5, 5), std::cmp::Ordering::Equal);
    assert_eq!(psn_cmp(5, 6), std::cmp::Ordering::Less);
    assert_eq!(psn_cmp(1, PSN_MASK - 100), std::cmp::Ordering::Greater);
}

#[test]
fn timers() {
    let table_ms = [
        655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32, 0.48, 0.64, 0.96, 1.28,
        1.92, 2.56, 3.84, 5.12, 7.68, 10.24, 15.36, 20.48, 30.72, 40.96, 61.44, 81.92, 122.88,
        163.84, 245.76, 327.68, 491.52,
    ];
    for (code, ms) in table_ms.iter().enumerate() {
        let d = rnr_timer_to_duration(code as u8);
        assert_eq!(
            d.as_micros(),
            (ms * 1000.0_f64).round() as u128,
            "code {code}"
        );
        if code > 0 {
            assert_eq!(duration_to_rnr_timer(d), code as u8);
        }
    }
    assert_eq!(rnr_timer_to_duration(0x20 | 14), rnr_timer_to_duration(14));
    assert_eq!(duration_to_rnr_timer(Duration::from_micros(11)), 2);
    assert_eq!(duration_to_rnr_timer(Duration::from_secs(1)), 0);
    assert_eq!(local_ack_timeout(0), None);
    assert_eq!(local_ack_timeout(18).unwrap().as_millis(), 1073);
    assert_eq!(local_ack_timeout(31), local_ack_timeout(200));
}

#[test]
fn udp_sport_and_mtu() {
    assert_eq!(udp_sport_for_qpn(0x11), 0xDF94);
    assert_eq!(udp_sport_for_qpn(16), 0xC722);
    assert_eq!(flow_label_from_qpns(17, 18), 0x132);
    assert_eq!(udp_sport_from_flow_label(0, 17, 18), 0xC132);
    assert_eq!(udp_sport_from_flow_label(0, 0x12_3456, 0xAB_CDEF), 0xC3C8);
    assert_eq!(
        udp_sport_from_flow_label(0xFFFFF, 1, 2),
        0xC000 | (0x3FFF ^ 0x3F)
    );
    for q in [0u32, 1, 0xFF_FFFF, 0x1234_5678] {
        assert!(udp_sport_for_qpn(q) >= 0xC000);
    }
    for (i, m) in Mtu::ALL.into_iter().enumerate() {
        assert_eq!(m.to_enum() as usize, i + 1);
        assert_eq!(Mtu::from_enum(m.to_enum()), Ok(m));
        assert_eq!(Mtu::from_bytes(m.bytes()), Ok(m));
    }
    assert_eq!(Mtu::Mtu256.bytes(), 256);
    assert_eq!(Mtu::Mtu4096.bytes(), 4096);
    assert_eq!(Mtu::from_enum(0), Err(WireError::InvalidMtu(0)));
    assert_eq!(Mtu::from_bytes(1500), Err(WireError::InvalidMtu(1500)));
    assert_eq!(Mtu::largest_for_netdev(9000), Some(Mtu::Mtu4096));
    assert_eq!(Mtu::largest_for_netdev(65536), Some(Mtu::Mtu4096));
    assert_eq!(Mtu::largest_for_netdev(300), None);
    assert_eq!(Mtu::Mtu1024.packets_for(0), 1);
    assert_eq!(Mtu::Mtu1024.packets_for(1024), 1);
    assert_eq!(Mtu::Mtu1024.packets_for(1025), 2);
    assert_eq!(
        MAX_DATAGRAM_LEN,
        wire_len(Opcode::RdmaWriteOnlyWithImmediate, 4096)
    );
}

#[test]
fn fill_icrc_ip_packet_restores_vectors() {
    for v in ALL_VECTORS {
        let good = hex(v);
        let mut p = good.clone();
        let n = p.len();
        p[n - 4..].fill(0);
        assert!(check_icrc_ip_packet(&p).is_err());
        fill_icrc_ip_packet(&mut p).unwrap();
        assert_eq!(p, good);
    }
}

#[test]
fn split_ip_packet_errors() {
    let mut p = hex(V3_ACK_V4);
    p[0] = 0x46;
    assert_eq!(
        split_ip_packet(&p),
        Err(WireError::BadIpHeader("IPv4 header with options"))
    );
    let mut p = hex(V3_ACK_V4);
    p[9] = 6;
    assert!(split_ip_packet(&p).is_err());
    let mut p = hex(V3_ACK_V4);
    p[25] ^= 1; // UDP length
    assert!(split_ip_packet(&p).is_err());
    let p = hex(V3_ACK_V4);
    assert!(matches!(
        split_ip_packet(&p[..30]),
        Err(WireError::Truncated { .. })
    ));
    // Ethernet padding after the IP packet is ignored.
    let mut p = hex(V3_ACK_V4);
    p.extend_from_slice(&[0; 6]);
    assert!(check_icrc_ip_packet(&p).is_ok());
}

// ---------------------------------------------------------------- property tests

fn arb_opcode() -> impl Strategy<Value = Opcode> {
    prop::sample::select(Opcode::ALL.to_vec())
}

prop_compose! {
    fn arb_bth()(opcode in arb_opcode(), se: bool, migreq: bool, pad_count in 0u8..4, pkey: u16, fecn: bool,
                 becn: bool, dest_qpn in 0u32..=QPN_MASK, ack_req: bool, psn in 0u32..=PSN_MASK) -> Bth {
        Bth { opcode, se, migreq, pad_count, tver: 0, pkey, fecn, becn, dest_qpn, ack_req, psn }
    }
}

prop_compose! {
    fn arb_ext()(reth: (u64, u32, u32), aeth in (any::<u8>(), 0u32..=MSN_MASK), atomic: (u64, u32, u64, u64),
                 orig: u64, imm: u32, inv: u32) -> ExtHeaders {
        ExtHeaders {
            reth: Some(Reth { va: reth.0, rkey: reth.1, dma_len: reth.2 }),
            aeth: Some(Aeth { syndrome: aeth.0, msn: aeth.1 }),
            atomic_eth: Some(AtomicEth { va: atomic.0, rkey: atomic.1, swap_add: atomic.2, compare: atomic.3 }),
            atomic_ack_eth: Some(AtomicAckEth { orig }),
            immdt: Some(ImmDt(imm)),
            ieth: Some(Ieth { rkey: inv }),
        }
    }
}

/// Keeps only the headers `op` carries.
fn restrict(ext: ExtHeaders, op: Opcode) -> ExtHeaders {
    let h = op.headers();
    ExtHeaders {
        reth: ext.reth.filter(|_| h.contains(HeaderSet::RETH)),
        aeth: ext.aeth.filter(|_| h.contains(HeaderSet::AETH)),
        atomic_eth: ext.atomic_eth.filter(|_| h.contains(HeaderSet::ATOMIC_ETH)),
        atomic_ack_eth: ext
            .atomic_ack_eth
            .filter(|_| h.contains(HeaderSet::ATOMIC_ACK_ETH)),
        immdt: ext.immdt.filter(|_| h.contains(HeaderSet::IMMDT)),
        ieth: ext.ieth.filter(|_| h.contains(HeaderSet::IETH)),
    }
}

fn arb_inputs() -> impl Strategy<Value = IcrcInputs> {
    prop_oneof![
        (
            any::<[u8; 4]>(),
            any::<[u8; 4]>(),
            any::<u16>(),
            any::<u16>(),
            any::<u16>(),
            any::<u16>()
        )
            .prop_map(|(s, d, sp, dp, id, ff)| IcrcInputs::ipv4(
                s.into(),
                d.into(),
                sp,
                dp
            )
            .with_ipv4_id(id, ff)),
        (
            any::<[u8; 16]>(),
            any::<[u8; 16]>(),
            any::<u16>(),
            any::<u16>()
        )
            .prop_map(|(s, d, sp, dp)| IcrcInputs::ipv6(s.into(), d.into(), sp, dp)),
    ]
}

proptest! {
    #[test]
    fn prop_bth_round_trip(bth in arb_bth()) {
        let bytes = bth.to_bytes();
        let (back, rest) = Bth::parse(&bytes).unwrap();
        prop_assert_eq!(back, bth);
        prop_assert!(rest.is_empty());
        let mut buf = [0u8; 13];
        prop_assert_eq!(bth.write(&mut buf), Ok(12));
        prop_assert_eq!(&buf[..12], &bytes[..]);
        prop_assert_eq!(bytes[4] & 0x3F, 0);
        prop_assert_eq!(bytes[8] & 0x7F, 0);
    }

    #[test]
    fn prop_ext_round_trip(ext in arb_ext()) {
        let r = ext.reth.unwrap();
        prop_assert_eq!(Reth::parse(&r.to_bytes()).unwrap().0, r);
        let a = ext.aeth.unwrap();
        prop_assert_eq!(Aeth::parse(&a.to_bytes()).unwrap().0, a);
        prop_assert_eq!(a.kind().to_byte(), a.syndrome);
        let x = ext.atomic_eth.unwrap();
        prop_assert_eq!(AtomicEth::parse(&x.to_bytes()).unwrap().0, x);
        let o = ext.atomic_ack_eth.unwrap();
        prop_assert_eq!(AtomicAckEth::parse(&o.to_bytes()).unwrap().0, o);
        let i = ext.immdt.unwrap();
        prop_assert_eq!(ImmDt::parse(&i.to_bytes()).unwrap().0, i);
        let v = ext.ieth.unwrap();
        prop_assert_eq!(Ieth::parse(&v.to_bytes()).unwrap().0, v);
        // Short buffers fail cleanly.
        prop_assert!(Reth::parse(&r.to_bytes()[..15]).is_err());
        prop_assert!(AtomicEth::parse(&x.to_bytes()[..27]).is_err());
        let mut small = [0u8; 3];
        prop_assert!(a.write(&mut small).is_err());
    }

    #[test]
    fn prop_packet_round_trip(bth in arb_bth(), ext in arb_ext(), payload in prop::collection::vec(any::<u8>(), 0..300),
                              inputs in arb_inputs()) {
        let op = bth.opcode;
        let ext = restrict(ext, op);
        let payload = if op.info().has_payload() { payload } else { Vec::new() };
        let b = PacketBuilder { bth, ext };
        let d = b.to_vec(&payload, &inputs).unwrap();
        let p = Packet::parse_verified(&d, &inputs).unwrap();
        prop_assert_eq!(p.bth, Bth { pad_count: pad_for(payload.len()), ..bth });
        prop_assert_eq!(p.ext, ext);
        prop_assert_eq!(p.payload, &payload[..]);
        if let IpInfo::V4 { identification, flags_fragment, .. } = inputs.ip {
            // A foreign IPv4 sender: any ID, DF or not; the receiver knows neither.
            let df = flags_fragment & IPV4_FLAGS_DF != 0;
            let sender = inputs.with_ipv4_id(identification, flags_fragment & IPV4_FLAGS_DF);
            let d2 = b.to_vec(&payload, &sender).unwrap();
            let unknown = inputs.with_ipv4_id(0, 0);
            prop_assert_eq!(Ipv4IdSolver::new(d2.len()).solve(&unknown, &d2), Ok((identification, df)));
        }
        fuzz_parse(&d);
    }

    /// The cached-prefix ICRC equals a one-pass CRC over the pseudo-packet written out from
    /// docs/roce.md §2 (independently of `IcrcInputs::compute`), for both families, any length,
    /// and three flows taking turns (the per-thread cache holds two).
    #[test]
    fn prop_icrc_matches_one_pass_reference(flows in prop::collection::vec(arb_inputs(), 3),
                                            bodies in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 1..8)) {
        for (i, body) in bodies.iter().enumerate() {
            let inputs = flows[i % 3];
            prop_assert_eq!(inputs.compute(body), reference_icrc(&inputs, body));
        }
    }

    #[test]
    fn prop_psn(a in 0u32..=PSN_MASK, k in 0u32..0x80_0000) {
        prop_assert_eq!(psn_diff(psn_add(a, k), a), k as i32);
        prop_assert_eq!(psn_diff(a, psn_add(a, k)), -(k as i32));
        prop_assert_eq!(psn_sub(psn_add(a, k), k), a);
        prop_assert!(psn_add(a, k) <= PSN_MASK);
        if k > 0 {
            prop_assert_eq!(psn_cmp(psn_add(a, k), a), std::cmp::Ordering::Greater);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn prop_fuzz_random_bytes(data in prop::collection::vec(any::<u8>(), 0..200)) {
        fuzz_parse(&data);
    }

    /// Random bytes rarely parse; mutate valid packets too so the round-trip asserts run.
    #[test]
    fn prop_fuzz_mutated_packets(op in arb_opcode(), len in 0usize..64, flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..4),
                                 cut in any::<u8>()) {
        let mut d = sample(op, len).to_vec(&payload_for(op, len), &lo4()).unwrap();
        for (pos, x) in flips {
            let n = d.len();
            d[pos % n] ^= x;
        }
        let keep = d.len().saturating_sub(usize::from(cut % 8));
        d.truncate(keep);
        fuzz_parse(&d);
    }

    #[test]
    fn prop_fuzz_ip_packets(v in prop::sample::select(ALL_VECTORS.to_vec()), pos: usize, x: u8) {
        let mut p = hex(v);
        let n = p.len();
        p[pos % n] ^= x;
        fuzz_parse(&p);
    }
}

/// The ICRC over the whole pseudo-packet in one pass, written out field by field (docs/roce.md §2).
fn reference_icrc(inputs: &IcrcInputs, body: &[u8]) -> u32 {
    let udp_len = (8 + body.len() + 4) as u16;
    let mut m = vec![0xFFu8; 8];
    match inputs.ip {
        IpInfo::V4 {
            src,
            dst,
            identification,
            flags_fragment,
        } => {
            m.extend_from_slice(&[0x45, 0xFF]);
            m.extend_from_slice(&(20 + udp_len).to_be_bytes());
            m.extend_from_slice(&identification.to_be_bytes());
            m.extend_from_slice(&flags_fragment.to_be_bytes());
            m.extend_from_slice(&[0xFF, 17, 0xFF, 0xFF]);
            m.extend_from_slice(&src.octets());
            m.extend_from_slice(&dst.octets());
        }
        IpInfo::V6 { src, dst } => {
            m.extend_from_slice(&[0x6F, 0xFF, 0xFF, 0xFF]);
            m.extend_from_slice(&udp_len.to_be_bytes());
            m.extend_from_slice(&[17, 0xFF]);
            m.extend_from_slice(&src.octets());
            m.extend_from_slice(&dst.octets());
        }
    }
    m.extend_from_slice(&inputs.src_port.to_be_bytes());
    m.extend_from_slice(&inputs.dst_port.to_be_bytes());
    m.extend_from_slice(&udp_len.to_be_bytes());
    m.extend_from_slice(&[0xFF, 0xFF]);
    let at = m.len();
    m.extend_from_slice(body);
    if body.len() > 4 {
        m[at + 4] = 0xFF;
    }
    crc32fast::hash(&m)
}
