//! Access flags (`enum ibv_access_flags`), with the kernel's numeric values.
#![forbid(unsafe_code)]

bitflags::bitflags! {
    /// Memory access rights of an MR, a memory window or a QP (`IBV_ACCESS_*`).
    ///
    /// Local read is always implied. `REMOTE_WRITE` and `REMOTE_ATOMIC` require
    /// `LOCAL_WRITE` (checked at registration, EINVAL otherwise).
    ///
    /// ```
    /// use mrkit_soft::AccessFlags;
    /// let a = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    /// assert_eq!(a.bits(), 0x3);
    /// assert!(a.is_writable());
    /// assert!(!AccessFlags::REMOTE_READ.is_writable());
    /// ```
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct AccessFlags: u32 {
        /// The device may write local memory (receive buffers, READ destinations, atomic results).
        const LOCAL_WRITE = 0x1;
        /// A peer may RDMA WRITE (requires LOCAL_WRITE).
        const REMOTE_WRITE = 0x2;
        /// A peer may RDMA READ.
        const REMOTE_READ = 0x4;
        /// A peer may run atomics (requires LOCAL_WRITE).
        const REMOTE_ATOMIC = 0x8;
        /// Memory windows may be bound to this MR.
        const MW_BIND = 0x10;
        /// The MR's address space starts at 0.
        const ZERO_BASED = 0x20;
        /// On-demand paging: nothing is pinned up front.
        const ON_DEMAND = 0x40;
        /// Huge-page hint.
        const HUGETLB = 0x80;
        /// Global-visibility FLUSH target.
        const FLUSH_GLOBAL = 0x100;
        /// Persistence FLUSH target.
        const FLUSH_PERSISTENT = 0x200;
        /// PCIe relaxed ordering (first bit of the optional range; a device may ignore it).
        const RELAXED_ORDERING = 0x10_0000;
        // Every other bit is kept so that the validation can reject (or ignore) it.
        const _ = !0;
    }
}

impl AccessFlags {
    /// Bits 20..29: optional bits a device may silently ignore.
    pub const OPTIONAL_RANGE: u32 = 0x3ff0_0000;
    /// Kernel `IB_ACCESS_SUPPORTED`: bits 0..9 plus the optional range.
    pub const SUPPORTED: u32 = 0x3ff0_03ff;
    /// The bits that make an access "writable" for pinning (kernel `ib_access_writable`).
    pub const WRITABLE: AccessFlags = AccessFlags::LOCAL_WRITE
        .union(AccessFlags::REMOTE_WRITE)
        .union(AccessFlags::REMOTE_ATOMIC)
        .union(AccessFlags::MW_BIND);
    /// All remote rights.
    pub const REMOTE: AccessFlags = AccessFlags::REMOTE_WRITE
        .union(AccessFlags::REMOTE_READ)
        .union(AccessFlags::REMOTE_ATOMIC);

    /// True if pinning must be writable (LOCAL_WRITE, REMOTE_WRITE, REMOTE_ATOMIC or MW_BIND).
    pub fn is_writable(self) -> bool {
        self.intersects(Self::WRITABLE)
    }

    /// Parse a comma-separated list such as `local-write,remote-read`.
    ///
    /// ```
    /// use mrkit_soft::AccessFlags;
    /// let a = AccessFlags::parse_list("local-write,remote-write").unwrap();
    /// assert_eq!(a, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE);
    /// assert!(AccessFlags::parse_list("bogus").is_err());
    /// ```
    pub fn parse_list(list: &str) -> Result<AccessFlags, String> {
        let mut a = AccessFlags::empty();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let norm = item.to_ascii_lowercase().replace('_', "-");
            a |= match norm.as_str() {
                "local-write" => AccessFlags::LOCAL_WRITE,
                "remote-write" => AccessFlags::REMOTE_WRITE,
                "remote-read" => AccessFlags::REMOTE_READ,
                "remote-atomic" => AccessFlags::REMOTE_ATOMIC,
                "mw-bind" => AccessFlags::MW_BIND,
                "zero-based" => AccessFlags::ZERO_BASED,
                "on-demand" | "odp" => AccessFlags::ON_DEMAND,
                "hugetlb" => AccessFlags::HUGETLB,
                "flush-global" => AccessFlags::FLUSH_GLOBAL,
                "flush-persistent" => AccessFlags::FLUSH_PERSISTENT,
                "relaxed-ordering" => AccessFlags::RELAXED_ORDERING,
                "none" | "local-read" => AccessFlags::empty(),
                other => {
                    if let Some(hex) = other.strip_prefix("0x") {
                        AccessFlags::from_bits_retain(
                            u32::from_str_radix(hex, 16).map_err(|e| format!("{item}: {e}"))?,
                        )
                    } else {
                        return Err(format!(
                            "unknown access flag `{item}` (expected local-write, remote-write, \
                             remote-read, remote-atomic, mw-bind, zero-based, on-demand, hugetlb, \
                             flush-global, flush-persistent, relaxed-ordering or 0xHEX)"
                        ));
                    }
                }
            };
        }
        Ok(a)
    }

    /// Names of the set bits, e.g. `["LOCAL_WRITE", "REMOTE_READ"]`; unknown bits as hex.
    pub fn names(self) -> Vec<String> {
        let mut v: Vec<String> = self.iter_names().map(|(n, _)| n.to_string()).collect();
        let known = AccessFlags::all().bits() & 0x0010_03ff;
        let rest = self.bits() & !known;
        if rest != 0 {
            v.push(format!("{rest:#x}"));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_match_verbs_h() {
        let table = [
            (AccessFlags::LOCAL_WRITE, 0x1),
            (AccessFlags::REMOTE_WRITE, 0x2),
            (AccessFlags::REMOTE_READ, 0x4),
            (AccessFlags::REMOTE_ATOMIC, 0x8),
            (AccessFlags::MW_BIND, 0x10),
            (AccessFlags::ZERO_BASED, 0x20),
            (AccessFlags::ON_DEMAND, 0x40),
            (AccessFlags::HUGETLB, 0x80),
            (AccessFlags::FLUSH_GLOBAL, 0x100),
            (AccessFlags::FLUSH_PERSISTENT, 0x200),
            (AccessFlags::RELAXED_ORDERING, 0x100000),
        ];
        for (f, v) in table {
            assert_eq!(f.bits(), v, "{f:?}");
        }
    }

    #[test]
    fn writable_set() {
        assert!(AccessFlags::MW_BIND.is_writable());
        assert!(AccessFlags::REMOTE_ATOMIC.is_writable());
        assert!(!(AccessFlags::REMOTE_READ | AccessFlags::ON_DEMAND).is_writable());
    }
}
