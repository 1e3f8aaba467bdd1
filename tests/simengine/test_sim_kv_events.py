"""KV cache events of `motor engine-sim --kv-events-config`, read off its ZMQ sockets as any vLLM
subscriber reads them: the structs below are vLLM's own (vllm.distributed.kv_events, array-like
encoding), not anything of Motor's."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from motor_mesh.common.tokenizer import Builtin
from tests.poll import wait_until
from tests.ports import reserve
from tests.procs import SimEngine
from tests.vllm_kv_events import DECODE, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from .conftest import metric

pytestmark = pytest.mark.timeout(60)


END_SEQ = (-1).to_bytes(8, "big", signed=True)
WAIT_MS = 10_000  # a bound on one receive, not a pause


def events_config(endpoint: str = "tcp://*:0", replay: str = "tcp://*:0", **more: Any) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            **more,
        }
    )


def post(url: str, body: dict[str, Any] | None = None) -> bytes:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        return bytes(r.read())


def complete(eng: SimEngine, prompt: str) -> None:
    post(eng.v1 + "/completions", {"prompt": prompt, "max_tokens": 1})


def metrics(eng: SimEngine) -> str:
    with urllib.request.urlopen(eng.base + "/metrics", timeout=10) as r:
        return str(r.read().decode())


def recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(WAIT_MS), "nothing received"
    return sock.recv_multipart()


def replay(endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    """Every kept batch from seq ``start`` on, through the end marker."""
    with zmq.Context.instance().socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            empty, seq, payload = recv(dealer)
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), DECODE(payload)))


class Subscriber:
    """A SUB socket on the engine's PUB endpoint, in step: every batch from the next one on."""

    def __init__(self, eng: SimEngine, topic: bytes = b"") -> None:
        fields = eng.listen_fields()
        self.eng, self.topic = eng, topic
        self.replay_endpoint = fields["kv_replay"]
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(fields["kv_events"])
        # A subscription takes a moment to reach the publisher; batches before it are not
        # delivered. Cache resets (AllBlocksCleared) until one arrives, then read up to the last.
        wait_until(self._subscribed, 10, "the subscription to take")
        last = replay(self.replay_endpoint, 0)[-1][0]
        while self.next()[0] < last:
            pass

    def _subscribed(self) -> bool:
        post(self.eng.base + "/reset_prefix_cache")
        return bool(self.sock.poll(0))

    def next(self) -> tuple[int, KVEventBatch]:
        topic, seq, payload = recv(self.sock)
        assert topic == self.topic and len(seq) == 8
        return int.from_bytes(seq, "big"), DECODE(payload)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def subscribe() -> Iterator[Any]:
    subs: list[Subscriber] = []

    def make(eng: SimEngine, topic: bytes = b"") -> Subscriber:
        subs.append(Subscriber(eng, topic))
        return subs[-1]

    yield make
    for s in subs:
        s.close()


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def test_stored_blocks_chain_and_a_repeat_is_a_hit(spawn_engine, subscribe) -> None:
    eng = spawn_engine("--block-size", "4", "--kv-events-config", events_config(topic="kv"))
    sub = subscribe(eng, b"kv")
    prompt = words("w", 10)  # two full blocks of 4
    complete(eng, prompt)
    seq, batch = sub.next()
    assert batch.data_parallel_rank == 0 and batch.ts > 0
    [first] = batch.events
    assert isinstance(first, BlockStored)
    assert len(first.block_hashes) == 2 and first.parent_block_hash is None and first.block_size == 4
    assert first.token_ids == Builtin().encode(prompt)[:8]
    assert (first.lora_id, first.medium, first.lora_name) == (None, "GPU", None)

    hits = metric(metrics(eng), "vllm:prefix_cache_hits_total")
    complete(eng, prompt)  # all cached: no event
    assert metric(metrics(eng), "vllm:prefix_cache_hits_total") == hits + 8
    longer = " ".join([*prompt.split()[:8], "x", "y", "z", "t"])  # the same 2 blocks, then a third
    complete(eng, longer)
    seq2, batch = sub.next()
    assert seq2 == seq + 1  # the repeat published nothing
    [tail] = batch.events
    assert isinstance(tail, BlockStored)
    assert tail.parent_block_hash == first.block_hashes[-1] and len(tail.block_hashes) == 1
    assert tail.token_ids == Builtin().encode("x y z t")
    chat = {"messages": [{"role": "user", "content": words("c", 7)}]}
    post(eng.v1 + "/chat/completions", chat)
    [stored] = sub.next()[1].events
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == Builtin().encode("user: " + words("c", 7))  # the sim's chat text


def test_eviction_publishes_removed_blocks_first(spawn_engine, subscribe) -> None:
    eng = spawn_engine(
        "--block-size", "2", "--num-gpu-blocks-override", "3", "--kv-events-config", events_config()
    )  # fmt: skip
    sub = subscribe(eng)
    complete(eng, words("a", 6))
    [a] = sub.next()[1].events
    complete(eng, words("b", 4))
    removed, stored = sub.next()[1].events
    assert isinstance(removed, BlockRemoved) and isinstance(stored, BlockStored)
    assert removed.block_hashes == [a.block_hashes[2], a.block_hashes[1]] and removed.medium == "GPU"
    assert len(stored.block_hashes) == 2


def test_seqs_replay_and_reset(spawn_engine, subscribe) -> None:
    eng = spawn_engine("--block-size", "2", "--kv-events-config", events_config(buffer_steps=4))
    sub = subscribe(eng)
    seqs = []
    for i in range(6):
        complete(eng, words(f"p{i}-", 2))
        seqs.append(sub.next()[0])
    assert seqs == list(range(seqs[0], seqs[0] + 6))  # one batch per request, numbered in order
    post(eng.base + "/reset_prefix_cache")
    seq, batch = sub.next()
    assert seq == seqs[-1] + 1 and [type(e) for e in batch.events] == [AllBlocksCleared]
    kept = replay(sub.replay_endpoint, 0)  # only the last buffer_steps batches are kept
    assert [s for s, _ in kept] == list(range(seq - 3, seq + 1))
    assert [s for s, _ in replay(sub.replay_endpoint, seq - 1)] == [seq - 1, seq]
    assert replay(sub.replay_endpoint, seq + 1) == []
    # After the reset the same prompt is stored again.
    complete(eng, words("p0-", 2))
    assert isinstance(sub.next()[1].events[0], BlockStored)


def test_seqs_start_at_zero(spawn_engine) -> None:
    eng = spawn_engine("--block-size", "2", "--kv-events-config", events_config())
    for i in range(3):
        complete(eng, words(f"s{i}-", 2))
    batches = replay(eng.listen_fields()["kv_replay"], 0)
    assert [s for s, _ in batches] == [0, 1, 2]
    assert all(isinstance(b.events[0], BlockStored) for _, b in batches)


def test_an_hf_tokenizer_s_ids_are_published(spawn_engine, subscribe, tmp_path) -> None:
    from tokenizers import Tokenizer

    from .test_sim_prefix_cache import wordlevel

    path = wordlevel(tmp_path)
    eng = spawn_engine("--tokenizer", str(path), "--block-size", "2", "--kv-events-config", events_config())
    sub = subscribe(eng)
    prompt = "hello world how are you today"
    complete(eng, prompt)
    [stored] = sub.next()[1].events
    ids = Tokenizer.from_file(str(path)).encode(prompt).ids  # [BOS] and 6 words: 3 full blocks
    assert isinstance(stored, BlockStored) and stored.token_ids == ids[:6] and len(stored.block_hashes) == 3


def test_data_parallel_rank_offsets_both_ports(spawn_engine) -> None:
    ports = reserve([0, 1, 2, 3])
    try:
        pub, rep = ports[0], ports[2]
        config = events_config(f"tcp://*:{pub}", f"tcp://*:{rep}")
        eng = spawn_engine("--data-parallel-rank", "1", "--block-size", "2", "--kv-events-config", config)
        fields = eng.listen_fields()
        assert fields["kv_events"] == f"tcp://127.0.0.1:{pub + 1}"
        assert fields["kv_replay"] == f"tcp://127.0.0.1:{rep + 1}"
        complete(eng, "a b")
        [(seq, batch)] = replay(fields["kv_replay"], 0)
        assert seq == 0 and batch.data_parallel_rank == 1
    finally:
        ports.close()


def test_no_prefix_caching_publishes_nothing(spawn_engine) -> None:
    eng = spawn_engine(
        "--no-enable-prefix-caching", "--block-size", "2", "--kv-events-config", events_config()
    )
    for _ in range(2):
        complete(eng, "a b c d")
    post(eng.base + "/reset_prefix_cache")
    # Events are published before the answer leaves: had there been any, replay would have them.
    assert replay(eng.listen_fields()["kv_replay"], 0) == []
    assert metric(metrics(eng), "vllm:prefix_cache_hits_total") == 0


def test_a_prompt_the_tokenizer_refuses_is_a_400(spawn_engine, tmp_path) -> None:
    import urllib.error

    from .test_sim_prefix_cache import wordlevel

    eng = spawn_engine("--tokenizer", str(wordlevel(tmp_path)))
    body = b'{"model": "motor-sim", "prompt": "hello \\ud800 world", "max_tokens": 2}'
    req = urllib.request.Request(f"{eng.v1}/completions", body, {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["code"] == "invalid_prompt"
