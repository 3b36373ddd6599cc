"""Writes the fuzz targets' seed corpora (inputs that once crashed a target, named
`regression-*`, are kept beside them by hand) from the vLLM fixtures and the repository's examples.

Usage: python3 fuzz/seed.py [FIXTURES_DIR]   (default: ../shared/fixtures beside the repository)
"""

import json
import pathlib
import struct
import sys

fuzz = pathlib.Path(__file__).resolve().parent
repo = fuzz.parent
fixtures = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else repo.parent / "shared" / "fixtures"
corpus = fuzz / "corpus"


def write(target, name, data):
    path = corpus / target
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_bytes(data)


for events in sorted((fixtures / "kv-events").glob("vllm-*.jsonl")):
    for i, line in enumerate(events.read_text().splitlines()):
        msg = json.loads(line)
        payload = bytes.fromhex(msg["payload_hex"])
        write("kv_event_decoder", f"{events.stem}-{i}", payload)
        frames = [msg["topic"].encode(), struct.pack(">Q", msg["seq"]), payload]
        write("zmq_frames", f"{events.stem}-{i}", b"\xff\x00".join(frames))

write("openai_request", "completion", json.dumps(
    {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True,
     "stream_options": {"include_usage": True}, "cache_salt": "tenant"}).encode())
write("openai_request", "batch", b'{"model":"m","prompt":[[1,2,3],[4]]}')
write("openai_request", "surrogate", b'{"model":"m","prompt":"x\\ud800y"}')
write("openai_request", "chat", json.dumps(
    {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}).encode())

write("engine_metrics", "vllm", b"""# HELP vllm:num_requests_waiting Waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 3.0
vllm:num_requests_running{model_name="m"} 7.0
vllm:kv_cache_usage_perc{model_name="m"} 0.42
vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1.0
vllm:prefix_cache_hits_total{model_name="m"} 1.2e+06
""")

write("router_config", "example", (repo / "examples" / "kvroute.yaml").read_bytes())
write("router_config", "minimal", b"models: [{name: m}]\nendpoints: [{url: 'http://127.0.0.1:8001'}]\n")


def zmtp_frame(body, more=False, command=False):
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def zmtp_ready(socket_type):
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return zmtp_frame(body, command=True)


# zmtp_decoder: the first byte is the read size; then what a peer sends after the greeting.
live = [b"kv@127.0.0.1:8000@m", struct.pack(">Q", 7), b"\x93\xcb" + b"\x00" * 8 + b"\x90\xc0"]
message = b"".join(zmtp_frame(f, more=i < 2) for i, f in enumerate(live))
write("zmtp_decoder", "ready-and-message", b"\x10" + zmtp_ready(b"PUB") + message + message)
write("zmtp_decoder", "ping", b"\x03" + zmtp_frame(b"\x04PING\x00\x00ctx", command=True))
write("zmtp_decoder", "long-frame", b"\x40" + zmtp_frame(b"\xab" * 300))
write("zmtp_decoder", "declares-2-62", b"\x08\x02" + struct.pack(">Q", 1 << 62))
write("zmtp_decoder", "declares-8-gib", b"\x08\x02" + struct.pack(">Q", 8 << 30) + b"\x00" * 64)
write("zmtp_decoder", "multipart-over-limit", b"\xff" + b"".join(
    zmtp_frame(b"\xcd" * 3000, more=i < 2) for i in range(3)))
