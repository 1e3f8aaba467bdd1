"""KV event batches on the wire: vLLM's encodings decode to the same events, anything else is a
WireError (never another exception), and Motor's block hashes chain like prefixes. Fuzzed with
hypothesis in tests/fuzz/test_kv_wire_fuzz.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from motor_mesh.coordinator.kv import hashing
from motor_mesh.coordinator.kv.wire import Batch, Cleared, Event, Removed, Stored, WireError, decode, encode
from tests.vllm_kv_events import AllBlocksCleared, BlockRemoved, KVEventBatch, vllm_stored

ROOT = Path(__file__).resolve().parents[2]


# Newer vLLM: no array_like (maps tagged with "type"), and more fields after the old ones.
class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class MapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class MapCleared(MapEvent, tag="AllBlocksCleared"):
    pass


TOKENS = list(range(8))
EXPECTED: list[Event] = [
    Stored([11, 12], None, TOKENS, 4, "GPU"),
    Stored([b"\x01" * 32], 12, [9, 9, 9, 9], 4, "GPU"),
    Removed([11], "GPU"),
    Cleared(),
]


def test_decodes_vllms_array_like_batches() -> None:
    batch = KVEventBatch(
        ts=123.5,
        events=[
            vllm_stored([11, 12], None, TOKENS, 4),
            vllm_stored([b"\x01" * 32], 12, [9, 9, 9, 9], 4),
            BlockRemoved([11], "GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )
    assert decode(msgspec.msgpack.encode(batch)) == Batch(123.5, EXPECTED, 2)


def test_decodes_the_map_form_and_ignores_newer_fields() -> None:
    batch = MapBatch(
        ts=7.0,
        events=[
            MapStored([11, 12], None, TOKENS, 4, None, "GPU", None, extra_keys=[None, None], group_idx=0),
            MapStored([b"\x01" * 32], 12, [9, 9, 9, 9], 4, None, "GPU", None),
            MapRemoved([11], "GPU", group_idx=0),
            MapCleared(),
        ],
    )
    raw = msgspec.msgpack.encode(batch)
    assert msgspec.msgpack.decode(raw)["events"][0]["type"] == "BlockStored"
    assert decode(raw) == Batch(7.0, EXPECTED, None)


def test_old_and_new_array_layouts() -> None:
    # The oldest vLLM: no rank, no medium; newer ones: trailing fields Motor does not read.
    old = msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, [1, 2], 2, None], ["BlockRemoved", [5]]]])
    assert decode(old) == Batch(1.0, [Stored([5], None, [1, 2], 2), Removed([5])], None)
    new = msgspec.msgpack.encode(
        [1, [["BlockStored", [5], None, [1, 2], 2, None, "CPU", "lora", [None], 3, "full", None]], 0, "x"]
    )
    assert decode(new) == Batch(1.0, [Stored([5], None, [1, 2], 2, "CPU")], 0)


def test_unknown_events_are_skipped_and_counted() -> None:
    raw = msgspec.msgpack.encode(
        [1.0, [["BlockMoved", 1, 2], {"type": "Future"}, ["AllBlocksCleared"], ["BlockRemoved", [3]]]]
    )
    batch = decode(raw)
    assert batch.events == [Cleared(), Removed([3])]
    assert batch.unknown == 2


def test_encode_writes_what_vllm_writes() -> None:
    batch = Batch(5.0, EXPECTED, 1)
    as_vllm = msgspec.msgpack.Decoder(KVEventBatch).decode(encode(batch))
    assert as_vllm.ts == 5.0 and as_vllm.data_parallel_rank == 1
    assert [type(e).__name__ for e in as_vllm.events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    assert decode(encode(batch)) == batch


@pytest.mark.parametrize(
    "value",
    [
        None,
        1.5,
        "batch",
        [],
        [1.0],
        ["now", []],
        [float("nan"), []],
        [True, []],
        [1.0, {}],
        [1.0, [], "rank"],
        [1.0, [], True],
        {"ts": 1.0},
        {"events": []},
        [1.0, [5]],
        [1.0, [[]]],
        [1.0, [[7, 1]]],
        [1.0, [{"kind": "BlockRemoved"}]],
        [1.0, [{"type": 3}]],
        [1.0, [["BlockStored", [1], None, [1, 2]]]],  # no block_size
        [1.0, [["BlockStored", [1], None, [1, 2], 0]]],
        [1.0, [["BlockStored", [1], None, [1, 2], True]]],
        [1.0, [["BlockStored", [1], None, [1, 2.0], 2]]],
        [1.0, [["BlockStored", [1], None, [1, [2]], 2]]],
        [1.0, [["BlockStored", [1], None, "12", 2]]],
        [1.0, [["BlockStored", [1.5], None, [1, 2], 2]]],
        [1.0, [["BlockStored", ["aGk="], None, [1, 2], 2]]],
        [1.0, [["BlockStored", [1], "p", [1, 2], 2]]],
        [1.0, [["BlockStored", [1], None, [1, 2], 2, None, 5]]],  # medium not a string
        [1.0, [["BlockRemoved"]]],
        [1.0, [["BlockRemoved", 5]]],
        [1.0, [["BlockRemoved", [None]]]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}]],
        [1.0, [{"type": "BlockRemoved"}]],
    ],
)
def test_malformed_batches_raise_wire_error(value: Any) -> None:
    with pytest.raises(WireError):
        decode(msgspec.msgpack.encode(value))


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x92\xcb", b"\x91" * 100_000, b"\xdd\xff\xff\xff\xff"])
def test_broken_msgpack_raises_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode(payload)


# ---- Motor's block hashes ----------------------------------------------------------------------


@given(st.lists(st.integers(0, 2**31), max_size=70), st.lists(st.integers(0, 2**31), max_size=70))
def test_chain_is_prefix_closed(a: list[int], b: list[int]) -> None:
    for size in (1, 4, 16):
        whole = hashing.chain(a + b, size)
        assert whole[: len(hashing.chain(a, size))] == hashing.chain(a, size)
        assert len(whole) == (len(a) + len(b)) // size
        # Continuing from the last full block's hash is the same as hashing the whole.
        head = hashing.chain(a, size)
        full = len(head) * size
        parent = head[-1] if head else hashing.ROOT
        assert head + hashing.chain((a + b)[full:], size, parent) == whole


def test_chain_tells_blocks_and_prefixes_apart() -> None:
    one = hashing.chain([1, 2, 3, 4, 5, 6, 7, 8], 4)
    other = hashing.chain([1, 2, 3, 4, 5, 6, 7, 9], 4)
    assert other[0] == one[0] and other[1] != one[1]
    assert hashing.chain([0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != one[1]  # same block, other prefix
    assert list(hashing.chain([1, 2, 3], 4)) == []
    assert len(set(hashing.chain(list(range(64)), 8))) == 8
    with pytest.raises(ValueError):
        hashing.chain([1], 0)


def test_chain_is_the_same_in_every_process() -> None:
    code = "from motor_mesh.coordinator.kv import hashing; print(hashing.chain(list(range(40)), 16))"
    seen = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        seen.add(out.stdout)
    assert seen == {f"{hashing.chain(list(range(40)), 16)}\n"}
