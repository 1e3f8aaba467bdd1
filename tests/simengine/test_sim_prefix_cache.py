"""The simulated engine's prefix cache: LRU order, deepest-first eviction, capacity, the events
each change makes (in this process), and what a client sees of it (real processes): a cached
prompt is prefilled faster, the usage counts come from the tokenizer in use."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.common.tokenizer import Builtin
from motor_mesh.simengine.cli import parse
from motor_mesh.simengine.config import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS
from motor_mesh.simengine.openai_api import parse_request
from motor_mesh.simengine.prefix_cache import Chain, PrefixCache, make_chain, seed_key
from motor_mesh.simengine.tokens import prompt_ids

from .conftest import metric

pytestmark = pytest.mark.timeout(60)

KEY = seed_key(0)


def chain(*words: str, block_size: int = 2) -> Chain:
    return make_chain(Builtin().encode(" ".join(words)), block_size, KEY, 1 << 20)


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def __call__(self, events: list[Any]) -> None:
        self.batches.append(events)


def cache(capacity: int) -> tuple[PrefixCache, Recorder]:
    rec = Recorder()
    return PrefixCache(capacity, 2, KEY, rec), rec


def test_chains_hash_full_blocks_with_their_parents() -> None:
    a = chain("a", "b", "c", "d", "e")
    assert len(a.hashes) == 2 and a.token_ids == Builtin().encode("a b c d")  # "e": not a full block
    b = chain("a", "b", "c", "d", "x", "y")
    assert b.hashes[:2] == a.hashes and len(set(b.hashes)) == 3
    # A block's hash covers what comes before it: the same tokens after another prefix differ.
    assert chain("x", "y", "c", "d").hashes[1] != a.hashes[1]
    assert all(0 <= h < 1 << 64 for h in b.hashes)
    assert make_chain(Builtin().encode("a b c d"), 2, seed_key(7), 9).hashes != a.hashes
    capped = make_chain(Builtin().encode("a b c d e f"), 2, KEY, 2)
    assert capped.hashes == b.hashes[:2] and len(capped.token_ids) == 4


def test_the_block_hash_is_keyed_blake2b_of_parent_and_tokens() -> None:
    def h(parent: bytes, ids: list[int], seed: int) -> int:
        data = parent + b"".join(i.to_bytes(4, "little") for i in ids)
        key = seed.to_bytes(8, "little")
        return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "little")

    first = h(b"", [7, 8, 9], 5)
    second = h(first.to_bytes(8, "little"), [1, 2, 3], 5)
    assert make_chain([7, 8, 9, 1, 2, 3, 4], 3, seed_key(5), 10).hashes == (first, second)


def test_a_store_publishes_new_blocks_and_a_hit_only_touches() -> None:
    c, rec = cache(16)
    a = chain("a", "b", "c", "d")
    assert c.hit_tokens((a,)) == 0
    c.store((a,))
    assert c.hit_tokens((a,)) == 4
    [[stored]] = rec.batches
    assert (stored.block_hashes, stored.parent_block_hash) == (list(a.hashes), None)
    assert stored.token_ids == a.token_ids and stored.block_size == 2 and stored.medium == "GPU"
    c.store((chain("a", "b", "c", "d"),))  # the same prompt again (another plan): no event
    assert len(rec.batches) == 1
    longer = chain("a", "b", "c", "d", "e", "f")
    assert c.hit_tokens((longer,)) == 4
    c.store((longer,))
    [tail] = rec.batches[1]
    assert tail.block_hashes == [longer.hashes[2]] and tail.parent_block_hash == a.hashes[1]
    assert tail.token_ids == Builtin().encode("e f")


def test_eviction_is_lru_and_deepest_first() -> None:
    c, rec = cache(4)
    a = chain("a1", "a2", "a3", "a4", "a5", "a6")  # 3 blocks
    b = chain("b1", "b2")
    c.store((a,))
    c.store((b,))
    # A chain is touched from its end: its first block is its most recent.
    assert c.order() == [a.hashes[2], a.hashes[1], a.hashes[0], b.hashes[0]]
    d = chain("d1", "d2", "d3", "d4")
    c.store((d,))
    removed, stored = rec.batches[-1]
    assert type(removed).__name__ == "BlockRemoved" and type(stored).__name__ == "BlockStored"
    assert removed.block_hashes == [a.hashes[2], a.hashes[1]]  # the deepest of the oldest first
    assert len(c) == 4 and c.hit_tokens((a,)) == 2
    c.store((a,))  # touching a's first block (and storing again what was evicted) makes b the oldest
    removed, stored = rec.batches[-1]
    assert removed.block_hashes == [b.hashes[0], d.hashes[1]]
    assert stored.block_hashes == list(a.hashes[1:]) and stored.parent_block_hash == a.hashes[0]


def test_capacity_holds_and_a_repeat_sees_what_others_evicted() -> None:
    c, rec = cache(3)
    a = chain("a1", "a2", "a3", "a4", "a5", "a6")
    c.store((a,))
    assert c.hit_tokens((a,)) == 6
    c.store((chain("b1", "b2", "b3", "b4"),))
    assert len(c) == 3 and c.hit_tokens((a,)) == 2  # the repeat is not answered from memory
    xs = [chain(f"x{i}", f"y{i}") for i in range(10)]
    for x in xs:
        c.store((x,))
        assert len(c) == 3
    # Two prompts of one request that do not fit together: in order, each one's changes.
    p, q = chain("p1", "p2", "p3", "p4"), chain("q1", "q2", "q3", "q4")
    c.store((p, q))
    kinds = [type(e).__name__ for e in rec.batches[-1]]
    assert kinds == ["BlockRemoved", "BlockStored", "BlockRemoved", "BlockStored"]
    # q evicts the oldest block left, then p's deeper block (p, stored first, is older than q).
    assert rec.batches[-1][2].block_hashes == [xs[-1].hashes[0], p.hashes[1]]
    assert c.hit_tokens((p, q)) == 2 + 4


def test_clear_publishes_all_blocks_cleared() -> None:
    c, rec = cache(8)
    a = chain("a", "b")
    c.store((a,))
    c.clear()
    assert len(c) == 0 and c.hit_tokens((a,)) == 0
    assert [type(e).__name__ for e in rec.batches[-1]] == ["AllBlocksCleared"]
    quiet = PrefixCache(8, 2, KEY)  # no publisher: the same cache, no events built
    quiet.store((a,))
    assert quiet.hit_tokens((a,)) == 2


def test_prompt_text_is_the_shared_tokenizer_text() -> None:
    chat = parse_request(
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url"}, {"type": "text", "text": "there"}]}]},
        True,
    )  # fmt: skip
    assert chat.prompts == ["system: be brief\nuser: hi there"] and chat.prompt_tokens == [6]
    # Token ids are the prompt as they are (vLLM's), not words.
    ids = parse_request({"prompt": [[1, 2, 3], [4]]}, False)
    assert ids.token_prompts == [[1, 2, 3], [4]] and ids.prompt_tokens == [3, 1]
    assert prompt_ids(Builtin(), ids) == [[1, 2, 3], [4]]


def test_flags() -> None:
    cfg, unknown = parse([])
    assert (cfg.block_size, cfg.num_gpu_blocks, cfg.enable_prefix_caching) == (
        DEFAULT_BLOCK_SIZE,
        DEFAULT_NUM_BLOCKS,
        True,
    )
    assert cfg.tokenizer is None and not cfg.kv_events.enabled and unknown == []
    events = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "buffer_steps": 5}
    cfg, _ = parse(
        ["--block-size", "32", "--num-gpu-blocks-override", "100", "--no-enable-prefix-caching",
         "--tokenizer", "/t", "--kv-events-config", json.dumps(events), "--data-parallel-rank", "2"]
    )  # fmt: skip
    assert (cfg.block_size, cfg.num_gpu_blocks, cfg.enable_prefix_caching, cfg.tokenizer) == (
        32,
        100,
        False,
        "/t",
    )
    assert cfg.kv_events.enabled and cfg.kv_events.publisher == "zmq" and cfg.kv_events.buffer_steps == 5
    assert cfg.data_parallel_rank == 2
    cfg, _ = parse(["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null"}'])
    assert not cfg.kv_events.enabled


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-events-config", "{bad"],
        ["--kv-events-config", "[]"],
        ["--kv-events-config", '{"enable_kv_cache_events": "yes"}'],
        ["--kv-events-config", '{"publisher": "kafka"}'],
        ["--kv-events-config", '{"buffer_steps": -1}'],
        ["--block-size", "0"],
        ["--num-gpu-blocks-override", "0"],
    ],
)
def test_bad_flags_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        answer: dict[str, Any] = json.load(r)
    return answer


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def timed(url: str, body: dict[str, Any]) -> float:
    t0 = time.monotonic()
    post(url, body)
    return time.monotonic() - t0


def test_a_cached_prompt_is_prefilled_faster(spawn_engine) -> None:
    eng = spawn_engine("--prefill-ms-per-token", "4", "--block-size", "16")
    prompt = " ".join(f"w{i}" for i in range(100))  # 6 full blocks: 96 of 100 tokens cached on a repeat
    body = {"prompt": prompt, "max_tokens": 1}
    cold = timed(eng.v1 + "/completions", body)
    warm = timed(eng.v1 + "/completions", body)
    assert warm < cold
    text = get_text(eng.base + "/metrics")
    assert metric(text, "vllm:prefix_cache_queries_total") == 200
    assert metric(text, "vllm:prefix_cache_hits_total") == 96
    # Without the cache every request prefills all of its tokens, and nothing is counted.
    off = spawn_engine("--prefill-ms-per-token", "4", "--no-enable-prefix-caching")
    for _ in range(2):
        post(off.v1 + "/completions", body)
    text = get_text(off.base + "/metrics")
    assert (
        metric(text, "vllm:prefix_cache_queries_total") == metric(text, "vllm:prefix_cache_hits_total") == 0
    )
    assert "prefix_cache=off" in off.output()


def test_builtin_token_counts_are_unchanged(spawn_engine) -> None:
    eng = spawn_engine()
    assert post(eng.v1 + "/completions", {"prompt": "one two  three"})["usage"]["prompt_tokens"] == 3
    assert post(eng.v1 + "/completions", {"prompt": ""})["usage"]["prompt_tokens"] == 1
    chat = post(eng.v1 + "/chat/completions", {"messages": [{"role": "user", "content": "a b"}]})
    assert chat["usage"]["prompt_tokens"] == 3  # "user: a b"


def wordlevel(directory: Path) -> Path:
    """A tokenizer.json (the tokenizers library's WordLevel) that adds a [BOS] with special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = ["[UNK]", "[BOS]", "user", ":", "hello", "world", "how", "are", "you", "today"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    directory.mkdir(exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.mark.parametrize("how", ["flag", "model_dir"])
def test_an_hf_tokenizer_counts_the_prompt_tokens(spawn_engine, tmp_path: Path, how: str) -> None:
    from tokenizers import Tokenizer

    path = wordlevel(tmp_path / "model")
    flags = ["--tokenizer", str(path)] if how == "flag" else ["serve", str(path.parent)]
    eng = spawn_engine(*flags)
    assert f"tokenizer_file={path}" in eng.output()
    tok = Tokenizer.from_file(str(path))
    prompt = "hello world how are you"
    usage = post(eng.v1 + "/completions", {"prompt": prompt})["usage"]
    assert usage["prompt_tokens"] == len(tok.encode(prompt).ids) == 6  # [BOS] and 5 words
    chat = post(eng.v1 + "/chat/completions", {"messages": [{"role": "user", "content": "hello today"}]})
    assert chat["usage"]["prompt_tokens"] == len(
        tok.encode("user: hello today", add_special_tokens=False).ids
    )


def test_a_missing_tokenizer_falls_back_to_the_builtin_one(spawn_engine, tmp_path: Path) -> None:
    eng = spawn_engine("--tokenizer", str(tmp_path / "nope"))
    assert "event=tokenizer_not_found" in eng.output()
    assert post(eng.v1 + "/completions", {"prompt": "a b c"})["usage"]["prompt_tokens"] == 3
