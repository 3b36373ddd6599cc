#!/usr/bin/env python3
"""KV-event ingestion through a running `kvroute serve`: the router's whole path per batch.

`cargo bench -p kvroute-vllm --bench live_ingest` measures the subscriber feeding an index;
the router adds its own sink around each batch (the fleet's lock, the endpoint's ingest lock,
event bookkeeping). This starts ENGINES vLLM-shaped publishers
(`crates/vllm/benches/python/flood_publisher.py`), each beside a small HTTP server that passes
the router's health checks and scrapes, starts `kvroute serve` on them, lets the publishers
send for SECONDS at RATE batches per second each (0: as fast as Python sends), waits until the
router's `/metrics` shows every batch applied or reported lost, and prints the block events
applied per second of wall time and per CPU-second of the router process.

usage: scripts/live_ingest_router.py KVROUTE_BINARY [ENGINES=8] [RATE=1000] [SECONDS=5]
       (run it with a Python that has pyzmq and msgspec: .venv/bin/python, which
       scripts/test.sh makes)
"""
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLISHER = os.path.join(ROOT, "crates/vllm/benches/python/flood_publisher.py")
PATIENCE_S = 120


class QuietEngine(http.server.BaseHTTPRequestHandler):
    """Answers the router's health checks and scrapes: healthy, idle, no gauges."""

    def do_GET(self):  # noqa: N802 (the handler's name is http.server's)
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_http():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), QuietEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def counters(admin):
    """Per endpoint: {kind: value} of `kvroute_kv_events`."""
    text = urllib.request.urlopen(f"http://{admin}/metrics", timeout=5).read().decode()
    out = {}
    for m in re.finditer(r'^kvroute_kv_events\{endpoint="([^"]+)",kind="([^"]+)"\} (\S+)$',
                         text, re.M):
        out.setdefault(m.group(1), {})[m.group(2)] = float(m.group(3))
    return out


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until(what, done, every_s=0.25):
    """Polls `done` every `every_s` (each poll is a scrape, which costs the router a little
    CPU) for up to PATIENCE_S."""
    deadline = time.monotonic() + PATIENCE_S
    while not done():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(every_s)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    engines = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    rate = float(sys.argv[3]) if len(sys.argv) > 3 else 1000.0
    seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 5.0

    publishers, endpoints = [], []
    for seed in range(1, engines + 1):
        p = subprocess.Popen(
            [sys.executable, PUBLISHER, "--seed", str(seed), "--rate", str(rate),
             "--seconds", str(seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        addresses = json.loads(p.stdout.readline())
        publishers.append(p)
        endpoints.append({"url": engine_http(), "events": addresses["pub"],
                          "replay": addresses["replay"]})
    admin = f"127.0.0.1:{free_port()}"
    config = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": {"listen": admin},
        "models": [{"name": "m", "tokenizer": "none", "block_size": 16}],
        "endpoints": endpoints,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(config, f)  # JSON is YAML
    router = subprocess.Popen([binary, "serve", "-c", f.name], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        def connected():
            try:
                c = counters(admin)
            except OSError:
                return False
            return len(c) == engines and all(v.get("connected") == 1 for v in c.values())

        wait_until("the router subscribed to every engine", connected)
        cpu_before, started = cpu_seconds(router.pid), time.monotonic()
        for p in publishers:
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = [json.loads(p.stdout.readline()) for p in publishers]
        sent = sum(r["sent"] for r in reports)
        block_events = sum(r["block_events"] for r in reports)

        # Every batch applied, or (batches lost past the engines' buffers, reported as
        # unfilled gaps) no progress for two seconds.
        progress = {"applied": -1, "at": time.monotonic()}

        def settled():
            applied = sum(v.get("batches", 0) for v in counters(admin).values())
            now = time.monotonic()
            if applied != progress["applied"]:
                progress.update(applied=applied, at=now)
            return applied >= sent or now - progress["at"] > 2.0

        wait_until("every batch applied", settled)
        wall = progress["at"] - started
        cpu = cpu_seconds(router.pid) - cpu_before
        c = counters(admin)
        applied = sum(v.get("batches", 0) for v in c.values())
        # Every batch carries the same block events (after each engine's cache has filled).
        events = block_events * applied / sent
        print(f"engines {engines}, rate {rate:g} batches/s each, {seconds:g} s: sent {sent} "
              f"batches, applied {applied:.0f}, gaps {sum(v.get('gaps', 0) for v in c.values()):.0f}, "
              f"unfilled gaps {sum(v.get('unfilled_gaps', 0) for v in c.values()):.0f}")
        print(f"router: {events / wall / 1e6:.2f} M block events/s wall, "
              f"{events / cpu / 1e6:.2f} M per router CPU-second ({cpu:.2f} CPU-s over "
              f"{wall:.2f} s)")
    finally:
        router.terminate()
        router.wait(timeout=10)
        for p in publishers:
            p.kill()
        os.unlink(f.name)


if __name__ == "__main__":
    main()
