"""Drive kvroute with the official OpenAI Python client, as a user's application would.

Usage: openai_client.py BASE_URL MODEL
Prints one JSON object with what each call returned; the Rust test asserts on it.
"""

import json
import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0)
out = {}

history = [
    {"role": "system", "content": "You are a helpful assistant. " * 40},
    {"role": "user", "content": "Tell me about prefix caching."},
]
raw = client.chat.completions.with_raw_response.create(model=model, messages=history, max_tokens=12)
first = raw.parse()
out["chat"] = {
    "content": first.choices[0].message.content,
    "finish_reason": first.choices[0].finish_reason,
    "completion_tokens": first.usage.completion_tokens,
    "endpoint": raw.headers.get("x-kvroute-endpoint"),
}

history.append({"role": "assistant", "content": first.choices[0].message.content})
history.append({"role": "user", "content": "And why does routing matter?"})
stream = client.chat.completions.create(
    model=model, messages=history, max_tokens=8, stream=True, stream_options={"include_usage": True}
)
pieces, usage = [], None
for chunk in stream:
    # The first chunk names the role with empty content, as vLLM's do: only text counts.
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
    if chunk.usage is not None:
        usage = chunk.usage
out["chat_stream"] = {
    "chunks": len(pieces),
    "text": "".join(pieces),
    "cached_tokens": usage.prompt_tokens_details.cached_tokens,
    "prompt_tokens": usage.prompt_tokens,
}

history.append({"role": "assistant", "content": "".join(pieces)})
history.append({"role": "user", "content": "Thanks, one more thing."})
raw = client.chat.completions.with_raw_response.create(model=model, messages=history, max_tokens=4)
third = raw.parse()
out["chat_turn3"] = {
    "endpoint": raw.headers.get("x-kvroute-endpoint"),
    "cached_tokens": third.usage.prompt_tokens_details.cached_tokens,
    "prompt_tokens": third.usage.prompt_tokens,
}

completion = client.completions.create(model=model, prompt="Once upon a time " * 30, max_tokens=5)
out["completion"] = {"text": completion.choices[0].text, "completion_tokens": completion.usage.completion_tokens}

stream = client.completions.create(model=model, prompt="Once upon a time " * 30, max_tokens=5, stream=True)
chunks = list(stream)
# No stream_options: whatever the router asked the engine for, the client sees no usage.
out["completion_stream"] = {"chunks": len(chunks), "usage_chunks": sum(1 for c in chunks if c.usage is not None)}

models = client.models.list()
out["models"] = [m.id for m in models.data]

try:
    client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    out["error"] = None
except openai.NotFoundError as e:
    out["error"] = {"status": e.status_code, "message": str(e)}

print(json.dumps(out))
