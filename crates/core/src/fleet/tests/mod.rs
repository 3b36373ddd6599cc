//! Decision tests with a manual clock and no sockets: the fleet is fed observations as the
//! router would feed them, and its plans are checked. The builders and helpers that several
//! topics use are here; the tests are in the submodules, one topic each.

use super::*;
use crate::event::{BlockStored, EngineHash, KvEvent};
use crate::keys::router_keys;

mod cache_picture;
mod conversations;
mod flow_control;
mod health;
mod learning;
mod load;
mod shared_prefixes;
mod tiers;

const BS: usize = 16;
const MODEL: &str = "m";

/// A fleet under construction.
struct FleetBuilder {
    specs: Vec<EndpointSpec>,
    config: FleetConfig,
    profile: Profile,
}

impl FleetBuilder {
    fn new(endpoints: usize) -> Self {
        Self {
            specs: (0..endpoints).map(|i| spec(&format!("e{i}"), BS)).collect(),
            config: FleetConfig::default(),
            profile: Profile::default(),
        }
    }

    fn build(self) -> Fleet {
        Fleet::new(self.config, self.profile, self.specs).unwrap()
    }
}

fn spec(name: &str, block_size: usize) -> EndpointSpec {
    EndpointSpec {
        name: name.into(),
        models: vec![MODEL.into()],
        role: Role::Both,
        has_events: true,
        block_size,
        offload: Default::default(),
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|t| t.wrapping_mul(31) ^ salt).collect()
}

/// What an engine publishes after prefilling `tokens` (its full blocks, one chain).
fn stored(tokens: &[u32], block_size: usize) -> KvEvent {
    let keys = router_keys(tokens, block_size, None).unwrap();
    let full = keys.len() * block_size;
    KvEvent::BlockStored(BlockStored {
        block_hashes: keys.iter().map(|k| EngineHash(k.0 ^ 0x55)).collect(),
        parent_block_hash: None,
        token_ids: tokens[..full].to_vec(),
        block_size: block_size as u32,
        ..Default::default()
    })
}

/// A scrape's vLLM gauges: `waiting` and `running` requests, `kv_usage` (0–1), and the cache's
/// capacity in blocks.
fn gauges(waiting: f64, running: f64, kv_usage: f64, num_gpu_blocks: usize) -> LoadSample {
    LoadSample {
        waiting: Some(waiting),
        running: Some(running),
        kv_usage: Some(kv_usage),
        num_gpu_blocks: Some(num_gpu_blocks),
    }
}

/// Every endpoint of `fleet` scraped at time 0 idle, with a cache of `num_gpu_blocks` blocks.
fn scrape_idle(fleet: &mut Fleet, num_gpu_blocks: usize) {
    let sample = gauges(0.0, 0.0, 0.0, num_gpu_blocks);
    for at in 0..fleet.endpoints().len() {
        fleet.observe_load(EndpointId(at as u32), sample, 0.0);
    }
}

/// A request as the router prepares it.
struct Req {
    keys: Arc<Vec<RouterKey>>,
    tokens: usize,
    session: Option<String>,
    model: &'static str,
    block_size: usize,
}

impl Req {
    fn new(tokens: &[u32]) -> Self {
        Self::sized(tokens, BS)
    }

    fn sized(tokens: &[u32], block_size: usize) -> Self {
        Self {
            keys: Arc::new(router_keys(tokens, block_size, None).unwrap()),
            tokens: tokens.len(),
            session: None,
            model: MODEL,
            block_size,
        }
    }

    fn features(&self) -> RequestFeatures<'_> {
        RequestFeatures {
            model: self.model,
            keys: &self.keys,
            prompt_tokens: self.tokens,
            block_size: self.block_size,
            session: self.session.as_deref(),
            role: Role::Both,
        }
    }
}

/// Plans, dispatches to the choice, and returns the dispatch.
fn send(fleet: &mut Fleet, req: &Req, now: f64) -> (Plan, Dispatch) {
    let plan = fleet.plan(&req.features(), 7, now);
    let chosen = plan.decision.chosen().expect("a candidate");
    let dispatch = fleet.dispatched(&plan.predicted_cached, &req.features(), chosen, now);
    (plan, dispatch)
}

/// Sends `req` to `endpoint` (whatever the plan says) at `now`.
fn send_to(fleet: &mut Fleet, req: &Req, endpoint: EndpointId, now: f64) -> Dispatch {
    let plan = fleet.plan(&req.features(), 7, now);
    fleet.dispatched(&plan.predicted_cached, &req.features(), endpoint, now)
}

/// What an offloading connector publishes for `tokens` (one hash per block, no tokens), and
/// the GPU's removal of the same blocks: the prefix survives on `medium` only.
fn offloaded_only(tokens: &[u32], medium: &str) -> Vec<KvEvent> {
    let KvEvent::BlockStored(gpu) = stored(tokens, BS) else {
        unreachable!()
    };
    vec![
        KvEvent::BlockStored(gpu.clone()),
        KvEvent::BlockStored(BlockStored {
            block_hashes: gpu.block_hashes.clone(),
            medium: Some(medium.into()),
            ..Default::default()
        }),
        KvEvent::BlockRemoved(crate::event::BlockRemoved {
            block_hashes: gpu.block_hashes,
            medium: Some("GPU".into()),
            group_idx: None,
        }),
    ]
}
