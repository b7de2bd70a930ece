"""The prefix cache's changes for a router, in vLLM's KV-cache event format: recorded by the block manager, published
over ZMQ, decoded here with msgspec structs written from vLLM's own schema (vllm/distributed/kv_events.py, 0.34:
events as maps tagged by `type` inside a positional batch), for the block manager alone and for a real server."""
from __future__ import annotations

import contextlib
import queue
import threading
import time

import msgspec
import pytest
import requests
import zmq

from deploy.ports import free_ports
from deploy.serve import ready_line, ready_ports, start_server
from dflash_runtime.block_manager import BlockManager, CacheEvent
from dflash_serving import kv_events
from dflash_serving.kv_events import END_SEQ, KVEventPublisher

MODEL = "smollm2-135m"


# --- vLLM's schema, as vllm/distributed/kv_events.py declares it --------------------------------------------------

class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """A router's side: SUB on the events, DEALER on the replay socket."""

    def __init__(self, endpoint: str, replay: str | None = None):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay

    def messages(self, count: int, timeout_ms: int = 10_000) -> list[tuple[bytes, int, KVEventBatch]]:
        out = []
        while len(out) < count:
            assert self.sub.poll(timeout_ms), f"{len(out)} of {count} messages came"  # never a blocking recv
            topic, seq, payload = self.sub.recv_multipart()
            out.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
        return out

    def replay(self, start: int) -> list[tuple[bytes, int, KVEventBatch]]:
        dealer = self.context.socket(zmq.DEALER)  # many replies to one request: not a REQ socket's one
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert dealer.poll(10_000)
            empty, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                dealer.close(linger=0)
                return out
            out.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))

    def close(self):
        self.context.destroy(linger=0)  # every socket, a replay's left open by a failed assertion too


def endpoints() -> tuple[str, str]:
    events, replay = free_ports(2)
    return f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"


# --- the block manager's records --------------------------------------------------------------------------------

def test_the_block_manager_records_what_enters_and_leaves_its_cache_once_asked():
    blocks = BlockManager(num_blocks=1 + 4, block_size=4)
    table, hashes = [], []
    blocks.admit(table, hashes, list(range(12)), reserve=12)
    blocks.cache_full_blocks(table, hashes, list(range(12)), written=8)
    assert blocks.take_events() == []  # not asked: nothing recorded
    blocks.record_events()
    blocks.cache_full_blocks(table, hashes, list(range(12)), written=12)
    assert blocks.take_events() == [CacheEvent("stored", (hashes[2],), hashes[1], (8, 9, 10, 11))]
    blocks.release(table)
    other, other_hashes = [], []
    blocks.admit(other, other_hashes, [50 + t for t in range(16)], reserve=16)  # needs every block: all evicted
    assert blocks.take_events() == [CacheEvent("removed", (h,)) for h in reversed(hashes)]  # last freed, first reused
    blocks.cache_full_blocks(other, other_hashes, [50 + t for t in range(16)], written=16)
    (stored,) = blocks.take_events()  # one chain of four blocks: one event, as vLLM sends it
    assert stored == CacheEvent("stored", tuple(other_hashes), None, tuple(50 + t for t in range(16)))
    blocks.forget()
    assert blocks.take_events() == [CacheEvent("cleared")] and blocks.take_events() == []


def test_published_events_decode_with_vllms_schema_in_order_and_replay(monkeypatch):
    endpoint, replay = endpoints()
    publisher = KVEventPublisher(endpoint, replay, "kv@pod-a@smollm2-135m", block_size=4)
    subscriber = Subscriber(endpoint, replay)
    try:
        base = 0  # until the subscription is up, PUB drops messages: probe until one arrives
        while True:
            publisher.publish([CacheEvent("cleared")])
            base += 1
            if subscriber.sub.poll(200):
                break
        time.sleep(0.5)
        while subscriber.sub.poll(100):  # the probes still on their way
            subscriber.sub.recv_multipart()
        steps = [[CacheEvent("stored", (11, 12), None, tuple(range(8)))], [CacheEvent("removed", (11,))],
                 [CacheEvent("stored", (13,), 12, (8, 9, 10, 11)), CacheEvent("cleared")]]
        for events in steps:
            publisher.publish(events)
        got = subscriber.messages(3)
        assert [topic for topic, _, _ in got] == [b"kv@pod-a@smollm2-135m"] * 3
        assert [seq for _, seq, _ in got] == [base, base + 1, base + 2]  # no gaps, counted from the first message
        first, second, third = (batch.events for _, _, batch in got)
        assert first == [BlockStored([11, 12], None, list(range(8)), 4, None, "GPU", None)]
        assert second == [BlockRemoved([11], "GPU")] and third[1] == AllBlocksCleared()
        assert third[0].parent_block_hash == 12 and all(b.data_parallel_rank is None for _, _, b in got)
        # a subscriber that missed some asks for them: every buffered message from there, then the end marker
        replayed = subscriber.replay(base + 1)
        assert [(seq, batch.events) for _, seq, batch in replayed] == [(base + 1, second), (base + 2, third)]
        # a publisher whose queue is full drops the step, counts it, and makes the next message begin with a clear
        monkeypatch.setattr(publisher._queue, "put_nowait", lambda _: (_ for _ in ()).throw(kv_events.queue.Full))
        publisher.publish([CacheEvent("removed", (13,))])
        monkeypatch.undo()
        publisher.publish([CacheEvent("removed", (14,))])
        (_, seq, batch), = subscriber.messages(1)
        assert publisher.dropped == 1 and seq == base + 3
        assert batch.events == [AllBlocksCleared(), BlockRemoved([14], "GPU")]
    finally:
        publisher.close()
        subscriber.close()


def test_an_endpoint_in_use_is_refused_when_the_publisher_starts():
    endpoint, _ = endpoints()
    first = KVEventPublisher(endpoint, None, "t")
    try:
        with pytest.raises(zmq.ZMQError):
            KVEventPublisher(endpoint, None, "t")
    finally:
        first.close()


# --- a real server ----------------------------------------------------------------------------------------------

def test_a_conversation_on_a_real_server_is_published_block_by_block(default_build, tmp_path):
    """Two turns through the server: the stored blocks, each with its parent, hold the conversation's own tokens (the
    first prompt's whole blocks, the second's, which begins with the first turn), under the topic and the sequence
    numbers a router expects; nothing is removed on a cache this size; a late subscriber gets it all by replay."""
    from clients import DFlashClient, GenerationParams
    from dflash_runtime.text import encode_prompt, load_tokenizer

    with start_server(default_build / "model_repository", 0, 0, 0, log_path=tmp_path / "server.log",
                      kv_events_port=0, kv_events_replay_port=0, kv_events_topic="kv@test-pod@smollm2-135m") as server:
        ports = ready_ports(ready_line(server))
        subscriber = Subscriber(f"tcp://127.0.0.1:{ports['kv_events']}",
                                f"tcp://127.0.0.1:{ports['kv_events_replay']}")
        try:
            with DFlashClient(server.grpc_url) as client:
                params = GenerationParams(max_tokens=40, temperature=0)
                first_prompt = [{"role": "user", "content": SEA}]
                first = client.generate(first_prompt, params)
                second_prompt = [*first_prompt, {"role": "assistant", "content": first.text},
                                 {"role": "user", "content": "And what about the sky above it?"}]
                assert first.text and client.generate(second_prompt, params).text
            published = subscriber.replay(0)  # everything since the server started, in order
        finally:
            subscriber.close()
    assert published and [seq for _, seq, _ in published] == list(range(len(published)))
    assert {topic for topic, _, _ in published} == {b"kv@test-pod@smollm2-135m"}
    events = [e for _, _, batch in published for e in batch.events]
    assert all(isinstance(e, BlockStored) and e.block_size == 16 and e.medium == "CPU" for e in events), events
    prefixes = {None: []}  # block hash -> the tokens from the sequence's start to the block's end
    for event in events:
        assert event.parent_block_hash in prefixes and len(event.token_ids) == 16 * len(event.block_hashes)
        tokens = prefixes[event.parent_block_hash]
        for i, h in enumerate(event.block_hashes):
            tokens = prefixes[h] = tokens + event.token_ids[16 * i:16 * (i + 1)]
    tokenizer = load_tokenizer(default_build / "target")
    for prompt in (first_prompt, second_prompt):
        ids = encode_prompt(tokenizer, prompt)
        assert len(ids) >= 32 and ids[:len(ids) // 16 * 16] in prefixes.values()


SEA = ("The sea covers most of the surface of our planet. It holds salt water, currents that carry heat from the "
       "equator to the poles, and more living things than any forest. Tell me about the sea.")


class PrefixRouter:
    """The endpoint picker's prefix rule, in a test: a request goes to the replica whose prefix cache, as its events
    tell, holds the longest run of the request's whole blocks; on a tie, to the one with the shorter queue (its
    gateway's vllm:num_requests_waiting). The token ids come from a render endpoint: no tokenizer here."""

    def __init__(self, replicas):
        self.replicas = replicas
        self.events = [f"tcp://127.0.0.1:{ready_ports(ready_line(r))['kv_events_replay']}" for r in replicas]

    def cached_prefixes(self, replica: int) -> set[tuple[int, ...]]:
        """Every token prefix, in whole blocks, the replica's cache holds: its events since it started (a replay),
        stored blocks chained to their parents, removed ones dropped."""
        subscriber = Subscriber("tcp://127.0.0.1:1", self.events[replica])  # only the replay socket is used
        try:
            batches = [batch for _, _, batch in subscriber.replay(0)]
        finally:
            subscriber.close()
        prefixes = {None: ()}
        for event in (e for batch in batches for e in batch.events):
            if isinstance(event, AllBlocksCleared):
                prefixes = {None: ()}
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    prefixes.pop(h, None)
            elif event.parent_block_hash in prefixes:
                tokens = prefixes[event.parent_block_hash]
                for i, h in enumerate(event.block_hashes):
                    tokens = prefixes[h] = tokens + tuple(event.token_ids[16 * i:16 * (i + 1)])
        return set(prefixes.values())

    def pick(self, messages: list[dict]) -> tuple[int, int]:
        """(the replica, the tokens of the request's prefix its cache holds)."""
        url = self.replicas[0].gateway.url
        ids = tuple(requests.post(f"{url}/v1/chat/completions/render", json={"model": MODEL, "messages": messages},
                                  timeout=60).json()["token_ids"])

        def score(replica: int) -> tuple[int, float]:
            held = self.cached_prefixes(replica)
            matched = max((k for k in range(0, len(ids) // 16 + 1) if ids[:16 * k] in held), default=0)
            waiting = scrape_waiting(self.replicas[replica].gateway.url)
            return matched, -waiting

        best = max(range(len(self.replicas)), key=score)
        return best, 16 * score(best)[0]


def scrape_waiting(url: str) -> float:
    return gauges(url)[1]


def gauges(url: str) -> tuple[float, float]:
    """(vllm:num_requests_running, vllm:num_requests_waiting) on a replica's gateway."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return tuple(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))
                 for name in ("vllm:num_requests_running", "vllm:num_requests_waiting"))


@contextlib.contextmanager
def streams(url: str, count: int):
    """`count` long streamed completions in flight on a replica until the block ends (the gateway answers a stream's
    headers with its first token, so each is sent from a thread of its own); then closed: the engine cancels them."""
    body = {"model": MODEL, "prompt": "Count from one to a thousand: one, two,", "max_tokens": 2000, "temperature": 0,
            "stream": True}
    replies = queue.Queue()
    senders = [threading.Thread(target=lambda: replies.put(requests.post(f"{url}/v1/completions", json=body,
                                                                         stream=True, timeout=120)))
               for _ in range(count)]
    for sender in senders:
        sender.start()
    try:
        yield
    finally:
        for _ in senders:
            reply = replies.get(timeout=120)
            assert reply.status_code == 200, reply.text
            reply.close()


def test_a_second_turn_routed_by_prefix_lands_on_the_replica_that_holds_its_history(default_build, tmp_path):
    """Two replicas of the embedded default on loopback: a conversation's first turn goes to one of them (both empty:
    the queue decides); routed by the events, its second turn goes to the same one, where the prefix cache covers its
    history; sent to the other replica, the same turn finds nothing cached."""
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(start_server(
            default_build / "model_repository", 0, 0, 0, log_path=tmp_path / f"server-{i}.log", openai_port=0,
            kv_events_port=0, kv_events_replay_port=0, kv_events_topic=f"kv@replica-{i}@{MODEL}")) for i in range(2)]
        router = PrefixRouter(replicas)
        conversation = [{"role": "user", "content": SEA}]
        first, nothing = router.pick(conversation)
        answer = chat(replicas[first], conversation)
        conversation += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "And what about the sky above it?"}]
        deadline = time.monotonic() + 30
        while not router.cached_prefixes(first) - {()} and time.monotonic() < deadline:  # the events are on their way
            time.sleep(0.2)
        second, held = router.pick(conversation)
        routed, elsewhere = chat(replicas[second], conversation), chat(replicas[1 - second], conversation)
        seen = gauges_under_load([r.gateway.url for r in replicas], (12, 4))
    assert nothing == 0 and second == first
    usage = routed["usage"]  # all the whole blocks of its history the events promised (74 % of it here)
    assert usage["prompt_tokens_details"]["cached_tokens"] == held >= 0.7 * usage["prompt_tokens"], usage
    assert elsewhere["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    print(f"second turn: {usage['prompt_tokens_details']['cached_tokens']} of {usage['prompt_tokens']} prompt tokens "
          f"cached on the routed replica, 0 on the other")
    # 16 streams over the two, 12 and 4, on 8 batch places each: each replica's own gauges, at every scrape
    assert seen[-1] == [(8, 4), (4, 0)], seen[-5:]  # all in their engines
    assert all(running <= 8 and running + waiting <= sent for scrape in seen
               for (running, waiting), sent in zip(scrape, (12, 4))), seen


def gauges_under_load(urls: list[str], counts: tuple[int, ...], places: int = 8) -> list[list[tuple[float, float]]]:
    """Each replica's (running, waiting) at every scrape while `counts` streams are in flight on them, until each
    reads all its streams in its engine, `places` of them running (the build's batch), or a minute passes; each back
    to (0, 0) once they close."""
    expected = [(min(count, places), count - min(count, places)) for count in counts]
    with contextlib.ExitStack() as stack:
        for url, count in zip(urls, counts):
            stack.enter_context(streams(url, count))
        deadline, seen = time.monotonic() + 60, []
        while time.monotonic() < deadline and seen[-1:] != [expected]:
            seen.append([gauges(url) for url in urls])
            time.sleep(0.1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(any(gauges(url)) for url in urls):
        time.sleep(0.2)
    assert all(gauges(url) == (0, 0) for url in urls)
    return seen


def chat(server, messages: list[dict]) -> dict:
    reply = requests.post(f"{server.gateway.url}/v1/chat/completions",
                          json={"model": MODEL, "messages": messages, "max_tokens": 40, "temperature": 0}, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()
