//! `--device NAME` for every verb: which device, opening it, and the exit status when that fails.

use mrkit::{Context, Errno};

use crate::exit;

/// The device opened when neither `--device` nor `MRKIT_DEVICE` names one.
const DEFAULT_DEVICE: &str = mrkit_soft::DEVICE_NAME;

/// The device a verb runs on: `--device`, else `$MRKIT_DEVICE`, else `mrkit0`.
#[derive(Debug, Clone)]
pub struct Selected {
    name: String,
}

impl Selected {
    /// From the `--device` flag (None: the environment or the default).
    pub fn new(flag: Option<String>) -> Selected {
        let name = flag
            .filter(|s| !s.is_empty())
            .or_else(|| {
                std::env::var(mrkit::DEVICE_ENV)
                    .ok()
                    .filter(|s| !s.is_empty())
            })
            .unwrap_or_else(|| DEFAULT_DEVICE.to_string());
        Selected { name }
    }

    /// The name as given (plain or `provider:name`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The provider part of a qualified name (`rdma-core` of `rdma-core:mlx5_0`).
    pub fn provider(&self) -> Option<&str> {
        self.name.split_once(':').map(|(p, _)| p)
    }

    /// The device part (`mlx5_0` of `rdma-core:mlx5_0`).
    pub fn device(&self) -> &str {
        self.name.split_once(':').map_or(&self.name, |(_, d)| d)
    }

    /// Whether this names the embedded `mrkit0` (plain `mrkit0` prefers it, `mrkit:mrkit0`),
    /// as [`Context::open_by_name`] resolves names.
    pub fn is_embedded(&self) -> bool {
        self.device() == mrkit_soft::DEVICE_NAME
            && self
                .provider()
                .is_none_or(|p| p == mrkit::EMBEDDED_PROVIDER)
    }

    /// Open it; on failure print `mrkit VERB: reason` and return the exit status: 2 for a
    /// malformed `MRKIT_*` environment of the embedded device, 1 for everything else (an
    /// unknown name, whose message lists the devices; rdma-core missing, with the reason).
    pub fn open(&self, verb: &str) -> Result<Context, u8> {
        match Context::open_by_name(&self.name) {
            Ok(c) => Ok(c),
            Err(e) => {
                eprintln!("mrkit {verb}: {e}");
                Err(if self.is_embedded() && e.errno() == Errno::EINVAL {
                    exit::USAGE
                } else {
                    exit::VERB_FAILED
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_split_and_embedded() {
        let s = Selected::new(Some("rdma-core:mlx5_0".into()));
        assert_eq!((s.provider(), s.device()), (Some("rdma-core"), "mlx5_0"));
        assert!(!s.is_embedded());
        assert!(Selected::new(Some("mrkit0".into())).is_embedded());
        assert!(Selected::new(Some("mrkit:mrkit0".into())).is_embedded());
        assert!(!Selected::new(Some("rdma-core:mrkit0".into())).is_embedded());
    }

    #[test]
    fn unknown_and_rdma_core_fail_with_exit_1() {
        assert_eq!(
            Selected::new(Some("mlx5_9".into())).open("t").unwrap_err(),
            exit::VERB_FAILED
        );
        assert_eq!(
            // Whether or not this machine has rdma-core (a missing library or no such device).
            Selected::new(Some("rdma-core:no-such-device".into()))
                .open("t")
                .unwrap_err(),
            exit::VERB_FAILED
        );
    }
}
