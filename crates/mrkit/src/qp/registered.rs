//! The one ownership story: what a work request may carry.
//!
//! Every kind of registered memory in this crate — a [`MemoryRegion`], a pool slot, a cache
//! handle, a bounce buffer, a list of several of them — implements [`Registered`]. A work
//! request posted through [`QueuePair`](crate::QueuePair) takes the value *by value* (an owned
//! buffer, or a borrow `&T` / `&mut T`), keeps it while the device may touch the memory, and
//! its completion hands it back. So the memory is owned or borrowed for as long as the device
//! can reach it, by construction.
//!
//! Which borrow a work request needs follows from what the device does with the memory:
//!
//! | work request | the device | needs |
//! |---|---|---|
//! | RDMA WRITE source, SEND | reads | [`Registered`] (an owned value, `&T` or `&mut T`) |
//! | RDMA READ destination, RECV, atomic result | writes | [`DeviceWritable`] (owned or `&mut T`) |
//!
//! The memory region's own rights are checked by the device, as on hardware: a READ into an
//! MR without `LOCAL_WRITE` completes with `LOC_PROT_ERR`, it is not refused by the type
//! system.
//!
//! Slicing is uniform: every kind has `local(range: Range<u64>) -> Result<LocalSlice>` and,
//! where it has remote rights, `remote(range: Range<u64>) -> Result<RemoteSlice>`, with offsets
//! relative to the kind's first byte and `EINVAL` for a range outside it.

use std::ops::Range;

use crate::verbs::{LocalSlice, MemoryRegion, RawMemoryRegion};
use crate::{Errno, Error, Result};

/// Registered memory that a work request may carry.
///
/// ```
/// use mrkit::{AccessFlags as A, Buffer, Context, Registered};
/// let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
/// let a = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
/// let b = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
/// let list = vec![&a, &b];
/// let mut sges = Vec::new();
/// list.sges(4000..4196, &mut sges).unwrap(); // crosses from `a` into `b`
/// assert_eq!(sges.len(), 2);
/// assert_eq!((sges[0].len, sges[1].len), (96, 100));
/// assert!(list.sges(0..8193, &mut sges).is_err());
/// ```
///
/// # Safety
///
/// An implementation promises that for as long as the value lives:
/// * every [`LocalSlice`] that [`Registered::sges`] appends lies inside a live registration
///   and carries that registration's lkey;
/// * the memory those slices describe stays mapped and is owned, or borrowed, by the value, so
///   that safe code cannot free or reuse it while a work request holds the value;
/// * for [`DeviceWritable`] implementations, no other reference to those bytes exists while
///   the work request holds the value (the device may write them).
pub unsafe trait Registered: Send {
    /// Length in bytes (offsets in [`Registered::sges`] run from 0 to this).
    fn len(&self) -> u64;

    /// Whether the memory is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Append the scatter/gather elements covering `range` (offsets into this memory) to
    /// `out`: one element for contiguous memory under one key, several where the memory spans
    /// registrations (a cache handle over several MRs, a list of pieces). `EINVAL` when the
    /// range is reversed or runs past [`Registered::len`]; `out` is then unchanged.
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()>;
}

/// Registered memory the device may write into (RDMA READ destination, receive buffer, atomic
/// result): owned values and exclusive borrows, never a shared borrow.
///
/// # Safety
///
/// As [`Registered`], and no other reference to the memory exists while a work request holds
/// the value.
pub unsafe trait DeviceWritable: Registered {}

/// The `EINVAL` every kind gives for a range outside it.
pub(crate) fn range_error(range: &Range<u64>, len: u64, what: &str) -> Error {
    Error::new(
        Errno::EINVAL,
        format!(
            "range {}..{} is outside the {what} (length {len})",
            range.start, range.end
        ),
    )
}

/// Check `range` against `len`; the sub-range as (start, length) when inside.
pub(crate) fn check_range(range: &Range<u64>, len: u64, what: &str) -> Result<(u64, u64)> {
    if range.start > range.end || range.end > len {
        return Err(range_error(range, len, what));
    }
    Ok((range.start, range.end - range.start))
}

// SAFETY: the MR owns its buffer (freed only after deregistration), and `local` returns slices
// inside the registration with its lkey.
unsafe impl Registered for MemoryRegion {
    fn len(&self) -> u64 {
        self.info().length
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        out.push(self.local(range)?);
        Ok(())
    }
}
// SAFETY: owned: nothing else references the buffer while the WR holds the MR.
unsafe impl DeviceWritable for MemoryRegion {}

// SAFETY: `register_raw`'s contract makes the caller keep the memory valid while the MR lives.
unsafe impl Registered for RawMemoryRegion {
    fn len(&self) -> u64 {
        self.info().length
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        out.push(self.local(range)?);
        Ok(())
    }
}
// SAFETY: `register_raw`'s contract covers device writes for the MR's whole life.
unsafe impl DeviceWritable for RawMemoryRegion {}

// SAFETY: a shared borrow keeps the memory alive for the WR; the device only reads through it
// (no `DeviceWritable` for `&T`).
unsafe impl<T: Registered + Sync> Registered for &T {
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        (**self).sges(range, out)
    }
}

// SAFETY: an exclusive borrow keeps the memory alive and unaliased for the WR.
unsafe impl<T: Registered> Registered for &mut T {
    fn len(&self) -> u64 {
        (**self).len()
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        (**self).sges(range, out)
    }
}
// SAFETY: as above; the borrow is exclusive.
unsafe impl<T: DeviceWritable> DeviceWritable for &mut T {}

// SAFETY: a list of pieces is their concatenation; each piece upholds the contract itself.
unsafe impl<T: Registered> Registered for Vec<T> {
    fn len(&self) -> u64 {
        self.iter().map(|p| p.len()).sum()
    }
    fn sges(&self, range: Range<u64>, out: &mut Vec<LocalSlice>) -> Result<()> {
        let total = Registered::len(self);
        check_range(&range, total, "scatter/gather list")?;
        let mark = out.len();
        let mut base = 0u64;
        for piece in self {
            let len = piece.len();
            let (start, end) = (range.start.max(base), range.end.min(base + len));
            if start < end {
                if let Err(e) = piece.sges(start - base..end - base, out) {
                    out.truncate(mark);
                    return Err(e);
                }
            }
            base += len;
        }
        Ok(())
    }
}
// SAFETY: every piece is device-writable, and the list owns them.
unsafe impl<T: DeviceWritable> DeviceWritable for Vec<T> {}
