"""Motor's block keys (services/coordinator/kv/hashing.py): XXH3-64 of each block's token ids as
64-bit signed little-endian integers, seeded with the parent block's key, stored signed; the
same from a prompt's tokens as from an engine's events."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Hashable, Sequence

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_mesh.coordinator.kv.hashing import ROOT, chain
from motor_mesh.coordinator.kv.index import KvIndex
from motor_mesh.coordinator.kv.prompt import Prompt
from motor_mesh.coordinator.kv.wire import BlockHash, Stored

int64 = st.integers(-(2**63), 2**63 - 1)
ids = st.integers(0, 2**32 - 1)  # what tokenizers give (any int64 works: see the contract test)


def signed(key: int) -> int:
    """An unsigned 64-bit key as the index stores it: the same bits, signed."""
    return key - 2**64 if key >= 2**63 else key


def expected_keys(tokens: Sequence[int], block_size: int, parent: int = ROOT) -> list[int]:
    """The contract, computed here on its own: each full block's ids packed as int64 LE,
    XXH3-64 seeded with the parent's key (unsigned), the result as a signed int64."""
    out = []
    h = parent % 2**64
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        h = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}q", *block), seed=h)
        out.append(h - 2**64 if h >= 2**63 else h)
    return out


def test_a_key_is_xxh3_64_of_the_blocks_ids_seeded_with_its_parent() -> None:
    block = list(range(1000, 1016))
    first = xxhash.xxh3_64_intdigest(struct.pack("<16q", *block), seed=ROOT)
    second_block = [2**63 - 1, -1, *range(14)]
    second = xxhash.xxh3_64_intdigest(struct.pack("<16q", *second_block), seed=first)
    keys = chain(block + second_block, 16)
    assert isinstance(keys, array) and keys.typecode == "q"
    assert list(keys) == [signed(first), signed(second)]
    assert signed(first) == (first - 2**64 if first >= 2**63 else first)
    # The parent is a key, signed or not: the same bits seed the same hash.
    for parent in (signed(first), first):
        assert list(chain(second_block, 16, parent)) == [signed(second)]
    assert list(chain(block, 16)) == list(chain(block, 16, ROOT))


@settings(max_examples=300, deadline=None)
@given(st.lists(ids, max_size=80), st.integers(1, 9), int64)
def test_keys_are_the_contracts(tokens: list[int], block_size: int, parent: int) -> None:
    keys = chain(tokens, block_size, parent)
    assert list(keys) == expected_keys(tokens, block_size, parent)
    assert len(keys) == len(tokens) // block_size  # a trailing partial block has no key
    assert all(-(2**63) <= k < 2**63 for k in keys)


@settings(max_examples=200, deadline=None)
@given(st.lists(ids, max_size=60), st.integers(1, 9))
def test_the_same_ids_in_any_sequence_give_the_same_keys(tokens: list[int], block_size: int) -> None:
    expected = list(chain(tokens, block_size))
    small = all(t < 2**31 for t in tokens)
    inputs: list[Sequence[int]] = [tuple(tokens), array("I", tokens), array("q", tokens), array("Q", tokens)]
    if small:
        inputs.append(array("i", tokens))
    for ids in inputs:
        assert list(chain(ids, block_size)) == expected, type(ids)


@settings(max_examples=200, deadline=None)
@given(st.lists(ids, max_size=60), st.integers(1, 6), int64)
def test_a_chain_is_its_blocks_chained_one_by_one(tokens: list[int], block_size: int, parent: int) -> None:
    whole = chain(tokens, block_size, parent)
    keys: list[int] = []
    previous = parent
    for start in range(0, len(tokens) - block_size + 1, block_size):
        (key,) = chain(tokens[start : start + block_size], block_size, previous)
        keys.append(key)
        previous = key
    assert list(whole) == keys


def test_a_trailing_partial_block_has_no_key() -> None:
    tokens = list(range(10))
    assert list(chain(tokens, 4)) == list(chain(tokens[:8], 4))
    assert len(chain(tokens, 4)) == 2
    assert list(chain(tokens[:3], 4)) == [] and list(chain([], 4)) == []


@pytest.mark.parametrize("bad", [-(2**63) - 1, 2**63])
def test_an_id_outside_32_bits_has_no_key(bad: int) -> None:
    with pytest.raises(OverflowError):
        chain([1, 2, bad, 4], 2)
    with pytest.raises(OverflowError):
        chain(array("q", [1, 2, 3, bad]), 2)
    # A prompt with such an id (a client's) has no keys: it is routed by load alone.
    assert list(Prompt([1, 2, bad, 4]).hashes(2)) == []


@pytest.mark.parametrize("block_size", [0, -1])
def test_a_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        chain([1, 2, 3, 4], block_size)


class Keys:
    """A mirror of the index recording the keys it holds per endpoint."""

    def __init__(self) -> None:
        self.held: dict[Hashable, set[int]] = {}

    def update(self, ep: Hashable, changes: dict[int, bool]) -> None:
        held = self.held.setdefault(ep, set())
        for key, hold in changes.items():
            if hold:
                held.add(key)
            else:
                held.discard(key)

    def clear(self, ep: Hashable) -> None:
        self.held.pop(ep, None)

    def block_size(self, ep: Hashable, size: int) -> None:
        pass


@settings(max_examples=100, deadline=None)
@given(st.lists(ids, min_size=1, max_size=48), st.integers(1, 6), st.data())
def test_a_prompts_keys_are_the_indexs_for_an_engine_storing_its_tokens(
    tokens: list[int], block_size: int, data: st.DataObject
) -> None:
    blocks = len(tokens) // block_size
    keys = Keys()
    index = KvIndex(mirror=keys)
    # The engine stores the blocks in events of a few blocks each, each chained to the last
    # block of the one before by the engine's own hash.
    start = 0
    parent: BlockHash | None = None
    while start < blocks:
        n = data.draw(st.integers(1, blocks - start))
        engine_hashes: list[BlockHash] = [f"e{i}".encode() for i in range(start, start + n)]
        ids = tokens[start * block_size : (start + n) * block_size]
        index.apply("a", Stored(engine_hashes, parent, ids, block_size))
        parent, start = engine_hashes[-1], start + n
    assert index.orphans == 0 and index.mismatched == 0
    prompt = Prompt(tokens)
    hashes = prompt.hashes(block_size)
    assert len(hashes) == blocks
    assert keys.held.get("a", set()) == set(hashes)
    assert index.match(hashes) == ({"a": blocks} if blocks else {})
    # The i-th key is the index's key of the engine's i-th block: a prompt diverging after it
    # matches exactly the blocks before.
    for i in range(blocks):
        other = [*tokens[: i * block_size], 2**32 - 1 - tokens[i * block_size], *tokens[i * block_size + 1 :]]
        assert index.match(Prompt(other).hashes(block_size)).get("a", 0) == i


def test_an_engine_event_with_an_id_outside_64_bits_is_skipped() -> None:
    index = KvIndex()
    index.apply("a", Stored([1, 2], None, [1, 2, 3, 2**63], 2))
    index.apply("a", Stored([3], None, [-(2**63) - 1, 0], 2))
    assert index.mismatched == 2 and index.size == 0
    index.apply("a", Stored([4], None, [5, 6], 2))
    assert index.match(chain([5, 6], 2)) == {"a": 1}
