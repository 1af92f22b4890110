//! Safe handles: context, protection domain, memory regions and windows.

use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::Arc;

use mrkit_soft::mr::ReregFlags;
use mrkit_soft::{
    AccessFlags, DeviceAttr, DeviceConfig, Errno, Error, MrInfo, MwType, Result, UserMemory,
};

use crate::buffer::Buffer;
use crate::provider::Provider;

/// Start the statistics exporter once per process (after the first try, a relaxed load).
/// Not in this crate's own unit tests, which install exporters with their own options.
fn auto_export() {
    #[cfg(not(test))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            if let Err(e) = crate::stat_export::install() {
                tracing::debug!(error = %e, "statistics export not started");
            }
        });
    }
}

/// The provider name of the embedded device in qualified names (`mrkit:mrkit0`).
pub const EMBEDDED_PROVIDER: &str = "mrkit";

/// Environment variable naming the device [`Context::open_default`] opens (a name as
/// [`Context::open_by_name`] takes it).
pub const DEVICE_ENV: &str = "MRKIT_DEVICE";

/// A device [`Context::devices`] lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceEntry {
    /// Device name (`mrkit0`, `mlx5_0`).
    pub name: String,
    /// Provider: `"mrkit"` (the embedded device) or `"rdma-core"`.
    pub provider: String,
    /// Node GUID (host order), where known.
    pub node_guid: Option<u64>,
    /// Transport, where known (`InfiniBand`, `iWARP`, ...; RoCE devices report InfiniBand).
    pub transport: Option<String>,
}

impl DeviceEntry {
    /// `provider:name`, which [`Context::open_by_name`] opens exactly.
    ///
    /// ```
    /// let d = &mrkit::Context::devices().unwrap()[0];
    /// assert_eq!(d.qualified(), format!("{}:{}", d.provider, d.name));
    /// ```
    pub fn qualified(&self) -> String {
        format!("{}:{}", self.provider, self.name)
    }
}

fn transport_name(t: i32) -> &'static str {
    match t {
        0 => "InfiniBand",
        1 => "iWARP",
        2 => "usNIC",
        3 => "usNIC UDP",
        4 => "unspecified",
        _ => "unknown",
    }
}

/// ENODEV for `name`, listing the devices there are.
fn no_such_device(name: &str) -> Error {
    let list = Context::devices()
        .map(|d| {
            d.iter()
                .map(DeviceEntry::qualified)
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_else(|e| format!("(cannot list: {e})"));
    Error::new(
        Errno::ENODEV,
        format!("no device {name:?}; the devices there are: {list}"),
    )
}

/// An opened device (`ibv_context`).
///
/// ```
/// let ctx = mrkit::Context::open_default().unwrap();
/// assert_eq!(ctx.name(), "mrkit0");
/// assert!(ctx.query_device().max_mr > 0);
/// ```
#[derive(Debug, Clone)]
pub struct Context {
    provider: Arc<dyn Provider>,
}

impl Context {
    /// Open the embedded `mrkit0` with explicit limits.
    ///
    /// The first open of a process also starts the statistics exporter read by `mrkit stat`
    /// ([`crate::stat_export::install`]; `MRKIT_STAT=0` disables it). Its idle cost is one
    /// `stat()` of a request file per second on a background thread.
    ///
    /// ```
    /// let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe().max_mr(100));
    /// assert_eq!(ctx.query_device().max_mr, 100);
    /// ```
    pub fn open(config: DeviceConfig) -> Context {
        auto_export();
        Context {
            provider: Arc::new(mrkit_soft::Context::open(config)),
        }
    }

    /// Open the default device: the one `MRKIT_DEVICE` names ([`Context::open_by_name`]),
    /// else `mrkit0` with the default limits overlaid by `MRKIT_*` environment variables.
    /// Opening `mrkit0` starts the statistics exporter as [`Context::open`] does.
    ///
    /// ```
    /// let ctx = mrkit::Context::open_default().unwrap(); // MRKIT_MAX_MR=... etc. apply
    /// assert_eq!(ctx.name(), "mrkit0");
    /// ```
    pub fn open_default() -> Result<Context> {
        match std::env::var(DEVICE_ENV) {
            Ok(name) if !name.trim().is_empty() => Context::open_by_name(name.trim()),
            _ => Context::open_embedded(),
        }
    }

    fn open_embedded() -> Result<Context> {
        auto_export();
        Ok(Context {
            provider: Arc::new(mrkit_soft::Context::open_from_env()?),
        })
    }

    /// Every device this process can open: the embedded `mrkit0` first, then each device of
    /// the system's rdma-core (`libibverbs.so.1`, or the library `MRKIT_RDMA_CORE_LIB`
    /// names). Without rdma-core, or when it cannot list its devices, the list has `mrkit0`
    /// only (why is logged at debug level; opening an rdma-core device then gives the
    /// reason). A kernel without RDMA support is an empty rdma-core list.
    ///
    /// ```
    /// let devs = mrkit::Context::devices().unwrap();
    /// assert_eq!(devs[0].qualified(), "mrkit:mrkit0");
    /// ```
    pub fn devices() -> Result<Vec<DeviceEntry>> {
        let embedded = DeviceConfig::rxe().attr().clone();
        let mut out = vec![DeviceEntry {
            name: mrkit_soft::DEVICE_NAME.to_string(),
            provider: EMBEDDED_PROVIDER.to_string(),
            node_guid: Some(embedded.node_guid),
            transport: Some("InfiniBand (RoCEv2 over UDP)".to_string()),
        }];
        match crate::rdma_core::library().and_then(crate::rdma_core::devices) {
            Ok(list) => out.extend(list.into_iter().map(|d| DeviceEntry {
                name: d.name,
                provider: crate::rdma_core::PROVIDER.to_string(),
                node_guid: Some(d.node_guid),
                transport: Some(transport_name(d.transport_type).to_string()),
            })),
            Err(e) => tracing::debug!(error = %e, "no rdma-core devices"),
        }
        Ok(out)
    }

    /// Open a device by name: `mrkit0` (the embedded device, with the `MRKIT_*` limits of
    /// [`Context::open_default`]), an rdma-core device's name (`mlx5_0`), or a name qualified
    /// by its provider (`mrkit:mrkit0`, `rdma-core:mrkit0`) when two providers offer the same
    /// name: a plain name offered by both means the embedded device. ENODEV, listing the
    /// devices there are, for a name that matches nothing; ENODEV saying why when rdma-core
    /// cannot be loaded for a name that must come from it.
    ///
    /// ```
    /// let ctx = mrkit::Context::open_by_name("mrkit:mrkit0").unwrap();
    /// assert_eq!(ctx.name(), "mrkit0");
    /// let err = mrkit::Context::open_by_name("no-such-device").unwrap_err();
    /// assert_eq!(err.errno(), mrkit::Errno::ENODEV);
    /// assert!(err.to_string().contains("mrkit:mrkit0"));
    /// ```
    pub fn open_by_name(name: &str) -> Result<Context> {
        let (provider, plain) = match name.split_once(':') {
            Some((p, n)) => (Some(p), n),
            None => (None, name),
        };
        match provider {
            Some(EMBEDDED_PROVIDER) | None if plain == mrkit_soft::DEVICE_NAME => {
                return Context::open_embedded()
            }
            Some(EMBEDDED_PROVIDER) => return Err(no_such_device(name)),
            Some(crate::rdma_core::PROVIDER) | None => {}
            Some(other) => {
                return Err(Error::new(
                    Errno::ENODEV,
                    format!(
                    "unknown provider {other:?} in {name:?} (providers: {EMBEDDED_PROVIDER}, {})",
                    crate::rdma_core::PROVIDER
                ),
                ))
            }
        }
        let lib = match crate::rdma_core::library() {
            Ok(lib) => lib,
            Err(e) if provider.is_some() => return Err(e),
            Err(_) => return Err(no_such_device(name)),
        };
        let names = crate::rdma_core::devices(lib)?;
        if !names.iter().any(|d| d.name == plain) {
            return Err(no_such_device(name));
        }
        let p = crate::rdma_core::RdmaCoreProvider::open(lib, plain)?;
        Ok(Context::from_provider(Arc::new(p)))
    }

    /// Wrap any provider.
    ///
    /// ```
    /// use std::sync::Arc;
    /// let dev: Arc<dyn mrkit::Provider> = Arc::new(mrkit_soft::Context::open(mrkit::DeviceConfig::rxe()));
    /// let ctx = mrkit::Context::from_provider(dev);
    /// assert_eq!(ctx.name(), "mrkit0");
    /// ```
    pub fn from_provider(provider: Arc<dyn Provider>) -> Context {
        Context { provider }
    }

    /// Device name.
    ///
    /// ```
    /// assert_eq!(mrkit::Context::open(mrkit::DeviceConfig::rxe()).name(), "mrkit0");
    /// ```
    pub fn name(&self) -> &str {
        self.provider.name()
    }

    /// `ibv_query_device`.
    ///
    /// ```
    /// let attr = mrkit::Context::open(mrkit::DeviceConfig::rxe()).query_device();
    /// assert!(attr.max_qp > 0 && attr.max_mr_size > 0);
    /// ```
    pub fn query_device(&self) -> DeviceAttr {
        self.provider.query_device()
    }

    /// `ibv_query_port`: the attributes of port `port` (numbered from 1); EINVAL for a port
    /// the device does not have, EOPNOTSUPP from a provider without the verb.
    ///
    /// ```
    /// let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// assert_eq!(ctx.query_port(1).unwrap().state, 4); // IBV_PORT_ACTIVE
    /// ```
    pub fn query_port(&self, port: u8) -> Result<crate::provider::PortAttr> {
        self.provider.query_port(port)
    }

    /// The provider (for services that need raw handles).
    ///
    /// ```
    /// let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// let pd = ctx.provider().alloc_pd().unwrap(); // a raw handle: yours to free
    /// ctx.provider().dealloc_pd(pd).unwrap();
    /// ```
    pub fn provider(&self) -> &Arc<dyn Provider> {
        &self.provider
    }

    /// The embedded software device, if this context is one.
    ///
    /// ```
    /// let ctx = mrkit::Context::open(mrkit::DeviceConfig::rxe());
    /// assert!(ctx.soft().is_some());
    /// ```
    pub fn soft(&self) -> Option<&mrkit_soft::Context> {
        self.provider.soft()
    }

    /// `ibv_alloc_pd`.
    ///
    /// ```
    /// let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// assert!(pd.handle() > 0);
    /// ```
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let handle = self.provider.alloc_pd()?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                ctx: self.clone(),
                handle,
            }),
        })
    }
}

#[derive(Debug)]
struct PdInner {
    ctx: Context,
    handle: u32,
}

impl Drop for PdInner {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.provider.dealloc_pd(self.handle) {
            tracing::warn!(error = %e, "dealloc_pd failed in drop");
        }
    }
}

/// A protection domain. MRs and windows keep it alive, so it is deallocated after the last of
/// them (the EBUSY of `ibv_dealloc_pd` cannot happen through this type).
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    inner: Arc<PdInner>,
}

impl ProtectionDomain {
    /// PD handle.
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let _handle: u32 = pd.handle();
    /// ```
    pub fn handle(&self) -> u32 {
        self.inner.handle
    }

    /// The context.
    ///
    /// ```
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// assert_eq!(pd.context().name(), "mrkit0");
    /// ```
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// Register a buffer this MR then owns. The MR's iova is the buffer's address.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mut mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// mr.as_mut_slice()[0] = 1;
    /// assert_eq!(mr.info().length, 4096);
    /// ```
    pub fn register(&self, buf: Buffer, access: AccessFlags) -> Result<MemoryRegion> {
        let iova = buf.addr();
        self.register_iova(buf, iova, access)
    }

    /// Register a buffer with an explicit iova (`ibv_reg_mr_iova`).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mr = pd.register_iova(Buffer::new(4096).unwrap(), 0x1000, A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// assert_eq!(mr.remote(0..16).unwrap().addr, 0x1000);
    /// ```
    pub fn register_iova(
        &self,
        buf: Buffer,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        // SAFETY: the returned `MemoryRegion` owns `buf` and frees it only once the MR is
        // deregistered (see its `Drop`: a registration that cannot be removed leaks the
        // buffer instead).
        let mem = unsafe { UserMemory::new(buf.addr(), buf.len() as u64) };
        let info = self
            .inner
            .ctx
            .provider
            .reg_mr(self.inner.handle, mem, iova, access)?;
        Ok(MemoryRegion {
            raw: RawMemoryRegion {
                pd: self.clone(),
                info,
                live: true,
            },
            buf: ManuallyDrop::new(buf),
        })
    }

    /// Register memory this crate does not own.
    ///
    /// # Safety
    /// `[addr, addr+len)` must stay mapped, and must not be freed or reused for anything the
    /// device may corrupt, until the returned region is dropped (deregistered) and every work
    /// request using it has completed. Registering with write rights lets peers holding the
    /// rkey write these bytes at any time.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let buf = Buffer::new(4096).unwrap(); // memory this program manages itself
    /// // SAFETY: `buf` outlives `raw` (dropped after it, below) and no work request uses it later.
    /// let raw = unsafe { pd.register_raw(buf.addr(), 4096, buf.addr(), A::LOCAL_WRITE) }.unwrap();
    /// assert_eq!(raw.info().length, 4096);
    /// drop(raw);
    /// drop(buf);
    /// ```
    pub unsafe fn register_raw(
        &self,
        addr: u64,
        len: u64,
        iova: u64,
        access: AccessFlags,
    ) -> Result<RawMemoryRegion> {
        // SAFETY: our caller's contract (above) is `UserMemory::new`'s.
        let mem = unsafe { UserMemory::new(addr, len) };
        let info = self
            .inner
            .ctx
            .provider
            .reg_mr(self.inner.handle, mem, iova, access)?;
        Ok(RawMemoryRegion {
            pd: self.clone(),
            info,
            live: true,
        })
    }

    /// `ibv_alloc_mw`.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mw = pd.alloc_mw(mrkit::MwType::Type2).unwrap();
    /// assert_eq!(mw.mw_type(), mrkit::MwType::Type2);
    /// ```
    pub fn alloc_mw(&self, ty: MwType) -> Result<MemoryWindow> {
        let rkey = self.inner.ctx.provider.alloc_mw(self.inner.handle, ty)?;
        Ok(MemoryWindow {
            pd: self.clone(),
            alloc_rkey: rkey,
            ty,
        })
    }

    /// `ibv_advise_mr` on ODP regions: `(lkey, addr, len)` triples.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE | A::ON_DEMAND).unwrap();
    /// // PREFETCH_WRITE (1), synchronously (FLUSH = 1), of the whole MR:
    /// pd.advise(1, 1, &[(mr.lkey(), mr.info().iova, 4096)]).unwrap();
    /// ```
    pub fn advise(&self, advice: u32, flags: u32, sges: &[(u32, u64, u32)]) -> Result<()> {
        self.inner
            .ctx
            .provider
            .advise_mr(self.inner.handle, advice, flags, sges)
    }
}

/// A registration of memory this crate does not own. Deregisters on drop.
#[derive(Debug)]
pub struct RawMemoryRegion {
    pd: ProtectionDomain,
    info: MrInfo,
    /// Still registered by us (cleared once deregistration succeeded).
    live: bool,
}

impl RawMemoryRegion {
    /// Local key.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let buf = Buffer::new(4096).unwrap();
    /// # let mut raw = unsafe { pd.register_raw(buf.addr(), 4096, buf.addr(), A::LOCAL_WRITE) }.unwrap();
    /// assert_eq!(raw.lkey(), raw.info().lkey);
    /// ```
    pub fn lkey(&self) -> u32 {
        self.info.lkey
    }
    /// Remote key.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let buf = Buffer::new(4096).unwrap();
    /// # let mut raw = unsafe { pd.register_raw(buf.addr(), 4096, buf.addr(), A::LOCAL_WRITE) }.unwrap();
    /// assert_eq!(raw.rkey(), raw.info().rkey);
    /// ```
    pub fn rkey(&self) -> u32 {
        self.info.rkey
    }
    /// What the device reports about this MR (page size, entries, pin path...).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let buf = Buffer::new(4096).unwrap();
    /// # let mut raw = unsafe { pd.register_raw(buf.addr(), 4096, buf.addr(), A::LOCAL_WRITE) }.unwrap();
    /// assert_eq!(raw.info().length, 4096);
    /// ```
    pub fn info(&self) -> &MrInfo {
        &self.info
    }
    /// Fresh `query_mr` from the device.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let buf = Buffer::new(4096).unwrap();
    /// # let mut raw = unsafe { pd.register_raw(buf.addr(), 4096, buf.addr(), A::LOCAL_WRITE) }.unwrap();
    /// assert_eq!(raw.query().unwrap().lkey, raw.lkey());
    /// ```
    pub fn query(&self) -> Result<MrInfo> {
        self.pd.inner.ctx.provider.query_mr(self.info.lkey)
    }
    /// The protection domain.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let buf = Buffer::new(4096).unwrap();
    /// # let mut raw = unsafe { pd.register_raw(buf.addr(), 4096, buf.addr(), A::LOCAL_WRITE) }.unwrap();
    /// assert_eq!(raw.pd().handle(), pd.handle());
    /// ```
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }
    /// `ibv_rereg_mr` changing access rights in place (keys stay). EACCES when the pages were
    /// pinned read-only and the new rights are writable.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let buf = Buffer::new(4096).unwrap();
    /// # let mut raw = unsafe { pd.register_raw(buf.addr(), 4096, buf.addr(), A::LOCAL_WRITE) }.unwrap();
    /// raw.set_access(A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// assert!(raw.info().access.contains(A::REMOTE_READ));
    /// ```
    pub fn set_access(&mut self, access: AccessFlags) -> Result<()> {
        self.info = self.pd.inner.ctx.provider.rereg_mr(
            self.info.lkey,
            ReregFlags::CHANGE_ACCESS,
            0,
            UserMemory::empty_at(0),
            0,
            access,
        )?;
        Ok(())
    }
    /// `ibv_rereg_mr` moving the MR to another PD in place (keys stay).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let buf = Buffer::new(4096).unwrap();
    /// # let mut raw = unsafe { pd.register_raw(buf.addr(), 4096, buf.addr(), A::LOCAL_WRITE) }.unwrap();
    /// let pd2 = pd.context().alloc_pd().unwrap();
    /// raw.set_pd(&pd2).unwrap();
    /// assert_eq!(raw.pd().handle(), pd2.handle());
    /// ```
    pub fn set_pd(&mut self, pd: &ProtectionDomain) -> Result<()> {
        self.info = self.pd.inner.ctx.provider.rereg_mr(
            self.info.lkey,
            ReregFlags::CHANGE_PD,
            pd.handle(),
            UserMemory::empty_at(0),
            0,
            AccessFlags::empty(),
        )?;
        self.pd = pd.clone();
        Ok(())
    }
    /// A local SGE over `range` (offsets into the MR).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let buf = Buffer::new(4096).unwrap();
    /// # let mut raw = unsafe { pd.register_raw(buf.addr(), 4096, buf.addr(), A::LOCAL_WRITE) }.unwrap();
    /// let l = raw.local(0..8).unwrap();
    /// assert_eq!((l.len, l.lkey), (8, raw.lkey()));
    /// ```
    pub fn local(&self, range: Range<u64>) -> Result<LocalSlice> {
        slice_check(&self.info, &range)?;
        Ok(LocalSlice {
            addr: self.info.iova + range.start,
            len: (range.end - range.start) as u32,
            lkey: self.info.lkey,
        })
    }
    /// A remote descriptor over `range` (offsets into the MR) to hand to a peer.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let buf = Buffer::new(4096).unwrap();
    /// # let mut raw = unsafe { pd.register_raw(buf.addr(), 4096, buf.addr(), A::LOCAL_WRITE) }.unwrap();
    /// raw.set_access(A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// assert_eq!(raw.remote(8..16).unwrap().len, 8);
    /// ```
    pub fn remote(&self, range: Range<u64>) -> Result<RemoteSlice> {
        slice_check(&self.info, &range)?;
        Ok(RemoteSlice {
            addr: self.info.iova + range.start,
            len: range.end - range.start,
            rkey: self.info.rkey,
        })
    }
}

fn slice_check(info: &MrInfo, range: &Range<u64>) -> Result<()> {
    if range.start > range.end
        || range.end > info.length
        || range.end - range.start > u32::MAX as u64
    {
        return Err(Error::new(
            Errno::EINVAL,
            format!(
                "slice {}..{} is outside the MR (length {})",
                range.start, range.end, info.length
            ),
        ));
    }
    Ok(())
}

impl RawMemoryRegion {
    /// Deregister; whether the MR is gone afterwards (also when something deregistered its
    /// key already). False only while the device still holds it (e.g. memory windows bound).
    fn release(&mut self) -> bool {
        if !self.live {
            return true;
        }
        let gone = match self.pd.inner.ctx.provider.dereg_mr(self.info.lkey) {
            Ok(()) => true,
            Err(e) => {
                let gone = self.pd.inner.ctx.provider.query_mr(self.info.lkey).is_err();
                if !gone {
                    tracing::warn!(error = %e, lkey = self.info.lkey, "dereg_mr failed");
                }
                gone
            }
        };
        self.live = !gone;
        gone
    }
}

impl Drop for RawMemoryRegion {
    fn drop(&mut self) {
        self.release();
    }
}

/// A registered [`Buffer`], owned by the MR. Dropping it deregisters, then frees the buffer.
#[derive(Debug)]
pub struct MemoryRegion {
    raw: RawMemoryRegion,
    /// Freed by `Drop` only after deregistration succeeded.
    buf: ManuallyDrop<Buffer>,
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if self.raw.release() {
            // SAFETY: the MR is gone, so the device no longer reaches the buffer; `buf` is
            // not used again (we are in `drop`).
            unsafe { ManuallyDrop::drop(&mut self.buf) }
        } else {
            // Still registered (e.g. memory windows bound to it): freeing the buffer would let
            // the device and peers write into freed memory. Leak it instead.
            tracing::warn!(
                lkey = self.raw.info.lkey,
                bytes = self.buf.len(),
                "MR could not be deregistered: its buffer is leaked, not freed"
            );
        }
    }
}

impl MemoryRegion {
    /// Local key.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let mut mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// assert_eq!(mr.lkey(), mr.info().lkey);
    /// ```
    pub fn lkey(&self) -> u32 {
        self.raw.lkey()
    }
    /// Remote key.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let mut mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// assert_eq!(mr.rkey(), mr.info().rkey);
    /// ```
    pub fn rkey(&self) -> u32 {
        self.raw.rkey()
    }
    /// Registration details.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let mut mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// assert_eq!(mr.info().length, 4096);
    /// ```
    pub fn info(&self) -> &MrInfo {
        self.raw.info()
    }
    /// Fresh `query_mr`.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let mut mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// assert_eq!(mr.query().unwrap(), *mr.info());
    /// ```
    pub fn query(&self) -> Result<MrInfo> {
        self.raw.query()
    }
    /// Bytes of the buffer.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let mut mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// assert!(mr.as_slice().iter().all(|&b| b == 0));
    /// ```
    pub fn as_slice(&self) -> &[u8] {
        self.buf.as_slice()
    }
    /// Bytes of the buffer, mutably (no work request can be in flight while `&mut` is held).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let mut mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// mr.as_mut_slice()[..5].copy_from_slice(b"hello");
    /// assert_eq!(&mr.as_slice()[..5], b"hello");
    /// ```
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.buf.as_mut_slice()
    }
    /// Rights change in place (see [`RawMemoryRegion::set_access`]).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let mut mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// mr.set_access(A::LOCAL_WRITE | A::REMOTE_WRITE).unwrap();
    /// assert!(mr.info().access.contains(A::REMOTE_WRITE));
    /// ```
    pub fn set_access(&mut self, access: AccessFlags) -> Result<()> {
        self.raw.set_access(access)
    }
    /// PD change in place.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let mut mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let pd2 = pd.context().alloc_pd().unwrap();
    /// mr.set_pd(&pd2).unwrap();
    /// ```
    pub fn set_pd(&mut self, pd: &ProtectionDomain) -> Result<()> {
        self.raw.set_pd(pd)
    }
    /// Local SGE over `range` (offsets into the MR); `EINVAL` outside it.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let l = mr.local(16..32).unwrap();
    /// assert_eq!((l.addr, l.len, l.lkey), (mr.info().iova + 16, 16, mr.lkey()));
    /// assert!(mr.local(4000..4097).is_err());
    /// ```
    pub fn local(&self, range: Range<u64>) -> Result<LocalSlice> {
        self.raw.local(range)
    }
    /// Remote descriptor over `range` (offsets into the MR) to hand to a peer; `EINVAL`
    /// outside it.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer, Context};
    /// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
    /// let r = mr.remote(0..4096).unwrap();
    /// assert_eq!((r.len, r.rkey), (4096, mr.rkey()));
    /// ```
    pub fn remote(&self, range: Range<u64>) -> Result<RemoteSlice> {
        self.raw.remote(range)
    }
    /// Deregister and get the buffer back. An MR the device cannot deregister (memory
    /// windows still bound) is returned as the error, still registered.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// # let mut mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE).unwrap();
    /// let buf = mr.deregister().unwrap();
    /// assert_eq!(buf.len(), 4096);
    /// ```
    pub fn deregister(mut self) -> std::result::Result<Buffer, Box<MemoryRegion>> {
        if !self.raw.release() {
            return Err(Box::new(self));
        }
        let mut me = ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped (ManuallyDrop), so each field is moved out exactly
        // once; the MR is deregistered, so the buffer is free to go.
        let (raw, buf) = unsafe { (std::ptr::read(&me.raw), ManuallyDrop::take(&mut me.buf)) };
        // Deregistered (`live` is false): dropping it only releases the PD reference.
        drop(raw);
        Ok(buf)
    }
}

/// A local scatter/gather element (`struct ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalSlice {
    /// Address in the MR's iova space.
    pub addr: u64,
    /// Length.
    pub len: u32,
    /// lkey.
    pub lkey: u32,
}

/// What a peer needs to RDMA READ/WRITE a range: address, length and rkey.
///
/// ```
/// # use mrkit::{AccessFlags as A, Buffer, Context};
/// # let pd = Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
/// let mr = pd.register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE | A::REMOTE_READ).unwrap();
/// let all = mr.remote(0..4096).unwrap();
/// let tail = all.offset(1024).unwrap();
/// assert_eq!((tail.addr, tail.len), (all.addr + 1024, 3072));
/// assert_eq!(tail.slice(0..8).unwrap(), mr.remote(1024..1032).unwrap());
/// assert_eq!(all.slice(4000..5000).unwrap_err().errno(), mrkit::Errno::EINVAL);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteSlice {
    /// Address in the MR's (or window's) iova space.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// rkey.
    pub rkey: u32,
}

impl RemoteSlice {
    /// The sub-range `range` (offsets from this slice's first byte), same rkey. `EINVAL` when
    /// the range is reversed, runs past [`RemoteSlice::len`], or the address would overflow.
    ///
    /// ```
    /// use mrkit::{Errno, RemoteSlice};
    /// let table = RemoteSlice { addr: 0x1000, len: 4096, rkey: 7 };
    /// let entry = table.slice(256..320).unwrap(); // READ only the entry the key hashes to
    /// assert_eq!(entry, RemoteSlice { addr: 0x1100, len: 64, rkey: 7 });
    /// assert_eq!(table.slice(4000..4097).unwrap_err().errno(), Errno::EINVAL);
    /// let top = RemoteSlice { addr: u64::MAX - 1, len: 8, rkey: 7 };
    /// assert_eq!(top.slice(4..6).unwrap_err().errno(), Errno::EINVAL); // overflow-safe
    /// ```
    pub fn slice(&self, range: Range<u64>) -> Result<RemoteSlice> {
        let (start, len) = crate::qp::registered::check_range(&range, self.len, "remote slice")?;
        let addr = self
            .addr
            .checked_add(start)
            .ok_or_else(|| Error::new(Errno::EINVAL, "remote address overflows"))?;
        Ok(RemoteSlice {
            addr,
            len,
            rkey: self.rkey,
        })
    }

    /// Everything from byte `off` on (`off == len` gives an empty slice; `EINVAL` past it).
    ///
    /// ```
    /// use mrkit::RemoteSlice;
    /// let record = RemoteSlice { addr: 0x1000, len: 100, rkey: 7 };
    /// let body = record.offset(16).unwrap(); // skip a 16-byte header
    /// assert_eq!((body.addr, body.len, body.rkey), (0x1010, 84, 7));
    /// assert_eq!(record.offset(100).unwrap().len, 0);
    /// assert!(record.offset(101).is_err());
    /// ```
    pub fn offset(&self, off: u64) -> Result<RemoteSlice> {
        self.slice(off..self.len)
    }
}

/// A memory window. Deallocated on drop.
#[derive(Debug)]
pub struct MemoryWindow {
    pd: ProtectionDomain,
    alloc_rkey: u32,
    ty: MwType,
}

impl MemoryWindow {
    /// Current rkey (changes with every bind).
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mw = pd.alloc_mw(mrkit::MwType::Type1).unwrap();
    /// assert_ne!(mw.rkey(), 0);
    /// ```
    pub fn rkey(&self) -> u32 {
        self.pd
            .inner
            .ctx
            .provider
            .query_mw(self.alloc_rkey)
            .map(|i| i.rkey)
            .unwrap_or(self.alloc_rkey)
    }
    /// Window type.
    ///
    /// ```
    /// # use mrkit::{AccessFlags as A, Buffer};
    /// # let pd = mrkit::Context::open(mrkit::DeviceConfig::rxe()).alloc_pd().unwrap();
    /// let mw = pd.alloc_mw(mrkit::MwType::Type1).unwrap();
    /// assert_eq!(mw.mw_type(), mrkit::MwType::Type1);
    /// ```
    pub fn mw_type(&self) -> MwType {
        self.ty
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        if let Err(e) = self.pd.inner.ctx.provider.dealloc_mw(self.alloc_rkey) {
            tracing::warn!(error = %e, "dealloc_mw failed in drop");
        }
    }
}
