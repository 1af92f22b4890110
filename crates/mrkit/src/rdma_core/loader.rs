//! Loading the system's `libibverbs.so.1` at run time and resolving the verbs the provider
//! calls. The function types are the C prototypes of rdma-core v44's `<infiniband/verbs.h>`
//! over the shared ABI definitions ([`mrkit_verbs_abi`]).
//!
//! A loaded library is never unloaded: the objects it hands out (and, for the drop-in, the
//! device threads it runs) must outlive every provider, so each library is leaked once per
//! path and process.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::Mutex;

use mrkit_soft::{Errno, Error, Result};
use mrkit_verbs_abi::*;

/// Environment variable naming the rdma-core library to load (a path); default
/// `libibverbs.so.1` from the dynamic loader's search path.
pub const LIB_ENV: &str = "MRKIT_RDMA_CORE_LIB";

/// The library file opened when [`LIB_ENV`] is not set.
pub const DEFAULT_LIB: &str = "libibverbs.so.1";

macro_rules! verbs {
    ($( $field:ident : fn($($arg:ty),*) -> $ret:ty ;)*) => {
        /// The exported verbs, resolved once at load.
        #[allow(missing_docs)]
        #[derive(Clone, Copy)]
        pub(crate) struct Verbs {
            $(pub $field: unsafe extern "C" fn($($arg),*) -> $ret,)*
        }

        impl Verbs {
            fn resolve(lib: &libloading::Library) -> std::result::Result<Verbs, String> {
                Ok(Verbs {
                    $($field: {
                        let name = concat!(stringify!($field), "\0");
                        let sym: libloading::Symbol<unsafe extern "C" fn($($arg),*) -> $ret> =
                            // SAFETY: the type is the v44 prototype of the symbol of that
                            // name; the pointer is copied out and stays valid because the
                            // library is never unloaded (it is leaked in `load`).
                            unsafe { lib.get(name.as_bytes()) }
                                .map_err(|e| format!("symbol {}: {e}", stringify!($field)))?;
                        *sym
                    },)*
                })
            }
        }
    };
}

verbs! {
    ibv_get_device_list: fn(*mut c_int) -> *mut *mut ibv_device;
    ibv_free_device_list: fn(*mut *mut ibv_device) -> ();
    ibv_get_device_name: fn(*mut ibv_device) -> *const c_char;
    ibv_get_device_guid: fn(*mut ibv_device) -> u64;
    ibv_open_device: fn(*mut ibv_device) -> *mut ibv_context;
    ibv_close_device: fn(*mut ibv_context) -> c_int;
    ibv_query_device: fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
    ibv_query_port: fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
    ibv_query_gid: fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
    ibv_alloc_pd: fn(*mut ibv_context) -> *mut ibv_pd;
    ibv_dealloc_pd: fn(*mut ibv_pd) -> c_int;
    ibv_reg_mr_iova2: fn(*mut ibv_pd, *mut c_void, usize, u64, u32) -> *mut ibv_mr;
    ibv_dereg_mr: fn(*mut ibv_mr) -> c_int;
    ibv_rereg_mr: fn(*mut ibv_mr, c_int, *mut ibv_pd, *mut c_void, usize, c_int) -> c_int;
    ibv_create_comp_channel: fn(*mut ibv_context) -> *mut ibv_comp_channel;
    ibv_destroy_comp_channel: fn(*mut ibv_comp_channel) -> c_int;
    ibv_create_cq: fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
    ibv_destroy_cq: fn(*mut ibv_cq) -> c_int;
    ibv_get_cq_event: fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
    ibv_ack_cq_events: fn(*mut ibv_cq, u32) -> ();
    ibv_create_qp: fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    ibv_modify_qp: fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    ibv_query_qp: fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int;
    ibv_destroy_qp: fn(*mut ibv_qp) -> c_int;
}

/// A loaded rdma-core library (`libibverbs.so.1`).
pub struct Library {
    /// What was opened (path or soname).
    pub(crate) path: String,
    pub(crate) verbs: Verbs,
    _lib: libloading::Library,
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library").field("path", &self.path).finish()
    }
}

impl Library {
    /// What was opened (the path, or the soname the dynamic loader searched for).
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// The library [`LIB_ENV`] names, else [`DEFAULT_LIB`].
pub fn configured_path() -> String {
    std::env::var(LIB_ENV)
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| DEFAULT_LIB.to_string())
}

/// The error every entry point of the provider gives when rdma-core cannot be loaded.
pub(crate) fn unavailable(path: &str, why: &str) -> Error {
    Error::new(
        Errno::ENODEV,
        format!(
            "rdma-core is not available: cannot load {path} ({why}); install rdma-core \
             (libibverbs1) or point {LIB_ENV} at a libibverbs.so.1. The embedded mrkit0 works \
             without it"
        ),
    )
}

/// Load (once per path and process) the library at `path`.
pub(crate) fn load(path: &str) -> Result<&'static Library> {
    static LOADED: Mutex<Option<HashMap<String, std::result::Result<&'static Library, String>>>> =
        Mutex::new(None);
    let mut g = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    let map = g.get_or_insert_with(HashMap::new);
    if let Some(r) = map.get(path) {
        return r.clone().map_err(|why| unavailable(path, &why));
    }
    let r = open(path);
    map.insert(path.to_string(), r.clone());
    r.map_err(|why| unavailable(path, &why))
}

fn open(path: &str) -> std::result::Result<&'static Library, String> {
    // RTLD_NOW: a library that lacks a symbol it needs fails here, not at the first call.
    // RTLD_LOCAL: its symbols do not take part in the resolution of later libraries (the
    // drop-in's internal copy of the device stays its own).
    // SAFETY: loading runs the library's initialisers. rdma-core's (and the drop-in's) do
    // not depend on anything this process must set up first.
    let lib = unsafe {
        libloading::os::unix::Library::open(Some(path), libc::RTLD_NOW | libc::RTLD_LOCAL)
    }
    .map_err(|e| e.to_string())?;
    let lib = libloading::Library::from(lib);
    let verbs = Verbs::resolve(&lib)?;
    Ok(Box::leak(Box::new(Library {
        path: path.to_string(),
        verbs,
        _lib: lib,
    })))
}
