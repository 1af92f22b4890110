//! The fuzz target body.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::*;

/// Parses `data` every way the wire module can and asserts the round-trip invariants.
///
/// Used as the body of the cargo-fuzz target in `fuzz/` and by a proptest in the unit tests.
/// It panics (on purpose) only when an invariant is broken, so any panic is a bug:
///
/// * no parser panics on any input;
/// * a packet that parses has exactly the opcode's headers, and header, payload, pad and ICRC
///   add up to the input length;
/// * re-building it gives a packet of the same length that parses to the same fields and whose
///   ICRC verifies; if the input was canonical (reserved bits and pad bytes zero), the bytes are
///   identical too;
/// * any single-bit flip outside the masked BTH byte 4 breaks the ICRC, and a flip inside it does not;
/// * AETH syndromes and PSN arithmetic round-trip.
///
/// ```
/// mrkit_soft::wire::fuzz_parse(&[0x11, 0, 0xff, 0xff, 0, 0, 0, 1, 0, 0, 0, 1, 0x1f, 0, 0, 1, 0, 0, 0, 0]);
/// mrkit_soft::wire::fuzz_parse(b"garbage");
/// ```
pub fn fuzz_parse(data: &[u8]) {
    // Standalone parsers: must not panic.
    let _ = Bth::parse(data);
    let _ = Reth::parse(data);
    let _ = Aeth::parse(data);
    let _ = AtomicEth::parse(data);
    let _ = AtomicAckEth::parse(data);
    let _ = ImmDt::parse(data);
    let _ = Ieth::parse(data);
    let _ = check_icrc_ipv4_packet(data);
    let _ = check_icrc_ipv6_packet(data);
    if let Some(&b) = data.first() {
        assert_eq!(Syndrome::from_byte(b).to_byte(), b, "syndrome round-trip");
        let _ = Opcode::from_u8(b);
        let _ = Mtu::from_enum(b);
        let _ = rnr_timer_to_duration(b);
        let _ = local_ack_timeout(b);
    }

    // Whole IP packets: refill the ICRC on a copy and check it.
    if let Ok((ip_inputs, payload)) = split_ip_packet(data) {
        let mut copy = data.to_vec();
        if payload.len() >= ICRC_LEN {
            fill_icrc_ip_packet(&mut copy).expect("fill after a successful split");
            check_icrc_ip_packet(&copy).expect("check after fill");
            let (again, _) = split_ip_packet(&copy).expect("split after fill");
            assert_eq!(again, ip_inputs);
        }
        fuzz_datagram(payload);
    }
    fuzz_datagram(data);
}

fn fuzz_datagram(data: &[u8]) {
    let Ok(p) = Packet::parse(data) else {
        return;
    };
    let n = data.len();
    let info = p.info();
    let pad = usize::from(p.bth.pad_count);
    assert_eq!(p.bth.tver, 0);
    assert!(p.ext.matches(p.opcode()), "ext headers match opcode");
    assert_eq!(
        info.header_len + p.payload.len() + pad + ICRC_LEN,
        n,
        "lengths add up"
    );
    assert_eq!(p.pad().len(), pad);
    assert_eq!(
        pad_for(p.payload.len()),
        p.bth.pad_count,
        "pad count canonical"
    );
    assert_eq!(wire_len(p.opcode(), p.payload.len()), n);
    assert!(info.has_payload() || p.payload.is_empty());
    assert_eq!(p.icrc().to_le_bytes(), data[n - ICRC_LEN..]);

    let v4 = IcrcInputs::ipv4(
        Ipv4Addr::new(10, 0, 0, 1),
        Ipv4Addr::new(10, 0, 0, 2),
        0xC000,
        ROCE_V2_UDP_PORT,
    );
    let v6 = IcrcInputs::ipv6(
        Ipv6Addr::LOCALHOST,
        Ipv6Addr::LOCALHOST,
        0xFFFF,
        ROCE_V2_UDP_PORT,
    );
    for inputs in [v4, v6] {
        let rebuilt = p
            .to_builder()
            .to_vec(p.payload, &inputs)
            .expect("re-build of a parsed packet");
        assert_eq!(rebuilt.len(), n);
        let q = Packet::parse_verified(&rebuilt, &inputs).expect("re-parse of a re-built packet");
        assert_eq!(q.bth, p.bth);
        assert_eq!(q.ext, p.ext);
        assert_eq!(q.payload, p.payload);

        let canonical = data[4] & 0x3F == 0
            && data[8] & 0x7F == 0
            && p.pad().iter().all(|&b| b == 0)
            && (p.opcode() != Opcode::Cnp
                || data[BTH_LEN..BTH_LEN + CNP_PAD_LEN].iter().all(|&b| b == 0));
        if canonical {
            assert_eq!(
                rebuilt[..n - ICRC_LEN],
                data[..n - ICRC_LEN],
                "canonical input re-builds identically"
            );
            assert_eq!(p.verify_icrc(&inputs).is_ok(), p.icrc() == q.icrc());
        }

        // Single-bit flips: byte 4 of the BTH is masked, everything else is covered.
        let seed = data.iter().fold(0usize, |h, &b| {
            h.wrapping_mul(31).wrapping_add(usize::from(b))
        });
        let mut pos = seed % n;
        if pos == 4 {
            pos = 0;
        }
        let mut flipped = rebuilt.clone();
        flipped[pos] ^= 1 << (seed % 8);
        assert!(
            inputs.verify(&flipped).is_err(),
            "bit flip at {pos} must break the ICRC"
        );
        let mut masked = rebuilt.clone();
        masked[4] ^= 1 << (seed % 8);
        assert!(inputs.verify(&masked).is_ok(), "BTH byte 4 is masked");
    }

    for mtu in Mtu::ALL {
        let _ = p.check_payload_len(mtu);
    }
    if let Some(a) = p.ext.aeth {
        assert_eq!(a.kind().to_byte(), a.syndrome);
    }
    let k = (p.payload.len() as u32) & 0x7F_FFFF;
    assert_eq!(psn_diff(psn_add(p.bth.psn, k), p.bth.psn), k as i32);
    assert_eq!(psn_sub(psn_add(p.bth.psn, k), k), p.bth.psn);
}
