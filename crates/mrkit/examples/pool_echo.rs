//! A SEND/RECV echo between two processes whose messages go out of pool slots, in safe code
//! with `mrkit` alone.
//!
//! ```text
//! cargo run -p mrkit --example pool_echo                        # spawns its own server
//! cargo run -p mrkit --example pool_echo server 127.0.0.1:7472  # or run the two sides apart
//! cargo run -p mrkit --example pool_echo client 127.0.0.1:7472 hello world
//! ```
//!
//! Each message is written into a slot of an [`MrPool`] (no registration per message), and the
//! slot moves into the SEND until its completion hands it back. Receives land in one
//! registered buffer: posting receives into pool slots needs a pipelined `post_recv`, which
//! `QueuePair` does not have yet. An empty message ends the session.
use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use mrkit::pool::{MrPool, PoolConfig};
use mrkit::tcp::{self, HandshakeOpts, Listener};
use mrkit::{AccessFlags, Buffer, Context, MemoryRegion, QpCap, QueuePair, WcStatus};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const MAX_MSG: usize = 4096;

/// SEND `msg` out of a pool slot; the slot returns to the pool with the completion.
fn send(qp: &mut QueuePair, pool: &MrPool, msg: &[u8]) -> Result<()> {
    let mut slot = pool.alloc_owned()?;
    slot.as_mut_slice()[..msg.len()].copy_from_slice(msg);
    let _ticket = qp
        .post_send(slot, 0..msg.len() as u64)
        .map_err(|r| r.error)?;
    for (wc, _slot) in qp.wait_all()? {
        if wc.status != WcStatus::Success {
            return Err(format!("SEND failed: {:?}", wc.status).into());
        }
    }
    Ok(())
}

/// Wait for the next message; its bytes are `buf[..len]`.
fn recv(qp: &mut QueuePair, buf: &mut MemoryRegion) -> Result<usize> {
    let wc = qp.recv(buf, 0..MAX_MSG as u64)?;
    if wc.status != WcStatus::Success {
        return Err(format!("RECV failed: {:?}", wc.status).into());
    }
    Ok(wc.byte_len as usize)
}

/// A pool of 4 KiB slots, one 1 MiB chunk, for local use only (SENDs read them).
fn pool(pd: &mrkit::ProtectionDomain) -> Result<MrPool> {
    let cfg = PoolConfig {
        slot_size: MAX_MSG,
        chunk_size: 1 << 20,
        access: AccessFlags::LOCAL_WRITE,
        ..PoolConfig::default()
    };
    Ok(MrPool::new(pd, cfg)?)
}

fn server(addr: &str) -> Result<()> {
    let pd = Context::open_default()?.alloc_pd()?;
    let (pool, mut buf) = (
        pool(&pd)?,
        pd.register(Buffer::new(MAX_MSG)?, AccessFlags::LOCAL_WRITE)?,
    );
    let listener = Listener::bind(addr)?;
    println!("listening on {}", listener.local_addr()?);
    let mut conn = listener.accept(&pd, QpCap::default(), &HandshakeOpts::default())?;
    loop {
        let n = recv(&mut conn.qp, &mut buf)?;
        if n == 0 {
            return Ok(());
        }
        let echo = buf.as_slice()[..n].to_vec();
        send(&mut conn.qp, &pool, &echo)?;
    }
}

fn client(addr: &str, words: &[&str]) -> Result<Vec<String>> {
    let pd = Context::open_default()?.alloc_pd()?;
    let (pool, mut buf) = (
        pool(&pd)?,
        pd.register(Buffer::new(MAX_MSG)?, AccessFlags::LOCAL_WRITE)?,
    );
    let mut conn = tcp::connect(addr, &pd, QpCap::default(), &HandshakeOpts::default())?;
    let mut echoes = Vec::new();
    for w in words {
        send(&mut conn.qp, &pool, &w.as_bytes()[..w.len().min(MAX_MSG)])?;
        let n = recv(&mut conn.qp, &mut buf)?;
        let echo = String::from_utf8_lossy(&buf.as_slice()[..n]).into_owned();
        println!("{w} -> {echo}");
        echoes.push(echo);
    }
    send(&mut conn.qp, &pool, b"")?; // the end
    Ok(echoes)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["server", addr] => server(addr),
        ["client", addr, ref words @ ..] if !words.is_empty() => client(addr, words).map(drop),
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
            let words = ["ping", "hello, pool", "x"];
            assert_eq!(client(addr, &words)?, words);
            if !child.wait()?.success() {
                return Err("the server failed".into());
            }
            Ok(())
        }
        _ => Err("usage: pool_echo [server ADDR | client ADDR WORD...]".into()),
    }
}
