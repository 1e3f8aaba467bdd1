"""The KV index: what each endpoint holds, under Motor's hashes, as its events tell it."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_mesh.coordinator.kv.hashing import chain
from motor_mesh.coordinator.kv.index import KvIndex
from motor_mesh.coordinator.kv.wire import BlockHash, Cleared, Event, Removed, Stored
from tests.coordinator.test_kv_speedups import IMPLEMENTATIONS, implementation

BS = 4
PROMPT = list(range(100, 124))  # six blocks
OURS = chain(PROMPT, BS)


@pytest.fixture(autouse=True, params=IMPLEMENTATIONS)
def impl(request: pytest.FixtureRequest) -> Any:
    """Every test twice: the per-block work in C, and in the Python it mirrors."""
    with implementation(request.param):
        yield request.param


def stored(hashes: list[BlockHash], parent: BlockHash | None, tokens: list[int], size: int = BS) -> Stored:
    return Stored(hashes, parent, tokens, size)


def test_a_stored_chain_is_matched_by_its_prompt() -> None:
    index = KvIndex()
    index.apply("a", stored([1, 2], None, PROMPT[:8]))
    index.apply("a", stored([3], 2, PROMPT[8:12]))  # continues the chain from its parent
    assert index.blocks("a") == frozenset(OURS[:3])
    assert index.match(OURS) == {"a": 3}
    assert index.match(OURS[:2]) == {"a": 2}
    assert index.match(chain([7, *PROMPT[1:]], BS)) == {}  # another first block: nothing
    assert index.block_size("a") == BS and index.block_size("b") is None
    assert index.size == 3 and index.endpoint_blocks("a") == 3


def test_match_counts_leading_blocks_per_endpoint() -> None:
    index = KvIndex()
    index.apply("a", stored([1, 2, 3, 4, 5, 6], None, PROMPT))
    index.apply("b", stored([1], None, PROMPT[:4]))
    index.apply("c", stored([7, 8], None, PROMPT[:8]))
    index.apply("c", Removed([7]))  # holds block 2 but not block 1: no prefix of the prompt
    index.apply("d", stored([9], None, [0, 0, 0, 0]))
    assert index.match(OURS) == {"a": 6, "b": 1}
    assert index.match(OURS, ["b", "c", "d", "nobody"]) == {"b": 1}
    assert index.match(OURS, []) == {}
    assert index.match([]) == {}
    index.apply("a", Removed([6, 5]))  # an engine evicts a chain from its end
    assert index.match(OURS)["a"] == 4
    # A hole no engine makes (a block gone, its children kept): the match, a bisection, ends at
    # the end of one of the held runs.
    index.apply("a", Removed([2]))
    assert index.match(OURS)["a"] in (1, 4)


def test_removed_and_cleared() -> None:
    index = KvIndex()
    index.apply("a", stored([1, 2], None, PROMPT[:8]))
    index.apply("b", stored([1, 2], None, PROMPT[:8]))
    index.apply("a", Removed([2, 99]))  # an unknown hash is ignored
    assert index.blocks("a") == frozenset(OURS[:1])
    index.apply("zzz", Removed([1]))
    index.apply("a", Cleared())
    assert index.blocks("a") == frozenset() and index.endpoint_blocks("a") == 0
    assert index.block_size("a") == BS  # the endpoint and its block size stay known
    assert index.size == 2 and index.match(OURS) == {"b": 2}
    index.drop("b")
    assert index.size == 0 and index.match(OURS) == {} and index.block_size("b") is None
    assert index.endpoints() == ["a"]


def test_a_chain_whose_parent_is_unknown_is_skipped() -> None:
    index = KvIndex()
    index.apply("a", stored([5], 4, PROMPT[4:8]))  # block 4 was stored before the index began
    assert index.orphans == 1 and index.size == 0
    index.apply("a", stored([4], None, PROMPT[:4]))
    index.apply("a", stored([5], 4, PROMPT[4:8]))
    assert index.match(OURS) == {"a": 2} and index.orphans == 1


def test_a_stored_event_whose_tokens_do_not_fill_its_blocks_is_skipped() -> None:
    index = KvIndex()
    index.apply("a", stored([1, 2], None, PROMPT[:6]))
    index.apply("a", stored([1], None, []))  # e.g. an offload store that carries no tokens
    assert index.mismatched == 2 and index.size == 0


def test_one_block_under_several_engine_hashes_is_counted() -> None:
    index = KvIndex()
    index.apply("a", stored([1], None, PROMPT[:4]))
    index.apply("a", stored([b"salted"], None, PROMPT[:4]))  # same tokens, another cache salt
    index.apply("a", stored([1], None, PROMPT[:4]))  # stored again: still one reference
    assert index.size == 1
    index.apply("a", Removed([1]))
    assert index.match(OURS) == {"a": 1}  # still held under the other engine hash
    index.apply("a", Removed([1]))
    assert index.match(OURS) == {"a": 1}
    index.apply("a", Removed([b"salted"]))
    assert index.match(OURS) == {} and index.size == 0


def test_memory_is_bounded_oldest_first() -> None:
    index = KvIndex(max_blocks_per_endpoint=4)
    index.apply("a", stored([1, 2, 3], None, PROMPT[:12]))
    index.apply("b", stored([1, 2, 3], None, PROMPT[:12]))
    index.apply("a", stored([4, 5, 6], 3, PROMPT[12:24]))
    assert index.evicted_by_bound == 2 and index.endpoint_blocks("a") == 4
    assert index.blocks("a") == frozenset(OURS[2:])
    assert index.match(OURS) == {"b": 3}  # a lost the prompt's first blocks
    # What a chain still needs is its newest block: a continuation from it is placed.
    index.apply("a", stored([7], 6, [1, 2, 3, 4]))
    assert index.orphans == 0 and index.endpoint_blocks("a") == 4 and index.size == 7
    with pytest.raises(ValueError):
        KvIndex(0)


# ---- against a model engine --------------------------------------------------------------------


class Engine:
    """A prefix cache as an engine keeps it, and the events it publishes: engine hashes are
    salted digests, and a stored chain's parent is always a block the engine holds."""

    def __init__(self) -> None:
        self.held: dict[bytes, list[int]] = {}  # engine hash -> the tokens up to its block's end

    def request(self, tokens: list[int], salt: int) -> list[Event]:
        parent: bytes | None = None
        new: list[bytes] = []
        first = 0
        for end in range(BS, len(tokens) + 1, BS):
            h = hashlib.sha256(repr((parent, tokens[end - BS : end], salt)).encode()).digest()
            if h not in self.held and not new:
                first = end - BS
                new_parent = parent
            if h not in self.held or new:
                new.append(h)
                self.held[h] = tokens[:end]
            parent = h
        if not new:
            return []
        return [Stored(list(new), new_parent, tokens[first : first + BS * len(new)], BS)]

    def evict(self, pick: int) -> list[Event]:
        # A block no other block continues: engines evict a chain from its end (vLLM frees a
        # request's blocks last first; a prefix hit refreshes every block before it).
        leaves = [
            h
            for h, tokens in self.held.items()
            if not any(len(t) == len(tokens) + BS and t[: len(tokens)] == tokens for t in self.held.values())
        ]
        if not leaves:
            return []
        victim = sorted(leaves)[pick % len(leaves)]
        del self.held[victim]
        return [Removed([victim])]

    def clear(self) -> list[Event]:
        self.held.clear()
        return [Cleared()]

    def ours(self) -> frozenset[int]:
        return frozenset(chain(tokens, BS)[-1] for tokens in self.held.values())


# Prompts made of a few blocks (and a partial one) share prefixes often.
BLOCKS = [[0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 1]]
prompts = st.tuples(
    st.lists(st.sampled_from(BLOCKS), max_size=4), st.lists(st.integers(0, 1), max_size=3)
).map(lambda p: [t for block in p[0] for t in block] + p[1])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("request"), prompts, st.integers(0, 1)),
        st.tuples(st.just("evict"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("clear"), st.just(0), st.just(0)),
    ),
    max_size=30,
)


def run(engine: Engine, op: tuple[str, Any, int]) -> list[Event]:
    kind, arg, salt = op
    if kind == "request":
        return engine.request(arg, salt)
    return engine.evict(arg) if kind == "evict" else engine.clear()


@settings(max_examples=300, deadline=None)
@given(ops)
def test_the_index_follows_an_engine(operations: list[tuple[str, Any, int]]) -> None:
    engine = Engine()
    stream: list[Event] = []
    index = KvIndex()
    for op in operations:
        events = run(engine, op)
        stream += events
        index.apply_all("e", events)
        assert index.blocks("e") == engine.ours()
    assert index.orphans == 0 and index.mismatched == 0
    # Rebuilt after a reset from the same stream (a replay), the index is the same one.
    again = KvIndex()
    again.apply_all("e", stream[: len(stream) // 2])
    again.apply("e", Cleared())
    again.apply_all("e", stream)
    assert again.blocks("e") == index.blocks("e") and again.size == index.size
    for tokens in ([0, 0, 0, 0, 1, 1, 1, 1], [1] * 12, [0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1]):
        hashes = chain(tokens, BS)
        expected = 0
        while expected < len(hashes) and hashes[expected] in engine.ours():
            expected += 1
        assert index.match(hashes).get("e", 0) == expected
