//! The live MRs of this process, for `mrkit stat --mrs` (like `rdma resource show mr`).
//!
//! The device keeps a weak reference to each device instance the process opens; a snapshot
//! walks their MR tables (no per-registration cost).
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use crate::{DeviceInner, MrInfo};

fn devices() -> &'static Mutex<Vec<Weak<DeviceInner>>> {
    static D: OnceLock<Mutex<Vec<Weak<DeviceInner>>>> = OnceLock::new();
    D.get_or_init(|| Mutex::new(Vec::new()))
}

/// Remember an opened device instance (dropped ones are forgotten here).
pub(crate) fn track(dev: &Arc<DeviceInner>) {
    let mut d = devices().lock().unwrap_or_else(|e| e.into_inner());
    d.retain(|w| w.strong_count() > 0);
    d.push(Arc::downgrade(dev));
}

/// One live MR.
#[derive(Debug, Clone)]
pub struct LiveMr {
    /// Device instance (node id) it is registered on.
    pub instance: u64,
    /// What `query_mr` reports (with its registration timing).
    pub info: MrInfo,
    /// Time since it was registered.
    pub age: Duration,
}

/// Up to `limit` live MRs of every open device instance of this process (by instance, then
/// key), and how many there are in all.
pub fn live(limit: usize) -> (Vec<LiveMr>, usize) {
    let devs: Vec<Arc<DeviceInner>> = devices()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    let mut out = Vec::new();
    let mut total = 0;
    for dev in devs {
        let mut keys = dev.core.mrs.keys();
        keys.sort_unstable();
        for k in keys {
            let Some(g) = dev.core.mrs.get(k) else {
                continue;
            };
            total += 1;
            if out.len() < limit {
                out.push(LiveMr {
                    instance: dev.dp.node_id,
                    info: crate::mr::info_of(k, &g),
                    age: g.shared.created.elapsed(),
                });
            }
        }
    }
    (out, total)
}
