"""The KV index: what each endpoint holds, under Motor's hashes, as its events tell it."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_mesh.coordinator.kv.blocks import held, held_run, hold, release
from motor_mesh.coordinator.kv.hashing import chain
from motor_mesh.coordinator.kv.index import KvIndex
from motor_mesh.coordinator.kv.wire import BlockHash, Cleared, Event, Removed, Stored

BS = 4
PROMPT = list(range(100, 124))  # six blocks
OURS = chain(PROMPT, BS)


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


# ---- the per-block work (services/coordinator/kv/blocks.py) -------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), st.sets(st.integers(0, 80), max_size=20))
def test_held_finds_a_leading_run_by_bisection(length: int, run: int, others: set[int]) -> None:
    hashes = list(range(length))
    run = min(run, length)
    # A leading run, then blocks held past a gap (a hole no engine makes).
    holding = set(range(run)) | {h for h in others if h > run}
    n = held(holding.__contains__, hashes)
    if run == 0:
        assert n == 0
        return
    assert n == held_run(holding.__contains__, hashes)
    # The end of one of the held runs: held up to it, not held right after.
    assert 1 <= n <= length and hashes[n - 1] in holding
    assert n == length or hashes[n] not in holding
    if not others:
        assert n == run
    assert held(holding.__contains__, []) == 0


engine_hash = st.integers(0, 12) | st.binary(min_size=1, max_size=2)
chains = st.lists(st.tuples(engine_hash, st.integers(0, 6)), max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), chains), max_size=12), st.integers(1, 6))
def test_holding_and_releasing_blocks_keeps_the_books(steps: list[Any], bound: int) -> None:
    """Stores (engine hashes standing for ours, re-stored, re-pointed, past the bound) and
    removals leave what a plain model of them leaves, and say what changed."""
    ours: OrderedDict[Any, int] = OrderedDict()
    refs: dict[int, int] = {}
    model: OrderedDict[Any, int] = OrderedDict()  # engine hash -> ours, oldest stored first
    for store, pairs in steps:
        before = set(refs)
        changes: dict[int, bool] = {}
        engine = [e for e, _ in pairs]
        if store:
            size, evicted = hold(ours, refs, changes, engine, array("q", [h for _, h in pairs]), bound)
            expected_evicted = 0
            for e, h in pairs:
                if e in model:
                    model.move_to_end(e)
                model[e] = h
                if len(model) > bound:
                    model.popitem(last=False)
                    expected_evicted += 1
            assert evicted == expected_evicted
        else:
            size = release(ours, refs, changes, engine)
            for e in engine:
                model.pop(e, None)
        assert list(ours.items()) == list(model.items())
        assert refs == Counter(model.values())
        assert len(ours) <= bound and sum(refs.values()) == len(ours)
        after = set(refs)
        assert size == len(after) - len(before)
        # Every hash held or let go is said, and what is said is how it ends.
        assert before ^ after <= set(changes)
        assert all(changes[h] == (h in after) for h in changes)


def test_a_block_re_pointed_by_its_engine_hash_moves_its_reference() -> None:
    ours: OrderedDict[Any, int] = OrderedDict()
    refs: dict[int, int] = {}
    changes: dict[int, bool] = {}
    assert hold(ours, refs, changes, [1, 2], array("q", [10, 10]), 8) == (1, 0)
    assert (refs, changes) == ({10: 2}, {10: True})
    changes = {}
    assert hold(ours, refs, changes, [1], array("q", [11]), 8) == (1, 0)  # 1 now stands for 11
    assert (refs, changes) == ({10: 1, 11: 1}, {11: True})
    changes = {}
    assert hold(ours, refs, changes, [3], array("q", [12]), 2) == (0, 1)  # past the bound: 2 goes
    assert list(ours) == [1, 3] and refs == {11: 1, 12: 1} and changes == {10: False, 12: True}
    changes = {}
    assert release(ours, refs, changes, [3, 3, 99]) == -1  # unknown ones are skipped
    assert (list(ours), refs, changes) == ([1], {11: 1}, {12: False})
