//! vLLM's NixlConnector protocol for prefill/decode disaggregation, per release
//! (`vllm-wire.md` §5): the engine roles, the `kv_transfer_params` object a request carries and
//! a prefill engine returns, and what changed between releases (which keys exist, how long a
//! prefill engine holds the blocks, whether a streamed answer carries the params).
//!
//! Pull mode (the default): the proxy sends the prefill leg with [`prefill_request_params`]
//! (`do_remote_decode: true`) and `max_tokens: 1`; the prefill engine answers one token and a
//! top-level `kv_transfer_params` naming itself (engine id, side channel, block ids); the proxy
//! hands that object, unchanged, to the decode engine, which pulls the blocks it lacks.

use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::VllmError;

/// An engine's part in P/D, as `--kv-transfer-config`'s `kv_role` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvRole {
    /// `kv_producer`: runs prefill legs and holds their blocks for a consumer.
    #[serde(rename = "kv_producer")]
    Producer,
    /// `kv_consumer`: runs decode legs, pulling the prompt's blocks from a producer.
    #[serde(rename = "kv_consumer")]
    Consumer,
    /// `kv_both`: either leg (vLLM's usual setting for NixlConnector).
    #[serde(rename = "kv_both")]
    Both,
}

impl KvRole {
    /// Whether the engine accepts `do_remote_decode` (a prefill leg).
    pub fn produces(self) -> bool {
        matches!(self, KvRole::Producer | KvRole::Both)
    }

    /// Whether the engine accepts `do_remote_prefill` (a decode leg).
    pub fn consumes(self) -> bool {
        matches!(self, KvRole::Consumer | KvRole::Both)
    }

    /// vLLM's name: `kv_producer`, `kv_consumer` or `kv_both`.
    pub fn vllm_name(self) -> &'static str {
        match self {
            KvRole::Producer => "kv_producer",
            KvRole::Consumer => "kv_consumer",
            KvRole::Both => "kv_both",
        }
    }
}

impl FromStr for KvRole {
    type Err = VllmError;

    /// `producer`, `consumer`, `both`, or vLLM's `kv_`-prefixed names.
    fn from_str(s: &str) -> Result<Self, VllmError> {
        match s.trim().trim_start_matches("kv_") {
            "producer" => Ok(KvRole::Producer),
            "consumer" => Ok(KvRole::Consumer),
            "both" => Ok(KvRole::Both),
            _ => Err(VllmError::KvTransfer(format!(
                "unknown kv_role {s:?}: expected producer, consumer or both"
            ))),
        }
    }
}

/// What a decode engine does when pulling the blocks fails (`kv_load_failure_policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvLoadFailurePolicy {
    /// The request fails (vLLM's default).
    #[default]
    Fail,
    /// The decode engine prefills what it could not pull, and the request succeeds.
    Recompute,
}

impl FromStr for KvLoadFailurePolicy {
    type Err = VllmError;

    fn from_str(s: &str) -> Result<Self, VllmError> {
        match s.trim() {
            "fail" => Ok(Self::Fail),
            "recompute" => Ok(Self::Recompute),
            _ => Err(VllmError::KvTransfer(format!(
                "unknown kv_load_failure_policy {s:?}: expected fail or recompute"
            ))),
        }
    }
}

/// How a prefill engine bounds the time it holds blocks nobody pulls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseKind {
    /// A fixed deadline from the end of the prefill (`VLLM_NIXL_ABORT_REQUEST_TIMEOUT`).
    AbortTimeout,
    /// A lease renewed by the decode engine's heartbeats (`kv_lease_duration`, 0.33).
    Heartbeat,
}

/// The release's default hold on prefilled blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct LeasePolicy {
    /// Which mechanism.
    pub kind: LeaseKind,
    /// How long, in engine seconds.
    pub duration: Duration,
}

/// What one vLLM release's NixlConnector does on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NixlRelease {
    minor: (u32, u32),
}

impl NixlRelease {
    /// The behaviour of a vLLM version such as `0.33.0`.
    pub fn for_vllm_version(version: &str) -> Result<Self, VllmError> {
        let (major, minor, patch) = crate::codec::parse_version(version)?;
        Ok(Self {
            minor: if major > 0 {
                (u32::MAX, 0)
            } else {
                (minor, patch)
            },
        })
    }

    fn at_least(&self, minor: u32) -> bool {
        self.minor >= (minor, 0)
    }

    /// The release's default hold on unpulled blocks: `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` of
    /// 120 s (as in 0.11) before 0.20, 480 s from 0.20, and the 30 s heartbeat lease of 0.33.
    pub fn default_lease(&self) -> LeasePolicy {
        if self.at_least(33) {
            LeasePolicy {
                kind: LeaseKind::Heartbeat,
                duration: Duration::from_secs(30),
            }
        } else {
            LeasePolicy {
                kind: LeaseKind::AbortTimeout,
                duration: Duration::from_secs(if self.at_least(20) { 480 } else { 120 }),
            }
        }
    }

    /// Whether the returned params name the producer's request (`remote_request_id`, 0.13+);
    /// before, the decode engine finds the blocks by sharing the prefill's `X-Request-Id`.
    pub fn has_remote_request_id(&self) -> bool {
        self.at_least(13)
    }

    /// Whether a streamed prefill answer carries the params on its final chunk (0.33+).
    pub fn streams_params(&self) -> bool {
        self.at_least(33)
    }

    /// Whether a decode engine reports `cached_tokens` from the proxy-supplied
    /// `remote_prefill_cached_tokens` (0.33+) instead of its local plus pulled hits.
    pub fn reports_remote_cached_tokens(&self) -> bool {
        self.at_least(33)
    }
}

/// The `kv_transfer_params` a proxy puts on the prefill leg (the same in every release).
pub fn prefill_request_params() -> Value {
    json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    })
}

/// A client's request body without the `kv_transfer_params` it named, or `None` when it named
/// none (or is not an object). Under P/D only the router may name a producer: a client's own
/// params could make an engine pull from (connect to) any address.
pub fn without_client_params(client: &Value) -> Option<Value> {
    client.get("kv_transfer_params")?;
    let mut body = client.clone();
    body.as_object_mut()?.remove("kv_transfer_params");
    Some(body)
}

/// The prefill leg a proxy derives from a client's request body (`vllm-wire.md` §5.1): the
/// same body with [`prefill_request_params`], `stream: false`, `max_tokens: 1` (and
/// `max_completion_tokens: 1` if the client set it), and without `stream_options`,
/// `min_tokens` and `min_completion_tokens`. A body that is not an object is returned as is.
pub fn prefill_leg_body(client: &Value) -> Value {
    let mut leg = client.clone();
    if let Some(map) = leg.as_object_mut() {
        map.insert("kv_transfer_params".into(), prefill_request_params());
        map.insert("stream".into(), false.into());
        map.insert("max_tokens".into(), 1.into());
        if map.contains_key("max_completion_tokens") {
            map.insert("max_completion_tokens".into(), 1.into());
        }
        for key in ["stream_options", "min_tokens", "min_completion_tokens"] {
            map.remove(key);
        }
    }
    leg
}

/// The `kv_transfer_params` a prefill engine returned in its (non-streaming) answer. A 200
/// without them is a failed prefill leg, not a success: the decode leg would recompute.
pub fn prefill_answer_params(answer: &Value) -> Result<&Map<String, Value>, VllmError> {
    match answer.get("kv_transfer_params") {
        Some(Value::Object(params)) if params.get("do_remote_prefill") == Some(&Value::Bool(true)) => {
            Ok(params)
        }
        Some(Value::Object(_)) => Err(VllmError::KvTransfer(
            "the prefill answer's kv_transfer_params do not ask for a remote prefill".into(),
        )),
        _ => Err(VllmError::KvTransfer(
            "the prefill answer carries no kv_transfer_params: is the engine a kv_producer with NixlConnector?"
                .into(),
        )),
    }
}

/// The decode leg: the client's original body (its own `stream`, `max_tokens`, ...) with
/// `kv_transfer_params` set to what the prefill engine returned, unchanged. With
/// `prefill_cached_tokens` (0.33+), `remote_prefill_cached_tokens` is added so that the decode
/// engine reports the prefill engine's cache hits as `cached_tokens`.
pub fn decode_leg_body(
    client: &Value,
    params: &Map<String, Value>,
    prefill_cached_tokens: Option<u64>,
) -> Value {
    let mut leg = client.clone();
    if let Some(map) = leg.as_object_mut() {
        let mut params = params.clone();
        if let Some(cached) = prefill_cached_tokens {
            params.insert("remote_prefill_cached_tokens".into(), cached.into());
        }
        map.insert("kv_transfer_params".into(), Value::Object(params));
    }
    leg
}

/// When the producer that returned `params` stops holding the blocks, seconds since the Unix
/// epoch: its `remote_blocks_expiry_time` (0.26+). `None` when the release does not say (its
/// lease then is [`NixlRelease::default_lease`], many seconds).
pub fn lease_expiry_unix_s(params: &Map<String, Value>) -> Option<f64> {
    params
        .get("remote_blocks_expiry_time")
        .and_then(Value::as_f64)
}

/// `kv_transfer_params` as a request carries it. Unknown keys are kept, so forwarding is
/// lossless.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KvTransferParams {
    /// Prefill leg: run the prefill and hold the blocks for a consumer.
    pub do_remote_decode: bool,
    /// Decode leg: pull the prompt's blocks from the named producer.
    pub do_remote_prefill: bool,
    /// The producer's engine id.
    pub remote_engine_id: Option<String>,
    /// The producer's block ids (per KV group in hybrid models: flattened here).
    pub remote_block_ids: Option<Vec<u64>>,
    /// The producer's side-channel host.
    pub remote_host: Option<String>,
    /// The producer's side-channel port.
    pub remote_port: Option<u16>,
    /// The producer's request id (0.13+).
    pub remote_request_id: Option<String>,
    /// The prompt tokens the producer prefilled (0.21+).
    pub remote_num_tokens: Option<u64>,
    /// The producer's registration generation (0.33+): changes when it restarts.
    pub remote_registration_generation: Option<u64>,
    /// Supplied by a proxy: the prompt tokens the producer found cached (0.33 reports this as
    /// the decode leg's `cached_tokens`).
    pub remote_prefill_cached_tokens: Option<u64>,
    /// Every key, as received.
    pub raw: Map<String, Value>,
}

fn bad(key: &str, want: &str) -> VllmError {
    VllmError::KvTransfer(format!("kv_transfer_params.{key} must be {want}"))
}

fn opt<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

fn opt_bool(map: &Map<String, Value>, key: &str) -> Result<bool, VllmError> {
    opt(map, key).map_or(Ok(false), |v| {
        v.as_bool().ok_or_else(|| bad(key, "a boolean"))
    })
}

fn opt_str(map: &Map<String, Value>, key: &str) -> Result<Option<String>, VllmError> {
    opt(map, key)
        .map(|v| {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| bad(key, "a string"))
        })
        .transpose()
}

fn opt_u64(map: &Map<String, Value>, key: &str) -> Result<Option<u64>, VllmError> {
    opt(map, key)
        .map(|v| v.as_u64().ok_or_else(|| bad(key, "a non-negative integer")))
        .transpose()
}

fn block_ids(value: &Value) -> Option<Vec<u64>> {
    let mut out = Vec::new();
    for item in value.as_array()? {
        match item {
            Value::Array(group) => {
                for id in group {
                    out.push(id.as_u64()?);
                }
            }
            id => out.push(id.as_u64()?),
        }
    }
    Some(out)
}

impl KvTransferParams {
    /// Reads the `kv_transfer_params` field of a request body: `None` when absent or null, an
    /// error when it is not an object or a known key has the wrong type.
    pub fn from_body(body: &Value) -> Result<Option<Self>, VllmError> {
        match body.get("kv_transfer_params") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(map)) => Self::from_map(map).map(Some),
            Some(_) => Err(VllmError::KvTransfer(
                "kv_transfer_params must be an object".into(),
            )),
        }
    }

    /// Reads a `kv_transfer_params` object.
    pub fn from_map(map: &Map<String, Value>) -> Result<Self, VllmError> {
        let remote_port = opt_u64(map, "remote_port")?
            .map(|p| u16::try_from(p).map_err(|_| bad("remote_port", "a port number")))
            .transpose()?;
        Ok(Self {
            do_remote_decode: opt_bool(map, "do_remote_decode")?,
            do_remote_prefill: opt_bool(map, "do_remote_prefill")?,
            remote_engine_id: opt_str(map, "remote_engine_id")?,
            remote_block_ids: opt(map, "remote_block_ids")
                .map(|v| {
                    block_ids(v)
                        .ok_or_else(|| bad("remote_block_ids", "a list of block ids (or of lists)"))
                })
                .transpose()?,
            remote_host: opt_str(map, "remote_host")?,
            remote_port,
            remote_request_id: opt_str(map, "remote_request_id")?,
            remote_num_tokens: opt_u64(map, "remote_num_tokens")?,
            remote_registration_generation: opt_u64(map, "remote_registration_generation")?,
            remote_prefill_cached_tokens: opt_u64(map, "remote_prefill_cached_tokens")?,
            raw: map.clone(),
        })
    }
}

/// What a producer knows about a finished prefill leg, to answer its `kv_transfer_params`.
#[derive(Clone, Debug, PartialEq)]
pub struct ProducerParams {
    /// The producer's engine id.
    pub engine_id: String,
    /// Its side-channel host.
    pub host: String,
    /// Its side-channel port.
    pub port: u16,
    /// The held blocks (full blocks of the prompt only).
    pub block_ids: Vec<u64>,
    /// The producer's request id.
    pub request_id: String,
    /// Prompt tokens prefilled.
    pub num_tokens: u64,
    /// When the hold expires, seconds since the Unix epoch.
    pub expiry_unix_s: f64,
    /// Changes each time the producer (re)starts.
    pub registration_generation: u64,
}

impl ProducerParams {
    /// The `kv_transfer_params` object this release's producer returns: exactly its keys
    /// (`vllm-wire.md` §5.1 table), in pull mode, tensor/pipeline/context parallel size 1.
    pub fn to_json(&self, release: NixlRelease) -> Value {
        let mut map = Map::new();
        map.insert("do_remote_prefill".into(), true.into());
        map.insert("do_remote_decode".into(), false.into());
        map.insert("remote_block_ids".into(), json!(self.block_ids));
        map.insert("remote_engine_id".into(), json!(self.engine_id));
        map.insert("remote_host".into(), json!(self.host));
        map.insert("remote_port".into(), json!(self.port));
        if release.minor >= (9, 2) {
            map.insert("tp_size".into(), json!(1));
        }
        if release.at_least(13) {
            map.insert("remote_request_id".into(), json!(self.request_id));
        }
        if release.at_least(21) {
            map.insert("remote_num_tokens".into(), json!(self.num_tokens));
        }
        if release.at_least(26) {
            map.insert(
                "remote_blocks_expiry_time".into(),
                json!(self.expiry_unix_s),
            );
        }
        if release.at_least(28) {
            map.insert("transfer_mode".into(), json!("pull"));
        }
        if release.at_least(29) {
            map.insert("dcp_size".into(), json!(1));
            map.insert("pp_size".into(), json!(1));
        }
        if release.at_least(33) {
            map.insert(
                "remote_registration_generation".into(),
                json!(self.registration_generation),
            );
        }
        Value::Object(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clients_own_params_are_removed_and_nothing_else() {
        let client = json!({"model": "m", "prompt": "hi", "kv_transfer_params": {"remote_host": "10.9.9.9"}});
        assert_eq!(
            without_client_params(&client),
            Some(json!({"model": "m", "prompt": "hi"}))
        );
        assert_eq!(without_client_params(&json!({"model": "m"})), None);
        assert_eq!(without_client_params(&json!([1, 2])), None);
    }

    #[test]
    fn the_lease_expiry_is_read_from_a_producers_params() {
        let producer = ProducerParams {
            engine_id: "p".into(),
            host: "127.0.0.1".into(),
            port: 5600,
            block_ids: vec![1],
            request_id: "r".into(),
            num_tokens: 16,
            expiry_unix_s: 1234.5,
            registration_generation: 0,
        };
        let params = |version: &str| {
            let release = NixlRelease::for_vllm_version(version).unwrap();
            producer.to_json(release).as_object().unwrap().clone()
        };
        assert_eq!(lease_expiry_unix_s(&params("0.26.0")), Some(1234.5));
        assert_eq!(lease_expiry_unix_s(&params("0.20.0")), None);
    }

    fn producer() -> ProducerParams {
        ProducerParams {
            engine_id: "e1".into(),
            host: "127.0.0.1".into(),
            port: 5600,
            block_ids: vec![3, 4],
            request_id: "cmpl-x".into(),
            num_tokens: 40,
            expiry_unix_s: 1.5,
            registration_generation: 2,
        }
    }

    #[test]
    fn each_release_returns_exactly_its_keys() {
        let keys = |v: &str| {
            let value = producer().to_json(NixlRelease::for_vllm_version(v).unwrap());
            let mut k: Vec<String> = value.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k.join(",")
        };
        assert_eq!(
            keys("0.9.0"),
            "do_remote_decode,do_remote_prefill,remote_block_ids,remote_engine_id,remote_host,remote_port"
        );
        assert!(
            keys("0.12.0").contains("tp_size") && !keys("0.12.0").contains("remote_request_id")
        );
        assert!(keys("0.13.0").contains("remote_request_id"));
        assert!(!keys("0.20.0").contains("remote_num_tokens"));
        assert!(keys("0.21.0").contains("remote_num_tokens"));
        assert!(keys("0.26.0").contains("remote_blocks_expiry_time"));
        assert!(keys("0.28.0").contains("transfer_mode"));
        assert!(keys("0.29.0").contains("pp_size"));
        assert!(!keys("0.32.0").contains("remote_registration_generation"));
        assert!(keys("0.33.0").contains("remote_registration_generation"));
    }

    #[test]
    fn returned_params_parse_back_unchanged() {
        let release = NixlRelease::for_vllm_version("0.33.0").unwrap();
        let value = producer().to_json(release);
        let body = json!({"kv_transfer_params": value});
        let parsed = KvTransferParams::from_body(&body).unwrap().unwrap();
        assert!(parsed.do_remote_prefill && !parsed.do_remote_decode);
        assert_eq!(parsed.remote_block_ids, Some(vec![3, 4]));
        assert_eq!(parsed.remote_port, Some(5600));
        assert_eq!(parsed.remote_request_id.as_deref(), Some("cmpl-x"));
        assert_eq!(Value::Object(parsed.raw), body["kv_transfer_params"]);
    }

    #[test]
    fn the_proxy_template_is_a_prefill_leg_and_bad_shapes_are_refused() {
        let parsed =
            KvTransferParams::from_body(&json!({"kv_transfer_params": prefill_request_params()}))
                .unwrap()
                .unwrap();
        assert!(parsed.do_remote_decode && !parsed.do_remote_prefill);
        assert_eq!(parsed.remote_engine_id, None);
        assert!(KvTransferParams::from_body(&json!({})).unwrap().is_none());
        assert!(KvTransferParams::from_body(&json!({"kv_transfer_params": 3})).is_err());
        let err =
            KvTransferParams::from_body(&json!({"kv_transfer_params": {"remote_port": 70000}}))
                .unwrap_err();
        assert!(err.to_string().contains("remote_port"), "{err}");
        let nested = KvTransferParams::from_body(
            &json!({"kv_transfer_params": {"remote_block_ids": [[1, 2], [3]]}}),
        )
        .unwrap()
        .unwrap();
        assert_eq!(nested.remote_block_ids, Some(vec![1, 2, 3]));
    }

    #[test]
    fn the_legs_follow_the_reference_proxy() {
        let client = json!({"model": "m", "prompt": "hi", "stream": true, "max_tokens": 50,
            "max_completion_tokens": 50, "stream_options": {"include_usage": true},
            "min_tokens": 3, "min_completion_tokens": 3, "cache_salt": "s"});
        let prefill = prefill_leg_body(&client);
        assert_eq!(prefill["stream"], false);
        assert_eq!(prefill["max_tokens"], 1);
        assert_eq!(prefill["max_completion_tokens"], 1);
        assert_eq!(prefill["kv_transfer_params"], prefill_request_params());
        for gone in ["stream_options", "min_tokens", "min_completion_tokens"] {
            assert!(prefill.get(gone).is_none(), "{gone}");
        }
        assert_eq!(prefill["cache_salt"], "s");
        assert!(
            prefill_leg_body(&json!({"model": "m"}))
                .get("max_completion_tokens")
                .is_none()
        );

        let release = NixlRelease::for_vllm_version("0.33.0").unwrap();
        let answer = json!({"choices": [], "kv_transfer_params": producer().to_json(release)});
        let params = prefill_answer_params(&answer).unwrap();
        let decode = decode_leg_body(&client, params, None);
        let mut expected = client.clone();
        expected["kv_transfer_params"] = answer["kv_transfer_params"].clone();
        assert_eq!(decode, expected, "the client's body, the params unchanged");
        let counted = decode_leg_body(&client, params, Some(32));
        assert_eq!(
            counted["kv_transfer_params"]["remote_prefill_cached_tokens"],
            32
        );

        assert!(prefill_answer_params(&json!({"choices": []})).is_err());
        let err =
            prefill_answer_params(&json!({"kv_transfer_params": {"do_remote_prefill": false}}))
                .unwrap_err();
        assert!(err.to_string().contains("remote prefill"), "{err}");
    }

    #[test]
    fn roles_and_leases_by_release() {
        assert_eq!("kv_both".parse::<KvRole>().unwrap(), KvRole::Both);
        assert_eq!("producer".parse::<KvRole>().unwrap(), KvRole::Producer);
        assert!("decoder".parse::<KvRole>().is_err());
        assert!(KvRole::Producer.produces() && !KvRole::Producer.consumes());
        let lease = |v: &str| NixlRelease::for_vllm_version(v).unwrap().default_lease();
        assert_eq!(lease("0.11.0").duration, Duration::from_secs(120));
        assert_eq!(lease("0.20.0").duration, Duration::from_secs(480));
        assert_eq!(lease("0.33.0").kind, LeaseKind::Heartbeat);
        assert_eq!(lease("0.33.0").duration, Duration::from_secs(30));
    }
}
