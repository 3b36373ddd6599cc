//! Every request record of `pd-cost` and `pd-always` runs on the P/D fleet shapes the crate's
//! tests use and larger ones (4 engines split or kv_both over each link, a producer short of
//! blocks, 24 mixed-role engines), on a mixed workload at two loads, printed as JSON: the
//! output of two builds is byte-identical when a change to the P/D decision keeps every
//! decision (a refactor's check).
//!
//! `cargo run -p kvroute-simulate --example pd_records > records.json`

use kvroute_bench::workload::{Workload, from_prompts};
use kvroute_sim::link::LinkSpec;
use kvroute_simulate::{FleetConfig, simulate};
use kvroute_vllm::nixl::KvRole;

/// Engines with `roles`, Llama-3.1-8B's KV over `link`, `blocks` GPU blocks each.
fn fleet(roles: &[KvRole], link: &str, blocks: usize) -> FleetConfig {
    FleetConfig::disaggregated(roles, LinkSpec::parse(link).unwrap(), blocks)
}

/// Mixed: shared system prompts, multi-turn-ish growth, some long documents.
fn mixed(n: usize, gap_s: f64, seed: u64) -> Workload {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let prompts = (0..n)
        .map(|i| {
            let r = next();
            let system = (r % 4) as u32;
            let len = if r % 7 == 0 {
                8192
            } else {
                256 + (r as usize >> 8) % 3000
            };
            let shared = 1024.min(len);
            let mut tokens: Vec<u32> = (0..shared as u32).map(|t| system * 1_000_000 + t).collect();
            let conv = (next() % 20) as u32;
            tokens.extend((shared..len).map(|t| 50_000_000 + conv * 100_000 + t as u32));
            (i as f64 * gap_s, tokens, 16 + (next() % 64) as u32)
        })
        .collect();
    from_prompts(serde_json::json!({"name": "mixed"}), prompts)
}

fn main() {
    use KvRole::{Both, Consumer, Producer};
    let mut all = Vec::new();
    let mut big: Vec<KvRole> = Vec::new();
    for i in 0..24 {
        big.push(match i % 3 {
            0 => Producer,
            1 => Consumer,
            _ => Both,
        });
    }
    let shapes: Vec<(Vec<KvRole>, &str, usize)> = vec![
        (
            vec![Producer, Producer, Consumer, Consumer],
            "roce-100",
            8000,
        ),
        (vec![Both; 4], "tcp", 8000),
        (vec![Both; 4], "ib-400", 8000),
        (vec![Producer, Consumer, Consumer], "tcp", 1300),
        (big.clone(), "roce-100", 4000),
        (big, "tcp", 2000),
    ];
    for (roles, link, blocks) in shapes {
        for policy in ["pd-cost", "pd-always"] {
            for (gap, seed) in [(0.05, 1), (0.01, 2)] {
                let f = fleet(&roles, link, blocks);
                let w = mixed(300, gap, seed);
                let r = simulate(&f, &w, None, &[policy.to_owned()])
                    .unwrap()
                    .remove(0);
                all.push(serde_json::json!({
                    "shape": format!("{} {link} {blocks} {policy} {gap}", roles.len()),
                    "records": r.records,
                }));
            }
        }
    }
    println!("{}", serde_json::to_string_pretty(&all).unwrap());
}
