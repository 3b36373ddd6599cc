#!/usr/bin/env python3
"""A vLLM-shaped KV-event publisher at full speed, for kvroute's live-ingestion benchmark.

It publishes through the look-alike structs and the transport of the integration tests'
publisher (``crates/vllm/tests/python/vllm_publisher.py``: vLLM 0.33's map layout, a pyzmq PUB
socket with vLLM's high-water mark of 100,000 messages, a ROUTER replay socket keeping vLLM's
10,000 batches). Each batch is one scheduler step of a busy engine: a ``BlockStored`` of one
chain of ``--chain-blocks`` blocks (32: a 512-token prefill, its token ids included) and, once
the cache is full, a ``BlockRemoved`` of the chain stored ``--window`` batches before, so the
engine's cache stays the same size. Block hashes are random 64-bit integers (hashing is not what is measured).

Every payload is encoded before the clock starts, so Python's cost per message is the send.

Protocol (one JSON document per line):

1. prints ``{"pub": ..., "replay": ..., "block_events_per_batch": ...}`` and waits for ``go``
   on stdin;
2. publishes for ``--seconds`` at ``--rate`` batches per second (0: as fast as it can), then
   prints ``{"sent": N, "block_events": M, "seconds": S}``;
3. serves replay until stdin closes or ``quit`` is read, then prints
   ``{"replay_requests": R}``.

With ``--dump FILE`` it writes the first ``--dump-batches`` payloads in send order (each
preceded by its length as 4 big-endian bytes) and exits: the benchmark's in-process baseline
decodes and applies the same bytes without the network.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests/python"))
from vllm_publisher import BLOCK_SIZE, Publisher, declare_vllm_0_33, gpu_stored  # noqa: E402

# Llama 3's vocabulary: about half the ids need a 32-bit msgpack int, as in real prompts.
VOCABULARY = 128_256
TOKEN_POOL = 64


def emit(line: dict) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


class Schedule:
    """The payloads in send order: the first ``window`` batches only store, every later one
    stores a chain and removes the one stored ``window`` batches before; chains repeat every
    ``2 * window`` batches (a removed chain is stored again later)."""

    def __init__(self, seed: int, window: int, chain_blocks: int) -> None:
        rng = random.Random(seed)
        structs = declare_vllm_0_33()
        encoder = msgspec.msgpack.Encoder()
        self.window = window
        self.chain_blocks = chain_blocks
        self.cycle = 2 * window
        chains = [
            [rng.getrandbits(64) for _ in range(chain_blocks)] for _ in range(self.cycle)
        ]

        # Token ids cost the decoder as much whatever they are: a few prompts' worth, reused,
        # keep the start-up short. Their first tokens name the chain and the publisher, so no
        # two chains are one prefix (a router key follows the tokens, not the engine's hash).
        prompts = [
            [rng.randrange(VOCABULARY) for _ in range(chain_blocks * BLOCK_SIZE)]
            for _ in range(TOKEN_POOL)
        ]

        def stored(n: int, chain: list[int]):
            unique = [n % VOCABULARY, n // VOCABULARY % VOCABULARY, seed % VOCABULARY]
            # A new prompt: the chain starts at the root.
            return gpu_stored(structs, chain, None, unique + rng.choice(prompts)[len(unique) :])

        def batch(events: list) -> bytes:
            return encoder.encode(
                structs["KVEventBatch"](ts=1_767_000_000.0, events=events, data_parallel_rank=0)
            )

        stores = [stored(n, chain) for n, chain in enumerate(chains)]
        self.filling = [batch([stores[i]]) for i in range(window)]
        self.steady = [
            batch(
                [
                    stores[i],
                    structs["BlockRemoved"](
                        block_hashes=chains[(i - window) % self.cycle], medium="GPU", group_idx=0
                    ),
                ]
            )
            for i in range(self.cycle)
        ]

    def payload(self, n: int) -> bytes:
        return self.filling[n] if n < self.window else self.steady[n % self.cycle]

    def block_events(self, sent: int) -> int:
        return self.chain_blocks * (sent + max(0, sent - self.window))


def publish(publisher: Publisher, schedule: Schedule, seconds: float, rate: float) -> int:
    """Sends for ``seconds``, paced to ``rate`` batches/s in 1 ms steps (0: unpaced)."""
    start = time.perf_counter()
    sent = 0
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return sent
        due = sent + 1_000 if rate <= 0 else int(elapsed * rate) + 1
        while sent < due:
            publisher.publish_payload(schedule.payload(sent))
            sent += 1
        if rate > 0:
            time.sleep(0.001)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--window", type=int, default=1_024, help="chains the cache holds")
    parser.add_argument("--chain-blocks", type=int, default=32, help="blocks per stored chain")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rate", type=float, default=0.0, help="batches/s (0: flat out)")
    parser.add_argument("--dump", type=Path)
    parser.add_argument("--dump-batches", type=int, default=4_096)
    args = parser.parse_args()

    schedule = Schedule(args.seed, args.window, args.chain_blocks)
    if args.dump is not None:
        with args.dump.open("wb") as f:
            for n in range(args.dump_batches):
                payload = schedule.payload(n)
                f.write(len(payload).to_bytes(4, "big") + payload)
        return 0

    ctx = zmq.Context()
    publisher = Publisher(ctx, "", "map", declare_vllm_0_33(), live_lag=0)
    publisher.thread.start()
    emit(
        {
            "pub": f"tcp://127.0.0.1:{publisher.pub_port}",
            "replay": f"tcp://127.0.0.1:{publisher.replay_port}",
            "block_events_per_batch": 2 * args.chain_blocks,
        }
    )
    for line in sys.stdin:
        if line.strip() == "go":
            break
    else:
        return 1
    started = time.perf_counter()
    sent = publish(publisher, schedule, args.seconds, args.rate)
    emit(
        {
            "sent": sent,
            "block_events": schedule.block_events(sent),
            "seconds": time.perf_counter() - started,
        }
    )
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    publisher.close()
    emit({"replay_requests": publisher.replay_requests})
    return 0 if publisher.replay_error is None else 1


if __name__ == "__main__":
    sys.exit(main())
