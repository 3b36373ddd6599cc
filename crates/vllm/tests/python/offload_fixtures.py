#!/usr/bin/env python3
"""Writes ``tests/data/offload-events.jsonl``: KV-event batches in the shapes vLLM's offloading
connectors and LMCache publish, release by release (``shared/reference/vllm-wire.md`` §6).

The structs are look-alikes declared with the same msgspec options and field order as each
imitated release (vLLM cannot be imported without torch), so msgspec writes the bytes that
release would write for the same content. Hashes are real ``sha256_cbor`` block hashes (seed
``vllm-none-hash``, block size 16), as ``vllm_publisher.py`` computes and checks them.

Run from the repository root: ``python crates/vllm/tests/python/offload_fixtures.py``.

Every case is one scenario on one endpoint: an 8-block prompt stored on the GPU (the release's
GPU event shape), then offload events for it, then removals. One JSON line per published
message: ``case``, ``vllm`` (the imitated release), ``seq``, ``payload_hex``, ``expect`` (the
events a decoder must produce) and, on the last line of a case, ``after``: per block index
(0-7), the tiers the endpoint holds it on once every message of the case is applied to an
index with block size 16 (``offload_block_size`` in ``index``, the chunk size the case's
connector uses).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_publisher import block_digests, event_hash  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "data/offload-events.jsonl"
PROMPT = list(range(1000, 1000 + 8 * 16))


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def positional(stored: list[str], removed: list[str]) -> dict[str, type]:
    """Tagged positional events (vLLM up to 0.23) with the given trailing optional fields."""

    class Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    stored_ns: dict[str, Any] = {
        "__annotations__": {
            "block_hashes": list[int | bytes],
            "parent_block_hash": int | bytes | None,
            "token_ids": list[int],
            "block_size": int,
            "lora_id": int | None,
            "medium": str | None,
        }
    }
    for name in stored:
        stored_ns["__annotations__"][name] = Any
        if name != "lora_name":  # required (no default) in every release that has it
            stored_ns[name] = None
    removed_ns: dict[str, Any] = {
        "__annotations__": {"block_hashes": list[int | bytes], "medium": str | None}
    }
    for name in removed:
        removed_ns["__annotations__"][name] = Any
        removed_ns[name] = None
    block_stored = type("BlockStored", (Event,), stored_ns)
    block_removed = type("BlockRemoved", (Event,), removed_ns)
    return {"BlockStored": block_stored, "BlockRemoved": block_removed}


def mapped() -> dict[str, type]:
    """Events as maps tagged by ``type`` (vLLM 0.24+), defaulted fields omitted when None."""

    class Event(msgspec.Struct, omit_defaults=True, tag=True):
        pass

    class BlockStored(Event):
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

    class BlockRemoved(Event):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    return {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}


DIGESTS = block_digests(PROMPT)
HASHES = [event_hash(d) for d in DIGESTS]


def stored(structs, hashes, parent, tokens, block_size, medium, **extra) -> Any:
    fields = structs["BlockStored"].__struct_fields__
    kwargs = {k: v for k, v in extra.items() if k in fields}
    if "lora_name" in fields:
        kwargs.setdefault("lora_name", None)
    return structs["BlockStored"](
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        **kwargs,
    )


def removed(structs, hashes, medium, **extra) -> Any:
    fields = structs["BlockRemoved"].__struct_fields__
    kwargs = {k: v for k, v in extra.items() if k in fields}
    return structs["BlockRemoved"](block_hashes=hashes, medium=medium, **kwargs)


def gpu_store(structs, group: bool) -> Any:
    extra = {"group_idx": 0} if group else {}
    return stored(structs, HASHES, None, PROMPT, 16, "GPU", **extra)


def expect(event: Any) -> dict[str, Any]:
    def h(x):
        return x if isinstance(x, int) or x is None else int.from_bytes(x[-8:], "big")

    tag = type(event).__name__
    out: dict[str, Any] = {"type": tag, "block_hashes": [h(x) for x in event.block_hashes]}
    out["medium"] = event.medium
    if tag == "BlockStored":
        out["parent_block_hash"] = h(event.parent_block_hash)
        out["token_ids"] = list(event.token_ids)
        out["block_size"] = event.block_size
        out["lora_name"] = getattr(event, "lora_name", None)
    out["group_idx"] = getattr(event, "group_idx", None)
    return out


def chunk_tails(factor: int) -> list[int]:
    """Indices of the last block of each offloaded chunk of `factor` blocks."""
    return [i for i in range(8) if (i + 1) % factor == 0]


def cases() -> list[dict[str, Any]]:
    out = []

    def case(name, version, structs, messages, after, index=None):
        out.append(
            {
                "name": name,
                "vllm": version,
                "structs": structs,
                "messages": messages,
                "after": after,
                "index": index or {},
            }
        )

    # 0.11-0.19: raw 32-byte digests, block_size = the offloaded block size (64: 4 GPU blocks,
    # the chunk's last block hash names it), no lora_name before 0.14.
    for version, s in [
        ("0.13.0", positional([], [])),
        ("0.17.0", positional(["lora_name", "extra_keys"], [])),
    ]:
        tails = [DIGESTS[i] for i in chunk_tails(4)]
        case(
            f"offloading-{version}-bytes-chunks",
            version,
            s,
            [
                [gpu_store(s, False)],
                [stored(s, tails, None, [], 64, "CPU")],
                # The GPU evicts the first chunk: it survives on the CPU tier only.
                [removed(s, HASHES[:4], "GPU")],
                # The CPU tier drops the second chunk.
                [removed(s, [DIGESTS[7]], "CPU")],
            ],
            {**{i: ["CPU"] for i in range(4)}, **{i: ["GPU"] for i in range(4, 8)}},
            {"offload_block_size": 64},
        )

    # 0.20-0.23: block_size 0 (the chunk size must come from configuration), group_idx.
    s = positional(["lora_name", "extra_keys", "group_idx"], ["group_idx"])
    tails = [DIGESTS[i] for i in chunk_tails(2)]
    case(
        "offloading-0.21.0-bytes-placeholders",
        "0.21.0",
        s,
        [
            [gpu_store(s, True)],
            [stored(s, tails, None, [], 0, "CPU", group_idx=0)],
            [removed(s, HASHES[:2], "GPU", group_idx=0)],
        ],
        {**{i: ["CPU"] for i in range(2)}, **{i: ["CPU", "GPU"] for i in range(2, 8)}},
        {"offload_block_size": 32},
    )

    # 0.24+: uint64 hashes, one per chunk (legacy placeholder payload), by medium string.
    m = mapped()
    for version, medium in [
        ("0.24.0", "CPU"),
        ("0.26.0", "FS"),
        ("0.26.0", "OBJ"),
        ("0.27.0", "STORAGE"),
        ("0.33.0", "cpu"),
    ]:
        tier = "CPU" if medium.upper() == "CPU" else "STORAGE"
        tails = [HASHES[i] for i in chunk_tails(4)]
        case(
            f"offloading-{version}-placeholders-{medium}",
            version,
            m,
            [
                [gpu_store(m, True)],
                [stored(m, tails, None, [], 0, medium, group_idx=0)],
                # Chunks overlapping a shared prefix are announced again: reference-counted.
                [stored(m, tails[:1], None, [], 0, medium, group_idx=0)],
                [removed(m, HASHES, "GPU", group_idx=0)],
                [removed(m, tails[:1], medium, group_idx=0)],
            ],
            {i: [tier] for i in range(8)},
            {"offload_block_size": 64},
        )

    # 0.24+ self-describing: every constituent hash, real parent, tokens, per-block size.
    case(
        "offloading-0.33.0-self-describing",
        "0.33.0",
        m,
        [
            [gpu_store(m, True)],
            [
                stored(
                    m,
                    HASHES[:4],
                    None,
                    PROMPT[:64],
                    16,
                    "CPU",
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                ),
                stored(
                    m,
                    HASHES[4:],
                    HASHES[3],
                    PROMPT[64:],
                    16,
                    "CPU",
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                ),
            ],
            # A second request re-announces the shared first chunk.
            [
                stored(
                    m,
                    HASHES[:4],
                    None,
                    PROMPT[:64],
                    16,
                    "CPU",
                    group_idx=0,
                    kv_cache_spec_kind="full_attention",
                )
            ],
            [removed(m, HASHES, "GPU", group_idx=0)],
            # One removal of the shared chunk: the second reference keeps it; the tail goes.
            [removed(m, HASHES, "CPU", group_idx=0)],
        ],
        {i: ["CPU"] for i in range(4)},
    )

    # LMCache (LMCacheConnectorV1): BlockStored only, its own chunk hashes over 64-token chunks
    # (LMCache's chunk_size; 256 by default), never a removal.
    chunks = [PROMPT[i : i + 64] for i in range(0, len(PROMPT), 64)]
    lm_hashes = []
    prev = b""
    for chunk in chunks:
        prev = hashlib.sha256(prev + json.dumps(chunk).encode()).digest()
        lm_hashes.append(int.from_bytes(prev[:8], "big"))
    case(
        "lmcache-0.33.0-stored-only",
        "0.33.0",
        m,
        [
            [gpu_store(m, True)],
            [stored(m, [lm_hashes[0]], None, chunks[0], 64, "cpu")],
            [stored(m, [lm_hashes[1]], lm_hashes[0], chunks[1], 64, "cpu")],
            [removed(m, HASHES, "GPU", group_idx=0)],
        ],
        {i: ["CPU"] for i in range(8)},
    )
    return out


def main() -> int:
    lines = []
    for c in cases():
        batch_type = type(
            "KVEventBatch",
            (EventBatch,),
            {"__annotations__": {"events": list[Any]}},
        )
        for seq, events in enumerate(c["messages"]):
            payload = msgspec.msgpack.encode(batch_type(ts=1_700_000_000.0, events=events))
            line = {
                "case": c["name"],
                "vllm": c["vllm"],
                "seq": seq,
                "payload_hex": payload.hex(),
                "expect": [expect(e) for e in events],
            }
            if seq == len(c["messages"]) - 1:
                line["after"] = {str(k): v for k, v in sorted(c["after"].items())}
                line["index"] = c["index"]
            lines.append(json.dumps(line))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} messages to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
