"""Records the KV events an engine publishes, decoded as vLLM's own consumers decode them
(pyzmq + msgspec), until stdin closes.

Usage: kv_events_recorder.py tcp://HOST:PUB_PORT tcp://HOST:REPLAY_PORT
Prints "ready" once connected; once stdin ends and 100 ms pass without an event, one JSON list of
{"seq": n, "type": ..., every field as published}, in sequence order.

A SUB socket receives nothing until its subscription has reached the publisher, so batches
published just after "ready" can be missed (ZMQ's slow joiner). At the end the recorder asks the
publisher's replay socket for every batch from sequence 0, as vLLM's own subscriber example does
after a gap, and keeps each batch once: the record is whole whatever the timing. A replay that
does not end within 10 s fails the recorder.
"""

import json
import sys
import threading

import msgspec
import zmq

address, replay_address = sys.argv[1], sys.argv[2]
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
END = b"\xff" * 8


def records(seq, payload):
    """The events of one batch, each tagged with the batch's sequence number."""
    out = []
    for event in msgspec.msgpack.decode(payload)[1]:
        # Events are tagged arrays: [tag, field, ...] (array_like structs) or maps.
        if isinstance(event, dict):
            record = dict(event)
        else:
            kind = event[0]
            record = {"type": kind}
            record.update(zip(FIELDS.get(kind, []), event[1:]))
        record["seq"] = seq
        out.append(record)
    return out


batches = {}
while True:
    try:
        topic, seq, payload = socket.recv_multipart()
    except zmq.Again:
        if done.is_set():
            break
        continue
    batches.setdefault(int.from_bytes(seq, "big"), payload)

# Every batch from the first, from the replay socket (a DEALER: an empty frame, then the start).
replay = context.socket(zmq.DEALER)
replay.setsockopt(zmq.RCVTIMEO, 10_000)
replay.setsockopt(zmq.LINGER, 0)
replay.connect(replay_address)
replay.send_multipart([b"", (0).to_bytes(8, "big")])
while True:
    try:
        frames = replay.recv_multipart()
    except zmq.Again:
        sys.exit("the replay socket did not end its replay within 10 s")
    # [empty, topic, seq, payload] since vLLM 0.26, [empty, seq, payload] before.
    seq, payload = frames[-2], frames[-1]
    if seq == END:
        break
    batches.setdefault(int.from_bytes(seq, "big"), payload)

events = [record for seq in sorted(batches) for record in records(seq, batches[seq])]
print(json.dumps(events), flush=True)
