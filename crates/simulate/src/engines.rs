//! The engines of a simulated fleet: kvroute-sim's engine model, unchanged, stepped in virtual
//! time. Each engine steps only while it has work; a step's state change happens when it
//! starts and its tokens and KV events come out when it ends, as in the simulated server.
//! Requests that arrive during a step wait in an inbox until the next one starts, as they wait
//! in the server's command channel: a scrape meanwhile does not count them as waiting.

use kvroute_core::load_counters::TierLoadCounters;
use kvroute_sim::engine::shared_fs::{SharedFs, SharedFsHandle};
use kvroute_sim::engine::{Engine, EngineConfig, EngineRequest, KvTransfer, StepOutput};
use kvroute_sim::server::text::{completion_seed, synthetic_completion};

use crate::SimulateError;

/// Load as the engine's `/metrics` shows it: gauges after its last finished step.
#[derive(Clone, Copy, Debug, Default)]
pub struct Observed {
    /// Requests waiting.
    pub waiting: f64,
    /// Requests running.
    pub running: f64,
    /// KV-cache usage, 0–1.
    pub kv_usage: f64,
}

/// One engine of the fleet.
pub struct SimEngine {
    engine: Engine,
    /// Each inbox request's part in P/D (by engine request id).
    transfers: std::collections::HashMap<u64, KvTransfer>,
    /// Request ids the engine handed out, as the server counts them (from 1): the id that
    /// seeds each answer.
    next_id: u64,
    /// Run-wide request index of each engine request id (id 1 at 0).
    requests: Vec<usize>,
    /// The step under way, until it ends.
    pending: Option<StepOutput>,
    /// Requests received (with their run-wide index) that the engine takes at its next step.
    inbox: Vec<(usize, EngineRequest)>,
    observed: Observed,
}

/// Why an engine refused a request, in the words the client would read.
pub type Refusal = String;

/// What starting a step gave: its duration (`None`: no work), and the requests the engine
/// refused (run-wide index, error).
pub type StepStart = (Option<f64>, Vec<(usize, Refusal)>);

impl SimEngine {
    /// One fresh engine per configuration; when the first configures a shared filesystem, they
    /// all mount that one.
    pub fn fleet(configs: Vec<EngineConfig>) -> Result<Vec<Self>, SimulateError> {
        let shared = configs
            .first()
            .and_then(|c| c.shared_fs.clone())
            .map(SharedFs::handle);
        configs
            .into_iter()
            .map(|config| Self::mounted(config, shared.clone()))
            .collect()
    }

    fn mounted(
        config: EngineConfig,
        shared: Option<SharedFsHandle>,
    ) -> Result<Self, SimulateError> {
        Ok(Self {
            engine: Engine::mounted(config, shared)?,
            next_id: 1,
            transfers: std::collections::HashMap::new(),
            requests: Vec::new(),
            pending: None,
            inbox: Vec::new(),
            observed: Observed::default(),
        })
    }

    /// Receives request `index` of the run, with the answer the simulated server would generate
    /// (the engine takes it at its next step). Returns that answer, or the error the client
    /// would see.
    pub fn submit(
        &mut self,
        index: usize,
        prompt: Vec<u32>,
        max_tokens: u32,
    ) -> Result<Vec<u32>, Refusal> {
        self.submit_leg(index, prompt, max_tokens, KvTransfer::None)
            .map(|(output, _)| output)
    }

    /// [`SimEngine::submit`] for a P/D leg; also returns the engine request id.
    pub fn submit_leg(
        &mut self,
        index: usize,
        prompt: Vec<u32>,
        max_tokens: u32,
        transfer: KvTransfer,
    ) -> Result<(Vec<u32>, u64), Refusal> {
        let max_len = self.engine.config().max_model_len;
        if prompt.len() + max_tokens as usize > max_len {
            return Err(format!(
                "HTTP 400: This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({} in the messages, {max_tokens} in the completion).",
                prompt.len() + max_tokens as usize,
                prompt.len()
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.requests.push(index);
        let output = synthetic_completion(completion_seed(id, &prompt), max_tokens as usize);
        let request = EngineRequest {
            id,
            prompt,
            output: output.clone(),
            lora_name: None,
            cache_salt: None,
        };
        if transfer != KvTransfer::None {
            self.transfers.insert(id, transfer);
        }
        self.inbox.push((index, request));
        Ok((output, id))
    }

    /// The prompt's prefix this engine holds, in blocks, and the blocks a prefix hit may
    /// cover (see [`Engine::local_prefix`]).
    pub fn local_prefix(&self, prompt: &[u32]) -> (usize, usize) {
        let (local, hashes) = self.engine.local_prefix(&EngineRequest {
            id: 0,
            prompt: prompt.to_vec(),
            output: Vec::new(),
            lora_name: None,
            cache_salt: None,
        });
        (local, hashes.len())
    }

    /// Releases the blocks a finished prefill leg holds (pulled).
    pub fn release(&mut self, id: u64) -> bool {
        self.engine.release(id)
    }

    /// The run-wide index of engine request `id`.
    pub fn request_index(&self, id: u64) -> usize {
        self.requests[(id - 1) as usize]
    }

    /// Starts a step if none is under way: the engine first takes the requests received since
    /// the last one. Returns the step's duration (`None`: no work) and the requests the engine
    /// refused, with the error the client reads.
    pub fn start_step(&mut self, engine: usize, now: f64) -> Result<StepStart, SimulateError> {
        if self.pending.is_some() {
            return Ok((None, Vec::new()));
        }
        let mut refused = Vec::new();
        for (index, request) in self.inbox.drain(..) {
            let transfer = self.transfers.remove(&request.id).unwrap_or_default();
            if let Err(e) = self.engine.add_request_with(request, transfer) {
                refused.push((index, format!("engine error: {e}")));
            }
        }
        if !self.engine.has_work() {
            return Ok((None, refused));
        }
        let step = self.engine.step_at(now);
        if step.tokens.is_empty() && step.work == Default::default() {
            if self.engine.held_requests() > 0 {
                // Every free block is held for a consumer: it runs again after a release.
                return Ok((None, refused));
            }
            return Err(SimulateError::Stalled { engine, at_s: now });
        }
        let duration = step.duration_s;
        self.pending = Some(step);
        Ok((Some(duration), refused))
    }

    /// Ends the step under way: its tokens and KV events come out, the gauges update.
    pub fn finish_step(&mut self) -> StepOutput {
        let step = self.pending.take().unwrap_or_default();
        let m = self.engine.metrics();
        self.observed = Observed {
            waiting: m.num_requests_waiting as f64,
            running: m.num_requests_running as f64,
            kv_usage: m.kv_cache_usage,
        };
        step
    }

    /// The gauges a scrape reads.
    pub fn observed(&self) -> Observed {
        self.observed
    }

    /// Its per-tier load counters (CPU, SSD, shared filesystem): tokens loaded and seconds the
    /// loads took, as its `/metrics` reports them.
    pub fn tier_load_counters(&self) -> TierLoadCounters {
        let m = self.engine.metrics();
        let tokens = [m.cpu_hit_tokens, m.ssd_hit_tokens, m.shared_fs_hit_tokens];
        TierLoadCounters {
            tokens: tokens.map(|t| Some(t as f64)),
            seconds: m.tier_load_seconds.map(Some),
        }
    }

    /// Prompt tokens looked up and found in the prefix cache so far.
    pub fn prefix_cache_counters(&self) -> (u64, u64) {
        let m = self.engine.metrics();
        (m.prefix_cache_queries, m.prefix_cache_hits)
    }
}
