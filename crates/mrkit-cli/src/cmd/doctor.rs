//! `mrkit doctor`: the seeds' checklist against this machine, and `mrkit doctor explain ERRNO`.

use clap::{Args, Subcommand};
use mrkit::{AccessFlags, Buffer, BufferOptions, Context, Errno};
use mrkit_soft::DeviceConfig;
use serde_json::{json, Value};

use std::path::Path;

use super::device::Selected;
use super::human;
use super::sysinfo::SysInfo;
use crate::exit;

#[derive(Args, Debug)]
#[command(
    args_conflicts_with_subcommands = true,
    after_help = "Examples:\n  mrkit doctor\n  mrkit doctor --json | jq '.checks[] | select(.status != \"ok\")'\n  mrkit doctor explain EINVAL --access remote-write\n  mrkit doctor explain ENOMEM --size 1GiB --access local-write --reproduce\n  mrkit doctor explain EFAULT --readonly --access local-write --reproduce\n\nExit status: 0 when no check failed (warnings allowed), 1 when a check failed, 2 on usage errors."
)]
pub struct DoctorArgs {
    #[command(subcommand)]
    sub: Option<DoctorSub>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum DoctorSub {
    /// Map a failed registration (errno + parameters) to its likely causes, in order, with fixes.
    Explain(ExplainArgs),
}

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  mrkit doctor explain EINVAL --access remote-write\n  mrkit doctor explain 12 --size 64MiB\n  mrkit doctor explain EFAULT --readonly --access local-write --reproduce\n  mrkit doctor explain EOPNOTSUPP --access on-demand --json"
)]
pub struct ExplainArgs {
    /// The errno of the failed registration: a name (EINVAL) or a number (22).
    errno: String,
    /// The access flags that were requested (as `mrkit reg --access`).
    #[arg(long)]
    access: Option<String>,
    /// The registration length.
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// In-page offset of the registered address.
    #[arg(long)]
    offset: Option<u64>,
    /// The iova that was passed (ibv_reg_mr_iova).
    #[arg(long, value_parser = parse_size)]
    iova: Option<u64>,
    /// The buffer was mapped read-only (PROT_READ or a read-only file mapping).
    #[arg(long)]
    readonly: bool,
    /// The buffer was backed by transparent huge pages.
    #[arg(long)]
    thp: bool,
    /// Register with these parameters on the device now and show the real result (sizes up to 1 GiB).
    #[arg(long)]
    reproduce: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    mrkit_soft::device::parse_size(s)
        .ok_or_else(|| format!("`{s}` is not a size (4096, 64KiB, 8MiB, 1GiB, 0x1000)"))
}

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    /// Fine.
    Ok,
    /// Works, but will bite.
    Warn,
    /// Registrations fail.
    Fail,
}

impl Status {
    fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One check's verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Stable identifier.
    pub id: &'static str,
    /// Verdict.
    pub status: Status,
    /// What was found.
    pub message: String,
    /// What to do (empty when ok).
    pub fix: String,
}

fn check(
    id: &'static str,
    status: Status,
    message: impl Into<String>,
    fix: impl Into<String>,
) -> Check {
    Check {
        id,
        status,
        message: message.into(),
        fix: fix.into(),
    }
}

/// Everything the checks read: the system, the device configuration from the environment,
/// and the stat files of running mrkit processes.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// /proc, /sys, rlimits, capabilities.
    pub sys: SysInfo,
    /// `DeviceConfig::from_env()`.
    pub config: Result<DeviceConfig, String>,
    /// Parsed stat files of live mrkit processes (`mrkit stat`).
    pub procs: Vec<Value>,
}

impl Inputs {
    /// The live system.
    pub fn gather() -> Inputs {
        let dir = mrkit::stat_export::runtime_dir();
        let procs = mrkit::stat_export::list(&dir)
            .into_iter()
            .filter_map(|pid| mrkit::stat_export::read(&dir, pid).ok())
            .filter(mrkit::stat_export::is_alive)
            .collect();
        Inputs {
            sys: SysInfo::gather(),
            config: DeviceConfig::from_env(),
            procs,
        }
    }
}

/// Memory below which a memlock limit is called small.
const SMALL_MEMLOCK: u64 = 64 << 20;

/// DONTFORK registrations below this many are worth a warning about vm.max_map_count.
const FEW_SPLITS: u64 = 16384;

/// Run every check.
pub fn checks(i: &Inputs) -> Vec<Check> {
    let s = &i.sys;
    let mut out = Vec::new();

    // 1. RLIMIT_MEMLOCK vs CAP_IPC_LOCK.
    out.push(if s.cap_ipc_lock {
        check("memlock", Status::Ok, "CAP_IPC_LOCK is held: RLIMIT_MEMLOCK does not limit pinning", "")
    } else {
        match s.memlock_soft {
            None => check("memlock", Status::Ok, "RLIMIT_MEMLOCK is unlimited", ""),
            Some(0) => check(
                "memlock",
                Status::Fail,
                "RLIMIT_MEMLOCK is 0 and CAP_IPC_LOCK is missing: every pinned registration fails with EPERM",
                "raise it: `ulimit -l unlimited` (needs the hard limit), LimitMEMLOCK=infinity (systemd), \
                 `docker run --ulimit memlock=-1`, /etc/security/limits.conf `* - memlock unlimited`; or grant CAP_IPC_LOCK",
            ),
            Some(l) if l < SMALL_MEMLOCK => check(
                "memlock",
                Status::Warn,
                format!(
                    "RLIMIT_MEMLOCK is {} (hard {}) and CAP_IPC_LOCK is missing: registrations beyond {} in total fail with ENOMEM",
                    human(l),
                    s.memlock_hard.map(human).unwrap_or_else(|| "unlimited".into()),
                    human(l)
                ),
                "raise it: `ulimit -l unlimited`, LimitMEMLOCK=infinity (systemd), `docker run --ulimit memlock=-1`, \
                 limits.conf memlock; or grant CAP_IPC_LOCK",
            ),
            Some(l) => check("memlock", Status::Ok, format!("RLIMIT_MEMLOCK is {}", human(l)), ""),
        }
    });

    // 2. cgroup memory limit.
    out.push(match &s.cgroup {
        None => check("cgroup", Status::Ok, "no memory cgroup limit found", ""),
        Some(c) => match c.limit {
            None => check(
                "cgroup",
                Status::Ok,
                format!("cgroup v{} {}: no memory limit ({})", c.version, c.path, c.limit_file),
                "",
            ),
            Some(l) => {
                let used = c.usage.unwrap_or(0);
                let pct = used as f64 * 100.0 / l.max(1) as f64;
                let fix = "raise the limit (memory.max / memory.limit_in_bytes, `docker run --memory`, the pod's \
                           resources.limits.memory) to cover the registered memory plus the working set";
                if pct >= 90.0 {
                    check(
                        "cgroup",
                        Status::Fail,
                        format!(
                            "cgroup v{} limit {} is {:.0}% used ({}): pinning more faults pages in and hits the limit (ENOMEM or the OOM killer)",
                            c.version,
                            human(l),
                            pct,
                            c.limit_file
                        ),
                        fix,
                    )
                } else {
                    check(
                        "cgroup",
                        Status::Warn,
                        format!(
                            "cgroup v{} memory limit {} ({}; {} used): pinned pages are charged to it and cannot be reclaimed",
                            c.version,
                            human(l),
                            c.limit_file,
                            human(used)
                        ),
                        fix,
                    )
                }
            }
        },
    });

    // 3. THP mode.
    out.push(match s.thp_enabled.as_deref() {
        Some("always") => check("thp", Status::Ok, "transparent huge pages: always", ""),
        Some("madvise") => check(
            "thp",
            Status::Ok,
            "transparent huge pages: madvise (mrkit Buffer's thp option and `mrkit reg --thp` use MADV_HUGEPAGE)",
            "",
        ),
        Some(other) => check(
            "thp",
            Status::Warn,
            format!("transparent huge pages: {other}: every registered page is 4 KiB, 512x more translation entries than 2 MiB pages"),
            "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (or boot with transparent_hugepage=madvise)",
        ),
        None => check(
            "thp",
            Status::Warn,
            "/sys/kernel/mm/transparent_hugepage/enabled is unreadable: THP state unknown",
            "check that the kernel has CONFIG_TRANSPARENT_HUGEPAGE and /sys is mounted",
        ),
    });
    out.push(if s.huge_detection {
        check("huge_detection", Status::Ok, "PAGEMAP_SCAN works: THP-backed registrations use 2 MiB translation entries", "")
    } else {
        check(
            "huge_detection",
            Status::Warn,
            "PAGEMAP_SCAN is unavailable: mrkit0 counts THP-backed memory as 4 KiB pages (no translation savings)",
            "use a kernel with PAGEMAP_SCAN (6.7 or later)",
        )
    });

    // 4. hugetlb reservation.
    let total = s.meminfo.get("HugePages_Total").copied().unwrap_or(0);
    let free = s.meminfo.get("HugePages_Free").copied().unwrap_or(0);
    let hps = s.meminfo.get("Hugepagesize").copied().unwrap_or(2 << 20);
    let mem_total = s.mem_total().unwrap_or(0);
    out.push(if total == 0 {
        check(
            "hugetlb",
            Status::Ok,
            "no hugetlbfs pages reserved (HugePages_Total 0): MAP_HUGETLB buffers fail, THP is used instead",
            "",
        )
    } else if free == 0 {
        check(
            "hugetlb",
            Status::Warn,
            format!("all {total} reserved huge pages of {} are in use: MAP_HUGETLB buffers fail with ENOMEM", human(hps)),
            "reserve more: sysctl vm.nr_hugepages=N, or use THP (MADV_HUGEPAGE) instead",
        )
    } else if mem_total > 0 && total * hps > mem_total / 2 {
        check(
            "hugetlb",
            Status::Warn,
            format!(
                "{} of {} RAM is reserved as hugetlbfs pages ({free} of {total} free): ordinary and THP memory cannot use it",
                human(total * hps),
                human(mem_total)
            ),
            "lower vm.nr_hugepages unless the application registers MAP_HUGETLB buffers",
        )
    } else {
        check(
            "hugetlb",
            Status::Ok,
            format!("{total} huge pages of {} reserved, {free} free", human(hps)),
            "",
        )
    });

    // 5. vm.max_map_count vs MADV_DONTFORK splits.
    let dontfork = i.config.as_ref().map(|c| c.uses_dontfork()).unwrap_or(true);
    let max_mr = i
        .config
        .as_ref()
        .map(|c| c.attr().max_mr as u64)
        .unwrap_or(524_287);
    out.push(match (s.max_map_count, dontfork) {
        (_, false) => check("max_map_count", Status::Ok, "MADV_DONTFORK is off (the default; MRKIT_DONTFORK=1 turns it on): registrations do not split mappings", ""),
        (None, true) => check("max_map_count", Status::Warn, "vm.max_map_count is unreadable", "check /proc/sys/vm/max_map_count"),
        (Some(max), true) => {
            let used = s.map_count.unwrap_or(0);
            let splits = max.saturating_sub(used) / 2;
            if splits < FEW_SPLITS.min(max_mr) {
                check(
                    "max_map_count",
                    Status::Warn,
                    format!(
                        "vm.max_map_count {max} with {used} mappings in use: MADV_DONTFORK splits a mapping into up to 3, so only about {splits} \
                         separate registrations fit before madvise fails with ENOMEM (max_mr is {max_mr})"
                    ),
                    "sysctl vm.max_map_count=1048576, or register a few large buffers (MR pool) instead of many small ones",
                )
            } else {
                check(
                    "max_map_count",
                    Status::Ok,
                    format!("vm.max_map_count {max}, {used} mappings in use: room for about {splits} DONTFORK splits"),
                    "",
                )
            }
        }
    });

    // 6. Locked and pinned memory (RLIMIT_MEMLOCK and pinning: `docs/registration.md`, "Pinning").
    let mlocked = s.meminfo.get("Mlocked").copied().unwrap_or(0);
    let own =
        s.status.get("VmLck").copied().unwrap_or(0) + s.status.get("VmPin").copied().unwrap_or(0);
    let lim = s.memlock_effective();
    out.push(if mem_total > 0 && mlocked > mem_total / 2 {
        check(
            "locked_memory",
            Status::Warn,
            format!("{} of {} RAM is mlocked system-wide (/proc/meminfo Mlocked): pinned memory cannot be swapped or reclaimed", human(mlocked), human(mem_total)),
            "find the holders (grep VmLck /proc/*/status), deregister idle MRs, use ODP for sparse buffers",
        )
    } else if let Some(l) = lim.filter(|l| *l > 0 && own * 10 > *l * 8) {
        check(
            "locked_memory",
            Status::Warn,
            format!("this process has {} locked/pinned (VmLck+VmPin) of its {} RLIMIT_MEMLOCK", human(own), human(l)),
            "raise RLIMIT_MEMLOCK or release locked memory",
        )
    } else {
        check(
            "locked_memory",
            Status::Ok,
            format!("Mlocked {} system-wide; this process VmLck+VmPin {}", human(mlocked), human(own)),
            "",
        )
    });

    // 7. io_uring (the pin path).
    out.push(match &s.io_uring {
        Ok(()) => check("io_uring", Status::Ok, "io_uring fixed buffers work: pages are pinned like ib_umem_get (long-term GUP pin)", ""),
        Err(r) => check(
            "io_uring",
            Status::Warn,
            format!("io_uring is unusable ({r}): mrkit0 pins with mlock instead (no long-term pin, no COW break on read-only pins)"),
            "sysctl kernel.io_uring_disabled=0; allow io_uring_setup in the seccomp profile (Docker's default blocks it); \
             MRKIT_PIN=mlock chooses mlock explicitly",
        ),
    });

    // 8. Device configuration.
    out.push(match &i.config {
        Ok(c) => {
            let over: Vec<String> = c.sources().map(|(k, v)| format!("{k} from {v}")).collect();
            check(
                "device_config",
                Status::Ok,
                if over.is_empty() {
                    format!("profile {}, built-in limits", c.profile_name())
                } else {
                    format!("profile {}, {}", c.profile_name(), over.join(", "))
                },
                "",
            )
        }
        Err(e) => check(
            "device_config",
            Status::Fail,
            format!("MRKIT_* environment is malformed: {e}"),
            "fix or unset the variable (see `mrkit devinfo -v`)",
        ),
    });

    // 9. Registrations near device limits (running processes that export stats).
    out.push(device_limits(i));
    out
}

fn device_limits(i: &Inputs) -> Check {
    if i.procs.is_empty() {
        return check(
            "device_limits",
            Status::Ok,
            "no running mrkit process exports statistics",
            "",
        );
    }
    let mut worst = Status::Ok;
    let mut notes = Vec::new();
    for p in &i.procs {
        let pid = p["pid"].as_u64().unwrap_or(0);
        let lim = &p["device_limits"];
        for (used_k, max_k, what) in [
            ("mrs_live", "max_mr", "MRs"),
            ("mtt_used", "max_mtt", "translation entries"),
        ] {
            let (Some(used), Some(max)) = (p[used_k].as_u64(), lim[max_k].as_u64()) else {
                continue;
            };
            if max == 0 {
                continue;
            }
            let st = if used >= max {
                Status::Fail
            } else if used * 10 >= max * 8 {
                Status::Warn
            } else {
                Status::Ok
            };
            if st > Status::Ok {
                notes.push(format!("pid {pid}: {used} of {max} {what}"));
            }
            worst = worst.max(st);
        }
        let enomem = p["failures"]["ENOMEM"].as_u64().unwrap_or(0);
        if enomem > 0 {
            notes.push(format!(
                "pid {pid}: {enomem} registrations failed with ENOMEM"
            ));
            worst = worst.max(Status::Warn);
        }
    }
    if worst == Status::Ok {
        check(
            "device_limits",
            Status::Ok,
            format!(
                "{} mrkit process(es) well below max_mr and the translation capacity",
                i.procs.len()
            ),
            "",
        )
    } else {
        check(
            "device_limits",
            worst,
            notes.join("; "),
            "reuse registrations (MR pool / registration cache), back buffers with THP, or raise MRKIT_MAX_MR / MRKIT_LOG_NUM_MTT",
        )
    }
}

/// Checks about mrkit0 itself, left out for a kernel device.
const MRKIT0_ONLY: &[&str] = &[
    "huge_detection",
    "io_uring",
    "device_config",
    "device_limits",
];

/// The kernel driver bound to RDMA device `dev` (`mlx5_core`, `mlx4_core`, `irdma`, ...): the
/// name of the `/sys/class/infiniband/<dev>/device/driver` link under `root`.
pub fn driver_of(root: &Path, dev: &str) -> Option<String> {
    let link = root
        .join("sys/class/infiniband")
        .join(dev)
        .join("device/driver");
    std::fs::read_link(link)
        .ok()?
        .file_name()?
        .to_str()
        .map(String::from)
}

fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// A loaded kernel module: `/sys/module/<m>` (built-in modules appear there too) or a line of
/// `/proc/modules`.
fn module_loaded(root: &Path, m: &str) -> bool {
    root.join("sys/module").join(m).exists()
        || read_trim(&root.join("proc/modules"))
            .is_some_and(|t| t.lines().any(|l| l.split_whitespace().next() == Some(m)))
}

/// The checklist of a kernel RDMA stack for device `dev`, reading the tree under `root` (`/`,
/// or a fake tree in tests): the uverbs character devices, the modules, each port's state and
/// RoCE v2 GID, and the security modules' denials where they can be seen.
pub fn stack_checks(root: &Path, dev: &str) -> Vec<Check> {
    let mut out = Vec::new();
    // 1. /dev/infiniband/uverbs*: present and readable+writable by this process.
    let uverbs: Vec<std::path::PathBuf> = std::fs::read_dir(root.join("dev/infiniband"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("uverbs"))
        })
        .collect();
    out.push(if uverbs.is_empty() {
        check(
            "uverbs",
            Status::Fail,
            "no /dev/infiniband/uverbs* character device: user space cannot open any RDMA device",
            "load the module (`modprobe ib_uverbs`); in a container pass the devices \
             (`docker run --device=/dev/infiniband/uverbs0 --device=/dev/infiniband/rdma_cm`, \
             or the RDMA device plugin in Kubernetes)",
        )
    } else {
        let denied: Vec<String> = uverbs
            .iter()
            .filter(|p| {
                rustix::fs::access(p.as_path(), rustix::fs::Access::READ_OK | rustix::fs::Access::WRITE_OK)
                    .is_err()
            })
            .map(|p| p.display().to_string())
            .collect();
        if denied.is_empty() {
            check(
                "uverbs",
                Status::Ok,
                format!("{} uverbs device(s), readable and writable", uverbs.len()),
                "",
            )
        } else {
            check(
                "uverbs",
                Status::Fail,
                format!("no read/write access to {}", denied.join(", ")),
                "give the user access: the rdma-core udev rule (MODE=\"0666\") or the `rdma` group, \
                 or run with the device passed into the container",
            )
        }
    });
    // 2. ib_uverbs and the device's driver.
    let driver = driver_of(root, dev);
    let devdir = root.join("sys/class/infiniband").join(dev);
    let mut missing = Vec::new();
    if !module_loaded(root, "ib_uverbs") {
        missing.push("ib_uverbs".to_string());
    }
    out.push(if !devdir.exists() {
        check(
            "driver",
            Status::Fail,
            format!("no RDMA device {dev} in /sys/class/infiniband (its driver is not loaded, or the name is wrong)"),
            "load the RDMA driver of the NIC (`modprobe mlx5_ib`, `irdma`, `efa`, `bnxt_re`; soft RoCE: \
             `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`); `rdma link` lists the devices",
        )
    } else if !missing.is_empty() {
        check(
            "driver",
            Status::Fail,
            format!("{dev} exists (driver {}) but {} is not loaded", driver.as_deref().unwrap_or("?"), missing.join(", ")),
            "`modprobe ib_uverbs` (and add it to /etc/modules-load.d/ so it loads at boot)",
        )
    } else {
        check(
            "driver",
            Status::Ok,
            format!("{dev}: driver {}, ib_uverbs loaded", driver.as_deref().unwrap_or("unknown")),
            "",
        )
    });
    // 3. Ports: state ACTIVE and, on Ethernet, a RoCE v2 GID.
    let mut ports: Vec<(u32, std::path::PathBuf)> = std::fs::read_dir(devdir.join("ports"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse().ok()?, e.path())))
        .collect();
    ports.sort();
    if devdir.exists() && ports.is_empty() {
        out.push(check(
            "port",
            Status::Fail,
            format!("{dev} has no ports in sysfs"),
            "check the driver's kernel log (dmesg)",
        ));
    }
    for (n, p) in &ports {
        let state = read_trim(&p.join("state")).unwrap_or_else(|| "unreadable".into());
        out.push(if state.ends_with("ACTIVE") && !state.contains("DEFER") {
            check("port", Status::Ok, format!("{dev} port {n}: {state}"), "")
        } else {
            check(
                "port",
                Status::Fail,
                format!("{dev} port {n} is {state}, not ACTIVE: QPs cannot reach RTR"),
                "bring the link up (`ip link set <netdev> up`, cable and switch port); on InfiniBand a subnet manager must run (opensm)",
            )
        });
        let ll = read_trim(&p.join("link_layer")).unwrap_or_default();
        if ll == "InfiniBand" {
            out.push(check(
                "roce_gid",
                Status::Ok,
                format!("{dev} port {n}: InfiniBand link layer, no RoCE GID needed"),
                "",
            ));
            continue;
        }
        let types = p.join("gid_attrs/types");
        let v2: Vec<String> = std::fs::read_dir(&types)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| read_trim(&e.path()).is_some_and(|t| t.eq_ignore_ascii_case("RoCE v2")))
            .filter(|e| {
                // A RoCE v2 entry with a non-zero GID (unused entries read as zeros or fail).
                read_trim(&p.join("gids").join(e.file_name()))
                    .is_some_and(|g| g.chars().any(|c| c != '0' && c != ':'))
            })
            .filter_map(|e| e.file_name().to_str().map(String::from))
            .collect();
        out.push(if v2.is_empty() {
            check(
                "roce_gid",
                Status::Fail,
                format!("{dev} port {n}: no RoCE v2 GID (gid_attrs/types has none with an address)"),
                "give the port's netdev an IP address (`ip addr add 192.0.2.1/24 dev <netdev>`): RoCE v2 GIDs are made from its addresses",
            )
        } else {
            let mut v2 = v2;
            v2.sort_by_key(|i| i.parse::<u32>().unwrap_or(u32::MAX));
            check("roce_gid", Status::Ok, format!("{dev} port {n}: RoCE v2 GID index {}", v2.join(", ")), "")
        });
    }
    // 4. Security modules: SELinux enforcing and its denials, the AppArmor confinement.
    let mut notes = Vec::new();
    let mut st = Status::Ok;
    let mut fix = String::new();
    if read_trim(&root.join("sys/fs/selinux/enforce")).as_deref() == Some("1") {
        notes.push("SELinux is enforcing".to_string());
        if let Some(log) = read_trim(&root.join("var/log/audit/audit.log")) {
            let denials = log
                .lines()
                .filter(|l| {
                    l.contains("avc:")
                        && l.contains("denied")
                        && (l.contains("infiniband") || l.contains("uverbs") || l.contains("rdma"))
                })
                .count();
            if denials > 0 {
                st = Status::Fail;
                notes.push(format!(
                    "{denials} AVC denial(s) of RDMA devices in the audit log"
                ));
                fix = "allow the access in the policy (`ausearch -m avc -c <comm> | audit2allow -M rdma_local && semodule -i rdma_local.pp`), or label the device correctly (`restorecon -v /dev/infiniband/*`)".into();
            }
        } else {
            notes.push("the audit log is not readable here: denials cannot be seen".into());
            st = st.max(Status::Warn);
            fix = "run as root or read /var/log/audit/audit.log (`ausearch -m avc -ts recent`) for denials of /dev/infiniband".into();
        }
    }
    if let Some(label) = read_trim(&root.join("proc/self/attr/current")) {
        let label = label.trim_end_matches('\0').to_string();
        if !label.is_empty()
            && label != "unconfined"
            && !label.contains("unconfined_t")
            && !label.starts_with("kernel")
        {
            notes.push(format!("this process runs confined as `{label}`"));
            if st == Status::Ok {
                st = Status::Warn;
                fix = "make sure the profile allows /dev/infiniband/* rw and /sys/class/infiniband/** r (AppArmor: `aa-complain` the profile to test; the kernel log shows `apparmor=\"DENIED\"` lines)".into();
            }
        }
    }
    out.push(if notes.is_empty() {
        check(
            "lsm",
            Status::Ok,
            "no SELinux enforcement and no confining security profile seen",
            "",
        )
    } else {
        check("lsm", st, notes.join("; "), fix)
    });
    out
}

fn checks_json(cs: &[Check]) -> Value {
    json!(cs
        .iter()
        .map(|c| json!({"id": c.id, "status": c.status.name(), "message": c.message, "fix": c.fix}))
        .collect::<Vec<_>>())
}

pub fn run(a: DoctorArgs, dev: &Selected) -> u8 {
    if let Some(DoctorSub::Explain(e)) = a.sub {
        return explain_run(e, dev);
    }
    let inputs = Inputs::gather();
    let mut cs = checks(&inputs);
    if !dev.is_embedded() {
        // A kernel device: mrkit0's own checks (its pin path, page-size detection, MRKIT_*
        // configuration, its processes' limits) do not apply; the kernel stack does, read
        // from sysfs without opening the device (so the checklist also runs when opening is
        // what fails).
        cs.retain(|c| !MRKIT0_ONLY.contains(&c.id));
        cs.extend(stack_checks(Path::new("/"), dev.device()));
    }
    let worst = cs.iter().map(|c| c.status).max().unwrap_or(Status::Ok);
    if a.json {
        let v = json!({
            "status": worst.name(),
            "checks": checks_json(&cs),
            "system": inputs.sys.to_json(),
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
    } else {
        for c in &cs {
            println!("[{:<4}] {:<15} {}", c.status.name(), c.id, c.message);
            if !c.fix.is_empty() {
                println!("       {:<15} fix: {}", "", c.fix);
            }
        }
        let n = |s: Status| cs.iter().filter(|c| c.status == s).count();
        println!(
            "\n{} ok, {} warn, {} fail",
            n(Status::Ok),
            n(Status::Warn),
            n(Status::Fail)
        );
    }
    if worst == Status::Fail {
        exit::VERB_FAILED
    } else {
        exit::OK
    }
}

// ---------------------------------------------------------------------------------------------
// explain

/// How well a cause fits the given parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fit {
    /// The parameters trigger it.
    Certain,
    /// Possible; the parameters do not tell.
    Possible,
    /// The parameters rule it out.
    Unlikely,
}

impl Fit {
    fn name(self) -> &'static str {
        match self {
            Fit::Certain => "certain",
            Fit::Possible => "possible",
            Fit::Unlikely => "unlikely",
        }
    }
}

/// One likely cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    /// Stable identifier.
    pub id: &'static str,
    /// How well it fits.
    pub fit: Fit,
    /// What happened.
    pub cause: String,
    /// What to do.
    pub fix: String,
}

/// The parameters of the failed registration.
#[derive(Debug, Clone, Default)]
pub struct Params {
    /// Requested access (None: not given).
    pub access: Option<AccessFlags>,
    /// Length.
    pub size: Option<u64>,
    /// In-page offset of addr.
    pub offset: Option<u64>,
    /// iova.
    pub iova: Option<u64>,
    /// Read-only mapping.
    pub readonly: bool,
    /// THP-backed.
    pub thp: bool,
}

fn fit(known: bool, yes: bool) -> Fit {
    match (known, yes) {
        (false, _) => Fit::Possible,
        (true, true) => Fit::Certain,
        (true, false) => Fit::Unlikely,
    }
}

/// Causes of `errno` for these parameters, most likely first.
#[cfg(test)]
pub fn explain(errno: Errno, p: &Params, cfg: &DeviceConfig, sys: &SysInfo) -> Vec<Cause> {
    explain_on(errno, p, cfg, sys, None)
}

/// `explain` for device `other` (not mrkit0) whose limits `cfg` carries: the limits are
/// then quoted as read from that device, not from mrkit0's configuration.
pub fn explain_on(
    errno: Errno,
    p: &Params,
    cfg: &DeviceConfig,
    sys: &SysInfo,
    other: Option<&str>,
) -> Vec<Cause> {
    let attr = cfg.attr();
    let source = |k: &str| match other {
        None => cfg.source(k).to_string(),
        Some(d) => format!("ibv_query_device on {d}"),
    };
    let acc = p.access;
    let has = |f: AccessFlags| acc.map(|a| a.intersects(f));
    let ps = sys.page_size;
    let mut v: Vec<Cause> = Vec::new();
    let mut add = |id: &'static str, f: Fit, cause: String, fix: &str| {
        v.push(Cause {
            id,
            fit: f,
            cause,
            fix: fix.to_string(),
        })
    };
    match errno {
        Errno::EINVAL => {
            let off_mismatch = p.iova.map(|i| i % ps != p.offset.unwrap_or(0) % ps);
            add(
                "iova_offset",
                fit(off_mismatch.is_some(), off_mismatch == Some(true)),
                "addr and iova have different offsets within the page (checked first)".into(),
                "pass an iova with the same low 12 bits as addr, or use ibv_reg_mr (iova = addr)",
            );
            let rw = acc.map(|a| {
                a.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
                    && !a.contains(AccessFlags::LOCAL_WRITE)
            });
            add(
                "remote_without_local_write",
                fit(rw.is_some(), rw == Some(true)),
                "REMOTE_WRITE or REMOTE_ATOMIC without LOCAL_WRITE".into(),
                "add local-write (IBV_ACCESS_LOCAL_WRITE) to the access flags",
            );
            let unknown = acc.map(|a| a.bits() & !AccessFlags::SUPPORTED != 0);
            add(
                "unknown_access_bits",
                fit(unknown.is_some(), unknown == Some(true)),
                "access bits outside IB_ACCESS_SUPPORTED (0x3ff003ff), e.g. bits 10-19 or 30-31"
                    .into(),
                "remove them; optional bits belong in 0x3ff00000 (RELAXED_ORDERING)",
            );
            let too_big = p.size.map(|s| s > attr.max_mr_size);
            add(
                "max_mr_size",
                fit(too_big.is_some(), too_big == Some(true)),
                format!(
                    "length exceeds max_mr_size ({}, from {})",
                    if attr.max_mr_size == u64::MAX { "unlimited".into() } else { human(attr.max_mr_size) },
                    source("max_mr_size")
                ),
                "split the buffer into several MRs (e.g. 1 GiB each) or raise max_mr_size (MRKIT_MAX_MR_SIZE)",
            );
            let zero = p.size.map(|s| s == 0);
            add(
                "zero_length",
                fit(zero.is_some(), zero == Some(true)),
                "length 0 (an MR must cover at least one byte)".into(),
                "register at least one byte",
            );
            add(
                "address_wrap",
                Fit::Possible,
                "addr + length wraps the address space (a garbage pointer or length)".into(),
                "check the pointer and length passed to ibv_reg_mr",
            );
            add(
                "bad_pd",
                Fit::Possible,
                "the PD handle is invalid (deallocated, or from another context)".into(),
                "register with a live PD of the same context",
            );
            add(
                "rxe_object_limit",
                Fit::Possible,
                format!("on Linux rxe, more than max_mr ({}) MRs: rxe reports EINVAL where mrkit0 and mlx5 report ENOMEM", attr.max_mr),
                "deregister MRs or reuse them (MR pool / registration cache)",
            );
        }
        Errno::EFAULT => {
            let writable = acc.map(|a| a.is_writable());
            add(
                "readonly_mapping",
                if p.readonly { fit(writable.is_some(), writable == Some(true)) } else { Fit::Possible },
                "writable access (LOCAL_WRITE, REMOTE_WRITE, REMOTE_ATOMIC or MW_BIND) on a read-only mapping \
                 (PROT_READ, a read-only file mapping, .rodata): the write pin is refused"
                    .into(),
                "register read-only memory with remote-read only (no local-write), or map it PROT_READ|PROT_WRITE",
            );
            add(
                "unmapped",
                if p.readonly { Fit::Unlikely } else { Fit::Possible },
                "part of [addr, addr+length) is not mapped (freed, munmapped, PROT_NONE guard page, wrong length)".into(),
                "check the buffer is still allocated and the length does not run past its end",
            );
            add(
                "file_mapping",
                Fit::Possible,
                "a writable long-term pin of a MAP_SHARED file on a filesystem with writeback (or FS-DAX) is refused".into(),
                "register anonymous, shmem/tmpfs or hugetlbfs memory instead",
            );
        }
        Errno::ENOMEM => {
            let lim = sys.memlock_effective();
            let over = match (lim, p.size) {
                (Some(l), Some(s)) => Some(s > l),
                (None, _) => Some(false),
                _ => None,
            };
            add(
                "memlock",
                fit(over.is_some(), over == Some(true)),
                format!(
                    "pinned pages would exceed RLIMIT_MEMLOCK ({}; CAP_IPC_LOCK {}); overlapping registrations count twice",
                    lim.map(human).unwrap_or_else(|| "not limiting".into()),
                    if sys.cap_ipc_lock { "held" } else { "missing" }
                ),
                "`ulimit -l unlimited`, LimitMEMLOCK=infinity, `docker run --ulimit memlock=-1`, or CAP_IPC_LOCK",
            );
            let entries = p.size.map(|s| {
                let page = if p.thp { 2 << 20 } else { ps };
                s.div_ceil(page) + 1
            });
            let mtt = entries.map(|e| e > attr.max_mtt);
            add(
                "translation_entries",
                fit(mtt.is_some(), mtt == Some(true)),
                format!(
                    "the MR needs more translation entries than are free (2^{} in total, from {})",
                    attr.log_num_mtt,
                    source("log_num_mtt")
                ),
                "back the buffer with THP (512x fewer entries), deregister MRs, or raise log_num_mtt (MRKIT_LOG_NUM_MTT; mlx5: log_num_mtt module parameter)",
            );
            add(
                "max_mr",
                Fit::Possible,
                format!("max_mr ({}, from {}) MRs are already registered", attr.max_mr, source("max_mr")),
                "reuse registrations (MR pool / registration cache), deregister idle MRs, or raise max_mr (MRKIT_MAX_MR)",
            );
            let cg = sys
                .cgroup
                .as_ref()
                .and_then(|c| c.limit.map(|l| (l, c.usage.unwrap_or(0))));
            let cg_fit = match (cg, p.size) {
                (None, _) => Fit::Unlikely,
                (Some((l, u)), Some(s)) => fit(true, u.saturating_add(s) > l),
                (Some(_), None) => Fit::Possible,
            };
            add(
                "cgroup",
                cg_fit,
                format!(
                    "the memory cgroup limit is reached while faulting pages in for pinning ({})",
                    sys.cgroup
                        .as_ref()
                        .map(|c| format!(
                            "{} = {}",
                            c.limit_file,
                            c.limit.map(human).unwrap_or_else(|| "max".into())
                        ))
                        .unwrap_or_else(|| "no limit found".into())
                ),
                "raise memory.max / memory.limit_in_bytes (docker --memory, pod limits)",
            );
            add(
                "max_map_count",
                Fit::Possible,
                format!(
                    "madvise(MADV_DONTFORK) split a mapping beyond vm.max_map_count ({})",
                    sys.max_map_count
                        .map(|m| m.to_string())
                        .unwrap_or_else(|| "?".into())
                ),
                "sysctl vm.max_map_count=1048576 or register fewer, larger buffers",
            );
        }
        Errno::EPERM => {
            let zero = !sys.cap_ipc_lock && sys.memlock_soft == Some(0);
            add(
                "memlock_zero",
                if zero { Fit::Certain } else { Fit::Possible },
                format!(
                    "RLIMIT_MEMLOCK is 0 and the process lacks CAP_IPC_LOCK, so it may not pin at all (now: {}, CAP_IPC_LOCK {})",
                    sys.memlock_soft.map(human).unwrap_or_else(|| "unlimited".into()),
                    if sys.cap_ipc_lock { "held" } else { "missing" }
                ),
                "`ulimit -l unlimited` / LimitMEMLOCK=infinity / `docker run --ulimit memlock=-1`, or grant CAP_IPC_LOCK",
            );
        }
        Errno::EOPNOTSUPP => {
            let odp = has(AccessFlags::ON_DEMAND);
            let no_cap = attr.odp_general_caps & 1 == 0;
            add(
                "odp_unsupported",
                match odp {
                    Some(true) => fit(true, no_cap),
                    Some(false) => Fit::Unlikely,
                    None => Fit::Possible,
                },
                format!(
                    "ON_DEMAND without the device's ODP capability (ODP caps {:#x}, from {})",
                    attr.odp_general_caps,
                    source("odp_caps")
                ),
                "register pinned memory (drop on-demand) or use a device with ODP (MRKIT_ODP=1)",
            );
            let flush = has(AccessFlags::FLUSH_GLOBAL | AccessFlags::FLUSH_PERSISTENT);
            add(
                "flush_unsupported",
                fit(flush.is_some(), flush == Some(true)),
                "FLUSH_GLOBAL / FLUSH_PERSISTENT without IB_DEVICE_FLUSH_* (mrkit0 does not offer them)".into(),
                "drop the flush bits",
            );
            let zb = has(AccessFlags::ZERO_BASED | AccessFlags::HUGETLB);
            add(
                "rxe_zero_based_hugetlb",
                fit(
                    zb.is_some(),
                    zb == Some(true) && cfg.model() == mrkit::StatusModel::Rxe,
                ),
                "ZERO_BASED or HUGETLB on rxe (status model rxe): the driver rejects them".into(),
                "use ibv_reg_mr_iova with iova 0 instead of ZERO_BASED; drop HUGETLB",
            );
        }
        Errno::EACCES => {
            add(
                "rereg_access_upgrade",
                Fit::Possible,
                "ibv_rereg_mr(CHANGE_ACCESS) to a writable access on an MR that was pinned read-only, without \
                 CHANGE_TRANSLATION (kernel fix for CVE-2026-52908)"
                    .into(),
                "rereg with IBV_REREG_MR_CHANGE_TRANSLATION as well (re-pins writable), or deregister and register again",
            );
            add(
                "mapping_permission",
                Fit::Possible,
                "the mapping's permissions (or an LSM such as SELinux) forbid the requested access"
                    .into(),
                "map the buffer with the permissions the access flags need; check the audit log",
            );
        }
        Errno::EBUSY => {
            add(
                "pd_in_use",
                Fit::Possible,
                "ibv_dealloc_pd on a PD that still has MRs, MWs, QPs or SRQs".into(),
                "destroy them first",
            );
        }
        Errno::EOVERFLOW => {
            add(
                "odp_wrap",
                Fit::Possible,
                "an ODP registration whose addr + length wraps".into(),
                "check the pointer and length",
            );
        }
        _ => {
            add(
                "not_a_registration_errno",
                Fit::Possible,
                format!("{} is not an errno ibv_reg_mr reports", errno.name()),
                "check where the error came from",
            );
        }
    }
    // Stable sort: certain first, then possible, then unlikely; within a class the kernel's order.
    v.sort_by_key(|c| c.fit);
    v
}

fn reproduce(p: &Params, ctx: &Context) -> Value {
    let size = p.size.unwrap_or(4096);
    if size > 1 << 30 {
        return json!({"attempted": false, "reason": "sizes above 1 GiB are not reproduced (they would pin real memory)"});
    }
    let Ok(len) = usize::try_from(size) else {
        return json!({"attempted": false, "reason": "size too large"});
    };
    let mut buf = match Buffer::with_options(
        len.max(1),
        BufferOptions {
            thp: p.thp,
            populate: true,
            offset: p.offset.unwrap_or(0) as usize % 4096,
        },
    ) {
        Ok(b) => b,
        Err(e) => return json!({"attempted": false, "reason": format!("allocation failed: {e}")}),
    };
    if p.readonly {
        if let Err(e) = buf.make_readonly() {
            return json!({"attempted": false, "reason": format!("mprotect failed: {e}")});
        }
    }
    let pd = match ctx.alloc_pd() {
        Ok(pd) => pd,
        Err(e) => {
            return json!({"attempted": true, "ok": false, "errno": e.errno().name(), "message": e.cause()})
        }
    };
    let iova = p.iova.unwrap_or(buf.addr());
    let access = p.access.unwrap_or(AccessFlags::LOCAL_WRITE);
    let r = if size == 0 {
        // Buffer cannot be empty: register zero bytes of it through the raw provider.
        ctx.provider()
            .reg_mr(
                pd.handle(),
                mrkit_soft::UserMemory::empty_at(buf.addr()),
                iova,
                access,
            )
            .map(|_| ())
    } else {
        pd.register_iova(buf, iova, access).map(|_| ())
    };
    match r {
        Ok(()) => {
            json!({"attempted": true, "ok": true, "errno": null, "message": format!("registration succeeded on {}", ctx.name())})
        }
        Err(e) => {
            json!({"attempted": true, "ok": false, "errno": e.errno().name(), "message": e.cause()})
        }
    }
}

fn explain_run(a: ExplainArgs, dev: &Selected) -> u8 {
    let Some(errno) = Errno::parse(&a.errno) else {
        eprintln!(
            "mrkit doctor explain: `{}` is not an errno name or number (EINVAL, 22, ENOMEM, ...)",
            a.errno
        );
        return exit::USAGE;
    };
    let access = match a.access.as_deref().map(AccessFlags::parse_list).transpose() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("mrkit doctor explain: {e}");
            return exit::USAGE;
        }
    };
    let ctx = match dev.open("doctor explain") {
        Ok(c) => c,
        Err(code) => return code,
    };
    let (cfg, other) = if ctx.soft().is_some() {
        match DeviceConfig::from_env() {
            Ok(c) => (c, None),
            Err(e) => {
                eprintln!("mrkit doctor explain: {e}");
                return exit::USAGE;
            }
        }
    } else {
        // Another device: its limits as it reports them, in mrkit0's rule model.
        let attr = ctx.query_device();
        (
            DeviceConfig::rxe()
                .status_model(mrkit::StatusModel::Hardware)
                .with_attr(|a| *a = attr),
            Some(ctx.name().to_string()),
        )
    };
    let p = Params {
        access,
        size: a.size,
        offset: a.offset,
        iova: a.iova,
        readonly: a.readonly,
        thp: a.thp,
    };
    let sys = SysInfo::gather();
    let causes = explain_on(errno, &p, &cfg, &sys, other.as_deref());
    let repro = a.reproduce.then(|| reproduce(&p, &ctx));
    if a.json {
        let v = json!({
            "errno": errno.name(),
            "errno_value": errno.raw(),
            "parameters": {
                "access": p.access.map(|x| x.names()),
                "size": p.size,
                "offset": p.offset,
                "iova": p.iova,
                "readonly": p.readonly,
                "thp": p.thp,
            },
            "causes": causes.iter().map(|c| json!({"id": c.id, "fit": c.fit.name(), "cause": c.cause, "fix": c.fix})).collect::<Vec<_>>(),
            "reproduction": repro,
        });
        println!("{}", serde_json::to_string_pretty(&v).expect("json"));
        return exit::OK;
    }
    println!(
        "{} ({}) from a memory registration: likely causes, most likely first",
        errno.name(),
        errno.raw()
    );
    for (n, c) in causes.iter().enumerate() {
        println!("{:>2}. [{}] {}", n + 1, c.fit.name(), c.cause);
        println!("    fix: {}", c.fix);
    }
    if let Some(r) = repro {
        println!();
        if r["attempted"] == true {
            if r["ok"] == true {
                println!("reproduction on {}: the registration succeeded", ctx.name());
            } else {
                println!(
                    "reproduction on {}: {}: {}",
                    ctx.name(),
                    r["errno"].as_str().unwrap_or("?"),
                    r["message"].as_str().unwrap_or("")
                );
            }
        } else {
            println!(
                "reproduction skipped: {}",
                r["reason"].as_str().unwrap_or("")
            );
        }
    }
    exit::OK
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::sysinfo::Cgroup;

    /// A healthy machine: every check ok.
    fn healthy() -> Inputs {
        let mut sys = SysInfo::from_root(Path::new("/nonexistent"));
        sys.page_size = 4096;
        sys.meminfo = [
            ("MemTotal", 16u64 << 30),
            ("Mlocked", 0),
            ("HugePages_Total", 0),
            ("HugePages_Free", 0),
            ("Hugepagesize", 2 << 20),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        sys.memlock_soft = None;
        sys.thp_enabled = Some("madvise".into());
        sys.max_map_count = Some(1 << 20);
        sys.map_count = Some(100);
        Inputs {
            sys,
            config: Ok(DeviceConfig::rxe()),
            procs: vec![],
        }
    }

    fn status_of(i: &Inputs, id: &str) -> Status {
        checks(i).into_iter().find(|c| c.id == id).unwrap().status
    }

    #[test]
    fn healthy_is_all_ok() {
        let cs = checks(&healthy());
        assert!(cs.iter().all(|c| c.status == Status::Ok), "{cs:#?}");
        assert_eq!(cs.len(), 10);
    }

    #[test]
    fn memlock_zero_fails_small_warns_cap_ok() {
        let mut i = healthy();
        i.sys.memlock_soft = Some(0);
        assert_eq!(status_of(&i, "memlock"), Status::Fail);
        i.sys.memlock_soft = Some(8 << 20);
        assert_eq!(status_of(&i, "memlock"), Status::Warn);
        i.sys.cap_ipc_lock = true;
        assert_eq!(status_of(&i, "memlock"), Status::Ok);
    }

    #[test]
    fn cgroup_limit_warns_and_full_fails() {
        let mut i = healthy();
        i.sys.cgroup = Some(Cgroup {
            version: 2,
            path: "/pod".into(),
            limit_file: "/sys/fs/cgroup/pod/memory.max".into(),
            limit: Some(1 << 30),
            usage: Some(100 << 20),
        });
        assert_eq!(status_of(&i, "cgroup"), Status::Warn);
        i.sys.cgroup.as_mut().unwrap().usage = Some(1000 << 20);
        assert_eq!(status_of(&i, "cgroup"), Status::Fail);
    }

    #[test]
    fn thp_never_and_unreadable_warn() {
        let mut i = healthy();
        i.sys.thp_enabled = Some("never".into());
        assert_eq!(status_of(&i, "thp"), Status::Warn);
        i.sys.thp_enabled = None;
        assert_eq!(status_of(&i, "thp"), Status::Warn);
        i.sys.huge_detection = false;
        assert_eq!(status_of(&i, "huge_detection"), Status::Warn);
    }

    #[test]
    fn hugetlb_exhausted_or_oversized_warns() {
        let mut i = healthy();
        i.sys.meminfo.insert("HugePages_Total".into(), 10);
        i.sys.meminfo.insert("HugePages_Free".into(), 0);
        assert_eq!(status_of(&i, "hugetlb"), Status::Warn);
        i.sys.meminfo.insert("HugePages_Total".into(), 5000);
        i.sys.meminfo.insert("HugePages_Free".into(), 5000);
        assert_eq!(status_of(&i, "hugetlb"), Status::Warn);
        i.sys.meminfo.insert("HugePages_Total".into(), 10);
        assert_eq!(status_of(&i, "hugetlb"), Status::Ok);
    }

    #[test]
    fn max_map_count_low_warns_unless_dontfork_off() {
        let mut i = healthy();
        i.sys.max_map_count = Some(65530);
        i.sys.map_count = Some(40000);
        // DONTFORK marking is opt-in (MRKIT_DONTFORK=1, as rdma-core's ibv_fork_init).
        i.config = Ok(DeviceConfig::rxe().dontfork(true));
        assert_eq!(status_of(&i, "max_map_count"), Status::Warn);
        i.config = Ok(DeviceConfig::rxe().dontfork(false));
        assert_eq!(status_of(&i, "max_map_count"), Status::Ok);
    }

    #[test]
    fn locked_memory_warns() {
        let mut i = healthy();
        i.sys.meminfo.insert("Mlocked".into(), 10 << 30);
        assert_eq!(status_of(&i, "locked_memory"), Status::Warn);
        let mut i = healthy();
        i.sys.memlock_soft = Some(1 << 30);
        i.sys.status.insert("VmPin".into(), 900 << 20);
        assert_eq!(status_of(&i, "locked_memory"), Status::Warn);
    }

    #[test]
    fn io_uring_unavailable_warns() {
        let mut i = healthy();
        i.sys.io_uring = Err("io_uring_setup failed: EPERM".into());
        assert_eq!(status_of(&i, "io_uring"), Status::Warn);
    }

    #[test]
    fn bad_env_fails() {
        let mut i = healthy();
        i.config = Err("MRKIT_MAX_MR=lots: not a number".into());
        assert_eq!(status_of(&i, "device_config"), Status::Fail);
    }

    #[test]
    fn near_device_limits() {
        let mut i = healthy();
        let p = |live: u64| {
            json!({"pid": 42, "mrs_live": live, "mtt_used": 0, "failures": {"ENOMEM": 0},
                   "device_limits": {"max_mr": 1000, "max_mtt": 1u64 << 20}})
        };
        i.procs = vec![p(10)];
        assert_eq!(status_of(&i, "device_limits"), Status::Ok);
        i.procs = vec![p(900)];
        assert_eq!(status_of(&i, "device_limits"), Status::Warn);
        i.procs = vec![p(1000)];
        assert_eq!(status_of(&i, "device_limits"), Status::Fail);
        let mut q = p(1);
        q["failures"]["ENOMEM"] = json!(3);
        i.procs = vec![q];
        assert_eq!(status_of(&i, "device_limits"), Status::Warn);
    }

    #[test]
    fn explain_orders_certain_first() {
        let i = healthy();
        let p = Params {
            access: Some(AccessFlags::REMOTE_WRITE),
            ..Default::default()
        };
        let c = explain(Errno::EINVAL, &p, &DeviceConfig::rxe(), &i.sys);
        assert_eq!(c[0].id, "remote_without_local_write");
        assert_eq!(c[0].fit, Fit::Certain);
        let mut sys = i.sys.clone();
        sys.memlock_soft = Some(8 << 20);
        let p = Params {
            size: Some(64 << 20),
            ..Default::default()
        };
        let c = explain(Errno::ENOMEM, &p, &DeviceConfig::rxe(), &sys);
        assert_eq!(c[0].id, "memlock");
        let c = explain(
            Errno::ENOMEM,
            &p,
            &DeviceConfig::rxe().log_num_mtt(10),
            &i.sys,
        );
        assert_eq!(c[0].id, "translation_entries");
        let p = Params {
            readonly: true,
            access: Some(AccessFlags::LOCAL_WRITE),
            ..Default::default()
        };
        assert_eq!(
            explain(Errno::EFAULT, &p, &DeviceConfig::rxe(), &i.sys)[0].id,
            "readonly_mapping"
        );
        let p = Params {
            access: Some(AccessFlags::ON_DEMAND),
            ..Default::default()
        };
        let c = explain(
            Errno::EOPNOTSUPP,
            &p,
            &DeviceConfig::rxe().odp_caps(0),
            &i.sys,
        );
        assert_eq!((c[0].id, c[0].fit), ("odp_unsupported", Fit::Certain));
        let mut sys = i.sys.clone();
        sys.memlock_soft = Some(0);
        assert_eq!(
            explain(Errno::EPERM, &Params::default(), &DeviceConfig::rxe(), &sys)[0].fit,
            Fit::Certain
        );
    }

    /// A fake root: `files` written (parents created), `links` made (link, target).
    fn fake(files: &[(&str, &str)], links: &[(&str, &str)]) -> tempfile::TempDir {
        let t = tempfile::tempdir().unwrap();
        for (p, c) in files {
            let p = t.path().join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, c).unwrap();
        }
        for (l, target) in links {
            let l = t.path().join(l);
            std::fs::create_dir_all(l.parent().unwrap()).unwrap();
            std::fs::create_dir_all(t.path().join(target)).unwrap();
            std::os::unix::fs::symlink(t.path().join(target), l).unwrap();
        }
        t
    }

    const MLX5: &[(&str, &str)] = &[
        ("dev/infiniband/uverbs0", ""),
        ("sys/module/ib_uverbs/refcnt", "1\n"),
        ("sys/class/infiniband/mlx5_0/ports/1/state", "4: ACTIVE\n"),
        (
            "sys/class/infiniband/mlx5_0/ports/1/link_layer",
            "Ethernet\n",
        ),
        (
            "sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/0",
            "IB/RoCE v1\n",
        ),
        (
            "sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/1",
            "RoCE v2\n",
        ),
        (
            "sys/class/infiniband/mlx5_0/ports/1/gids/0",
            "fe80:0000:0000:0000:0202:c9ff:fe00:0001\n",
        ),
        (
            "sys/class/infiniband/mlx5_0/ports/1/gids/1",
            "0000:0000:0000:0000:0000:ffff:c000:0201\n",
        ),
    ];
    const MLX5_DRIVER: &[(&str, &str)] = &[(
        "sys/class/infiniband/mlx5_0/device/driver",
        "sys/bus/pci/drivers/mlx5_core",
    )];

    fn stack_status(files: &[(&str, &str)], links: &[(&str, &str)], id: &str) -> Vec<Status> {
        let t = fake(files, links);
        stack_checks(t.path(), "mlx5_0")
            .into_iter()
            .filter(|c| c.id == id)
            .map(|c| {
                if c.status != Status::Ok {
                    assert!(!c.fix.is_empty(), "{c:?} has no fix");
                }
                c.status
            })
            .collect()
    }

    fn with(
        extra: &[(&'static str, &'static str)],
        drop: &[&str],
    ) -> Vec<(&'static str, &'static str)> {
        let mut v: Vec<_> = MLX5
            .iter()
            .copied()
            .filter(|(p, _)| !drop.contains(p))
            .collect();
        v.extend_from_slice(extra);
        v
    }

    #[test]
    fn real_stack_table() {
        let ok = Status::Ok;
        let fail = Status::Fail;
        // (what, files, check id, expected statuses)
        type Files = Vec<(&'static str, &'static str)>;
        let cases: Vec<(&str, Files, &str, Vec<Status>)> = vec![
            ("healthy uverbs", with(&[], &[]), "uverbs", vec![ok]),
            ("no uverbs", with(&[], &["dev/infiniband/uverbs0"]), "uverbs", vec![fail]),
            ("healthy driver", with(&[], &[]), "driver", vec![ok]),
            ("ib_uverbs missing", with(&[], &["sys/module/ib_uverbs/refcnt"]), "driver", vec![fail]),
            (
                "ib_uverbs in /proc/modules",
                with(&[("proc/modules", "ib_uverbs 184320 2 rdma_ucm, Live 0x0\n")], &["sys/module/ib_uverbs/refcnt"]),
                "driver",
                vec![ok],
            ),
            ("port active", with(&[], &[]), "port", vec![ok]),
            (
                "port down",
                with(&[("sys/class/infiniband/mlx5_0/ports/1/state", "1: DOWN\n")], &["sys/class/infiniband/mlx5_0/ports/1/state"]),
                "port",
                vec![fail],
            ),
            ("roce v2 gid", with(&[], &[]), "roce_gid", vec![ok]),
            (
                "only RoCE v1",
                with(&[], &["sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/1"]),
                "roce_gid",
                vec![fail],
            ),
            (
                "RoCE v2 entry without an address",
                with(&[("sys/class/infiniband/mlx5_0/ports/1/gids/1", "0000:0000:0000:0000:0000:0000:0000:0000\n")], &["sys/class/infiniband/mlx5_0/ports/1/gids/1"]),
                "roce_gid",
                vec![fail],
            ),
            (
                "InfiniBand port",
                with(&[("sys/class/infiniband/mlx5_0/ports/1/link_layer", "InfiniBand\n")], &["sys/class/infiniband/mlx5_0/ports/1/link_layer", "sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/1"]),
                "roce_gid",
                vec![ok],
            ),
            ("no lsm", with(&[], &[]), "lsm", vec![ok]),
            (
                "selinux denial",
                with(&[("sys/fs/selinux/enforce", "1"), ("var/log/audit/audit.log", "type=AVC msg=audit(1.2:3): avc:  denied  { read write } for pid=7 comm=\"app\" name=\"uverbs0\" dev=\"devtmpfs\"\n")], &[]),
                "lsm",
                vec![fail],
            ),
            ("selinux, log unreadable", with(&[("sys/fs/selinux/enforce", "1")], &[]), "lsm", vec![Status::Warn]),
            ("apparmor confined", with(&[("proc/self/attr/current", "docker-default (enforce)\n")], &[]), "lsm", vec![Status::Warn]),
            ("apparmor unconfined", with(&[("proc/self/attr/current", "unconfined\n")], &[]), "lsm", vec![ok]),
        ];
        for (what, files, id, want) in cases {
            assert_eq!(stack_status(&files, MLX5_DRIVER, id), want, "{what}");
        }
        // No device at all: driver fails with its fix; the driver name comes from the link.
        assert_eq!(stack_status(&[], &[], "driver"), vec![fail]);
        let t = fake(MLX5, MLX5_DRIVER);
        assert_eq!(driver_of(t.path(), "mlx5_0").as_deref(), Some("mlx5_core"));
    }
}
