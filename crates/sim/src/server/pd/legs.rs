//! The two legs of a P/D request as one engine serves them: which leg a request is (from its
//! `kv_transfer_params` and the engine's role), the params a producer returns, and a
//! consumer's pull (own prefix cache first, then only the missing blocks from the producer).

use std::time::Duration;

use kvroute_vllm::nixl::{KvTransferParams, ProducerParams};
use kvroute_vllm::openai::ApiError;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::PdEngine;
use super::side_channel::{SideRequest, call};
use crate::engine::{EngineRequest, HeldBlocks, KvTransfer};
use crate::server::actor::Command;
use crate::server::faults::Faults;

/// Which leg a generation request is.
#[derive(Debug)]
pub enum Leg {
    /// An ordinary (aggregated) request.
    Plain,
    /// `do_remote_decode`: prefill, answer one token and the params, hold the blocks.
    Prefill,
    /// `do_remote_prefill`: pull from the named producer, then decode.
    Decode(Box<KvTransferParams>),
}

/// Reads the request's leg. Without a connector the params are ignored, as vLLM does.
pub fn classify(pd: Option<&PdEngine>, body: &[u8]) -> Result<Leg, ApiError> {
    let Some(pd) = pd else {
        return Ok(Leg::Plain);
    };
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("request body is not valid JSON: {e}"), None))?;
    let params = KvTransferParams::from_body(&value)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("kv_transfer_params")))?;
    let Some(params) = params else {
        return Ok(Leg::Plain);
    };
    let refuse = |what: &str| {
        Err(ApiError::bad_request(
            format!(
                "this engine's kv_role is {}: it cannot serve {what}",
                pd.role.vllm_name()
            ),
            Some("kv_transfer_params"),
        ))
    };
    match (params.do_remote_decode, params.do_remote_prefill) {
        (true, true) => Err(ApiError::bad_request(
            "kv_transfer_params cannot set both do_remote_decode and do_remote_prefill",
            Some("kv_transfer_params"),
        )),
        (true, false) if !pd.role.produces() => refuse("a prefill leg (do_remote_decode)"),
        (true, false) => Ok(Leg::Prefill),
        (false, true) if !pd.role.consumes() => refuse("a decode leg (do_remote_prefill)"),
        (false, true) => Ok(Leg::Decode(Box::new(params))),
        (false, false) => Ok(Leg::Plain),
    }
}

/// The `kv_transfer_params` a producer returns for its held blocks.
pub fn producer_params(
    pd: &PdEngine,
    held: &HeldBlocks,
    name: &str,
    prompt_tokens: usize,
    lease: Duration,
    generation: u64,
) -> Value {
    ProducerParams {
        engine_id: pd.engine_id.clone(),
        host: pd.side_channel.0.clone(),
        port: pd.side_channel.1,
        block_ids: held.block_ids.iter().map(|&b| u64::from(b)).collect(),
        request_id: name.to_owned(),
        num_tokens: prompt_tokens as u64,
        expiry_unix_s: super::super::actor::unix_now() + lease.as_secs_f64(),
        registration_generation: generation,
    }
    .to_json(pd.release)
}

/// Why a decode leg could not get its blocks.
#[derive(Debug)]
pub enum PullError {
    /// The params do not name a producer: the request is malformed (400).
    Invalid(String),
    /// The transfer failed: `kv_load_failure_policy` decides.
    Failed(String),
}

/// Pulls the blocks a decode leg lacks from its producer and waits the link's transfer time;
/// the engine then takes them as a prefix hit. A full local hit only tells the producer to
/// release its hold.
pub async fn pull(
    pd: &PdEngine,
    commands: &mpsc::UnboundedSender<Command>,
    faults: &Faults,
    request: &EngineRequest,
    params: &KvTransferParams,
    own_request_id: &str,
) -> Result<KvTransfer, PullError> {
    let missing = |what: &str| {
        PullError::Invalid(format!(
            "kv_transfer_params.{what} is required for do_remote_prefill"
        ))
    };
    let engine_id = params
        .remote_engine_id
        .clone()
        .ok_or_else(|| missing("remote_engine_id"))?;
    let host = params
        .remote_host
        .clone()
        .ok_or_else(|| missing("remote_host"))?;
    let port = params.remote_port.ok_or_else(|| missing("remote_port"))?;
    let remote_blocks = params
        .remote_block_ids
        .clone()
        .ok_or_else(|| missing("remote_block_ids"))?;
    // Before 0.13 the consumer finds the hold by the request id both legs share.
    let request_id = if pd.release.has_remote_request_id() {
        params
            .remote_request_id
            .clone()
            .ok_or_else(|| missing("remote_request_id"))?
    } else {
        own_request_id.to_owned()
    };
    let addr = format!("{host}:{port}");

    let (reply, answer) = oneshot::channel();
    commands
        .send(Command::LocalPrefix(request.clone(), reply))
        .map_err(|_| PullError::Failed("the engine stopped".into()))?;
    let (local, hashes) = answer
        .await
        .map_err(|_| PullError::Failed("the engine stopped".into()))?;
    let wanted = hashes.len().min(remote_blocks.len());
    let done = SideRequest::Done {
        engine_id: engine_id.clone(),
        request_id: request_id.clone(),
    };
    if local >= wanted {
        // Nothing to read: only let the producer free its blocks.
        if let Err(e) = call(&addr, &done).await {
            tracing::warn!(error = %e, "could not release the producer's hold after a full local hit");
        }
        return Ok(KvTransfer::Consume {
            from: local,
            blocks: local,
        });
    }
    let read = SideRequest::Read {
        engine_id,
        request_id,
        block_ids: remote_blocks[local..wanted].to_vec(),
        generation: params.remote_registration_generation,
    };
    let result = async {
        let reply = call(&addr, &read).await.map_err(PullError::Failed)?;
        if !reply.ok {
            return Err(PullError::Failed(format!(
                "the producer refused the read: {}",
                reply.error.unwrap_or_default()
            )));
        }
        if reply.block_hashes != hashes[local..wanted] {
            return Err(PullError::Failed(
                "the producer's blocks hold a different prompt than this request".into(),
            ));
        }
        let tokens = ((wanted - local) * pd.block_size) as u64;
        let bytes = tokens * pd.kv_bytes_per_token;
        let seconds = pd
            .fabric
            .transfer(&addr, &pd.nic, bytes, faults.link_slowdown.max(1.0))
            .await
            .ok_or_else(|| PullError::Failed("the link model stopped".into()))?;
        if faults.kv_transfer_failure_fraction > 0.0
            && rand::random_bool(faults.kv_transfer_failure_fraction.clamp(0.0, 1.0))
        {
            return Err(PullError::Failed("an injected KV transfer failure".into()));
        }
        let reply = call(&addr, &done).await.map_err(PullError::Failed)?;
        if !reply.ok {
            return Err(PullError::Failed(format!(
                "the producer lost the blocks during the transfer: {}",
                reply.error.unwrap_or_default()
            )));
        }
        pd.metrics.lock().transferred(seconds, bytes, tokens);
        Ok(KvTransfer::Consume {
            from: local,
            blocks: wanted,
        })
    }
    .await;
    if result.is_err() {
        pd.metrics.lock().failed();
    }
    result
}
