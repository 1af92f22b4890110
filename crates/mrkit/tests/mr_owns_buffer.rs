//! A `MemoryRegion` owns its buffer: the buffer is freed only after the MR is deregistered.
//! When the device refuses to deregister (a memory window is bound to the MR), the buffer is
//! kept (leaked) rather than freed under a live registration.
mod providers_util;

use mrkit::{AccessFlags, BindInfo, Buffer, MwType};

/// Whether `addr` lies in a mapping of this process.
fn mapped(addr: u64) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (range, _) = l.split_once(' ')?;
            let (a, b) = range.split_once('-')?;
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        })
        .any(|(a, b)| a <= addr && addr < b)
}

#[test]
fn buffer_outlives_a_registration_that_cannot_be_removed() {
    if providers_util::needs_native("holds an MR in mrkit-soft's table (a deregistration that cannot finish) through the software device") {
        return;
    }
    let ctx = providers_util::open();
    let soft = ctx.soft().expect("embedded device").clone();
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd
        .register(
            Buffer::new(64 << 10).unwrap(),
            AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
        )
        .unwrap();
    let (addr, lkey) = (mr.info().addr, mr.lkey());
    let mw = pd.alloc_mw(MwType::Type1).unwrap();
    soft.bind_mw(
        pd.handle(),
        7,
        mw.rkey(),
        1,
        BindInfo {
            mr_lkey: lkey,
            addr: mr.info().iova,
            length: 4096,
            access: AccessFlags::REMOTE_READ,
        },
    )
    .unwrap();
    // The device refuses: the MR comes back, still registered.
    let mr = mr.deregister().unwrap_err();
    assert!(soft.query_mr(lkey).is_ok());
    // Dropped while still registered: the buffer must stay mapped (leaked, not freed).
    drop(mr);
    assert!(soft.query_mr(lkey).is_ok(), "still registered");
    assert!(
        mapped(addr),
        "the registered buffer was unmapped under a live MR"
    );
}

#[test]
fn deregister_returns_the_buffer() {
    let ctx = providers_util::open();
    let pd = ctx.alloc_pd().unwrap();
    let mut b = Buffer::new(4096).unwrap();
    b.as_mut_slice()[0] = 9;
    let mr = pd.register(b, AccessFlags::LOCAL_WRITE).unwrap();
    let lkey = mr.lkey();
    let b = mr.deregister().unwrap();
    assert_eq!(b.as_slice()[0], 9);
    assert!(ctx.provider().query_mr(lkey).is_err());
}
