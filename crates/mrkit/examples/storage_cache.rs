//! A storage-style user of the registration cache, in safe code only.
//!
//! An initiator keeps a few I/O buffers (`Arc<Buffer>`, owned) and cycles them through a
//! [`RegCache`]: each I/O looks its buffer up (a miss the first time, a hit afterwards) with
//! remote rights and hands the rkey to the storage target, which moves the data by RDMA, as
//! NVMe-oF and iSER targets do: a *read* I/O is an RDMA WRITE from the target's disk into the
//! buffer, a *write* I/O an RDMA READ out of the buffer onto the target's mirror disk. Target and
//! initiator are two queue pairs of one process connected over loopback.
//!
//! The cache co-owns each buffer while its registration (and so the rkey the target holds)
//! is cached, so no buffer can be freed while the target may still reach it.
//!
//! Run: `cargo run -p mrkit --example storage_cache`
#![forbid(unsafe_code)]

use std::error::Error;
use std::sync::Arc;

use mrkit::cache::{CacheConfig, RegCache, RegOwned};
use mrkit::{
    AccessFlags as A, Buffer, Context, MemoryRegion, QpCap, QueuePair, RemoteSlice, WcStatus,
};

const BLOCK: usize = 64 << 10;
const DISK_BLOCKS: usize = 16;
const BUFFERS: usize = 4;
const IOS: usize = 64;

/// The target's side of one I/O: the QP step of this example (the device moves the bytes).
/// The initiator could as well post its cached handle itself (`RegOwned` is `Registered` and
/// `DeviceWritable`, so it moves into a work request like any MR); here the target does the
/// one-sided work, as storage targets do.
fn serve(
    target: &mut QueuePair,
    disk: &mut MemoryRegion,
    block: usize,
    write_io: bool,
    into: RemoteSlice,
) -> Result<(), Box<dyn Error>> {
    let range = (block * BLOCK) as u64..((block + 1) * BLOCK) as u64;
    let wc = if write_io {
        target.read(disk, range, into)?
    } else {
        target.write(disk, range, into)?
    };
    if wc.status != WcStatus::Success {
        return Err(format!("I/O failed: {:?}", wc.status).into());
    }
    Ok(())
}

fn checksum(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &x| {
        (h ^ u64::from(x)).wrapping_mul(0x100_0000_01b3)
    })
}

fn main() -> Result<(), Box<dyn Error>> {
    let ctx = Context::open_default()?;
    let pd = ctx.alloc_pd()?;
    let cache = RegCache::new(&pd, CacheConfig::default())?;

    // The target: a disk with a pattern in every block, and a QP connected to the initiator.
    let mut disk = pd.register(Buffer::new(DISK_BLOCKS * BLOCK)?, A::LOCAL_WRITE)?;
    for (i, b) in disk.as_mut_slice().iter_mut().enumerate() {
        *b = (i / BLOCK * 31 + i % 251) as u8;
    }
    let expected: Vec<u64> = disk.as_slice().chunks(BLOCK).map(checksum).collect();
    // Where write I/Os land: a second disk, a mirror of the first once every block went by.
    let mut mirror = pd.register(Buffer::new(DISK_BLOCKS * BLOCK)?, A::LOCAL_WRITE)?;
    let acc = A::LOCAL_WRITE | A::REMOTE_READ | A::REMOTE_WRITE;
    let mut target = QueuePair::new(&pd, QpCap::default())?;
    let initiator = QueuePair::new(&pd, QpCap::default())?;
    QueuePair::connect(&target, &initiator, acc)?;

    // The initiator's I/O buffers: owned, shared with the cache.
    let buffers: Vec<Arc<Buffer>> = (0..BUFFERS)
        .map(|_| Buffer::new(BLOCK).map(Arc::new))
        .collect::<std::io::Result<_>>()?;

    for io in 0..IOS {
        let buf = &buffers[io % BUFFERS];
        let h: RegOwned<Buffer> = cache.get_owned(buf, 0..BLOCK as u64, acc)?;
        let src = io % DISK_BLOCKS;
        // Read I/O: block `src` into the buffer.
        serve(
            &mut target,
            &mut disk,
            src,
            false,
            h.remote(0..BLOCK as u64)?,
        )?;
        assert_eq!(checksum(buf.as_slice()), expected[src], "read I/O {io}");
        // Write I/O: the buffer out to the same block of the mirror.
        serve(
            &mut target,
            &mut mirror,
            src,
            true,
            h.remote(0..BLOCK as u64)?,
        )?;
        drop(h); // the registration stays cached (and keeps `buf` alive) for the next I/O
    }
    // Every block went through a cached buffer onto the mirror.
    assert!(mirror.as_slice() == disk.as_slice(), "mirror differs");
    let st = cache.stats();
    println!(
        "{IOS} I/Os over {BUFFERS} cached buffers: {} misses, {} hits ({} registrations)",
        st.misses, st.hits, st.registrations
    );
    assert_eq!(st.misses, BUFFERS as u64);
    assert_eq!(st.hits, (IOS - BUFFERS) as u64);
    // Giving the buffers back: invalidate, and each `Arc` is ours alone again.
    for b in &buffers {
        cache.invalidate(b.addr(), BLOCK as u64);
    }
    assert!(buffers.iter().all(|b| Arc::strong_count(b) == 1));
    Ok(())
}
