//! Tool-calling chats against the real engine: the router's own rendering of the chat template
//! (tools, tool calls, tool results, reasoning, template arguments, a continued message, a
//! developer message, content as parts, the model's `tool_use` template) gives the tokens the
//! engine's `/tokenize` gives, and an agent's turns through the router are predicted exactly
//! and stay on their engine.

use kvroute_vllm::openai::chat_input;
use kvroute_vllm::tokenizer::HfTokenizer;
use serde_json::{Value, json};

use super::engines::{BLOCK_SIZE, Engine, MODEL, exclusive, install, shared_fleet};
use super::router::{Router, post, predicted_for};
use super::{full_blocks, settled_prediction};

/// Two tools, in the shapes clients send: one with a nested schema whose keys are not in
/// alphabetical order, with an enum, a float bound, HTML characters and non-ASCII text; one
/// with neither description nor parameters, marked strict.
fn tools(label: &str) -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": format!("[{label}] Current weather for a city, <b>live</b> & cached."),
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Zürich"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    "precision": {"type": "number", "minimum": 0.00001, "default": 0.5},
                },
                "required": ["city"],
            },
        }},
        {"type": "function", "function": {"name": "list_routes", "strict": true}},
    ])
}

/// An agent's conversation after `turns` tool round trips: the user's question, then for each
/// round an assistant tool call (its arguments a JSON string, as the API sends them) and the
/// tool's answer, then a follow-up question.
fn agent_messages(label: &str, turns: usize) -> Vec<Value> {
    let mut messages = vec![
        json!({"role": "system", "content": format!("[{label}] You are a routing assistant who calls tools. ").repeat(6)}),
        json!({"role": "user", "content": "What is the weather where the fleet runs, and which routes exist?"}),
    ];
    for turn in 0..turns {
        let arguments =
            json!({"city": "Zürich", "unit": "celsius", "days": turn + 1, "precision": 21.5});
        messages.push(json!({
            "role": "assistant",
            "content": null,
            "tool_calls": [{
                "id": format!("call_{turn}"),
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments.to_string()},
            }],
        }));
        messages.push(json!({
            "role": "tool",
            "tool_call_id": format!("call_{turn}"),
            "content": [{"type": "text", "text": format!("{{\"temperature\": {}, \"sky\": \"clear\"}}", 18 + turn)}],
        }));
        messages.push(json!({"role": "user", "content": format!("And for {} days?", turn + 2)}));
    }
    messages
}

/// Chat bodies that exercise each part of the template rendering vLLM does.
fn chats(label: &str) -> Vec<(&'static str, Value)> {
    let agent = agent_messages(label, 2);
    let mut reasoning = agent.clone();
    reasoning.push(json!({"role": "assistant", "content": "Sunny all week.", "reasoning": "The tool said clear skies."}));
    reasoning.push(json!({"role": "user", "content": "Thanks."}));
    let mut continued = agent.clone();
    continued.push(json!({"role": "assistant", "content": "The weather in Zürich is"}));
    vec![
        (
            "tools and tool calls",
            json!({"messages": agent, "tools": tools(label)}),
        ),
        (
            "thinking off by template argument",
            json!({"messages": agent, "tools": tools(label), "chat_template_kwargs": {"enable_thinking": false}}),
        ),
        (
            "template arguments null or auto are unset",
            json!({"messages": agent, "chat_template_kwargs": {"enable_thinking": null, "reasoning_effort": "auto"}}),
        ),
        (
            "an empty tools list picks the tool_use template",
            json!({"messages": agent, "tools": []}),
        ),
        ("reasoning in the history", json!({"messages": reasoning})),
        (
            "the last message continued",
            json!({"messages": continued, "add_generation_prompt": false, "continue_final_message": true}),
        ),
        (
            "developer messages as system ones, merged first",
            json!({"messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": "Prefer metric units."},
                {"role": "user", "content": "Weather?"},
            ]}),
        ),
        (
            "Claude Code's billing header dropped, content parts looped over",
            json!({"messages": [
                {"role": "system", "content": "x-anthropic-billing-header: cch=4f2a;\nYou are a coding agent."},
                {"role": "user", "content": [
                    {"type": "input_text", "text": "Read the file."},
                    {"type": "text", "text": "Then summarize it."},
                ]},
            ]}),
        ),
    ]
}

#[test]
fn hf_tokenizer_renders_tool_calling_chats_as_the_engine_does() {
    let Some(fleet) = shared_fleet() else {
        return;
    };
    let model = &install().unwrap().model;
    let tokenizer = HfTokenizer::load(&model.join("tokenizer.json"), None).unwrap();
    for (case, mut body) in chats("render") {
        body["model"] = json!(MODEL);
        let (status, engine) = post(fleet[0].http, "/tokenize", &body);
        assert_eq!(status, 200, "{case}: {engine}");
        let engine: Vec<u64> = serde_json::from_value(engine["tokens"].clone()).unwrap();
        let chat = chat_input(&body).unwrap();
        let ours: Vec<u64> = tokenizer
            .encode_chat(&chat)
            .unwrap()
            .into_iter()
            .map(u64::from)
            .collect();
        if ours != engine {
            let text = tokenizer.apply_chat_template(&chat).unwrap();
            let same = ours.iter().zip(&engine).take_while(|(a, b)| a == b).count();
            panic!(
                "{case}: the tokens part at {same} of {} (router) / {} (engine); the router rendered:\n{text}",
                ours.len(),
                engine.len()
            );
        }
    }
}

/// An agent's turns through a router with `tokenizer` over the shared engines
/// ([`agent_turns_are_predicted_and_reuse_the_last`]).
fn agent_turns_stay_home_and_are_predicted(tokenizer: &str, label: &str) {
    let Some(fleet) = shared_fleet() else {
        return;
    };
    agent_turns_are_predicted_and_reuse_the_last(
        &Router::start(&[&fleet[0], &fleet[1]], tokenizer, ""),
        label,
    );
}

/// Sends an agent's turns (`tool_choice: none`) through `router`: each prediction is what the
/// engine then reports cached, and each turn goes where the previous one is cached, finding at
/// least its prompt's full blocks but the last.
fn agent_turns_are_predicted_and_reuse_the_last(router: &Router, label: &str) {
    let mut home = None;
    let mut previous_blocks = 0;
    for turns in 0..3 {
        let body = json!({
            "model": MODEL,
            "max_tokens": 4,
            "messages": agent_messages(label, turns),
            "tools": tools(label),
            // The tools are still rendered: the tiny engine has no tool-call parser, which
            // vLLM requires for `auto`.
            "tool_choice": "none",
            "chat_template_kwargs": {"enable_thinking": false},
        });
        let (_, _, explain) = settled_prediction(router, &body);
        let (endpoint, answer) = send_through(router, &body);
        let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(
            cached,
            predicted_for(&explain, &endpoint),
            "turn {turns} on {endpoint}: {explain}"
        );
        if turns > 0 {
            assert_eq!(Some(&endpoint), home.as_ref(), "turn {turns}: {explain}");
            // All but the block where the previous generation prompt's empty think block
            // (not kept in the history) begins.
            assert!(
                cached + BLOCK_SIZE >= previous_blocks,
                "turn {turns} reuses the previous prompt ({previous_blocks}): {answer}"
            );
        }
        home = Some(endpoint);
        previous_blocks = full_blocks(&answer);
        assert!(previous_blocks >= 2 * BLOCK_SIZE, "{answer}");
    }
}

/// Sends a chat `body` through the router: the endpoint it went to (`x-kvroute-endpoint`) and
/// the engine's answer.
fn send_through(router: &Router, body: &Value) -> (String, Value) {
    let answer = router.chat(body);
    let endpoint = answer
        .head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("x-kvroute-endpoint")
                .then(|| value.trim().to_owned())
        })
        .expect("x-kvroute-endpoint");
    (endpoint, serde_json::from_str(&answer.body).unwrap())
}

#[test]
fn an_agents_turns_are_predicted_and_stay_home_with_the_hf_tokenizer() {
    let Some(model) = install().map(|i| &i.model) else {
        return;
    };
    let tokenizer = format!("{{hf: '{}'}}", model.join("tokenizer.json").display());
    agent_turns_stay_home_and_are_predicted(&tokenizer, "agent-hf");
}

#[test]
fn an_agents_turns_are_predicted_and_stay_home_with_the_remote_tokenizer() {
    agent_turns_stay_home_and_are_predicted("remote", "agent-remote");
}

/// Engines started with `--exclude-tools-when-tool-choice-none` render a `tool_choice: none`
/// chat without its tools (their `/tokenize` renders them whatever the flag): a router told so
/// (`exclude_tools_when_tool_choice_none`) keys an agent's turns as such an engine caches them.
#[test]
fn an_agents_turns_are_predicted_on_engines_that_drop_tools_for_tool_choice_none() {
    let Some(_turn) = exclusive() else {
        return;
    };
    let model = &install().unwrap().model;
    let mut engine = Engine::spawn(&["--exclude-tools-when-tool-choice-none"]);
    let took = engine.wait_healthy();
    eprintln!("engine excluding tools for tool_choice none healthy after {took:?}");
    let tokenizer = format!(
        "{{hf: '{}', exclude_tools_when_tool_choice_none: true}}",
        model.join("tokenizer.json").display()
    );
    agent_turns_are_predicted_and_reuse_the_last(
        &Router::start(&[&engine], &tokenizer, ""),
        "agent-no-tools",
    );
}
