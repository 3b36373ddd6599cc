//! The configuration's unit tests: defaults, the parsing of each form, and every refusal naming
//! its field.

use kvroute_core::index::{OffloadSpec, SharedMount};
use kvroute_core::schedule::{Profile, ProfileName};

use super::*;

const MINIMAL: &str = "models: [{name: m}]\nendpoints: [{url: 'http://127.0.0.1:8001'}]\n";

#[test]
fn minimal_config_gets_every_default() {
    let c = RouterConfig::from_yaml(MINIMAL).unwrap();
    assert_eq!(c.listen.port(), 8000);
    assert_eq!(c.models[0].block_size, 16);
    assert_eq!(c.scheduler.policy, ProfileName::Precise);
    assert_eq!(c.scheduler.profile(), Profile::default());
    assert_eq!(c.health.unhealthy_after, 2);
    assert!(c.admin.listen.ip().is_loopback() && c.admin.token.is_none());
}

/// The engines' prefill chunk reaches the fleet's cost model as written, vLLM's default when
/// left out.
#[test]
fn the_prefill_chunk_reaches_the_fleet() {
    let c = RouterConfig::from_yaml(MINIMAL).unwrap();
    assert_eq!(c.fleet_config().prefill_chunk_tokens, 8192);
    let yaml = format!("{MINIMAL}scheduler: {{prefill_chunk_tokens: 2048}}\n");
    let c = RouterConfig::from_yaml(&yaml).unwrap();
    assert_eq!(c.fleet_config().prefill_chunk_tokens, 2048);
}

/// A HuggingFace tokenizer's engine flags read as written, and as vLLM's defaults when
/// left out.
#[test]
fn an_hf_tokenizer_takes_the_engines_template_flags() {
    let yaml = "models:\n  - name: m\n    tokenizer: {hf: t.json, chat_template_content_format: openai, exclude_tools_when_tool_choice_none: true}\n  - name: n\n    tokenizer: {hf: t.json}\nendpoints: [{url: 'http://127.0.0.1:8001'}]\n";
    let c = RouterConfig::from_yaml(yaml).unwrap();
    let flags = |i: usize| match &c.models[i].tokenizer {
        TokenizerConfig::Hf(hf) => (
            hf.chat_template_content_format,
            hf.exclude_tools_when_tool_choice_none,
        ),
        other => panic!("{other:?}"),
    };
    assert_eq!(flags(0), (ContentFormatConfig::Openai, true));
    assert_eq!(flags(1), (ContentFormatConfig::Auto, false));
}

/// A misspelled tokenizer setting or kind is refused by name: an engine flag the router
/// did not read would key every chat it changes as the engine never renders it.
#[test]
fn a_misspelled_tokenizer_setting_is_refused_by_name() {
    let config = |tokenizer: &str| {
        RouterConfig::from_yaml(&format!(
            "models:\n  - name: m\n    tokenizer: {tokenizer}\nendpoints: [{{url: 'http://127.0.0.1:8001'}}]\n"
        ))
    };
    let e = config("{hf: t.json, exclude_tools: true}")
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `exclude_tools`"), "{e}");
    let e = config("remot").unwrap_err().to_string();
    assert!(e.contains("unknown variant `remot`"), "{e}");
    assert_eq!(
        config("remote").unwrap().models[0].tokenizer,
        TokenizerConfig::Kind(TokenizerKind::Remote)
    );
}

#[test]
fn an_endpoint_declares_its_shared_mount_in_config_or_by_pod_label() {
    let yaml = "models: [{name: m}]\nendpoints:\n  - {url: 'http://127.0.0.1:8001', offload: {block_size: 64, shared_mount: lustre, shared_media: [STORAGE]}}\n  - {url: 'http://127.0.0.1:8002', labels: {kvroute.io/shared-kv-mount: lustre}}\n  - {url: 'http://127.0.0.1:8003'}\n";
    let c = RouterConfig::from_yaml(yaml).unwrap();
    let specs: Vec<OffloadSpec> = c.endpoints.iter().map(|e| e.offload_spec()).collect();
    assert_eq!(specs[0].block_size, Some(64));
    let first = specs[0].shared.as_ref().unwrap();
    assert_eq!(
        (first.name.as_str(), first.media.clone()),
        ("lustre", vec!["STORAGE".to_owned()])
    );
    let second = specs[1].shared.as_ref().unwrap();
    assert_eq!(second, &SharedMount::new("lustre"));
    assert!(specs[2].shared.is_none());
    let bad = format!("{MINIMAL}scheduler: {{tiers: {{cpu_weight: 1.5}}}}\n");
    let err = RouterConfig::from_yaml(&bad).unwrap_err().to_string();
    assert!(err.contains("scheduler.tiers.cpu_weight"), "{err}");
}

#[test]
fn the_tier_load_mode_follows_the_engines_connector() {
    use kvroute_core::tiers::TierLoadMode;
    let c = RouterConfig::from_yaml(MINIMAL).unwrap();
    assert_eq!(c.scheduler.profile().tiers.load_mode, TierLoadMode::Async);
    let lmcache = format!("{MINIMAL}scheduler: {{tiers: {{load_mode: in_step}}}}\n");
    let c = RouterConfig::from_yaml(&lmcache).unwrap();
    assert_eq!(c.scheduler.profile().tiers.load_mode, TierLoadMode::InStep);
    let bad = format!("{MINIMAL}scheduler: {{tiers: {{load_mode: sometimes}}}}\n");
    let err = RouterConfig::from_yaml(&bad).unwrap_err().to_string();
    assert!(err.contains("load_mode"), "{err}");
}

#[test]
fn a_public_admin_listener_needs_a_token() {
    let yaml = format!("{MINIMAL}admin: {{listen: '0.0.0.0:9000', token: secret}}\n");
    let c = RouterConfig::from_yaml(&yaml).unwrap();
    assert_eq!(c.admin.token.as_deref(), Some("secret"));
}

#[test]
fn the_annotated_example_parses() {
    let text = include_str!("../../../../examples/kvroute.yaml");
    let c = RouterConfig::from_yaml(text).unwrap();
    assert!(c.endpoints.len() >= 2);
}

#[test]
fn ipv6_hosts_are_urls_with_or_without_a_port() {
    let yaml =
        "models: [{name: m}]\nendpoints: [{url: 'http://[::1]'}, {url: 'http://[::1]:8001'}]";
    let c = RouterConfig::from_yaml(yaml).unwrap();
    assert_eq!(c.endpoints.len(), 2);
}

#[test]
fn bad_configs_name_the_field() {
    let cases = [
        ("models: []\nendpoints: [{url: 'http://a:1'}]", "models"),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\noutlier: {max_inflight: 0}",
            "outlier",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\noutlier: {max_ejected_fraction: 2}",
            "outlier.max_ejected_fraction",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nretry: {window_s: 0}",
            "retry",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nreplicas: {kubernetes: {selector: {'app,x': r}, admin_port: 9000}}",
            "replicas.kubernetes.selector",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nreplicas: {kubernetes: {selector: {app: r}, admin_port: 0}}",
            "replicas.kubernetes.admin_port",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nreplicas: {kubernetes: {selector: {app: r}, admin_port: 9000, api_server: 'not a url'}}",
            "replicas.kubernetes.api_server",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nshutdown: {drain_timeout_s: -1}",
            "shutdown.drain_timeout_s",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nlimits: {connect_timeout_ms: 0}",
            "limits.connect_timeout_ms",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nhealth: {timeout_ms: 0}",
            "health.timeout_ms",
        ),
        (
            "models: [{name: base, lora_adapters: [other]}, {name: other}]\nendpoints: [{url: 'http://a:1'}]",
            "models[0].lora_adapters[0]",
        ),
        (
            "models: [{name: a, lora_adapters: [sql]}, {name: b, lora_adapters: [sql]}]\nendpoints: [{url: 'http://a:1'}]",
            "models[1].lora_adapters[0]",
        ),
        (
            "models: [{name: m}]\ndiscovery: {selector: {'app,x': r}, target_ports: [8000]}",
            "discovery.selector",
        ),
        (
            "models: [{name: m}]\ndiscovery: {inference_pool: p, selector: {app: x}}",
            "discovery.inference_pool",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nkv_events: {max_message_bytes: 1000}",
            "kv_events.max_message_bytes",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'ftp://a:1'}]",
            "endpoints[0].url",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1', events: 'a:5557'}]",
            "endpoints[0].events",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1', models: [x]}]",
            "endpoints[0].models",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://user:pw@a:1'}]",
            "must not carry credentials",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:99999'}]",
            "endpoints[0].url",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1', events: 'tcp://'}]",
            "endpoints[0].events",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1', events: 'tcp://a:1', replay: 'tcp://*:2'}]",
            "endpoints[0].replay",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1', name: ' '}]",
            "endpoints[0].name",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}, {url: 'http://a:1/'}]",
            "endpoints[1]: \"http://a:1/\" is another endpoint's host and port (a:1)",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://A:1'}, {url: 'http://a:1/v1'}]",
            "is another endpoint's host and port",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}, {url: 'http://b:1', name: 'a:1'}]",
            "endpoints[1]: \"a:1\" is another endpoint's name",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1', events: 'tcp://a:5'}, {url: 'http://b:1', events: 'tcp://a:5'}]",
            "another endpoint's events address",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1', name: x}, {url: 'http://b:1', name: x}]",
            "another endpoint's name",
        ),
        (
            "models: [{name: m}, {name: m}]\nendpoints: [{url: 'http://a:1'}]",
            "models[1].name",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {saturation: {queue: 0}}",
            "scheduler.saturation.queue",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {saturation: {kv_usage: .nan}}",
            "scheduler.saturation.kv_usage",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {filters: {max_waiting: -1}}",
            "scheduler.filters.max_waiting",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {prefill_chunk_tokens: 0}",
            "scheduler.prefill_chunk_tokens",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {filters: {max_kv_usage: -0.5}}",
            "scheduler.filters.max_kv_usage",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\ncache: {index_shards: 100000000}",
            "cache.index_shards",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1', urll: 3}]",
            "unknown field `urll`",
        ),
        (
            "models: [{name: m, block_size: 0}]\nendpoints: [{url: 'http://a:1'}]",
            "models[0].block_size",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {policy: fastest}",
            "unknown variant `fastest`",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {weights: {load: -1}}",
            "scheduler.weights.load",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nlisten: nowhere",
            "listen",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nadmin: {listen: '0.0.0.0:9000'}",
            "admin.listen",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nreplicas: {peers: ['a:1']}",
            "replicas.peers[0]",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nlimits: {header_timeout_ms: 0}",
            "limits.header_timeout_ms",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nlimits: {max_buffered_bytes: 10}",
            "limits.max_buffered_bytes",
        ),
        (
            "models: [{name: m}]\ndiscovery: {inference_pool: p, pool_recheck_s: 0.000001}",
            "discovery.pool_recheck_s",
        ),
        (
            "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nshutdown: {drain_timeout_s: 1e20}",
            "shutdown.drain_timeout_s",
        ),
    ];
    for (yaml, want) in cases {
        let e = RouterConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(e.contains(want), "{yaml}\n=> {e}");
    }
}
