//! `mrkit capacity`: how much memory this process can register right now (seed 004 §3 and more).

use clap::Args;
use mrkit_soft::DeviceConfig;
use serde_json::{json, Value};

use super::human;
use super::sysinfo::SysInfo;
use crate::exit;

/// Default share of MemTotal that may be registered (the seed's `memory_registration_ratio`).
pub const DEFAULT_RATIO: f64 = 0.9;

/// 2 MiB: a transparent huge page on x86-64 and arm64 with 4 KiB base pages.
pub const HUGE_PAGE: u64 = 2 << 20;

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  mrkit capacity\n  mrkit capacity --json | jq .binding\n  mrkit capacity --ratio 0.5\n  MRKIT_PROFILE=connectx5-seed mrkit capacity   # 2^20 entries x 4 KiB = 4 GiB"
)]
pub struct CapacityArgs {
    /// Share of MemTotal that may be registered (default: $MRKIT_REG_RATIO, else 0.9).
    #[arg(long)]
    ratio: Option<f64>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// One term of the minimum.
#[derive(Debug, Clone, PartialEq)]
pub struct Term {
    /// Stable identifier.
    pub name: &'static str,
    /// Bytes with 4 KiB pages (None: unlimited).
    pub bytes: Option<u64>,
    /// Bytes if the memory is backed by THP (None: unlimited).
    pub bytes_thp: Option<u64>,
    /// Where the value came from.
    pub source: String,
    /// How it was computed.
    pub detail: String,
}

/// The computed capacity.
#[derive(Debug, Clone, PartialEq)]
pub struct Capacity {
    /// All terms.
    pub terms: Vec<Term>,
    /// min over terms (None: unlimited).
    pub bytes: Option<u64>,
    /// The term that binds.
    pub binding: Option<&'static str>,
    /// min over the THP column.
    pub bytes_thp: Option<u64>,
    /// The term that binds with THP.
    pub binding_thp: Option<&'static str>,
    /// The ratio used and where it came from.
    pub ratio: (f64, String),
}

fn min_term(terms: &[Term], thp: bool) -> (Option<u64>, Option<&'static str>) {
    let mut best: (Option<u64>, Option<&'static str>) = (None, None);
    for t in terms {
        let v = if thp { t.bytes_thp } else { t.bytes };
        if let Some(v) = v {
            if best.0.map_or(true, |b| v < b) {
                best = (Some(v), Some(t.name));
            }
        }
    }
    best
}

/// Compute every term from the device configuration, the system and this process's usage.
pub fn compute(
    cfg: &DeviceConfig,
    sys: &SysInfo,
    ratio: (f64, String),
    mtt_used: u64,
    pinned: u64,
) -> Capacity {
    let a = cfg.attr();
    let ps = sys.page_size;
    let mut terms = Vec::new();
    let mms = (a.max_mr_size != u64::MAX).then_some(a.max_mr_size);
    terms.push(Term {
        name: "max_mr_size",
        bytes: mms,
        bytes_thp: mms,
        source: cfg.source("max_mr_size").to_string(),
        detail: "largest single registration (ibv_query_device max_mr_size)".into(),
    });
    let mtt = a.max_mtt.saturating_mul(ps);
    terms.push(Term {
        name: "translation_capacity",
        bytes: Some(mtt),
        bytes_thp: Some(a.max_mtt.saturating_mul(HUGE_PAGE)),
        source: cfg.source("log_num_mtt").to_string(),
        detail: format!(
            "2^log_num_mtt x page size = 2^{} x {} (THP: x {})",
            a.log_num_mtt,
            human(ps),
            human(HUGE_PAGE)
        ),
    });
    let free = a.max_mtt.saturating_sub(mtt_used);
    terms.push(Term {
        name: "free_translation_entries",
        bytes: Some(free.saturating_mul(ps)),
        bytes_thp: Some(free.saturating_mul(HUGE_PAGE)),
        source: "this process's mrkit0 instances".into(),
        detail: format!(
            "{free} of {} entries free ({mtt_used} used) x page size",
            a.max_mtt
        ),
    });
    let ram = sys.mem_total().map(|t| (t as f64 * ratio.0) as u64);
    terms.push(Term {
        name: "ram_ratio",
        bytes: ram,
        bytes_thp: ram,
        source: format!("/proc/meminfo MemTotal x ratio ({})", ratio.1),
        detail: match sys.mem_total() {
            Some(t) => format!("{} x {}", human(t), ratio.0),
            None => "MemTotal unreadable: term ignored".into(),
        },
    });
    let (ml, src, detail) = if sys.cap_ipc_lock {
        (
            None,
            "CAP_IPC_LOCK".to_string(),
            "the process holds CAP_IPC_LOCK: RLIMIT_MEMLOCK does not apply".to_string(),
        )
    } else {
        match sys.memlock_soft {
            None => (None, "getrlimit(RLIMIT_MEMLOCK)".into(), "unlimited".into()),
            Some(l) => (
                Some(l.saturating_sub(pinned)),
                "getrlimit(RLIMIT_MEMLOCK)".into(),
                format!(
                    "soft limit {} minus {} already pinned by this process",
                    human(l),
                    human(pinned)
                ),
            ),
        }
    };
    terms.push(Term {
        name: "memlock",
        bytes: ml,
        bytes_thp: ml,
        source: src,
        detail,
    });
    let (cg, src, detail) = match &sys.cgroup {
        None => (
            None,
            "/proc/self/cgroup".to_string(),
            "no memory cgroup found".to_string(),
        ),
        Some(c) => match c.limit {
            None => (
                None,
                c.limit_file.clone(),
                format!("cgroup v{} {}: no limit", c.version, c.path),
            ),
            Some(l) => {
                let used = c.usage.unwrap_or(0);
                (
                    Some(l.saturating_sub(used)),
                    c.limit_file.clone(),
                    format!(
                        "cgroup v{} limit {} minus usage {}",
                        c.version,
                        human(l),
                        human(used)
                    ),
                )
            }
        },
    };
    terms.push(Term {
        name: "cgroup",
        bytes: cg,
        bytes_thp: cg,
        source: src,
        detail,
    });
    let (bytes, binding) = min_term(&terms, false);
    let (bytes_thp, binding_thp) = min_term(&terms, true);
    Capacity {
        terms,
        bytes,
        binding,
        bytes_thp,
        binding_thp,
        ratio,
    }
}

/// The ratio and its source: flag, environment or default.
pub fn ratio_of(flag: Option<f64>) -> Result<(f64, String), String> {
    let (r, src) = match flag {
        Some(r) => (r, "--ratio".to_string()),
        None => match std::env::var("MRKIT_REG_RATIO") {
            Ok(v) => (
                v.parse::<f64>()
                    .map_err(|_| format!("MRKIT_REG_RATIO={v}: not a number"))?,
                "env MRKIT_REG_RATIO".to_string(),
            ),
            Err(_) => (DEFAULT_RATIO, "default 0.9".to_string()),
        },
    };
    if !(r > 0.0 && r <= 1.0) {
        return Err(format!("ratio {r} must be in (0, 1]"));
    }
    Ok((r, src))
}

fn opt(v: Option<u64>) -> String {
    v.map(human).unwrap_or_else(|| "unlimited".into())
}

/// JSON of a capacity (schema in docs/cli.md).
pub fn to_json(c: &Capacity, sys: &SysInfo, device: &str) -> Value {
    json!({
        "device": device,
        "page_size": sys.page_size,
        "huge_page_size": HUGE_PAGE,
        "ratio": c.ratio.0,
        "ratio_source": c.ratio.1,
        "terms": c.terms.iter().map(|t| json!({
            "name": t.name,
            "bytes": t.bytes,
            "bytes_thp": t.bytes_thp,
            "source": t.source,
            "detail": t.detail,
        })).collect::<Vec<_>>(),
        "capacity_bytes": c.bytes,
        "binding": c.binding,
        "thp": {
            "capacity_bytes": c.bytes_thp,
            "binding": c.binding_thp,
            "thp_enabled": sys.thp_enabled,
            "huge_detection": sys.huge_detection,
        },
    })
}

pub fn run(a: CapacityArgs) -> u8 {
    let ratio = match ratio_of(a.ratio) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("mrkit capacity: {e}");
            return exit::USAGE;
        }
    };
    let cfg = match DeviceConfig::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mrkit capacity: {e}");
            return exit::USAGE;
        }
    };
    let sys = SysInfo::gather();
    let st = mrkit_soft::stats::process().snapshot();
    let c = compute(
        &cfg,
        &sys,
        ratio,
        st.mtt_used,
        mrkit_soft::mem::account::pinned_pages() * sys.page_size,
    );
    tracing::info!(binding = ?c.binding, bytes = ?c.bytes, "capacity computed");
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&c, &sys, mrkit_soft::DEVICE_NAME))
                .expect("json")
        );
        return exit::OK;
    }
    println!(
        "registrable memory on {} for this process (pid {}), page size {}",
        mrkit_soft::DEVICE_NAME,
        std::process::id(),
        human(sys.page_size)
    );
    println!();
    println!(
        "  {:<26} {:>12} {:>12}  source",
        "term", "4 KiB pages", "THP 2 MiB"
    );
    for t in &c.terms {
        let mark = if Some(t.name) == c.binding { "*" } else { " " };
        println!(
            "{mark} {:<26} {:>12} {:>12}  {}",
            t.name,
            opt(t.bytes),
            opt(t.bytes_thp),
            t.source
        );
        println!("  {:<26} {}", "", t.detail);
    }
    println!();
    println!(
        "capacity now: {} (bound by {})",
        opt(c.bytes),
        c.binding.unwrap_or("nothing")
    );
    println!(
        "with THP:     {} (bound by {}); 2 MiB pages need {}x fewer translation entries",
        opt(c.bytes_thp),
        c.binding_thp.unwrap_or("nothing"),
        HUGE_PAGE / sys.page_size
    );
    match sys.thp_enabled.as_deref() {
        Some("never") => println!("  note: THP is disabled (transparent_hugepage/enabled = never): the THP column is not reachable"),
        None => println!("  note: /sys/kernel/mm/transparent_hugepage/enabled is unreadable"),
        _ => {}
    }
    if !sys.huge_detection {
        println!("  note: PAGEMAP_SCAN is unavailable: mrkit0 sees every page as 4 KiB, so THP saves no entries here");
    }
    exit::OK
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::sysinfo::Cgroup;

    fn sys() -> SysInfo {
        let mut s = SysInfo::from_root(std::path::Path::new("/nonexistent"));
        s.page_size = 4096;
        s.meminfo.insert("MemTotal".into(), 16 << 30);
        s
    }

    #[test]
    fn memlock_binds_unless_cap() {
        let mut s = sys();
        s.memlock_soft = Some(8 << 20);
        let c = compute(&DeviceConfig::rxe(), &s, (0.9, "default".into()), 0, 0);
        assert_eq!(c.binding, Some("memlock"));
        assert_eq!(c.bytes, Some(8 << 20));
        s.cap_ipc_lock = true;
        let c = compute(&DeviceConfig::rxe(), &s, (0.9, "default".into()), 0, 0);
        assert_eq!(c.binding, Some("ram_ratio"));
    }

    #[test]
    fn mtt_binds_and_thp_lifts_it() {
        let s = sys();
        let cfg = DeviceConfig::rxe().log_num_mtt(10);
        let c = compute(&cfg, &s, (0.9, "default".into()), 0, 0);
        assert_eq!(c.bytes, Some(4 << 20));
        assert_eq!(c.binding, Some("translation_capacity"));
        assert_eq!(c.bytes_thp, Some(2 << 30));
        let c = compute(&cfg, &s, (0.9, "default".into()), 512, 0);
        assert_eq!(c.binding, Some("free_translation_entries"));
        assert_eq!(c.bytes, Some(2 << 20));
    }

    #[test]
    fn cgroup_and_max_mr_size() {
        let mut s = sys();
        s.cgroup = Some(Cgroup {
            version: 2,
            path: "/x".into(),
            limit_file: "/sys/fs/cgroup/x/memory.max".into(),
            limit: Some(1 << 30),
            usage: Some(256 << 20),
        });
        let c = compute(&DeviceConfig::rxe(), &s, (0.9, "default".into()), 0, 0);
        assert_eq!(c.binding, Some("cgroup"));
        assert_eq!(c.bytes, Some(768 << 20));
        let c = compute(
            &DeviceConfig::connectx5_seed(),
            &s,
            (0.9, "default".into()),
            0,
            0,
        );
        assert_eq!(c.binding, Some("max_mr_size"));
        assert_eq!(c.terms[0].source, "profile connectx5-seed");
    }
}
