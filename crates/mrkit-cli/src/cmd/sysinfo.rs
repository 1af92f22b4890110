//! The inputs of `capacity` and `doctor`: /proc, /sys, rlimits and capabilities, gathered into
//! one plain struct so tests can feed fake contents ([`SysInfo::from_root`] reads a fake tree).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// RLIMIT / cgroup v1 values at or above this are "unlimited" (v1 reports PAGE_COUNTER_MAX).
const HUGE_LIMIT: u64 = 1 << 62;

/// The memory cgroup of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroup {
    /// 1 or 2.
    pub version: u8,
    /// The process's cgroup path (from /proc/self/cgroup).
    pub path: String,
    /// The file the binding limit was read from.
    pub limit_file: String,
    /// The smallest memory limit of the cgroup and its ancestors (None: unlimited).
    pub limit: Option<u64>,
    /// Current usage (memory.current / memory.usage_in_bytes), if readable.
    pub usage: Option<u64>,
}

/// Everything the checks look at.
#[derive(Debug, Clone)]
pub struct SysInfo {
    /// Base page size.
    pub page_size: u64,
    /// /proc/meminfo: kB fields converted to bytes, counts (HugePages_*) as they are.
    pub meminfo: BTreeMap<String, u64>,
    /// /proc/self/status VmLck / VmPin in bytes.
    pub status: BTreeMap<String, u64>,
    /// Soft RLIMIT_MEMLOCK (None: unlimited).
    pub memlock_soft: Option<u64>,
    /// Hard RLIMIT_MEMLOCK (None: unlimited).
    pub memlock_hard: Option<u64>,
    /// CAP_IPC_LOCK in the effective set.
    pub cap_ipc_lock: bool,
    /// The memory cgroup, if any controller was found.
    pub cgroup: Option<Cgroup>,
    /// The selected word of /sys/kernel/mm/transparent_hugepage/enabled.
    pub thp_enabled: Option<String>,
    /// vm.max_map_count.
    pub max_map_count: Option<u64>,
    /// Mappings of this process now (lines of /proc/self/maps).
    pub map_count: Option<u64>,
    /// io_uring pinning: Ok or the reason it is unusable.
    pub io_uring: Result<(), String>,
    /// PAGEMAP_SCAN works (THP pages are seen as 2 MiB).
    pub huge_detection: bool,
}

/// `/proc/meminfo` → map (kB values in bytes).
pub fn parse_meminfo(text: &str) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for line in text.lines() {
        let Some((k, rest)) = line.split_once(':') else {
            continue;
        };
        let mut it = rest.split_whitespace();
        let Some(n) = it.next().and_then(|n| n.parse::<u64>().ok()) else {
            continue;
        };
        let v = if it.next() == Some("kB") { n * 1024 } else { n };
        m.insert(k.trim().to_string(), v);
    }
    m
}

/// The bracketed word of a sysfs choice file (`always [madvise] never` → `madvise`).
pub fn parse_choice(text: &str) -> Option<String> {
    let s = text.find('[')?;
    let e = text[s..].find(']')? + s;
    Some(text[s + 1..e].to_string())
}

fn parse_limit(text: &str) -> Option<Option<u64>> {
    let t = text.trim();
    if t == "max" {
        return Some(None);
    }
    let v: u64 = t.parse().ok()?;
    Some(if v >= HUGE_LIMIT { None } else { Some(v) })
}

/// Find the memory cgroup from `/proc/self/cgroup` contents; `read` reads a file by absolute
/// path (relative to the root being inspected).
pub fn find_cgroup(proc_cgroup: &str, read: &dyn Fn(&str) -> Option<String>) -> Option<Cgroup> {
    let mut v1 = None;
    let mut v2 = None;
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        if ctrl.is_empty() {
            v2 = Some(path.to_string());
        } else if ctrl.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_string());
        }
    }
    let (version, path, mounts, limit_name, usage_name): (u8, String, &[&str], &str, &str) =
        if let Some(p) = v1 {
            (
                1,
                p,
                &["/sys/fs/cgroup/memory"],
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            (
                2,
                v2?,
                &["/sys/fs/cgroup", "/sys/fs/cgroup/unified"],
                "memory.max",
                "memory.current",
            )
        };
    // Walk the cgroup and its ancestors; inside a cgroup namespace the path may not exist under
    // the mount (the mount root *is* our cgroup), so the mount root is tried last.
    for mount in mounts {
        let mut best: Option<(Option<u64>, String)> = None;
        let mut usage = None;
        let mut p = path.trim_end_matches('/').to_string();
        loop {
            let dir = format!("{mount}{p}");
            let file = format!("{dir}/{limit_name}");
            if let Some(l) = read(&file).and_then(|t| parse_limit(&t)) {
                if usage.is_none() {
                    usage =
                        read(&format!("{dir}/{usage_name}")).and_then(|t| t.trim().parse().ok());
                }
                let better = match (&best, l) {
                    (None, _) => true,
                    (Some((None, _)), Some(_)) => true,
                    (Some((Some(b), _)), Some(x)) => x < *b,
                    _ => false,
                };
                if better {
                    best = Some((l, file));
                }
            }
            if p.is_empty() {
                break;
            }
            p = match p.rfind('/') {
                Some(i) => p[..i].to_string(),
                None => String::new(),
            };
        }
        if let Some((limit, limit_file)) = best {
            return Some(Cgroup {
                version,
                path,
                limit_file,
                limit,
                usage,
            });
        }
    }
    None
}

impl SysInfo {
    /// Read the live system.
    pub fn gather() -> SysInfo {
        let mut s = SysInfo::from_root(Path::new("/"));
        let lim = rustix::process::getrlimit(rustix::process::Resource::Memlock);
        s.memlock_soft = lim.current.filter(|v| *v < HUGE_LIMIT);
        s.memlock_hard = lim.maximum.filter(|v| *v < HUGE_LIMIT);
        s.cap_ipc_lock = mrkit_soft::mem::account::has_cap_ipc_lock();
        s.io_uring = match mrkit_soft::mem::pin::io_uring_unavailable_reason() {
            None => Ok(()),
            Some(r) => Err(r),
        };
        s.huge_detection = mrkit_soft::mem::translate::huge_detection_available();
        s
    }

    /// Read the files under `root` (a real `/` or a fake tree with `proc/meminfo`,
    /// `proc/self/status`, `proc/self/cgroup`, `proc/self/maps`, `proc/sys/vm/max_map_count`,
    /// `sys/kernel/mm/transparent_hugepage/enabled`, `sys/fs/cgroup/...`). Non-file inputs
    /// (rlimits, capabilities, io_uring) get neutral defaults: unlimited, no capability, usable.
    pub fn from_root(root: &Path) -> SysInfo {
        let at = |p: &str| -> PathBuf { root.join(p.trim_start_matches('/')) };
        let read = |p: &str| std::fs::read_to_string(at(p)).ok();
        let status = read("/proc/self/status")
            .map(|t| {
                parse_meminfo(&t)
                    .into_iter()
                    .filter(|(k, _)| k == "VmLck" || k == "VmPin")
                    .collect()
            })
            .unwrap_or_default();
        SysInfo {
            page_size: mrkit_soft::mem::page_size() as u64,
            meminfo: read("/proc/meminfo")
                .map(|t| parse_meminfo(&t))
                .unwrap_or_default(),
            status,
            memlock_soft: None,
            memlock_hard: None,
            cap_ipc_lock: false,
            cgroup: read("/proc/self/cgroup").and_then(|t| find_cgroup(&t, &read)),
            thp_enabled: read("/sys/kernel/mm/transparent_hugepage/enabled")
                .and_then(|t| parse_choice(&t)),
            max_map_count: read("/proc/sys/vm/max_map_count").and_then(|t| t.trim().parse().ok()),
            map_count: read("/proc/self/maps").map(|t| t.lines().count() as u64),
            io_uring: Ok(()),
            huge_detection: true,
        }
    }

    /// MemTotal in bytes.
    pub fn mem_total(&self) -> Option<u64> {
        self.meminfo.get("MemTotal").copied()
    }

    /// The memlock limit that applies to pinning (None: none applies).
    pub fn memlock_effective(&self) -> Option<u64> {
        if self.cap_ipc_lock {
            None
        } else {
            self.memlock_soft
        }
    }

    /// JSON view (`doctor --json` "system").
    pub fn to_json(&self) -> Value {
        json!({
            "page_size": self.page_size,
            "mem_total": self.mem_total(),
            "mlocked": self.meminfo.get("Mlocked"),
            "hugepages_total": self.meminfo.get("HugePages_Total"),
            "hugepages_free": self.meminfo.get("HugePages_Free"),
            "hugepagesize": self.meminfo.get("Hugepagesize"),
            "vm_lck": self.status.get("VmLck"),
            "vm_pin": self.status.get("VmPin"),
            "memlock_soft": self.memlock_soft,
            "memlock_hard": self.memlock_hard,
            "cap_ipc_lock": self.cap_ipc_lock,
            "cgroup": self.cgroup.as_ref().map(|c| json!({
                "version": c.version,
                "path": c.path,
                "limit_file": c.limit_file,
                "limit": c.limit,
                "usage": c.usage,
            })),
            "thp_enabled": self.thp_enabled,
            "max_map_count": self.max_map_count,
            "map_count": self.map_count,
            "io_uring": self.io_uring.is_ok(),
            "io_uring_reason": self.io_uring.as_ref().err(),
            "huge_detection": self.huge_detection,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_choice() {
        let m = parse_meminfo("MemTotal:  1000 kB\nHugePages_Total:   4\nMlocked: 8 kB\n");
        assert_eq!(m["MemTotal"], 1024 * 1000);
        assert_eq!(m["HugePages_Total"], 4);
        assert_eq!(
            parse_choice("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
    }

    #[test]
    fn cgroup_v2_ancestors_and_namespace() {
        let files: BTreeMap<&str, &str> = [
            ("/sys/fs/cgroup/a/memory.max", "2000000\n"),
            ("/sys/fs/cgroup/a/b/memory.max", "max\n"),
            ("/sys/fs/cgroup/a/b/memory.current", "1234\n"),
        ]
        .into_iter()
        .collect();
        let read = |p: &str| files.get(p).map(|s| s.to_string());
        let c = find_cgroup("0::/a/b\n", &read).unwrap();
        assert_eq!(c.version, 2);
        assert_eq!(c.limit, Some(2_000_000));
        assert_eq!(c.limit_file, "/sys/fs/cgroup/a/memory.max");
        assert_eq!(c.usage, Some(1234));
        // v1 with a namespaced mount: only the mount root has the files.
        let files: BTreeMap<&str, &str> = [(
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "9223372036854771712\n",
        )]
        .into_iter()
        .collect();
        let read = |p: &str| files.get(p).map(|s| s.to_string());
        let c = find_cgroup("4:memory:/x/y\n0::/\n", &read).unwrap();
        assert_eq!(c.version, 1);
        assert_eq!(c.limit, None);
    }
}
