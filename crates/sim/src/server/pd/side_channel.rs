//! The simulator's stand-in for NIXL: a producer engine's side channel, over which a consumer
//! reads held blocks and then tells the producer it is done. vLLM's real side channel is a ZMQ
//! handshake followed by RDMA reads; here one TCP connection per operation carries one JSON
//! line each way, and the bytes themselves are not sent: the consumer receives the blocks'
//! hashes (so a prompt that does not match the held blocks is caught) and waits the link
//! model's transfer time instead.
//!
//! - `{"op":"read","engine_id":…,"request_id":…,"block_ids":[…],"generation":…}` answers the
//!   blocks' hashes and renews the hold;
//! - `{"op":"done","engine_id":…,"request_id":…}` releases the hold.
//!
//! Every read is bounded (one line of at most [`MAX_LINE`] bytes, [`IO_TIMEOUT`] per
//! operation) and a producer serves at most [`MAX_CONNECTIONS`] at once.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;
use tracing::debug;

use super::super::actor::{Command, EngineShared};

/// Longest request or reply line.
pub const MAX_LINE: u64 = 1 << 20;
/// Deadline of one operation (connect, send, answer).
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections a producer serves at once.
pub const MAX_CONNECTIONS: usize = 256;

/// One side-channel operation.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum SideRequest {
    /// Read held blocks (no block ids: only renew the hold).
    Read {
        /// The producer the consumer expects (`remote_engine_id`).
        engine_id: String,
        /// The hold's name (`remote_request_id`, or the shared request id before 0.13).
        request_id: String,
        /// Producer block ids to read.
        block_ids: Vec<u64>,
        /// `remote_registration_generation`, when the release sends it.
        generation: Option<u64>,
    },
    /// Release the hold.
    Done {
        /// The producer the consumer expects.
        engine_id: String,
        /// The hold's name.
        request_id: String,
    },
}

/// A producer's answer.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SideReply {
    /// Whether the operation succeeded.
    pub ok: bool,
    /// Why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The hashes of the blocks read, in the order asked.
    #[serde(default)]
    pub block_hashes: Vec<u64>,
}

impl SideReply {
    fn refused(error: impl Into<String>) -> Self {
        Self {
            ok: false,
            error: Some(error.into()),
            block_hashes: Vec::new(),
        }
    }
}

/// What a producer's side channel serves.
pub struct Producer {
    /// Its engine id.
    pub engine_id: String,
    /// Its holds.
    pub shared: Arc<EngineShared>,
    /// Its engine task, to release pulled holds.
    pub commands: mpsc::UnboundedSender<Command>,
}

impl Producer {
    fn answer(&self, request: SideRequest) -> SideReply {
        let (engine_id, request_id) = match &request {
            SideRequest::Read {
                engine_id,
                request_id,
                ..
            }
            | SideRequest::Done {
                engine_id,
                request_id,
            } => (engine_id, request_id),
        };
        if *engine_id != self.engine_id {
            return SideReply::refused(format!(
                "engine id mismatch: this producer is {:?}, the request names {engine_id:?}",
                self.engine_id
            ));
        }
        let mut leases = self.shared.leases.lock();
        match request {
            SideRequest::Read {
                ref block_ids,
                generation,
                ..
            } => {
                if let Some(g) = generation
                    && g != leases.generation()
                {
                    return SideReply::refused(format!(
                        "registration generation {g} is stale: the producer restarted (now {})",
                        leases.generation()
                    ));
                }
                match leases.begin_pull(request_id, block_ids, Instant::now()) {
                    Ok(block_hashes) => SideReply {
                        ok: true,
                        error: None,
                        block_hashes,
                    },
                    Err(e) => SideReply::refused(e.to_string()),
                }
            }
            SideRequest::Done { .. } => match leases.finish_pull(request_id) {
                Ok(id) => {
                    let _ = self.commands.send(Command::Release(id));
                    SideReply {
                        ok: true,
                        ..SideReply::default()
                    }
                }
                Err(e) => SideReply::refused(e.to_string()),
            },
        }
    }
}

async fn read_line(stream: &mut BufReader<TcpStream>) -> std::io::Result<String> {
    let mut line = String::new();
    let n = (&mut *stream).take(MAX_LINE).read_line(&mut line).await?;
    if n == 0 || !line.ends_with('\n') {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the line is empty, cut short or longer than the limit",
        ));
    }
    Ok(line)
}

async fn serve_one(stream: TcpStream, producer: &Producer) -> std::io::Result<()> {
    let mut stream = BufReader::new(stream);
    let line = read_line(&mut stream).await?;
    let reply = match serde_json::from_str::<SideRequest>(&line) {
        Ok(request) => producer.answer(request),
        Err(e) => SideReply::refused(format!("malformed side-channel request: {e}")),
    };
    let mut out = serde_json::to_vec(&reply).expect("replies serialize");
    out.push(b'\n');
    stream.get_mut().write_all(&out).await
}

/// Serves a producer's side channel until the listener fails.
pub async fn serve(listener: TcpListener, producer: Arc<Producer>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let producer = producer.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(IO_TIMEOUT, serve_one(stream, &producer)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(error = %e, "side-channel connection failed"),
                Err(_) => debug!("side-channel connection timed out"),
            }
        });
    }
}

/// Sends one operation to the producer at `addr` (`host:port`); an unreachable, slow or
/// refusing producer is an error that says which.
pub async fn call(addr: &str, request: &SideRequest) -> Result<SideReply, String> {
    let exchange = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("cannot reach the producer's side channel at {addr}: {e}"))?;
        let mut stream = BufReader::new(stream);
        let mut line = serde_json::to_vec(request).expect("requests serialize");
        line.push(b'\n');
        stream
            .get_mut()
            .write_all(&line)
            .await
            .map_err(|e| format!("side channel {addr}: {e}"))?;
        let answer = read_line(&mut stream)
            .await
            .map_err(|e| format!("side channel {addr}: {e}"))?;
        serde_json::from_str::<SideReply>(&answer)
            .map_err(|e| format!("side channel {addr}: malformed reply: {e}"))
    };
    tokio::time::timeout(IO_TIMEOUT, exchange)
        .await
        .map_err(|_| format!("side channel {addr}: no answer within {IO_TIMEOUT:?}"))?
}
