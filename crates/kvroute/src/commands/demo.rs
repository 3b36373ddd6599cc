//! `kvroute demo`: the whole story on a laptop. A fleet of simulated engines, the same seeded
//! multi-turn workload routed four ways (a fresh fleet each time), the comparison, and the
//! ceiling: one pooled cache as large as the fleet's serving the same requests. With `--pd`,
//! prefill/decode disaggregation instead: precise routing on the whole fleet against the same
//! engines split into prefill and decode halves, every request disaggregated (`pd-always`) or
//! decided per request by cost (`pd-cost`). With `--offload`, tiered KV offload instead: engines
//! whose GPU holds a quarter of `--blocks-per-engine` (the working set overflows it), routed by
//! precise routing without an offload tier (`gpu-only`), and with a CPU tier of
//! `--blocks-per-engine` blocks each, credited as the GPU (`tier-blind`) or priced in seconds
//! (`tier-aware`); each run's summary counts the prompt tokens the engines found on the GPU and
//! loaded from each tier (`tier_tokens`, shown by `bench compare`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvroute_bench::driver::{DriverConfig, run as drive};
use kvroute_bench::result::{RunResult, TierTokens};
use kvroute_bench::workload::{MultiTurn, multi_turn};
use kvroute_router::config::RouterConfig;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::link::LinkSpec;
use kvroute_sim::server::pd::PdConfig;
use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};
use kvroute_vllm::nixl::KvRole;

/// Arguments of `kvroute demo`.
#[derive(Args)]
pub struct DemoArgs {
    /// Simulated engines.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// GPU blocks per engine (16 tokens each).
    #[arg(long, default_value_t = 1200)]
    blocks_per_engine: usize,
    /// Conversations.
    #[arg(long, default_value_t = 32)]
    users: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// New conversations per second.
    #[arg(long, default_value_t = 2.0)]
    rate: f64,
    /// Policies to compare, in order (default: round-robin, least-load, prefix-hash,
    /// approximate, precise; with `--pd`: precise, pd-always, pd-cost; with `--offload`:
    /// gpu-only, tier-blind, tier-aware).
    #[arg(long, value_delimiter = ',')]
    policies: Option<Vec<String>>,
    /// Prefill/decode disaggregation: the policies `pd-always` and `pd-cost` run on the same
    /// number of engines, the first half kv_producer and the rest kv_consumer, with the
    /// router orchestrating both legs (`pd.mode: always` or `orchestrate`).
    #[arg(long, conflicts_with = "offload")]
    pd: bool,
    /// Tiered KV offload: each engine's GPU holds a quarter of --blocks-per-engine, so the
    /// working set overflows it; `gpu-only` runs precise routing on those engines alone,
    /// `tier-blind` and `tier-aware` (and any other policy) on the same engines with a CPU
    /// tier of --blocks-per-engine blocks each, credited as the GPU or priced in seconds.
    #[arg(long)]
    offload: bool,
    /// P/D: the KV link between prefill and decode engines (`tcp`, `roce-100`, `ib-400`,
    /// `custom:<GB/s>[:<latency ms>]`).
    #[arg(long, default_value = "ib-400")]
    kv_link: String,
    /// Where to write the JSON and HTML report.
    #[arg(long, default_value = "kvroute-demo")]
    out: PathBuf,
    /// Random seed of the workload.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

const MODEL: &str = "sim-llama-3.1-8b";

/// The policies compared by default.
const POLICIES: &str = "round-robin,least-load,prefix-hash,approximate,precise";
/// The policies compared by default with `--pd`.
const PD_POLICIES: &str = "precise,pd-always,pd-cost";
/// The policies compared by default with `--offload`.
const OFFLOAD_POLICIES: &str = "gpu-only,tier-blind,tier-aware";

/// The share of `--blocks-per-engine` an engine's GPU holds with `--offload`.
const OFFLOAD_GPU_DIVISOR: usize = 4;

/// The router's scheduler for an `--offload` policy of the demo; `None`: not one.
fn offload_scheduler(policy: &str) -> Option<&'static str> {
    match policy {
        "gpu-only" | "tier-aware" => Some("{policy: precise}"),
        "tier-blind" => Some(
            "{policy: precise, tiers: {cpu_weight: 1.0, storage_weight: 1.0, shared_weight: 1.0}}",
        ),
        _ => None,
    }
}

/// The router's `pd.mode` for a P/D policy of the demo; `None`: not a P/D policy.
fn pd_mode(policy: &str) -> Option<&'static str> {
    match policy {
        "pd-always" => Some("always"),
        "pd-cost" => Some("orchestrate"),
        _ => None,
    }
}

fn engine_config(blocks: usize) -> EngineConfig {
    EngineConfig {
        num_gpu_blocks: blocks,
        ..EngineConfig::default()
    }
}

/// One engine of the demo running `policy`: `--blocks-per-engine` GPU blocks; with
/// `--offload`, a quarter of them on the GPU and (except for `gpu-only`) a CPU tier of
/// `--blocks-per-engine` blocks.
fn demo_engine(args: &DemoArgs, policy: &str) -> EngineConfig {
    if !args.offload {
        return engine_config(args.blocks_per_engine);
    }
    EngineConfig {
        num_cpu_blocks: if policy == "gpu-only" {
            0
        } else {
            args.blocks_per_engine
        },
        ..engine_config(args.blocks_per_engine / OFFLOAD_GPU_DIVISOR)
    }
}

/// Whether engine `i` of `engines` only prefills: with P/D (`pd`) the first half does.
fn produces_only(i: usize, engines: usize, pd: bool) -> bool {
    pd && i < engines / 2
}

/// Engine `i`'s endpoint name in the router's configuration and the results.
fn endpoint_name(i: usize) -> String {
    format!("engine-{i}")
}

/// The engines for `policy`: a P/D fleet (the first half kv_producer, the rest kv_consumer)
/// for a P/D policy, else independent engines without a KV connector.
async fn fleet(args: &DemoArgs, policy: &str) -> anyhow::Result<Vec<SimFleet>> {
    if pd_mode(policy).is_some() {
        let roles = (0..args.engines)
            .map(|i| {
                if produces_only(i, args.engines, true) {
                    KvRole::Producer
                } else {
                    KvRole::Consumer
                }
            })
            .collect();
        let pd = PdConfig {
            link: LinkSpec::parse(&args.kv_link)?,
            side_channel_port: 0,
            ..PdConfig::new(roles)
        };
        let fleet = start_sim(SimConfig {
            port: 0,
            events_port: 0,
            replay_port: Some(0),
            engines: args.engines,
            engine: engine_config(args.blocks_per_engine),
            pd: Some(pd),
            ..SimConfig::default()
        })
        .await
        .context("starting the simulated P/D fleet")?;
        return Ok(vec![fleet]);
    }
    let mut engines = Vec::new();
    for _ in 0..args.engines {
        engines.push(
            start_sim(SimConfig {
                port: 0,
                events_port: 0,
                replay_port: Some(0),
                engine: demo_engine(args, policy),
                ..SimConfig::default()
            })
            .await
            .context("starting a simulated engine")?,
        );
    }
    Ok(engines)
}

/// The router's configuration for `policy` over `engines` (a P/D policy: precise scheduling,
/// the endpoints' roles, and `pd.mode` over `kv_link`).
fn router_yaml(engines: &[SimFleet], policy: &str, kv_link: &str) -> String {
    let (scheduler, pd) = match (pd_mode(policy), offload_scheduler(policy)) {
        (Some(mode), _) => (
            "{policy: precise}".to_owned(),
            format!("pd: {{mode: {mode}, link: '{kv_link}'}}\n"),
        ),
        (None, Some(scheduler)) => (scheduler.to_owned(), String::new()),
        (None, None) => (format!("{{policy: {policy}}}"), String::new()),
    };
    let mut yaml = format!(
        "listen: 127.0.0.1:0\nadmin: {{listen: 127.0.0.1:0}}\nmodels: [{{name: {MODEL}}}]\nscheduler: {scheduler}\nscrape: {{interval_ms: 200}}\n{pd}endpoints:\n"
    );
    let endpoints: Vec<_> = engines.iter().flat_map(|f| &f.endpoints).collect();
    let n = endpoints.len();
    for (i, ep) in endpoints.iter().enumerate() {
        let role = match (pd.is_empty(), produces_only(i, n, !pd.is_empty())) {
            (true, _) => "both",
            (false, true) => "prefill",
            (false, false) => "decode",
        };
        yaml.push_str(&format!(
            "  - {{name: {}, role: {role}, url: '{}', events: '{}', replay: '{}'}}\n",
            endpoint_name(i),
            ep.url,
            ep.events,
            ep.replay.as_deref().unwrap_or_default()
        ));
    }
    yaml
}

/// Waits (at most 10 s) until the router's KV-event subscribers are connected.
async fn subscribed(router: &kvroute_router::server::RunningRouter) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !router.subscribers_connected() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs the demo and prints the comparison.
pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.engines >= 2,
        "--engines must be at least 2 to compare routing"
    );
    anyhow::ensure!(
        args.rate > 0.0 && args.rate.is_finite(),
        "--rate must be positive"
    );
    let policies: Vec<String> = args.policies.clone().unwrap_or_else(|| {
        let default = match (args.pd, args.offload) {
            (true, _) => PD_POLICIES,
            (false, true) => OFFLOAD_POLICIES,
            (false, false) => POLICIES,
        };
        default.split(',').map(str::to_owned).collect()
    });
    anyhow::ensure!(
        !args.offload || args.blocks_per_engine >= OFFLOAD_GPU_DIVISOR,
        "--offload puts a quarter of --blocks-per-engine on the GPU: give at least {OFFLOAD_GPU_DIVISOR}"
    );
    if let Some(policy) = policies
        .iter()
        .find(|p| !args.offload && offload_scheduler(p).is_some())
    {
        anyhow::bail!("policy {policy} compares offload tiers: it needs --offload");
    }
    if let Some(policy) = policies
        .iter()
        .find(|p| args.offload && pd_mode(p).is_some())
    {
        anyhow::bail!(
            "policy {policy} runs a P/D fleet without offload tiers: it cannot be compared under --offload"
        );
    }
    LinkSpec::parse(&args.kv_link).context("--kv-link")?;
    let params = MultiTurn {
        users: args.users,
        turns: args.turns,
        system_tokens: 400,
        user_tokens: 250,
        output_tokens: 64,
        think_s: 1.0,
        rate_per_s: args.rate,
        seed: args.seed,
    };
    let workload = multi_turn(&params);
    let tiers = demo_engine(&args, "tier-aware");
    let cpu = if args.offload {
        format!(" (+ {} CPU-tier blocks)", tiers.num_cpu_blocks)
    } else {
        String::new()
    };
    println!(
        "kvroute demo: {} simulated engines x {} GPU blocks{cpu}; {} conversations x {} turns sharing a {}-token system prompt",
        args.engines, tiers.num_gpu_blocks, args.users, args.turns, params.system_tokens
    );
    let mut runs: Vec<RunResult> = Vec::new();
    let mut prompts_for_ceiling = None;
    for policy in &policies {
        let engines = fleet(&args, policy).await?;
        let config = RouterConfig::from_yaml(&router_yaml(&engines, policy, &args.kv_link))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let router = kvroute_router::server::start(config).await?;
        subscribed(&router).await;
        match pd_mode(policy) {
            Some(_) => println!(
                "  running {policy} ({} prefill + {} decode engines over {}) ...",
                args.engines / 2,
                args.engines - args.engines / 2,
                args.kv_link
            ),
            None => println!("  running {policy} ..."),
        }
        let counters_before = engine_counters(&engines).await;
        let (records, duration) = drive(
            &workload,
            &DriverConfig {
                base_url: format!("http://{}/v1", router.addr),
                model: MODEL.into(),
                concurrency: None,
                timeout: Duration::from_secs(120),
                progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
            },
        )
        .await;
        let mut summary = kvroute_bench::stats::summarize(&records, duration);
        // Every engine a request could be sent to counts in the imbalance, the idle ones too.
        let pd = pd_mode(policy).is_some();
        kvroute_bench::stats::count_idle_endpoints(
            &mut summary,
            (0..args.engines)
                .filter(|&i| !produces_only(i, args.engines, pd))
                .map(endpoint_name),
        );
        let counters_after = engine_counters(&engines).await;
        let (queries, hits) = (
            counters_after.queries - counters_before.queries,
            counters_after.hits - counters_before.hits,
        );
        summary.engine_hit_rate = (queries > 0.0).then(|| hits / queries);
        let tier_loaded = std::array::from_fn::<f64, 3, _>(|tier| {
            counters_after.tier_loaded[tier] - counters_before.tier_loaded[tier]
        });
        if args.offload {
            println!(
                "    {:.0} prompt tokens loaded from the CPU tier",
                tier_loaded[0]
            );
            // Counters are whole tokens; a negative difference (an engine restarted) saturates
            // to 0.
            summary.tier_tokens = Some(TierTokens {
                gpu: hits as u64,
                cpu: tier_loaded[0] as u64,
                ssd: tier_loaded[1] as u64,
                shared_fs: tier_loaded[2] as u64,
            });
        }
        if prompts_for_ceiling.is_none() {
            prompts_for_ceiling = Some(
                records
                    .iter()
                    .map(|r| (r.prompt_tokens, r.completion_tokens))
                    .collect::<Vec<_>>(),
            );
        }
        runs.push(RunResult {
            name: policy.clone(),
            config: serde_json::json!({
                "policy": policy,
                "workload": workload.description,
                "engines": args.engines,
                "blocks_per_engine": args.blocks_per_engine,
                "kv_link": pd_mode(policy).map(|_| &args.kv_link),
                "offload": args.offload.then(|| serde_json::json!({
                    "gpu_blocks": demo_engine(&args, policy).num_gpu_blocks,
                    "cpu_blocks": demo_engine(&args, policy).num_cpu_blocks,
                    "tier_loaded_tokens": {"cpu": tier_loaded[0], "ssd": tier_loaded[1], "shared_fs": tier_loaded[2]},
                })),
            }),
            summary,
            records,
        });
        drop(router);
        drop(engines);
    }
    // With --offload, the pool holds what the fleet's GPUs and CPU tiers hold together.
    let pooled_blocks = args.engines * (tiers.num_gpu_blocks + tiers.num_cpu_blocks);
    let ceiling = kvroute_bench::ceiling::pooled_hit_rate(&workload, &engine_config(pooled_blocks));
    println!();
    println!("{}", kvroute_bench::report::table(&runs));
    println!(
        "Ceiling: one pooled cache of {pooled_blocks} blocks serving the same requests in order reaches a {:.1}% hit rate.",
        ceiling * 100.0
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let (json, html) = kvroute_bench::report::write_files(&runs, &args.out, "demo")
        .context("writing the report")?;
    println!("Report: {} (data: {})", html.display(), json.display());
    Ok(ExitCode::SUCCESS)
}

/// The engines' own counters, summed over the fleet.
#[derive(Default)]
struct EngineCounters {
    /// Prompt tokens looked up in the GPU prefix cache.
    queries: f64,
    /// Prompt tokens found there.
    hits: f64,
    /// Prompt tokens loaded from each offload tier (CPU, own storage, shared).
    tier_loaded: [f64; 3],
}

/// The engines' own prefix-cache and tier counters, summed (an unreachable engine counts 0).
async fn engine_counters(engines: &[SimFleet]) -> EngineCounters {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap_or_default();
    let mut sum = EngineCounters::default();
    for endpoint in engines.iter().flat_map(|f| &f.endpoints) {
        if let Ok(resp) = client.get(format!("{}/metrics", endpoint.url)).send().await
            && let Ok(text) = resp.text().await
        {
            let sample = kvroute_vllm::metrics::parse_engine_metrics(&text);
            sum.queries += sample.prefix_cache_queries.unwrap_or(0.0);
            sum.hits += sample.prefix_cache_hits.unwrap_or(0.0);
            for (total, loaded) in sum.tier_loaded.iter_mut().zip(sample.tier_loaded_tokens) {
                *total += loaded.unwrap_or(0.0);
            }
        }
    }
    sum
}
