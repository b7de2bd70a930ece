"""The prefix cache's changes, published for a router as vLLM publishes its KV-cache events (vllm/distributed/
kv_events.py, 0.26 and later), so that llm-d's router (the Inference Gateway's endpoint picker with its precise
prefix-cache scorer) sends a conversation's next turn to the replica that holds its history.

On a ZMQ PUB socket, one message per engine step that changed the cache, three frames: the topic
(`kv@<pod>@<model>`), an 8-byte big-endian sequence number (0, 1, 2, ...), and a msgpack payload
`[timestamp, [event, ...], data_parallel_rank]` whose events are maps tagged by `type`: BlockStored {block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name}, BlockRemoved {block_hashes, medium},
AllBlocksCleared {}. A subscriber that missed some asks the replay socket (ROUTER): it sends an empty frame and the
first sequence number it wants (8 bytes big-endian; a DEALER socket, since the answer is many messages) and gets
each buffered message still held, as [b"", topic, seq, payload], then [b"", b"", END_SEQ, b""].

The engine never waits for a subscriber: its loop hands each step's events to a bounded queue, and a thread of
this publisher sends them. Should the queue be full (a stalled publisher thread), that step's events are dropped and
counted, and the next message begins with AllBlocksCleared: a router then forgets this replica's blocks and learns
them again as they are stored, instead of keeping a view that misses some removals.
"""
from __future__ import annotations

import collections
import itertools
import os
import queue
import threading
import time

import msgspec
import zmq

from dflash_contract.server import KV_EVENTS_ENDPOINT_ENV, KV_EVENTS_REPLAY_ENV, KV_EVENTS_TOPIC_ENV
from dflash_runtime.block_manager import CacheEvent
from dflash_runtime.kv_cache import BLOCK_SIZE

END_SEQ = (-1).to_bytes(8, "big", signed=True)
BUFFER_MESSAGES = 10_000  # vLLM's buffer_steps: what a replay can still send
QUEUE_STEPS = 1_000  # steps' events waiting for the publisher thread at most
POLL_MS = 50


class KVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, block_size: int = BLOCK_SIZE):
        """Binds its sockets now (an endpoint in use raises zmq.ZMQError). medium: vLLM's name of where the blocks
        live, "GPU" or "CPU", set once the engine is on its device."""
        self.topic, self.block_size, self.medium = topic.encode(), block_size, "GPU"
        self.dropped = 0  # steps whose events were dropped (the queue was full)
        self._queue: queue.Queue[list[CacheEvent] | None] = queue.Queue(QUEUE_STEPS)
        self._clear_next = False
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.bind(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="dflash-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[CacheEvent]) -> None:
        """Queue one step's events; never blocks."""
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1
            self._clear_next = True

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        sequence, buffer = itertools.count(), collections.deque(maxlen=BUFFER_MESSAGES)
        encoder, poller = msgspec.msgpack.Encoder(), zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                if self._replay is not None and poller.poll(0):
                    self._answer_replay(buffer)
                try:
                    events = self._queue.get(timeout=POLL_MS / 1000)
                except queue.Empty:
                    continue
                if events is None:
                    return
                if self._clear_next:
                    self._clear_next = False
                    events = [CacheEvent("cleared"), *events]
                seq = next(sequence).to_bytes(8, "big")
                payload = encoder.encode([time.time(), [self._wire(e) for e in events], None])
                buffer.append((seq, payload))
                self._pub.send_multipart((self.topic, seq, payload))
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _answer_replay(self, buffer) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # not a sequence number after the envelope: nothing to answer
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(buffer):
            if int.from_bytes(seq, "big") >= first:
                self._replay.send_multipart((client, b"", self.topic, seq, payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _wire(self, event: CacheEvent) -> dict:
        if event.kind == "stored":
            return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                    "parent_block_hash": event.parent_hash, "token_ids": list(event.token_ids),
                    "block_size": self.block_size, "lora_id": None, "medium": self.medium, "lora_name": None}
        if event.kind == "removed":
            return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": self.medium}
        return {"type": "AllBlocksCleared"}


def kv_event_publisher() -> KVEventPublisher | None:
    """The publisher dflash-serve asked for (--kv-events-port), None when it asked for none."""
    endpoint = os.environ.get(KV_EVENTS_ENDPOINT_ENV)
    if not endpoint:
        return None
    return KVEventPublisher(endpoint, os.environ.get(KV_EVENTS_REPLAY_ENV) or None,
                            os.environ.get(KV_EVENTS_TOPIC_ENV, ""))
