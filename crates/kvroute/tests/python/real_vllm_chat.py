"""Drive kvroute in front of real vLLM engines with the official OpenAI client: multi-turn
chats sharing a system prompt and growing completions, streaming and not. Before each request
the router's explain gives its prediction of the chosen engine's cached tokens.

Usage: real_vllm_chat.py BASE_URL ADMIN_URL MODEL LABEL
Prints one JSON list, one record per request: kind, stream, chosen, reason and predictions
(explain: predicted cached tokens by endpoint), endpoint (the x-kvroute-endpoint header),
prompt_tokens and cached_tokens (the engine's usage).
LABEL makes the prompts unique, so runs against the same engines do not share a cache.
"""

import json
import sys
import time
import urllib.request

import openai

base_url, admin_url, model, label = sys.argv[1:5]
client = openai.OpenAI(base_url=base_url + "/v1", api_key="not-needed", max_retries=0)
SYSTEM = f"[{label}] You are a careful assistant who answers in full sentences about caches. " * 12
QUESTIONS = [
    "How does prefix caching work in the engine?",
    "Why does routing matter for the cache hit rate of a fleet?",
    "What happens to the cached blocks when memory runs out?",
    "Summarize the conversation in three sentences, please.",
]


def explain(body):
    """The router's predictions for `body`, once its index has taken in the latest events:
    the predictions read twice 50 ms apart, equal (at most 2 s)."""
    last = None
    for _ in range(40):
        request = urllib.request.Request(
            admin_url + "/kvroute/v1/explain",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = json.load(response)
        predictions = {e["endpoint"]: e["predicted_cached_tokens"] for e in answer["endpoints"]}
        if last == predictions:
            break
        last = predictions
        time.sleep(0.05)
    return {
        "chosen": answer["chosen"],
        "reason": answer["reason"],
        "predictions": predictions,
        "explain_prompt_tokens": answer.get("prompt_tokens"),
    }


def send(kind, body, stream):
    record = {"kind": kind, "stream": stream}
    record.update(explain(body))
    create = client.chat.completions if kind == "chat" else client.completions
    options = {"stream_options": {"include_usage": True}} if stream else {}
    raw = create.with_raw_response.create(**body, stream=stream, **options)
    record["endpoint"] = raw.headers.get("x-kvroute-endpoint")
    if stream:
        text, usage = [], None
        for chunk in raw.parse():
            if chunk.choices:
                piece = chunk.choices[0].delta.content if kind == "chat" else chunk.choices[0].text
                text.append(piece or "")
            if chunk.usage is not None:
                usage = chunk.usage
        text = "".join(text)
    else:
        parsed = raw.parse()
        usage = parsed.usage
        text = parsed.choices[0].message.content if kind == "chat" else parsed.choices[0].text
    record["prompt_tokens"] = usage.prompt_tokens
    record["cached_tokens"] = usage.prompt_tokens_details.cached_tokens
    return record, text


records = []
for conversation in range(2):
    history = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(QUESTIONS):
        history.append({"role": "user", "content": f"{question} (conversation {conversation})"})
        body = {"model": model, "messages": history, "max_tokens": 24}
        record, answer = send("chat", body, stream=turn % 2 == 1)
        record.update(conversation=conversation, turn=turn)
        records.append(record)
        history.append({"role": "assistant", "content": answer})

prompt = f"[{label}] The router reads the engine's events and keeps an index of every block. " * 10
for turn in range(3):
    body = {"model": model, "prompt": prompt, "max_tokens": 16}
    record, answer = send("completion", body, stream=turn == 1)
    record.update(conversation=2, turn=turn)
    records.append(record)
    prompt += answer + f" Then step {turn} follows."

print(json.dumps(records))
