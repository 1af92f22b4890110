//! Live statistics for `mrkit stat`: re-exports the device's exporter
//! ([`mrkit_soft::stat_export`]), so programs on this crate, on the drop-in `libibverbs.so.1`
//! and the CLI's own verbs all export through one mechanism. See that module for the design,
//! the directory and permission rules and the file format.
//!
//! ```
//! mrkit::stat_export::register_source("example", || serde_json::json!({"hits": 1}));
//! let snap = mrkit::stat_export::snapshot();
//! assert_eq!(snap["sources"]["example"]["hits"], 1);
//! ```
#![forbid(unsafe_code)]

pub use mrkit_soft::stat_export::*;
