//! SEND/RECV echo with the async API: a client task sends messages, a server task echoes each
//! back, both awaiting completions on a tokio runtime (`--features tokio`). One process, two
//! queue pairs on two device contexts; the buffers travel with their work requests and come
//! back with the completions.
//!
//! ```text
//! cargo run -p mrkit --features tokio --example async_echo
//! ```

use std::sync::Arc;
use std::time::Duration;

use mrkit::{AccessFlags as A, Buffer, Context, QpCap, QueuePair};

const MSG: u64 = 64;
const ROUNDS: usize = 1000;
const DEPTH: usize = 8;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (c1, c2) = (Context::open_default()?, Context::open_default()?);
    let (pd1, pd2) = (c1.alloc_pd()?, c2.alloc_pd()?);
    let client = Arc::new(QueuePair::new(&pd1, QpCap::default())?);
    let server = Arc::new(QueuePair::new(&pd2, QpCap::default())?);
    QueuePair::connect(&client, &server, A::empty())?;

    // Receives go up before any message can arrive: DEPTH on each side.
    for _ in 0..DEPTH {
        let _ticket = server.post_recv(
            pd2.register(Buffer::new(MSG as usize)?, A::LOCAL_WRITE)?,
            0..MSG,
        )?;
        let _ticket = client.post_recv(
            pd1.register(Buffer::new(MSG as usize)?, A::LOCAL_WRITE)?,
            0..MSG,
        )?;
    }

    // Server: each received message is sent back from the same buffer, which is then
    // re-posted as a receive. Sends and receives share the queue pair's completions.
    let srv = server.clone();
    let echo = tokio::spawn(async move {
        let mut echoed = 0;
        while echoed < ROUNDS {
            let c = srv.next_completion().await?;
            let (wc, buf) = c.into_result()?;
            match wc.opcode {
                mrkit::WcOpcode::Recv => {
                    let _ticket = srv.post_send(buf, 0..u64::from(wc.byte_len))?;
                }
                _ => {
                    // The echo went out: the buffer serves as a receive again.
                    let _ticket = srv.post_recv(buf, 0..MSG)?;
                    echoed += 1;
                }
            }
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
    });

    // Client: keep DEPTH messages in flight, check every echo.
    let mut sent = 0;
    let mut checked = 0;
    let mut spare = Vec::new();
    for _ in 0..DEPTH {
        spare.push(pd1.register(Buffer::new(MSG as usize)?, A::LOCAL_WRITE)?);
    }
    while checked < ROUNDS {
        while sent < ROUNDS {
            let Some(mut tx) = spare.pop() else { break };
            tx.as_mut_slice()[..8].copy_from_slice(&(sent as u64).to_le_bytes());
            let _ticket = client.post_send(tx, 0..MSG)?;
            sent += 1;
        }
        let c = tokio::time::timeout(Duration::from_secs(30), client.next_completion()).await??;
        let (wc, buf) = c.into_result()?;
        let mrkit::Owned::Mr(mr) = buf else {
            unreachable!("only MRs are posted here")
        };
        match wc.opcode {
            mrkit::WcOpcode::Recv => {
                let n = u64::from_le_bytes(mr.as_slice()[..8].try_into()?);
                assert!(n < sent as u64, "echo of a message never sent");
                checked += 1;
                let _ticket = client.post_recv(mr, 0..MSG)?;
            }
            _ => spare.push(mr),
        }
    }
    echo.await?.map_err(|e| e.to_string())?;
    println!("{ROUNDS} messages of {MSG} bytes echoed");
    Ok(())
}
