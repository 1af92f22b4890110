//! The provider interface: one ops table per device backend, in the shape of rdma-core's
//! `verbs_context_ops`. Optional operations default to "unsupported" (EOPNOTSUPP), so a new
//! backend compiles with the handful of mandatory ones.
#![forbid(unsafe_code)]

use mrkit_soft::mw::{BindInfo, MwInfo};
use mrkit_soft::{AccessFlags, DeviceAttr, Errno, Error, MrInfo, MwType, Result, UserMemory};

fn unsupported(op: &str) -> Error {
    Error::new(
        Errno::EOPNOTSUPP,
        format!("{op} is not implemented by this provider"),
    )
}

/// Operations a device backend provides. Handles are plain integers (PD handle, MR key), as a
/// kernel driver hands them out; the safe types in this crate own them.
pub trait Provider: Send + Sync + std::fmt::Debug + 'static {
    /// Device name (`mrkit0`).
    fn name(&self) -> &str;
    /// `ibv_query_device`.
    fn query_device(&self) -> DeviceAttr;
    /// `ibv_alloc_pd`.
    fn alloc_pd(&self) -> Result<u32>;
    /// `ibv_dealloc_pd`.
    fn dealloc_pd(&self, pd: u32) -> Result<()>;
    /// `ibv_reg_mr_iova2`. `mem` carries the guarantee that the memory outlives the MR (see
    /// [`UserMemory`]): a provider keeps `mem` (its owner, if any) until deregistration.
    fn reg_mr(&self, pd: u32, mem: UserMemory, iova: u64, access: AccessFlags) -> Result<MrInfo>;
    /// `ibv_dereg_mr`.
    fn dereg_mr(&self, lkey: u32) -> Result<()>;
    /// `ibv_rereg_mr` (`mem` is used with CHANGE_TRANSLATION only; else pass
    /// [`UserMemory::empty_at`]).
    fn rereg_mr(
        &self,
        _lkey: u32,
        _flags: u32,
        _pd: u32,
        _mem: UserMemory,
        _iova: u64,
        _access: AccessFlags,
    ) -> Result<MrInfo> {
        Err(unsupported("rereg_mr"))
    }
    /// `ibv_query_mr`.
    fn query_mr(&self, _lkey: u32) -> Result<MrInfo> {
        Err(unsupported("query_mr"))
    }
    /// `ibv_advise_mr`.
    fn advise_mr(
        &self,
        _pd: u32,
        _advice: u32,
        _flags: u32,
        _sges: &[(u32, u64, u32)],
    ) -> Result<()> {
        Err(unsupported("advise_mr"))
    }
    /// `ibv_alloc_mw`.
    fn alloc_mw(&self, _pd: u32, _ty: MwType) -> Result<u32> {
        Err(unsupported("alloc_mw"))
    }
    /// `ibv_dealloc_mw`.
    fn dealloc_mw(&self, _rkey: u32) -> Result<()> {
        Err(unsupported("dealloc_mw"))
    }
    /// Execute a window bind.
    fn bind_mw(
        &self,
        _qp_pd: u32,
        _qp_num: u32,
        _rkey: u32,
        _new_key: u8,
        _info: BindInfo,
    ) -> Result<u32> {
        Err(unsupported("bind_mw"))
    }
    /// Describe a window.
    fn query_mw(&self, _rkey: u32) -> Result<MwInfo> {
        Err(unsupported("query_mw"))
    }
    /// The embedded software device, when this provider is one (statistics, data path).
    fn soft(&self) -> Option<&mrkit_soft::Context> {
        None
    }
}

impl Provider for mrkit_soft::Context {
    fn name(&self) -> &str {
        mrkit_soft::DEVICE_NAME
    }
    fn query_device(&self) -> DeviceAttr {
        mrkit_soft::Context::query_device(self)
    }
    fn alloc_pd(&self) -> Result<u32> {
        mrkit_soft::Context::alloc_pd(self)
    }
    fn dealloc_pd(&self, pd: u32) -> Result<()> {
        mrkit_soft::Context::dealloc_pd(self, pd)
    }
    fn reg_mr(&self, pd: u32, mem: UserMemory, iova: u64, access: AccessFlags) -> Result<MrInfo> {
        mrkit_soft::Context::reg_mr(self, pd, mem, iova, access)
    }
    fn dereg_mr(&self, lkey: u32) -> Result<()> {
        mrkit_soft::Context::dereg_mr(self, lkey)
    }
    fn rereg_mr(
        &self,
        lkey: u32,
        flags: u32,
        pd: u32,
        mem: UserMemory,
        iova: u64,
        access: AccessFlags,
    ) -> Result<MrInfo> {
        mrkit_soft::Context::rereg_mr(self, lkey, flags, pd, mem, iova, access)
    }
    fn query_mr(&self, lkey: u32) -> Result<MrInfo> {
        mrkit_soft::Context::query_mr(self, lkey)
    }
    fn advise_mr(&self, pd: u32, advice: u32, flags: u32, sges: &[(u32, u64, u32)]) -> Result<()> {
        mrkit_soft::Context::advise_mr(self, pd, advice, flags, sges)
    }
    fn alloc_mw(&self, pd: u32, ty: MwType) -> Result<u32> {
        mrkit_soft::Context::alloc_mw(self, pd, ty)
    }
    fn dealloc_mw(&self, rkey: u32) -> Result<()> {
        mrkit_soft::Context::dealloc_mw(self, rkey)
    }
    fn bind_mw(
        &self,
        qp_pd: u32,
        qp_num: u32,
        rkey: u32,
        new_key: u8,
        info: BindInfo,
    ) -> Result<u32> {
        mrkit_soft::Context::bind_mw(self, qp_pd, qp_num, rkey, new_key, info)
    }
    fn query_mw(&self, rkey: u32) -> Result<MwInfo> {
        mrkit_soft::Context::query_mw(self, rkey)
    }
    fn soft(&self) -> Option<&mrkit_soft::Context> {
        Some(self)
    }
}
