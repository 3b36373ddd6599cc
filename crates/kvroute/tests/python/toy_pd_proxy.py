"""A prefill/decode proxy with the request sequence of vLLM's reference proxy
(toy_proxy_server.py), written from the protocol notes (vllm-wire.md section 5.1), not copied:

1. prefill leg to P: the client's body with kv_transfer_params = {do_remote_decode: true,
   do_remote_prefill: false, remote_*: null}, stream false, max_tokens 1 (and
   max_completion_tokens 1 if present), stream_options, min_tokens and min_completion_tokens
   removed; header X-Request-Id shared by both legs;
2. decode leg to D: the client's original body with kv_transfer_params replaced by the object P
   returned, unchanged, the same X-Request-Id; D's answer streamed back to the client.

Usage: toy_pd_proxy.py PREFILL_URL DECODE_URL AGGREGATED_URL MODEL
The OpenAI Python client then runs a multi-turn conversation (plain and streamed) through the
proxy and the same requests against an aggregated engine. Prints one JSON object per turn with
what each side answered; the Rust test asserts on it.
"""

import http.client
import json
import sys
import threading
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai

prefill_url, decode_url, aggregated_url, model = sys.argv[1:5]
TIMEOUT = 60
seen_params = []  # what P returned, per request, as the proxy forwarded it


def post(base, path, body, request_id, stream=False):
    """POST JSON; returns the open connection and response (the caller reads it)."""
    url = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=TIMEOUT)
    conn.request(
        "POST",
        path,
        body=json.dumps(body),
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    return conn, conn.getresponse()


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, content_type, body):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request_id = str(uuid.uuid4())
        prefill = dict(body)
        prefill["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        prefill["stream"] = False
        prefill["max_tokens"] = 1
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        for key in ("stream_options", "min_tokens", "min_completion_tokens"):
            prefill.pop(key, None)
        conn, resp = post(prefill_url, self.path, prefill, request_id)
        answer = resp.read()
        conn.close()
        if resp.status != 200:
            self.reply(resp.status, "application/json", answer)
            return
        params = json.loads(answer).get("kv_transfer_params")
        seen_params.append(params)
        decode = dict(body)
        decode["kv_transfer_params"] = params
        conn, resp = post(decode_url, self.path, decode, request_id)
        if not body.get("stream"):
            self.reply(resp.status, "application/json", resp.read())
            conn.close()
            return
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.getheader("Content-Type", "text/event-stream"))
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            chunk = resp.read1(65536)
            if not chunk:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        conn.close()


server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
threading.Thread(target=server.serve_forever, daemon=True).start()
proxy = openai.OpenAI(
    base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key="none", max_retries=0
)
aggregated = openai.OpenAI(base_url=f"{aggregated_url}/v1", api_key="none", max_retries=0)


def complete(client, prompt, stream):
    """(text, cached_tokens, prompt_tokens) of one completion."""
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=12)
        return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens
    text, cached, prompt_tokens = "", None, None
    for chunk in client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
            prompt_tokens = chunk.usage.prompt_tokens
    return text, cached, prompt_tokens


turns = []
prompt = "You are a careful assistant who explains caching. " * 60
for i, stream in enumerate([False, True, False]):
    prompt += f" Question {i}: why does the prefix cache matter for turn {i}?"
    pd_text, pd_cached, pd_prompt = complete(proxy, prompt, stream)
    agg_text, agg_cached, agg_prompt = complete(aggregated, prompt, stream)
    turns.append(
        {
            "stream": stream,
            "pd_text": pd_text,
            "agg_text": agg_text,
            "pd_cached": pd_cached,
            "agg_cached": agg_cached,
            "prompt_tokens": pd_prompt,
            "agg_prompt_tokens": agg_prompt,
            "params": seen_params[-1],
        }
    )
    prompt += pd_text
server.shutdown()
print(json.dumps({"turns": turns}))
