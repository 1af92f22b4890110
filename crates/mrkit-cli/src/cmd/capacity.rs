//! `mrkit capacity`: how much memory this process can register right now (the capacity formula: `docs/cli.md`, "mrkit capacity").

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
            if best.0.is_none_or(|b| v < b) {
                best = (Some(v), Some(t.name));
            }
        }
    }
    best
}

/// The translation limit of a device: how many translation (MTT) entries it has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Translation {
    /// `entries` in total, described by `formula` (`2^20`), read from `source`.
    Known {
        /// Translation entries in total.
        entries: u64,
        /// How the number was formed.
        formula: String,
        /// Where it was read.
        source: String,
    },
    /// The driver exposes no limit: why (no term is invented).
    Unknown(String),
}

/// The device-side inputs of the formula.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceLimits {
    /// The device name.
    pub device: String,
    /// `max_mr` and where it came from.
    pub max_mr: (u32, String),
    /// `max_mr_size` and where it came from.
    pub max_mr_size: (u64, String),
    /// The translation limit.
    pub translation: Translation,
    /// Entries this process uses now (known on mrkit0 only).
    pub mtt_used: Option<u64>,
}

impl DeviceLimits {
    /// The embedded device: every limit from its configuration.
    pub fn embedded(cfg: &DeviceConfig, mtt_used: u64) -> DeviceLimits {
        let a = cfg.attr();
        DeviceLimits {
            device: mrkit_soft::DEVICE_NAME.to_string(),
            max_mr: (a.max_mr, cfg.source("max_mr").to_string()),
            max_mr_size: (a.max_mr_size, cfg.source("max_mr_size").to_string()),
            translation: Translation::Known {
                entries: a.max_mtt,
                formula: format!("2^log_num_mtt = 2^{}", a.log_num_mtt),
                source: cfg.source("log_num_mtt").to_string(),
            },
            mtt_used: Some(mtt_used),
        }
    }
}

/// The translation limit of kernel RDMA device `dev` as sysfs under `root` exposes it:
/// mlx4 has the `log_num_mtt` and `log_mtts_per_seg` module parameters (entries =
/// 2^(log_num_mtt + log_mtts_per_seg)); other drivers (mlx5, irdma, efa, rxe, siw) expose none.
pub fn translation_from_sysfs(root: &std::path::Path, dev: &str) -> Translation {
    let driver = super::doctor::driver_of(root, dev);
    match driver.as_deref() {
        Some("mlx4_core") | Some("mlx4_ib") => {
            let dir = root.join("sys/module/mlx4_core/parameters");
            let read = |n: &str| -> Option<u64> {
                std::fs::read_to_string(dir.join(n))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            };
            match (read("log_num_mtt"), read("log_mtts_per_seg")) {
                (Some(0), _) => Translation::Unknown(
                    "mlx4_core log_num_mtt is 0: the driver sizes the MTT table from RAM at load time and does not expose the result".into(),
                ),
                (Some(n), Some(s)) if n.checked_add(s).is_some_and(|t| t < 64) => Translation::Known {
                    entries: 1u64 << (n + s),
                    formula: format!("2^log_num_mtt x 2^log_mtts_per_seg = 2^{n} x 2^{s}"),
                    source: "/sys/module/mlx4_core/parameters".into(),
                },
                _ => Translation::Unknown(
                    "mlx4_core parameters log_num_mtt / log_mtts_per_seg are unreadable".into(),
                ),
            }
        }
        Some(d) => Translation::Unknown(format!(
            "driver {d} exposes no translation limit (no module parameter or sysfs file): no term"
        )),
        None => Translation::Unknown(format!(
            "{dev}: driver unknown (/sys/class/infiniband/{dev}/device/driver unreadable): no term"
        )),
    }
}

/// Compute every term from the device configuration, the system and this process's usage.
#[cfg(test)]
pub fn compute(
    cfg: &DeviceConfig,
    sys: &SysInfo,
    ratio: (f64, String),
    mtt_used: u64,
    pinned: u64,
) -> Capacity {
    compute_for(&DeviceLimits::embedded(cfg, mtt_used), sys, ratio, pinned)
}

/// Compute every term for any device.
pub fn compute_for(d: &DeviceLimits, sys: &SysInfo, ratio: (f64, String), pinned: u64) -> Capacity {
    let ps = sys.page_size;
    let mut terms = Vec::new();
    let mms = (d.max_mr_size.0 != u64::MAX).then_some(d.max_mr_size.0);
    terms.push(Term {
        name: "max_mr_size",
        bytes: mms,
        bytes_thp: mms,
        source: d.max_mr_size.1.clone(),
        detail: "largest single registration (ibv_query_device max_mr_size)".into(),
    });
    let all = mms.map(|m| m.saturating_mul(u64::from(d.max_mr.0)));
    terms.push(Term {
        name: "max_mr",
        bytes: all,
        bytes_thp: all,
        source: d.max_mr.1.clone(),
        detail: format!(
            "at most max_mr = {} MRs of at most max_mr_size each",
            d.max_mr.0
        ),
    });
    match &d.translation {
        Translation::Known {
            entries,
            formula,
            source,
        } => {
            terms.push(Term {
                name: "translation_capacity",
                bytes: Some(entries.saturating_mul(ps)),
                bytes_thp: Some(entries.saturating_mul(HUGE_PAGE)),
                source: source.clone(),
                detail: format!(
                    "{formula} entries x page size {} (THP: x {})",
                    human(ps),
                    human(HUGE_PAGE)
                ),
            });
            if let Some(used) = d.mtt_used {
                let free = entries.saturating_sub(used);
                terms.push(Term {
                    name: "free_translation_entries",
                    bytes: Some(free.saturating_mul(ps)),
                    bytes_thp: Some(free.saturating_mul(HUGE_PAGE)),
                    source: "this process's mrkit0 instances".into(),
                    detail: format!("{free} of {entries} entries free ({used} used) x page size"),
                });
            }
        }
        Translation::Unknown(why) => terms.push(Term {
            name: "translation_capacity",
            bytes: None,
            bytes_thp: None,
            source: "not exposed".into(),
            detail: why.clone(),
        }),
    }
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

pub fn run(a: CapacityArgs, dev: &super::device::Selected) -> u8 {
    let ratio = match ratio_of(a.ratio) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("mrkit capacity: {e}");
            return exit::USAGE;
        }
    };
    let ctx = match dev.open("capacity") {
        Ok(c) => c,
        Err(code) => return code,
    };
    let sys = SysInfo::gather();
    let st = mrkit_soft::stats::process().snapshot();
    let limits = if ctx.soft().is_some() {
        match DeviceConfig::from_env() {
            Ok(cfg) => DeviceLimits::embedded(&cfg, st.mtt_used),
            Err(e) => {
                eprintln!("mrkit capacity: {e}");
                return exit::USAGE;
            }
        }
    } else {
        let a = ctx.query_device();
        DeviceLimits {
            device: ctx.name().to_string(),
            max_mr: (a.max_mr, "ibv_query_device".into()),
            max_mr_size: (a.max_mr_size, "ibv_query_device".into()),
            translation: translation_from_sysfs(std::path::Path::new("/"), ctx.name()),
            mtt_used: None,
        }
    };
    let c = compute_for(
        &limits,
        &sys,
        ratio,
        mrkit_soft::mem::account::pinned_pages() * sys.page_size,
    );
    tracing::info!(binding = ?c.binding, bytes = ?c.bytes, "capacity computed");
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&to_json(&c, &sys, &limits.device)).expect("json")
        );
        return exit::OK;
    }
    println!(
        "registrable memory on {} for this process (pid {}), page size {}",
        limits.device,
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
    if !sys.huge_detection && ctx.soft().is_some() {
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

    /// A fake sysfs tree: `/sys/class/infiniband/<dev>/device/driver` → the driver, plus
    /// module parameters.
    fn tree(dev: &str, driver: Option<&str>, params: &[(&str, &str)]) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        let devdir = t
            .path()
            .join("sys/class/infiniband")
            .join(dev)
            .join("device");
        std::fs::create_dir_all(&devdir).unwrap();
        if let Some(d) = driver {
            let drv = t.path().join("sys/bus/pci/drivers").join(d);
            std::fs::create_dir_all(&drv).unwrap();
            std::os::unix::fs::symlink(&drv, devdir.join("driver")).unwrap();
        }
        let pdir = t.path().join("sys/module/mlx4_core/parameters");
        for (k, v) in params {
            std::fs::create_dir_all(&pdir).unwrap();
            std::fs::write(pdir.join(k), v).unwrap();
        }
        t
    }

    #[test]
    fn translation_limit_table() {
        struct Case {
            what: &'static str,
            driver: Option<&'static str>,
            params: &'static [(&'static str, &'static str)],
            entries: Option<u64>,
        }
        let cases = [
            Case {
                what: "mlx4 with params",
                driver: Some("mlx4_core"),
                params: &[("log_num_mtt", "20\n"), ("log_mtts_per_seg", "3\n")],
                entries: Some(1 << 23),
            },
            Case {
                what: "mlx4 auto (0)",
                driver: Some("mlx4_core"),
                params: &[("log_num_mtt", "0\n"), ("log_mtts_per_seg", "3\n")],
                entries: None,
            },
            Case {
                what: "mlx4 params missing",
                driver: Some("mlx4_core"),
                params: &[],
                entries: None,
            },
            Case {
                what: "mlx4 hostile params (overflowing sum)",
                driver: Some("mlx4_core"),
                params: &[
                    ("log_num_mtt", "18446744073709551615\n"),
                    ("log_mtts_per_seg", "3\n"),
                ],
                entries: None,
            },
            Case {
                what: "mlx5: none exposed",
                driver: Some("mlx5_core"),
                params: &[("log_num_mtt", "24\n"), ("log_mtts_per_seg", "3\n")],
                entries: None,
            },
            Case {
                what: "no driver link",
                driver: None,
                params: &[],
                entries: None,
            },
        ];
        let s = sys();
        for c in cases {
            let t = tree("dev0", c.driver, c.params);
            let tr = translation_from_sysfs(t.path(), "dev0");
            let got = match &tr {
                Translation::Known { entries, .. } => Some(*entries),
                Translation::Unknown(_) => None,
            };
            assert_eq!(got, c.entries, "{}: {tr:?}", c.what);
            let d = DeviceLimits {
                device: "dev0".into(),
                max_mr: (1000, "ibv_query_device".into()),
                max_mr_size: (u64::MAX, "ibv_query_device".into()),
                translation: tr,
                mtt_used: None,
            };
            let cap = compute_for(&d, &s, (0.9, "default".into()), 0);
            let t = cap
                .terms
                .iter()
                .find(|t| t.name == "translation_capacity")
                .unwrap();
            match c.entries {
                // 2^23 entries x 4 KiB = 32 GiB: above RAM x 0.9, so RAM binds.
                Some(e) => assert_eq!(t.bytes, Some(e * 4096), "{}", c.what),
                None => {
                    assert_eq!(t.bytes, None, "{}: no invented term", c.what);
                    assert_eq!(t.source, "not exposed");
                }
            }
            assert!(cap
                .terms
                .iter()
                .all(|t| t.name != "free_translation_entries"));
            assert_eq!(cap.binding, Some("ram_ratio"), "{}", c.what);
        }
        let t = tree("mlx5_0", Some("mlx5_core"), &[]);
        match translation_from_sysfs(t.path(), "mlx5_0") {
            Translation::Unknown(why) => assert!(
                why.contains("mlx5_core exposes no translation limit"),
                "{why}"
            ),
            k => panic!("{k:?}"),
        }
    }
}
