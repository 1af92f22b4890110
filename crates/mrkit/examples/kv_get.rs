//! A key-value GET over RDMA READ between two processes, in safe code with `mrkit` alone.
//!
//! ```text
//! cargo run -p mrkit --example kv_get                        # spawns its own server
//! cargo run -p mrkit --example kv_get server 127.0.0.1:7471  # or run the two sides apart
//! cargo run -p mrkit --example kv_get client 127.0.0.1:7471 apple
//! ```
//!
//! The server registers a hash table for remote READ and hands its address and rkey to the
//! client as the handshake's private data. The client READs the slot of its key (probing on
//! if another key sits there): the server's CPU does nothing per GET. On two hosts, give each
//! side its RDMA address with `MRKIT_ADDR` (see `docs/connect.md`).
use std::error::Error;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

use mrkit::tcp::{self, HandshakeOpts, Listener};
use mrkit::{AccessFlags, Buffer, Context, MemoryRegion, QpCap, QueuePair, RemoteSlice, WcStatus};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const SLOTS: u64 = 64;
/// A slot: the key (32 bytes, zero-padded), then the value (32 bytes, zero-padded).
const SLOT: u64 = 64;

fn home(key: &str) -> u64 {
    // FNV-1a: both sides must agree on where a key lives.
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    h % SLOTS
}

fn field(b: &[u8]) -> &[u8] {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    &b[..end]
}

fn put(table: &mut [u8], key: &str, value: &str) {
    assert!(!key.is_empty() && key.len() <= 32 && value.len() <= 32);
    let mut s = home(key);
    while !field(&table[(s * SLOT) as usize..][..32]).is_empty() {
        s = (s + 1) % SLOTS;
    }
    let slot = &mut table[(s * SLOT) as usize..][..SLOT as usize];
    slot[..key.len()].copy_from_slice(key.as_bytes());
    slot[32..32 + value.len()].copy_from_slice(value.as_bytes());
}

fn server(addr: &str) -> Result<()> {
    let pd = Context::open_default()?.alloc_pd()?;
    let len = (SLOTS * SLOT) as usize;
    let mut table = pd.register(Buffer::new(len)?, AccessFlags::REMOTE_READ)?;
    for (k, v) in [
        ("apple", "red"),
        ("banana", "yellow"),
        ("cherry", "dark red"),
    ] {
        put(table.as_mut_slice(), k, v);
    }
    let listener = Listener::bind(addr)?;
    println!("listening on {}", listener.local_addr()?);
    let opts = HandshakeOpts {
        private_data: table.remote(0..len as u64)?.to_bytes().to_vec(),
        ..Default::default()
    };
    let mut conn = listener.accept(&pd, QpCap::default(), &opts)?;
    // Keep the table registered until the client is done: it closes the side channel.
    let _ = conn.stream.read(&mut [0u8; 1])?;
    Ok(())
}

fn get(
    qp: &QueuePair,
    buf: &mut MemoryRegion,
    table: RemoteSlice,
    key: &str,
) -> Result<Option<String>> {
    let mut s = home(key);
    for _ in 0..SLOTS {
        let slot = table.slice(s * SLOT..(s + 1) * SLOT)?; // EINVAL outside the table
        let wc = qp.read(buf, 0..SLOT, slot)?;
        if wc.status != WcStatus::Success {
            return Err(format!("READ failed: {:?}", wc.status).into());
        }
        let b = buf.as_slice();
        match field(&b[..32]) {
            [] => return Ok(None),
            k if k == key.as_bytes() => {
                return Ok(Some(String::from_utf8_lossy(field(&b[32..64])).into()))
            }
            _ => s = (s + 1) % SLOTS,
        }
    }
    Ok(None)
}

fn client(addr: &str, keys: &[&str]) -> Result<Vec<Option<String>>> {
    let pd = Context::open_default()?.alloc_pd()?;
    let conn = tcp::connect(addr, &pd, QpCap::default(), &HandshakeOpts::default())?;
    let table = RemoteSlice::from_bytes(&conn.private_data)?;
    if table.len < SLOTS * SLOT {
        return Err("the server's table is too small".into()); // so no slot address overflows
    }
    let mut buf = pd.register(Buffer::new(SLOT as usize)?, AccessFlags::LOCAL_WRITE)?;
    let mut out = Vec::new();
    for key in keys {
        let v = get(&conn.qp, &mut buf, table, key)?;
        println!("{key} -> {}", v.as_deref().unwrap_or("(not found)"));
        out.push(v);
    }
    Ok(out)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["server", addr] => server(addr),
        ["client", addr, ref keys @ ..] if !keys.is_empty() => client(addr, keys).map(drop),
        [] => {
            // Both sides: the server in a child process, the client here.
            let exe = std::env::current_exe()?;
            let mut child = Command::new(exe)
                .args(["server", "127.0.0.1:0"])
                .stdout(Stdio::piped())
                .spawn()?;
            let mut line = String::new();
            BufReader::new(child.stdout.take().ok_or("no stdout")?).read_line(&mut line)?;
            let addr = line
                .trim()
                .strip_prefix("listening on ")
                .ok_or("the server did not start")?;
            let got = client(addr, &["apple", "cherry", "durian"])?;
            let want = [Some("red"), Some("dark red"), None];
            assert_eq!(got.iter().map(Option::as_deref).collect::<Vec<_>>(), want);
            if !child.wait()?.success() {
                return Err("the server failed".into());
            }
            Ok(())
        }
        _ => Err("usage: kv_get [server ADDR | client ADDR KEY...]".into()),
    }
}
