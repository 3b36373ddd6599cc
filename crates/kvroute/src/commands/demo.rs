//! `kvroute demo`: the whole story on a laptop. A fleet of simulated engines, the same seeded
//! multi-turn workload routed four ways (a fresh fleet each time), the comparison, and the
//! ceiling: one pooled cache as large as the fleet's serving the same requests.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvroute_bench::driver::{DriverConfig, run as drive};
use kvroute_bench::result::RunResult;
use kvroute_bench::workload::{MultiTurn, multi_turn};
use kvroute_router::config::RouterConfig;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};

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
    /// Policies to compare, in order.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round-robin,least-load,prefix-hash,approximate,precise"
    )]
    policies: Vec<String>,
    /// Where to write the JSON and HTML report.
    #[arg(long, default_value = "kvroute-demo")]
    out: PathBuf,
    /// Random seed of the workload.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

const MODEL: &str = "sim-llama-3.1-8b";

fn engine_config(blocks: usize) -> EngineConfig {
    EngineConfig {
        num_gpu_blocks: blocks,
        ..EngineConfig::default()
    }
}

async fn fleet(args: &DemoArgs) -> anyhow::Result<Vec<SimFleet>> {
    let mut engines = Vec::new();
    for _ in 0..args.engines {
        engines.push(
            start_sim(SimConfig {
                port: 0,
                events_port: 0,
                replay_port: Some(0),
                engine: engine_config(args.blocks_per_engine),
                ..SimConfig::default()
            })
            .await
            .context("starting a simulated engine")?,
        );
    }
    Ok(engines)
}

fn router_yaml(engines: &[SimFleet], policy: &str) -> String {
    let mut yaml = format!(
        "listen: 127.0.0.1:0\nadmin: {{listen: 127.0.0.1:0}}\nmodels: [{{name: {MODEL}}}]\nscheduler: {{policy: {policy}}}\nscrape: {{interval_ms: 200}}\nendpoints:\n"
    );
    for (i, f) in engines.iter().enumerate() {
        let ep = &f.endpoints[0];
        yaml.push_str(&format!(
            "  - {{name: engine-{i}, url: '{}', events: '{}', replay: '{}'}}\n",
            ep.url,
            ep.events,
            ep.replay.as_deref().unwrap_or_default()
        ));
    }
    yaml
}

/// Runs the demo and prints the comparison.
pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.engines >= 2,
        "--engines must be at least 2 to compare routing"
    );
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
    println!(
        "kvroute demo: {} simulated engines x {} blocks; {} conversations x {} turns sharing a {}-token system prompt",
        args.engines, args.blocks_per_engine, args.users, args.turns, params.system_tokens
    );
    let mut runs: Vec<RunResult> = Vec::new();
    let mut prompts_for_ceiling = None;
    for policy in &args.policies {
        let engines = fleet(&args).await?;
        let config = RouterConfig::from_yaml(&router_yaml(&engines, policy))
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let router = kvroute_router::server::start(config).await?;
        tokio::time::sleep(Duration::from_millis(300)).await; // subscribers connect
        println!("  running {policy} ...");
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
        let counters_after = engine_counters(&engines).await;
        let (queries, hits) = (
            counters_after.0 - counters_before.0,
            counters_after.1 - counters_before.1,
        );
        summary.engine_hit_rate = (queries > 0.0).then(|| hits / queries);
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
            config: serde_json::json!({"policy": policy, "workload": workload.description, "engines": args.engines, "blocks_per_engine": args.blocks_per_engine}),
            summary,
            records,
        });
        drop(router);
        drop(engines);
    }
    let ceiling = kvroute_bench::ceiling::pooled_hit_rate(
        &workload,
        &engine_config(args.engines * args.blocks_per_engine),
    );
    println!();
    println!("{}", kvroute_bench::report::table(&runs));
    println!(
        "Ceiling: one pooled cache of {} blocks serving the same requests in order reaches a {:.1}% hit rate.",
        args.engines * args.blocks_per_engine,
        ceiling * 100.0
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let (json, html) = kvroute_bench::report::write_files(&runs, &args.out, "demo")
        .context("writing the report")?;
    println!("Report: {} (data: {})", html.display(), json.display());
    Ok(ExitCode::SUCCESS)
}

/// The engines' own prefix-cache counters, summed: (tokens queried, tokens hit).
async fn engine_counters(engines: &[SimFleet]) -> (f64, f64) {
    let client = reqwest::Client::new();
    let (mut queries, mut hits) = (0.0, 0.0);
    for f in engines {
        if let Ok(resp) = client
            .get(format!("{}/metrics", f.endpoints[0].url))
            .send()
            .await
            && let Ok(text) = resp.text().await
        {
            let sample = kvroute_vllm::metrics::parse_engine_metrics(&text);
            queries += sample.prefix_cache_queries.unwrap_or(0.0);
            hits += sample.prefix_cache_hits.unwrap_or(0.0);
        }
    }
    (queries, hits)
}
