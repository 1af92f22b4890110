//! On-demand paging primitives: fault pages in (as the HCA's page-fault handler does through
//! `hmm_range_fault`) and snapshot which pages are present.
//!
//! Faulting uses `madvise(MADV_POPULATE_WRITE / MADV_POPULATE_READ)` (Linux >= 5.14), which
//! faults exactly like a user access but reports failures as errors instead of SIGSEGV/SIGBUS.
//! Presence comes from `/proc/self/pagemap` (bit 63 present; a swapped page, bit 62, is not
//! present).

use crate::error::{err, Result};

/// Fault in `[start, start + len)` (any alignment), writable if `write`.
/// EFAULT if part of the range is unmapped, PROT_NONE, or read-only while `write` is requested.
pub fn fault_in(start: u64, len: u64, write: bool) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let (s, l) = super::page_span(start, len).ok_or_else(|| {
        err!(
            EINVAL,
            "fault range [{start:#x}, +{len:#x}) wraps the address space; pass a valid range"
        )
    })?;
    super::pin::populate(s, l, write)
}

/// Present bit of every base page of the page-aligned `[start, start + len)`.
pub fn present_pages(start: u64, len: u64) -> Result<Vec<bool>> {
    let ps = super::page_size() as u64;
    if start % ps != 0 || len % ps != 0 {
        return Err(err!(
            EINVAL,
            "present-page snapshot of [{start:#x}, +{len:#x}) is not page aligned; round it \
             with mem::page_span first"
        ));
    }
    start.checked_add(len).ok_or_else(|| {
        err!(
            EINVAL,
            "present-page snapshot of [{start:#x}, +{len:#x}) wraps the address space; pass a \
             valid range"
        )
    })?;
    let entries = super::translate::pagemap_entries(start, len / ps)?;
    Ok(entries
        .into_iter()
        .map(|e| e & super::translate::PM_PRESENT != 0 && e & super::translate::PM_SWAPPED == 0)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Errno;
    use crate::mem::test_util::Map;
    use rustix::mm::ProtFlags;

    #[test]
    fn present_before_and_after() {
        let m = Map::new(16 * 4096);
        assert_eq!(present_pages(m.addr, m.len).unwrap(), vec![false; 16]);
        // SAFETY: writing inside our own writable mapping.
        unsafe { std::ptr::write_volatile((m.addr + 3 * 4096) as *mut u8, 7) };
        let p = present_pages(m.addr, m.len).unwrap();
        assert_eq!(p.iter().filter(|&&x| x).count(), 1);
        assert!(p[3]);
        // Fault pages 8..12 in (unaligned start/len rounds outwards).
        fault_in(m.addr + 8 * 4096 + 100, 3 * 4096, true).unwrap();
        let p = present_pages(m.addr, m.len).unwrap();
        let idx: Vec<usize> = (0..16).filter(|&i| p[i]).collect();
        assert_eq!(idx, vec![3, 8, 9, 10, 11]);
        fault_in(m.addr, 0, true).unwrap();
        assert_eq!(
            present_pages(m.addr + 1, 4096).unwrap_err().errno(),
            Errno::EINVAL
        );
    }

    #[test]
    fn read_fault_on_read_only() {
        let m = Map::with_prot(8 * 4096, ProtFlags::READ);
        fault_in(m.addr, m.len, false).unwrap();
        let e = fault_in(m.addr, m.len, true).unwrap_err();
        assert_eq!(e.errno(), Errno::EFAULT);
        assert!(e.cause().contains("read-only"), "{e}");
    }

    #[test]
    fn unmapped_and_prot_none_are_efault() {
        // 8-40 KiB: no mapping is placed that low without MAP_FIXED (the kernel allocates
        // top-down from below the stack; below vm.mmap_min_addr, 64 KiB by default, not even
        // that). Unmapping a mapping of our own instead raced with the other test threads: an
        // mmap of theirs could take the freed range before the check (seen in CI).
        let addr = 0x2000;
        for write in [false, true] {
            let e = fault_in(addr, 8 * 4096, write).unwrap_err();
            assert_eq!(e.errno(), Errno::EFAULT, "{e}");
            assert!(e.cause().contains("not entirely mapped"), "{e}");
        }
        let n = Map::with_prot(4096, ProtFlags::empty());
        for write in [false, true] {
            assert_eq!(
                fault_in(n.addr, 10, write).unwrap_err().errno(),
                Errno::EFAULT
            );
        }
        assert_eq!(
            fault_in(u64::MAX - 10, 100, false).unwrap_err().errno(),
            Errno::EINVAL
        );
    }
}
