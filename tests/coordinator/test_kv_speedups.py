"""kv_aware's request path in C (services/coordinator/kv/_speedups.c) computes exactly what the
Python it mirrors computes: the simulated engine's chat ids, the chained block hashes, and the
shared tables' lookups and writes. The other KV tests run both (see ``implementations``)."""

from __future__ import annotations

import contextlib
import shutil
import sysconfig
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_mesh.common.tokenizer import BUILTIN_VOCAB, Builtin, sim_chat_text
from motor_mesh.coordinator.kv import speedups
from motor_mesh.coordinator.kv.hashing import ROOT, chain
from motor_mesh.coordinator.kv.prompt import Prompt, Tokens
from motor_mesh.coordinator.kv.shared import MIN_CAPACITY, SharedReader, SharedWriter, Table

IMPLEMENTATIONS = ["c", "python"]


@contextlib.contextmanager
def implementation(name: str) -> Iterator[None]:
    """Run the block with the C speedups ("c") or with the Python references ("python")."""
    if name == "c":
        if speedups.native is None:
            pytest.skip("the C speedups were not built (no C compiler at install)")
        yield
        return
    native, speedups.native = speedups.native, None
    try:
        yield
    finally:
        speedups.native = native


def c() -> Any:
    if speedups.native is None:
        pytest.skip("the C speedups were not built (no C compiler at install)")
    return speedups.native


def test_the_extension_is_built_where_there_is_a_c_compiler() -> None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): Motor runs the Python references")
    assert speedups.native is not None, "pip install did not build services/coordinator/kv/_speedups.c"


# -- chained hashes ------------------------------------------------------------------------------

int64 = st.integers(-(2**63), 2**63 - 1)


@settings(max_examples=300, deadline=None)
@given(st.lists(int64, max_size=80), st.integers(1, 9), int64)
def test_chain_is_pythons_own(ids: list[int], block_size: int, parent: int) -> None:
    assert list(c().chain(array("q", ids), block_size, parent)) == chain(ids, block_size, parent)
    small = [i % 2**31 for i in ids]
    assert list(c().chain(array("i", small), block_size, parent)) == chain(small, block_size, parent)
    # An event's token ids arrive as a list: read in place.
    assert list(c().chain(ids, block_size, parent)) == chain(ids, block_size, parent)


def test_chain_refuses_what_python_refuses() -> None:
    with pytest.raises(ValueError, match="block_size"):
        c().chain(array("q", [1, 2]), 0, 1)
    with pytest.raises(TypeError):
        c().chain(b"\x00\x01", 1, 1)
    with pytest.raises(OverflowError):
        c().chain([1, 2**64], 1, 1)
    with pytest.raises(TypeError):
        c().chain([1, 2.0], 1, 1)
    # Ids beyond 64 bits go to Python's hash, which takes any int.
    assert list(speedups.chain([2**70, 3], 1)) == chain([2**70, 3], 1)


packed_ids = st.lists(st.integers(-(2**63), 2**64 - 1), max_size=40).map(msgspec.msgpack.encode)
packed_other = st.lists(
    st.integers(-9, 9) | st.floats() | st.text(max_size=3) | st.booleans() | st.none(), max_size=5
)


@settings(max_examples=500, deadline=None)
@given(packed_ids | packed_other.map(msgspec.msgpack.encode) | st.binary(max_size=24))
def test_unpacking_ids_reads_what_msgspec_reads(packed: bytes) -> None:
    try:
        expected: list[int] | None = msgspec.msgpack.decode(packed, type=list[int])
    except msgspec.MsgspecError:
        expected = None
    try:
        got: list[int] | None = list(c().unpack_ids(packed))
    except ValueError:
        got = None
    except OverflowError:  # what an array('q') cannot hold
        assert expected is not None and max(expected) > 2**63 - 1
        return
    assert got == expected


def test_unpacking_ids_takes_every_array_header() -> None:
    for n in (0, 15, 16, 65535, 65536):
        ids = [(i * 7919) % 300_000 - 1000 for i in range(n)]
        assert list(c().unpack_ids(msgspec.msgpack.encode(ids))) == ids


# -- the simulated engine's chat ids -------------------------------------------------------------

text = st.text(st.characters(codec=None, exclude_categories=()), max_size=40) | st.lists(
    st.sampled_from(["hello", "wörld", "東京", " ", "\n", "\t", "\u3000", "\x1c", "\u2028", "\x85", "😀"]),
    max_size=20,
).map("".join)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user"]) | text, "content": text | st.none()}
)


def reference(messages: list[dict[str, Any]]) -> list[int]:
    pairs = [(m["role"], m["content"] or "") for m in messages]
    return Builtin().encode(sim_chat_text(pairs), special=False)


CHATS: Any = None  # one cache across examples, as a Coordinator keeps it


def read(chats: Any, messages: list[dict[str, Any]], bs: int) -> tuple[int, list[int]]:
    prompt = chats.prompt(messages, bs)
    return prompt.n, list(prompt.hashes(bs))


@settings(max_examples=400, deadline=None)
@given(st.lists(message, min_size=1, max_size=5), st.sampled_from([1, 2, 3, 16]))
def test_chats_are_the_builtin_tokenizers_ids_and_their_chain(
    messages: list[dict[str, Any]], bs: int
) -> None:
    global CHATS
    CHATS = CHATS or c().Chats(BUILTIN_VOCAB, 64, 1 << 20, ROOT)
    ids = reference(messages)
    assert list(c().chat_ids(messages, BUILTIN_VOCAB)) == ids
    for _ in range(2):  # the second time from the cache
        assert read(CHATS, messages, bs) == (len(ids), chain(ids, bs))
    prompt = CHATS.prompt(messages, bs)
    assert prompt.tokens == ids and list(prompt.ids) == ids
    assert list(prompt.hashes(bs + 1)) == chain(ids, bs + 1)  # another block size: from the ids


def test_a_conversation_is_hashed_from_what_it_shares_with_earlier_ones() -> None:
    chats = c().Chats(BUILTIN_VOCAB, 64, 1 << 20, ROOT)
    system = {"role": "system", "content": "a long shared system prompt " * 10}
    first = [system, {"role": "user", "content": "one two three"}]
    chats.prompt(first, 4)
    assert chats.count == 2  # [system] and [system, question]
    later = [*first, {"role": "assistant", "content": "four five"}, {"role": "user", "content": "six"}]
    ids = reference(later)
    assert read(chats, later, 4) == (len(ids), chain(ids, 4))
    assert chats.count == 4  # two more: the answer's and the question's
    other = [system, {"role": "user", "content": "another conversation"}]
    assert read(chats, other, 4)[1] == chain(reference(other), 4)
    assert chats.count == 5
    assert read(chats, other, 3)[1] == chain(reference(other), 3)  # another block size
    assert chats.count == 7


def test_a_chats_last_message_is_remembered_once_its_prompt_is_released() -> None:
    """The request that sent a question does not need it remembered; its next turn does."""
    chats = c().Chats(BUILTIN_VOCAB, 64, 1 << 20, ROOT)
    system = {"role": "system", "content": "a long shared system prompt " * 10}
    first = [system, {"role": "user", "content": "one two three four five"}]
    prompt = chats.prompt(first, 4)
    assert chats.count == 1  # [system] only, while the request is routed and served
    assert (prompt.n, list(prompt.hashes(4))) == (len(reference(first)), chain(reference(first), 4))
    del prompt
    assert chats.count == 2
    bytes_before = chats.bytes
    later = [*first, {"role": "assistant", "content": "six"}, {"role": "user", "content": "seven"}]
    ids = reference(later)
    assert read(chats, later, 4) == (len(ids), chain(ids, 4))  # from the turn the first one left
    assert chats.count == 4 and chats.bytes > bytes_before
    # What a turn keeps counts what it holds (hashes and the last partial block's ids), not the
    # room its buffer had: the budget of one of them is exactly one chat's worth.
    one = c().Chats(BUILTIN_VOCAB, 8, 1 << 20, ROOT)
    read(one, [{"role": "user", "content": "w " * 21}], 4)  # 22 tokens: 5 blocks and 2 ids
    assert (one.count, one.bytes) == (1, 5 * 8 + 2 * 4)


@pytest.fixture(params=["aes", "portable"])
def key_fold(request: pytest.FixtureRequest) -> Iterator[str]:
    """The chat memo keyed by each fold the extension has (AES where the CPU has it)."""
    before = c()._key_fold()
    try:
        c()._key_fold(request.param)
    except ValueError:
        pytest.skip(f"no {request.param} key fold on this CPU")
    try:
        yield request.param
    finally:
        c()._key_fold(before)


def test_every_byte_of_a_chat_keys_what_the_memo_remembers(key_fold: str) -> None:
    """A key that missed a byte, a length, a text's width or where a role ends would hand one
    chat the blocks remembered for another: each chat below is read after all the others before
    it were remembered, and must still get its own hashes."""
    chats = c().Chats(BUILTIN_VOCAB, 4096, 1 << 24, ROOT)
    base = "".join(chr(97 + i % 26) + (" " if i % 7 == 6 else "") for i in range(300))
    texts = [base[:n] for n in range(0, 300, 3)]  # every length class: tails, blocks, lanes
    texts += [base[:n] + "\x00" for n in (0, 15, 16, 127, 128, 129)]  # not its zero-padded self
    texts += [base[:i] + "#" + base[i + 1 :] for i in range(0, len(base), 5)]  # one byte changed
    texts += ["\u0100", "\x00\x01", "\U00010000", "\x00\x00\x01\x00"]  # same bytes, another width
    chats_read = [[{"role": "system", "content": t}, {"role": "user", "content": "q"}] for t in texts]
    chats_read += [
        [{"role": "ab", "content": "c"}],
        [{"role": "a", "content": "bc"}],
        [{"role": "a", "content": "b"}, {"role": "c", "content": "d"}],
        [{"role": "a", "content": "bc"}, {"role": "", "content": "d"}],
    ]
    for messages in chats_read:
        ids = reference(messages)
        assert read(chats, messages, 4) == (len(ids), chain(ids, 4)), messages
    assert chats.count > len(texts)  # they were remembered, so each read above went by its key


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "not a list",
        [["role", "user"]],
        [{"role": 1, "content": "x"}],
        [{"content": "x"}],
        [{"role": "user", "content": [{"type": "text", "text": "parts are read in Python"}]}],
        [{"role": "user", "content": "fine"}, {"role": "user", "content": 7}],
    ],
)
def test_chats_leave_what_they_do_not_read_to_python(messages: Any) -> None:
    assert c().Chats(BUILTIN_VOCAB, 8, 1 << 20, ROOT).prompt(messages, 16) is None
    assert c().chat_ids(messages, BUILTIN_VOCAB) is None


def test_the_chat_cache_keeps_its_bounds_and_its_answers() -> None:
    chats = c().Chats(BUILTIN_VOCAB, 8, 4096, ROOT)
    system = {"role": "system", "content": "a long shared system prompt " * 40}
    for i in range(200):
        messages = [system, {"role": "user", "content": f"question {i} " * (i % 7)}]
        ids = reference(messages)
        assert read(chats, messages, 2) == (len(ids), chain(ids, 2))
        assert chats.count <= 8 and chats.bytes <= 4096
    huge = [{"role": "user", "content": "word " * 5000}]  # more than the budget: not kept
    before = chats.count
    assert read(chats, huge, 2)[1] == chain(reference(huge), 2)
    assert chats.count <= before and chats.bytes <= 4096


@contextlib.contextmanager
def shared_tables(tmp: Path, impl: str) -> Iterator[tuple[SharedWriter, SharedReader]]:
    """A writer of shared tables and a reader of them made with ``impl`` (a reader takes its
    lookups' implementation as it is made)."""
    writer = SharedWriter(str(tmp), max_blocks_per_endpoint=100)
    writer.open()
    with implementation(impl):
        reader = SharedReader(str(tmp))
    try:
        yield writer, reader
    finally:
        reader.close()
        writer.close()


def installed(reader: SharedReader) -> None:
    changed = reader.read_directory()
    assert changed is not None
    reader.install(*changed, reader.attach(changed[1]))


FORTY_WORDS = [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}]  # 41 tokens


@contextlib.contextmanager
def a_holds_six_blocks(tmp: Path, impl: str) -> Iterator[tuple[SharedReader, list[int]]]:
    """A reader (of ``impl``) of one table, endpoint "a" at block size 4, holding the first 6
    blocks of :data:`FORTY_WORDS`; and that chat's ids."""
    ids = reference(FORTY_WORDS)
    with shared_tables(tmp, impl) as (writer, reader):
        writer.install("a", table := writer.create("a"))
        table.set_block_size(4)
        table.update(dict.fromkeys(chain(ids, 4)[:6], True))
        installed(reader)
        yield reader, ids


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_worker_finds_the_holder_of_a_chats_prefix(tmp_path: Path, impl: str) -> None:
    messages = FORTY_WORDS
    ids = reference(messages)
    with shared_tables(tmp_path, impl) as (writer, reader):
        for name, blocks, size in (("a", 7, 4), ("b", 9, 4), ("c", 20, 2), ("off", 10, 4)):
            writer.install(name, table := writer.create(name))
            table.set_block_size(size)
            for h in chain(ids, size)[:blocks]:
                table.update({h: True})
        installed(reader)
        a, b, c_, off, gone = (Endpoint(n) for n in ("a", "b", "c", "off", "gone"))
        off.down = True
        with implementation(impl):
            chats = Tokens(Builtin(), sim=True)
            chats.block_size = 4
            for prompt in (chats.prompt({"messages": messages}, True), Prompt(ids)):
                assert prompt is not None
                assert reader.holder(prompt, [a, b, off, gone]) == (36, b)
                assert reader.holder(prompt, [a, c_]) == (40, c_)  # at c's own block size
                assert reader.holder(prompt, [off, gone]) == (0, None)
                assert reader.holder(prompt, []) == (0, None)
            short = Prompt(ids[:30])
            assert reader.holder(short, [b]) == (28, b)  # its 7 full blocks


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_placing_a_prompt_writes_the_holders_answer_into_it_and_counts_it(tmp_path: Path, impl: str) -> None:
    with a_holds_six_blocks(tmp_path, impl) as (reader, ids):
        a, b = Endpoint("a"), Endpoint("b")
        tally = array("q", [5, 7])
        with implementation(impl):
            tokens = Tokens(Builtin(), sim=True)
            tokens.block_size = 4
            chat = tokens.prompt({"messages": FORTY_WORDS}, True)
        for prompt in (chat, Prompt(ids)):
            assert prompt is not None
            reader.place(prompt, [b, a], tally)
            assert (prompt.cached, prompt.endpoint) == (24, a) == reader.holder(prompt, [b, a])
            reader.place(prompt, [b], tally)
            assert (prompt.cached, prompt.endpoint) == (0, None)
        assert list(tally) == [5 + 4 * 41, 7 + 2 * 24]
        if impl == "c":
            with pytest.raises(ValueError, match="two 64-bit"):
                reader.place(chat, [a], array("q", [0]))


class Endpoint:
    """What the index reads of an Upstream."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.down = False


class Downs:
    """A table's count of endpoints out of rotation (routes.DownCount)."""

    def __init__(self) -> None:
        self.n = 0


class Instance:
    """What the request path reads of a Target."""

    def __init__(
        self, *endpoints: Endpoint, model: str = "m", role: int = 1, load: int = 0, downs: Downs | None = None
    ) -> None:
        self.model, self.engine_type, self.role = model, 4, role
        self.endpoints = endpoints
        self.load = load
        self.downs = downs or Downs()


class Calls:
    """A Python fallback that records its calls and answers with a marker."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.answer = object()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((*args, *kwargs.values()))
        return self.answer


def test_a_workers_prompt_is_a_chat_read_in_c_and_the_rest_in_python() -> None:
    tokens = Tokens(Builtin(), sim=True)
    rest = Calls()
    prompts = c().Prompts({("m", 4): tokens.chats}, rest)
    messages = [{"role": "system", "content": "be brief " * 20}, {"role": "user", "content": "why"}]
    ids = reference(messages)
    target = Instance()
    for size in (16, 3):  # the block size the Python side keeps, as the engines report it
        tokens.block_size = size
        prompt = prompts({"messages": messages}, True, target)
        assert (prompt.n, list(prompt.hashes(size))) == (len(ids), chain(ids, size))
    assert rest.calls == []
    parts = [{"role": "user", "content": [{"type": "text", "text": "parts are read in Python"}]}]
    other = Instance(model="another")
    for req, chat, t in (
        ({"messages": parts}, True, target),  # a chat C does not read
        ({"prompt": "a completion"}, False, target),
        ({"messages": messages}, True, other),  # no C reader for its model
        (["not", "a", "body"], True, target),
    ):
        assert prompts(req, chat, t) is rest.answer
        assert rest.calls[-1] == (req, chat, t)
    assert len(rest.calls) == 4
    with pytest.raises(TypeError):
        prompts({"messages": messages}, True)
    with pytest.raises(ValueError, match="positive"):
        tokens.block_size = 0
    assert tokens.block_size == tokens.chats.block_size == 3


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_workers_usual_choice_is_made_in_c_and_every_other_one_is_the_policys(
    tmp_path: Path, impl: str
) -> None:
    with a_holds_six_blocks(tmp_path, impl) as (reader, ids):
        tallies = {1: array("q", [0, 0])}
        general = Calls()
        chooser = reader.chooser(tallies, general, 1.0, 1.0)
        if impl == "python":  # the policy's own choose is called directly
            assert chooser is None
            return
        a, b = Endpoint("a"), Endpoint("b")
        lone, busy, idle = Instance(b, a), Instance(a, load=30), Instance(a, load=10)
        prompt = Prompt(ids)
        assert chooser([lone], set(), prompt) is lone
        assert (prompt.cached, prompt.endpoint) == (24, a) == reader.holder(prompt, [b, a])
        assert list(tallies[1]) == [41, 24]
        # Several: the lowest cost (uncached tokens + load), placed and counted the same way.
        prompt = Prompt(ids)
        assert chooser([busy, idle, Instance(b)], set(), prompt) is idle  # b: 41 uncached tokens
        assert (prompt.cached, prompt.endpoint, list(tallies[1])) == (24, a, [82, 48])
        assert chooser([busy, Instance(b)], set(), Prompt(ids)).endpoints == (b,)  # 41 < 17 + 30
        weighed = reader.chooser(tallies, general, 1.0, 0.1)  # load counts a tenth
        assert weighed([busy, Instance(b)], set(), Prompt(ids)) is busy  # 17 + 3 < 41
        # Equal costs: the engines caching fewer blocks, then at random.
        assert chooser([Instance(a, load=24), Instance(b)], set(), Prompt(ids)).endpoints == (b,)  # 41 each
        twins = [Instance(a), Instance(a)]
        assert {id(chooser(twins, (), Prompt(ids))) for _ in range(200)} == {id(t) for t in twins}
        calls, counted = len(general.calls), list(tallies[1])
        down = Downs()
        down.n = 1
        prompt = Prompt(ids)
        for args, kwargs in (
            (([lone, busy], {7}, prompt), {}),  # something excluded
            (([lone], {7}, prompt), {}),
            (([lone, busy], set(), None), {}),  # no prompt: the load policy's choice
            (([Instance(a, role=2)], set(), prompt), {}),  # a role without a tally yet
            (([Instance(a, role=2), Instance(b, role=2)], set(), prompt), {}),
            (([Instance(a, downs=down), Instance(b, downs=down)], set(), prompt), {}),  # the healthy only
            (([Instance(a)] * 65, set(), prompt), {}),  # more candidates than the C takes
            (([lone], set()), {"prompt": prompt}),
            (([], set(), prompt), {}),
        ):
            assert chooser(*args, **kwargs) is general.answer
            assert general.calls[-1] == (*args, *kwargs.values())
        assert len(general.calls) == calls + 9 and calls == 0
        # What the policy decides is its own: nothing was placed or counted on the way to it.
        assert (prompt.cached, prompt.endpoint, list(tallies[1])) == (0, None, counted)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 6), st.data())
def test_a_chats_known_blocks_are_tried_first_and_find_what_bisection_finds(
    tmp_path_factory: pytest.TempPathFactory, turns: int, known: int, data: st.DataObject
) -> None:
    """The C holder tries a chat's blocks the memo knew (its earlier messages) before bisecting:
    whatever leading run a table holds, it finds the same one as the lookup of its bare ids."""
    messages = [
        {"role": "user" if t % 2 == 0 else "assistant", "content": " ".join(f"t{t}w{w}" for w in range(9))}
        for t in range(turns)
    ]
    ids = reference(messages)
    hashes = chain(ids, 4)
    held = data.draw(st.integers(0, len(hashes)))
    tmp = tmp_path_factory.mktemp("tables")
    writer = SharedWriter(str(tmp), max_blocks_per_endpoint=100)
    writer.open()
    reader = SharedReader(str(tmp))
    try:
        writer.install("a", table := writer.create("a"))
        table.set_block_size(4)
        table.update(dict.fromkeys(hashes[:held], True))
        installed(reader)
        chats = c().Chats(BUILTIN_VOCAB, 64, 1 << 20, ROOT)
        if known:  # the memo knows the chat's first messages (all of them when known >= turns)
            chats.prompt(messages[:known], 4)
        prompt = chats.prompt(messages, 4)
        a = Endpoint("a")
        expected = (min(held * 4, len(ids)), a if held else None)
        assert reader.holder(prompt, [a]) == reader.holder(Prompt(ids), [a]) == expected
    finally:
        reader.close()
        writer.close()


# -- the shared tables ---------------------------------------------------------------------------

MASK = MIN_CAPACITY - 1
crowded = st.builds(  # keys on a few home slots, some wrapping around the end of the table
    lambda home, lap, sign: sign * (home + lap * MIN_CAPACITY),
    st.sampled_from([0, 1, 2, MASK - 1, MASK]),
    st.integers(0, 40),
    st.sampled_from([1, -1]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), crowded), max_size=120), st.lists(crowded, min_size=1, max_size=12))
def test_table_writes_and_lookups_are_the_pythons(
    tmp_path_factory: Any, steps: list[Any], probe: list[int]
) -> None:
    where = tmp_path_factory.mktemp("t")
    tables = {name: Table.create(str(Path(where) / name), MIN_CAPACITY) for name in IMPLEMENTATIONS}
    try:
        for add, key in steps:
            for name, table in tables.items():
                with implementation(name):
                    table.update({key: add})
            assert bytes(tables["c"].slots) == bytes(tables["python"].slots)
            assert tables["c"].blocks == tables["python"].blocks
        # An event's changes, in one call.
        changes = {key: not add for add, key in steps[:40]}
        for name, table in tables.items():
            with implementation(name):
                table.update(changes)
        assert bytes(tables["c"].slots) == bytes(tables["python"].slots)
        held = sum(map(tables["python"].has, {k or 1 for _, k in steps}))
        assert tables["c"].blocks == tables["python"].blocks == held
        t = tables["c"]
        # held: the bisection over any prompt, its first hashes held or not.
        for hashes in (probe, [k for _, k in steps if _][:12] + probe):
            expected = speedups.held_run(t.has, hashes) if t.has(hashes[0]) else 0
            assert c().held(t.slots, array("q", hashes)) == expected
    finally:
        for table in tables.values():
            table.close()


# -- the index's per-block work ------------------------------------------------------------------


engine_hash = st.integers(0, 12) | st.binary(min_size=1, max_size=2)
chains = st.lists(st.tuples(engine_hash, st.integers(0, 6)), max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), chains), max_size=12), st.integers(1, 6))
def test_holding_and_releasing_blocks_is_the_pythons(steps: list[Any], bound: int) -> None:
    """The same stores (engine hashes standing for ours, re-stored, re-pointed, past the bound)
    and removals leave the same containers, in the same order, and say the same."""
    states: dict[str, Any] = {}
    for name in IMPLEMENTATIONS:
        with implementation(name):
            ours: OrderedDict[Any, int] = OrderedDict()
            refs: dict[int, int] = {}
            said = []
            for store, pairs in steps:
                changes: dict[int, bool] = {}
                engine = [e for e, _ in pairs]
                if store:
                    said.append(
                        speedups.hold(ours, refs, changes, engine, array("q", [h for _, h in pairs]), bound)
                    )
                else:
                    said.append(speedups.release(ours, refs, changes, engine))
                said.append(changes)
                assert len(ours) <= bound and sum(refs.values()) == len(ours)
            states[name] = (list(ours.items()), refs, said)
    assert states["c"] == states["python"]
