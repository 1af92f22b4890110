//! A SEND/RECV echo between two processes whose messages go out of pool slots, in safe code
//! with `mrkit` alone.
//!
//! ```text
//! cargo run -p mrkit --example pool_echo                        # spawns its own server
//! cargo run -p mrkit --example pool_echo server 127.0.0.1:7472  # or run the two sides apart
//! cargo run -p mrkit --example pool_echo client 127.0.0.1:7472 hello world
//! ```
//!
//! Every message, sent or received, lives in a slot of an [`MrPool`] (no registration per
//! message): a slot moves into its SEND or RECV work request and comes back with the
//! completion, holding the received bytes. An empty message ends the session.
use std::error::Error;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use mrkit::pool::{MrPool, PoolConfig};
use mrkit::tcp::{self, HandshakeOpts, Listener};
use mrkit::{AccessFlags, Context, QpCap, QueuePair, Ticket};

type Result<T> = std::result::Result<T, Box<dyn Error>>;

const MAX_MSG: usize = 4096;
const TIMEOUT: Duration = Duration::from_secs(10);

/// Post a receive into a fresh pool slot (before the peer may send).
fn post_recv(qp: &QueuePair, pool: &MrPool) -> Result<Ticket> {
    let slot = pool.alloc_owned()?;
    Ok(qp.post_recv(slot, 0..MAX_MSG as u64).map_err(|r| r.error)?)
}

/// Wait for the message of receive `ticket`: its slot comes back holding the bytes.
fn recv(qp: &QueuePair, ticket: Ticket) -> Result<Vec<u8>> {
    let (wc, slot) = qp.wait_ticket(ticket, TIMEOUT)?.into_result()?;
    let bytes = slot.as_slice().ok_or("a receive slot")?;
    Ok(bytes[..wc.byte_len as usize].to_vec())
}

/// SEND `msg` out of a pool slot; the slot returns to the pool with the completion.
fn send(qp: &QueuePair, pool: &MrPool, msg: &[u8]) -> Result<()> {
    let mut slot = pool.alloc_owned()?;
    slot.as_mut_slice()[..msg.len()].copy_from_slice(msg);
    let ticket = qp
        .post_send(slot, 0..msg.len() as u64)
        .map_err(|r| r.error)?;
    qp.wait_ticket(ticket, TIMEOUT)?.into_result()?;
    Ok(())
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

pub fn server(addr: &str) -> Result<()> {
    let pd = Context::open_default()?.alloc_pd()?;
    let pool = pool(&pd)?;
    let listener = Listener::bind(addr)?;
    println!("listening on {}", listener.local_addr()?);
    let conn = listener.accept(&pd, QpCap::default(), &HandshakeOpts::default())?;
    let mut next = post_recv(&conn.qp, &pool)?;
    loop {
        let msg = recv(&conn.qp, next)?;
        if msg.is_empty() {
            return Ok(());
        }
        next = post_recv(&conn.qp, &pool)?;
        send(&conn.qp, &pool, &msg)?;
    }
}

pub fn client(addr: &str, words: &[&str]) -> Result<Vec<String>> {
    let pd = Context::open_default()?.alloc_pd()?;
    let pool = pool(&pd)?;
    let conn = tcp::connect(addr, &pd, QpCap::default(), &HandshakeOpts::default())?;
    let mut echoes = Vec::new();
    for w in words {
        let reply = post_recv(&conn.qp, &pool)?;
        send(&conn.qp, &pool, &w.as_bytes()[..w.len().min(MAX_MSG)])?;
        let echo = String::from_utf8_lossy(&recv(&conn.qp, reply)?).into_owned();
        println!("{w} -> {echo}");
        echoes.push(echo);
    }
    send(&conn.qp, &pool, b"")?; // the end
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
