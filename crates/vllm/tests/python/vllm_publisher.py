#!/usr/bin/env python3
"""A KV-event publisher built the way vLLM builds its own, for kvroute's integration tests.

Only the stdlib, pyzmq and msgspec are used (vLLM itself cannot be imported without torch).
The event structs are look-alikes declared with the same msgspec struct options and field
order as the vLLM release they imitate, so msgspec produces the bytes vLLM would produce for
the same content:

* ``--layout array``: vLLM 0.23 (events are tagged positional arrays, replay replies without
  the topic frame);
* ``--layout map``: vLLM 0.33 (events are maps tagged by ``"type"``, replay replies with the
  topic frame, as since 0.26).

Block hashes are real ``sha256_cbor`` hashes (canonical CBOR by a small encoder below,
deterministic NONE_HASH as since vLLM 0.29), published as the low 64 bits of the digest. The
hashing checks itself against kvroute's ground-truth vectors at startup.

Protocol with the test (stdin/stdout, one JSON document per line):

1. prints ``{"pub": ..., "replay": ...}``, then waits for ``go`` on stdin;
2. publishes a deterministic multi-turn workload on a small simulated block pool (LRU
   eviction of freed blocks, tail blocks first, as vLLM's free queue does), one scheduler step
   per batch, with one batch consumed but never sent on PUB (it stays replayable);
3. prints one ``{"tokens": [...], "cached_blocks": N}`` line per conversation, then
   ``{"done": true, ...}``;
4. keeps serving replay until stdin closes or ``quit`` is read.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import random
import sys
import threading
from pathlib import Path
from typing import Any

import msgspec
import zmq

BLOCK_SIZE = 16
# vLLM's default ``buffer_steps``: batches kept for replay.
BUFFER_STEPS = 10_000
NONE_HASH_SEED = "vllm-none-hash"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
HASH_VECTORS = Path(__file__).resolve().parents[3] / "core/tests/data/vllm-block-hashes.jsonl"


# --------------------------------------------------------------------------------------------
# Canonical CBOR (the subset vLLM's sha256_cbor hashes: uints, byte/text strings, arrays, null)
# --------------------------------------------------------------------------------------------


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([(major << 5) | n])
    if n < 1 << 8:
        return bytes([(major << 5) | 24, n])
    if n < 1 << 16:
        return bytes([(major << 5) | 25]) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes([(major << 5) | 26]) + n.to_bytes(4, "big")
    if n < 1 << 64:
        return bytes([(major << 5) | 27]) + n.to_bytes(8, "big")
    raise ValueError(f"integer {n} needs a bignum, which this encoder does not write")


def cbor(value: Any) -> bytes:
    """Canonical CBOR of ``value`` (shortest heads, definite lengths)."""
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        return b"\xf5" if value else b"\xf4"
    if isinstance(value, int):
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if isinstance(value, (bytes, bytearray)):
        return _cbor_head(2, len(value)) + bytes(value)
    if isinstance(value, str):
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(value, (tuple, list)):
        return _cbor_head(4, len(value)) + b"".join(cbor(v) for v in value)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor(value)).digest()


def none_hash(seed: str = NONE_HASH_SEED) -> bytes:
    return sha256_cbor(seed)


def block_digests(
    tokens: list[int],
    block_size: int = BLOCK_SIZE,
    extra_keys: list[list[Any] | None] | None = None,
    seed: str = NONE_HASH_SEED,
) -> list[bytes]:
    """Digests of every full block: H((parent digest, tuple(tokens), extra keys or None))."""
    parent = none_hash(seed)
    out = []
    for i in range(len(tokens) // block_size):
        chunk = tuple(tokens[i * block_size : (i + 1) * block_size])
        extra = None
        if extra_keys is not None and extra_keys[i] is not None:
            extra = tuple(extra_keys[i])
        parent = sha256_cbor((parent, chunk, extra))
        out.append(parent)
    return out


def event_hash(digest: bytes) -> int:
    """The value vLLM publishes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (the default)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def self_check(path: Path) -> int:
    """Checks the hashing against kvroute's ground truth; returns how many vectors agreed."""
    checked = 0
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            vector = json.loads(line)
            if vector["algo"] != "sha256_cbor":
                continue
            seed = vector["seed"]
            got_none = none_hash(seed).hex()
            if got_none != vector["none_hash"]:
                raise SystemExit(
                    f"{path}:{lineno}: NONE_HASH {got_none} != expected {vector['none_hash']}"
                )
            digests = block_digests(
                vector["token_ids"], vector["block_size"], vector["extra_keys"], seed
            )
            got = [d.hex() for d in digests]
            if got != vector["digests"]:
                raise SystemExit(f"{path}:{lineno}: digests {got} != expected {vector['digests']}")
            ints = [event_hash(d) for d in digests]
            if ints != vector["event_u64"]:
                raise SystemExit(
                    f"{path}:{lineno}: event hashes {ints} != expected {vector['event_u64']}"
                )
            checked += 1
    if checked == 0:
        raise SystemExit(f"{path}: no sha256_cbor vectors to check against")
    return checked


# --------------------------------------------------------------------------------------------
# Look-alike event structs (same options and field order as the imitated vLLM release)
# --------------------------------------------------------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def declare_vllm_0_23() -> dict[str, type]:
    """vLLM 0.23: tagged positional events (array_like on the event base)."""

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[list[Any] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return {
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
        "KVEventBatch": KVEventBatch,
    }


def declare_vllm_0_33() -> dict[str, type]:
    """vLLM 0.33: events tagged by "type" in map form; defaulted fields omitted when None."""

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[list[Any] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None
        lookahead_token_ids: list[list[int]] | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return {
        "BlockStored": BlockStored,
        "BlockRemoved": BlockRemoved,
        "AllBlocksCleared": AllBlocksCleared,
        "KVEventBatch": KVEventBatch,
    }


def gpu_stored(
    structs: dict[str, type],
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    **extra: Any,
) -> Any:
    """A full-attention GPU ``BlockStored``, as vLLM publishes one for blocks it just cached."""
    return structs["BlockStored"](
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        **extra,
    )


def check_struct_shapes(layout: str, structs: dict[str, type]) -> None:
    """Fails fast if msgspec would not produce the shape the layout promises."""
    sample = structs["BlockRemoved"](block_hashes=[1], medium="GPU")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(sample))
    if layout == "array":
        assert decoded == ["BlockRemoved", [1], "GPU", None], decoded
    else:
        assert decoded == {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}, decoded
    cleared = msgspec.msgpack.decode(msgspec.msgpack.encode(structs["AllBlocksCleared"]()))
    assert cleared == (["AllBlocksCleared"] if layout == "array" else {"type": "AllBlocksCleared"})


# --------------------------------------------------------------------------------------------
# A tiny vLLM-like block pool: prefix hits, free queue with LRU eviction, event emission
# --------------------------------------------------------------------------------------------


class Block:
    __slots__ = ("id", "digest")

    def __init__(self, block_id: int) -> None:
        self.id = block_id
        self.digest: bytes | None = None


class Engine:
    """One engine's prefix cache, enough of vLLM's BlockPool to emit its events honestly.

    Requests run one at a time. Freed blocks go to the back of the free queue in reverse order
    (tail blocks first), allocation pops from the front and evicts the cached hash of a popped
    block (one BlockRemoved per evicted block), as vLLM does.
    """

    def __init__(
        self, num_blocks: int, structs: dict[str, type], layout: str, cpu_blocks: int = 0
    ) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        # OffloadingConnector's CPU tier (block_size = the GPU's: one hash per block), least
        # recently used first; 0 blocks: no connector.
        self.cpu_capacity = cpu_blocks
        self.cpu: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (b.id, None) for b in self.blocks
        )
        self.cached: dict[bytes, Block] = {}
        self.structs = structs
        self.layout = layout
        self.events: list[Any] = []
        self.stored = 0
        self.removed = 0
        self.loaded = 0

    def _offload_hash(self, digest: bytes) -> int | bytes:
        # Before 0.24 the connector published raw digests; since, the int form.
        return digest if self.layout == "array" else event_hash(digest)

    def _offload(self, digests: list[bytes]) -> None:
        """Stores newly computed blocks on the CPU tier, as the connector does on write:
        its events follow the step's GPU events; blocks already there are not stored again."""
        if not self.cpu_capacity:
            return
        new = [d for d in digests if d not in self.cpu]
        for d in digests:
            self.cpu[d] = None
            self.cpu.move_to_end(d)
        if new:
            extra = {} if self.layout == "array" else {"group_idx": 0}
            self.stored += len(new)
            self.events.append(
                self.structs["BlockStored"](
                    block_hashes=[self._offload_hash(d) for d in new],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                    **extra,
                )
            )
        while len(self.cpu) > self.cpu_capacity:
            old, _ = self.cpu.popitem(last=False)
            self.removed += 1
            self.events.append(
                self.structs["BlockRemoved"](block_hashes=[self._offload_hash(old)], medium="CPU")
            )

    def take_events(self) -> list[Any]:
        events, self.events = self.events, []
        return events

    def _allocate(self, n: int) -> list[Block]:
        if n > len(self.free):
            raise RuntimeError(f"pool exhausted: need {n}, {len(self.free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.digest is not None:
                del self.cached[block.digest]
                self.removed += 1
                self.events.append(
                    self.structs["BlockRemoved"](
                        block_hashes=[event_hash(block.digest)], medium="GPU", group_idx=0
                    )
                )
                block.digest = None
            out.append(block)
        return out

    def _cache(
        self,
        blocks: list[Block],
        digests: list[bytes],
        tokens: list[int],
        start: int,
        end: int,
        session: str,
    ) -> None:
        """Commits full blocks start..end of a request to the prefix cache."""
        if start >= end:
            return
        for i in range(start, end):
            if digests[i] in self.cached:
                # vLLM would cache a duplicate; the test scenario avoids this case on purpose.
                raise RuntimeError("scenario produced a duplicate cached block")
            blocks[i].digest = digests[i]
            self.cached[digests[i]] = blocks[i]
        self.stored += end - start
        extra = {"session_id": session} if self.layout == "map" else {}
        self.events.append(
            gpu_stored(
                self.structs,
                [event_hash(d) for d in digests[start:end]],
                event_hash(digests[start - 1]) if start > 0 else None,
                tokens[start * BLOCK_SIZE : end * BLOCK_SIZE],
                **extra,
            )
        )
        self._offload(digests[start:end])

    def prefill(self, prompt: list[int], session: str) -> "Request":
        digests = block_digests(prompt)
        # A full hit still recomputes the last token, so at most (len - 1) // block_size hit.
        max_hit = (len(prompt) - 1) // BLOCK_SIZE
        hits: list[Block] = []
        for d in digests[:max_hit]:
            block = self.cached.get(d)
            if block is None:
                break
            hits.append(block)
        # Blocks found on the CPU tier after the GPU's are loaded into fresh GPU blocks (and
        # cached there again, with their own BlockStored).
        loaded = 0
        for d in digests[len(hits) : max_hit]:
            if d not in self.cpu:
                break
            loaded += 1
        self.loaded += loaded
        for block in hits:
            self.free.pop(block.id, None)
        new = self._allocate(-(-len(prompt) // BLOCK_SIZE) - len(hits))
        blocks = hits + new
        self._cache(blocks, digests, prompt, len(hits), len(digests), session)
        return Request(prompt, blocks, len(digests), session)

    def decode(self, request: "Request", output: list[int]) -> None:
        tokens = request.tokens + output
        need = -(-len(tokens) // BLOCK_SIZE) - len(request.blocks)
        request.blocks += self._allocate(need)
        digests = block_digests(tokens)
        self._cache(request.blocks, digests, tokens, request.cached, len(digests), request.session)
        request.tokens = tokens
        request.cached = len(digests)

    def finish(self, request: "Request") -> None:
        for block in reversed(request.blocks):
            self.free[block.id] = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.digest = None
        self.cached.clear()
        self.cpu.clear()  # kvroute drops every tier of an engine on AllBlocksCleared
        self.events.append(self.structs["AllBlocksCleared"]())

    def cached_prefix(self, tokens: list[int]) -> int:
        """Leading blocks held on the GPU or, with the connector, on the CPU tier."""
        n = 0
        for d in block_digests(tokens):
            if d not in self.cached and d not in self.cpu:
                break
            n += 1
        return n


class Request:
    def __init__(self, tokens: list[int], blocks: list[Block], cached: int, session: str) -> None:
        self.tokens = tokens
        self.blocks = blocks
        self.cached = cached
        self.session = session


# --------------------------------------------------------------------------------------------
# Transport: PUB plus a replay ROUTER served from its own thread
# --------------------------------------------------------------------------------------------


class Publisher:
    def __init__(
        self, ctx: zmq.Context, topic: str, layout: str, structs: dict[str, type], live_lag: int
    ):
        self.live_lag = live_lag
        self.live_queue: collections.deque[tuple[bytes, bytes, bytes]] = collections.deque()
        self.topic = topic.encode("utf-8")
        self.layout = layout
        self.structs = structs
        self.encoder = msgspec.msgpack.Encoder()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.set_hwm(100_000)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        if layout == "map":
            # vLLM 0.33 lets a whole buffer's replay through; earlier releases keep ZMQ's
            # default of 1,000 messages, and drop the rest of a larger one.
            self.router.setsockopt(zmq.SNDHWM, 2 * (BUFFER_STEPS + 1))
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=BUFFER_STEPS
        )
        self.lock = threading.Lock()
        self.seq = 0
        self.sent = 0
        self.lost: list[int] = []
        self.replay_requests = 0
        self.stop = threading.Event()
        self.replay_error: BaseException | None = None
        self.thread = threading.Thread(target=self._replay_thread, name="replay", daemon=True)

    def publish(self, ts: float, events: list[Any], lose: bool = False) -> int:
        batch = self.structs["KVEventBatch"](ts=ts, events=events, data_parallel_rank=0)
        return self.publish_payload(self.encoder.encode(batch), lose)

    def publish_payload(self, payload: bytes, lose: bool = False) -> int:
        """Buffers an encoded batch for replay and sends it (unless ``lose``); its sequence."""
        seq = self.seq
        self.seq += 1
        with self.lock:
            self.buffer.append((seq, payload))
        if lose:
            self.lost.append(seq)
        else:
            self.live_queue.append((self.topic, seq.to_bytes(8, "big"), payload))
            self.flush_live(self.live_lag)
        return seq

    def flush_live(self, keep: int = 0) -> None:
        """Sends live messages, leaving the newest ``keep`` queued (``--live-lag``)."""
        while len(self.live_queue) > keep:
            self.pub.send_multipart(self.live_queue.popleft())
            self.sent += 1

    def _replay_thread(self) -> None:
        try:
            self._serve_replay()
        except BaseException as e:  # reported by main(), which then exits non-zero
            self.replay_error = e
            raise

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self.stop.is_set():
            if not dict(poller.poll(50)):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                print(f"invalid replay request: {len(frames)} frames", file=sys.stderr)
                continue
            client, delimiter, start = frames
            if delimiter != b"" or len(start) != 8:
                print("invalid replay request", file=sys.stderr)
                continue
            start_seq = int.from_bytes(start, "big")
            self.replay_requests += 1
            with self.lock:
                batches = [(s, p) for s, p in self.buffer if s >= start_seq]
            for s, payload in batches:
                if self.layout == "map":  # 0.26+ framing: like live messages
                    reply = (client, b"", self.topic, s.to_bytes(8, "big"), payload)
                else:  # 0.9.0-0.25 framing
                    reply = (client, b"", s.to_bytes(8, "big"), payload)
                self.router.send_multipart(reply)
            if self.layout == "map":
                self.router.send_multipart((client, b"", b"", END_SEQ, b""))
            else:
                self.router.send_multipart((client, b"", END_SEQ, b""))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.pub.close()
        self.router.close()


# --------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------


def emit(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def message(rng: random.Random, lo: int, hi: int, prompt_len: int) -> list[int]:
    """Random tokens (ids span every msgpack/CBOR int width), never ending a prompt on a
    block boundary (a full prefix hit would make vLLM cache a duplicate block)."""
    n = rng.randint(lo, hi)
    if (prompt_len + n) % BLOCK_SIZE == 0:
        n += 1
    widths = ((0, 24), (24, 256), (256, 65536), (65536, 200_000))
    return [rng.randrange(*rng.choice(widths)) for _ in range(n)]


def run_workload(args: argparse.Namespace, engine: Engine, publisher: Publisher) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = message(rng, 40, 40, 0)  # 2.5 blocks shared by every conversation
    conversations = [list(system) for _ in range(args.conversations)]
    ts = 1_767_000_000.0
    lost_pending = True

    def step(lose: bool = False) -> bool:
        nonlocal ts
        events = engine.take_events()
        if not events:  # vLLM publishes a batch only for steps that produced events
            return False
        ts += 0.025
        publisher.publish(ts, events, lose=lose)
        publisher.stop.wait(args.step_interval)
        return True

    for turn in range(args.turns):
        if turn == 1:
            # A prefix-cache reset between rounds (vLLM emits AllBlocksCleared on its own).
            engine.reset_prefix_cache()
            step()
        for c, conv in enumerate(conversations):
            prompt = conv + message(rng, 8, 40, len(conv))
            request = engine.prefill(prompt, session=f"conv-{c}")
            # The first store after the reset is dropped on PUB: every later store of every
            # conversation chains onto its blocks, so only replay can make them placeable.
            if step(lose=lost_pending and turn == 1) and turn == 1:
                lost_pending = False
            request_output = message(rng, 10, 60, len(prompt))
            engine.decode(request, request_output)
            step()
            engine.finish(request)
            conv[:] = request.tokens
    if lost_pending:
        raise RuntimeError("the scenario never lost a batch")
    return conversations


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("array", "map"), required=True)
    parser.add_argument("--topic", default="")
    parser.add_argument("--seed", type=int, default=20261)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--num-blocks", type=int, default=40)
    parser.add_argument(
        "--cpu-blocks",
        type=int,
        default=0,
        help="an OffloadingConnector CPU tier of this many blocks (0: none)",
    )
    parser.add_argument("--step-interval", type=float, default=0.005)
    parser.add_argument(
        "--live-lag",
        type=int,
        default=0,
        help="hold each live message back until N newer batches are buffered (they are "
        "replayable at once): models PUB delivery slower than the replay socket's",
    )
    parser.add_argument("--hash-vectors", type=Path, default=HASH_VECTORS)
    parser.add_argument("--self-check-only", action="store_true")
    args = parser.parse_args()

    checked = self_check(args.hash_vectors)
    structs = declare_vllm_0_23() if args.layout == "array" else declare_vllm_0_33()
    check_struct_shapes(args.layout, structs)
    if args.self_check_only:
        print(f"{checked} hash vectors agree", file=sys.stderr)
        return 0

    ctx = zmq.Context()
    publisher = Publisher(ctx, args.topic, args.layout, structs, args.live_lag)
    publisher.thread.start()
    emit({
        "pub": f"tcp://127.0.0.1:{publisher.pub_port}",
        "replay": f"tcp://127.0.0.1:{publisher.replay_port}",
    })
    try:
        for line in sys.stdin:
            if line.strip() == "go":
                break
        else:
            return 0  # stdin closed before "go"

        engine = Engine(args.num_blocks, structs, args.layout, args.cpu_blocks)
        conversations = run_workload(args, engine, publisher)
        publisher.flush_live()
        for tokens in conversations:
            emit({"tokens": tokens, "cached_blocks": engine.cached_prefix(tokens)})
        emit({
            "done": True,
            "batches": publisher.seq,
            "sent": publisher.sent,
            "lost": publisher.lost,
            "cached_total": len(engine.cached),
            "cpu_total": len(engine.cpu),
            "cpu_loaded": engine.loaded,
            "blocks_stored": engine.stored,
            "blocks_removed": engine.removed,
            "hash_vectors_checked": checked,
            "replay_requests": publisher.replay_requests,
        })
        for line in sys.stdin:
            if line.strip() == "quit":
                break
        return 0 if publisher.replay_error is None else 1
    finally:
        publisher.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main())
