"""Drive kvroute's router-orchestrated P/D with the official OpenAI Python client, and send the
same requests to an aggregated engine, as a user comparing the two would.

Usage: pd_route_client.py ROUTER_BASE_URL AGGREGATED_BASE_URL MODEL
Prints one JSON object: per turn of a conversation (plain, streamed, plain), what each side
answered (text, prompt and cached tokens, and the router's endpoint header). The Rust test
asserts on it.
"""

import json
import sys

import openai

router_url, aggregated_url, model = sys.argv[1:4]
router = openai.OpenAI(base_url=router_url, api_key="not-needed", max_retries=0, timeout=60)
aggregated = openai.OpenAI(base_url=aggregated_url, api_key="not-needed", max_retries=0, timeout=60)


def plain(client, messages, max_tokens):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=max_tokens
    )
    answer = raw.parse()
    return {
        "text": answer.choices[0].message.content,
        "prompt_tokens": answer.usage.prompt_tokens,
        "cached_tokens": answer.usage.prompt_tokens_details.cached_tokens,
        "completion_tokens": answer.usage.completion_tokens,
        "endpoint": raw.headers.get("x-kvroute-endpoint"),
    }


def streamed(client, messages, max_tokens):
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, chunks = [], None, 0
    for chunk in stream:
        if chunk.choices:
            chunks += 1
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    return {
        "text": "".join(pieces),
        "chunks": chunks,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
        "completion_tokens": usage.completion_tokens,
        "endpoint": None,
    }


history = [
    {"role": "system", "content": "You are a careful assistant who reads long documents. " * 60},
    {"role": "user", "content": "Summarise the document above in a few words."},
]
turns = []
for i, call in enumerate([plain, streamed, plain]):
    max_tokens = [6, 9, 5][i]
    pd = call(router, history, max_tokens)
    agg = call(aggregated, history, max_tokens)
    turns.append({"pd": pd, "agg": agg})
    # A fixed assistant turn, not the model's own output: the aggregated engine also cached
    # the blocks it decoded, which a prefill engine never holds (it decodes one token), so a
    # history repeating the output would find up to a block more cached on the aggregated side.
    history.append({"role": "assistant", "content": f"Here is part {i} of the summary."})
    history.append({"role": "user", "content": f"Now say more, part {i}."})
print(json.dumps({"turns": turns}))
