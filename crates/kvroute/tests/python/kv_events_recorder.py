"""Records the KV events an engine publishes, decoded as vLLM's own consumers decode them
(pyzmq + msgspec), until stdin closes.

Usage: kv_events_recorder.py tcp://HOST:PORT
Prints "ready" once subscribed; once stdin ends and 100 ms pass without an event, one JSON list of
{"seq": n, "type": ..., every field as published} in arrival order.
"""

import json
import sys
import threading

import msgspec
import zmq

address = sys.argv[1]
context = zmq.Context()
socket = context.socket(zmq.SUB)
socket.setsockopt(zmq.SUBSCRIBE, b"")
socket.setsockopt(zmq.RCVTIMEO, 100)
socket.connect(address)

done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
print("ready", flush=True)

FIELDS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"],
    "BlockRemoved": ["block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": [],
}

events = []
while True:
    try:
        topic, seq, payload = socket.recv_multipart()
    except zmq.Again:
        if done.is_set():
            break
        continue
    batch = msgspec.msgpack.decode(payload)
    for event in batch[1]:
        # Events are tagged arrays: [tag, field, ...] (array_like structs) or maps.
        if isinstance(event, dict):
            record = dict(event)
        else:
            kind = event[0]
            record = {"type": kind}
            record.update(zip(FIELDS.get(kind, []), event[1:]))
        record["seq"] = int.from_bytes(seq, "big")
        events.append(record)

print(json.dumps(events), flush=True)
