//! The scheduler matrix: every policy on a grid of workload shapes, cache sizes and loads.
//!
//! A cell is a workload kind × tenants × context length × cache size relative to the working
//! set × offered rate relative to round-robin's saturation. Each cell runs every policy on
//! several seeds (a fresh fleet each time) and keeps, per policy, the median over seeds of the
//! hit rate, TTFT p50/p90/p99, ITL p99 and load imbalance, next to the pooled-cache ceiling.
//! [`report`] renders the results: a text table (with every policy's ITL p99 next to precise's,
//! so a reader sees whether decodes pay for precise's TTFT) and an HTML heat map of precise
//! against the best other policy.
//!
//! - The **working set** is the tenants' contexts, in blocks: what must stay cached for
//!   conversations to reuse it (a conversation's own history is reused only during its life).
//! - **Round-robin's saturation** is estimated from the engine model: engines ÷ the engine
//!   seconds one request costs under round-robin (its uncached prefill, at round-robin's hit
//!   rate measured on a probe run, plus its decode steps).

pub mod report;

use serde::Serialize;

use kvroute_bench::ceiling::{longest_request_tokens, pooled_hit_rate};
use kvroute_bench::result::RunResult;
use kvroute_bench::workload::{TenantSkew, Tenants, Workload, tenants};
use kvroute_sim::engine::EngineConfig;

use crate::{FleetConfig, SimulateError, simulate};

/// The shape of a cell's traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// One question per conversation under a tenant's context (llm-d's shared-prefix shape).
    TenantQuestions,
    /// Multi-turn conversations under a tenant's context.
    TenantChats,
    /// Like `TenantQuestions` with Zipf(1.1)-popular tenants and log-normal lengths (cv 0.5).
    SkewedQuestions,
}

impl Kind {
    /// Its name in tables.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::TenantQuestions => "questions",
            Kind::TenantChats => "chats",
            Kind::SkewedQuestions => "skewed",
        }
    }
}

/// What a matrix sweeps.
#[derive(Clone, Debug, Serialize)]
pub struct MatrixSpec {
    /// Workload kinds.
    pub kinds: Vec<Kind>,
    /// Tenant counts.
    pub tenants: Vec<usize>,
    /// Mean context lengths, tokens.
    pub context_tokens: Vec<usize>,
    /// The fleet's pooled cache over the working set.
    pub cache_ratios: Vec<f64>,
    /// Offered request rate over round-robin's saturation rate.
    pub load_ratios: Vec<f64>,
    /// Workload seeds (each a fresh run); figures are medians over them.
    pub seeds: Vec<u64>,
    /// Policies compared (`precise` is the one the heat map judges).
    pub policies: Vec<String>,
    /// Requests per run (about).
    pub requests: usize,
    /// Tokens per question.
    pub question_tokens: usize,
    /// Tokens generated per answer.
    pub output_tokens: u32,
}

impl MatrixSpec {
    /// The full matrix of docs/benchmarks.md.
    pub fn full() -> Self {
        Self {
            kinds: vec![
                Kind::TenantQuestions,
                Kind::TenantChats,
                Kind::SkewedQuestions,
            ],
            tenants: vec![4, 12],
            context_tokens: vec![2000],
            cache_ratios: vec![0.25, 1.0, 2.0, 4.0],
            load_ratios: vec![0.3, 0.7, 1.2],
            seeds: vec![1, 2, 3],
            policies: ["round-robin", "least-load", "prefix-hash", "precise"]
                .map(String::from)
                .to_vec(),
            requests: 240,
            question_tokens: 100,
            output_tokens: 32,
        }
    }

    /// The small matrix CI runs: the shapes where a fill-fraction copy rule thrashes, on three
    /// seeds (the targets are medians of three: at the light load one seed's TTFT p90 falls
    /// within a few requests of the line between a cache hit and a miss, 12 of its 200 being
    /// first questions that miss everywhere).
    pub fn small() -> Self {
        Self {
            kinds: vec![Kind::TenantQuestions],
            tenants: vec![12],
            context_tokens: vec![1000],
            cache_ratios: vec![1.5],
            load_ratios: vec![0.1, 0.9],
            seeds: vec![1, 2, 3],
            policies: ["round-robin", "least-load", "prefix-hash", "precise"]
                .map(String::from)
                .to_vec(),
            requests: 200,
            question_tokens: 60,
            output_tokens: 16,
        }
    }
}

/// One cell's coordinates and the fleet and rate they come to.
#[derive(Clone, Debug, Serialize)]
pub struct Cell {
    /// Workload kind.
    pub kind: Kind,
    /// Tenants.
    pub tenants: usize,
    /// Mean context tokens.
    pub context_tokens: usize,
    /// Pooled cache over working set, as asked for.
    pub cache_ratio: f64,
    /// Pooled cache over working set, as run (an engine holds at least one whole prompt, so
    /// the smallest ratios can come out larger).
    pub effective_cache_ratio: f64,
    /// Offered rate over round-robin's saturation.
    pub load_ratio: f64,
    /// GPU blocks per engine.
    pub blocks_per_engine: usize,
    /// Round-robin's estimated saturation, requests per second.
    pub saturation_rate: f64,
    /// Offered requests per second.
    pub rate: f64,
}

/// One policy's medians over seeds in one cell.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PolicyFigures {
    /// The policy.
    pub policy: String,
    /// Prefix-cache hit rate (0–1).
    pub hit_rate: f64,
    /// TTFT p50, seconds.
    pub ttft_p50: f64,
    /// TTFT p90, seconds.
    pub ttft_p90: f64,
    /// TTFT p99, seconds.
    pub ttft_p99: f64,
    /// ITL p99, seconds.
    pub itl_p99: f64,
    /// Busiest endpoint's requests over the mean.
    pub imbalance: f64,
    /// Requests that failed in the seed where most failed: none where every engine holds
    /// every request (the percentiles are of the requests served).
    pub errors: f64,
}

/// A cell's results.
#[derive(Clone, Debug, Serialize)]
pub struct CellResult {
    /// Where.
    pub cell: Cell,
    /// The pooled-cache ceiling's hit rate (median over seeds).
    pub ceiling: f64,
    /// Per policy, in the spec's order.
    pub policies: Vec<PolicyFigures>,
    /// Precise's ITL p99 over round-robin's (`None` without either): whether concentrating
    /// prefills where the cache is makes the running decodes pay for TTFT.
    pub precise_itl_p99_over_round_robin: Option<f64>,
}

impl CellResult {
    /// The figures of `policy`.
    pub fn figures(&self, policy: &str) -> Option<&PolicyFigures> {
        self.policies.iter().find(|p| p.policy == policy)
    }

    /// Whether the working set fits the pooled cache, as asked or as run (the hit-rate target's
    /// cells: a cache asked at the working set can come out a block short per engine).
    pub fn fits(&self) -> bool {
        self.cell.cache_ratio >= 1.0 || self.cell.effective_cache_ratio >= 1.0
    }

    /// Precise's ITL p99 over `policy`'s (`None` without either).
    pub fn precise_itl_p99_over(&self, policy: &str) -> Option<f64> {
        let precise = self.figures("precise")?.itl_p99;
        let other = self.figures(policy)?.itl_p99;
        Some(precise / other.max(1e-9))
    }

    /// Precise's TTFT p50, p90 and p99 over the best of the other policies', each (`None`
    /// without precise or another policy).
    pub fn precise_over_best_other(&self) -> Option<[f64; 3]> {
        let precise = self.figures("precise")?;
        let others: Vec<&PolicyFigures> = self
            .policies
            .iter()
            .filter(|p| p.policy != "precise" && p.policy != "approximate")
            .collect();
        if others.is_empty() {
            return None;
        }
        let best = |f: fn(&PolicyFigures) -> f64| {
            others.iter().map(|p| f(p)).fold(f64::INFINITY, f64::min)
        };
        let ratio = |mine: f64, theirs: f64| mine / theirs.max(1e-9);
        Some([
            ratio(precise.ttft_p50, best(|p| p.ttft_p50)),
            ratio(precise.ttft_p90, best(|p| p.ttft_p90)),
            ratio(precise.ttft_p99, best(|p| p.ttft_p99)),
        ])
    }
}

/// The workload seed of the run that measures round-robin's saturation.
const PROBE_SEED: u64 = 1;

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    match values.len() {
        0 => 0.0,
        n if n % 2 == 1 => values[n / 2],
        n => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

struct Shape {
    kind: Kind,
    tenants: usize,
    context_tokens: usize,
}

impl Shape {
    fn workload(&self, spec: &MatrixSpec, rate: f64, seed: u64) -> Workload {
        let turns = if self.kind == Kind::TenantChats { 3 } else { 1 };
        let (skew, length_cv) = if self.kind == Kind::SkewedQuestions {
            (TenantSkew::Zipf { s: 1.1 }, 0.5)
        } else {
            (TenantSkew::Uniform, 0.0)
        };
        tenants(&Tenants {
            tenants: self.tenants,
            context_tokens: self.context_tokens,
            conversations: spec.requests.div_ceil(turns),
            turns,
            question_tokens: spec.question_tokens,
            length_cv,
            output_tokens: spec.output_tokens,
            think_s: 1.0,
            // Conversations per second for `rate` requests per second.
            rate_per_s: rate / turns as f64,
            skew,
            seed,
        })
    }
}

/// Mean prompt tokens of a workload's requests (contexts and questions as the built-in
/// tokenizer counts them, histories included).
fn mean_prompt_tokens(runs: &RunResult) -> f64 {
    let done: Vec<&kvroute_bench::result::RequestRecord> =
        runs.records.iter().filter(|r| r.error.is_none()).collect();
    done.iter().map(|r| r.prompt_tokens as f64).sum::<f64>() / done.len().max(1) as f64
}

/// Engine seconds one request costs at hit rate `hit`, from the engine model: its uncached
/// prefill and its decode steps (the per-step overhead is shared by the batch and left out).
fn request_seconds(engine: &EngineConfig, prompt_tokens: f64, hit: f64, output: u32) -> f64 {
    let l = &engine.latency;
    prompt_tokens * (1.0 - hit) * l.prefill_per_token_s
        + f64::from(output) * (l.decode_per_seq_s + prompt_tokens * l.decode_per_context_token_s)
}

/// Runs the matrix on fleets like `base` (engines, engine model, timing); `progress` is called
/// with (runs done, runs in all).
pub fn run_matrix(
    spec: &MatrixSpec,
    base: &FleetConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<CellResult>, SimulateError> {
    let mut shapes = Vec::new();
    for &kind in &spec.kinds {
        for &tenants in &spec.tenants {
            for &context_tokens in &spec.context_tokens {
                shapes.push(Shape {
                    kind,
                    tenants,
                    context_tokens,
                });
            }
        }
    }
    let per_shape = spec.cache_ratios.len()
        * (1 + spec.load_ratios.len() * spec.seeds.len() * spec.policies.len());
    let total = shapes.len() * per_shape;
    let mut done = 0;
    let mut results = Vec::new();
    for shape in &shapes {
        let bs = base.engine.block_size.max(1);
        // The working set: every tenant's context, in blocks (as the seed-1 workload draws them).
        let probe_workload = shape.workload(spec, 1.0, spec.seeds.first().copied().unwrap_or(1));
        let working_blocks: usize = {
            let mut contexts: Vec<&String> = probe_workload
                .sessions
                .iter()
                .filter_map(|s| s.system.as_ref())
                .collect();
            contexts.sort();
            contexts.dedup();
            contexts
                .iter()
                .map(|c| kvroute_vllm::tokenizer::BuiltinTokenizer.encode(c).len() / bs)
                .sum()
        };
        // The longest request of any seed's workload (its prompt, a conversation's history
        // included, and its reply): an engine whose cache cannot hold it refuses it.
        let longest_request = spec
            .seeds
            .iter()
            .chain([&PROBE_SEED])
            .map(|&seed| longest_request_tokens(&shape.workload(spec, 1.0, seed)))
            .max()
            .unwrap_or(0);
        let mut last_blocks = None;
        for &cache_ratio in &spec.cache_ratios {
            // At least room on every engine for the longest context and four questions, and
            // for the longest request, with 16 blocks to spare.
            let longest = probe_workload
                .sessions
                .iter()
                .filter_map(|s| s.system.as_ref())
                .map(|c| kvroute_vllm::tokenizer::BuiltinTokenizer.encode(c).len())
                .max()
                .unwrap_or(0);
            let floor =
                ((longest + 4 * spec.question_tokens) / bs).max(longest_request.div_ceil(bs)) + 16;
            let blocks =
                ((cache_ratio * working_blocks as f64 / base.engines as f64) as usize).max(floor);
            // Two ratios that come to the same cache (the floor) are one cell.
            if last_blocks.replace(blocks) == Some(blocks) {
                done += 1 + spec.load_ratios.len() * spec.seeds.len() * spec.policies.len();
                progress(done, total);
                continue;
            }
            let fleet = FleetConfig {
                engine: EngineConfig {
                    num_gpu_blocks: blocks,
                    ..base.engine.clone()
                },
                ..base.clone()
            };
            // Round-robin's saturation: a probe at a rate it surely sustains gives its hit rate.
            let cold_rate = base.engines as f64
                / request_seconds(
                    &fleet.engine,
                    (longest + spec.question_tokens) as f64,
                    0.0,
                    spec.output_tokens,
                );
            let probe = simulate(
                &fleet,
                &shape.workload(spec, cold_rate * 0.3, PROBE_SEED),
                None,
                &["round-robin".to_owned()],
            )?;
            done += 1;
            progress(done, total);
            let probe = &probe[0];
            let saturation_rate = base.engines as f64
                / request_seconds(
                    &fleet.engine,
                    mean_prompt_tokens(probe),
                    probe.summary.hit_rate,
                    spec.output_tokens,
                );
            for &load_ratio in &spec.load_ratios {
                let rate = load_ratio * saturation_rate;
                let mut ceilings = Vec::new();
                let mut per_policy: Vec<Vec<RunResult>> = vec![Vec::new(); spec.policies.len()];
                for &seed in &spec.seeds {
                    let workload = shape.workload(spec, rate, seed);
                    ceilings.push(pooled_hit_rate(
                        &workload,
                        &fleet.engine.pooled(fleet.engines),
                    ));
                    let seeded = FleetConfig {
                        seed,
                        ..fleet.clone()
                    };
                    for (i, policy) in spec.policies.iter().enumerate() {
                        let run = simulate(&seeded, &workload, None, std::slice::from_ref(policy))?;
                        per_policy[i].extend(run);
                        done += 1;
                        progress(done, total);
                    }
                }
                let policies = spec
                    .policies
                    .iter()
                    .zip(per_policy)
                    .map(|(name, runs)| {
                        let m = |f: fn(&RunResult) -> f64| median(runs.iter().map(f).collect());
                        PolicyFigures {
                            policy: name.clone(),
                            hit_rate: m(|r| r.summary.hit_rate),
                            ttft_p50: m(|r| r.summary.ttft.p50),
                            ttft_p90: m(|r| r.summary.ttft.p90),
                            ttft_p99: m(|r| r.summary.ttft.p99),
                            itl_p99: m(|r| r.summary.itl.p99),
                            imbalance: m(|r| r.summary.load_imbalance),
                            errors: runs
                                .iter()
                                .map(|r| r.summary.errors as f64)
                                .fold(0.0, f64::max),
                        }
                    })
                    .collect();
                let mut result = CellResult {
                    cell: Cell {
                        kind: shape.kind,
                        tenants: shape.tenants,
                        context_tokens: shape.context_tokens,
                        cache_ratio,
                        effective_cache_ratio: (blocks * base.engines) as f64
                            / working_blocks.max(1) as f64,
                        load_ratio,
                        blocks_per_engine: blocks,
                        saturation_rate,
                        rate,
                    },
                    ceiling: median(ceilings),
                    policies,
                    precise_itl_p99_over_round_robin: None,
                };
                result.precise_itl_p99_over_round_robin =
                    result.precise_itl_p99_over("round-robin");
                results.push(result);
            }
        }
    }
    Ok(results)
}
