//! 24-bit PSN arithmetic (docs/roce.md §3.1).

use core::cmp::Ordering;

use super::PSN_MASK;

/// `psn + n` modulo 2^24.
///
/// ```
/// use mrkit_soft::wire::psn_add;
/// assert_eq!(psn_add(0xFF_FFFF, 1), 0);
/// assert_eq!(psn_add(5, 3), 8);
/// ```
pub const fn psn_add(psn: u32, n: u32) -> u32 {
    psn.wrapping_add(n) & PSN_MASK
}

/// `psn - n` modulo 2^24.
pub const fn psn_sub(psn: u32, n: u32) -> u32 {
    psn.wrapping_sub(n) & PSN_MASK
}

/// Signed 24-bit distance `a - b`, in `-2^23 ..= 2^23 - 1` (positive when `a` is after `b`).
///
/// This is rxe's `(int32)((a - b) << 8)` scaled back to PSN units.
///
/// ```
/// use mrkit_soft::wire::psn_diff;
/// assert_eq!(psn_diff(2, 0xFF_FFFE), 4);
/// assert_eq!(psn_diff(0xFF_FFFE, 2), -4);
/// ```
pub const fn psn_diff(a: u32, b: u32) -> i32 {
    ((a.wrapping_sub(b) << 8) as i32) >> 8
}

/// Orders two PSNs within a half window of 2^23.
///
/// ```
/// use mrkit_soft::wire::psn_cmp;
/// use std::cmp::Ordering;
/// assert_eq!(psn_cmp(0, 0xFF_FFFF), Ordering::Greater);
/// ```
pub const fn psn_cmp(a: u32, b: u32) -> Ordering {
    let d = psn_diff(a, b);
    if d < 0 {
        Ordering::Less
    } else if d > 0 {
        Ordering::Greater
    } else {
        Ordering::Equal
    }
}
