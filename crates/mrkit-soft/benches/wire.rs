//! Per-packet wire costs of the latency path: the ICRC of an 8-byte SEND and of an ACK
//! (computed on send, checked on receive), beside the floor, a bare CRC-32 over the same
//! pseudo-packet bytes laid out in one buffer (what the ICRC cannot go below without a
//! faster CRC). And an empty `poll_cq` on a device bound to UDP (what a spinning application
//! does between messages: its cost is how late an arriving message is noticed), beside a raw
//! non-blocking `recvfrom` that finds nothing. (An idle device receives in bulk mode, one
//! `recvmmsg` per poll; request/response traffic switches it to plain `recvfrom`, ~0.15 µs
//! cheaper, see `net::udp::RecvBufs`.) Run: `cargo bench -p mrkit-soft --bench wire`.
use std::hint::black_box;
use std::net::Ipv4Addr;

use criterion::Criterion;
use mrkit_soft::wire::IcrcInputs;

/// SEND ONLY with 8 bytes (BTH + payload) and an ACK (BTH + AETH), without their ICRC.
const SEND8: [u8; 20] = [
    0x04, 0x40, 0xff, 0xff, 0, 0, 0, 0x12, 0x80, 0, 0, 7, 1, 2, 3, 4, 5, 6, 7, 8,
];
const ACK: [u8; 16] = [
    0x11, 0x40, 0xff, 0xff, 0, 0, 0, 0x12, 0, 0, 0, 7, 0x1f, 0, 0, 1,
];

fn icrc(c: &mut Criterion) {
    let a = Ipv4Addr::new(127, 79, 3, 1);
    let b = Ipv4Addr::new(127, 79, 3, 2);
    let out = IcrcInputs::ipv4(a, b, 0xc012, 4791);
    let back = IcrcInputs::ipv4(b, a, 0xc013, 4791);
    let mut g = c.benchmark_group("icrc");
    for (name, body) in [("send8", &SEND8[..]), ("ack", &ACK[..])] {
        // A connection's thread computes for its outgoing flow and checks its incoming one.
        g.bench_function(format!("{name}/both directions"), |bch| {
            bch.iter(|| {
                black_box(out.compute(black_box(body))) ^ black_box(back.compute(black_box(body)))
            })
        });
        // Floor: one CRC-32 over the 36-byte IPv4 pseudo-header and the body, twice.
        let mut pseudo = vec![0xFFu8; 36];
        pseudo.extend_from_slice(body);
        g.bench_function(
            format!("{name}/floor: crc32 of the pseudo-packet, twice"),
            |bch| {
                bch.iter(|| {
                    black_box(crc32fast::hash(black_box(&pseudo)))
                        ^ black_box(crc32fast::hash(black_box(&pseudo)))
                })
            },
        );
    }
    g.finish();
}

fn empty_poll(c: &mut Criterion) {
    let ctx = mrkit_soft::Context::open(
        mrkit_soft::DeviceConfig::rxe().udp_addr("127.79.9.1:0".parse().unwrap()),
    );
    let port = ctx.udp_port().expect("bind 127.79.9.1");
    let cq = ctx.create_cq(16, None).unwrap();
    let mut out = Vec::new();
    let mut g = c.benchmark_group("poll");
    g.bench_function("empty poll_cq (progress on poll, UDP bound)", |b| {
        b.iter(|| ctx.poll_cq(black_box(cq), &mut out, 16).unwrap())
    });
    let sock = std::net::UdpSocket::bind("127.79.9.2:0").unwrap();
    let mut buf = [0u8; 2048];
    g.bench_function("floor: recvfrom EAGAIN", |b| {
        b.iter(|| mrkit_soft::sockio::recv_one(&sock, &mut buf).unwrap())
    });
    g.finish();
    drop(port);
}

fn main() {
    let mut c = if std::env::args().any(|a| a == "--bench") {
        Criterion::default().configure_from_args()
    } else {
        // Run as a test (`cargo test --all-targets` passes test-harness flags, which
        // criterion rejects): one short pass of each benchmark, to show it still runs.
        Criterion::default()
            .sample_size(10)
            .warm_up_time(std::time::Duration::from_millis(10))
            .measurement_time(std::time::Duration::from_millis(50))
    };
    icrc(&mut c);
    empty_poll(&mut c);
    c.final_summary();
}
