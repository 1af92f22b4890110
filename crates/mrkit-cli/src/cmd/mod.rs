//! Subcommands.
pub mod bench;
pub mod bench_pool_cache;
pub mod bench_transport;
pub mod capacity;
pub mod completions;
pub mod demo;
pub mod device;
pub mod devinfo;
pub mod doctor;
pub mod nldev;
pub mod perf;
pub mod reg;
pub mod stat;
pub mod sysinfo;

/// Human-readable bytes (`64 KiB`).
pub fn human(bytes: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", U[i])
    } else {
        format!("{v:.1} {}", U[i])
    }
}
