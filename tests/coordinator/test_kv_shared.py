"""The KV index the management process shares with its inference workers: what a worker reads
from the mapped files is what the writer's index holds."""

from __future__ import annotations

import os
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_mesh.common.tokenizer import Builtin, sim_chat_text
from motor_mesh.coordinator.kv.hashing import chain
from motor_mesh.coordinator.kv.index import KvIndex
from motor_mesh.coordinator.kv.prompt import Prompt, Tokens
from motor_mesh.coordinator.kv.shared import (
    MIN_CAPACITY,
    SharedReader,
    SharedWriter,
    Table,
    capacity_for,
    room,
)
from motor_mesh.coordinator.kv.wire import Cleared
from tests.coordinator.test_kv_index import BS, Engine, ops, run


def follow(reader: SharedReader) -> bool:
    """What a worker's refresh does; whether the directory had changed."""
    changed = reader.read_directory()
    if changed is None:
        return False
    gen, names = changed
    reader.install(gen, names, reader.attach(names))
    return True


@pytest.fixture
def shared(tmp_path: Path) -> Any:
    writer = SharedWriter(str(tmp_path), max_blocks_per_endpoint=100)
    writer.open()
    reader = SharedReader(str(tmp_path))
    yield writer, reader
    reader.close()
    writer.close()


# -- one table ---------------------------------------------------------------------------------

MASK = MIN_CAPACITY - 1
# Keys crowded on a few home slots, some at the end of the table: long runs that wrap around,
# where deleting must shift later entries back.
keys = st.builds(
    lambda home, lap, sign: sign * (home + lap * MIN_CAPACITY),
    st.sampled_from([0, 1, 2, MASK - 1, MASK]),
    st.integers(0, 40),
    st.sampled_from([1, -1]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), keys), max_size=120))
def test_a_table_is_the_set_its_adds_and_removes_make(tmp_path_factory: Any, steps: list[Any]) -> None:
    path = tmp_path_factory.mktemp("t") / "table"
    table = Table.create(str(path), MIN_CAPACITY)
    reader = Table.attach(str(path))
    try:
        model: set[int] = set()  # 0 is stored as 1 (0 marks an empty slot): one key
        for add, key in steps:
            if add:
                table.update({key: True})
                model.add(key or 1)
            else:
                table.update({key: False})
                model.discard(key or 1)
            assert reader.blocks == len(model)
        every = {k for _, k in steps} | {7, -7, MIN_CAPACITY * 99}
        assert {k or 1 for k in every if reader.has(k)} == model
    finally:
        reader.close()
        table.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), keys), max_size=120))
def test_an_events_changes_in_one_update_are_its_changes_one_by_one(
    tmp_path_factory: Any, steps: list[Any]
) -> None:
    """A batch of changes (a churning engine's event changes a hundred blocks) leaves the table
    as the same changes made one at a time do, slot for slot."""
    where = tmp_path_factory.mktemp("t")
    one, each = (Table.create(str(where / name), MIN_CAPACITY) for name in ("one", "each"))
    try:
        for add, key in steps[:60]:  # some already held before the batch
            one.update({key: add})
            each.update({key: add})
        batch: dict[int, bool] = {}
        for add, key in steps[60:]:
            batch[key] = add
        one.update(batch)
        for key, add in batch.items():
            each.update({key: add})
        assert bytes(one.slots) == bytes(each.slots) and one.blocks == each.blocks
        assert {k for _, k in steps if one.has(k)} == {k for _, k in steps if each.has(k)}
    finally:
        one.close()
        each.close()


def test_zero_is_a_key_like_any_other(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), MIN_CAPACITY)
    try:
        assert not table.has(0)
        table.update({0: True})  # 0 marks an empty slot: the key is stored as 1, so 1 and 0 are one key
        assert table.has(0) and table.blocks == 1
        table.update({0: False})
        assert not table.has(0) and table.blocks == 0
    finally:
        table.close()


def test_emptying_a_table(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), 1 << 20)  # 8 MiB: the zeros take several writes
    try:
        keys = [k * 7919 for k in range(1, 2000)] + [(1 << 20) - 1]  # the last slot too
        for k in keys:
            table.update({k: True})
        table.set_block_size(16)
        table.clear()
        assert not any(table.has(k) for k in keys) and table.blocks == 0
        assert table.block_size == 16  # the header stays
        table.update({keys[0]: True})
        assert table.has(keys[0]) and table.blocks == 1
    finally:
        table.close()


def test_a_table_gets_its_room_when_created_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "t"
    Table.create(str(path), MIN_CAPACITY).close()
    assert os.stat(path).st_blocks * 512 >= MIN_CAPACITY * 8  # allocated, not sparse
    with pytest.raises(OSError):  # more than any file system here has room for
        Table.create(str(tmp_path / "huge"), 1 << 58)
    assert not (tmp_path / "huge").exists()


def test_the_files_go_at_close(tmp_path: Path) -> None:
    writer = SharedWriter(str(tmp_path), 100)
    writer.open()
    writer.install("a", writer.create("a"))
    assert sorted(os.listdir(writer.dir)) == ["endpoints", "ep-1"]
    writer.close()
    assert not os.path.exists(writer.dir)


def test_a_table_is_never_full(tmp_path: Path) -> None:
    table = Table.create(str(tmp_path / "t"), MIN_CAPACITY)
    try:
        table.update(dict.fromkeys(range(1, MIN_CAPACITY + 1), True))
        assert table.blocks == room(MIN_CAPACITY) < MIN_CAPACITY
        assert not table.has(-5)  # a probe still meets an empty slot
        held = [k for k in range(1, MIN_CAPACITY + 1) if table.has(k)]
        assert len(held) == table.blocks
        table.update({held[0]: False})
        table.update({MIN_CAPACITY + 7: True})  # room again
        assert table.has(MIN_CAPACITY + 7) and table.blocks == room(MIN_CAPACITY)
    finally:
        table.close()


def test_capacity_keeps_a_table_at_most_half_full() -> None:
    assert capacity_for(1) == MIN_CAPACITY
    assert capacity_for(262144) == 1 << 19
    assert capacity_for(262145) == 1 << 20


# -- the index, mirrored ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(ops)
def test_a_worker_reads_what_the_index_holds(tmp_path_factory: Any, operations: list[Any]) -> None:
    writer = SharedWriter(str(tmp_path_factory.mktemp("kv")), max_blocks_per_endpoint=8)
    writer.open()
    reader = SharedReader(writer.dir.rsplit("/", 1)[0])
    try:
        index = KvIndex(8, writer)  # a small bound: its evictions must reach the mirror too
        writer.install("e", writer.create("e"))
        assert follow(reader)
        engine = Engine()
        for op in operations:
            index.apply_all("e", run(engine, op))
            for tokens in (
                [0, 0, 0, 0, 1, 1, 1, 1],
                [1] * 12,
                [0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1],
                [0] * 16,
            ):
                hashes = chain(tokens, BS)
                assert reader.match(hashes) == index.match(hashes)
            assert reader.endpoint_blocks("e") == index.endpoint_blocks("e")
            assert reader.block_size("e") == index.block_size("e")
    finally:
        reader.close()
        writer.close()


def test_workers_follow_endpoints_joining_restarting_and_leaving(shared: Any) -> None:
    writer, reader = shared
    index = KvIndex(100, writer)
    hashes = chain(list(range(12)), BS)
    assert follow(reader) and reader.endpoints() == []
    assert not follow(reader)  # nothing changed since

    writer.install("a", writer.create("a"))
    writer.install("b", writer.create("b"))
    index.apply_all("a", Engine().request(list(range(12)), 0))
    index.apply_all("b", Engine().request(list(range(8)), 0))
    assert follow(reader)
    assert reader.match(hashes) == {"a": 3, "b": 2}
    assert reader.match(hashes, ["b", "nobody"]) == {"b": 2}
    assert (reader.block_size("a"), reader.endpoint_blocks("a")) == (BS, 3)
    # Events keep flowing into the mapped tables: no directory change needed to see them.
    index.apply("a", Cleared())
    assert not follow(reader) and reader.match(hashes) == {"b": 2}

    # "b" restarts (a new table replaces its old one) and "a" leaves: a worker still mapping
    # an old table sees it empty, and the next refresh maps the new one.
    index.drop("b")
    old = writer.install("b", writer.create("b"))
    assert old is not None
    SharedWriter.unlink(old)
    left = writer.uninstall("a")
    assert left is not None
    SharedWriter.unlink(left)
    assert reader.match(hashes) == {}
    index.apply_all("b", Engine().request(list(range(4)), 0))
    assert follow(reader)
    assert reader.endpoints() == ["b"] and reader.match(hashes) == {"b": 1}
    assert reader.endpoint_blocks("a") == 0 and reader.block_size("a") is None


def test_a_crowded_table_is_replaced_by_a_bigger_one_holding_the_same(tmp_path: Path) -> None:
    writer = SharedWriter(str(tmp_path), max_blocks_per_endpoint=5000)
    writer.open()
    reader = SharedReader(str(tmp_path))
    try:
        index = KvIndex(5000, writer)
        writer.install("e", writer.create("e"))
        first = writer.table("e")
        assert first is not None and first.capacity == MIN_CAPACITY
        engine = Engine()
        tokens = list(range(600 * BS))
        index.apply_all("e", engine.request(tokens, 0))
        assert writer.crowded == {"e"}  # 600 blocks in 1,024 slots
        assert follow(reader)
        hashes = chain(tokens, BS)
        assert reader.match(hashes) == {"e": 600}

        bigger = writer.create("e", writer.grown(index.endpoint_blocks("e")))
        old = writer.replace("e", bigger, index.blocks("e"))
        assert old is first and writer.table("e") is bigger and not writer.crowded
        assert bigger.capacity == capacity_for(1200) and bigger.block_size == BS
        # A worker still mapping the old table reads it as it was, then follows the directory.
        assert reader.match(hashes) == {"e": 600}
        SharedWriter.unlink(old)
        assert follow(reader)
        assert reader.match(hashes) == {"e": 600} and reader.endpoint_blocks("e") == 600
        assert sorted(os.listdir(writer.dir)) == ["endpoints", "ep-2"]
        # The events now reach the new table.
        more = tokens + list(range(10**6, 10**6 + 8))
        index.apply_all("e", engine.request(more, 0))
        assert reader.match(chain(more, BS)) == {"e": 602}
        # The largest table the bound needs is not replaced again.
        assert writer.grown(5000) == writer.max_capacity == capacity_for(5000)
    finally:
        reader.close()
        writer.close()


def test_a_table_dropped_before_a_worker_maps_it_is_skipped(shared: Any) -> None:
    writer, reader = shared
    table = writer.create("a")
    writer.install("a", table)
    changed = reader.read_directory()
    assert changed is not None
    gone = writer.uninstall("a")
    assert gone is not None
    SharedWriter.unlink(gone)
    gen, names = changed
    reader.install(gen, names, reader.attach(names))  # the file is gone: no table, no error
    assert reader.endpoints() == []
    assert follow(reader) and reader.endpoints() == []


def test_before_the_management_process_shares_anything_a_worker_sees_no_index(tmp_path: Path) -> None:
    reader = SharedReader(str(tmp_path))
    try:
        assert reader.read_directory() is None
        assert reader.match(chain(list(range(8)), BS)) == {} and reader.block_size("a") is None
    finally:
        reader.close()


# -- a request's lookup ------------------------------------------------------------------------


class Endpoint:
    """What the index reads of an Upstream."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.down = False


def sim_ids(messages: list[dict[str, Any]]) -> list[int]:
    """The simulated engine's ids of a chat, with its built-in tokenizer."""
    return Builtin().encode(sim_chat_text([(m["role"], m["content"]) for m in messages]), special=False)


FORTY_WORDS = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}]  # 41 tokens


def test_a_worker_finds_the_holder_of_a_chats_prefix(shared: Any) -> None:
    writer, reader = shared
    ids = sim_ids(FORTY_WORDS)
    assert len(ids) == 41
    for name, blocks, size in (("a", 7, 4), ("b", 9, 4), ("c", 20, 2), ("off", 10, 4)):
        writer.install(name, table := writer.create(name))
        table.set_block_size(size)
        for h in chain(ids, size)[:blocks]:
            table.update({h: True})
    assert follow(reader)
    a, b, c, off, gone = (Endpoint(n) for n in ("a", "b", "c", "off", "gone"))
    off.down = True
    read = Tokens(Builtin(), sim=True).read({"messages": FORTY_WORDS}, True)
    for prompt in (read, Prompt(ids)):
        assert prompt is not None and prompt.tokens == ids
        assert reader.holder(prompt, [a, b, off, gone]) == (36, b)
        assert reader.holder(prompt, [a, c]) == (40, c)  # at c's own block size
        assert reader.holder(prompt, [off, gone]) == (0, None)
        assert reader.holder(prompt, []) == (0, None)
    assert reader.holder(Prompt(ids[:30]), [b]) == (28, b)  # its 7 full blocks
    assert reader.holder(Prompt(ids[:3]), [a, b, c]) == (2, c)  # no block of 4: c's block of 2


def test_placing_a_prompt_writes_the_holders_answer_into_it_and_counts_it(shared: Any) -> None:
    writer, reader = shared
    ids = sim_ids(FORTY_WORDS)
    writer.install("a", table := writer.create("a"))
    table.set_block_size(4)
    table.update(dict.fromkeys(chain(ids, 4)[:6], True))
    assert follow(reader)
    a, b = Endpoint("a"), Endpoint("b")
    tally = array("q", [5, 7])
    chat = Tokens(Builtin(), sim=True).read({"messages": FORTY_WORDS}, True)
    for prompt in (chat, Prompt(ids)):
        assert prompt is not None
        reader.place(prompt, [b, a], tally)
        assert (prompt.cached, prompt.endpoint) == (24, a) == reader.holder(prompt, [b, a])
        reader.place(prompt, [b], tally)
        assert (prompt.cached, prompt.endpoint) == (0, None)
    assert list(tally) == [5 + 4 * 41, 7 + 2 * 24]
