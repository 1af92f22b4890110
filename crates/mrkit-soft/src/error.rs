//! Typed errors: every failure carries the errno a real verbs stack would report and a sentence
//! that names the cause and the fix.
#![forbid(unsafe_code)]

use std::fmt;

/// The errno values the verbs API reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Errno {
    /// Operation not permitted (1).
    EPERM,
    /// No such file or directory (2).
    ENOENT,
    /// Try again (11).
    EAGAIN,
    /// Out of memory / resource limit (12).
    ENOMEM,
    /// Permission denied (13).
    EACCES,
    /// Bad address (14).
    EFAULT,
    /// Device or resource busy (16).
    EBUSY,
    /// Invalid argument (22).
    EINVAL,
    /// Value too large (75).
    EOVERFLOW,
    /// Operation not supported (95).
    EOPNOTSUPP,
    /// Connection timed out (110).
    ETIMEDOUT,
    /// Address not available (99).
    EADDRNOTAVAIL,
    /// I/O error (5): a device failure an rdma-core provider reports.
    EIO,
    /// No such device (19): a device name that matches nothing, or rdma-core not loadable.
    ENODEV,
}

impl Errno {
    /// Linux numeric value.
    ///
    /// ```
    /// assert_eq!(mrkit_soft::Errno::EINVAL.raw(), 22);
    /// ```
    pub const fn raw(self) -> i32 {
        match self {
            Errno::EPERM => 1,
            Errno::ENOENT => 2,
            Errno::EAGAIN => 11,
            Errno::ENOMEM => 12,
            Errno::EACCES => 13,
            Errno::EFAULT => 14,
            Errno::EBUSY => 16,
            Errno::EINVAL => 22,
            Errno::EOVERFLOW => 75,
            Errno::EOPNOTSUPP => 95,
            Errno::ETIMEDOUT => 110,
            Errno::EADDRNOTAVAIL => 99,
            Errno::EIO => 5,
            Errno::ENODEV => 19,
        }
    }

    /// Symbolic name, e.g. `"EINVAL"`.
    ///
    /// ```
    /// assert_eq!(mrkit_soft::Errno::ENOMEM.name(), "ENOMEM");
    /// ```
    pub const fn name(self) -> &'static str {
        match self {
            Errno::EPERM => "EPERM",
            Errno::ENOENT => "ENOENT",
            Errno::EAGAIN => "EAGAIN",
            Errno::ENOMEM => "ENOMEM",
            Errno::EACCES => "EACCES",
            Errno::EFAULT => "EFAULT",
            Errno::EBUSY => "EBUSY",
            Errno::EINVAL => "EINVAL",
            Errno::EOVERFLOW => "EOVERFLOW",
            Errno::EOPNOTSUPP => "EOPNOTSUPP",
            Errno::ETIMEDOUT => "ETIMEDOUT",
            Errno::EADDRNOTAVAIL => "EADDRNOTAVAIL",
            Errno::EIO => "EIO",
            Errno::ENODEV => "ENODEV",
        }
    }

    /// Parse a name (`"EINVAL"`) or a number (`"22"`).
    ///
    /// ```
    /// use mrkit_soft::Errno;
    /// assert_eq!(Errno::parse("efault"), Some(Errno::EFAULT));
    /// assert_eq!(Errno::parse("12"), Some(Errno::ENOMEM));
    /// ```
    pub fn parse(s: &str) -> Option<Errno> {
        const ALL: [Errno; 12] = [
            Errno::EPERM,
            Errno::ENOENT,
            Errno::EAGAIN,
            Errno::ENOMEM,
            Errno::EACCES,
            Errno::EFAULT,
            Errno::EBUSY,
            Errno::EINVAL,
            Errno::EOVERFLOW,
            Errno::EOPNOTSUPP,
            Errno::ETIMEDOUT,
            Errno::EADDRNOTAVAIL,
        ];
        let s = s.trim();
        if let Ok(n) = s.parse::<i32>() {
            return ALL.into_iter().find(|e| e.raw() == n);
        }
        ALL.into_iter().find(|e| e.name().eq_ignore_ascii_case(s))
    }

    /// Map a raw OS errno to the closest verbs errno (unknown values become EFAULT for pin
    /// failures, which is what GUP reports for most refusals).
    pub fn from_raw_os(raw: i32) -> Errno {
        match raw {
            1 => Errno::EPERM,
            2 => Errno::ENOENT,
            11 => Errno::EAGAIN,
            12 => Errno::ENOMEM,
            13 => Errno::EACCES,
            16 => Errno::EBUSY,
            22 => Errno::EINVAL,
            75 => Errno::EOVERFLOW,
            95 => Errno::EOPNOTSUPP,
            110 => Errno::ETIMEDOUT,
            99 => Errno::EADDRNOTAVAIL,
            _ => Errno::EFAULT,
        }
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed verb: the errno plus a sentence naming the cause and the fix.
///
/// `Display` prints `ERRNO: sentence`, e.g.
/// `EINVAL: REMOTE_WRITE requires LOCAL_WRITE; add AccessFlags::LOCAL_WRITE`.
///
/// ```
/// use mrkit_soft::{Error, Errno};
/// let e = Error::new(Errno::EBUSY, "the PD still has 2 MRs; deregister them first");
/// assert_eq!(e.errno(), Errno::EBUSY);
/// assert!(e.to_string().starts_with("EBUSY: "));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{errno}: {cause}")]
pub struct Error {
    errno: Errno,
    cause: std::borrow::Cow<'static, str>,
}

impl Error {
    /// Build an error from an errno and a cause sentence.
    pub fn new(errno: Errno, cause: impl Into<std::borrow::Cow<'static, str>>) -> Error {
        Error {
            errno,
            cause: cause.into(),
        }
    }

    /// The errno a real verbs stack reports for this failure.
    pub fn errno(&self) -> Errno {
        self.errno
    }

    /// The sentence naming the cause and the fix.
    pub fn cause(&self) -> &str {
        &self.cause
    }
}

/// Result alias for the device.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Shorthand used inside the crate: `err!(EINVAL, "...")`.
macro_rules! err {
    ($errno:ident, $($arg:tt)+) => {
        $crate::error::Error::new($crate::error::Errno::$errno, format!($($arg)+))
    };
}
pub(crate) use err;
