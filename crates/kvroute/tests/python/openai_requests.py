"""A steady run of chat completions with the official OpenAI Python client, one at a time.

Usage: openai_requests.py BASE_URL MODEL COUNT PAUSE_AFTER[,PAUSE_AFTER...]
Prints one JSON line per request ({"i", "ok", "status", "endpoint", "error"}, where endpoint
is the picker's `x-kvroute-endpoint` response header, null when no picker answered). After
each request number listed in PAUSE_AFTER it prints {"paused": N} and waits for a line on
stdin: the Rust test kills an engine or the picker there, between two requests of a run
that keeps going. Every prompt shares one long prefix, so that the picker keeps choosing the
engine that caches it. The client never retries (max_retries=0): what it sees is what the
gateway did.
"""

import json
import sys

import openai

base_url, model, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
pauses = {int(p) for p in sys.argv[4].split(",") if p}
client = openai.OpenAI(base_url=base_url, api_key="not-needed", max_retries=0, timeout=60)
system = "You are a careful assistant who answers in one short sentence. " * 30


def one(i):
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Question number {i}: what is a prefix cache?"},
    ]
    stream = i % 2 == 1
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=4, stream=stream
        )
        parsed = raw.parse()
        if stream:
            chunks = sum(1 for _ in parsed)
            ok = chunks > 0
        else:
            ok = parsed.usage.completion_tokens == 4
        return {"ok": ok, "status": raw.status_code, "endpoint": raw.headers.get("x-kvroute-endpoint")}
    except openai.APIStatusError as e:
        return {"ok": False, "status": e.status_code, "endpoint": None, "error": str(e)}
    except openai.APIError as e:
        return {"ok": False, "status": 0, "endpoint": None, "error": repr(e)}


for i in range(count):
    print(json.dumps({"i": i, **one(i)}), flush=True)
    if i + 1 in pauses:
        print(json.dumps({"paused": i + 1}), flush=True)
        if not sys.stdin.readline():
            break
